// Prefill / large-batch matrix x activations on tensor cores (WMMA, 16x16x16, float
// accumulate): y[t][r] = sum_i W[r][i] * x[t][i] for many tokens t.
//
// Each block computes a TILE_ROWS x TILE_TOKENS tile of y. Per 32-element step of the inner
// dimension it decodes the tile's weight groups (one row per thread of the first half of the
// block) and converts the activations (one token per thread of the second half) into shared
// memory as `In` (half or bfloat16), then each of the 4 warps multiplies its 32x32 quarter.
// Layouts as in matvec.cu (weights at row_pitch bytes per row; x [n_tokens][x_stride] float32,
// n_in % 32 == 0; y [n_tokens][y_stride] float32). Grid: (ceil(rows / 64), ceil(n_tokens / 64)).
// Entry points: mul_mat_tiles_f16_<type> (inputs rounded to float16: values must stay within
// +-65504), mul_mat_tiles_bf16_<type> (float32's range, 8-bit mantissa) and
// mul_mat_tiles_f16x3_<type>: each input split into float16 parts, v = hi + lo with
// hi = f16(v), lo = f16(v - hi), and W x = W_lo x_hi + W_hi x_lo + W_hi x_hi (three products
// per step, the small ones first): about 22 bits of each input instead of 11, within float16's
// range. The CUDA backend uses this one: a single rounding to float16 of weights and
// activations moves logits by up to ~0.06 on the reference models, past the 0.05 allowed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include "device_common.cuh"
#include "quant_blocks.cuh"

using namespace nvcuda;

constexpr int TILE_ROWS = 64, TILE_TOKENS = 64, TILE_PAD = 8, WMMA_N = 16;
constexpr int TILE_THREADS = 128;
constexpr int TILE_LD = GROUP + TILE_PAD;  // padded row of a staged tile, in elements

template <class In>
__device__ In to_input(float value);
template <>
__device__ __half to_input<__half>(float value) { return __float2half_rn(value); }
template <>
__device__ __nv_bfloat16 to_input<__nv_bfloat16>(float value) {
    return __float2bfloat16_rn(value);
}

// One row of a staged tile: 32 floats converted to In, as PARTS parts (1: the rounded value;
// 2: hi = In(v) into dest_hi, lo = In(v - hi) into dest_lo).
template <class In, int PARTS>
__device__ void stage_row(In* dest_hi, In* dest_lo, const float* values) {
#pragma unroll
    for (int i = 0; i < GROUP; ++i) {
        const In hi = to_input<In>(values[i]);
        dest_hi[i] = hi;
        if (PARTS == 2) dest_lo[i] = to_input<In>(values[i] - float(hi));
    }
}

