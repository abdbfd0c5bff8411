"""The CUDA backend's kernel launches of one step, as data: no pycuda, no device.

`forward_calls` lists every kernel a step runs, in order, each with its grid, block and
arguments; arguments that are device addresses are `Ref`s (a name and a byte offset) which the
backend resolves when it launches: the GGUF tensor names for weights, `k_cache.<layer>` /
`v_cache.<layer>` for the KV pool, the names of `cuda_plan.workspace_buffers` for the
workspace, `step.<array>` and `rows.<array>` for the arrays packed into the step's input
buffer (actors.compute.cuda_packing). So the order of the kernels and every architecture
quirk they honour (embedding scale, q/k/v biases, q/k head norms, RoPE layout and per-layer
base, sliding window, post norms, the gated activation, the tied output) are tested on any
machine, and the backend is a loop.

Layouts are the kernels' (cuda_src/README.md): activations float32 rows; q, k and v side by
side in one `qkv` row (q heads, then k heads, then v); gate and up side by side in `gate_up`.
Each layer's residual add is fused into the next RMSNorm (residual_rms_norm's `delta`).

The step's row count picks the kernels (`row_runs`): decode rows up to
plan.MATVEC_MMA_MAX_ROWS take the matvec (mul_mat_vec_mma, the matvec on the tensor cores,
for the block types it serves; the CUDA-core mul_mat_vec for the others), more decode rows the
batched product (mul_mat_batch<N>, each weight byte unpacked once a step); a short prefill
item takes the matvec too, a long one the batched product at 64 token columns a block; the
logits rows always take the batched product. A sequence's tokens do not depend on what else
shares its step. The Q6_K matrices lie on the device row-planar alone
(`MatrixLayout.planar`): every kernel that reads one has an entry for that layout, and none for
the file's.

A decode layer is seven launches: residual_rms_norm, the fused QKV (mul_mat_vec_mma_qkv where
the mma matvec serves q, k and v, mul_mat_vec_qkv where it serves none, mul_mat_batch<N>_qkv
past 8 rows; its epilogue finishes q, k and v: biases, q/k norms, RoPE, the K/V write),
attention_decode, the output product, residual_rms_norm, the fused gate+up+activation, the
down product. A matvec run whose q, k and v the mma matvec serves in part takes a launch a
matrix then qkv_finish.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from actors.compute import cuda_plan as plan
from actors.errors import InvalidRequest
from actors.model.arch import ModelSpec
from actors.model.gguf.reader import TensorInfo
from actors.model.step import StepPlan

F32 = 4  # bytes per activation element
# The tensor-core tiles' inputs: exact float16 weight levels times the activations split into
# float16 hi + lo parts (about 22 bits of each activation; float16's range). Through the
# emulated backend (tests/test_cuda_backend_emulated.py, and tests/gpu/test_cuda_backend.py run
# over the emulator), the tiny qwen2's logits are 0.024 from the CPU's with the split and 0.054
# with the activations rounded once to float16 (0.05 allowed). The inputs (normed activations,
# attention outputs, gated activations; never Gemma's float32 residual stream) peaked near 300
# there, far inside float16's range.
TILE_INPUT = "f16x2"


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

    @property
    def planar(self) -> bool:
        """Held in the row-planar layout (cuda_plan.holds_planar)."""
        return plan.holds_planar(self.type_name)


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
    gather_logit_rows: bool  # False: the logits rows are rows 0 .. n_logit_rows - 1
    table_stride: int
    n_splits: int
    split_keys: int
    block_size: int
    prefill_lengths: tuple[int, ...] = ()  # each prefill item's tokens, in row order


# --- decisions about a step -----------------------------------------------------------------


def leading_decode_items(lengths: np.ndarray) -> int:
    """How many items at the front of the step have one token: they are the decode kernel's
    rows 0 .. n - 1 (single-token items after a longer one go to the prefill kernel)."""
    longer = np.flatnonzero(np.asarray(lengths) != 1)
    return int(longer[0]) if longer.size else len(lengths)


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes decode graphs are captured for: 1, 2, 4, ... up to the first power of two
    >= max_batch. A step of n sequences replays the smallest bucket >= n, padded."""
    if max_batch < 1:
        raise InvalidRequest(f"max_batch must be >= 1, got {max_batch}", field="max_batch")
    return tuple(1 << i for i in range((max_batch - 1).bit_length() + 1))


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n (buckets ascending)."""
    index = int(np.searchsorted(np.asarray(buckets), n))
    if n < 1 or index == len(buckets):
        raise InvalidRequest(f"no graph bucket holds a batch of {n} (buckets {list(buckets)})",
                             field="batch")
    return int(buckets[index])


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
    return bucket_for(n_items, buckets)


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
        gather_logit_rows=not np.array_equal(step.logit_rows, np.arange(n_rows)),
        table_stride=table_stride,
        n_splits=plan.decode_splits(context_length, split_keys),
        split_keys=split_keys,
        block_size=step.block_size,
        prefill_lengths=tuple(int(n) for n in prefill_lengths),
    )


def graph_shape(bucket: int, table_stride: int, split_keys: int, context_length: int,
                block_size: int) -> StepShape:
    """The launch shape a decode graph of `bucket` rows is captured with."""
    return StepShape(
        n_tokens=bucket, n_decode=bucket, n_prefill=0, prefill_max_tokens=0,
        n_logit_rows=bucket, gather_logit_rows=False,
        table_stride=table_stride,
        n_splits=plan.decode_splits(context_length, split_keys), split_keys=split_keys,
        block_size=block_size,
    )


# --- the launches ---------------------------------------------------------------------------


def _i32(value: int) -> np.int32:
    return np.int32(value)


# A RowRun's kernels: the matvec (mul_mat_vec_mma where it serves a matrix's block type, the
# CUDA-core mul_mat_vec for the others) or the batched product (mul_mat_batch).
MATVEC, BATCH = "matvec", "batch"


@dataclass(frozen=True)
class RowRun:
    """Consecutive rows of a step that one launch per product serves: `rows` rows from
    `first`, on `kernels` (MATVEC or BATCH)."""

    first: int
    rows: int
    kernels: str


def row_runs(shape: StepShape) -> list[RowRun]:
    """The step's rows in launches: the decode rows on the matvec up to
    plan.MATVEC_MMA_MAX_ROWS of them (a graph bucket's bound), else on the batched product;
    each prefill item on the matvec when it is short (plan.uses_matvec of its own length),
    else on the batched product; neighbours on the same kernels share a launch. A decode
    row's kernels depend on the number of decode rows alone, a prefill row's on its own item,
    and each kernel's rows are independent of each other (the batched product's whatever its
    N), so a row's sums are the same bits among the steps that give it the same kernels, and
    its greedy tokens the same at any number of streams."""
    runs: list[RowRun] = []
    decode_kernels = MATVEC if shape.n_decode <= plan.MATVEC_MMA_MAX_ROWS else BATCH
    items = [(shape.n_decode, decode_kernels)] if shape.n_decode else []
    items += [(n, MATVEC if plan.uses_matvec(n) else BATCH) for n in shape.prefill_lengths]
    first = 0
    for rows, kernels in items:
        if runs and runs[-1].kernels == kernels:
            runs[-1] = RowRun(runs[-1].first, runs[-1].rows + rows, kernels)
        else:
            runs.append(RowRun(first, rows, kernels))
        first += rows
    return runs


def _rows_in(ref: Ref, rows: int, stride: int) -> Ref:
    """`ref` moved `rows` rows of `stride` floats on."""
    return Ref(ref.name, ref.offset + rows * stride * F32)


def matvec_call(weights: Mapping[str, MatrixLayout], name: str, x: Ref, x_stride: int, y: Ref,
                y_stride: int, batch: int) -> KernelCall:
    """y[b][r] = W[r] . x[b] for the matrix `name`, b < batch, on mul_mat_vec_mma where it
    serves the matrix's block type (plan.uses_matvec_mma), else on the CUDA-core mul_mat_vec
    (the same arguments)."""
    matrix = weights[name]
    if plan.uses_matvec_mma(matrix.type_name):
        kernel = plan.matvec_mma_kernel(matrix.type_name)
        launch = plan.matvec_mma_launch(matrix.rows, matrix.row_length)
    else:
        kernel = plan.matvec_kernel(matrix.type_name)
        launch = plan.matvec_launch(matrix.rows, matrix.row_length)
    return KernelCall(kernel, launch,
                      (Ref(name), np.int64(matrix.pitch), x, _i32(x_stride), y, _i32(y_stride),
                       _i32(matrix.rows), _i32(matrix.row_length), _i32(batch)))


def batch_call(weights: Mapping[str, MatrixLayout], name: str, x: Ref, x_stride: int, y: Ref,
               y_stride: int, n_tokens: int, tile_input: str) -> KernelCall:
    """y[t][r] = W[r] . x[t] for the matrix `name` on the batched product, t < n_tokens (any
    number: N = plan.batch_tokens(n_tokens) columns a block, more token tiles past 64)."""
    matrix = weights[name]
    return KernelCall(plan.batch_kernel(matrix.type_name, n_tokens, tile_input),
                      plan.batch_launch(matrix.rows, n_tokens),
                      (Ref(name), np.int64(matrix.pitch), x, _i32(x_stride), y, _i32(y_stride),
                       _i32(matrix.rows), _i32(matrix.row_length), _i32(n_tokens)))


def product_call(weights: Mapping[str, MatrixLayout], name: str, x: Ref, x_stride: int,
                 y: Ref, y_stride: int, run: RowRun, tile_input: str) -> KernelCall:
    """y = W x over the rows of `run` (x and y: its first rows) on the run's kernels."""
    run_x, run_y = _rows_in(x, run.first, x_stride), _rows_in(y, run.first, y_stride)
    if run.kernels == MATVEC:
        return matvec_call(weights, name, run_x, x_stride, run_y, y_stride, run.rows)
    return batch_call(weights, name, run_x, x_stride, run_y, y_stride, run.rows, tile_input)


