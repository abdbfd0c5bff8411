// Rotary position embedding in place, llama.cpp's two layouts, on the GGUF's own feature
// order (the CPU path permutes q/k features; this kernel does not need to):
//   NORM (neox = 0): pairs (x[2i], x[2i + 1])           llama
//   NEOX (neox = 1): pairs (x[i], x[i + rope_dim / 2])   qwen2, gemma3
// Pair i of a token at position p turns by p * base^(-2i / rope_dim) / freq_factors[i]
// (freq_factors may be null), the angle and its sine / cosine in float64 as rope.py forms them
// (to ~1e-16), the rotation (x0 cos - x1 sin, x0 sin + x1 cos) in float32. `base` is per call:
// gemma-3's local and global layers use different ones. Features past rope_dim are left alone.
// Head h of token t: x[t * row_stride + h * head_dim ...]. Grid (n_heads, n_tokens); 64 threads.
#include "head_ops.cuh"

extern "C" __global__ void __launch_bounds__(64)
    rope(float* __restrict__ x, int row_stride, const int* __restrict__ positions, int n_heads,
         int head_dim, int rope_dim, double base, const float* __restrict__ freq_factors,
         int neox) {
    rope_head(x + int64_t(blockIdx.y) * row_stride + blockIdx.x * head_dim,
              positions[blockIdx.y], rope_dim, base, freq_factors, neox, threadIdx.x,
              blockDim.x);
}
