// The batched product: a matrix times all of a step's rows on the tensor cores (mma.sync
// m16n8k16, float16 inputs, float32 accumulation; sm_80+), the rows in the MMA's token
// dimension, so each weight byte is fetched and unpacked once per N rows: decode steps past
// the mma matvec's rows, every step's logits rows and every prefill chunk past the matvec's
// tokens (at 64 columns a block) take it.
//
// Numerics: each activation is split into float16 parts, x = (hi + lo) 2^e with hi =
// f16(x 2^-e) and lo = f16(x 2^-e - hi) (about 22 bits of x), e a power-of-two exponent per
// token and stage (32 elements) that keeps the parts in float16's range for any float and is 0
// for the usual magnitudes (activation_split.cuh), and both parts are multiplied by the
// weights' levels; each stage's float32 sums are multiplied by 2^e (exact) before they join
// the token's sums:
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
// Entry points, per block type as the device holds it (<type>: q4_0 ... bf16, and
// q6_K_planar: every Q6_K matrix lies row-planar, cuda_plan.planar_q6_K_rows), N in 16, 32,
// 64 (the step's bucket: the fewest columns holding its rows; 64 and more token tiles past
// them), <act> in silu, gelu_tanh:
//   mul_mat_batch<N>_f16x2_<type>(weights, int64 row_pitch, x, int x_stride, y, int y_stride,
//                                 int rows, int n_in, int n_tokens)
//       y[t][r] = W[r] . x[t]: blocks of 64 rows x N tokens (BatchTile<N>), 4 warps of 16 rows
//       x N tokens. Grid (ceil(n_tokens / N), ceil(rows / 64)): token tiles fastest, so the
//       blocks sharing a weight tile run together and read it from DRAM once.
//   mul_mat_batch<N>_gate_up_<act>_f16x2_<type>(gate, up, int64 row_pitch, x, x_stride, y,
//                                               y_stride, int ffn_rows, n_in, n_tokens)
//       y[t][f] = act(gate[f] . x[t]) * (up[f] . x[t]): 32 gate and the same 32 up rows a
//       block (grid y: ceil(ffn_rows / 32)), bit for bit mul_mat_batch<N>_f16x2_<type> of
//       gate and of up then activation.cu's gated_<act>.
//   mul_mat_batch<N>_qkv_f16x2(matvec.cu's mul_mat_vec_qkv arguments)
//       q, k and v (a block type each, as the device holds it) into one qkv row and their
//       heads finished (qkv_finish_ops.cuh's epilogue, head_counters a token tile: n_heads +
//       2 n_kv_heads of them), bit for bit mul_mat_batch<N>_f16x2_<type> of each matrix then
//       qkv_finish. Grid y: the 64-row blocks of q, then k, then v. N in 16, 32 only (more
//       rows take more token tiles): at 64 the out-of-line Q6_K product spilled registers.
// Layouts as in matvec.cu: weights at row_pitch bytes per row (16-byte aligned rows), x
// [n_tokens][x_stride] float32 with 16-byte aligned rows (x_stride % 4 == 0), n_in % 32 == 0,
// y [n_tokens][y_stride] float32. Each warp unpacks its 16 rows' weight fragments once a stage
// (32 elements) and multiplies them with the N / 8 MMA column tiles of the block's tokens
// (tile_pipeline.cuh). A token's sums are taken stage by stage, MMA by MMA, with the same split
// of x: whatever N, the number of rows or the other rows, a token's result is the same bits
// (the K order depends on the matrix alone, and MMA columns are independent).
#include "tile_pipeline.cuh"

