"""The forward pass against the reference logits (tests/reference/README.md).

1. logits_exact.npz (transformers, exact f32 dequantization): max |delta| <= 0.02 over the
   top-16 logits at every position of every sequence of all four models.
2. logits.npz (llama.cpp, 8-bit activations): top-1 agreement >= 94% over all positions of
   the two real models together.

Each model's sequences are scored once (module-scoped); only the columns and argmaxes the
checks need are kept, not the (n, 262144) rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from actors.model.loaded import load_model
from tests.conftest import REFERENCE_DIR, TINY_MODELS, gemma3_path, smollm2_path

EXACT_TOLERANCE = 0.02
TOP1_AGREEMENT = 0.94
REAL_MODELS = ("gemma3-270m", "smollm2-135m")
ALL_MODELS = (*TINY_MODELS, *REAL_MODELS)


@dataclass(frozen=True)
class SequenceScore:
    tokens: np.ndarray
    at_exact_ids: np.ndarray  # our logits at logits_exact's top-16 ids, (n, 16)
    exact_logits: np.ndarray  # logits_exact's top-16 logits, (n, 16)
    our_top1: np.ndarray  # (n,)
    llama_cpp_top1: np.ndarray  # (n,)


def _model_path(name: str) -> Path:
    if name in TINY_MODELS:
        return TINY_MODELS[name]
    return gemma3_path() if name == "gemma3-270m" else smollm2_path()


def _score_model(name: str) -> list[SequenceScore]:
    model = load_model(_model_path(name))
    exact = np.load(REFERENCE_DIR / name / "logits_exact.npz")
    llama_cpp = np.load(REFERENCE_DIR / name / "logits.npz")
    n_sequences = sum(1 for key in llama_cpp.files if key.endswith("_tokens"))
    scores = []
    for index in range(n_sequences):
        tokens = llama_cpp[f"seq{index}_tokens"]
        exact_ids = exact[f"seq{index}_topk_ids"]
        logits = model.logits(tokens.tolist())
        scores.append(SequenceScore(
            tokens=tokens,
            at_exact_ids=np.take_along_axis(logits, exact_ids, axis=1),
            exact_logits=exact[f"seq{index}_topk_logits"],
            our_top1=logits.argmax(axis=1),
            llama_cpp_top1=llama_cpp[f"seq{index}_topk_ids"][:, 0],
        ))
        del logits
    return scores


@pytest.fixture(scope="module")
def scored() -> dict[str, list[SequenceScore]]:
    return {name: _score_model(name) for name in ALL_MODELS}


@pytest.mark.parametrize("name", ALL_MODELS)
def test_matches_exact_reference_at_every_position(
    scored: dict[str, list[SequenceScore]], name: str
) -> None:
    for index, score in enumerate(scored[name]):
        assert score.at_exact_ids.shape == score.exact_logits.shape == (len(score.tokens), 16)
        delta = np.abs(score.at_exact_ids - score.exact_logits)
        worst = np.unravel_index(delta.argmax(), delta.shape)
        assert delta.max() <= EXACT_TOLERANCE, (
            f"{name} seq{index}: max |delta| {delta.max():.4f} at position {worst[0]}"
        )


def test_long_gemma_sequence_crosses_the_sliding_window(
    scored: dict[str, list[SequenceScore]],
) -> None:
    # The exact check above is only meaningful for the window if a sequence is longer than it.
    assert max(len(s.tokens) for s in scored["gemma3-270m"]) > 512


def test_top1_agrees_with_llama_cpp(scored: dict[str, list[SequenceScore]]) -> None:
    agree = sum(int((s.our_top1 == s.llama_cpp_top1).sum()) for m in REAL_MODELS
                for s in scored[m])
    total = sum(len(s.tokens) for m in REAL_MODELS for s in scored[m])
    assert agree / total >= TOP1_AGREEMENT, f"top-1 agreement {agree}/{total}"
