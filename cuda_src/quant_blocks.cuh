// GGUF block types: layouts and exact decoding, shared by host and device code.
//
// Every type is decoded in groups of GROUP = 32 consecutive elements of a row. A type struct
// gives BLOCK_ELEMENTS / BLOCK_BYTES (for the float types a "block" is 32 elements, so that
// every kernel can walk every row in whole blocks of whole groups) and
// dequantize_group(block, g, out): elements [32 g, 32 g + 32) of the block as float.
//
// The decoded floats equal actors/model/gguf/quants.py bit for bit: each element is
// float(level) * scale (+ offset), one float32 rounding per operation, with scale and offset
// per group computed as quants.py computes them (Q4_K: d * sc and -(dmin * m)). The host test
// tests/test_cuda_blockmath.py proves it on every type.
#pragma once

#include "float_bits.cuh"

constexpr int GROUP = 32;

QK_HD void scale_levels(const int* levels, float scale, float* out, int count = GROUP) {
    for (int i = 0; i < count; ++i) out[i] = mul_rn(float(levels[i]), scale);
}

QK_HD void affine_levels(const int* levels, float scale, float offset, float* out) {
    for (int i = 0; i < GROUP; ++i) out[i] = add_rn(mul_rn(float(levels[i]), scale), offset);
}

// Q4_0 / Q4_1: 32 nibbles in 16 bytes, element i < 16 in the low nibble of byte i, element
// i >= 16 in the high nibble of byte i - 16.
QK_HD void nibble_levels(const uint8_t* qs, int offset, int* levels) {
    for (int i = 0; i < 16; ++i) {
        levels[i] = (qs[i] & 0x0F) - offset;
        levels[i + 16] = (qs[i] >> 4) - offset;
    }
}

// Q5_0 / Q5_1: nibbles as Q4 plus a fifth bit per element from the little-endian uint32 qh.
QK_HD void fifth_bit_levels(const uint8_t* qh_bytes, const uint8_t* qs, int offset, int* levels) {
    const uint32_t qh = load_u32(qh_bytes);
    nibble_levels(qs, 0, levels);
    for (int i = 0; i < GROUP; ++i) levels[i] += int((qh >> i) & 1u) << 4;
    for (int i = 0; i < GROUP; ++i) levels[i] -= offset;
}

struct type_q4_0 {
    static constexpr int BLOCK_ELEMENTS = 32, BLOCK_BYTES = 18;  // d, qs[16]
    static QK_HD void dequantize_group(const uint8_t* block, int, float* out) {
        int levels[GROUP];
        nibble_levels(block + 2, 8, levels);
        scale_levels(levels, load_half(block), out);
    }
};

struct type_q4_1 {
    static constexpr int BLOCK_ELEMENTS = 32, BLOCK_BYTES = 20;  // d, m, qs[16]
    static QK_HD void dequantize_group(const uint8_t* block, int, float* out) {
        int levels[GROUP];
        nibble_levels(block + 4, 0, levels);
        affine_levels(levels, load_half(block), load_half(block + 2), out);
    }
};

struct type_q5_0 {
    static constexpr int BLOCK_ELEMENTS = 32, BLOCK_BYTES = 22;  // d, qh[4], qs[16]
    static QK_HD void dequantize_group(const uint8_t* block, int, float* out) {
        int levels[GROUP];
        fifth_bit_levels(block + 2, block + 6, 16, levels);
        scale_levels(levels, load_half(block), out);
    }
};

struct type_q5_1 {
    static constexpr int BLOCK_ELEMENTS = 32, BLOCK_BYTES = 24;  // d, m, qh[4], qs[16]
    static QK_HD void dequantize_group(const uint8_t* block, int, float* out) {
        int levels[GROUP];
        fifth_bit_levels(block + 4, block + 8, 0, levels);
        affine_levels(levels, load_half(block), load_half(block + 2), out);
    }
};

struct type_q8_0 {
    static constexpr int BLOCK_ELEMENTS = 32, BLOCK_BYTES = 34;  // d, qs[32] int8
    static QK_HD void dequantize_group(const uint8_t* block, int, float* out) {
        int levels[GROUP];
        for (int i = 0; i < GROUP; ++i) levels[i] = int8_t(block[2 + i]);
        scale_levels(levels, load_half(block), out);
    }
};

