// Device functions on one attention head of a token's fused qkv row, shared by the kernels
// that run them alone (norm.cu's head_rms_norm, rope.cu's rope) and by qkv_finish.cu, which
// runs them back to back in one launch: one body each, so the fused kernel rounds exactly as
// the separate ones do.
#pragma once

#include "device_common.cuh"

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

// RoPE of one head in place, pairs i = first, first + step, ... below rope_dim / 2 (see
// rope.cu for the layouts and the float64 angle). Each pair is computed alone, so any split of
// the pairs among threads gives the same bits.
__device__ __forceinline__ void rope_head(float* head, double position, int rope_dim,
                                          double base, const float* __restrict__ freq_factors,
                                          int neox, int first, int step) {
    const int half = rope_dim / 2;
    for (int i = first; i < half; i += step) {
        double inv_freq = pow(base, -double(2 * i) / double(rope_dim));
        if (freq_factors != nullptr) inv_freq /= double(freq_factors[i]);
        // sincospi: its argument reduction is exact and needs no local-memory table (sincos
        // of a large argument does); dividing by pi first costs ~1e-16 relative in the angle.
        double sin_angle, cos_angle;
        sincospi(position * inv_freq / 3.141592653589793, &sin_angle, &cos_angle);
        const float c = float(cos_angle), s = float(sin_angle);
        float* first_of_pair = head + (neox ? i : 2 * i);
        float* second_of_pair = first_of_pair + (neox ? half : 1);
        const float x0 = *first_of_pair, x1 = *second_of_pair;
        *first_of_pair = x0 * c - x1 * s;
        *second_of_pair = x0 * s + x1 * c;
    }
}
