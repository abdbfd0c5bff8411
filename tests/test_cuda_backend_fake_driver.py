"""actors.compute.cuda driven through an emulated pycuda whose kernels are only recorded
(tests/cuda_emulator.py): its control flow on any machine. The build compiles every file,
uploads the weights into one arena and sizes the KV pool from the free memory; a decode step replays its bucket's graph (captured
once) in a handful of stream operations with one synchronization; a prefill step launches
its kernels one by one; a step too large for the workspace grows it and drops the graphs;
CUDA errors fail the step, or lose the backend when the context fails the probe after them;
close frees everything and releases the context."""

from __future__ import annotations

import io
import json
import shutil
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from actors.compute.contract import BackendLostError, KVRequest, RowInputs, StepItem
from actors.errors import ComputeError, InvalidRequest
from actors.logs import logging_to
from actors.model.candidates import mask_words
from actors.model.loaded import OpenedModel, open_model
from tests.conftest import TINY_MODELS

@pytest.fixture(scope="module")
def tiny() -> Iterator[OpenedModel]:
    model = open_model(TINY_MODELS["qwen2-q4k-tiny"])
    yield model
    model.gguf.close()


def _backend(cuda_module: Any, model: OpenedModel, blocks: int | None = 32,
             run_ahead_rows: int = 0) -> Any:
    """A backend over the fake driver; counting tests see one step at a time unless
    `run_ahead_rows` (then a greedy decode step of up to that many rows queues the next:
    test_the_next_greedy_step_...)."""
    kv = KVRequest(blocks=blocks, block_size=16, max_sequences=8)
    return cuda_module.build_cuda_backend(model, kv, 0.9, run_ahead_rows=run_ahead_rows)


