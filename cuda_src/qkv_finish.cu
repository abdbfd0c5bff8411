// qkv_finish: everything between the fused QKV projection and attention for the prefill rows
// of a step, in one launch (decode rows are finished in attention_decode's prologue, with the
// same device functions, so a token's K and V round alike either way): head_ops.cuh's steps
// 1-4 on every head of token t's row qkv[t * row_stride ...] (q heads, then k heads, then v
// heads, each head_dim floats): bias, q / k head norm, RoPE at positions[t], and k and v
// rounded to float16 into the paged cache at slot slots[t]. The row keeps the float32 values
// (finished q included), so attention_prefill reads q from it.
// One warp per head: grid (ceil((n_heads + 2 n_kv_heads) / 4), n_tokens), 128 threads.
#include <cuda_fp16.h>

#include "head_ops.cuh"

constexpr int QKV_FINISH_HEADS_PER_BLOCK = 4;

extern "C" __global__ void __launch_bounds__(QKV_FINISH_HEADS_PER_BLOCK * WARP)
    qkv_finish(float* __restrict__ qkv, int row_stride, int n_heads, int n_kv_heads,
               int head_dim, const float* __restrict__ q_bias, const float* __restrict__ k_bias,
               const float* __restrict__ v_bias, const float* __restrict__ q_norm,
               const float* __restrict__ k_norm, float eps, int rope_dim, double base,
               const float* __restrict__ freq_factors, int neox,
               const int* __restrict__ positions, const int* __restrict__ slots,
               __half* __restrict__ k_cache, __half* __restrict__ v_cache) {
    const HeadFinish finish{q_bias, k_bias, v_bias, q_norm, k_norm, eps, rope_dim, base,
                            freq_factors, neox};
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
        rope_head(v, positions[token], finish, lane, WARP);
        return;
    }
    if (is_k) {
        rope_head(v, positions[token], finish, lane, WARP);
        __syncwarp();
    }
    __half* cache = is_k ? k_cache : v_cache;
    const int64_t dest = int64_t(slots[token]) * n_kv_heads * head_dim +
                         int64_t(in_segment) * head_dim;
    for (int i = lane; i < head_dim; i += WARP) cache[dest + i] = __float2half_rn(v[i]);
}
