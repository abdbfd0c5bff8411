"""The CPU compute backend: the numpy forward, its weight matrices kept as the file's
quantized blocks (actors.model.quantized), over a float32 paged KV pool. The same forward over
float32 weights (`load_float32`) is the reference every other backend is tested against."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from actors.compute.contract import (
    Candidates,
    ComputeInfo,
    KVRequest,
    RowInputs,
    StepItem,
    apply_penalties,
    apply_token_masks,
    plan_step,
    top_candidates,
)
from actors.errors import InvalidRequest
from actors.model.arch import ModelSpec
from actors.model.loaded import Model, OpenedModel, load_quantized
from actors.progress import Progress, progress_callback

# The K/V arrays are float32 on the host.
KV_DTYPE = np.float32
# Unless the caller sizes the pool in blocks, it holds the model's whole context once (the
# longest request it takes) or this many positions per sequence the engine runs, whichever is
# more; its pages are only resident once written.
KV_POSITIONS_PER_SEQUENCE = 1024
# ... but never more than this share of the memory the machine has available.
KV_MEMORY_SHARE = 0.5
MEMINFO = Path("/proc/meminfo")
STATM = Path("/proc/self/statm")
# The warm-up's steps: a prefill of this many tokens, then one decoding step.
WARM_UP_PROMPT = 2
WARM_UP_TASK = "preparing the CPU kernels (compiled on a machine's first run, then cached)"
_warmed_up = False  # the kernels compile once a process


class CpuBackend:
    """Owns a float32 model and its KV pool; runs `Model.step` and the candidates on them."""

    def __init__(
        self, model: Model, num_blocks: int, block_size: int, notices: Sequence[str] = ()
    ) -> None:
        self._model = model
        self._kv = model.new_kv_pool(num_blocks, block_size)
        self._last_rows = np.zeros((0, model.spec.vocab_size), dtype=np.float32)
        self._logits = self._last_rows
        self.info = ComputeInfo.of_model(
            model.spec,
            on_gpu=False,
            num_blocks=num_blocks,
            block_size=block_size,
            kv_dtype=np.dtype(KV_DTYPE).name,
            notices=tuple(notices),
        )
        self._warm_up()

    def _warm_up(self) -> None:
        """The process's first backend runs a tiny prefill and a decoding step on the pool's
        first blocks (overwritten before any sequence reads them): numba compiles every kernel
        a step takes on its first call, about two and a half minutes on a fresh install, and
        this way that happens here, under a progress bar, not inside the first request. The
        steps are this class's own (a subclass's `run` may count or refuse steps)."""
        global _warmed_up
        if _warmed_up:
            return
        blocks = tuple(range(-(-(WARM_UP_PROMPT + 1) // self._kv.block_size)))
        if len(blocks) > self._kv.num_blocks:
            return
        greedy = [RowInputs(candidates=1)]
        with Progress(WARM_UP_TASK, 2) as progress:
            first = CpuBackend.run(self, [StepItem(tuple(range(WARM_UP_PROMPT)), 0, blocks)],
                                   greedy)
            progress.advance()
            CpuBackend.run(self, [StepItem((int(first.ids[0, 0]),), WARM_UP_PROMPT, blocks)],
                           greedy)
            progress.advance()
        self._last_rows = self._last_rows[:0]
        _warmed_up = True

    def run(self, items: Sequence[StepItem], rows: Sequence[RowInputs]) -> Candidates:
        # Forget the last step's rows first: a failed step leaves nothing to fetch.
        self._last_rows = self._last_rows[:0]
        plan = plan_step(items, self._model.spec, self._kv.num_blocks, self._kv.block_size)
        if len(rows) != len(plan.logit_rows):
            raise InvalidRequest(
                f"{len(rows)} row inputs for {len(plan.logit_rows)} items that want logits",
                field="rows",
            )
        logits = self._model.run_plan(plan, self._kv, self._logits_buffer(len(rows)))
        apply_token_masks(logits, rows)
        apply_penalties(logits, rows)
        self._last_rows = logits
        return top_candidates(logits, rows)

    def _logits_buffer(self, n_rows: int) -> np.ndarray:
        """(n_rows, vocab) float32 rows of a buffer kept from step to step: a fresh one each
        step (64 MB at 64 rows of gemma-3's vocabulary) costs its page faults every step, a
        third of a 64-row step's logits product on a machine with slow faults. The last
        step's rows are a view of it, dropped before the next step writes it."""
        if len(self._logits) < n_rows:
            self._logits = np.empty((n_rows, self._model.spec.vocab_size), dtype=np.float32)
        return self._logits[:n_rows]

    def fetch_rows(self, indices: Sequence[int]) -> np.ndarray:
        index = np.asarray(indices, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= len(self._last_rows)):
            raise InvalidRequest(
                f"rows {list(indices)} are not all rows of the last step "
                f"({len(self._last_rows)} rows)", field="rows",
            )
        return self._last_rows[index]

    def close(self) -> None:
        # The pool can be gigabytes; drop it now rather than when the engine is collected.
        self._kv = None
        self._last_rows = self._logits = None


def available_memory_bytes() -> int:
    """Memory the machine can give without swapping: MemAvailable on Linux (the page cache
    counts as available), else the physical memory."""
    try:
        with MEMINFO.open() as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resident_bytes() -> int | None:
    """This process's resident memory: now on Linux, its peak elsewhere (macOS), None where
    neither can be read."""
    try:
        return int(STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def kv_budget_bytes(spec: ModelSpec, max_sequences: int, available_bytes: int) -> int:
    """The default KV pool's bytes: the model's whole context once, or
    KV_POSITIONS_PER_SEQUENCE for each of `max_sequences`, whichever is more, within
    KV_MEMORY_SHARE of `available_bytes`."""
    positions = max(spec.context_length, max_sequences * KV_POSITIONS_PER_SEQUENCE)
    per_position = spec.kv_bytes_per_token(np.dtype(KV_DTYPE).itemsize)
    return min(positions * per_position, int(KV_MEMORY_SHARE * available_bytes))


def build_cpu_backend(model: OpenedModel, kv: KVRequest, notices: Sequence[str]) -> CpuBackend:
    """The CPU backend for `model`: its weights as the file's quantized blocks (or those of an
    already loaded `Model`), a float32 KV pool sized by `kv_budget_bytes` unless `kv` sizes
    it."""
    if isinstance(model, Model):  # already loaded (e.g. shared by `Engine.open(model)`)
        loaded = model
    else:
        with progress_callback("loading the model weights") as report:
            loaded = load_quantized(model, report)
    spec = loaded.spec
    block_bytes = kv.block_size * spec.kv_bytes_per_token(np.dtype(KV_DTYPE).itemsize)
    budget = kv_budget_bytes(spec, kv.max_sequences, available_memory_bytes())
    num_blocks = kv.blocks_within(budget, block_bytes, spec.context_length)
    return CpuBackend(loaded, num_blocks, kv.block_size, notices)
