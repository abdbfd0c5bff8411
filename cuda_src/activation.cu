// Gated feed-forward activations, float32, elementwise as forward.py writes them:
//   silu(g) = g / (1 + exp(-g))
//   gelu_tanh(g) = g / (1 + exp(-2c (g + 0.044715 g^3))), c = sqrt(2 / pi)
//                (= 0.5 g (1 + tanh(c (g + 0.044715 g^3))))
// out[t][i] = act(gate_up[t][i]) * gate_up[t][ffn + i]: each row of gate_up holds the gate
// projection, then the up projection (two matvecs into one buffer with y_stride = 2 * ffn).
// out: [n_tokens][ffn]. Grid-stride: any grid and block size.
#include "activation_ops.cuh"

template <class Op>
__device__ void gated(const float* __restrict__ gate_up, float* __restrict__ out, int n_tokens,
                      int ffn) {
    const int64_t total = int64_t(n_tokens) * ffn;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
         e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t t = e / ffn, i = e % ffn;
        const float* row = gate_up + t * 2 * ffn;
        out[e] = Op::apply(row[i]) * row[ffn + i];
    }
}

extern "C" __global__ void gated_silu(const float* gate_up, float* out, int n_tokens, int ffn) {
    gated<silu_op>(gate_up, out, n_tokens, ffn);
}

extern "C" __global__ void gated_gelu_tanh(const float* gate_up, float* out, int n_tokens,
                                           int ffn) {
    gated<gelu_tanh_op>(gate_up, out, n_tokens, ffn);
}
