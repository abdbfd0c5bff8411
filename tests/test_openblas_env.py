"""OpenBLAS's settings: which CPUs get which kernels, threads that sleep, the user's choice wins."""

from __future__ import annotations

import os
import subprocess
import sys

from actors.compute.openblas_env import CPUINFO, THREAD_TIMEOUT, kernel_family_for

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw

processor\t: 1
vendor_id\t: AuthenticAMD
"""
ZEN3 = ZEN4.replace(" avx512f avx512bw", "")
SKYLAKE_X = ZEN4.replace("AuthenticAMD", "GenuineIntel")


def test_amd_with_avx512_gets_the_zen_kernels() -> None:
    assert kernel_family_for(ZEN4.splitlines()) == "Zen"


def test_other_cpus_keep_openblas_own_choice() -> None:
    assert kernel_family_for(ZEN3.splitlines()) is None
    assert kernel_family_for(SKYLAKE_X.splitlines()) is None
    assert kernel_family_for([]) is None


def _setting_after_import(env: dict[str, str], first_import: str,
                          name: str = "OPENBLAS_CORETYPE") -> str:
    code = f"import {first_import}, actors, os; print(os.environ.get({name!r}))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True)
    return done.stdout.strip()


def test_importing_actors_first_sets_the_family_for_this_cpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    expected = kernel_family_for(CPUINFO.read_text().splitlines()) if CPUINFO.exists() else None
    assert _setting_after_import(env, "sys") == str(expected)


def test_users_choice_and_an_already_loaded_numpy_are_left_alone() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    assert _setting_after_import({**env, "OPENBLAS_CORETYPE": "Haswell"}, "sys") == "Haswell"
    assert _setting_after_import(env, "numpy") == "None"


def test_openblas_threads_sleep_after_a_product_unless_the_user_says() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    name = "OPENBLAS_THREAD_TIMEOUT"
    assert _setting_after_import(env, "sys", name) == THREAD_TIMEOUT
    assert _setting_after_import({**env, name: "20"}, "sys", name) == "20"
    assert _setting_after_import(env, "numpy", name) == "None"
