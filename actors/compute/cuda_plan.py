"""Host-side planning for the CUDA backend: pure Python and numpy, no pycuda.

What the CUDA actor decides about its kernels before it touches the device lives here, so it
is tested on every machine: where the kernel sources are and what their entry points are
called, and each kernel's launch geometry (which kernel multiplies a matrix: the tensor
cores' matvec, the CUDA-core matvec for the block types that one does not serve, or the
batched product). The device memory's plan (workspace, KV pool) is
actors.compute.cuda_memory's; the weights' device image actors.compute.cuda_weights'; the
launches of a step, and the graph bucket it replays, actors.compute.cuda_launches'; its int32
arrays, actors.compute.cuda_packing's. The layouts named here are the kernels' (see the
comment at the top of each cuda_src/*.cu file).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actors.errors import InvalidRequest
from actors.model.gguf.quants import row_bytes

_PACKAGE_DIR = Path(__file__).resolve().parent.parent

# Block types, GGUF spelling -> the kernels' entry-point suffix (llama.cpp style: lower case
# but the K-quants' K).
KERNEL_TYPE_SUFFIX = {
    "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0",
    "Q4_K": "q4_K", "Q5_K": "q5_K", "Q6_K": "q6_K", "F32": "f32", "F16": "f16", "BF16": "bf16",
}
# What the batched product feeds the tensor cores: exact float16 weight levels and the
# activations split into float16 hi + lo parts (see cuda_src/matmul_batch.cu).
TILE_INPUTS = ("f16x2",)
# The gated activations: activation.cu's gated_<act> and matvec.cu's fused gate+up entries.
ACTIVATIONS = ("silu", "gelu_tanh")

# Constants the kernels are compiled with (cuda_src/*.cu); launches must agree with them.
GROUP = 32  # elements decoded at a time: every row length must be a multiple
ROW_ALIGN = 16  # weight rows start on 16-byte boundaries (matvec's vector loads)
MATVEC_WARPS = 8  # warps per matvec block: MATVEC_WARPS / splits rows of warps x splits
MATVEC_ROWS_PER_WARP = 4
MATVEC_SPLIT_INPUTS = 2048  # K-split: one split per this many inputs, a power of two <= WARPS
# A prefill item of at most this many tokens takes the matvecs (uses_matvec), a longer one
# the batched product.
MATVEC_MAX_BATCH = 8
# mul_mat_vec_mma (matvec_mma.cu): the matvec on the tensor cores, one MMA row tile of 16
# rows a block, 8 warps splitting K; the block types it has entries for. The CUDA-core matvec
# (matvec.cu) has entries for the other types alone (MATVEC_TYPES): it multiplies the rows
# the mma matvec takes where a matrix's type is not one of these.
MATVEC_MMA_TYPES = ("Q4_K", "Q6_K")
MATVEC_TYPES = tuple(t for t in KERNEL_TYPE_SUFFIX if t not in MATVEC_MMA_TYPES)
# The matrices of these types lie on the device in the row-planar layout alone
# (planar_q6_K_rows: the file's 210-byte Q6_K blocks are only 2-byte aligned): every kernel
# reading such a matrix has an entry for that layout (PLANAR_KERNEL) and none for the file's.
PLANAR_TYPES = ("Q6_K",)
PLANAR_KERNEL = "_planar"  # the suffix of those entries, after the block type's
MATVEC_MMA_ROWS, MATVEC_MMA_THREADS = 16, 256
# mul_mat_vec_mma's staging ring of weight pieces in dynamic shared memory (matvec_mma.cu's
# MMA_MATVEC_STAGING_BYTES: 2 stages x 8 pieces of 16 bytes a thread), which its launches ask
# for and its functions must be allowed (past the 48 KB a block has without asking).
MATVEC_MMA_STAGING_BYTES = 2 * 8 * MATVEC_MMA_THREADS * 16
# The batched product (matmul_batch.cu): 64 weight rows x N token columns a block, N the
# fewest of BATCH_TOKENS holding the step's rows (64 columns a token tile past them: a
# prefill chunk's); its grid runs token tiles fastest.
BATCH_TOKENS = (16, 32, 64)
BATCH_QKV_TOKENS = 32  # the batched QKV's most token columns a block (matmul_batch.cu)
BATCH_ROWS, BATCH_THREADS = 64, 128
# Decode steps of more rows than this take the batched product (each weight byte unpacked
# once a step); the mma matvec, paying a pass for every two rows, the others. To be set by
# measurement.
MATVEC_MMA_MAX_ROWS = 8
NORM_THREADS = 256
HEAD_NORM_HEADS_PER_BLOCK = 4
QKV_FINISH_HEADS_PER_BLOCK = 4
ROPE_THREADS = 64
ELEMENTWISE_THREADS = 256
ATTN_WARPS = 4
DECODE_THREADS = ATTN_WARPS * 32
MAX_GROUP_HEADS = 8  # q heads of one KV head per decode attention block
DECODE_TILE_KEYS = 64  # the most keys of a decode tile: splits hold whole ones
PREFILL_QUERIES = 8  # queries of one item and head per prefill attention block
MAX_HEAD_DIM = 256
CANDIDATE_THREADS = 1024
MAX_CANDIDATES = 1024
SMALL_CANDIDATES = 64  # rows asking for at most this many are selected slice by slice
MAX_SLICES = 32  # blocks per row for those
MIN_SLICE = 4096  # ids per slice block, about (fewer blocks than MAX_SLICES)
SLICE_WORDS = 2 + 2 * SMALL_CANDIDATES  # a slice's partial: max, sum, keys, ids
PENALTY_THREADS = 256
MASK_THREADS = 256  # apply_token_mask: a thread per token
KV_BYTES_PER_VALUE = 2  # float16 cache
GRID_LIMIT = 65535  # grid y / z limit; elementwise kernels stride, so x is capped here too


def kernel_source_dir() -> Path:
    """The folder holding the .cu/.cuh kernel sources: `actors/_cuda_src` in an installed
    wheel, the checkout's top-level `cuda_src/` otherwise (including editable installs)."""
    for candidate in (_PACKAGE_DIR / "_cuda_src", _PACKAGE_DIR.parent / "cuda_src"):
        if any(candidate.glob("*.cu")):
            return candidate
    raise FileNotFoundError(
        f"no CUDA kernel sources next to {_PACKAGE_DIR} (looked for _cuda_src/ in the package "
        "and cuda_src/ beside it); reinstall q4k-actors"
    )


