"""actors.compute.cuda driven through a fake pycuda (no device, no kernels run): its control
flow on any machine. The build compiles every file, uploads the weights into one arena and
sizes the KV pool from the free memory; a decode step replays its bucket's graph (captured
once) in a handful of stream operations with one synchronization; a prefill step launches
its kernels one by one; a step too large for the workspace grows it and drops the graphs;
CUDA errors fail the step, or lose the backend when the context fails the probe after them;
close frees everything and releases the context."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from actors.compute.contract import BackendLostError, KVRequest, RowInputs, StepItem
from actors.errors import ComputeError, InvalidRequest
from actors.model.loaded import OpenedModel, open_model
from tests.conftest import TINY_MODELS

GIB = 1 << 30


class FakeDriver:
    """The parts of pycuda.driver the backend uses, recording what it is asked."""

    class Error(Exception):
        pass

    class MemoryError(Error):
        pass

    class LogicError(Error):
        pass

    def __init__(self) -> None:
        self.next_address = 1 << 20
        self.live: set[int] = set()
        self.launches: list[str] = []
        self.synchronizations = 0
        self.copies = 0
        self.fail_kernel: str | None = None
        self.context_broken = False
        self.context_stack: list[Any] = []
        self.detached = 0
        driver = self

        class Allocation:
            def __init__(self, size: int) -> None:
                self.address = driver.next_address
                driver.next_address += -(-size // 256) * 256
                driver.live.add(self.address)

            def __int__(self) -> int:
                return self.address

            def free(self) -> None:
                driver.live.remove(self.address)

        class HostBuffer(bytearray):
            def free(self) -> None:
                pass

        class Context:
            def push(self) -> None:
                driver.context_stack.append(self)

            def detach(self) -> None:
                driver.detached += 1

            @staticmethod
            def pop() -> None:
                driver.context_stack.pop()

            @staticmethod
            def synchronize() -> None:
                if driver.context_broken:
                    raise FakeDriver.LogicError("cuCtxSynchronize failed: an illegal memory "
                                                "access was encountered")

        class Device:
            def __init__(self, ordinal: int) -> None:
                pass

            def compute_capability(self) -> tuple[int, int]:
                return (9, 0)

            def name(self) -> str:
                return "Fake H200"

            def retain_primary_context(self) -> Context:
                return Context()

        class Stream:
            handle = 77

            def synchronize(self) -> None:
                driver.synchronizations += 1

        self.Allocation, self.Context, self.Device, self.Stream = (Allocation, Context, Device,
                                                                    Stream)
        self.HostBuffer = HostBuffer

    def module(self) -> types.ModuleType:
        module = types.ModuleType("pycuda.driver")
        for name in ("Error", "MemoryError", "LogicError", "Context", "Device", "Stream"):
            setattr(module, name, getattr(self, name))
        module.init = lambda: None
        module.mem_get_info = self.mem_get_info
        module.mem_alloc = self.Allocation
        module.pagelocked_empty = lambda n, dtype: np.ndarray(  # base: the "allocation"
            (n,), dtype, buffer=self.HostBuffer(n * np.dtype(dtype).itemsize))
        module.memcpy_htod = lambda address, data: self._copy()
        module.memcpy_htod_async = lambda address, data, stream: self._copy()
        module.memcpy_dtoh = lambda data, address: self._copy()
        module.memcpy_dtoh_async = lambda data, address, stream: self._copy()
        module.Function = object
        return module

    def mem_get_info(self) -> tuple[int, int]:
        if self.context_broken:
            raise self.LogicError("cuMemGetInfo failed: an illegal memory access")
        return 100 * GIB, 141 * GIB

    def _copy(self) -> None:
        self.copies += 1

    def launch(self, name: str) -> None:
        if name == self.fail_kernel:
            raise self.LogicError(f"cuLaunchKernel failed: {name}")
        self.launches.append(name)


class FakeGraphs:
    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replayed = 0
        self.destroyed = 0

    def capture(self, stream: Any, enqueue: Any) -> int:
        enqueue()
        self.captured.append(len(self.captured) + 1)
        return self.captured[-1]

    def launch(self, executable: int, stream: Any) -> None:
        self.replayed += 1

    def destroy(self, executable: int) -> None:
        self.destroyed += 1


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, FakeDriver, FakeGraphs]]:
    driver, graphs = FakeDriver(), FakeGraphs()
    compiled: list[str] = []

    class SourceModule:
        def __init__(self, source: str, **options: Any) -> None:
            assert options["no_extern_c"] and options["arch"] == "sm_90"
            compiled.append(source)

        def get_function(self, name: str) -> Any:
            def function(*args: Any, grid: Any, block: Any, stream: Any) -> None:
                assert all(isinstance(a, (np.uintp, np.int32, np.int64, np.float32,
                                          np.float64)) for a in args)
                driver.launch(name)
            return function

    package = types.ModuleType("pycuda")
    compiler = types.ModuleType("pycuda.compiler")
    compiler.SourceModule = SourceModule
    package.driver, package.compiler = driver.module(), compiler
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.driver", package.driver)
    monkeypatch.setitem(sys.modules, "pycuda.compiler", compiler)
    monkeypatch.delitem(sys.modules, "actors.compute.cuda", raising=False)
    cuda_module = importlib.import_module("actors.compute.cuda")
    monkeypatch.setattr(cuda_module, "DriverGraphs", lambda: graphs)
    yield cuda_module, driver, graphs
    sys.modules.pop("actors.compute.cuda", None)


@pytest.fixture(scope="module")
def tiny() -> Iterator[OpenedModel]:
    model = open_model(TINY_MODELS["qwen2-q4k-tiny"])
    yield model
    model.gguf.close()


def _backend(cuda_module: Any, model: OpenedModel, blocks: int | None = 32) -> Any:
    kv = KVRequest(blocks=blocks, block_size=16, max_sequences=8)
    return cuda_module.build_cuda_backend(model, kv, 0.9)


def test_build_compiles_uploads_and_sizes_the_pool(fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver, _ = fake
    backend = _backend(cuda_module, tiny, blocks=None)
    info = backend.info
    assert info.on_gpu and info.kv_dtype == "float16" and info.arch == "qwen2"
    useful = 8 * -(-tiny.spec.context_length // 16)  # memory holds far more
    assert info.num_blocks == useful
    assert driver.copies == len(list(tiny.gguf))  # every tensor fits one copy
    assert driver.context_stack == []  # the context is current only during calls
    backend.close()
    assert driver.live == set() and driver.detached == 1


def test_decode_steps_replay_one_graph_per_bucket(fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver, graphs = fake
    backend = _backend(cuda_module, tiny)
    prompt = [StepItem((1, 2, 3), 0, (0,)), StepItem((4, 5), 0, (1,))]
    backend.run(prompt, [RowInputs(), RowInputs()])
    prefill_kernels = len(driver.launches)
    assert backend.launches_per_step == prefill_kernels + 2 and not graphs.captured
    synchronizations = driver.synchronizations
    for position in range(3, 6):
        decode = [StepItem((7,), position, (0,)), StepItem((8,), position - 1, (1,))]
        backend.run(decode, [RowInputs(), RowInputs()])
        # host -> device, the graph, top_candidates, device -> host
        assert backend.launches_per_step == 4
        assert backend.kernels_per_step > 4 * tiny.spec.n_layers
    assert graphs.captured == [1] and graphs.replayed == 3
    assert driver.synchronizations == synchronizations + 3  # one per step
    backend.run([StepItem((7,), 6, (0,))], [RowInputs()])
    assert graphs.captured == [1, 2]  # bucket 1
    backend.close()
    assert graphs.destroyed == 2


def test_penalties_add_a_launch(fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver, _ = fake
    backend = _backend(cuda_module, tiny)
    backend.run([StepItem((7,), 0, (0,))], [RowInputs(repetition_penalty=1.3, repeated=(5,))])
    assert driver.launches[-2:] == ["apply_penalties", "top_candidates"]
    backend.close()


def test_a_larger_step_grows_the_workspace_and_drops_the_graphs(fake: Any,
                                                                tiny: OpenedModel) -> None:
    cuda_module, driver, graphs = fake
    backend = _backend(cuda_module, tiny, blocks=64)
    backend.run([StepItem((7,), 0, (0,))], [RowInputs()])
    long_prompt = tuple(range(1, cuda_module.FIRST_STEP_TOKENS + 40))
    backend.run([StepItem(long_prompt, 0, tuple(range(1, 40)))], [RowInputs()])
    assert graphs.destroyed == 1
    backend.close()
    assert driver.live == set()


def test_rows_are_checked_before_anything_runs(fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver, _ = fake
    backend = _backend(cuda_module, tiny)
    with pytest.raises(InvalidRequest, match="row inputs"):
        backend.run([StepItem((7,), 0, (0,))], [])
    with pytest.raises(InvalidRequest):
        backend.run([StepItem((7,), 0, (99,))], [RowInputs()])
    assert driver.launches == []
    backend.run([StepItem((7,), 0, (0,))], [RowInputs()])
    assert backend.fetch_rows([0]).shape == (1, tiny.spec.vocab_size)
    with pytest.raises(InvalidRequest):
        backend.fetch_rows([1])
    backend.close()


def test_errors_fail_the_step_unless_the_context_is_gone(fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver, _ = fake
    backend = _backend(cuda_module, tiny)
    driver.fail_kernel = "rope"
    with pytest.raises(driver.LogicError):
        backend.run([StepItem((7, 8), 0, (0,))], [RowInputs()])
    with pytest.raises(InvalidRequest):
        backend.fetch_rows([0])  # a failed step leaves no rows
    assert driver.context_stack == []
    driver.context_broken = True
    with pytest.raises(BackendLostError, match="illegal memory access"):
        backend.run([StepItem((7, 8), 0, (0,))], [RowInputs()])
    driver.fail_kernel, driver.context_broken = None, False
    backend.close()


def test_a_failed_build_frees_what_it_allocated(fake: Any, tiny: OpenedModel,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_module, driver, _ = fake
    monkeypatch.setattr(driver, "mem_get_info", lambda: (1 << 20, 141 * GIB))
    monkeypatch.setattr(cuda_module.cuda, "mem_get_info", driver.mem_get_info)
    with pytest.raises(ComputeError, match="short of one KV block"):
        _backend(cuda_module, tiny)
    assert driver.live == set() and driver.detached == 1 and driver.context_stack == []


def test_decode_rows_without_logits_still_fit_the_attention_partials(
        fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver, _ = fake
    backend = _backend(cuda_module, tiny, blocks=64)
    rows_before = backend._workspace.limits.max_rows
    silent = [StepItem((7,), 0, (i,), want_logits=False) for i in range(rows_before + 3)]
    backend.run([*silent, StepItem((1, 2), 0, (63,))], [RowInputs()])
    assert backend._workspace.limits.max_rows >= rows_before + 3
    backend.close()
