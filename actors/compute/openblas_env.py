"""OpenBLAS's settings, made before numpy loads OpenBLAS: its kernel family for this CPU, and
threads that sleep as soon as a product ends.

numpy's OpenBLAS is built for many CPUs and chooses its kernels once, when it is loaded. On
AMD CPUs with AVX-512 (Zen 4 and later) it chooses the SkylakeX kernels, which are much slower
at the skinny float32 matmuls of decoding than its Zen kernels: measured on a 2-core Zen 4
(`python benchmarks/bench_forward.py`), 16 streams decode at 81 tok/s with SkylakeX kernels
and 140 with Zen's, and a (16, 640) @ (640, 262144) output projection takes 115 ms against 55.

After each product OpenBLAS's threads spin for 2^28 cycles (about 0.1 s) waiting for the
next one, holding every core: the engine's own threads (the kernel helpers, the event loop)
then share a core with a thread that does nothing. Told to sleep at once (2^4 cycles), they
cost a wake-up per product instead; measured (2-core Zen 3, `bench_forward.py` steps of 64
sequences, five runs each, three processes apart): gemma-3-270m 176-180 -> 207-211 tok/s at
best, SmolLM2 304-315 -> 319-346, prefill of 512 tokens unchanged.

Both are set through the environment variables OpenBLAS reads at load time, so they only take
effect when `actors` is imported before numpy, and a value the user set always wins.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def kernel_family_for(first_processor: Iterable[str]) -> str | None:
    """The OpenBLAS core type to ask for on the CPU whose /proc/cpuinfo lines these are (read
    up to the first blank line: the first processor's block describes them all), or None to
    keep OpenBLAS's own choice."""
    fields: dict[str, str] = {}
    for line in first_processor:
        if not line.strip():
            break
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    is_amd = fields.get("vendor_id") == "AuthenticAMD"
    has_avx512 = "avx512f" in fields.get("flags", "").split()
    return "Zen" if is_amd and has_avx512 else None


# 2^4 cycles, the least OpenBLAS takes: its threads sleep when a product ends.
THREAD_TIMEOUT = "4"


def configure_openblas() -> None:
    """Set OPENBLAS_THREAD_TIMEOUT, and OPENBLAS_CORETYPE for this CPU, where numpy has not
    loaded OpenBLAS yet and the user has not set them."""
    if "numpy" in sys.modules:
        return
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
    if "OPENBLAS_CORETYPE" in os.environ:
        return
    try:
        # Only the first block is read: on a many-core machine the file is hundreds of KB,
        # and this runs on every `import actors`.
        with CPUINFO.open() as cpuinfo:
            family = kernel_family_for(cpuinfo)
    except OSError:  # not Linux: keep OpenBLAS's choice
        return
    if family is not None:
        os.environ["OPENBLAS_CORETYPE"] = family