def kernel_cache_dir() -> Path:
    """The one folder where PyCUDA keeps the compiled kernels, for the backend, tests/gpu and
    the benchmark alike (one compile of each file per source version, not one per caller);
    made if absent (PyCUDA makes only its own default folder)."""
    folder = Path.home() / ".cache" / "q4k-actors" / "cuda"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def source_module_options(capability: tuple[int, int]) -> dict[str, object]:
    """PyCUDA SourceModule's keyword arguments for a cuda_src file on a device of this
    compute capability: the same for every caller, so they all hit one cache entry."""
    return {"no_extern_c": True, "options": nvcc_options(),
            "include_dirs": [str(kernel_source_dir())], "arch": "sm_%d%d" % capability,
            "cache_dir": str(kernel_cache_dir())}


def nvcc_options() -> list[str]:
    """nvcc options for compiling a cuda_src file (PyCUDA's SourceModule(options=...), with
    no_extern_c=True and include_dirs=[kernel_source_dir()]). No fast-math: the block decode
    must round as quants.py does, and expf / division must keep their accuracy."""
    return ["-std=c++17", "-O3"]


def kernel_entry_points() -> dict[str, tuple[str, ...]]:
    """Source file name -> the `extern "C"` kernels it defines (what `get_function` takes)."""
    types = tuple(KERNEL_TYPE_SUFFIX)
    return {
        "matvec.cu": (*(matvec_kernel(t) for t in MATVEC_TYPES),
                      *(gate_up_kernel(a, kernel_suffix(t)) for a in ACTIVATIONS
                        for t in MATVEC_TYPES),
                      "mul_mat_vec_qkv"),
        "matmul_batch.cu": (*(batch_kernel(t, n, i) for n in BATCH_TOKENS for t in types
                              for i in TILE_INPUTS),
                            *(batch_gate_up_kernel(a, t, n, i) for a in ACTIVATIONS
                              for n in BATCH_TOKENS for t in types for i in TILE_INPUTS),
                            *(batch_qkv_kernel(n, i) for n in BATCH_TOKENS
                              if n <= BATCH_QKV_TOKENS for i in TILE_INPUTS)),
        "matvec_mma.cu": (*(matvec_mma_kernel(t) for t in MATVEC_MMA_TYPES),
                          *(matvec_mma_gate_up_kernel(a, t) for a in ACTIVATIONS
                            for t in MATVEC_MMA_TYPES), "mul_mat_vec_mma_qkv"),
        "embedding.cu": tuple(get_rows_kernel(t) for t in types),
        "norm.cu": ("residual_rms_norm", "head_rms_norm"),
        "rope.cu": ("rope",),
        "activation.cu": ("gated_silu", "gated_gelu_tanh"),
        "kv_cache.cu": ("kv_write",),
        "attention.cu": ("attention_decode", "attention_prefill"),
        "candidates.cu": ("apply_token_mask", "apply_penalties", "top_candidates",
                          "feed_greedy_tokens"),
        "bias.cu": ("add_bias",),
        "qkv_finish.cu": ("qkv_finish",),
    }


