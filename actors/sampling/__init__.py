"""Token choice: each row's candidates + its sequence's SamplingParams -> the next tokens.

The backend hands over, per logits row, its most likely tokens after the penalties and the
row's log-partition value (see actors.model.candidates); most rows are decided from those
alone. A row its candidates cannot decide asks for its whole (penalized) row, and only that
row crosses: `start_choice` decides what it can and names the rows it needs,
`finish_choice` decides those from their rows. `choose_tokens` runs the whole pipeline on
full rows (the reference for tests and benchmarks); `SamplerActor` runs it for the engine.

Modules: `state` (one sequence's SamplingParams, Generator, token history and constraint; a
row's TokenChoice or RowFailed), `from_candidates` (`start_choice`), `whole_row`
(`finish_choice`: candidate tables from whole rows), `nucleus` (top-p nuclei too wide to
sort), `batch` (the params as per-row arrays and CDF inversion, which the paths share),
`pipeline` (`choose_tokens`), `actor` (`SamplerActor` and its messages) and `constraints`
(`ConstraintWorkers`: a constrained row's token fed to its constraint, off the shared step).

One row goes through (the Hugging Face / vLLM order):

1. penalties on the raw logits (applied by the backend: repetition over the distinct tokens
   of the last `repetition_window` of prompt + generated, then presence and frequency over
   the generated tokens);
2. temperature: `l / T`; T = 0 (or below 1e-5) is greedy: the argmax of the penalized logits,
   lowest id on ties;
3. top-k; then top-p over the distribution renormalized to the top-k survivors (to the whole
   vocabulary when top_k is 0); then min-p: keep tokens at least `min_p` times as likely as the
   most likely one. The most likely token always survives;
4. one uniform from the sequence's own Generator, inverted through the survivors' CDF, so a
   seeded sequence gets the same tokens whatever else shares its batch. The CDF runs most
   likely first (ties by id); an unfiltered row's runs through its candidates first, then the
   rest of the vocabulary in id order (so only a uniform past the candidates' mass needs the
   row); a top-p nucleus too wide to sort is inverted in vocabulary order (see `nucleus`).
   Which order a row uses depends on its own logits and params alone.

Logprobs are the log-softmax, over the whole vocabulary, of step 2's distribution (penalties and
temperature applied, before top-k/top-p/min-p); greedy rows use T = 1, i.e. the penalized model
distribution.
"""

from __future__ import annotations

from actors.sampling.actor import (
    RowsWanted,
    SampleRows,
    SampleStep,
    SamplerActor,
    SamplingFailed,
    StepSampled,
    sample,
)
from actors.sampling.constraints import (
    AdvanceConstraint,
    ConstraintAdvanced,
    ConstraintWorkers,
    ReleaseConstraint,
)
from actors.sampling.from_candidates import PendingChoice, start_choice
from actors.sampling.pipeline import choose_tokens
from actors.sampling.state import RowFailed, SequenceSampling, TokenChoice
from actors.sampling.whole_row import finish_choice

__all__ = [
    "AdvanceConstraint",
    "ConstraintAdvanced",
    "ConstraintWorkers",
    "PendingChoice",
    "ReleaseConstraint",
    "RowFailed",
    "RowsWanted",
    "SampleRows",
    "SampleStep",
    "SamplerActor",
    "SamplingFailed",
    "SequenceSampling",
    "StepSampled",
    "TokenChoice",
    "choose_tokens",
    "finish_choice",
    "sample",
    "start_choice",
]