def matmul_calls(weights: Mapping[str, MatrixLayout], name: str, x: Ref, x_stride: int,
                 y: Ref, y_stride: int, runs: Sequence[RowRun],
                 tile_input: str) -> list[KernelCall]:
    """y = W x over the rows of `runs`, one launch per run."""
    return [product_call(weights, name, x, x_stride, y, y_stride, run, tile_input)
            for run in runs]


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


def _finish_args(spec: ModelSpec, weights: Mapping[str, MatrixLayout], layer: int,
                 first_row: int) -> tuple[Arg, ...]:
    """What finishing a head needs besides its row, as qkv_finish and mul_mat_vec_qkv both
    take it (from q_bias to v_cache): biases (qwen2), q / k head norms (gemma-3), the RoPE of
    the layer and the K/V cache, with positions and slots from the step's row `first_row`."""
    p, sliding = f"blk.{layer}.", spec.is_sliding(layer)
    biases = [_optional(f"{p}attn_{part}.bias", spec.qkv_bias) for part in "qkv"]
    norms = [_optional(f"{p}attn_{part}_norm.weight", spec.qk_norm) for part in "qk"]
    return (*biases, *norms, np.float32(spec.rms_eps), Ref("step.positions", first_row * 4),
            _i32(spec.rope_dim), np.float64(spec.rope_base_local if sliding else spec.rope_base),
            _optional("rope_freqs.weight", not sliding and "rope_freqs.weight" in weights),
            _i32(int(spec.rope_neox)), Ref("step.slots", first_row * 4),
            Ref(f"k_cache.{layer}"), Ref(f"v_cache.{layer}"))


