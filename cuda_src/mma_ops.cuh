// Device helpers of the kernels that multiply on the tensor cores (matmul_batch.cu,
// matvec_mma.cu): float16x2 packing, the hi + lo split of activations, and mma.sync m16n8k16
// (sm_80+).
#pragma once

#include <stdint.h>

// float16x2 bits of (low, high), rounded to nearest even.
__device__ __forceinline__ uint32_t pack_halves(float low, float high) {
    uint32_t bits;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(bits) : "f"(high), "f"(low));
    return bits;
}

__device__ __forceinline__ float2 unpack_halves(uint32_t bits) {
    float low, high;
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}"
        : "=f"(low), "=f"(high)
        : "r"(bits));
    return make_float2(low, high);
}

__device__ __forceinline__ uint32_t sub_halves(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// (low, high) split into float16 hi + lo pairs: hi = f16(v), lo = f16(v - hi).
__device__ __forceinline__ void split_pair(float low, float high, uint32_t* hi, uint32_t* lo) {
    *hi = pack_halves(low, high);
    const float2 rounded = unpack_halves(*hi);
    *lo = pack_halves(low - rounded.x, high - rounded.y);
}

// d += a (16 x 16, row-major fragment) x b (16 x 8, column-major fragment). PTX fragments
// (lane = 4 g + c): a = {(g, 2c..2c+1), (g+8, 2c..), (g, 2c+8..), (g+8, 2c+8..)}, b = {(k
// 2c..2c+1, n g), (k 2c+8.., n g)}, d = {(g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)}.
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d = a x b: the first product of a sum, without zeroing d first.
__device__ __forceinline__ void mma_first(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %10, %10, %10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
}
