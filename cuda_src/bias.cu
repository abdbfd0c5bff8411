// Bias add in place (qwen2's q / k / v biases): y[t][i] += bias[i] for i < n, float32, one
// rounding per element as forward.py's `qkv += qkv_bias`. y rows are `y_stride` floats apart
// (the fused qkv rows: q, k and v biases laid end to end match them). Grid-stride: any grid
// and block size.
#include <stdint.h>

extern "C" __global__ void add_bias(float* __restrict__ y, int y_stride,
                                    const float* __restrict__ bias, int n_tokens, int n) {
    const int64_t total = int64_t(n_tokens) * n;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
         e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t t = e / n, i = e % n;
        y[t * y_stride + i] += bias[i];
    }
}
