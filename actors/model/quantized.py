"""Weight matrices kept as the file's quantized blocks, multiplied by compiled kernels.

A `QuantizedMatrix` is W (out_features, in_features) as one or more parts, each a run of
output features stored as rows of GGUF blocks of one type (q | k | v and gate | up are fused
this way, each part keeping its own type); one kernel call covers every part. Its rows are
read straight from the mapped file: the weights take the file's bytes and no more. A part may
name its rows in any order (`rows`): the q and k heads are read in RoPE pair order that way,
so nothing is copied to permute them.

`x @ W.T` takes one of two routes, by the number of rows of x:
- a few rows (decoding): `run_rows(MATVEC)` multiplies the blocks directly, every weight byte
  read once for all the rows, the matrix's rows split among the cores;
- more (prefill chunks, wide batches): a slab of W's rows at a time is dequantized into a
  reused float32 buffer (`run_rows(DEQUANTIZE)`) and multiplied by BLAS, which is faster per
  product once the dequantizing is shared by enough rows (the logits of a decoding batch: each
  kernel thread on slabs of its own; otherwise BLAS's threads on one slab at a time). Where the
  routes cross was measured per shape (`benchmarks/bench_forward.py --crossover`):
  DIRECT_ROWS_LIMIT.

Both routes see exactly the levels `quants.dequantize` gives; only the order (and, for a row
alone, the grouping: quantized_kernels) of the float32 sums differs from a float32 matmul's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actors.errors import InvalidRequest, ModelFormatError
from actors.model.gguf.quants import block_format, row_bytes
from actors.model.quantized_kernels import (
    CALL_WORDS,
    DEQUANTIZE,
    LANES,
    MATVEC,
    TYPE_CODES,
    WATCHING,
    claim_chunk,
    finish_chunk,
    publish,
    run_rows,
    run_shared,
    serve_calls,
    ticket,
    wait_for_chunks,
    wait_for_published,
)

# Elements a row must be a whole number of, for the kernels (a unit of two vectors).
ROW_UNIT = 2 * LANES
# The most rows of x the direct product takes: past it the slab route is faster. Measured per
# shape of gemma-3-270m's matrices and of random ones of every block type (`bench_forward.py
# --crossover`; on a 2-core Zen 3 also per core, by thread CPU time): the routes cross between
# 16 and 24 rows for every one, the (262144, 640) output included (61.5 / 65.7 ms at 16 rows,
# 97.4 / 77.5 at 24), so one limit serves.
DIRECT_ROWS_LIMIT = 16
# The float32 slab a kernel thread dequantizes and multiplies at a time: big enough for BLAS
# to run at full speed on it (skinny products are slow: at least MIN_SLAB_ROWS of W), small
# enough to stay near the core between the two. Measured on gemma-3-270m's matrices, one
# thread (/proc thread CPU time): 1-2 MB slabs take the (64, 640) x (640, 262144) output
# product in 317-325 ms, 8 MB slabs in 451 ms; 512 KB ones lose at 16 rows.
SLAB_BYTES = 1 << 20
MIN_SLAB_ROWS = 64
SLABS_PER_THREAD = 4
# The slab of a product BLAS's threads share (more rows of x than TRANSPOSED_PRODUCT_ROWS):
# large, for few calls (the last-level cache holds it).
SHARED_SLAB_BYTES = 1 << 23
# A matrix whose float32 form passes this is dequantized by every kernel thread in parallel
# for a few dozen rows of x (each on its own slabs): gemma-3's 671 MB logits matrix, not its
# 10 MB gate | up one, which runs as fast on BLAS's threads.
PER_THREAD_MIN_BYTES = SLABS_PER_THREAD * SHARED_SLAB_BYTES
# Up to this many rows of x, BLAS runs slab @ x.T (then copied transposed into out) faster than
# x @ slab.T: 1.7x at 16 rows, 1.3x at 32, even at 64-128 (measured, a (3276, 640) slab).
TRANSPOSED_PRODUCT_ROWS = 64
# Chunks of rows per thread in a kernel call: small chunks let whoever is running take more.
CHUNKS_PER_THREAD = 8
# Below this many weights times rows of x a call runs in the calling thread alone: a helper
# takes about 10 us to wake.
PARALLEL_MIN_WORK = 1 << 19
# The same within compiled code that makes its calls itself (`run_calls`, a decoding block):
# the helpers, woken once for the block, are watching between its calls, so sharing pays down
# to small products (SmolLM2-135M's (576, 576) attention output: one stream 5% faster).
WATCHED_MIN_WORK = 1 << 16
# A call whose helpers kept its thread waiting for more than this share of the call (they had
# lost their core to other work mid-chunk) makes the next calls run alone: SOLO_CALLS[0] of
# them, twice as many after each such call in a row, at most SOLO_CALLS[1].
SLOW_HELPER_SHARE = 0.25
SOLO_CALLS = (16, 1024)
_scratch = threading.local()
# A piece of work split in chunks: task(n_chunks, counters) takes chunks from `counters` until
# none are left (quantized_kernels' CLAIMED / DONE protocol), in every thread that calls it.
ChunkedTask = Callable[[int, np.ndarray], None]
# A call handed to the helpers: the task, its chunks, its counters and the call's number.
Call = tuple[ChunkedTask, int, np.ndarray, int]
# How long a helper watches for the next call after one before it sleeps: about 0.2-0.5 ms of
# reads. Calls within a step come 0.05-0.3 ms apart, while waking a sleeping thread took a
# good share of a small matrix's product (one row through gemma-3's 72 layer matrices: 15.1 ms
# on one core, 11.5-15.9 ms on two with sleeping helpers).
HELPER_WATCH_READS = 1 << 20


def kernel_supports(type_name: str, row_length: int) -> bool:
    """Whether the kernels can run a matrix of `type_name` with rows of `row_length`."""
    return type_name in TYPE_CODES and row_length % ROW_UNIT == 0


def _scratch_buffer(name: str, shape: tuple[int, int]) -> np.ndarray:
    """This thread's reused float32 buffer `name`, grown to hold `shape` (a fresh multi-MB
    array a call would cost its page faults every time)."""
    size = shape[0] * shape[1]
    buffer = getattr(_scratch, name, None)
    if buffer is None or buffer.size < size:
        buffer = np.empty(size, dtype=np.float32)
        setattr(_scratch, name, buffer)
    return buffer[:size].reshape(shape)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _BlasThreads:
    """The thread count of the OpenBLAS numpy calls, where numpy uses OpenBLAS.

    Products of a few dozen rows of x run best as several single-threaded BLAS calls at once,
    one in each kernel thread on its own slabs (both cores dequantize and multiply the whole
    call), rather than one thread dequantizing while BLAS's own threads wait and then take the
    cores; OpenBLAS counts its threads for the whole process, so the count is set to one for
    such a product and set back after it.
    """

    # The library's setter and getter: scipy-openblas's names (numpy's wheels), then plain ones.
    NAMES = (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
             ("openblas_set_num_threads", "openblas_get_num_threads"))

    def __init__(self) -> None:
        self._set: Callable[[int], None] | None = None
        self._get: Callable[[], int] | None = None
        package = Path(np.__file__).parent
        for path in sorted([*package.parent.glob("numpy.libs/*openblas*"),
                            *package.glob(".dylibs/*openblas*")]):
            try:
                library = ctypes.CDLL(str(path))
            except OSError:
                continue
            for set_name, get_name in self.NAMES:
                if hasattr(library, set_name) and hasattr(library, get_name):
                    self._set, self._get = getattr(library, set_name), getattr(library, get_name)
                    self._set.argtypes, self._set.restype = [ctypes.c_int], None
                    self._get.argtypes, self._get.restype = [], ctypes.c_int
                    return

    @property
    def available(self) -> bool:
        return self._set is not None

    @contextlib.contextmanager
    def single(self) -> Iterator[None]:
        """BLAS calls single-threaded, in whichever thread makes them, until the block ends."""
        if self._set is None or self._get is None:
            yield
            return
        threads = self._get()
        self._set(1)
        try:
            yield
        finally:
            self._set(threads)


_blas_threads = _BlasThreads()


class _KernelThreads:
    """The calling thread and helper threads sharing each kernel call's chunks.

    The caller takes chunks at once; each helper, woken by a queue, takes what is left when it
    gets a core. So a helper that the machine has given to another process holds nobody up
    (as a fork-join team's barrier would, for a whole time slice), and one that wakes late
    finds its call's chunks used up and goes back to sleep. Only a helper that loses its
    core in the middle of a chunk keeps the caller waiting; when that costs a call more than
    SLOW_HELPER_SHARE of its time, the cores are busy elsewhere and the next calls run in the
    caller alone, longer each time it happens again (SOLO_CALLS). One call runs at a time. The
    helpers serve the whole process, as BLAS threads do; they start with the first call big
    enough to share.

    A compiled product (`run_compiled`) is published whole in quantized_kernels' call words,
    and a helper watching them runs it without Python: a helper that needed Python's lock for
    each call waited for the caller's Python work between calls and slowed it down. Other
    tasks (`run`) are numbered there and run by the helpers in Python. Compiled code may also
    publish its own products (`run_calls`: a decoding block's four, numbered for it here).
    """

    def __init__(self, helpers: int) -> None:
        self._helpers = helpers
        self._lock = threading.Lock()
        self._inboxes: list[queue.SimpleQueue[None]] = []
        self._solo_calls = 0  # calls left to run alone
        self._solo_next = SOLO_CALLS[0]  # how many after the next slow shared call
        self._call = np.zeros(CALL_WORDS, dtype=np.int64)  # quantized_kernels' published call
        self._number = 0  # the newest call's
        self._latest: Call | None = None  # the newest call to run in Python
        self._read_time: float | None = None  # seconds a read of a wait takes

    def _help(self, inbox: queue.SimpleQueue[None]) -> None:
        """A helper's life: woken, serve the published calls (`serve_calls`) until none came
        for HELPER_WATCH_READS reads, running in Python those that are not compiled."""
        seen = 0
        while True:
            inbox.get()
            while True:
                newest, python_call = serve_calls(self._call, seen, HELPER_WATCH_READS)
                if newest == seen:
                    break
                seen = newest
                latest = self._latest
                if python_call and latest is not None and latest[3] == newest:
                    task, n_chunks, counters, _ = latest
                    task(n_chunks, counters)

    def _start_helpers(self) -> None:
        for index in range(self._helpers):
            inbox: queue.SimpleQueue[None] = queue.SimpleQueue()
            threading.Thread(target=self._help, args=(inbox,), daemon=True,
                             name=f"kernel-helper-{index + 1}").start()
            self._inboxes.append(inbox)

    def _shared_calls(self, work: np.ndarray, minimum: int) -> np.ndarray:
        """Which of the next calls, worth `work` each in order, are shared with the helpers
        (`minimum` the least work worth it): none of those still to run alone after a slow
        shared call, which they count down."""
        shared = (work >= minimum) & (self._helpers > 0)
        shared[: self._solo_calls] = False
        self._solo_calls = max(0, self._solo_calls - len(work))
        if shared.any() and not self._inboxes:
            self._start_helpers()
        return shared

    def _shares(self, work: int) -> bool:
        """Whether the next call, worth `work`, is shared with the helpers."""
        return bool(self._shared_calls(np.array([work]), PARALLEL_MIN_WORK)[0])

    def _next_ticket(self, n_chunks: int, compiled: bool) -> int:
        """Number the next call and wake the helpers not watching for it (all, unless every
        one is): its ticket, for the caller to publish."""
        self._number += 1
        self._wake_helpers()
        return ticket(self._number, n_chunks, compiled)

    def _wake_helpers(self) -> None:
        """Wake the helpers, unless every one is watching for calls already."""
        if self._call[WATCHING] < self._helpers:
            for inbox in self._inboxes:
                inbox.put(None)

    def _count_wait(self, started: float, own_work_done: float) -> None:
        """After a shared call: whether its helpers kept the caller waiting too long."""
        finished = time.perf_counter()
        self._note_wait(finished - started, finished - own_work_done)

    def _note_wait(self, elapsed: float, waited: float) -> None:
        """After shared calls that took `elapsed` seconds, `waited` of them waiting for the
        helpers: whether the helpers kept the caller waiting too long."""
        if waited > SLOW_HELPER_SHARE * elapsed:
            self._solo_calls = self._solo_next
            self._solo_next = min(2 * self._solo_next, SOLO_CALLS[1])
        else:
            self._solo_next = SOLO_CALLS[0]

    @property
    def size(self) -> int:
        """The threads that share a call: the caller and the helpers."""
        return self._helpers + 1

    def run(self, task: ChunkedTask, n_items: int, work: int) -> None:
        """`task(n_chunks, counters)` over `n_items` items worth `work` (weights times rows):
        every thread that calls it with the same counters takes chunks of the items until none
        are left. Shared with the helpers where the work is worth it."""
        with self._lock:
            shared = self._shares(work)
            n_chunks = min(n_items, self.size * CHUNKS_PER_THREAD) if shared else 1
            counters = np.zeros(2, dtype=np.int64)
            if not shared:
                task(n_chunks, counters)
                return
            started = time.perf_counter()
            self._latest = (task, n_chunks, counters, self._number + 1)
            publish(self._call, self._next_ticket(n_chunks, compiled=False))
            task(n_chunks, counters)
            own_work_done = time.perf_counter()
            wait_for_chunks(counters, n_chunks)
            self._count_wait(started, own_work_done)

    def run_calls(self, items: np.ndarray, work: np.ndarray,
                  run: Callable[[np.ndarray, int, np.ndarray], int]) -> None:
        """Compiled code making kernel calls in order (`product_in_call`), call i over
        items[i] items worth work[i] (int64 arrays): run(call words, the first call's number,
        each call's chunks, 0 for a call run alone) -> the reads it spent waiting for the
        helpers."""
        with self._lock:
            shared = self._shared_calls(work, WATCHED_MIN_WORK)
            chunks = np.where(shared, np.minimum(items, self.size * CHUNKS_PER_THREAD), 0)
            first = self._number + 1
            self._number += len(work)
            if shared.any():
                self._wake_helpers()
            started = time.perf_counter()
            reads = run(self._call, first, chunks)
            if reads:
                self._note_wait(time.perf_counter() - started, reads * self._seconds_per_read())

    def _seconds_per_read(self) -> float:
        """How long one read of a wait for the helpers takes (measured once: a watch over a
        call that never comes spins the same loop)."""
        if self._read_time is None:
            reads = 1 << 18
            started = time.perf_counter()
            serve_calls(np.zeros(CALL_WORDS, dtype=np.int64), 0, reads)
            self._read_time = (time.perf_counter() - started) / reads
        return self._read_time

    def run_compiled(self, job: int, data: np.ndarray, parts: np.ndarray, rows: np.ndarray,
                     features: np.ndarray, x: np.ndarray, out: np.ndarray, work: int) -> None:
        """`run_rows(job, ...)` on every feature (see quantized_kernels), shared with the
        helpers where the work is worth it. The arrays must be C-order."""
        with self._lock:
            if not self._shares(work):
                run_rows(job, data, parts, rows, features, x, out, 1,
                         np.zeros(2, dtype=np.int64))
                return
            n_chunks = min(features.size, self.size * CHUNKS_PER_THREAD)
            word = self._next_ticket(n_chunks, compiled=True)
            started = time.perf_counter()
            run_shared(self._call, word, job, data, parts, rows, features, x, out)
            own_work_done = time.perf_counter()
            wait_for_published(self._call, n_chunks)
            self._count_wait(started, own_work_done)


_threads = _KernelThreads(_cores() - 1)


def run_kernel_calls(items: np.ndarray, work: np.ndarray,
                     run: Callable[[np.ndarray, int, np.ndarray], int]) -> None:
    """Run compiled code that makes kernel calls itself (`product_in_call`), shared with the
    kernel threads: see _KernelThreads.run_calls."""
    _threads.run_calls(items, work, run)


@dataclass(frozen=True)
class QuantizedPart:
    """Output features [first, first + rows.size) of a matrix: row `rows[j]` of `blocks`
    (uint8, (n, row bytes), read-only) is output feature first + j."""

    type_name: str
    blocks: np.ndarray
    rows: np.ndarray  # int64
    first: int


def _buffer_of(array: np.ndarray) -> object:
    """The object whose memory `array` views (a view of a whole mapped file, or the array
    owning its memory)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array if array.base is None else array.base


def _one_buffer(arrays: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """A read-only uint8 array holding every array's bytes, and each one's byte offset in it:
    the buffer they all view (a model's mapped file) where they lie in one, else a copy of
    them end to end."""
    data = np.frombuffer(_buffer_of(arrays[0]), dtype=np.uint8)
    offsets = [array.ctypes.data - data.ctypes.data for array in arrays]
    if not all(0 <= offset and offset + array.nbytes <= data.nbytes
               for offset, array in zip(offsets, arrays)):
        data = np.concatenate([array.reshape(-1) for array in arrays])
        offsets = np.cumsum([0] + [array.nbytes for array in arrays[:-1]]).tolist()
    data.flags.writeable = False
    return data, offsets


class QuantizedMatrix:
    """W (out_features, in_features) as parts of GGUF blocks (module doc); `buffer` holds the
    bytes every part lies in (a model's whole mapped file)."""

    def __init__(self, parts: list[QuantizedPart], in_features: int) -> None:
        end = 0
        for part in parts:  # the kernel indexes without bounds checks
            if part.blocks.ndim != 2 or part.blocks.shape[1] != row_bytes(part.type_name,
                                                                          in_features):
                raise ModelFormatError(
                    f"{part.type_name} blocks of shape {part.blocks.shape} are not rows of "
                    f"{in_features} elements")
            if part.rows.size and (part.rows.min() < 0 or part.rows.max() >= len(part.blocks)):
                raise ModelFormatError(f"rows of a {part.type_name} part past its "
                                       f"{len(part.blocks)} rows of blocks")
            if part.first != end:
                raise ModelFormatError(f"a part starts at output feature {part.first}, the "
                                       f"parts before it end at {end}")
            end += part.rows.size
        self.parts = tuple(parts)
        self.in_features = in_features
        self.out_features = end
        self.direct_rows_limit = DIRECT_ROWS_LIMIT
        # What the kernel reads: the bytes, a table of the parts, each feature's row.
        self.buffer, offsets = _one_buffer([part.blocks for part in parts])
        self._parts = np.array(
            [[TYPE_CODES[part.type_name], offset, part.blocks.shape[1], part.first,
              part.first + part.rows.size] for part, offset in zip(parts, offsets)],
            dtype=np.int64)
        self._rows = np.concatenate([part.rows for part in parts])
        self._features = np.arange(end, dtype=np.int64)

    @classmethod
    def of_blocks(cls, type_name: str, blocks: np.ndarray, in_features: int,
                  rows: np.ndarray | None = None) -> QuantizedMatrix:
        """One part: `blocks` (n, row bytes) of `type_name`, its rows taken in `rows` order."""
        return cls([part_of_blocks(type_name, blocks, 0, rows)], in_features)

    @property
    def kernel_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What `run_rows` takes for the whole matrix: data, parts, rows, features."""
        return self.buffer, self._parts, self._rows, self._features

    @property
    def nbytes(self) -> int:
        """Bytes of blocks held (each part's rows, counted once)."""
        return sum(part.blocks.nbytes for part in self.parts)

    def _run(self, job: int, features: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        """`run_rows(job)` on W[features], shared among the kernel threads."""
        width = out.shape[1] if job == DEQUANTIZE else x.shape[0] * x.shape[1]
        _threads.run_compiled(job, self.buffer, self._parts, self._rows, features, x, out,
                              features.size * width)

    def _slab_products(self, x: np.ndarray, out: np.ndarray) -> None:
        """out = x @ W.T a slab of W's rows at a time, dequantized into a reused buffer and
        multiplied by BLAS. Where W as float32 is larger than PER_THREAD_MIN_BYTES and x
        has at most TRANSPOSED_PRODUCT_ROWS rows (the logits of a batch of decoding
        sequences), dequantizing is much of the work: each kernel thread takes slabs and
        multiplies them by BLAS single-threaded. Otherwise (prefill chunks, smaller matrices)
        the caller dequantizes and BLAS's own threads share each product, which they run at a
        higher rate than two single-threaded calls. Measured (gemma-3-270m, 2-core Zen 3):
        the (64, 640) x (640, 262144) logits take 184-200 ms each thread on its own slabs
        against 280-350 ms with BLAS's threads; the layers' matrices run 5-20% faster, and
        prefill's 512 rows up to 1.5x, with BLAS's threads."""
        narrow = len(x) <= TRANSPOSED_PRODUCT_ROWS
        per_thread = (narrow and _blas_threads.available
                      and 4 * self.in_features * self.out_features > PER_THREAD_MIN_BYTES)
        if per_thread:
            # Slabs enough for every thread to take several (an uneven last share leaves a
            # core idle), each at most SLAB_BYTES.
            slab_rows = min(SLAB_BYTES // (4 * self.in_features),
                            -(-self.out_features // (SLABS_PER_THREAD * _threads.size)))
        else:
            slab_rows = SHARED_SLAB_BYTES // (4 * self.in_features)
        slab_rows = max(slab_rows, MIN_SLAB_ROWS)
        n_slabs = -(-self.out_features // slab_rows)

        def task(n_chunks: int, counters: np.ndarray) -> None:
            slab = _scratch_buffer("slab", (slab_rows, self.in_features))
            product = _scratch_buffer("product", (slab_rows, len(x))) if narrow else None
            chunk = claim_chunk(counters)
            while chunk < n_chunks:
                for index in range(chunk * n_slabs // n_chunks,
                                   (chunk + 1) * n_slabs // n_chunks):
                    features = self._features[index * slab_rows : (index + 1) * slab_rows]
                    levels = slab[: features.size]
                    run_rows(DEQUANTIZE, self.buffer, self._parts, self._rows, features,
                             levels[:0], levels, 1, np.zeros(2, dtype=np.int64))
                    columns = out[:, features[0] : features[-1] + 1]
                    if product is None:
                        np.matmul(x, levels.T, out=columns)
                    else:
                        np.matmul(levels, x.T, out=product[: features.size])
                        columns[...] = product[: features.size].T
                finish_chunk(counters)
                chunk = claim_chunk(counters)

        if not per_thread:  # the caller's slabs, BLAS's threads in each product
            task(1, np.zeros(2, dtype=np.int64))
            return
        with _blas_threads.single():
            _threads.run(task, n_slabs, len(x) * self.in_features * self.out_features)

    def apply(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = x @ W.T for x (n, in_features) float32, into out (n, out_features) float32 in
        C order. The kernel indexes without bounds checks, so the shapes are checked here."""
        x = _float32_rows(x, self.in_features, "x")
        if out.dtype != np.float32 or not out.flags.c_contiguous or out.shape != (
            x.shape[0], self.out_features
        ):
            raise InvalidRequest(
                f"out must be C-order float32 of shape {(x.shape[0], self.out_features)}, got "
                f"{out.dtype} {out.shape}", field="out")
        if x.shape[0] <= self.direct_rows_limit:
            self._run(MATVEC, self._features, x, out)
        else:
            self._slab_products(x, out)
        return out

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """W[ids] as float32 (len(ids), in_features): the embedding's rows of tokens."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= self.out_features)):
            raise InvalidRequest(f"ids must be a list of rows below {self.out_features}",
                                 field="ids")
        out = np.empty((ids.size, self.in_features), dtype=np.float32)
        self._run(DEQUANTIZE, ids, out[:0], out)
        return out


def _float32_rows(x: np.ndarray, width: int, field: str) -> np.ndarray:
    """x as a writable C-order float32 (n, width) array (what the one compiled kernel takes),
    copied only where it is not one already."""
    if x.ndim != 2 or x.shape[1] != width:
        raise InvalidRequest(f"{field} must have shape (n, {width}), got {x.shape}", field=field)
    if x.dtype != np.float32 or not x.flags.c_contiguous or not x.flags.writeable:
        return np.array(x, dtype=np.float32, order="C")
    return x


def part_of_blocks(type_name: str, blocks: np.ndarray, first: int,
                   rows: np.ndarray | None = None) -> QuantizedPart:
    """A part from a tensor's (n, row bytes) blocks, its rows taken in `rows` order (None: as
    stored), starting at output feature `first`."""
    block_format(type_name)  # UnsupportedModelError for a type nobody decodes
    order = np.arange(len(blocks), dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    return QuantizedPart(type_name, blocks, np.ascontiguousarray(order), first)
