"""Samples shared by the CUDA tests (the host tests and tests/gpu): blocks of every GGUF block
type (random bytes with sane float16 scales, or finite values only), random row inputs, the
numpy twins of apply_penalties and top_candidates, greedy decoding with other streams
sharing the steps (the batch-invariance check) and constrained steps (structured output's
token masks) against the CPU reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from actors.compute.cuda_plan import MATVEC_MMA_MAX_ROWS, candidate_record_words
from actors.model.candidates import mask_words
from actors.model.elementwise import ACTIVATION_CODES, gate_rows
from actors.model.candidates import (
    Candidates,
    RowInputs,
    apply_penalties,
    apply_token_masks,
    top_candidates,
)
from actors.model.gguf.quantizers import QUANTIZERS, quantize
from actors.model.gguf.quants import FORMATS, row_bytes
from actors.model.step import StepItem

SPLIT_GROUP = 32  # cuda_src/activation_split.cuh: the elements that share a split's exponent
# Byte offsets of each quantized type's float16 scale fields (d, and m / dmin where it has one).
HALF_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def random_blocks(type_name: str, rows: int, row_length: int,
                  rng: np.random.Generator) -> np.ndarray:
    """(rows, row bytes) of random bytes (every byte pattern is a block), with the scale
    halves of the quantized types replaced by random finite halves in [-2, 2]."""
    raw = rng.integers(0, 256, (rows, row_bytes(type_name, row_length)), dtype=np.uint8)
    if type_name in HALF_FIELDS:
        blocks = raw.reshape(-1, FORMATS[type_name].type_size)
        for start in HALF_FIELDS[type_name]:
            halves = rng.uniform(-2.0, 2.0, len(blocks)).astype(np.float16)
            blocks[:, start : start + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw


def finite_blocks(type_name: str, rows: int, row_length: int,
                  rng: np.random.Generator) -> np.ndarray:
    """(rows, row bytes) of blocks holding only finite values: standard normal floats
    quantized where the project has a quantizer, random blocks with sane scales (Q4_0, Q4_1),
    or the floats converted (BF16 by truncation)."""
    values = rng.standard_normal((rows, row_length)).astype(np.float32)
    if type_name in QUANTIZERS:
        return quantize(values, type_name)
    if type_name in HALF_FIELDS:
        return random_blocks(type_name, rows, row_length, rng)
    if type_name == "F16":
        return values.astype(np.float16).view(np.uint8)
    if type_name == "BF16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return values.view(np.uint8)


def assert_same_floats(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal bit patterns wherever the value is a number; NaN exactly where numpy has NaN (a
    NaN's payload is not part of the format: hardware conversions may quiet it)."""
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan)
    mismatch = actual.view(np.uint32)[~nan] != expected.view(np.uint32)[~nan]
    assert not mismatch.any(), (
        f"{mismatch.sum()} values differ, first: got {actual[~nan][mismatch][0]!r} "
        f"numpy {expected[~nan][mismatch][0]!r}"
    )


def random_row_inputs(rng: np.random.Generator, n: int, vocab: int) -> list[RowInputs]:
    """Rows mixing every kind of candidate, penalty and logit bias input (the biased tokens
    may be penalized too)."""
    rows = []
    for _ in range(n):
        generated = rng.choice(vocab, size=int(rng.integers(0, 12)), replace=False)
        biased = np.unique(np.concatenate([
            generated[: int(rng.integers(0, 3))],
            rng.choice(vocab, size=int(rng.integers(0, 6)), replace=False)]))
        rows.append(RowInputs(
            candidates=int(rng.integers(1, 20)), max_candidates=int(rng.integers(1, 300)),
            mass=float(rng.choice([0.0, 0.5, 0.9, 0.999])), inv_temp=float(rng.uniform(0.3, 3)),
            want_log_z=bool(rng.integers(2)),
            repetition_penalty=float(rng.choice([1.0, 1.3])),
            repeated=tuple(int(i) for i in rng.choice(vocab, size=int(rng.integers(0, 8)),
                                                      replace=False)),
            presence_penalty=float(rng.choice([0.0, 0.4])),
            frequency_penalty=float(rng.choice([0.0, 0.25])),
            generated=tuple(int(i) for i in generated),
            generated_counts=tuple(int(c) for c in rng.integers(1, 5, size=generated.size)),
            bias_tokens=tuple(int(i) for i in biased),
            bias_values=tuple(float(v) for v in rng.uniform(-100, 100, biased.size)),
        ))
    return rows


