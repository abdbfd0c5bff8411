"""The CUDA backend's kernel launches of one step, as data: no pycuda, no device.

`forward_calls` lists every kernel a step runs, in order, each with its grid, block and
arguments; arguments that are device addresses are `Ref`s (a name and a byte offset) which the
backend resolves when it launches: the GGUF tensor names for weights, `k_cache.<layer>` /
`v_cache.<layer>` for the KV pool, the names of `cuda_plan.workspace_buffers` for the
workspace, `step.<array>` and `rows.<array>` for the arrays packed into the step's input
buffer. So the order of the kernels and every architecture quirk they honour (embedding scale,
q/k/v biases, q/k head norms, RoPE layout and per-layer base, sliding window, post norms, the
gated activation, the tied output) are tested on any machine, and the backend is a loop.

Layouts are the kernels' (cuda_src/README.md): activations float32 rows; q, k and v side by
side in one `qkv` row (q heads, then k heads, then v); gate and up side by side in `gate_up`.
Each layer's residual add is fused into the next RMSNorm (residual_rms_norm's `delta`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from actors.compute import cuda_plan as plan
from actors.errors import InvalidRequest
from actors.model.arch import ModelSpec
from actors.model.gguf import TensorInfo
from actors.model.candidates import Candidates, RowInputs
from actors.model.step import StepPlan

F32 = 4  # bytes per activation element
# The tensor-core tiles' inputs: each split into float16 hi + lo parts (three products, about
# 22 bits of each input). Through the emulated backend (tests/test_cuda_backend_emulated.py,
# and tests/gpu/test_cuda_backend.py run over the emulator), one rounding to float16 put the
# tiny qwen2's logits 0.064 from the CPU's (0.05 allowed; bfloat16 put gemma-3-270m's 0.11
# off). The inputs (normed activations, attention outputs, gated activations; never Gemma's
# float32 residual stream) peaked near 300 there, far inside float16's range.
TILE_INPUT = "f16x3"


@dataclass(frozen=True)
class Ref:
    """A device address: the buffer, weight or step array called `name`, `offset` bytes in."""

    name: str
    offset: int = 0


NULL = Ref("null")  # an absent optional pointer (resolves to 0)
Arg = Ref | np.int32 | np.int64 | np.float32 | np.float64


@dataclass(frozen=True)
class KernelCall:
    """One kernel launch: the entry point, its geometry and its arguments in order."""

    kernel: str
    launch: plan.Launch
    args: tuple[Arg, ...]


@dataclass(frozen=True)
class MatrixLayout:
    """A tensor on the device: `rows` rows of `row_length` elements of `type_name` (a vector
    is one float32 row). The launches take every tensor of the model by name from a mapping of
    these."""

    type_name: str
    rows: int
    row_length: int

    @property
    def pitch(self) -> int:
        return plan.row_pitch(self.type_name, self.row_length)


def tensor_layouts(tensors: Iterable[TensorInfo]) -> dict[str, MatrixLayout]:
    """Every tensor of a file as it lies on the device (vectors as one float32 row)."""
    return {
        info.name: MatrixLayout("F32", 1, info.shape[0]) if len(info.shape) == 1
        else MatrixLayout(info.type_name, math.prod(info.shape[:-1]), info.shape[-1])
        for info in tensors
    }


@dataclass(frozen=True)
class StepShape:
    """What a step's launches depend on. Items are laid out as in `StepPlan`; the first
    `n_decode` items have one token each (row i = item i) and use the flash-decoding kernels,
    the other `n_prefill` items the prefill kernel."""

    n_tokens: int
    n_decode: int
    n_prefill: int
    prefill_max_tokens: int  # the longest of the prefill items
    n_logit_rows: int
    n_decode_logit_rows: int  # the first logits rows, which belong to decode items
    gather_logit_rows: bool  # False: the logits rows are rows 0 .. n_logit_rows - 1
    table_stride: int
    n_splits: int
    split_keys: int
    block_size: int


# --- decisions about a step -----------------------------------------------------------------


def leading_decode_items(lengths: np.ndarray) -> int:
    """How many items at the front of the step have one token: they are the decode kernel's
    rows 0 .. n - 1 (single-token items after a longer one go to the prefill kernel)."""
    longer = np.flatnonzero(np.asarray(lengths) != 1)
    return int(longer[0]) if longer.size else len(lengths)


def graph_bucket(step: StepPlan, buckets: Sequence[int]) -> int | None:
    """The decode-graph bucket a step replays, or None when it runs launch by launch: a
    graph serves steps whose every item is one token that wants logits, up to the largest
    bucket."""
    n_items = len(step.lengths)
    if (
        (step.lengths != 1).any()
        or len(step.logit_rows) != n_items
        or n_items > buckets[-1]
    ):
        return None
    return plan.bucket_for(n_items, buckets)


def split_keys_for(context_length: int, max_splits: int = 32) -> int:
    """Keys per flash-decoding split: whole decode tiles, at least two, and few enough splits
    that a graph's fixed grid stays small at any context length."""
    tile = plan.DECODE_TILE_KEYS
    return tile * max(2, -(-context_length // (max_splits * tile)))


def table_stride_for(context_length: int, block_size: int, num_blocks: int) -> int:
    """Block-table columns: a sequence holds at most a context's blocks, and at most the
    pool's."""
    return min(-(-context_length // block_size), num_blocks)


def step_shape(step: StepPlan, table_stride: int, split_keys: int,
               context_length: int) -> StepShape:
    """The launch shape of a step run launch by launch."""
    n_decode = leading_decode_items(step.lengths)
    prefill_lengths = step.lengths[n_decode:]
    n_rows = len(step.logit_rows)
    return StepShape(
        n_tokens=step.n_tokens,
        n_decode=n_decode,
        n_prefill=len(prefill_lengths),
        prefill_max_tokens=int(prefill_lengths.max()) if prefill_lengths.size else 0,
        n_logit_rows=n_rows,
        n_decode_logit_rows=int((step.logit_rows < n_decode).sum()),
        gather_logit_rows=not np.array_equal(step.logit_rows, np.arange(n_rows)),
        table_stride=table_stride,
        n_splits=plan.decode_splits(context_length, split_keys),
        split_keys=split_keys,
        block_size=step.block_size,
    )


def graph_shape(bucket: int, table_stride: int, split_keys: int, context_length: int,
                block_size: int) -> StepShape:
    """The launch shape a decode graph of `bucket` rows is captured with."""
    return StepShape(
        n_tokens=bucket, n_decode=bucket, n_prefill=0, prefill_max_tokens=0,
        n_logit_rows=bucket, n_decode_logit_rows=bucket, gather_logit_rows=False,
        table_stride=table_stride,
        n_splits=plan.decode_splits(context_length, split_keys), split_keys=split_keys,
        block_size=block_size,
    )


# --- the step's int32 input arrays ----------------------------------------------------------


def step_arrays(step: StepPlan, n_decode: int, table_stride: int) -> dict[str, np.ndarray]:
    """The arrays the forward kernels read (`step.<name>`), for a step run launch by launch."""
    prefill = slice(n_decode, None)
    return {
        "token_ids": step.token_ids.astype(np.int32),
        "positions": step.positions.astype(np.int32),
        "slots": (step.slot_blocks * step.block_size + step.slot_offsets).astype(np.int32),
        "block_tables": plan.block_table_array(list(step.block_tables), len(step.lengths),
                                               table_stride, 0),
        "prefill_first_row": step.first_rows[prefill].astype(np.int32),
        "prefill_tokens": step.lengths[prefill].astype(np.int32),
        "prefill_start": step.starts[prefill].astype(np.int32),
        "logit_rows": step.logit_rows.astype(np.int32),
    }


def _words(values: np.ndarray) -> np.ndarray:
    """float32 / float64 values as the int32 words of the packed buffer."""
    return np.ascontiguousarray(values).view(np.int32)


def _csr(lists: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-row id lists -> (offsets (rows + 1,), ids) int32."""
    lengths = [len(ids) for ids in lists]
    offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).astype(np.int32)
    ids = np.concatenate([np.zeros(0, np.int32), *(ids.astype(np.int32) for ids in lists)])
    return offsets, ids


def _checked_ids(ids: Sequence[int], vocab: int, field: str) -> np.ndarray:
    values = np.asarray(ids, dtype=np.int64).reshape(-1)
    if values.size and (values.min() < 0 or values.max() >= vocab):
        raise InvalidRequest(f"{field} holds a token id outside [0, {vocab})", field=field)
    return values


@dataclass(frozen=True)
class RowArrays:
    """The rows' penalty and candidate inputs (`rows.<name>`), the candidate record width and
    whether any row has a penalty to apply."""

    arrays: dict[str, np.ndarray]
    width: int
    any_penalty: bool


def row_arrays(rows: Sequence[RowInputs], vocab: int) -> RowArrays:
    """Pack RowInputs for apply_penalties (CSR lists, ids ascending, float64 parameters) and
    top_candidates (least / most candidates, mass, inv_temp). InvalidRequest for a penalty id
    outside the vocabulary or a row asking for more candidates than the kernel selects."""
    repeated, counted, counts = [], [], []
    for row in rows:
        rep = np.unique(_checked_ids(row.repeated, vocab, "repeated"))
        repeated.append(rep if row.repetition_penalty != 1.0 else rep[:0])
        ids = _checked_ids(row.generated, vocab, "generated")
        row_counts = np.asarray(row.generated_counts, dtype=np.int64).reshape(-1)
        if ids.size != row_counts.size:
            raise InvalidRequest("generated and generated_counts differ in length",
                                 field="generated_counts")
        if row.presence_penalty == 0 and row.frequency_penalty == 0:
            ids, row_counts = ids[:0], row_counts[:0]
        order = np.argsort(ids, kind="stable")
        counted.append(ids[order])
        counts.append(row_counts[order])
    cap = min(vocab, plan.MAX_CANDIDATES)
    least = np.array([min(max(1, row.candidates), vocab) for row in rows], dtype=np.int64)
    if (least > cap).any():
        raise InvalidRequest(f"a row asks for {int(least.max())} candidates; the CUDA backend "
                             f"selects at most {cap}", field="candidates")
    most = np.array([min(max(row.candidates, row.max_candidates, 1), cap) for row in rows],
                    dtype=np.int64)
    rep_offsets, rep_ids = _csr(repeated)
    count_offsets, count_ids = _csr(counted)
    float64_of = {name: np.array([getattr(row, name) for row in rows], dtype=np.float64)
                  for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")}
    arrays = {
        # float64 first: every array starts 16-byte aligned, these need 8.
        "repetition": _words(float64_of["repetition_penalty"]),
        "presence": _words(float64_of["presence_penalty"]),
        "frequency": _words(float64_of["frequency_penalty"]),
        "least": least.astype(np.int32),
        "most": most.astype(np.int32),
        "mass": _words(np.array([row.mass for row in rows], dtype=np.float32)),
        "inv_temp": _words(np.array([row.inv_temp for row in rows], dtype=np.float32)),
        "rep_offsets": rep_offsets,
        "rep_ids": rep_ids,
        "count_offsets": count_offsets,
        "count_ids": count_ids,
        "counts": np.concatenate([np.zeros(0, np.int32), *(c.astype(np.int32) for c in counts)]),
    }
    return RowArrays(arrays, int(most.max()) if len(rows) else 1,
                     bool(rep_ids.size or count_ids.size))


# --- the launches ---------------------------------------------------------------------------


def _i32(value: int) -> np.int32:
    return np.int32(value)


def matmul_call(weights: Mapping[str, MatrixLayout], name: str, x: Ref, x_stride: int, y: Ref,
                y_stride: int, n_tokens: int, tile_input: str) -> KernelCall:
    """y[t][r] = W[r] . x[t] for the matrix `name` (matvec up to 8 tokens, else tiles)."""
    matrix = weights[name]
    return KernelCall(
        plan.matmul_kernel(matrix.type_name, n_tokens, tile_input),
        plan.matmul_launch(matrix.rows, n_tokens),
        (Ref(name), np.int64(matrix.pitch), x, _i32(x_stride), y, _i32(y_stride),
         _i32(matrix.rows), _i32(matrix.row_length), _i32(n_tokens)),
    )


def matmul_calls(weights: Mapping[str, MatrixLayout], name: str, x: Ref, x_stride: int,
                 y: Ref, y_stride: int, n_tokens: int, n_decode: int,
                 tile_input: str) -> list[KernelCall]:
    """`matmul_call` over n_tokens rows, of which the first n_decode are decode rows: when
    the rest push the step onto the tensor-core tiles, the decode rows (up to the matvec's
    batch) still take the float32 matvec, so a sequence's tokens do not depend on what
    shares its step."""
    if plan.uses_matvec(n_tokens) or not 0 < n_decode <= plan.MATVEC_MAX_BATCH:
        return [matmul_call(weights, name, x, x_stride, y, y_stride, n_tokens, tile_input)]
    rest_x = Ref(x.name, x.offset + n_decode * x_stride * F32)
    rest_y = Ref(y.name, y.offset + n_decode * y_stride * F32)
    return [matmul_call(weights, name, x, x_stride, y, y_stride, n_decode, tile_input),
            matmul_call(weights, name, rest_x, x_stride, rest_y, y_stride, n_tokens - n_decode,
                        tile_input)]


def _optional(name: str, present: bool) -> Ref:
    return Ref(name) if present else NULL


def residual_norm_call(spec: ModelSpec, n_tokens: int, delta: Ref, delta_weight: Ref,
                       weight: Ref, out: Ref) -> KernelCall:
    """x += (normed) delta, then out = norm(x) * weight (delta NULL: just the norm)."""
    return KernelCall("residual_rms_norm", plan.norm_launch(n_tokens),
                      (Ref("x"), delta, delta_weight, weight, out, _i32(spec.d_model),
                       np.float32(spec.rms_eps)))


def _post_ffn_norm(spec: ModelSpec, layer: int) -> Ref:
    return _optional(f"blk.{layer}.post_ffw_norm.weight", spec.post_norms)


def attention_calls(spec: ModelSpec, shape: StepShape, layer: int) -> list[KernelCall]:
    """The layer's attention over the paged cache: decode items split and combined in one
    launch (its counters are zero between launches), prefill items tiled; q is scaled inside
    by spec.query_scale."""
    qkv_stride = spec.q_dim + 2 * spec.kv_dim
    window = _i32(spec.sliding_window if spec.is_sliding(layer) else 0)
    cache = (Ref(f"k_cache.{layer}"), Ref(f"v_cache.{layer}"))
    heads = (_i32(spec.n_heads), _i32(spec.n_kv_heads), _i32(spec.head_dim))
    scale = np.float32(spec.query_scale)
    calls = []
    if shape.n_decode:
        calls.append(KernelCall(
            "attention_decode",
            plan.attention_decode_launch(shape.n_decode, spec.n_heads, spec.n_kv_heads,
                                         shape.n_splits),
            (Ref("qkv"), _i32(qkv_stride), *cache, Ref("step.block_tables"),
             _i32(shape.table_stride), Ref("step.positions"), _i32(shape.block_size), *heads,
             scale, window, _i32(shape.split_keys), Ref("partial_acc"), Ref("partial_max"),
             Ref("partial_sum"), Ref("attention_counters"), Ref("attn"), _i32(spec.q_dim))))
    if shape.n_prefill:
        calls.append(KernelCall(
            "attention_prefill",
            plan.attention_prefill_launch(shape.prefill_max_tokens, spec.n_heads,
                                          shape.n_prefill),
            (Ref("qkv"), _i32(qkv_stride), *cache,
             Ref("step.block_tables", shape.n_decode * shape.table_stride * 4),
             _i32(shape.table_stride), Ref("step.prefill_first_row"),
             Ref("step.prefill_tokens"), Ref("step.prefill_start"), _i32(shape.block_size),
             *heads, scale, window, Ref("attn"), _i32(spec.q_dim))))
    return calls


def layer_calls(spec: ModelSpec, weights: Mapping[str, MatrixLayout], shape: StepShape,
                layer: int, tile_input: str) -> list[KernelCall]:
    """One transformer block, from the norm that opens it (adding the previous block's FFN
    output to the residual) to its down projection (left in `projected`)."""
    p, t = f"blk.{layer}.", shape.n_tokens
    d, q_dim, kv_dim, ffn = spec.d_model, spec.q_dim, spec.kv_dim, spec.ffn_dim
    qkv_stride = q_dim + 2 * kv_dim
    k_at, v_at = Ref("qkv", q_dim * F32), Ref("qkv", (q_dim + kv_dim) * F32)
    first = layer == 0
    calls = [residual_norm_call(spec, t, NULL if first else Ref("projected"),
                                NULL if first else _post_ffn_norm(spec, layer - 1),
                                Ref(p + "attn_norm.weight"), Ref("normed"))]
    for part, y in (("q", Ref("qkv")), ("k", k_at), ("v", v_at)):
        calls += matmul_calls(weights, f"{p}attn_{part}.weight", Ref("normed"), d, y,
                              qkv_stride, t, shape.n_decode, tile_input)
    if spec.qkv_bias:
        for part, y, n in (("q", Ref("qkv"), q_dim), ("k", k_at, kv_dim), ("v", v_at, kv_dim)):
            calls.append(KernelCall("add_bias", plan.elementwise_launch(t * n),
                                    (y, _i32(qkv_stride), Ref(f"{p}attn_{part}.bias"), _i32(t),
                                     _i32(n))))
    if spec.qk_norm:
        for part, x, heads in (("q", Ref("qkv"), spec.n_heads), ("k", k_at, spec.n_kv_heads)):
            calls.append(KernelCall("head_rms_norm", plan.head_norm_launch(t, heads),
                                    (x, _i32(qkv_stride), _i32(heads), _i32(spec.head_dim),
                                     Ref(f"{p}attn_{part}_norm.weight"),
                                     np.float32(spec.rms_eps))))
    sliding = spec.is_sliding(layer)
    # k's heads follow q's in the row: one launch rotates both.
    calls.append(KernelCall(
        "rope", plan.rope_launch(t, spec.n_heads + spec.n_kv_heads),
        (Ref("qkv"), _i32(qkv_stride), Ref("step.positions"),
         _i32(spec.n_heads + spec.n_kv_heads), _i32(spec.head_dim), _i32(spec.rope_dim),
         np.float64(spec.rope_base_local if sliding else spec.rope_base),
         _optional("rope_freqs.weight", not sliding and "rope_freqs.weight" in weights),
         _i32(int(spec.rope_neox)))))
    calls.append(KernelCall("kv_write", plan.elementwise_launch(t * kv_dim),
                            (k_at, v_at, _i32(qkv_stride), Ref("step.slots"), _i32(t),
                             _i32(kv_dim), Ref(f"k_cache.{layer}"), Ref(f"v_cache.{layer}"))))
    calls += attention_calls(spec, shape, layer)
    calls += matmul_calls(weights, p + "attn_output.weight", Ref("attn"), q_dim,
                          Ref("projected"), d, t, shape.n_decode, tile_input)
    calls.append(residual_norm_call(
        spec, t, Ref("projected"), _optional(p + "post_attention_norm.weight", spec.post_norms),
        Ref(p + "ffn_norm.weight"), Ref("normed")))
    for part, y in (("gate", Ref("gate_up")), ("up", Ref("gate_up", ffn * F32))):
        calls += matmul_calls(weights, f"{p}ffn_{part}.weight", Ref("normed"), d, y, 2 * ffn,
                              t, shape.n_decode, tile_input)
    calls.append(KernelCall(f"gated_{spec.activation}", plan.elementwise_launch(t * ffn),
                            (Ref("gate_up"), Ref("gated"), _i32(t), _i32(ffn))))
    calls += matmul_calls(weights, p + "ffn_down.weight", Ref("gated"), ffn,
                          Ref("projected"), d, t, shape.n_decode, tile_input)
    return calls


def forward_calls(spec: ModelSpec, weights: Mapping[str, MatrixLayout], shape: StepShape,
                  tile_input: str) -> list[KernelCall]:
    """Every kernel from the token ids to the logits rows (`logits`, n_logit_rows x vocab)."""
    embedding = weights["token_embd.weight"]
    calls = [KernelCall(
        f"get_rows_{plan.kernel_suffix(embedding.type_name)}",
        plan.get_rows_launch(shape.n_tokens, spec.d_model),
        (Ref("token_embd.weight"), np.int64(embedding.pitch), Ref("step.token_ids"), Ref("x"),
         _i32(spec.d_model), np.float32(spec.embedding_scale)))]
    for layer in range(spec.n_layers):
        calls += layer_calls(spec, weights, shape, layer, tile_input)
    calls.append(residual_norm_call(spec, shape.n_tokens, Ref("projected"),
                                    _post_ffn_norm(spec, spec.n_layers - 1),
                                    Ref("output_norm.weight"), Ref("normed")))
    final = Ref("normed")
    if shape.gather_logit_rows:
        # get_rows over float32 rows is an exact gather of the logits rows' states.
        final = Ref("final")
        calls.append(KernelCall(
            "get_rows_f32", plan.get_rows_launch(shape.n_logit_rows, spec.d_model),
            (Ref("normed"), np.int64(plan.row_pitch("F32", spec.d_model)),
             Ref("step.logit_rows"), final, _i32(spec.d_model), np.float32(1.0))))
    if shape.n_logit_rows:
        output = "token_embd.weight" if spec.tied_output else "output.weight"
        calls += matmul_calls(weights, output, final, spec.d_model, Ref("logits"),
                              spec.vocab_size, shape.n_logit_rows, shape.n_decode_logit_rows,
                              tile_input)
    return calls


def candidate_calls(spec: ModelSpec, n_rows: int, width: int,
                    any_penalty: bool) -> list[KernelCall]:
    """Penalties (when a row has any) and the candidates of the logits rows (several blocks
    per row where rows ask for few; their counters are zero between launches)."""
    vocab = _i32(spec.vocab_size)
    calls = []
    if any_penalty:
        calls.append(KernelCall(
            "apply_penalties", plan.penalties_launch(n_rows),
            (Ref("logits"), vocab, Ref("rows.rep_offsets"), Ref("rows.rep_ids"),
             Ref("rows.repetition"), Ref("rows.count_offsets"), Ref("rows.count_ids"),
             Ref("rows.counts"), Ref("rows.presence"), Ref("rows.frequency"))))
    calls.append(KernelCall(
        "top_candidates", plan.candidates_launch(n_rows, width, spec.vocab_size),
        (Ref("logits"), vocab, Ref("rows.least"), Ref("rows.most"), Ref("rows.mass"),
         Ref("rows.inv_temp"), _i32(width), Ref("candidates"), Ref("candidate_partials"),
         Ref("candidate_counters"))))
    return calls


# --- the candidates' way back ---------------------------------------------------------------


def candidates_from_records(records: np.ndarray, width: int,
                            rows: Sequence[RowInputs]) -> Candidates:
    """top_candidates' records (n_rows, candidate_record_words(width)) int32 -> Candidates:
    columns past a row's count become id 0 / logit -inf, log_z is NaN where the row did not
    ask for it (nor for a mass) or its top logit is not finite."""
    count = records[:, 0].copy()
    real = np.arange(width) < count[:, None]
    ids = np.where(real, records[:, 2 : 2 + width], 0).astype(np.int32)
    logits = np.where(real, records[:, 2 + width :].view(np.float32), np.float32(-np.inf))
    keep = int(count.max()) if len(rows) else 1
    log_z = records[:, 1].view(np.float32).astype(np.float64)
    asked = np.array([row.want_log_z or row.mass > 0 for row in rows], dtype=bool)
    log_z[~asked | ~np.isfinite(logits[:, 0])] = np.nan
    return Candidates(ids=ids[:, :keep], logits=logits[:, :keep].astype(np.float32),
                      count=count.astype(np.int32), log_z=log_z)