def qkv_calls(spec: ModelSpec, weights: Mapping[str, MatrixLayout], runs: Sequence[RowRun],
              layer: int, tile_input: str) -> list[KernelCall]:
    """q, k and v side by side in each `qkv` row, finished (biases, head norms, RoPE, the K/V
    write) for attention: a batched product run in one launch (mul_mat_batch<N>_qkv, a block
    type per segment, the finish in its epilogue), as is a matvec run (mul_mat_vec_mma_qkv
    where mul_mat_vec_mma serves all three matrices, mul_mat_vec_qkv where it serves none);
    any other run in one launch per matrix then qkv_finish over its rows. Each row is
    finished once, by its own run's launches."""
    d, qkv_stride = spec.d_model, spec.q_dim + 2 * spec.kv_dim
    names = [f"blk.{layer}.attn_{part}.weight" for part in "qkv"]
    served = {plan.uses_matvec_mma(weights[name].type_name) for name in names}
    columns = (0, spec.q_dim, spec.q_dim + spec.kv_dim)
    calls = []
    for run in runs:
        if run.kernels == BATCH or (run.kernels == MATVEC and len(served) == 1):
            calls.append(_fused_qkv_call(spec, weights, names, run, layer, tile_input))
        else:
            calls += [product_call(weights, name, Ref("normed"), d, Ref("qkv", column * F32),
                                   qkv_stride, run, tile_input)
                      for name, column in zip(names, columns)]
            calls.append(qkv_finish_call(spec, weights, run, layer))
    return calls


