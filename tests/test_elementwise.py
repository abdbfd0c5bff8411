"""The compiled element-wise pieces against float64: exp, the gated activations, softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors.model.attention import masked_softmax
from actors.model.elementwise import ACTIVATION_CODES, exp_in_place, gate_rows

# float32's unit roundoff: the pieces stay within a few of it of float64.
ROUNDOFF = 2.0**-24


def exp32(values: np.ndarray) -> np.ndarray:
    out = np.array(values, dtype=np.float32)
    exp_in_place(out, np.empty(out.size, dtype=np.int32))
    return out


def test_exp_is_within_two_roundoffs_of_float64_over_float32s_range() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-87.0, 88.0, 200_000),
                        np.linspace(-1.0, 1.0, 20_001),
                        np.arange(-87, 89)]).astype(np.float32)
    got = exp32(x)
    relative = np.abs(got / np.exp(x.astype(np.float64)) - 1.0)
    assert relative.max() < 2 * ROUNDOFF


def test_exp_edges() -> None:
    got = exp32(np.array([-np.inf, -1000.0, -87.5, 0.0, 89.0, 1000.0, np.inf, np.nan],
                         dtype=np.float32))
    np.testing.assert_array_equal(got[:4], [0.0, 0.0, 0.0, 1.0])
    assert np.isposinf(got[4:7]).all()
    assert np.isnan(got[7])


@pytest.mark.parametrize("length", [1, 7, 8, 9, 33, 2048])
def test_exp_writes_every_element_of_any_length(length: int) -> None:
    x = np.linspace(-3.0, 3.0, length, dtype=np.float32)
    np.testing.assert_allclose(exp32(x), np.exp(x.astype(np.float64)), rtol=2 * ROUNDOFF)


def gelu_tanh_exponent(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + tanh(c (x + 0.044715 x^3))) = x / (1 + exp(this))."""
    return -2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)


@pytest.mark.parametrize(("activation", "exponent"),
                         [("silu", np.negative), ("gelu_tanh", gelu_tanh_exponent)])
def test_gate_rows_is_act_of_gate_times_up(activation: str, exponent) -> None:
    rng = np.random.default_rng(1)
    tokens, ffn = 5, 300
    gate_up = (rng.standard_normal((tokens, 2 * ffn)) * 4).astype(np.float32)
    gate_up[0, :4] = [-100.0, 100.0, 0.0, -1e30]  # exp past float32's range, the zero
    gated = np.full((tokens, ffn), np.nan, dtype=np.float32)
    gate_rows(gate_up, ACTIVATION_CODES[activation], gated)
    gate, up = gate_up[:, :ffn].astype(np.float64), gate_up[:, ffn:].astype(np.float64)
    z = exponent(gate)
    with np.errstate(over="ignore"):
        expected = gate / (1.0 + np.exp(z)) * up
    # float32's roundings in the exponent z (up to 4 of them) move exp(z) by 4 |z| roundoffs:
    # the form's own conditioning, beside the few roundoffs of exp and the arithmetic.
    bound = (8 + 4 * np.minimum(np.abs(z), 100)) * ROUNDOFF * np.abs(expected) + 1e-30
    assert (np.abs(gated - expected) <= bound).all()


def test_masked_softmax_matches_float64_and_gives_masked_keys_zero() -> None:
    rng = np.random.default_rng(2)
    batch, heads, n, keys = 2, 3, 5, 40
    scores = (rng.standard_normal((batch, heads, n, keys)) * 10).astype(np.float32)
    visible = rng.random((batch, n, keys)) < 0.6
    visible[..., 0] = True
    bias = np.where(visible, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
    masked = scores.astype(np.float64) + bias[:, None]
    expected = np.exp(masked - masked.max(axis=-1, keepdims=True))
    expected /= expected.sum(axis=-1, keepdims=True)
    masked_softmax(scores, bias)
    np.testing.assert_allclose(scores, expected, rtol=8 * ROUNDOFF, atol=1e-7)
    assert (scores[np.broadcast_to(~visible[:, None], scores.shape)] == 0.0).all()