// Gate and up with the activation: tile rows 0..31 are gate rows f0.. (warps 0 and 1), rows
// 32..63 the same up rows (warps 2 and 3); y[t][f] = act(gate . x) * (up . x) as
// activation.cu's gated_<act>, from the block's sums gathered in the scratch.
template <class Shape, class Op>
struct TileGateUp : GateUpRows<Shape::ROWS / 2> {
    // The stages' loops unrolled, the two matrices' rows spilled registers at 8 column tiles.
    static constexpr bool ROLLED = Shape::J > 4;
    static constexpr int HALF = Shape::ROWS / 2;
    static_assert(Shape::ROWS * sizeof(float) <= 2 * X_PIECES * sizeof(uint4),
                  "the activation stages hold the block's sums");
    using GateUpRows<HALF>::first_row;
    using GateUpRows<HALF>::ffn_rows;
    using GateUpRows<HALF>::y;
    using GateUpRows<HALF>::y_stride;
    __device__ void store(const float (&acc)[Shape::I][Shape::J][4], float* scratch,
                          int warp_rows, int token0, int warp_tokens, int n_tokens) const {
        __syncthreads();  // every warp is done with the activation stages
        store_tile<Shape>(acc, scratch, Shape::ROWS, warp_rows, warp_tokens, Shape::ROWS,
                          Shape::TOKENS);
        __syncthreads();
        for (int e = threadIdx.x; e < HALF * Shape::TOKENS; e += blockDim.x) {
            const int r = e % HALF, t = e / HALF;
            if (first_row() + r < ffn_rows && token0 + t < n_tokens) {
                const float* sums = scratch + t * Shape::ROWS;
                y[int64_t(token0 + t) * y_stride + first_row() + r] =
                    Op::apply(sums[r]) * sums[HALF + r];
            }
        }
    }
};

// One segment (q, k or v) of the batched QKV: the block's tile rows are the segment's rows
// from (blockIdx.y - block_first) * ROWS, their sums at the segment's column of y; the
// product's activations with it (the out-of-line product takes it all from shared memory).
template <class Shape>
struct TileQkvSegment {
    static constexpr bool ROLLED = false;
    QkvSegment seg;
    float* y;
    int y_stride;
    const float* x;
    int x_stride, n_in, n_tokens;

    __device__ int first_row() const { return (blockIdx.y - seg.block_first) * Shape::ROWS; }
    __device__ WeightRow row(int r) const {
        return WeightRow{seg.weights + (first_row() + r) * seg.pitch, first_row() + r < seg.rows};
    }
    __device__ void store(const float (&acc)[Shape::I][Shape::J][4], float*, int warp_rows,
                          int token0, int warp_tokens, int n_tokens) const {
        store_tile<Shape>(acc, y + seg.column, y_stride, first_row() + warp_rows,
                          token0 + warp_tokens, seg.rows, n_tokens);
    }
};

// The largest head the batched QKV finishes (attention.cu's MAX_HEAD_DIM).
constexpr int BATCH_QKV_MAX_HEAD_DIM = 256;

// Every block type's shared memory in one place (a block multiplies one segment, of one
// type), and the finish's head copies (a head_dim copy a warp, used once the products are
// done).
#define QK_BATCH_SHARED_MEMBER(suffix, block_type) TileShared<block_type, BatchTile<N>> suffix;
template <int N>
union BatchQkvShared {
    QK_FOR_EACH_HELD_TYPE(QK_BATCH_SHARED_MEMBER)
    float head_copies[BatchTile<N>::THREADS / WARP * BATCH_QKV_MAX_HEAD_DIM];
};

// The block's tile of its segment, out of line: the eleven products inlined in one kernel
// spill registers (no one of them alone does).
template <class T, int N>
__device__ __noinline__ void batch_qkv_tile(const TileQkvSegment<BatchTile<N>>& job,
                                            TileShared<T, BatchTile<N>>& shared) {
    mul_mat_tiles<T>(job, shared, job.x, job.x_stride, job.n_in, job.n_tokens);
}

#define QK_BATCH_QKV_CASE(suffix, block_type)                                                 \
    if (job.seg.type_code == code++) {                                                        \
        batch_qkv_tile<block_type, N>(job, shared.suffix);                                    \
        return;                                                                               \
    }

// Type codes as mul_mat_vec_qkv's (QK_FOR_EACH_HELD_TYPE keeps their order); the segment's
// type is block-uniform.
template <int N>
__device__ void batch_qkv_segment_of_its_type(const TileQkvSegment<BatchTile<N>>& job,
                                              BatchQkvShared<N>& shared) {
    int code = 0;
    QK_FOR_EACH_HELD_TYPE(QK_BATCH_QKV_CASE)
    __trap();  // a type code cuda_plan.kernel_type_code never gives
}