def _fused_qkv_call(spec: ModelSpec, weights: Mapping[str, MatrixLayout], names: Sequence[str],
                    run: RowRun, layer: int, tile_input: str) -> KernelCall:
    """Three products and the finish over the run's rows in one launch, the same arguments
    on the run's kernels: mul_mat_batch<N>_qkv (BATCH), else mul_mat_vec_mma_qkv where the
    mma matvec serves the three matrices and mul_mat_vec_qkv where it serves none of them."""
    d, qkv_stride = spec.d_model, spec.q_dim + 2 * spec.kv_dim
    layouts = [weights[name] for name in names]
    segments = [arg for name, layout in zip(names, layouts) for arg in (
        Ref(name), np.int64(layout.pitch), _i32(plan.kernel_type_code(layout.type_name)),
        _i32(layout.rows))]
    rows = [layout.rows for layout in layouts]
    if run.kernels == BATCH:
        kernel = plan.batch_qkv_kernel(run.rows, tile_input)
        launch = plan.batch_qkv_launch(rows, run.rows)
    elif plan.uses_matvec_mma(layouts[0].type_name):
        kernel, launch = "mul_mat_vec_mma_qkv", plan.matvec_mma_qkv_launch(*rows)
    else:
        kernel, launch = "mul_mat_vec_qkv", plan.qkv_launch(*rows, d)
    return KernelCall(kernel, launch, (
        *segments, _rows_in(Ref("normed"), run.first, d), _i32(d),
        _rows_in(Ref("qkv"), run.first, qkv_stride), _i32(qkv_stride), _i32(d),
        _i32(run.rows), _i32(spec.head_dim), *_finish_args(spec, weights, layer, run.first),
        Ref("qkv_counters")))


def qkv_finish_call(spec: ModelSpec, weights: Mapping[str, MatrixLayout], run: RowRun,
                    layer: int) -> KernelCall:
    """Biases (qwen2), q / k head norms (gemma-3), RoPE (k's heads follow q's in the row) and
    the K/V write of the run's rows, in one launch."""
    qkv_stride = spec.q_dim + 2 * spec.kv_dim
    return KernelCall(
        "qkv_finish",
        plan.qkv_finish_launch(run.rows, spec.n_heads + 2 * spec.n_kv_heads),
        (_rows_in(Ref("qkv"), run.first, qkv_stride), _i32(qkv_stride), _i32(spec.n_heads),
         _i32(spec.n_kv_heads), _i32(spec.head_dim),
         *_finish_args(spec, weights, layer, run.first)))