template <class T, class In, int PARTS>
__device__ void mul_mat_tiles(const uint8_t* __restrict__ weights, int64_t row_pitch,
                              const float* __restrict__ x, int x_stride, float* __restrict__ y,
                              int y_stride, int rows, int n_in, int n_tokens) {
    // [part][row][k]: part 0 the rounded value (hi), part 1 (PARTS == 2) the remainder (lo).
    __shared__ __align__(32) In w_tile[PARTS][TILE_ROWS][TILE_LD];
    __shared__ __align__(32) In x_tile[PARTS][TILE_TOKENS][TILE_LD];
    __shared__ __align__(32) float y_tile[TILE_TOKENS][TILE_ROWS + 4];

    const int row0 = blockIdx.x * TILE_ROWS, token0 = blockIdx.y * TILE_TOKENS;
    const int warp = threadIdx.x / WARP;
    const int warp_rows = (warp / 2) * 32, warp_tokens = (warp % 2) * 32;

    wmma::fragment<wmma::accumulator, WMMA_N, WMMA_N, WMMA_N, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    }

    for (int group = 0; group < n_in / GROUP; ++group) {
        float values[GROUP];
        if (threadIdx.x < TILE_ROWS) {  // warps 0-1: decode one weight row's group each
            const int row = row0 + threadIdx.x;
            if (row < rows) {
                dequantize_row_group<T>(weights + row * row_pitch, group, values);
            } else {
#pragma unroll
                for (int i = 0; i < GROUP; ++i) values[i] = 0.0f;
            }
            stage_row<In, PARTS>(w_tile[0][threadIdx.x], w_tile[PARTS - 1][threadIdx.x], values);
        } else {  // warps 2-3: one token's 32 activations each
            const int t = threadIdx.x - TILE_ROWS, token = token0 + t;
            const float4* src =
                reinterpret_cast<const float4*>(x + token * x_stride + group * GROUP);
#pragma unroll
            for (int i = 0; i < GROUP / 4; ++i) {
                const float4 v = token < n_tokens ? __ldg(src + i) : make_float4(0, 0, 0, 0);
                values[4 * i] = v.x;
                values[4 * i + 1] = v.y;
                values[4 * i + 2] = v.z;
                values[4 * i + 3] = v.w;
            }
            stage_row<In, PARTS>(x_tile[0][t], x_tile[PARTS - 1][t], values);
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < GROUP; k += WMMA_N) {
            wmma::fragment<wmma::matrix_a, WMMA_N, WMMA_N, WMMA_N, In, wmma::row_major> a[PARTS][2];
            wmma::fragment<wmma::matrix_b, WMMA_N, WMMA_N, WMMA_N, In, wmma::col_major> b[PARTS][2];
#pragma unroll
            for (int p = 0; p < PARTS; ++p) {
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    wmma::load_matrix_sync(a[p][i], &w_tile[p][warp_rows + WMMA_N * i][k], TILE_LD);
                    wmma::load_matrix_sync(b[p][i], &x_tile[p][warp_tokens + WMMA_N * i][k],
                                           TILE_LD);
                }
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    if (PARTS == 2) {  // the small products first
                        wmma::mma_sync(acc[i][j], a[1][i], b[0][j], acc[i][j]);
                        wmma::mma_sync(acc[i][j], a[0][i], b[1][j], acc[i][j]);
                    }
                    wmma::mma_sync(acc[i][j], a[0][i], b[0][j], acc[i][j]);
                }
            }
        }
        __syncthreads();  // the tiles are restaged next step
    }
    // acc[i][j] element (row m, token n) goes to y_tile[n][m]: column-major storage.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            wmma::store_matrix_sync(&y_tile[warp_tokens + WMMA_N * j][warp_rows + WMMA_N * i],
                                    acc[i][j], TILE_ROWS + 4, wmma::mem_col_major);
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < TILE_ROWS * TILE_TOKENS; e += TILE_THREADS) {
        const int t = e / TILE_ROWS, r = e % TILE_ROWS;
        if (token0 + t < n_tokens && row0 + r < rows) {
            y[(token0 + t) * y_stride + row0 + r] = y_tile[t][r];
        }
    }
}

#define QK_MATMUL_ENTRY_FOR(in_suffix, in_type, parts, suffix, type)                            \
    extern "C" __global__ void __launch_bounds__(TILE_THREADS)                                  \
        mul_mat_tiles_##in_suffix##_##suffix(const uint8_t* weights, int64_t row_pitch,         \
                                             const float* x, int x_stride, float* y,            \
                                             int y_stride, int rows, int n_in, int n_tokens) {  \
        mul_mat_tiles<type, in_type, parts>(weights, row_pitch, x, x_stride, y, y_stride, rows,  \
                                            n_in, n_tokens);                                    \
    }
#define QK_MATMUL_ENTRIES(suffix, type)                          \
    QK_MATMUL_ENTRY_FOR(f16, __half, 1, suffix, type)            \
    QK_MATMUL_ENTRY_FOR(bf16, __nv_bfloat16, 1, suffix, type)    \
    QK_MATMUL_ENTRY_FOR(f16x3, __half, 2, suffix, type)

QK_FOR_EACH_TYPE(QK_MATMUL_ENTRIES)