def top_candidates_twin(logits: np.ndarray, arrays: dict[str, np.ndarray],
                         width: int) -> np.ndarray:
    """top_candidates' records, computed as the kernel does: exact top `most`, float32 log_z
    and running weights, count = min(k, max(least, below + margin))."""
    least, most = arrays["least"], arrays["most"]
    mass, inv_temp = arrays["mass"].view(np.float32), arrays["inv_temp"].view(np.float32)
    records = np.zeros((len(logits), candidate_record_words(width)), dtype=np.int32)
    for row, values in enumerate(logits):
        k = int(most[row])
        order = np.lexsort((np.arange(values.size), -values))[:k]
        top = values[order[0]]
        weights = np.exp((values - top) * inv_temp[row], dtype=np.float32)
        total = weights.sum(dtype=np.float32)
        target = np.float32(mass[row] * total)
        running = np.cumsum(np.exp((values[order] - top) * inv_temp[row], dtype=np.float32),
                            dtype=np.float32)
        reach = int((running < target).sum()) + 2 if target > 0 else 0
        records[row, 0] = min(k, max(int(least[row]), reach))
        records[row, 1] = np.float32(np.log(total)).view(np.int32)
        records[row, 2 : 2 + k] = order
        records[row, 2 + width : 2 + width + k] = values[order].view(np.int32)
    return records