def fused_gate_up_call(spec: ModelSpec, weights: Mapping[str, MatrixLayout], run: RowRun,
                       layer: int, tile_input: str) -> KernelCall | None:
    """`gated` = act(gate x) * (up x) over the run's rows in one launch, where gate and up
    share a block type: the batched product's fused entry, else mul_mat_vec_mma's where it
    serves the matrices and the CUDA-core matvec's where it does not. None where they differ."""
    d, ffn = spec.d_model, spec.ffn_dim
    gate, up = f"blk.{layer}.ffn_gate.weight", f"blk.{layer}.ffn_up.weight"
    type_name = weights[gate].type_name
    if type_name != weights[up].type_name:
        return None
    args = (Ref(gate), Ref(up), np.int64(weights[gate].pitch),
            _rows_in(Ref("normed"), run.first, d), _i32(d),
            _rows_in(Ref("gated"), run.first, ffn), _i32(ffn), _i32(ffn), _i32(d),
            _i32(run.rows))
    if run.kernels == BATCH:
        return KernelCall(
            plan.batch_gate_up_kernel(spec.activation, type_name, run.rows, tile_input),
            plan.batch_launch(ffn, run.rows, plan.BATCH_ROWS // 2), args)
    if plan.uses_matvec_mma(type_name):
        return KernelCall(plan.matvec_mma_gate_up_kernel(spec.activation, type_name),
                          plan.matvec_mma_launch(2 * ffn, d), args)
    return KernelCall(plan.gate_up_kernel(spec.activation, plan.kernel_suffix(type_name)),
                      plan.matvec_launch(2 * ffn, d), args)


def gated_ffn_calls(spec: ModelSpec, weights: Mapping[str, MatrixLayout],
                    runs: Sequence[RowRun], layer: int, tile_input: str) -> list[KernelCall]:
    """`gated` = act(gate x) * (up x): each run in one fused launch where it can
    (fused_gate_up_call); otherwise the run's gate and up products into `gate_up` (gate, then
    up, in each row) and gated_<act> over its rows (one over all rows where gate and up have
    different block types)."""
    d, ffn = spec.d_model, spec.ffn_dim
    gate, up = f"blk.{layer}.ffn_gate.weight", f"blk.{layer}.ffn_up.weight"
    fuses = weights[gate].type_name == weights[up].type_name

    def gated(first: int, rows: int) -> KernelCall:
        return KernelCall(f"gated_{spec.activation}", plan.elementwise_launch(rows * ffn),
                          (_rows_in(Ref("gate_up"), first, 2 * ffn),
                           _rows_in(Ref("gated"), first, ffn), _i32(rows), _i32(ffn)))

    calls = []
    for run in runs:
        fused = fused_gate_up_call(spec, weights, run, layer, tile_input)
        if fused is not None:
            calls.append(fused)
            continue
        for name, column in ((gate, 0), (up, ffn)):
            calls.append(product_call(weights, name, Ref("normed"), d,
                                      Ref("gate_up", column * F32), 2 * ffn, run, tile_input))
        if fuses:
            calls.append(gated(run.first, run.rows))
    if not fuses:
        calls.append(gated(0, sum(run.rows for run in runs)))
    return calls


def layer_calls(spec: ModelSpec, weights: Mapping[str, MatrixLayout], shape: StepShape,
                layer: int, tile_input: str) -> list[KernelCall]:
    """One transformer block, from the norm that opens it (adding the previous block's FFN
    output to the residual) to its down projection (left in `projected`)."""
    p, t, runs = f"blk.{layer}.", shape.n_tokens, row_runs(shape)
    first = layer == 0
    calls = [residual_norm_call(spec, t, NULL if first else Ref("projected"),
                                NULL if first else _post_ffn_norm(spec, layer - 1),
                                Ref(p + "attn_norm.weight"), Ref("normed"))]
    calls += qkv_calls(spec, weights, runs, layer, tile_input)
    calls += attention_calls(spec, shape, layer)
    calls += matmul_calls(weights, p + "attn_output.weight", Ref("attn"), spec.q_dim,
                          Ref("projected"), spec.d_model, runs, tile_input)
    calls.append(residual_norm_call(
        spec, t, Ref("projected"), _optional(p + "post_attention_norm.weight", spec.post_norms),
        Ref(p + "ffn_norm.weight"), Ref("normed")))
    calls += gated_ffn_calls(spec, weights, runs, layer, tile_input)
    calls += matmul_calls(weights, p + "ffn_down.weight", Ref("gated"), spec.ffn_dim,
                          Ref("projected"), spec.d_model, runs, tile_input)
    return calls


def forward_calls(spec: ModelSpec, weights: Mapping[str, MatrixLayout], shape: StepShape,
                  tile_input: str) -> list[KernelCall]:
    """Every kernel from the token ids to the logits rows (`logits`, n_logit_rows x vocab)."""
    embedding = weights["token_embd.weight"]
    calls = [KernelCall(
        plan.get_rows_kernel(embedding.type_name),
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
        # The logits rows on the batched product whatever their number (the output matrix read
        # and unpacked once a step), each independent of the others.
        output = "token_embd.weight" if spec.tied_output else "output.weight"
        calls.append(batch_call(weights, output, final, spec.d_model, Ref("logits"),
                                spec.vocab_size, shape.n_logit_rows, tile_input))
    return calls


def candidate_calls(spec: ModelSpec, n_rows: int, width: int, any_penalty: bool,
                    n_masked: int) -> list[KernelCall]:
    """The token masks (when `n_masked` rows have one), the penalties and logit biases (when a
    row has any), then the candidates of the logits rows (several blocks per row where rows
    ask for few; their counters are zero between launches), all in place on `logits`."""
    vocab = _i32(spec.vocab_size)
    calls = []
    if n_masked:
        calls.append(KernelCall(
            "apply_token_mask", plan.token_mask_launch(n_masked, spec.vocab_size),
            (Ref("logits"), vocab, Ref("rows.mask_rows"), Ref("rows.mask_words"))))
    if any_penalty:
        calls.append(KernelCall(
            "apply_penalties", plan.penalties_launch(n_rows),
            (Ref("logits"), vocab, Ref("rows.rep_offsets"), Ref("rows.rep_ids"),
             Ref("rows.repetition"), Ref("rows.count_offsets"), Ref("rows.count_ids"),
             Ref("rows.counts"), Ref("rows.presence"), Ref("rows.frequency"),
             Ref("rows.bias_offsets"), Ref("rows.bias_ids"), Ref("rows.bias_values"))))
    calls.append(KernelCall(
        "top_candidates", plan.candidates_launch(n_rows, width, spec.vocab_size),
        (Ref("logits"), vocab, Ref("rows.least"), Ref("rows.most"), Ref("rows.mass"),
         Ref("rows.inv_temp"), _i32(width), Ref("candidates"), Ref("candidate_partials"),
         Ref("candidate_counters"))))
    return calls


def feed_tokens_call(n_rows: int, width: int, token_ids: Ref) -> KernelCall:
    """The first candidate of each of the last step's `n_rows` records (`width` candidates
    a record) into `token_ids`: the tokens of the step run ahead, fed on the device."""
    return KernelCall("feed_greedy_tokens", plan.elementwise_launch(n_rows),
                      (Ref("candidates"), _i32(plan.candidate_record_words(width)), token_ids,
                       _i32(n_rows)))
