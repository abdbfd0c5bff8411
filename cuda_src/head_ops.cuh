// Device functions that turn a token's raw attention heads (a row of the fused qkv projection)
// into the ones attention uses, shared by qkv_finish.cu (prefill rows, one warp per head) and
// attention.cu's attention_decode (decode rows, in its prologue): one body each, so both
// round exactly alike.
//
// The steps, per head (q heads, k heads, v heads; each head_dim floats):
//   1. bias (qwen2; per segment, may be null): v += bias, one rounding each;
//   2. q / k head RMSNorm (gemma-3; may be null): one weight vector per segment;
//   3. RoPE of q and k heads, llama.cpp's two layouts on the GGUF's own feature order (the CPU
//      path permutes q/k features; the kernels do not need to):
//        NORM (neox = 0): pairs (x[2i], x[2i + 1])           llama
//        NEOX (neox = 1): pairs (x[i], x[i + rope_dim / 2])   qwen2, gemma3
//      Pair i of a token at position p turns by p * base^(-2i / rope_dim) / freq_factors[i]
//      (freq_factors may be null), the angle and its sine / cosine in float64 as rope.py forms
//      them (to ~1e-16), the rotation (x0 cos - x1 sin, x0 sin + x1 cos) in float32. `base`
//      is per call: gemma-3's local and global layers use different ones. Features past
//      rope_dim are left alone; rope_dim 0 rotates nothing.
//   4. k and v heads rounded to nearest float16 into the paged cache: per layer, K and V
//      separate, [block][pos_in_block][kv_head][head_dim], so slot s = block * block_size +
//      pos_in_block starts at s * kv_dim (kv_dim = n_kv_heads * head_dim).
#pragma once

#include "device_common.cuh"

// Steps 1-3's parameters, as both kernels take them (in this order).
struct HeadFinish {
    const float* q_bias;
    const float* k_bias;
    const float* v_bias;
    const float* q_norm;
    const float* k_norm;
    float eps;
    int rope_dim;
    double base;
    const float* freq_factors;
    int neox;
};

// RMSNorm of v[0..head_dim) in place by one warp (`lane` its lane): lane-strided squares, a
// shuffle sum, then v / sqrt(mean(v^2) + eps) * weight. Each lane rewrites only the elements
// it read, so no barrier is needed inside; a caller reading other lanes' elements afterwards
// must __syncwarp().
__device__ __forceinline__ void warp_head_rms_norm(float* v, int head_dim,
                                                   const float* __restrict__ weight, float eps,
                                                   int lane) {
    float squares = 0.0f;
    for (int i = lane; i < head_dim; i += WARP) squares += v[i] * v[i];
    const float divisor = sqrtf(warp_sum(squares) * (1.0f / float(head_dim)) + eps);
    for (int i = lane; i < head_dim; i += WARP) v[i] = v[i] / divisor * weight[i];
}

// (cos, sin) of RoPE pair i at `position`, rounded to float32. It depends on nothing else, so
// a kernel may compute it once for all the heads of a token.
__device__ __forceinline__ float2 rope_rotation(double position, int i, const HeadFinish& f) {
    double inv_freq = pow(f.base, -double(2 * i) / double(f.rope_dim));
    if (f.freq_factors != nullptr) inv_freq /= double(f.freq_factors[i]);
    // sincospi: its argument reduction is exact and needs no local-memory table (sincos of a
    // large argument does); dividing by pi first costs ~1e-16 relative in the angle.
    double sin_angle, cos_angle;
    sincospi(position * inv_freq / 3.141592653589793, &sin_angle, &cos_angle);
    return make_float2(float(cos_angle), float(sin_angle));
}

// Turn pair i of one head in place by `rotation` (rope_rotation's).
__device__ __forceinline__ void rotate_pair(float* head, int i, float2 rotation,
                                            const HeadFinish& f) {
    float* first_of_pair = head + (f.neox ? i : 2 * i);
    float* second_of_pair = first_of_pair + (f.neox ? f.rope_dim / 2 : 1);
    const float x0 = *first_of_pair, x1 = *second_of_pair;
    *first_of_pair = x0 * rotation.x - x1 * rotation.y;
    *second_of_pair = x0 * rotation.y + x1 * rotation.x;
}

// RoPE of one head in place, pairs i = first, first + step, ... below rope_dim / 2. Each pair
// is computed alone, so any split of the pairs among threads gives the same bits.
__device__ __forceinline__ void rope_head(float* head, double position, const HeadFinish& f,
                                          int first, int step) {
    for (int i = first; i < f.rope_dim / 2; i += step) {
        rotate_pair(head, i, rope_rotation(position, i, f), f);
    }
}
