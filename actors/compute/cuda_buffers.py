"""The CUDA backend's step buffers on the device: the workspace (actors.compute.cuda_memory's
buffers) and its two lanes, each with the pinned input buffer its step arrays go through.
Imports pycuda, as actors.compute.cuda does (and only it imports this module)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pycuda.driver as cuda

from actors.compute import cuda_memory as memory
from actors.compute import cuda_packing as packing
from actors.compute import cuda_plan as plan


class InputBuffer:
    """A device buffer of int32 words and its pinned host twin: packed arrays go to the
    device through it in one asynchronous copy."""

    def __init__(self, words: int) -> None:
        self.words = words
        self.device = cuda.mem_alloc(words * 4)
        self.pinned = cuda.pagelocked_empty(words, np.int32)

    def upload(self, packed: packing.PackedArrays, stream: cuda.Stream) -> dict[str, int]:
        """Queue the copy of `packed` (which must fit); each array's device address. The
        pinned words must not be rewritten before the stream has run the copy."""
        words = packed.buffer.size
        self.pinned[:words] = packed.buffer
        cuda.memcpy_htod_async(self.device, self.pinned[:words], stream)
        return {name: int(self.device) + 4 * offset for name, offset in packed.offsets.items()}

    def free(self) -> None:
        self.device.free()
        self.pinned.base.free()


class Lane:
    """What a step keeps apart from the step queued beside it: the step arrays' input buffer
    (its decode graphs read it), its logits rows (fetch_rows reads them after it) and the
    pinned candidate records it answers from; the event that marks its end."""

    def __init__(self, logits: Any, limits: memory.StepLimits, input_words: int) -> None:
        self.logits = logits
        self.input = InputBuffer(input_words)
        record = plan.candidate_record_words(limits.max_candidates)
        self.pinned_candidates = cuda.pagelocked_empty(limits.max_rows * record, np.int32)
        self.done = cuda.Event()

    def free(self) -> None:
        self.input.free()
        self.pinned_candidates.base.free()


class Workspace:
    """The step's device buffers (cuda_memory.workspace_buffers) and its two lanes (the second
    with logits rows of its own), sized for `limits` and `input_words` int32s."""

    def __init__(self, spec: Any, limits: memory.StepLimits, input_words: int) -> None:
        self.limits = limits
        sizes = memory.workspace_buffers(spec, limits)
        self.buffers = {name: cuda.mem_alloc(max(size, 4)) for name, size in sizes.items()}
        for name in memory.ZEROED_BUFFERS:  # the kernels' cross-block counters start at zero
            cuda.memset_d32(self.buffers[name], 0, sizes[name] // 4)
        cuda.Context.synchronize()  # zeroed before any stream's first launch reads them
        self.lanes = (Lane(self.buffers["logits"], limits, input_words),
                      Lane(self.buffers["logits_ahead"], limits, input_words))

    def covers(self, tokens: int, rows: int, input_words: int) -> bool:
        return (tokens <= self.limits.max_tokens and rows <= self.limits.max_rows
                and input_words <= self.lanes[0].input.words)

    def free(self) -> None:
        for allocation in self.buffers.values():
            allocation.free()
        for lane in self.lanes:
            lane.free()
