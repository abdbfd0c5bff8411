"""Every cuda_src/*.cu compiles with nvcc to sm_80 and sm_90 cubins, warnings as errors, with
no register spills and no local memory (ptxas reports them as errors), and defines exactly
the entry points actors.compute.cuda_plan names. Runs without a GPU; skipped only where no
nvcc exists. Each test compiles its one file, for the two archs at once, each compile under its
own time limit: a compile slowed by a loaded machine fails that file alone, naming it and the
arch (the whole set takes about 90 s of CPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from actors.compute.cuda_plan import kernel_entry_points, kernel_source_dir, nvcc_options

ARCHS = ("80", "90")
SOURCES = sorted(kernel_entry_points())
# As ../shared/cuda/nvcc_compile_check.sh: warnings are errors, ptxas reports spills and
# local memory (-v prints each function's registers, stack frame and spills).
PTXAS_FLAGS = "-v,-warn-spills,-warn-lmem-usage"
# One file's compile for one arch: seconds on a quiet machine, many times that on a loaded
# one. Only a hang reaches it; the tests' own timeout is above it, so that the failure names
# the file and the arch.
COMPILE_TIMEOUT_S = 420


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (path for path in ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc")
         if os.access(path, os.X_OK)), None)


NVCC = find_nvcc()
pytestmark = [
    pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine (pinned "
                       "nvidia-cuda-nvcc wheels provide one: see ../shared/cuda/README.md)"),
    pytest.mark.timeout(COMPILE_TIMEOUT_S + 60),
]


def compile_cubin(source: Path, arch: str, cubin: Path) -> subprocess.CompletedProcess[str]:
    """nvcc of `source` for sm_`arch` into `cubin`, with the checks' flags; a compile past
    COMPILE_TIMEOUT_S fails the calling test, naming the file and the arch."""
    assert NVCC is not None
    try:
        return subprocess.run(
            [NVCC, *nvcc_options(), "-cubin", f"-gencode=arch=compute_{arch},code=sm_{arch}",
             "-Werror", "all-warnings", "-Xptxas", PTXAS_FLAGS, "-o", str(cubin), str(source)],
            capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"nvcc did not finish {source.name} for sm_{arch} in {COMPILE_TIMEOUT_S} s")


def test_every_source_file_is_listed() -> None:
    assert sorted(p.name for p in kernel_source_dir().glob("*.cu")) == SOURCES


@pytest.mark.parametrize("name", SOURCES)
def test_kernel_compiles_clean(name: str, tmp_path: Path) -> None:
    """`name` for each arch, the two compiles at once (each under its own limit)."""
    cubins = {arch: tmp_path / f"{Path(name).stem}.sm_{arch}.cubin" for arch in ARCHS}
    with ThreadPoolExecutor(max_workers=len(ARCHS)) as pool:
        results = dict(zip(ARCHS, pool.map(
            lambda arch: compile_cubin(kernel_source_dir() / name, arch, cubins[arch]), ARCHS)))
    problems = []
    for arch, result in results.items():
        output = result.stdout + result.stderr
        if result.returncode != 0:
            problems.append(f"nvcc failed for {name} on sm_{arch}:\n{output}")
            continue
        # ptxas -v reported every function: the checks did run
        assert "stack frame" in output, (arch, output)
        # Every listed entry point is in the cubin's symbol table under its plain (extern "C")
        # name.
        symbols = cubins[arch].read_bytes()
        missing = [k for k in kernel_entry_points()[name] if f"\0{k}\0".encode() not in symbols]
        if missing:
            problems.append(f"{name} on sm_{arch} lacks entry points {missing}")
    assert not problems, "\n".join(problems)


def test_spills_and_local_memory_fail_the_check(tmp_path: Path) -> None:
    """A kernel indexing a local array too big for registers at run time needs local memory:
    the flags make that an error, so such a kernel cannot pass test_kernel_compiles_clean."""
    source = tmp_path / "local.cu"
    source.write_text(
        'extern "C" __global__ void local_array(float* out, int i) {\n'
        "    float scratch[512];\n"
        "    for (int k = 0; k < 512; ++k) scratch[k] = out[k * i];\n"
        "    out[0] = scratch[i & 511];\n"
        "}\n"
    )
    result = compile_cubin(source, "90", tmp_path / "local.cubin")
    assert result.returncode != 0
    assert "Local memory" in result.stdout + result.stderr


def test_a_compile_past_its_limit_fails_its_test_naming_the_file_and_arch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys.modules[__name__], "COMPILE_TIMEOUT_S", 0.01)
    with pytest.raises(pytest.fail.Exception,
                       match=r"nvcc did not finish matmul_batch\.cu for sm_80"):
        compile_cubin(kernel_source_dir() / "matmul_batch.cu", "80", tmp_path / "batch.cubin")