// Q4_K / Q5_K: 6-bit scale and min of sub-block g from the 12 packed bytes `packed`:
// bytes 0..3 scales 0..3 (top two bits: high bits of scales 4..7), bytes 4..7 mins 0..3 (top
// two bits: high bits of mins 4..7), bytes 8..11 low nibbles of scales / mins 4..7.
QK_HD void k_scale_min(const uint8_t* packed, int g, int* scale, int* min) {
    if (g < 4) {
        *scale = packed[g] & 63;
        *min = packed[g + 4] & 63;
    } else {
        *scale = (packed[g + 4] & 0x0F) | ((packed[g - 4] >> 6) << 4);
        *min = (packed[g + 4] >> 4) | ((packed[g] >> 6) << 4);
    }
}

// Q4_K / Q5_K sub-block g: level * (d * sc) + (-(dmin * m)).
QK_HD void k_affine(const uint8_t* block, int g, const int* levels, float* out) {
    int sc, m;
    k_scale_min(block + 4, g, &sc, &m);
    const float scale = mul_rn(load_half(block), float(sc));
    const float offset = -mul_rn(load_half(block + 2), float(m));
    affine_levels(levels, scale, offset, out);
}

// The low 4 bits of Q4_K / Q5_K sub-block g: 32 bytes per pair of sub-blocks, sub-block 2j in
// the low nibbles of pair j's bytes, 2j + 1 in the high nibbles.
QK_HD void k_low_nibbles(const uint8_t* qs, int g, int* levels) {
    const uint8_t* pair = qs + 32 * (g / 2);
    const int shift = 4 * (g % 2);
    for (int i = 0; i < GROUP; ++i) levels[i] = (pair[i] >> shift) & 0x0F;
}

struct type_q4_K {
    // d, dmin, scales[12], qs[128]
    static constexpr int BLOCK_ELEMENTS = 256, BLOCK_BYTES = 144;
    static QK_HD void dequantize_group(const uint8_t* block, int g, float* out) {
        int levels[GROUP];
        k_low_nibbles(block + 16, g, levels);
        k_affine(block, g, levels, out);
    }
};

struct type_q5_K {
    // d, dmin, scales[12], qh[32] (bit g of qh[i]: fifth bit of element i of sub-block g), qs[128]
    static constexpr int BLOCK_ELEMENTS = 256, BLOCK_BYTES = 176;
    static QK_HD void dequantize_group(const uint8_t* block, int g, float* out) {
        int levels[GROUP];
        k_low_nibbles(block + 48, g, levels);
        for (int i = 0; i < GROUP; ++i) levels[i] |= ((block[16 + i] >> g) & 1) << 4;
        k_affine(block, g, levels, out);
    }
};

// Q6_K group g (elements [32 g, 32 g + 32)) of a block whose ql + qh (192 bytes), int8 scales
// (16) and float16 d lie at `quants`, `scales` and `d`: adjacent in the file's block, apart
// in the row-planar copy (cuda_plan.planar_q6_K_rows, dequantize_planar_q6_K_group).
QK_HD void dequantize_q6_K_group(const uint8_t* quants, const uint8_t* scales, const uint8_t* d,
                                 int g, float* out) {
    const int half = g / 4, quarter = g % 4;
    const uint8_t* ql = quants + 64 * half + 32 * (quarter % 2);
    const uint8_t* qh = quants + 128 + 32 * half;
    const int nibble_shift = 4 * (quarter / 2), top_shift = 2 * quarter;
    int levels[GROUP];
    for (int i = 0; i < GROUP; ++i) {
        levels[i] = (((ql[i] >> nibble_shift) & 0x0F) | (((qh[i] >> top_shift) & 3) << 4)) - 32;
    }
    const float scale = load_half(d);
    const float first = mul_rn(scale, float(int8_t(scales[2 * g])));
    const float second = mul_rn(scale, float(int8_t(scales[2 * g + 1])));
    scale_levels(levels, first, out, 16);  // 16 elements at each scale
    scale_levels(levels + 16, second, out + 16, 16);
}

