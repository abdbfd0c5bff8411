"""Fault injection: a wrapper around any backend that fails the steps of chosen sequences.

For testing what an application (and the engine) does when compute goes wrong: a `Fault`
picks sequences by the first tokens of their prompt and, in every step that carries one of
them (up to `times` steps), makes the step raise, answers NaN logits for those sequences'
rows, or hangs for `hang_s` seconds before running it. The engine's contract says what must
follow: the hit sequences replay (alone) or fail with `ComputeError`; every other request
completes with exactly the tokens it gives alone.

    backend = FaultyBackend(inner, [Fault(kind="nan", prompt_prefix=(1, 2, 3), times=2)])
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import numpy as np

from actors.compute.contract import Candidates, ComputeBackend, ComputeInfo, RowInputs, StepItem

FAULT_KINDS = ("raise", "nan", "hang")


class InjectedFault(RuntimeError):
    """What a step hit by a `raise` fault raises."""


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """Hit the steps of the sequences whose prompt starts with `prompt_prefix`, at most
    `times` steps (None: every one)."""

    kind: str  # one of FAULT_KINDS
    prompt_prefix: tuple[int, ...]
    times: int | None = None
    hang_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {FAULT_KINDS}")
        if not self.prompt_prefix:
            raise ValueError("a fault needs a prompt prefix to pick its sequences")


class FaultyBackend:
    """`inner` with `faults` injected; counts what it injected in `injected` (kind -> steps)."""

    def __init__(self, inner: ComputeBackend, faults: Sequence[Fault]) -> None:
        self._inner = inner
        self._faults = tuple(faults)
        self._left = [fault.times for fault in self._faults]
        self._targets: list[set[int]] = [set() for _ in self._faults]
        self.injected = {kind: 0 for kind in FAULT_KINDS}

    @property
    def info(self) -> ComputeInfo:
        return self._inner.info

    def run(self, items: Sequence[StepItem], rows: Sequence[RowInputs]) -> Candidates:
        hits = self._hits(items)
        for index, hit_items in hits:
            kind = self._faults[index].kind
            self.injected[kind] += 1
            if kind == "raise":
                raise InjectedFault(f"injected failure for sequences {sorted(hit_items)}")
            if kind == "hang":
                time.sleep(self._faults[index].hang_s)
        candidates = self._inner.run(items, rows)
        poisoned = {seq for index, seqs in hits if self._faults[index].kind == "nan"
                    for seq in seqs}
        if not poisoned:
            return candidates
        logit_items = [item for item in items if item.want_logits]
        bad = [row for row, item in enumerate(logit_items) if item.seq_id in poisoned]
        logits = candidates.logits.copy()
        logits[bad] = np.nan
        return msgspec.structs.replace(candidates, logits=logits)

    def fetch_rows(self, indices: Sequence[int]) -> np.ndarray:
        return self._inner.fetch_rows(indices)

    def close(self) -> None:
        self._inner.close()

    def _hits(self, items: Sequence[StepItem]) -> list[tuple[int, set[int]]]:
        """(fault index, the sequences of this step it hits) for every fault that fires."""
        hits = []
        for index, fault in enumerate(self._faults):
            targets = self._targets[index]
            prefix = fault.prompt_prefix
            targets.update(
                item.seq_id for item in items
                if item.start == 0 and tuple(item.tokens[: len(prefix)]) == prefix
            )
            in_step = {item.seq_id for item in items} & targets
            if in_step and self._left[index] != 0:
                if self._left[index] is not None:
                    self._left[index] -= 1
                hits.append((index, in_step))
        return hits