def gate_up_kernel(activation: str, suffix: str) -> str:
    """matvec.cu's fused entry y = act(gate . x) * (up . x) for one block type's suffix."""
    return f"mul_mat_vec_gate_up_{activation}_{suffix}"


def kernel_suffix(type_name: str) -> str:
    """The entry-point suffix of a GGUF block type; InvalidRequest for one with no kernels."""
    try:
        return KERNEL_TYPE_SUFFIX[type_name]
    except KeyError:
        raise InvalidRequest(f"no CUDA kernels for tensor type {type_name!r}",
                             field="type") from None


def kernel_type_code(type_name: str) -> int:
    """mul_mat_vec_qkv's code for a block type: its index in KERNEL_TYPE_SUFFIX (the order of
    QK_FOR_EACH_TYPE in cuda_src/quant_blocks.cuh)."""
    kernel_suffix(type_name)
    return list(KERNEL_TYPE_SUFFIX).index(type_name)


# ---------------------------------------------------------------------------------------------
# The weights on the device


def row_pitch(type_name: str, row_length: int) -> int:
    """Bytes between consecutive weight rows on the device: the row's bytes rounded up to 16."""
    if row_length % GROUP:
        raise InvalidRequest(f"rows of {row_length} elements are not a whole number of "
                             f"{GROUP}-element groups: no CUDA kernel decodes them", field="shape")
    return -(-row_bytes(type_name, row_length) // ROW_ALIGN) * ROW_ALIGN


# A Q6_K block's bytes (quants' format), its ql + qh, its scales (then its float16 d).
Q6_K_BLOCK_BYTES, Q6_K_QUANT_BYTES, Q6_K_SCALE_BYTES = row_bytes("Q6_K", 256), 192, 16


def planar_q6_K_rows(rows: np.ndarray) -> np.ndarray:
    """Q6_K rows (n, 210 * nb) uint8 as the file holds them -> (n, row_pitch) uint8 rows in
    the row-planar layout the device holds them in (holds_planar): block k's ql and
    qh (its first 192 bytes) at 192 * k, its 16 scales at 192 * nb + 16 * k, its float16 d at
    208 * nb + 2 * k, then zeros to the pitch. The same bytes, reordered so that every load
    is aligned."""
    n, width = rows.shape
    if width % Q6_K_BLOCK_BYTES:
        raise InvalidRequest(f"Q6_K rows of {width} bytes are not whole blocks", field="shape")
    nb = width // Q6_K_BLOCK_BYTES
    blocks = rows.reshape(n, nb, Q6_K_BLOCK_BYTES)
    fields = np.split(blocks, [Q6_K_QUANT_BYTES, Q6_K_QUANT_BYTES + Q6_K_SCALE_BYTES], axis=2)
    out = np.zeros((n, row_pitch("Q6_K", 256 * nb)), dtype=np.uint8)
    out[:, :width] = np.concatenate([field.reshape(n, -1) for field in fields], axis=1)
    return out


def candidate_record_words(width: int) -> int:
    """32-bit words of one row's top_candidates record: count, log_z, ids[width],
    logits[width]."""
    return 2 + 2 * width


# ---------------------------------------------------------------------------------------------
# Launch geometry


@dataclass(frozen=True)
class Launch:
    """A kernel's grid and block, as PyCUDA's `grid=` and `block=` take them, and the bytes of
    dynamic shared memory it asks for (`shared=`)."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int = 0


def _blocks(n: int, per_block: int) -> int:
    return -(-n // per_block)


def _check_grid(launch: Launch) -> Launch:
    if min(launch.grid) < 1 or max(launch.grid[1:]) > GRID_LIMIT:
        raise InvalidRequest(f"grid {launch.grid} is outside the device's limits",
                             field="shape")
    return launch


def uses_matvec(n_tokens: int) -> bool:
    """A prefill item of up to MATVEC_MAX_BATCH tokens takes the matvecs; a longer one goes to
    the batched product. (Decode rows take their kernels by their number:
    cuda_launches.row_runs.)"""
    return n_tokens <= MATVEC_MAX_BATCH


def holds_planar(type_name: str) -> bool:
    """Whether a matrix of `type_name` lies on the device in the row-planar layout (every Q6_K
    matrix: planar_q6_K_rows), not as the file's blocks."""
    return type_name in PLANAR_TYPES


def _layout_suffix(type_name: str) -> str:
    """The entry-point suffix of a matrix as the device holds it: its block type's, then
    PLANAR_KERNEL where it lies row-planar."""
    suffix = kernel_suffix(type_name)
    return suffix + PLANAR_KERNEL if holds_planar(type_name) else suffix


def _tile_input(tile_input: str) -> str:
    if tile_input not in TILE_INPUTS:
        raise InvalidRequest(f"tile input must be one of {TILE_INPUTS}, got {tile_input!r}",
                             field="tile_input")
    return tile_input


def get_rows_kernel(type_name: str) -> str:
    """The embedding gather of a `type_name` table, as the device holds it."""
    return f"get_rows_{_layout_suffix(type_name)}"


def uses_matvec_mma(type_name: str) -> bool:
    """Whether the matvec rows of a `type_name` matrix take mul_mat_vec_mma (else the
    CUDA-core mul_mat_vec)."""
    return type_name in MATVEC_MMA_TYPES


def matvec_mma_kernel(type_name: str) -> str:
    """The matvec on the tensor cores (mul_mat_vec's arguments, its own summation)."""
    return f"mul_mat_vec_mma_{kernel_suffix(type_name)}"


def matvec_mma_gate_up_kernel(activation: str, type_name: str) -> str:
    """mul_mat_vec_mma's y = act(gate . x) * (up . x) entry for a block type."""
    return f"mul_mat_vec_mma_gate_up_{activation}_{kernel_suffix(type_name)}"


def matvec_mma_launch(rows: int, n_in: int) -> Launch:
    """mul_mat_vec_mma (`rows` output rows) or its gate+up (2 * ffn rows: 8 gate and the same
    8 up rows a block), any batch: MATVEC_MMA_ROWS rows a block, its 8 warps splitting n_in
    (which the grid does not depend on), its staging ring."""
    return _check_grid(Launch((_blocks(rows, MATVEC_MMA_ROWS), 1, 1),
                              (MATVEC_MMA_THREADS, 1, 1), MATVEC_MMA_STAGING_BYTES))


def matvec_mma_qkv_launch(rows_q: int, rows_k: int, rows_v: int) -> Launch:
    """mul_mat_vec_mma_qkv: the 16-row blocks of the three matrices one after the other."""
    blocks = sum(_blocks(rows, MATVEC_MMA_ROWS) for rows in (rows_q, rows_k, rows_v))
    return _check_grid(Launch((blocks, 1, 1), (MATVEC_MMA_THREADS, 1, 1),
                              MATVEC_MMA_STAGING_BYTES))


def dynamic_shared_bytes(kernel: str) -> int:
    """The dynamic shared memory `kernel`'s launches ask for, which its function must be
    allowed before its first launch (the mma matvec's staging ring; none elsewhere)."""
    return MATVEC_MMA_STAGING_BYTES if kernel.startswith("mul_mat_vec_mma_") else 0


def batch_tokens(n_tokens: int, most: int = BATCH_TOKENS[-1]) -> int:
    """The batched product's token columns a block for n_tokens rows: the fewest of
    BATCH_TOKENS holding them, else `most` (several token tiles)."""
    return next((n for n in BATCH_TOKENS if n >= min(n_tokens, most)), most)


def batch_kernel(type_name: str, n_tokens: int, tile_input: str = TILE_INPUTS[0]) -> str:
    """The batched product's entry point of a `type_name` matrix for n_tokens rows, as the
    device holds it: a row's sums the same bits whatever n_tokens."""
    return (f"mul_mat_batch{batch_tokens(n_tokens)}_{_tile_input(tile_input)}_"
            f"{_layout_suffix(type_name)}")


def batch_gate_up_kernel(activation: str, type_name: str, n_tokens: int,
                         tile_input: str = TILE_INPUTS[0]) -> str:
    """The batched product's y = act(gate . x) * (up . x) entry for a block type."""
    return (f"mul_mat_batch{batch_tokens(n_tokens)}_gate_up_{activation}_"
            f"{_tile_input(tile_input)}_{_layout_suffix(type_name)}")


def batch_launch(rows: int, n_tokens: int, rows_per_block: int = BATCH_ROWS,
                 most: int = BATCH_TOKENS[-1]) -> Launch:
    """mul_mat_batch<N>: token tiles of N (batch_tokens, at most `most`) fastest (the blocks
    sharing a weight tile run together and read it from DRAM once), BATCH_ROWS rows a block;
    the gate+up entry passes 32 ffn rows a block (32 gate and the same 32 up rows), the QKV
    entry the rows of its three matrices one after the other."""
    return _check_grid(Launch((_blocks(n_tokens, batch_tokens(n_tokens, most)),
                               _blocks(rows, rows_per_block), 1), (BATCH_THREADS, 1, 1)))


def batch_qkv_kernel(n_tokens: int, tile_input: str = TILE_INPUTS[0]) -> str:
    """The batched product's fused QKV entry (q, k and v, a block type each, and the finish)
    for n_tokens rows."""
    return f"mul_mat_batch{batch_tokens(n_tokens, BATCH_QKV_TOKENS)}_qkv_{_tile_input(tile_input)}"


def batch_qkv_launch(rows: Sequence[int], n_tokens: int) -> Launch:
    """mul_mat_batch<N>_qkv: the 64-row blocks of q, then k, then v (grid y), token tiles of
    at most BATCH_QKV_TOKENS fastest."""
    return batch_launch(sum(_blocks(n, BATCH_ROWS) for n in rows) * BATCH_ROWS, n_tokens,
                        most=BATCH_QKV_TOKENS)


def matvec_kernel(type_name: str) -> str:
    """The CUDA-core matvec's entry point of a `type_name` matrix (one of MATVEC_TYPES, those
    mul_mat_vec_mma does not serve): any number of activation rows, each row's result
    independent of the others."""
    if type_name not in MATVEC_TYPES:
        raise InvalidRequest(f"{type_name} matrices take mul_mat_vec_mma, not the CUDA-core "
                             "matvec", field="type")
    return f"mul_mat_vec_{kernel_suffix(type_name)}"


def matvec_splits(n_in: int) -> int:
    """Warps sharing each matvec row (K-split): a power of two <= MATVEC_WARPS, one per
    MATVEC_SPLIT_INPUTS inputs. A function of n_in alone, so every matvec entry point sums a
    row of a given length in the same order (the fused ones match the plain one bit for bit)."""
    splits = 1
    while splits * 2 <= min(MATVEC_WARPS, n_in // MATVEC_SPLIT_INPUTS):
        splits *= 2
    return splits


def matvec_rows_per_block(n_in: int) -> int:
    return MATVEC_WARPS // matvec_splits(n_in) * MATVEC_ROWS_PER_WARP


def matvec_launch(rows: int, n_in: int) -> Launch:
    """mul_mat_vec_<type> (`rows` output rows) or mul_mat_vec_gate_up_* (2 * ffn rows: gate
    and up), any batch: blockDim = (32 * warps per split, splits), a block per
    matvec_rows_per_block rows. The batch does not enter: a row's sums never depend on it."""
    splits = matvec_splits(n_in)
    return _check_grid(Launch((_blocks(rows, matvec_rows_per_block(n_in)), 1, 1),
                              (32 * MATVEC_WARPS // splits, splits, 1)))


def qkv_launch(rows_q: int, rows_k: int, rows_v: int, n_in: int) -> Launch:
    """mul_mat_vec_qkv: the blocks of the three matrices one after the other (each block's
    rows lie in one matrix; a head's rows may span blocks, a block may hold several heads)."""
    per_block = matvec_rows_per_block(n_in)
    single = matvec_launch(1, n_in)
    blocks = sum(_blocks(rows, per_block) for rows in (rows_q, rows_k, rows_v))
    return _check_grid(Launch((blocks, 1, 1), single.block))


def get_rows_launch(n_ids: int, d_model: int) -> Launch:
    """One block per id, a thread per 32-element group (at most 128, a multiple of 32)."""
    threads = min(128, _blocks(d_model // GROUP, 32) * 32)
    return _check_grid(Launch((n_ids, 1, 1), (threads, 1, 1)))


def norm_launch(n_rows: int) -> Launch:
    return _check_grid(Launch((n_rows, 1, 1), (NORM_THREADS, 1, 1)))


def head_norm_launch(n_tokens: int, n_heads: int) -> Launch:
    return _check_grid(Launch((_blocks(n_heads, HEAD_NORM_HEADS_PER_BLOCK), n_tokens, 1),
                              (HEAD_NORM_HEADS_PER_BLOCK * 32, 1, 1)))


def qkv_finish_launch(n_tokens: int, n_heads: int) -> Launch:
    """qkv_finish: one warp per head (q, k and v heads together) of each token."""
    return _check_grid(Launch((_blocks(n_heads, QKV_FINISH_HEADS_PER_BLOCK), n_tokens, 1),
                              (QKV_FINISH_HEADS_PER_BLOCK * 32, 1, 1)))


def rope_launch(n_tokens: int, n_heads: int) -> Launch:
    return _check_grid(Launch((n_heads, n_tokens, 1), (ROPE_THREADS, 1, 1)))


def elementwise_launch(n_elements: int) -> Launch:
    """Grid-stride kernels (gated activations, kv_write): enough blocks to cover n_elements,
    capped (the kernels loop)."""
    return Launch((min(_blocks(n_elements, ELEMENTWISE_THREADS), GRID_LIMIT), 1, 1),
                  (ELEMENTWISE_THREADS, 1, 1))


def decode_splits(context_length: int, split_keys: int) -> int:
    """Splits per (sequence, head) so that any sequence's keys fit. A decode graph keeps this
    grid for every step; splits past a sequence's keys (or before its window) return at once
    and write nothing."""
    if split_keys < 1 or split_keys % DECODE_TILE_KEYS:
        raise InvalidRequest(f"split_keys must be a positive multiple of {DECODE_TILE_KEYS}, "
                             f"got {split_keys}", field="split_keys")
    return _blocks(context_length, split_keys)


def attention_decode_launch(n_seqs: int, n_heads: int, n_kv_heads: int,
                            n_splits: int) -> Launch:
    """attention_decode: per split, per KV head the q heads of its group in blocks of up to
    MAX_GROUP_HEADS, per sequence."""
    group = n_heads // n_kv_heads
    head_blocks = n_kv_heads * _blocks(group, MAX_GROUP_HEADS)
    return _check_grid(Launch((n_splits, head_blocks, n_seqs), (DECODE_THREADS, 1, 1)))


def attention_prefill_launch(max_item_tokens: int, n_heads: int, n_items: int) -> Launch:
    return _check_grid(Launch((_blocks(max_item_tokens, PREFILL_QUERIES), n_heads, n_items),
                              (ATTN_WARPS * 32, 1, 1)))


def token_mask_launch(n_masked: int, vocab: int) -> Launch:
    """apply_token_mask: a thread per token of each masked row (grid y: the masked rows)."""
    return _check_grid(Launch((_blocks(vocab, MASK_THREADS), n_masked, 1),
                              (MASK_THREADS, 1, 1)))


def penalties_launch(n_rows: int) -> Launch:
    return _check_grid(Launch((n_rows, 1, 1), (PENALTY_THREADS, 1, 1)))


def candidate_slices(vocab: int) -> int:
    """Blocks per row of top_candidates: one per MIN_SLICE ids begun, at most MAX_SLICES
    (a row asking for more than SMALL_CANDIDATES uses only the first)."""
    return min(MAX_SLICES, _blocks(vocab, MIN_SLICE))


def candidates_launch(n_rows: int, k: int, vocab: int) -> Launch:
    """top_candidates: candidate_slices(vocab) blocks per row; 1 <= k <= min(vocab,
    MAX_CANDIDATES) (k: the record width, the most candidates any row asks)."""
    if not 1 <= k <= min(vocab, MAX_CANDIDATES):
        raise InvalidRequest(f"candidates per row must be in [1, {min(vocab, MAX_CANDIDATES)}], "
                             f"got {k}", field="candidates")
    return _check_grid(Launch((candidate_slices(vocab), n_rows, 1), (CANDIDATE_THREADS, 1, 1)))
