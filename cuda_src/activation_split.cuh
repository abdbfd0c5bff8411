// The scale of the float16 hi + lo split of activations (mma_ops.cuh's split_pair) that the
// tensor cores multiply (matmul_batch.cu, matvec_mma.cu), safe for every float. Float16 holds
// magnitudes below 65,520 only (65,520 and up round to inf, and lo = x - inf is NaN) and has
// an absolute floor of 2^-24, so each 32-element group of an activation row (SPLIT_GROUP,
// aligned within the row) is split as x 2^-e: hi = f16(x 2^-e), lo = f16(x 2^-e - hi), and
// the float32 sums of the group's products are multiplied by 2^e after the MMAs. e brings the
// group's largest magnitude M into [2^14, 2^15) where M lies outside [2^-2, 2^15), and is 0
// inside it: there the split is the plain one, bit for bit. Multiplying by a power of two is
// exact (short of float32 overflow or underflow), so a group's sums are those of float16 with
// an unbounded exponent: every element within 2^-23 M of hi + lo (exactly, for float32
// subnormals), any finite x. Host and device: tests/test_cuda_blockmath.py checks it.
#pragma once

#include "float_bits.cuh"

constexpr int SPLIT_GROUP = 32;

// |v|'s bits: as unsigned integers they order as the magnitudes do (NaN above inf).
QK_HD uint32_t magnitude_bits(float v) {
    uint32_t bits;
#ifdef __CUDA_ARCH__
    bits = __float_as_uint(v);
#else
    memcpy(&bits, &v, sizeof bits);
#endif
    return bits & 0x7FFFFFFFu;
}

// The exponent e of a group whose largest magnitude has the bits `largest` (magnitude_bits),
// within [-126, 113] so that 2^e and 2^-e are normal floats (an inf or NaN group stays so).
QK_HD int split_exponent(uint32_t largest) {
    const int exponent = int(largest >> 23) - 127;  // floor(log2 M); -127 for 0 and subnormals
    if (exponent >= -2 && exponent <= 14) return 0;
    const int e = exponent - 14;
    return e < -126 ? -126 : e > 113 ? 113 : e;
}

// 2^e for e in [-126, 127], exactly.
QK_HD float power_of_two(int e) { return float_from_bits(uint32_t(127 + e) << 23); }
