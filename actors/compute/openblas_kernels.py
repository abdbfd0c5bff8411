"""Pick OpenBLAS's kernel family for this CPU before numpy loads OpenBLAS.

numpy's OpenBLAS is built for many CPUs and chooses its kernels once, when it is loaded. On
AMD CPUs with AVX-512 (Zen 4 and later) it chooses the SkylakeX kernels, which are much slower
at the skinny float32 matmuls of decoding than its Zen kernels: measured on a 2-core Zen 4
(`python benchmarks/bench_forward.py`), 16 streams decode at 81 tok/s with SkylakeX kernels
and 140 with Zen's, and a (16, 640) @ (640, 262144) output projection takes 115 ms against 55.
The choice is made through the environment variable OpenBLAS reads at load time, so it only
takes effect when `actors` is imported before numpy, and a value the user set always wins.
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


def choose_openblas_kernels() -> None:
    """Set OPENBLAS_CORETYPE for this CPU if numpy has not loaded OpenBLAS yet and the user
    has not chosen."""
    if "numpy" in sys.modules or "OPENBLAS_CORETYPE" in os.environ:
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
