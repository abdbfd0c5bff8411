// Scalar helpers shared by host and device code: float16 / bfloat16 bit patterns to float, and
// float32 arithmetic that is never contracted into an FMA, so block decoding rounds exactly as
// numpy does (actors/model/gguf/quants.py multiplies, then adds, each step rounded to float32).
// Host paths use portable C++ only: this header must compile with g++ without CUDA headers.
#pragma once

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define QK_HD __host__ __device__ __forceinline__
#else
#define QK_HD inline
#endif

// a * b rounded to float32, never fused with a following add.
QK_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;  // the host build uses -ffp-contract=off (see tests/test_cuda_blockmath.py)
#endif
}

// a + b rounded to float32, never fused with a preceding multiply.
QK_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

QK_HD float float_from_bits(uint32_t bits) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
#endif
}

// IEEE binary16 bits -> float, exactly (every half is a float). NaNs keep sign and payload.
QK_HD float half_to_float(uint16_t h) {
#ifdef __CUDA_ARCH__
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(h));
    return value;
#else
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1Fu;
    const uint32_t mantissa = h & 0x3FFu;
    if (exponent == 0x1Fu) {  // inf / NaN
        return float_from_bits(sign | 0x7F800000u | (mantissa << 13));
    }
    if (exponent == 0) {  // zero / subnormal: mantissa * 2^-24 is exact in float
        const float magnitude = float(mantissa) * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    return float_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

// bfloat16 bits are the top half of a float's.
QK_HD float bf16_to_float(uint16_t b) { return float_from_bits(uint32_t(b) << 16); }

// Little-endian loads from byte pointers of any alignment (block fields are unaligned).
QK_HD uint16_t load_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

QK_HD uint32_t load_u32(const uint8_t* p) {
    return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

QK_HD float load_half(const uint8_t* p) { return half_to_float(load_u16(p)); }
