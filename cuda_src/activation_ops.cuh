// The gated feed-forward activations as functions of the gate, float32, as forward.py writes
// them (see activation.cu). Shared by activation.cu and matvec.cu's fused gate+up entry points,
// so both round identically.
#pragma once

// forward.py's constants, formed in float64 and rounded once, as numpy forms them.
constexpr double GELU_C = 0.7978845608028654;  // sqrt(2 / pi)
constexpr float GELU_CUBIC = float(-2.0 * GELU_C * 0.044715);
constexpr float GELU_LINEAR = float(2.0 * GELU_C);

struct silu_op {
    static __device__ float apply(float g) { return g / (1.0f + expf(-g)); }
};

struct gelu_tanh_op {
    static __device__ float apply(float g) {
        // forward.py's steps, each rounded (no FMA): exp amplifies the exponent's error by its
        // size (up to ~88), so the exponent must match the CPU's bit for bit.
        const float inner =
            __fmul_rn(__fsub_rn(__fmul_rn(__fmul_rn(g, g), GELU_CUBIC), GELU_LINEAR), g);
        return g / (1.0f + expf(inner));
    }
};