template <int N>
__device__ void batch_qkv(QK_QKV_PARAMETERS) {
    using Shape = BatchTile<N>;
    __shared__ BatchQkvShared<N> shared;
    // The job in shared memory: the out-of-line products take it by reference.
    __shared__ TileQkvSegment<Shape> job;
    const QkvSegment seg = qkv_segment_of_block(blockIdx.y, Shape::ROWS, QK_QKV_ARGUMENTS);
    if (threadIdx.x == 0) job = {seg, y, y_stride, x, x_stride, n_in, batch};
    __syncthreads();
    batch_qkv_segment_of_its_type<N>(job, shared);
    const int token0 = blockIdx.x * Shape::TOKENS;
    const int heads = (rows_q + rows_k + rows_v) / head_dim;
    finish_qkv_block<Shape::ROWS>(
        QkvBlock{int(blockIdx.y), Shape::ROWS, token0, min(token0 + Shape::TOKENS, batch),
                 head_counters + blockIdx.x * heads},
        seg, shared.head_copies, QK_QKV_ARGUMENTS);
}

#define QK_BATCH_QKV_ENTRY(n)                                                               \
    extern "C" __global__ void __launch_bounds__(BatchTile<n>::THREADS, TILE_BLOCKS_PER_SM) \
        mul_mat_batch##n##_qkv_f16x2(QK_QKV_PARAMETERS) {                                   \
        batch_qkv<n>(QK_QKV_ARGUMENTS);                                                     \
    }

QK_BATCH_QKV_ENTRY(16)
QK_BATCH_QKV_ENTRY(32)

#define QK_BATCH_GATE_UP_ENTRY(n, act, op, suffix, type)                                        \
    extern "C" __global__ void __launch_bounds__(BatchTile<n>::THREADS, TILE_BLOCKS_PER_SM)     \
        mul_mat_batch##n##_gate_up_##act##_f16x2_##suffix(                                      \
            const uint8_t* gate, const uint8_t* up, int64_t row_pitch, const float* x,          \
            int x_stride, float* y, int y_stride, int ffn_rows, int n_in, int n_tokens) {       \
        __shared__ TileShared<type, BatchTile<n>> shared;                                       \
        mul_mat_tiles<type>(                                                                    \
            TileGateUp<BatchTile<n>, op>{{gate, up, row_pitch, ffn_rows, y, y_stride}}, shared, \
            x, x_stride, n_in, n_tokens);                                                       \
    }

#define QK_BATCH_ENTRIES_N(n, suffix, type)                                                     \
    extern "C" __global__ void __launch_bounds__(BatchTile<n>::THREADS, TILE_BLOCKS_PER_SM)     \
        mul_mat_batch##n##_f16x2_##suffix(const uint8_t* weights, int64_t row_pitch,            \
                                          const float* x, int x_stride, float* y,              \
                                          int y_stride, int rows, int n_in, int n_tokens) {     \
        __shared__ TileShared<type, BatchTile<n>> shared;                                       \
        mul_mat_tiles<type>(TileMatrix<BatchTile<n>>{weights, row_pitch, rows, y, y_stride},   \
                            shared, x, x_stride, n_in, n_tokens);                               \
    }                                                                                           \
    QK_BATCH_GATE_UP_ENTRY(n, silu, silu_op, suffix, type)                                      \
    QK_BATCH_GATE_UP_ENTRY(n, gelu_tanh, gelu_tanh_op, suffix, type)

#define QK_BATCH_ENTRIES(suffix, type)  \
    QK_BATCH_ENTRIES_N(16, suffix, type) \
    QK_BATCH_ENTRIES_N(32, suffix, type) \
    QK_BATCH_ENTRIES_N(64, suffix, type)

QK_FOR_EACH_HELD_TYPE(QK_BATCH_ENTRIES)
