// RMSNorm kernels, float32: norm(v) = v / sqrt(mean(v^2) + eps) * weight, as forward.rms_norm
// (sum of squares, times 1/n, plus eps, sqrt, divide, times weight; the sum is a float32 tree
// here, so results match the CPU to float tolerance, not bit for bit).
#include "head_ops.cuh"

constexpr int NORM_THREADS = 256;

// sqrt(mean(v^2) + eps) over v[0..n), the divisor of an RMS norm; every thread gets it.
__device__ float block_rms_divisor(const float* v, int n, float eps, float* scratch) {
    float squares = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) squares += v[i] * v[i];
    const float mean = block_sum(squares, scratch) * (1.0f / float(n));
    return sqrtf(mean + eps);
}

// One block (NORM_THREADS) per token row:
//   if delta:  delta' = delta_weight ? norm(delta) * delta_weight : delta  (gemma-3's post-norms)
//              x += delta'                                                  (the residual add)
//   out = norm(x) * weight
// x [rows][d] is updated in place; delta and out are [rows][d]; out may not alias x.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    residual_rms_norm(float* __restrict__ x, const float* __restrict__ delta,
                      const float* __restrict__ delta_weight, const float* __restrict__ weight,
                      float* __restrict__ out, int d, float eps) {
    __shared__ float scratch[WARP];
    const int64_t offset = int64_t(blockIdx.x) * d;
    float* row = x + offset;
    if (delta != nullptr) {
        const float* add = delta + offset;
        const float divisor =
            delta_weight != nullptr ? block_rms_divisor(add, d, eps, scratch) : 1.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            row[i] += delta_weight != nullptr ? add[i] / divisor * delta_weight[i] : add[i];
        }
        __syncthreads();  // every thread's part of x is written before the sums read it
    }
    const float divisor = block_rms_divisor(row, d, eps, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        out[offset + i] = row[i] / divisor * weight[i];
    }
}

// Per-head RMSNorm in place (gemma-3's q/k norms): head h of token t is
// x[t * row_stride + h * head_dim ...], normed over head_dim with one weight vector shared by
// all heads. One warp per head: grid (ceil(n_heads / 4), n_tokens), 128 threads.
extern "C" __global__ void __launch_bounds__(4 * WARP)
    head_rms_norm(float* __restrict__ x, int row_stride, int n_heads, int head_dim,
                  const float* __restrict__ weight, float eps) {
    const int head = blockIdx.x * 4 + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (head >= n_heads) return;
    warp_head_rms_norm(x + int64_t(blockIdx.y) * row_stride + head * head_dim, head_dim,
                       weight, eps, lane);
}
