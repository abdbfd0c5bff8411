// Rotary position embedding in place, llama.cpp's two layouts, on the GGUF's own feature
// order (the CPU path permutes q/k features; this kernel does not need to):
//   NORM (neox = 0): pairs (x[2i], x[2i + 1])           llama
//   NEOX (neox = 1): pairs (x[i], x[i + rope_dim / 2])   qwen2, gemma3
// Pair i of a token at position p turns by p * base^(-2i / rope_dim) / freq_factors[i]
// (freq_factors may be null), the angle and its sine / cosine in float64 as rope.py forms them
// (to ~1e-16), the rotation (x0 cos - x1 sin, x0 sin + x1 cos) in float32. `base` is per call:
// gemma-3's local and global layers use different ones. Features past rope_dim are left alone.
// Head h of token t: x[t * row_stride + h * head_dim ...]. Grid (n_heads, n_tokens); 64 threads.
extern "C" __global__ void __launch_bounds__(64)
    rope(float* __restrict__ x, int row_stride, const int* __restrict__ positions, int n_heads,
         int head_dim, int rope_dim, double base, const float* __restrict__ freq_factors,
         int neox) {
    float* head = x + int64_t(blockIdx.y) * row_stride + blockIdx.x * head_dim;
    const double position = positions[blockIdx.y];
    const int half = rope_dim / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double inv_freq = pow(base, -double(2 * i) / double(rope_dim));
        if (freq_factors != nullptr) inv_freq /= double(freq_factors[i]);
        // sincospi: its argument reduction is exact and needs no local-memory table (sincos
        // of a large argument does); dividing by pi first costs ~1e-16 relative in the angle.
        double sin_angle, cos_angle;
        sincospi(position * inv_freq / 3.141592653589793, &sin_angle, &cos_angle);
        const float c = float(cos_angle), s = float(sin_angle);
        float* first = head + (neox ? i : 2 * i);
        float* second = first + (neox ? half : 1);
        const float x0 = *first, x1 = *second;
        *first = x0 * c - x1 * s;
        *second = x0 * s + x1 * c;
    }
}
