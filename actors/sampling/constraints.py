"""The constraint workers: a few threads that advance constrained sequences' constraints by
their chosen tokens, off the shared step.

Once a step's tokens are chosen, every unconstrained sequence gets its token at once; a
constrained one waits for its own constraint to consume the token, take the tokens the
grammar then forces and compute the next mask (milliseconds, up to the parser limits for a
costly grammar). That work runs here, one sequence per job, on `CONSTRAINT_THREADS` threads
taking jobs in order, so a costly mask delays only its own sequence: the scheduler leaves it
out of the steps until its answer comes (`ConstraintAdvanced`, sent into the scheduler's
inbox), and the others go on stepping.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import anyio
import msgspec

from actors.channels import LoopSender, ThreadReceiver
from actors.compute.actor import run_in_own_thread

# Threads advancing constraints at once: masks run without the GIL, a core each; half the
# cores, so costly masks leave the other half to the steps (measured on 2 cores with eight
# rows of 25-60 ms masks: a plain stream beside them slowed 3.4x with 2 threads, against
# 2.6x beside eight plain rows).
CONSTRAINT_THREADS = max(1, (os.cpu_count() or 2) // 2)
# Their CPU priority below the steps' (a nice value; Linux, where a thread is a task of its
# own): where cores are short, a costly mask takes the time the steps leave.
CONSTRAINT_NICENESS = 10


class AdvanceConstraint(msgspec.Struct, frozen=True, kw_only=True):
    """Feed `token`, chosen for sequence `seq_id`, to its constraint (`sampler.constraint`);
    the tokens it forces then join `sampler`'s history."""

    seq_id: int
    token: int
    sampler: Any  # actors.sampling.SequenceSampling


class ReleaseConstraint(msgspec.Struct, frozen=True, kw_only=True):
    """A request ended: free its constraint's matcher here, not on the event loop (a large
    grammar's takes tens of milliseconds, holding the GIL)."""

    constraint: Any  # actors.structured.Constraint


class ConstraintAdvanced(msgspec.Struct, frozen=True, kw_only=True):
    """A sequence's constraint took its token: the tokens it forces after it (consumed), and
    whether it is complete; or why it failed (the request then fails, naming its constraint)."""

    seq_id: int
    forced: tuple[int, ...] = ()
    done: bool = False
    error: str | None = None


class ConstraintWorkers:
    """The actor: `CONSTRAINT_THREADS` threads sharing one inbox of jobs, answering each
    `AdvanceConstraint` into `outbox` (the scheduler's inbox)."""

    def __init__(
        self,
        inbox: ThreadReceiver[AdvanceConstraint | ReleaseConstraint],
        outbox: LoopSender[Any],
        threads: int = CONSTRAINT_THREADS,
    ) -> None:
        self._inbox = inbox
        self._outbox = outbox
        self._threads = threads

    async def run(self) -> None:
        """The actor task: until the inbox closes (its threads finish the job in hand)."""
        with self._inbox:
            async with anyio.create_task_group() as threads:
                for number in range(self._threads):
                    threads.start_soon(run_in_own_thread, f"q4k-constraint-{number}",
                                       self._serve, None, self._inbox.close)

    def _serve(self) -> None:
        _lower_this_threads_priority()
        while (job := self._inbox.receive()) is not None:
            if isinstance(job, ReleaseConstraint):
                job.constraint.release()
            elif not self._outbox.send_from_thread(advance(job)):
                return


def _lower_this_threads_priority() -> None:
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CONSTRAINT_NICENESS)
        except OSError:  # not allowed here: the masks share the cores as they are
            pass


def advance(job: AdvanceConstraint) -> ConstraintAdvanced:
    """Run one job; any failure is an answer, never a crash."""
    sampler = job.sampler
    try:
        advanced = sampler.constraint.advance(job.token)
        for token in advanced.forced:
            sampler.record(token)
    except Exception as exc:
        return ConstraintAdvanced(seq_id=job.seq_id,
                                  error=f"the structured output constraint failed: "
                                        f"{type(exc).__name__}: {exc}")
    return ConstraintAdvanced(seq_id=job.seq_id, forced=advanced.forced, done=advanced.done,
                              error=advanced.error)
