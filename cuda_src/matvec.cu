// Decode matrix x activations: y[b][r] = sum_i W[r][i] * x[b][i] for a batch of up to
// MATVEC_MAX_BATCH activation rows, reading each weight block once for the whole batch.
//
// Layouts (the CUDA backend must follow them):
//   weights  rows of the GGUF tensor as stored in the file, each row at `row_pitch` bytes
//            from the previous one; row_pitch is the row's bytes rounded up to 16 and the
//            base is 16-byte aligned (cuda_plan.row_pitch), so rows load as 16-byte vectors.
//   x        float32 [batch][x_stride], x_stride % 4 == 0, 16-byte aligned; n_in % 32 == 0.
//   y        float32 [batch][y_stride] (a stride lets gate and up share one buffer).
// One warp per output row, MATVEC_WARPS rows per block (grid = ceil(rows / MATVEC_WARPS)).
// Each warp stages a run of whole weight blocks into shared memory with 16-byte loads (several
// per lane in flight), then each lane decodes whole 32-element groups from there and takes
// their dot product with every activation row; the lanes' partial sums meet in a shuffle.
#include "device_common.cuh"
#include "quant_blocks.cuh"

constexpr int MATVEC_WARPS = 4;
constexpr int MATVEC_MAX_BATCH = 8;
constexpr int STAGE_TARGET_BYTES = 2048;

// Blocks staged per step: a multiple of 8 blocks (every type's BLOCK_BYTES is even, so the run
// is a whole number of 16-byte vectors) near STAGE_TARGET_BYTES.
template <class T>
constexpr int stage_blocks = 8 * (STAGE_TARGET_BYTES / (8 * T::BLOCK_BYTES) > 0
                                      ? STAGE_TARGET_BYTES / (8 * T::BLOCK_BYTES) : 1);

template <class T>
__device__ void mul_mat_vec(const uint8_t* __restrict__ weights, int64_t row_pitch,
                            const float* __restrict__ x, int x_stride, float* __restrict__ y,
                            int y_stride, int rows, int n_in, int batch) {
    constexpr int STAGE_BLOCKS = stage_blocks<T>;
    constexpr int STAGE_BYTES = STAGE_BLOCKS * T::BLOCK_BYTES;
    constexpr int GPB = groups_per_block<T>;
    __shared__ __align__(16) uint8_t stage[MATVEC_WARPS][STAGE_BYTES];

    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int row = blockIdx.x * MATVEC_WARPS + warp;
    if (row >= rows) return;  // the whole warp leaves: only warp-level syncs follow
    const uint8_t* w_row = weights + row * row_pitch;
    uint8_t* my_stage = stage[warp];
    const int n_blocks = n_in / T::BLOCK_ELEMENTS;

    float acc[MATVEC_MAX_BATCH];
#pragma unroll
    for (int b = 0; b < MATVEC_MAX_BATCH; ++b) acc[b] = 0.0f;

    for (int first = 0; first < n_blocks; first += STAGE_BLOCKS) {
        const int run = min(STAGE_BLOCKS, n_blocks - first);
        const int vectors = (run * T::BLOCK_BYTES + 15) / 16;  // may read into the row's padding
        const uint4* src = reinterpret_cast<const uint4*>(w_row + first * T::BLOCK_BYTES);
#pragma unroll 4
        for (int v = lane; v < vectors; v += WARP) {
            reinterpret_cast<uint4*>(my_stage)[v] = __ldg(src + v);
        }
        __syncwarp();
        for (int g = lane; g < run * GPB; g += WARP) {
            float w[GROUP];
            T::dequantize_group(my_stage + (g / GPB) * T::BLOCK_BYTES, g % GPB, w);
            const int column = (first * GPB + g) * GROUP;
#pragma unroll
            for (int b = 0; b < MATVEC_MAX_BATCH; ++b) {
                if (b >= batch) break;
                const float4* xs = reinterpret_cast<const float4*>(x + b * x_stride + column);
                float sum = 0.0f;
#pragma unroll
                for (int i = 0; i < GROUP / 4; ++i) {
                    const float4 v = __ldg(xs + i);
                    sum += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z +
                           w[4 * i + 3] * v.w;
                }
                acc[b] += sum;
            }
        }
        __syncwarp();  // the stage is rewritten next step
    }
#pragma unroll
    for (int b = 0; b < MATVEC_MAX_BATCH; ++b) {
        if (b >= batch) break;
        const float total = warp_sum(acc[b]);
        if (lane == 0) y[b * y_stride + row] = total;
    }
}

// The occupancy hint (4 blocks per SM) lets ptxas take up to 128 registers; without it the
// q4_K build capped itself at 64 and spilled.
#define QK_MATVEC_ENTRY(suffix, type)                                                           \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * WARP, 4) mul_mat_vec_##suffix(     \
        const uint8_t* weights, int64_t row_pitch, const float* x, int x_stride, float* y,      \
        int y_stride, int rows, int n_in, int batch) {                                          \
        mul_mat_vec<type>(weights, row_pitch, x, x_stride, y, y_stride, rows, n_in, batch);     \
    }

QK_FOR_EACH_TYPE(QK_MATVEC_ENTRY)
