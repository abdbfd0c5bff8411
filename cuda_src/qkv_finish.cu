// qkv_finish: everything between the fused QKV projection and attention, for every token of
// a step, in one launch (it replaces add_bias x3, head_rms_norm x2, rope and kv_write, and
// rounds exactly as they do: the same device functions, head_ops.cuh, in the same order).
// Per head of token t's row qkv[t * row_stride ...] (q heads, then k heads, then v heads, each
// head_dim floats):
//   1. bias (qwen2; q_bias / k_bias / v_bias may be null): v += bias, one rounding each;
//   2. q / k head RMSNorm (gemma-3; q_norm / k_norm may be null), one weight per segment;
//   3. RoPE of q and k heads at positions[t] (rope.cu: NORM / NEOX, per-call base, optional
//      freq_factors);
//   4. k and v heads rounded to float16 into the paged cache (kv_cache.cu's layout) at slot
//      slots[t]; the row keeps the float32 values, so attention reads q from it.
// One warp per head: grid (ceil((n_heads + 2 n_kv_heads) / 4), n_tokens), 128 threads.
#include <cuda_fp16.h>

#include "head_ops.cuh"

constexpr int QKV_FINISH_HEADS_PER_BLOCK = 4;

extern "C" __global__ void __launch_bounds__(QKV_FINISH_HEADS_PER_BLOCK * WARP)
    qkv_finish(float* __restrict__ qkv, int row_stride, int n_heads, int n_kv_heads,
               int head_dim, const float* __restrict__ q_bias, const float* __restrict__ k_bias,
               const float* __restrict__ v_bias, const float* __restrict__ q_norm,
               const float* __restrict__ k_norm, float eps, const int* __restrict__ positions,
               int rope_dim, double base, const float* __restrict__ freq_factors, int neox,
               const int* __restrict__ slots, __half* __restrict__ k_cache,
               __half* __restrict__ v_cache) {
    const int head = blockIdx.x * QKV_FINISH_HEADS_PER_BLOCK + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (head >= n_heads + 2 * n_kv_heads) return;  // the whole warp leaves
    const int token = blockIdx.y;
    float* v = qkv + int64_t(token) * row_stride + int64_t(head) * head_dim;
    const bool is_q = head < n_heads, is_k = !is_q && head < n_heads + n_kv_heads;
    // The head's index within its segment (q, k or v).
    const int in_segment = is_q ? head : (head - n_heads) % n_kv_heads;
    const float* bias = is_q ? q_bias : is_k ? k_bias : v_bias;
    if (bias != nullptr) {
        const float* head_bias = bias + int64_t(in_segment) * head_dim;
        for (int i = lane; i < head_dim; i += WARP) v[i] += head_bias[i];
        __syncwarp();
    }
    const float* norm = is_q ? q_norm : is_k ? k_norm : nullptr;
    if (norm != nullptr) {
        warp_head_rms_norm(v, head_dim, norm, eps, lane);
        __syncwarp();  // RoPE pairs span lanes
    }
    if (is_q) {
        rope_head(v, positions[token], rope_dim, base, freq_factors, neox, lane, WARP);
        return;
    }
    if (is_k) {
        rope_head(v, positions[token], rope_dim, base, freq_factors, neox, lane, WARP);
        __syncwarp();
    }
    __half* cache = is_k ? k_cache : v_cache;
    const int64_t dest = int64_t(slots[token]) * n_kv_heads * head_dim +
                         int64_t(in_segment) * head_dim;
    for (int i = lane; i < head_dim; i += WARP) cache[dest + i] = __float2half_rn(v[i]);
}