struct type_q6_K {
    // ql[128], qh[64], scales[16] int8, d. Half h (128 elements) has ql bytes a = ql[64h..+32],
    // b = ql[64h+32..+32] and qh[32h..+32]; its quarters are a's low nibbles, b's low, a's high,
    // b's high, with two top bits from qh at shifts 0, 2, 4, 6; levels are those 6 bits - 32.
    // Scale per 16 elements: d * scales[e / 16].
    static constexpr int BLOCK_ELEMENTS = 256, BLOCK_BYTES = 210;
    static constexpr int QUANT_BYTES = 192, SCALE_BYTES = 16;  // ql + qh, then the scales
    static QK_HD void dequantize_group(const uint8_t* block, int g, float* out) {
        dequantize_q6_K_group(block, block + QUANT_BYTES, block + QUANT_BYTES + SCALE_BYTES, g,
                              out);
    }
};

// Group `group` of a Q6_K row of `blocks` blocks in the row-planar layout
// (cuda_plan.planar_q6_K_rows): block k's ql + qh at 192 k, its scales at 192 blocks + 16 k,
// its d at 208 blocks + 2 k.
QK_HD void dequantize_planar_q6_K_group(const uint8_t* row, int blocks, int group, float* out) {
    const int k = group / 8;
    constexpr int Q = type_q6_K::QUANT_BYTES, S = type_q6_K::SCALE_BYTES;
    dequantize_q6_K_group(row + Q * k, row + Q * blocks + S * k, row + (Q + S) * blocks + 2 * k,
                          group % 8, out);
}

// Float types: GGUF blocks of one element, walked by kernels in blocks of one group.
struct type_f32 {
    static constexpr int BLOCK_ELEMENTS = 32, BLOCK_BYTES = 128;
    static QK_HD void dequantize_group(const uint8_t* block, int, float* out) {
        for (int i = 0; i < GROUP; ++i) out[i] = float_from_bits(load_u32(block + 4 * i));
    }
};

struct type_f16 {
    static constexpr int BLOCK_ELEMENTS = 32, BLOCK_BYTES = 64;
    static QK_HD void dequantize_group(const uint8_t* block, int, float* out) {
        for (int i = 0; i < GROUP; ++i) out[i] = load_half(block + 2 * i);
    }
};

struct type_bf16 {
    static constexpr int BLOCK_ELEMENTS = 32, BLOCK_BYTES = 64;
    static QK_HD void dequantize_group(const uint8_t* block, int, float* out) {
        for (int i = 0; i < GROUP; ++i) out[i] = bf16_to_float(load_u16(block + 2 * i));
    }
};

// Every type, as X(suffix, struct), in the order of the kernels' type codes
// (cuda_plan.KERNEL_TYPE_SUFFIX): the list the host wrappers and the type-code switches
// follow. Suffixes are GGUF's type names in lower case except the K of the K-quants (llama.cpp
// style). The kernels' entries follow the types as the device holds them
// (tile_levels.cuh's QK_FOR_EACH_HELD_TYPE: Q6_K row-planar).
#define QK_LEGACY_TYPES(X) \
    X(q4_0, type_q4_0)     \
    X(q4_1, type_q4_1)     \
    X(q5_0, type_q5_0)     \
    X(q5_1, type_q5_1)     \
    X(q8_0, type_q8_0)
#define QK_FLOAT_TYPES(X) \
    X(f32, type_f32)      \
    X(f16, type_f16)      \
    X(bf16, type_bf16)
#define QK_FOR_EACH_TYPE(X) \
    QK_LEGACY_TYPES(X) X(q4_K, type_q4_K) X(q5_K, type_q5_K) X(q6_K, type_q6_K) QK_FLOAT_TYPES(X)

template <class T>
constexpr int groups_per_block = T::BLOCK_ELEMENTS / GROUP;

// Group `group` of a row (row elements [32 group, 32 group + 32)) as float, exact.
template <class T>
QK_HD void dequantize_row_group(const uint8_t* row, int group, float* out) {
    const int per_block = groups_per_block<T>;
    T::dequantize_group(row + (group / per_block) * T::BLOCK_BYTES, group % per_block, out);
}
