"""Every cuda_src/*.cu compiles with nvcc to sm_80 and sm_90 cubins, warnings as errors, with
no register spills and no local memory (ptxas reports them as errors), and defines exactly
the entry points actors.compute.cuda_plan names. Runs without a GPU; skipped only where no
nvcc exists. The compiles run two at a time (about 10 s on 2 cores)."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from actors.compute.cuda_plan import kernel_entry_points, kernel_source_dir, nvcc_options

ARCHS = ("80", "90")
SOURCES = sorted(kernel_entry_points())
# As ../shared/cuda/nvcc_compile_check.sh: warnings are errors, ptxas reports spills and
# local memory (-v prints each function's registers, stack frame and spills).
PTXAS_FLAGS = "-v,-warn-spills,-warn-lmem-usage"


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (path for path in ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc")
         if os.access(path, os.X_OK)), None)


NVCC = find_nvcc()
# (source name, arch) -> (nvcc's return code, its output, the cubin's path)
Compiled = dict[tuple[str, str], tuple[int, str, Path]]
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine "
                                "(pinned nvidia-cuda-nvcc wheels provide one: see "
                                "../shared/cuda/README.md)")


def compile_cubin(source: Path, arch: str, out_dir: Path) -> subprocess.CompletedProcess[str]:
    assert NVCC is not None
    cubin = out_dir / f"{source.stem}.sm_{arch}.cubin"
    return subprocess.run(
        [NVCC, *nvcc_options(), "-cubin", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Werror",
         "all-warnings", "-Xptxas", PTXAS_FLAGS, "-o", str(cubin), str(source)],
        capture_output=True, text=True,
    )


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Compiled:
    """Every source compiled for every arch."""
    out_dir = tmp_path_factory.mktemp("cubins")
    jobs = [(name, arch) for name in SOURCES for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda job: compile_cubin(kernel_source_dir() / job[0], job[1],
                                                     out_dir), jobs)
        return {
            job: (result.returncode, result.stdout + result.stderr,
                  out_dir / f"{Path(job[0]).stem}.sm_{job[1]}.cubin")
            for job, result in zip(jobs, results)
        }


def test_every_source_file_is_listed() -> None:
    assert sorted(p.name for p in kernel_source_dir().glob("*.cu")) == SOURCES


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", SOURCES)
def test_kernel_compiles_clean(compiled: Compiled, name: str, arch: str) -> None:
    returncode, output, cubin = compiled[(name, arch)]
    assert returncode == 0, f"nvcc failed for {name} on sm_{arch}:\n{output}"
    assert "stack frame" in output  # ptxas -v reported every function: the checks did run
    # Every listed entry point is in the cubin's symbol table under its plain (extern "C") name.
    symbols = cubin.read_bytes()
    missing = [k for k in kernel_entry_points()[name] if f"\0{k}\0".encode() not in symbols]
    assert not missing, f"{name} lacks entry points {missing}"


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
    result = compile_cubin(source, "90", tmp_path)
    assert result.returncode != 0
    assert "Local memory" in result.stdout + result.stderr
