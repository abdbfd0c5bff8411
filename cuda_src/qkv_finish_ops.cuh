// One head of one token between the QKV product and attention: qkv_finish.cu runs it on the
// step's rows, matvec.cu's mul_mat_vec_qkv in its epilogue. One body, so both round the same.
#pragma once

#include <cuda_fp16.h>

#include "head_ops.cuh"

// What the finish of a head reads besides the head itself (qkv_finish.cu's arguments).
struct QkvFinish {
    int n_heads, n_kv_heads, head_dim;
    const float* q_bias;  // the biases and norms may be null
    const float* k_bias;
    const float* v_bias;
    const float* q_norm;
    const float* k_norm;
    float eps;
    const int* positions;  // per token of the launch
    int rope_dim;
    double base;
    const float* freq_factors;  // may be null
    int neox;
    const int* slots;  // per token of the launch
    __half* k_cache;
    __half* v_cache;
};

// Head `head` (q heads, then k heads, then v heads) of token `token`, its head_dim floats at
// `v` (the qkv row itself or a copy of it), by one warp (`lane` its lane): bias, head RMSNorm,
// RoPE (q and k), then k and v rounded to float16 into the paged cache. The caller must
// __syncwarp() before reading v's elements in other lanes (RoPE pairs span lanes).
__device__ __forceinline__ void finish_head(float* v, int head, int token, const QkvFinish& f,
                                            int lane) {
    const int n_heads = f.n_heads, n_kv_heads = f.n_kv_heads, head_dim = f.head_dim;
    const bool is_q = head < n_heads, is_k = !is_q && head < n_heads + n_kv_heads;
    // The head's index within its segment (q, k or v).
    const int in_segment = is_q ? head : (head - n_heads) % n_kv_heads;
    const float* bias = is_q ? f.q_bias : is_k ? f.k_bias : f.v_bias;
    if (bias != nullptr) {
        const float* head_bias = bias + int64_t(in_segment) * head_dim;
        for (int i = lane; i < head_dim; i += WARP) v[i] += head_bias[i];
        __syncwarp();
    }
    const float* norm = is_q ? f.q_norm : is_k ? f.k_norm : nullptr;
    if (norm != nullptr) {
        warp_head_rms_norm(v, head_dim, norm, f.eps, lane);
        __syncwarp();  // RoPE pairs span lanes
    }
    if (is_q) {
        rope_head(v, f.positions[token], f.rope_dim, f.base, f.freq_factors, f.neox, lane, WARP);
        return;
    }
    if (is_k) {
        rope_head(v, f.positions[token], f.rope_dim, f.base, f.freq_factors, f.neox, lane, WARP);
        __syncwarp();
    }
    __half* cache = is_k ? f.k_cache : f.v_cache;
    const int64_t dest = int64_t(f.slots[token]) * n_kv_heads * head_dim +
                         int64_t(in_segment) * head_dim;
    for (int i = lane; i < head_dim; i += WARP) cache[dest + i] = __float2half_rn(v[i]);
}
