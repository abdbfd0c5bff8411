// Prefill matrix x activations on tensor cores: y[t][r] = sum_i W[r][i] * x[t][i] for many
// tokens t (mma.sync m16n8k16, float16 inputs, float32 accumulation; sm_80+).
//
// Numerics (entry points mul_mat_tiles_f16x2_<type>): each activation is split into float16
// parts, x = (hi + lo) 2^e with hi = f16(x 2^-e) and lo = f16(x 2^-e - hi) (about 22 bits of
// x), e a power-of-two exponent per token and stage (32 elements) that keeps the parts in
// float16's range for any float and is 0 for the usual magnitudes (activation_split.cuh), and
// both parts are multiplied by the weights' levels; each stage's float32 sums are multiplied
// by 2^e (exact) before they join the token's sums:
// - quantized types (tile_levels.cuh): the integer levels are exact in float16, so per scale
//   group (32 elements, Q6_K 16) the tensor cores sum levels x (hi + lo) in float32, and the
//   block's scale and offset are applied to the sums: y += scale * (2^e sum(level * x)) +
//   offset * sum(x). Two MMAs per product; sum(x) (the offset types', 32-element groups) is
//   each token's float32 sum of the stage, taken once a block by the threads that split it.
// - F16 weights: exact in float16, W x hi + W x lo, summed a stage, then 2^e times that.
// - F32 / BF16 weights: split as the activations (without a scale: |w| < 65,520),
//   W_hi x_hi + W_hi x_lo + W_lo x_hi, summed a stage, then 2^e times that.
// One float16 rounding of the activations moves logits past the 0.05 allowed (the emulated
// tiny qwen2: 0.054 off the CPU; with the split 0.024).
//
// Entry points, per block type as the device holds it (<type> as in matvec.cu, and
// q6_K_planar: every Q6_K matrix lies row-planar, cuda_plan.planar_q6_K_rows):
//   mul_mat_tiles_f16x2_<type>(weights, int64 row_pitch, x, int x_stride, y, int y_stride,
//                              int rows, int n_in, int n_tokens)
//       prefill: blocks of 64 rows x 64 tokens, 4 warps of 32 x 32 (tile_shape PrefillTile).
// Each computes every y value from its own weight row and token alone, in the same order
// whatever n_tokens is: a token's results do not depend on the batch.
//
// Layouts as in matvec.cu: weights at row_pitch bytes per row (16-byte aligned rows), x
// [n_tokens][x_stride] float32 with 16-byte aligned rows (x_stride % 4 == 0), n_in % 32 == 0,
// y [n_tokens][y_stride] float32. Grid: (ceil(n_tokens / 64), ceil(rows / 64)): token tiles
// fastest, so the blocks sharing a weight tile run together and read it from DRAM once.
//
// The tiles' pipeline and block math: tile_pipeline.cuh (matmul_batch.cu's batched product
// runs the same on another tile shape).
#include "tile_pipeline.cuh"

#define QK_PREFILL_TILES_ENTRY(suffix, type)                                                     \
    extern "C" __global__ void __launch_bounds__(PrefillTile::THREADS, TILE_BLOCKS_PER_SM)        \
        mul_mat_tiles_f16x2_##suffix(const uint8_t* weights, int64_t row_pitch, const float* x,  \
                                     int x_stride, float* y, int y_stride, int rows, int n_in,   \
                                     int n_tokens) {                                             \
        __shared__ TileShared<type, PrefillTile> shared;                                         \
        mul_mat_tiles<type>(TileMatrix<PrefillTile>{weights, row_pitch, rows, y, y_stride},       \
                            shared, x, x_stride, n_in, n_tokens);                                \
    }

QK_FOR_EACH_HELD_TYPE(QK_PREFILL_TILES_ENTRY)
