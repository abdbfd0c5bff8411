"""The CUDA backend: PyCUDA-compiled kernels over the file's quantized weights and a paged
float16 KV cache, behind the compute contract (actors.compute.contract).

Only this module and its step buffers' (actors.compute.cuda_buffers) import pycuda; the
registry imports it when a CUDA backend is built, inside the compute actor's thread. Every
device call happens with the device's primary context made current for the call (push / pop),
so several backends of one process (tests) share it.

A step: `plan_step` validates it; its int32 arrays are packed into a pinned buffer and copied
to the device once; the forward kernels run (`cuda_launches.forward_calls`), replayed from a
CUDA graph when every item is one token that wants logits (a graph per batch bucket, captured
on first use over fixed device buffers). While the GPU runs the forward, the host packs the
rows' mask / penalty / candidate inputs into a second pinned buffer (at 64 rows the larger
part of the host's work; a structured-output row adds its mask's words, an unconstrained one
nothing) and queues their copy, the masks, the penalties and the candidates behind it; the
candidate records come back in one copy, and the host synchronizes once. The masked and
penalized logits rows stay on the device for `fetch_rows`. Everything runs on one
non-blocking stream, so no operation on the legacy stream (anyone's synchronous copy) can
break a graph capture.

The compute contract is synchronous (`run` answers the step's candidates), yet the GPU need
not wait while the host hands out step n's tokens and the engine builds step n+1: after a
greedy decode step the backend queues the step that follows if every sequence goes on
(actors.compute.cuda_ahead), its tokens fed on the device from step n's candidate records,
in the other of two lanes (pinned input, logits rows, candidate records, graphs); when step
n+1 comes and is that one, its candidates are already there and the next is queued at once
(`steps_run_ahead` counts those), at steps of up to `run_ahead_rows` rows
(cuda_ahead.RUN_AHEAD_MAX_ROWS unless told; 0 turns it off).

Errors: out of memory or any other CUDA error in a step fails the step; when the context then
fails a probe (a synchronize and a memory query), the error was sticky (an illegal address, a
kernel fault, a destroyed context: PyCUDA raises those as LaunchError or LogicError, the same
types as a harmless bad argument, so the type cannot tell) and the backend is lost.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import numpy as np
import pycuda.driver as cuda
from pycuda.compiler import compile as compile_cubin

from actors.compute import cuda_ahead
from actors.compute import cuda_launches as launches
from actors.compute import cuda_memory as memory
from actors.compute import cuda_packing as packing
from actors.compute import cuda_plan as plan
from actors.compute import cuda_weights as weights
from actors.compute.cuda_buffers import InputBuffer, Lane, Workspace
from actors.compute.cuda_graphs import DriverError, DriverGraphs
from actors.compute.contract import (
    BackendLostError,
    Candidates,
    ComputeInfo,
    KVRequest,
    RowInputs,
    StepItem,
    plan_step,
)
from actors.errors import InvalidRequest
from actors.model.loaded import OpenedModel
from actors.progress import progress_callback

# The workspace is first sized for a step of this many tokens (the engine's prefill chunk)
# beside the largest decode batch; a larger step grows it.
FIRST_STEP_TOKENS = 512
# Decode graphs are captured for batch buckets up to this many sequences.
MAX_GRAPH_BATCH = 64
# CU_STREAM_NON_BLOCKING: the stream does not synchronize with the legacy stream.
STREAM_NON_BLOCKING = 1


def compile_cubins(capability: tuple[int, int], *, cache_dir: str | None = None,
                   jobs: int | None = None) -> dict[str, bytes]:
    """Each cuda_src file compiled for this compute capability, file name -> cubin; no
    context needed. `cache_dir`: PyCUDA's cache folder (default cuda_plan.kernel_cache_dir(),
    shared with tests/gpu and the benchmark); `jobs`: files compiled at once (default all)."""
    source_dir = plan.kernel_source_dir()
    options = plan.source_module_options(capability)
    if cache_dir is not None:
        options = {**options, "cache_dir": cache_dir}
    files = list(plan.kernel_entry_points())

    def compiled(file_name: str) -> bytes:
        return compile_cubin((source_dir / file_name).read_text(), **options)

    # nvcc runs in processes of its own, so the files compile side by side: a first start
    # waits for the longest file, not for them all (likewise the preprocessing that keys
    # PyCUDA's cache on every start).
    with (progress_callback("compiling the CUDA kernels") as report,
          ThreadPoolExecutor(jobs or len(files)) as pool):
        pending = {pool.submit(compiled, file_name): file_name for file_name in files}
        cubins = {}
        for done, future in enumerate(as_completed(pending), start=1):
            cubins[pending[future]] = future.result()
            report(done, len(files))
    return cubins


def compile_kernels(capability: tuple[int, int]) -> dict[str, cuda.Function]:
    """Every entry point of cuda_src, each file compiled once for this device
    (compile_cubins) and loaded here, where the context is current. Each function holds its
    module: dropping the functions unloads the modules."""
    cubins = compile_cubins(capability)
    functions = {}
    for file_name, entry_points in plan.kernel_entry_points().items():
        module = cuda.module_from_buffer(cubins[file_name])
        functions.update((name, entry_function(module, name)) for name in entry_points)
    return functions


def entry_function(module: Any, name: str) -> Any:
    """The entry point `name` of a loaded module, allowed the dynamic shared memory its
    launches ask for (cuda_plan.dynamic_shared_bytes: past 48 KB a block, a launch is refused
    unless its function was allowed it)."""
    function = module.get_function(name)
    shared = plan.dynamic_shared_bytes(name)
    if shared:
        function.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)
    return function


@dataclass
class QueuedStep:
    """A decode step queued ahead in `lane`: its bucket, `width` candidates a record, the
    stream operations and kernels it enqueued, and once the step before it has answered (its
    tokens known) its items and rows (`step`)."""

    lane: int
    bucket: int
    width: int
    operations: int
    kernels: int
    step: cuda_ahead.AheadStep | None = None


class CudaBackend:
    """Owns the device's weights, KV pool, workspace, kernels and decode graphs."""

    def __init__(self, model: OpenedModel, kv: KVRequest, memory_fraction: float,
                 notices: Sequence[str] = (),
                 run_ahead_rows: int = cuda_ahead.RUN_AHEAD_MAX_ROWS) -> None:
        # The most rows of a greedy decode step after which the next is queued (0: none).
        self._run_ahead_rows = run_ahead_rows
        cuda.init()
        device = cuda.Device(0)
        self._context = device.retain_primary_context()
        self._allocations: list[Any] = []
        # Decode graphs by (bucket, lane): each lane's reads its own input buffer and logits.
        self._graphs: dict[tuple[int, int], tuple[int, dict[str, int], int]] = {}
        self._ahead: QueuedStep | None = None  # the step queued after the last one
        # The step expected next where none was queued, and whether to queue: not after a
        # step queued was dropped, until an expected step comes true (a dropped step cost the
        # device a whole step).
        self._expected: cuda_ahead.AheadStep | None = None
        self._queue_allowed = True
        self._lane = 0  # the last step's lane (its logits rows are fetch_rows')
        self._row_addresses: dict[str, int] = {}  # the last rows' arrays on the device
        self._workspace: Workspace | None = None
        self._row_input: InputBuffer | None = None  # the rows' arrays: graphs never read it
        self._functions: dict[str, Any] = {}
        self._stream: Any = None
        self._last_rows = 0
        self.steps_run_ahead = 0  # decode steps answered from the step queued ahead
        self.launches_per_step = 0  # stream operations the last step enqueued (copies, launches)
        self.kernels_per_step = 0  # kernels the last step ran on the device
        try:
            with self._current():
                self._set_up(model, kv, memory_fraction, device, notices)
        except BaseException:
            self.close()  # what was allocated before the failure, and the context
            raise

    # --- set-up ---------------------------------------------------------------------------

    def _set_up(self, model: OpenedModel, kv: KVRequest, memory_fraction: float,
                device: cuda.Device, notices: Sequence[str]) -> None:
        spec = self._spec = model.spec
        capability = device.compute_capability()
        free_bytes, _ = cuda.mem_get_info()
        self._functions = compile_kernels(capability)
        self._driver_graphs = DriverGraphs()
        self._stream = cuda.Stream(flags=STREAM_NON_BLOCKING)
        self._layouts = launches.tensor_layouts(model.tensors)
        self._split_keys = launches.split_keys_for(spec.context_length)
        self._buckets = launches.graph_buckets(min(kv.max_sequences, MAX_GRAPH_BATCH))
        weight_addresses, weight_bytes = self._upload_weights(model)
        self._addresses = {"null": 0, **weight_addresses}
        limits = memory.StepLimits(
            max_tokens=FIRST_STEP_TOKENS + self._buckets[-1], max_rows=self._buckets[-1],
            max_splits=plan.decode_splits(spec.context_length, self._split_keys),
            max_candidates=plan.MAX_CANDIDATES)
        first_input = 1 << 16
        workspace_bytes = (sum(memory.workspace_buffers(spec, limits).values()) +
                           2 * 4 * first_input)  # the two lanes' input buffers
        block_bytes = memory.kv_block_bytes(spec, kv.block_size)
        self.num_blocks = memory.kv_pool_blocks(
            free_bytes, memory_fraction, weight_bytes, workspace_bytes, block_bytes,
            kv.blocks, kv.max_sequences * -(-spec.context_length // kv.block_size))
        self.block_size = kv.block_size
        self._table_stride = launches.table_stride_for(spec.context_length, kv.block_size,
                                                       self.num_blocks)
        self._addresses.update(self._allocate_kv(block_bytes))
        self._set_workspace(limits, first_input)
        self.info = ComputeInfo.of_model(
            spec, on_gpu=True, num_blocks=self.num_blocks, block_size=kv.block_size,
            kv_dtype="float16",
            notices=(*notices, f"CUDA backend on {device.name()} (sm_{capability[0]}"
                               f"{capability[1]}): {self.num_blocks} KV blocks of "
                               f"{kv.block_size} positions, decode graphs for batches "
                               f"{list(self._buckets)}"),
        )

    def _allocate(self, size: int) -> Any:
        allocation = cuda.mem_alloc(max(size, 1))
        self._allocations.append(allocation)
        return allocation

    def _upload_weights(self, model: OpenedModel) -> tuple[dict[str, int], int]:
        """Every tensor into one allocation, blocks as stored (its Q6_K matrices row-planar:
        actors.compute.cuda_weights): each tensor's address, and the allocation's size."""
        offsets, size = weights.weight_arena(model.tensors)
        base = int(self._allocate(size))
        with progress_callback("uploading the weights to the GPU") as report:
            tensors = list(model.tensors)
            for done, info in enumerate(tensors, start=1):
                for at, data in weights.device_bytes_of(model.tensors.raw(info.name), info):
                    cuda.memcpy_htod(base + offsets[info.name] + at, data)
                report(done, len(tensors))
        return {name: base + offset for name, offset in offsets.items()}, size

    def _allocate_kv(self, block_bytes: int) -> dict[str, int]:
        """K and V of each layer: (num_blocks + 1) blocks, the last one the padding rows'."""
        layer_bytes = block_bytes // (2 * self._spec.n_layers) * (self.num_blocks + 1)
        base = int(self._allocate(2 * self._spec.n_layers * layer_bytes))
        addresses = {}
        for layer in range(self._spec.n_layers):
            addresses[f"k_cache.{layer}"] = base + 2 * layer * layer_bytes
            addresses[f"v_cache.{layer}"] = base + (2 * layer + 1) * layer_bytes
        return addresses

    def _set_workspace(self, limits: memory.StepLimits, input_words: int) -> None:
        """(Re)allocate the workspace; graphs captured over the old one are dropped, and a
        step queued ahead (it uses the old one) is waited for and dropped."""
        self._settle()
        self._drop_graphs()
        if self._workspace is not None:
            self._workspace.free()
            self._workspace = None
        self._workspace = Workspace(self._spec, limits, input_words)
        self._addresses.update((name, int(allocation))
                               for name, allocation in self._workspace.buffers.items())

    def _drop_graphs(self) -> None:
        for executable, _, _ in self._graphs.values():
            self._driver_graphs.destroy(executable)
        self._graphs.clear()

    @contextmanager
    def _current(self) -> Iterator[None]:
        self._context.push()
        try:
            yield
        finally:
            cuda.Context.pop()

    # --- the contract ---------------------------------------------------------------------

    def run(self, items: Sequence[StepItem], rows: Sequence[RowInputs]) -> Candidates:
        # Forget the last step's rows first: a failed step leaves nothing to fetch.
        self._last_rows = 0
        ahead, self._ahead = self._ahead, None
        expected, self._expected = self._expected, None
        if (ahead is not None and ahead.step is not None
                and cuda_ahead.is_ahead_step(ahead.step, items, rows)):
            with self._current(), self._lost_on_sticky_errors():
                candidates = self._take(ahead, items, rows)
            self._last_rows = len(rows)
            return candidates
        if ahead is not None:
            # Also what keeps the dropped step's lane unwritten until a later step's wait
            # (its pinned input may not have been copied yet): nothing is queued this step.
            self._queue_allowed = False
        elif expected is not None and cuda_ahead.is_ahead_step(expected, items, rows):
            self._queue_allowed = True
        # A dropped step may still be queued: this one takes the other lane.
        lane = self._lane if ahead is None else 1 - ahead.lane
        step = plan_step(items, self._spec, self.num_blocks, self.block_size)
        if len(rows) != len(step.logit_rows):
            raise InvalidRequest(
                f"{len(rows)} row inputs for {len(step.logit_rows)} items that want logits",
                field="rows",
            )
        packing.check_token_masks(rows, self._spec.vocab_size)  # before any kernel runs
        with self._current(), self._lost_on_sticky_errors():
            candidates = self._run(step, items, rows, lane)
        self._last_rows = len(rows)
        return candidates

    def fetch_rows(self, indices: Sequence[int]) -> np.ndarray:
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        if index.size and (index.min() < 0 or index.max() >= self._last_rows):
            raise InvalidRequest(
                f"rows {list(indices)} are not all rows of the last step "
                f"({self._last_rows} rows)", field="rows",
            )
        vocab = self._spec.vocab_size
        out = np.empty((index.size, vocab), dtype=np.float32)
        with self._current(), self._lost_on_sticky_errors():
            logits = int(self._workspace.lanes[self._lane].logits)
            for i, row in enumerate(index):
                cuda.memcpy_dtoh(out[i], logits + int(row) * vocab * 4)
        return out

    def close(self) -> None:
        if self._context is None:
            return
        try:
            with self._current():
                with suppress(cuda.Error):  # a lost context: free what can be freed
                    self._settle()
                self._drop_graphs()
                if self._workspace is not None:
                    self._workspace.free()
                if self._row_input is not None:
                    self._row_input.free()
                for allocation in self._allocations:
                    allocation.free()
                # The stream and the modules (held by their functions) go with their last
                # reference: now, while the context is current, not in a destructor after
                # the detach (PyCUDA warns there, possibly from another thread).
                self._functions, self._stream = {}, None
        finally:
            self._workspace, self._row_input, self._allocations = None, None, []
            self._context.detach()
            self._context = None

    # --- a step ---------------------------------------------------------------------------

    @contextmanager
    def _lost_on_sticky_errors(self) -> Iterator[None]:
        """A CUDA error fails the step; when the context then fails a probe too, the error
        was sticky and the backend is lost (BackendLostError)."""
        try:
            yield
        except cuda.MemoryError:
            raise  # out of memory: the step failed, the context is fine
        except (cuda.Error, DriverError) as error:
            try:
                cuda.Context.synchronize()
                cuda.mem_get_info()
            except cuda.Error as probe:
                raise BackendLostError(
                    f"the CUDA context is unusable after {type(error).__name__}: {error} "
                    f"(probe: {probe})") from error
            raise

    def _run(self, step: Any, items: Sequence[StepItem], rows: Sequence[RowInputs],
             lane: int) -> Candidates:
        spec = self._spec
        bucket = launches.graph_bucket(step, self._buckets)
        if bucket is None:
            shape = launches.step_shape(step, self._table_stride, self._split_keys,
                                        spec.context_length)
            arrays = packing.step_arrays(step, shape.n_decode, self._table_stride)
        else:
            shape = launches.graph_shape(bucket, self._table_stride, self._split_keys,
                                         spec.context_length, self.block_size)
            pad_block = self.num_blocks  # the extra block past the scheduler's pool
            arrays = packing.decode_step_arrays(
                step.token_ids, step.positions, step.slot_blocks * self.block_size +
                step.slot_offsets, step.block_tables, bucket, self._table_stride,
                pad_block * self.block_size, pad_block,
                used=1 + step.positions // self.block_size)
        packed = packing.pack_int32({f"step.{k}": v for k, v in arrays.items()})
        n_rows = len(rows)
        self._fit_workspace(shape, n_rows, packed.buffer.size)
        at = self._workspace.lanes[lane]
        try:
            addresses = {**at.input.upload(packed, self._stream), "logits": int(at.logits)}
            if bucket is None:
                calls = self._forward_calls(shape)
                self._launch(calls, addresses)
                kernels = len(calls)
            else:
                kernels = self._replay(bucket, lane, addresses)
            operations = 2 if bucket is not None else 1 + kernels
            # The GPU runs the forward while the host packs the rows' inputs.
            row_pack = packing.row_arrays(rows, spec.vocab_size)
            record = plan.candidate_record_words(row_pack.width)
            if n_rows:
                packed_rows = packing.pack_int32({f"rows.{k}": v
                                               for k, v in row_pack.arrays.items()})
                self._row_addresses = self._row_buffer(packed_rows.buffer.size).upload(
                    packed_rows, self._stream)
                tail = launches.candidate_calls(spec, n_rows, row_pack.width,
                                                row_pack.any_penalty, row_pack.n_masked)
                self._launch(tail, {**addresses, **self._row_addresses})
                cuda.memcpy_dtoh_async(at.pinned_candidates[: n_rows * record],
                                       self._workspace.buffers["candidates"], self._stream)
                operations += len(tail) + 2
                kernels += len(tail)
            at.done.record(self._stream)
            pending = (self._queue_ahead(items, rows, bucket, lane, row_pack.width)
                       if bucket is not None else None)
            at.done.synchronize()  # the step's one wait (not for the step queued after it)
        except BaseException:
            self._abandon()
            raise
        self._lane = lane
        self.launches_per_step, self.kernels_per_step = operations, kernels
        return self._answer(at, n_rows, row_pack.width, rows, pending)

    def _answer(self, at: Lane, n_rows: int, width: int, rows: Sequence[RowInputs],
                pending: tuple[StepItem, ...] | None) -> Candidates:
        """The step's candidates from its lane's records; the step queued after it (its
        `pending` items) learns the tokens the device fed it."""
        record = plan.candidate_record_words(width)
        records = at.pinned_candidates[: n_rows * record].reshape(n_rows, record).copy()
        if pending is not None:
            # Each record's candidate 0 (what feed_greedy_tokens took, where it ran).
            following = cuda_ahead.ahead_step(pending, records[:, 2], rows)
            if self._ahead is not None:
                self._ahead.step = following
            else:
                self._expected = following
        return packing.candidates_from_records(records, width, rows)

    def _take(self, ahead: QueuedStep, items: Sequence[StepItem],
              rows: Sequence[RowInputs]) -> Candidates:
        """The step queued ahead is the one asked for: queue the one after it, wait for it."""
        at = self._workspace.lanes[ahead.lane]
        try:
            pending = self._queue_ahead(items, rows, ahead.bucket, ahead.lane, ahead.width)
            at.done.synchronize()
        except BaseException:
            self._abandon()
            raise
        self._lane = ahead.lane
        self.steps_run_ahead += 1
        self.launches_per_step, self.kernels_per_step = ahead.operations, ahead.kernels
        return self._answer(at, len(rows), ahead.width, rows, pending)

    def _queue_ahead(self, items: Sequence[StepItem], rows: Sequence[RowInputs], bucket: int,
                     lane: int, width: int) -> tuple[StepItem, ...] | None:
        """Queue, in the other lane, the decode step after `items` (just queued in `lane`) if
        every sequence goes on with its first candidate (cuda_ahead.next_items) and queueing
        is allowed: its arrays, the tokens fed from the records on the device, the bucket's
        graph, the same rows' candidates. Its items (tokens unknown yet), or None where no
        step follows that way."""
        pending = cuda_ahead.next_items(items, rows, self.block_size, self.num_blocks,
                                        self._spec.context_length, self._run_ahead_rows)
        if pending is None or not self._queue_allowed:
            return pending
        ahead_lane = 1 - lane
        at = self._workspace.lanes[ahead_lane]
        pad_block = self.num_blocks
        positions = [item.start for item in pending]
        slots = [item.blocks[-1] * self.block_size + p % self.block_size
                 for item, p in zip(pending, positions)]
        packed = packing.pack_int32({f"step.{k}": v for k, v in packing.decode_step_arrays(
            [0] * len(pending), positions, slots, [item.blocks for item in pending], bucket,
            self._table_stride, pad_block * self.block_size, pad_block).items()})
        addresses = {**at.input.upload(packed, self._stream), "logits": int(at.logits)}
        feed = launches.feed_tokens_call(len(rows), width, launches.Ref("step.token_ids"))
        self._launch([feed], addresses)
        kernels = self._replay(bucket, ahead_lane, addresses)
        tail = launches.candidate_calls(self._spec, len(rows), width, False, 0)
        self._launch(tail, {**addresses, **self._row_addresses})
        record = plan.candidate_record_words(width)
        cuda.memcpy_dtoh_async(at.pinned_candidates[: len(rows) * record],
                               self._workspace.buffers["candidates"], self._stream)
        at.done.record(self._stream)
        # Operations: the arrays' copy, the feed, the graph, the tail, the records' copy.
        self._ahead = QueuedStep(ahead_lane, bucket, width, len(tail) + 4,
                                 kernels + 1 + len(tail))
        return pending

    def _abandon(self) -> None:
        """After a failure: no step queued ahead, and nothing queued still reads the pinned
        inputs the next step rewrites (a sticky error here is the probe's to report)."""
        self._ahead = self._expected = None
        with suppress(cuda.Error):
            self._stream.synchronize()

    def _settle(self) -> None:
        """Drop the step queued ahead and wait for everything queued (a step dropped may still
        be), before buffers they use go."""
        self._ahead = self._expected = None
        if self._stream is not None:
            self._stream.synchronize()

    def _row_buffer(self, words: int) -> InputBuffer:
        """The rows' input buffer, grown to hold `words` (no graph reads it: growing it
        drops none). The last step that used it has ended."""
        if self._row_input is None or self._row_input.words < words:
            if self._row_input is not None:
                self._stream.synchronize()  # a step queued ahead may still read it
                self._row_input.free()
                self._row_input = None
            self._row_input = InputBuffer(max(words, 1024))
        return self._row_input

    def _fit_workspace(self, shape: launches.StepShape, n_rows: int, input_words: int) -> None:
        workspace = self._workspace
        # Rows: the logits rows and the decode rows (attention partials are per decode row).
        rows = max(n_rows, shape.n_logit_rows, shape.n_decode)
        if workspace.covers(shape.n_tokens, rows, input_words):
            return
        limits = workspace.limits
        self._set_workspace(
            memory.StepLimits(max_tokens=max(limits.max_tokens, shape.n_tokens),
                            max_rows=max(limits.max_rows, rows),
                            max_splits=limits.max_splits,
                            max_candidates=limits.max_candidates),
            max(workspace.lanes[0].input.words, input_words))

    def _forward_calls(self, shape: launches.StepShape) -> list[launches.KernelCall]:
        """The step's kernels, eager or to capture."""
        return launches.forward_calls(self._spec, self._layouts, shape, launches.TILE_INPUT)

    def _launch(self, calls: Sequence[launches.KernelCall], step_addresses: dict[str, int]) -> None:
        for call in calls:
            args = [self._resolve(arg, step_addresses) for arg in call.args]
            self._functions[call.kernel](*args, grid=call.launch.grid, block=call.launch.block,
                                         shared=call.launch.shared, stream=self._stream)

    def _resolve(self, arg: launches.Arg, step_addresses: dict[str, int]) -> Any:
        if not isinstance(arg, launches.Ref):
            return arg
        base = step_addresses[arg.name] if arg.name in step_addresses else self._addresses[arg.name]
        return np.uintp(base + arg.offset)

    def _replay(self, bucket: int, lane: int, step_addresses: dict[str, int]) -> int:
        """Launch the bucket's decode graph of `lane` (captured now if this is its first
        step); the number of kernels it holds."""
        key = (bucket, lane)
        if key not in self._graphs:
            calls = self._forward_calls(launches.graph_shape(
                bucket, self._table_stride, self._split_keys, self._spec.context_length,
                self.block_size))
            executable = self._driver_graphs.capture(
                self._stream, lambda: self._launch(calls, step_addresses))
            self._graphs[key] = (executable, dict(step_addresses), len(calls))
        executable, captured_addresses, kernels = self._graphs[key]
        if any(captured_addresses[k] != v for k, v in step_addresses.items()):
            raise RuntimeError(f"the decode graph of bucket {bucket}, lane {lane} was captured "
                               "over other step-array addresses")
        self._driver_graphs.launch(executable, self._stream)
        return kernels


def build_cuda_backend(model: OpenedModel, kv: KVRequest, memory_fraction: float,
                       notices: Sequence[str] = (),
                       run_ahead_rows: int = cuda_ahead.RUN_AHEAD_MAX_ROWS) -> CudaBackend:
    """The CUDA backend for `model` (called in the compute actor's thread)."""
    return CudaBackend(model, kv, memory_fraction, notices, run_ahead_rows)
