"""How long the CUDA backend's kernels take to compile, without a GPU: PyCUDA's compiler over
any driver (a stub libcuda will do; .cudacarry/make_libcuda_stub.sh makes one).

cuda_src's files compiled as the backend compiles them (actors.compute.cuda.compile_cubins,
the backend's nvcc options for --arch), one at a time and side by side, each into an empty
cache folder (a first start on a machine) and then again (a cached start, which still runs
nvcc's preprocessor on each file to key PyCUDA's cache). Prints JSON: seconds per case.

    python benchmarks/bench_compile.py [--arch 90]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from actors.compute import cuda_plan as plan
from actors.compute.cuda import compile_cubins


def timed(capability: tuple[int, int], cache_dir: str, jobs: int | None) -> float:
    started = time.perf_counter()
    compile_cubins(capability, cache_dir=cache_dir, jobs=jobs)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    args = parser.parse_args()
    capability = divmod(args.arch, 10)
    figures: dict[str, object] = {"files": len(plan.kernel_entry_points())}
    for name, jobs in (("one_at_a_time", 1), ("side_by_side", None)):
        with tempfile.TemporaryDirectory() as cache_dir:
            figures[f"{name}_cold_s"] = round(timed(capability, cache_dir, jobs), 2)
            figures[f"{name}_cached_s"] = round(timed(capability, cache_dir, jobs), 2)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