def test_build_compiles_uploads_and_sizes_the_pool(fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver = fake
    backend = _backend(cuda_module, tiny, blocks=None)
    info = backend.info
    assert info.on_gpu and info.kv_dtype == "float16" and info.arch == "qwen2"
    useful = 8 * -(-tiny.spec.context_length // 16)  # memory holds far more
    assert info.num_blocks == useful
    assert driver.copies == len(list(tiny.gguf))  # every tensor fits one copy
    assert driver.context_stack == []  # the context is current only during calls
    backend.close()
    assert driver.live == set() and driver.detached == 1


def test_one_non_blocking_stream_and_close_releases_it_and_the_modules_first(
        fake: Any, tiny: OpenedModel) -> None:
    """A graph captured on a blocking stream is invalidated by any legacy-stream operation
    in the process; the stream and the modules must go while the context is still current."""
    cuda_module, driver = fake
    backend = _backend(cuda_module, tiny)
    backend.run([StepItem((7,), 0, (0,))], [RowInputs()])
    assert driver.streams == [cuda_module.STREAM_NON_BLOCKING]
    backend.close()
    assert sorted(driver.released) == ["module"] * driver.modules_made + ["stream"]
    assert driver.released_without_context == []


def test_compiles_share_one_cache_folder_with_the_tests(fake: Any, tiny: OpenedModel) -> None:
    from actors.compute import cuda_plan

    cuda_module, driver = fake
    _backend(cuda_module, tiny).close()
    assert {options["cache_dir"] for _, options in driver.compiled} == {
        str(cuda_plan.kernel_cache_dir())}
    assert all(options == cuda_plan.source_module_options((9, 0))
               for _, options in driver.compiled)


def test_the_compile_reports_its_progress(fake: Any, tiny: OpenedModel) -> None:
    """A first start on a machine compiles for tens of seconds: the log (and a bar, on a
    terminal) says what it is doing, file by file."""
    from actors.compute import cuda_plan

    cuda_module, _ = fake
    log = io.StringIO()
    with logging_to("info", log, as_json=True):
        _backend(cuda_module, tiny).close()
    events = [json.loads(line) for line in log.getvalue().splitlines()]
    compiling = [event for event in events if event.get("task") == "compiling the CUDA kernels"]
    files = len(cuda_plan.kernel_entry_points())
    assert compiling and {event["total"] for event in compiling} == {files}
    assert compiling[-1]["done"] == files


class FailingCaptureLibrary:
    """libcuda's graph calls as a broken capture sees them: ending it fails."""

    INVALIDATED = 901  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append(name)
            return self.INVALIDATED if name == "cuStreamEndCapture" else 0
        return call


def test_a_failed_capture_ends_it_and_raises_the_original_error(fake: Any) -> None:
    _, driver = fake
    graphs = object.__new__(driver.real_driver_graphs)
    graphs._lib = FailingCaptureLibrary()

    def enqueue() -> None:
        raise ValueError("a launch failed during capture")

    with pytest.raises(ValueError, match="during capture"):
        graphs.capture(types.SimpleNamespace(handle=5), enqueue)
    assert graphs._lib.calls == ["cuStreamBeginCapture_v2", "cuStreamEndCapture"]


def test_decode_steps_replay_one_graph_per_bucket(fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver = fake
    backend = _backend(cuda_module, tiny)
    prompt = [StepItem((1, 2, 3), 0, (0,)), StepItem((4, 5), 0, (1,))]
    backend.run(prompt, [RowInputs(), RowInputs()])
    prefill_kernels = len(driver.launches)
    # the step arrays' copy, the kernels, the rows' copy, the records' copy
    assert backend.launches_per_step == prefill_kernels + 3 and not driver.captures
    synchronizations = driver.synchronizations
    for position in range(3, 6):
        decode = [StepItem((7,), position, (0,)), StepItem((8,), position - 1, (1,))]
        backend.run(decode, [RowInputs(), RowInputs()])
        # step arrays host -> device, the graph, rows host -> device, top_candidates,
        # records device -> host
        assert backend.launches_per_step == 5
        assert backend.kernels_per_step > 4 * tiny.spec.n_layers
    assert driver.captures == 1 and driver.replays == 3
    assert driver.synchronizations == synchronizations + 3  # one per step
    backend.run([StepItem((7,), 6, (0,))], [RowInputs()])
    assert driver.captures == 2  # bucket 1
    backend.close()
    assert driver.destroyed == 2


def test_the_next_greedy_step_is_queued_in_the_other_lane_and_taken(
        fake: Any, tiny: OpenedModel) -> None:
    """A greedy decode step queues the next one (the other lane's graph, the tokens fed on
    the device, its candidates and their copy) before its one wait; that step, asked for,
    is answered after one wait, having queued the one after it; any other step drops it."""
    cuda_module, driver = fake
    backend = _backend(cuda_module, tiny, run_ahead_rows=8)
    backend.run([StepItem((1, 2, 3), 0, (0,)), StepItem((4, 5), 0, (1,))], [RowInputs()] * 2)
    synchronizations = driver.synchronizations
    driver.launches.clear()
    # the fake's records name token 0 for every row: the steps asked for feed it
    for position in range(3, 7):
        backend.run([StepItem((0,), position, (0,)), StepItem((0,), position - 1, (1,))],
                    [RowInputs()] * 2)
        assert backend.launches_per_step == 5
    assert backend.steps_run_ahead == 3 and driver.captures == 2  # a graph a lane
    assert driver.synchronizations == synchronizations + 4  # one wait a step
    # each step's graph ran when it was queued: one a step, and the one queued last
    assert driver.replays == 5 and driver.launches.count("feed_greedy_tokens") == 4
    backend.run([StepItem((9,), 7, (0,)), StepItem((0,), 6, (1,))], [RowInputs()] * 2)
    assert backend.steps_run_ahead == 3  # another token: dropped
    backend.close()
    assert driver.live == set()


def test_penalties_add_a_launch(fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver = fake
    backend = _backend(cuda_module, tiny)
    backend.run([StepItem((7,), 0, (0,))], [RowInputs(repetition_penalty=1.3, repeated=(5,))])
    assert driver.launches[-2:] == ["apply_penalties", "top_candidates"]
    backend.close()


def test_a_token_mask_adds_a_launch_before_the_penalties(fake: Any, tiny: OpenedModel) -> None:
    """A decode step with one constrained row of two: the graph, then apply_token_mask over
    that row alone, the penalties and the candidates; the rows' inputs (the mask's words
    among them) still go in one copy. The next step, unconstrained, launches no mask."""
    cuda_module, driver = fake
    backend = _backend(cuda_module, tiny)
    allowed = np.ones(mask_words(tiny.spec.vocab_size), np.int32)
    decode = [StepItem((7,), 3, (0,)), StepItem((8,), 2, (1,))]
    backend.run(decode, [RowInputs(allowed=allowed, repetition_penalty=1.3, repeated=(5,)),
                         RowInputs()])
    assert driver.launches[-3:] == ["apply_token_mask", "apply_penalties", "top_candidates"]
    # step arrays, the graph, rows, the mask, the penalties, the candidates, the records
    assert backend.launches_per_step == 7
    driver.launches.clear()
    backend.run(decode, [RowInputs(), RowInputs()])
    assert "apply_token_mask" not in driver.launches and backend.launches_per_step == 5
    backend.close()


def test_a_larger_step_grows_the_workspace_and_drops_the_graphs(fake: Any,
                                                                tiny: OpenedModel) -> None:
    cuda_module, driver = fake
    backend = _backend(cuda_module, tiny, blocks=64)
    backend.run([StepItem((7,), 0, (0,))], [RowInputs()])
    long_prompt = tuple(range(1, cuda_module.FIRST_STEP_TOKENS + 40))
    backend.run([StepItem(long_prompt, 0, tuple(range(1, 40)))], [RowInputs()])
    assert driver.destroyed == 1
    backend.close()
    assert driver.live == set()


def test_rows_are_checked_before_anything_runs(fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver = fake
    backend = _backend(cuda_module, tiny)
    with pytest.raises(InvalidRequest, match="row inputs"):
        backend.run([StepItem((7,), 0, (0,))], [])
    with pytest.raises(InvalidRequest):
        backend.run([StepItem((7,), 0, (99,))], [RowInputs()])
    with pytest.raises(InvalidRequest, match="token mask") as caught:
        backend.run([StepItem((7,), 0, (0,))], [RowInputs(allowed=np.ones(3, np.int32))])
    assert caught.value.field == "allowed"
    assert driver.launches == []
    backend.run([StepItem((7,), 0, (0,))], [RowInputs()])
    assert backend.fetch_rows([0]).shape == (1, tiny.spec.vocab_size)
    with pytest.raises(InvalidRequest):
        backend.fetch_rows([1])
    backend.close()


def test_errors_fail_the_step_unless_the_context_is_gone(fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver = fake
    backend = _backend(cuda_module, tiny)
    driver.fail_kernel = "mul_mat_vec_mma_qkv"
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


def test_a_failed_build_frees_what_it_allocated(fake: Any, tiny: OpenedModel) -> None:
    cuda_module, driver = fake
    driver.free_bytes = 1 << 20
    with pytest.raises(ComputeError, match="short of one KV block"):
        _backend(cuda_module, tiny)
    assert driver.live == set() and driver.detached == 1 and driver.context_stack == []


def test_decode_rows_without_logits_still_fit_the_attention_partials(
        fake: Any, tiny: OpenedModel) -> None:
    cuda_module, _ = fake
    backend = _backend(cuda_module, tiny, blocks=64)
    rows_before = backend._workspace.limits.max_rows
    silent = [StepItem((7,), 0, (i,), want_logits=False) for i in range(rows_before + 3)]
    backend.run([*silent, StepItem((1, 2), 0, (63,))], [RowInputs()])
    assert backend._workspace.limits.max_rows >= rows_before + 3
    backend.close()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
def test_a_launch_unlike_its_kernels_parameters_is_refused(fake: Any) -> None:
    """The emulated device checks each launch against the compiled kernel's parameters, so a
    test or benchmark that passes a kernel the wrong arguments fails here, not on a device."""
    from pycuda.compiler import SourceModule

    from actors.compute import cuda_plan as plan

    module = SourceModule((plan.kernel_source_dir() / "matvec.cu").read_text())
    matvec = module.get_function("mul_mat_vec_q8_0")
    address = np.uintp(1 << 40)
    right = (address, np.int64(272), address, np.int32(256), address, np.int32(1),
             np.int32(1), np.int32(256), np.int32(1))
    grid, block = (1, 1, 1), (256, 1, 1)
    matvec(*right, grid=grid, block=block)  # recorded: the fake device runs no kernel
    for wrong in (right[:-1],  # an argument short
                  (right[0], np.int32(144), *right[2:])):  # a 64-bit pitch passed as 32 bits
        with pytest.raises(AssertionError, match="unlike the kernel's parameters"):
            matvec(*wrong, grid=grid, block=block)
    with pytest.raises(fake[1].LogicError, match="named symbol not found"):
        module.get_function("mul_mat_vec_q4_K")  # the mma matvec's type: no entry here


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
def test_the_mma_matvec_is_allowed_the_staging_ring_its_launches_ask_for(fake: Any) -> None:
    """mul_mat_vec_mma's launches ask for its staging ring in dynamic shared memory, past
    the 48 KB a block has without asking: refused from a function not allowed it, launched
    from the backend's entry_function."""
    from pycuda.compiler import SourceModule

    from actors.compute import cuda_plan as plan

    cuda_module, device = fake
    module = SourceModule((plan.kernel_source_dir() / "matvec_mma.cu").read_text())
    name, launch = "mul_mat_vec_mma_q4_K", plan.matvec_mma_launch(16, 256)
    assert launch.shared == plan.dynamic_shared_bytes(name) > 48 * 1024
    address = np.uintp(1 << 40)
    args = (address, np.int64(144), address, np.int32(256), address, np.int32(16),
            np.int32(16), np.int32(256), np.int32(1))
    with pytest.raises(device.LogicError, match="dynamic shared memory"):
        module.get_function(name)(*args, grid=launch.grid, block=launch.block,
                                  shared=launch.shared)
    cuda_module.entry_function(module, name)(*args, grid=launch.grid, block=launch.block,
                                             shared=launch.shared)
    assert device.launches[-1] == name