def penalties_twin(logits: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
    """apply_penalties as candidates.cu computes it from the packed CSR lists, the logit
    biases last."""
    repetition, presence, frequency = (arrays[name].view(np.float64)
                                       for name in ("repetition", "presence", "frequency"))
    for row in range(logits.shape[0]):
        reps = arrays["rep_ids"][arrays["rep_offsets"][row] : arrays["rep_offsets"][row + 1]]
        first, last = arrays["count_offsets"][row], arrays["count_offsets"][row + 1]
        counted, counts = arrays["count_ids"][first:last], arrays["counts"][first:last]
        assert (np.diff(reps) > 0).all() and (np.diff(counted) > 0).all()  # the kernel's search

        def repeated(value: float) -> float:
            return value / repetition[row] if value > 0 else value * repetition[row]

        for token, count in zip(counted, counts):
            value = float(logits[row, token])
            if token in reps:
                value = repeated(value)
            logits[row, token] = value - (presence[row] * (count > 0) + frequency[row] * count)
        for token in set(reps.tolist()) - set(counted.tolist()):
            logits[row, token] = repeated(float(logits[row, token]))
        # The biases, once the penalties are written (the kernel syncs its threads between).
        first, last = arrays["bias_offsets"][row], arrays["bias_offsets"][row + 1]
        biases = arrays["bias_values"].view(np.float64)[first:last]
        for token, bias in zip(arrays["bias_ids"][first:last], biases):
            logits[row, token] = float(logits[row, token]) + bias


def float16_parts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 values split as the tensor-core kernels split them: hi = f16(v), lo =
    f16(v - hi) (nearest even; v - hi is exact in float32), both as float64."""
    values = np.asarray(values, dtype=np.float32)
    hi = values.astype(np.float16)
    lo = (values - hi.astype(np.float32)).astype(np.float16)
    return hi.astype(np.float64), lo.astype(np.float64)


def split_exponents(values: np.ndarray) -> np.ndarray:
    """cuda_src/activation_split.cuh's exponent e of each SPLIT_GROUP-element group along the
    last axis (its length a multiple of SPLIT_GROUP): 0 where the group's largest magnitude M
    lies in [2^-2, 2^15), else the e that brings M into [2^14, 2^15), within [-126, 113]."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    magnitudes = values.view(np.uint32) & np.uint32(0x7FFFFFFF)
    largest = magnitudes.reshape(*values.shape[:-1], -1, SPLIT_GROUP).max(axis=-1)
    exponent = (largest >> 23).astype(np.int64) - 127
    return np.where((exponent >= -2) & (exponent <= 14), 0, np.clip(exponent - 14, -126, 113))


def activation_parts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 activation rows split as the tensor-core kernels split them: each group's
    x 2^-e (split_exponents; exact in float32) into float16 hi + lo, both times 2^e (float64,
    exact)."""
    x = np.asarray(x, dtype=np.float32)
    e = np.repeat(split_exponents(x), SPLIT_GROUP, axis=-1)
    hi, lo = float16_parts(x * np.exp2(-e).astype(np.float32))
    return hi * np.exp2(e), lo * np.exp2(e)


def gated_twin(activation: str, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """act(gate) * up as the CPU computes it (gate_rows), for gate and up (T, ffn)."""
    gated = np.empty(gate.shape, dtype=np.float32)
    gate_rows(np.concatenate([gate, up], axis=1).astype(np.float32),
              ACTIVATION_CODES[activation], gated)
    return gated


def planar_names(layouts: dict[str, Any]) -> frozenset[str]:
    """The tensors of `layouts` (cuda_launches.MatrixLayout) held in the row-planar layout."""
    return frozenset(name for name, layout in layouts.items() if layout.planar)


def tile_product(w: np.ndarray, x: np.ndarray, type_name: str) -> np.ndarray:
    """x @ w.T as mul_mat_batch<N>_f16x2_<type> multiplies, summed exactly (float64): the
    activations split into float16 hi + lo (activation_parts: scaled by a power of two per 32
    elements), times the weights exactly (a quantized type's
    integer levels and F16's halves are exact in float16; level * scale + offset is w before
    quants.py's float32 rounding, within a float32 unit of w), or for F32 / BF16 weights also
    split, with the lo x lo product left out. The kernel's float32 accumulation is the
    caller's bound; so is its offset term, which multiplies the float32 sum of x itself, not
    of hi + lo (at most ~2^-22 |x| apart an element)."""
    x_hi, x_lo = activation_parts(x)
    if type_name not in ("F32", "BF16"):
        return (x_hi + x_lo) @ np.asarray(w, dtype=np.float64).T
    w_hi, w_lo = float16_parts(w)
    return x_hi @ w_lo.T + x_lo @ w_hi.T + x_hi @ w_hi.T


def greedy_sharing_steps(backend: Any, prompts: Sequence[Sequence[int]], steps: int,
                         block_size: int) -> tuple[list[list[int]], np.ndarray]:
    """Each prompt prefilled alone in its own step, then `steps` - 1 decode steps that all
    the sequences share, greedy: every sequence's tokens, and sequence 0's logits rows
    (steps, vocab) as the backend handed them over."""
    per_sequence = -(-(max(len(p) for p in prompts) + steps) // block_size)
    tables = [tuple(range(i * per_sequence, (i + 1) * per_sequence))
              for i in range(len(prompts))]
    tokens, rows = [], []
    for index, (prompt, table) in enumerate(zip(prompts, tables)):
        candidates = backend.run([StepItem(tuple(prompt), 0, table)], [RowInputs()])
        tokens.append([int(candidates.ids[0, 0])])
        if index == 0:
            rows.append(backend.fetch_rows([0])[0])
    for step in range(steps - 1):
        items = [StepItem((held[-1],), len(prompt) + step, table)
                 for held, prompt, table in zip(tokens, prompts, tables)]
        candidates = backend.run(items, [RowInputs()] * len(items))
        for held, token in zip(tokens, candidates.ids[:, 0]):
            held.append(int(token))
        rows.append(backend.fetch_rows([0])[0])
    return tokens, np.stack(rows)


def assert_streams_do_not_change_sequence_0(
        runs: dict[int, tuple[list[list[int]], np.ndarray]]) -> None:
    """greedy_sharing_steps' results at several stream counts: sequence 0's tokens the same
    at every count, and its logits rows the same bits among the counts whose decode rows
    take the same kernels: the counts up to MATVEC_MMA_MAX_ROWS (the matvec) and those past
    it (the batched product), each apart (two summations of the same products)."""
    def kernels(streams: int) -> bool:
        return streams > MATVEC_MMA_MAX_ROWS

    alone_tokens = runs[min(runs)][0]
    first_rows = {kernels(n): rows for n, (_, rows) in sorted(runs.items(), reverse=True)}
    for n, (tokens, rows) in runs.items():
        assert tokens[0] == alone_tokens[0], n
        np.testing.assert_array_equal(rows.view(np.uint32), first_rows[kernels(n)].view(np.uint32),
                                      err_msg=f"{n} streams")


def short_prompt_alone_and_shared(backend: Any) -> tuple[np.ndarray, np.ndarray]:
    """A 5-token prompt's logits row prefilled alone, then beside another 5-token prompt and
    a 20-token one in one step (blocks 0 to 3 of 16 positions)."""
    prompt = (5, 17, 300, 42, 9)
    backend.run([StepItem(prompt, 0, (0,))], [RowInputs()])
    alone = backend.fetch_rows([0])[0]
    backend.run([StepItem(prompt, 0, (0,)), StepItem((8, 6, 4, 2, 1), 0, (1,)),
                 StepItem(tuple(range(30, 50)), 0, (2, 3))], [RowInputs()] * 3)
    return alone, backend.fetch_rows([0])[0]


def mask_of(allowed: np.ndarray, vocab: int) -> np.ndarray:
    """llguidance's bitmask of the token ids `allowed`: bit t % 32 of int32 word t // 32."""
    bits = np.zeros(mask_words(vocab) * 32, dtype=bool)
    bits[allowed] = True
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


def constrained_rows(raw: np.ndarray, rng: np.random.Generator) -> list[RowInputs]:
    """Rows for three logits rows `raw` as they come unmasked: row 0 allows one middling
    token alone; row 1 has no mask but a repetition penalty on its top three, and logit
    biases banning its top token and lifting its tenth; row 2 allows about half the
    vocabulary but not its argmax, with presence and frequency penalties on its top five (the
    argmax and other forbidden tokens among them) at a temperature, and a +100 bias on its
    forbidden argmax (which stays forbidden)."""
    vocab = raw.shape[1]
    single = np.argsort(raw[0])[vocab // 2]
    half = rng.random(vocab) < 0.5
    half[raw[2].argmax()] = False
    top_1 = np.argsort(-raw[1])
    return [
        RowInputs(candidates=4, max_candidates=4, want_log_z=True,
                  allowed=mask_of(np.array([single]), vocab)),
        RowInputs(candidates=8, max_candidates=8, repetition_penalty=1.3,
                  repeated=tuple(int(t) for t in top_1[:3]),
                  **biases({int(top_1[0]): -100.0, int(top_1[9]): 3.5})),
        RowInputs(candidates=16, max_candidates=16, want_log_z=True, inv_temp=1.5,
                  allowed=mask_of(np.flatnonzero(half), vocab), presence_penalty=0.5,
                  frequency_penalty=0.25,
                  generated=tuple(int(t) for t in np.argsort(-raw[2])[:5]),
                  generated_counts=(1, 2, 3, 1, 1),
                  **biases({int(raw[2].argmax()): 100.0})),
    ]


def biases(bias: dict[int, float]) -> dict[str, tuple]:
    """RowInputs' bias fields for a logit_bias map, ids ascending."""
    ordered = sorted(bias.items())
    return {"bias_tokens": tuple(t for t, _ in ordered),
            "bias_values": tuple(v for _, v in ordered)}


def masked_step(backend: Any, items: Sequence[StepItem], rng: np.random.Generator
                ) -> tuple[np.ndarray, list[RowInputs], Candidates]:
    """The three-row step run unconstrained (its rows as fetched: the raw logits), then again
    (the same K/V rewritten, so the same logits) with `constrained_rows`: the raw rows, the
    rows' inputs and the constrained step's candidates, checked against the CPU reference
    over the raw rows (apply_token_masks, apply_penalties, top_candidates): the same rows bit
    for bit through fetch_rows, the same candidates, log_z within the kernel's float32
    bound."""
    backend.run(items, [RowInputs()] * 3)
    raw = backend.fetch_rows(range(3))
    rows = constrained_rows(raw, rng)
    got = backend.run(items, rows)
    expected = raw.copy()
    apply_token_masks(expected, rows)
    apply_penalties(expected, rows)
    np.testing.assert_array_equal(backend.fetch_rows(range(3)).view(np.uint32),
                                  expected.view(np.uint32))
    reference = top_candidates(expected, rows)
    np.testing.assert_array_equal(got.count, reference.count)
    np.testing.assert_array_equal(got.ids, reference.ids)
    np.testing.assert_array_equal(got.logits.view(np.uint32), reference.logits.view(np.uint32))
    np.testing.assert_allclose(got.log_z, reference.log_z, atol=1e-4)  # NaN where not asked
    return raw, rows, got


def constrained_steps(backend: Any) -> None:
    """`masked_step` on a prefill step of three prompts (blocks 0 to 2, launch by launch) and
    on their decode step (a graph of 4 rows, one padding): besides the reference's
    candidates, the single allowed token is row 0's only finite candidate, row 2's best is
    an allowed token other than its argmax (its +100 bias left it forbidden), and row 1 (no
    mask) keeps finite candidates, its banned top token not first among them."""
    rng = np.random.default_rng(29)
    prompts = [(5, 17, 300, 42, 9), (8, 6, 4, 2, 1, 11, 12, 13, 14), (30, 31, 32)]
    prefill = [StepItem(prompt, 0, (i,)) for i, prompt in enumerate(prompts)]
    decode = [StepItem((100 + i,), len(prompt), (i,)) for i, prompt in enumerate(prompts)]
    for items in (prefill, decode):
        raw, rows, got = masked_step(backend, items, rng)
        assert got.ids[0, 0] == np.argsort(raw[0])[raw.shape[1] // 2]
        assert np.isfinite(got.logits[0, 0]) and np.isneginf(got.logits[0, 1:]).all()
        allowed = np.unpackbits(rows[2].allowed.view(np.uint8), bitorder="little")
        assert got.ids[2, 0] != raw[2].argmax() and allowed[got.ids[2, 0]]
        assert np.isfinite(got.logits[1, : got.count[1]]).all()
        assert got.ids[1, 0] != raw[1].argmax()
