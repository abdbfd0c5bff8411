// What the tensor-core tiles (matmul_batch.cu) feed the MMAs, per block type, shared by host
// and device code (tests/test_cuda_blockmath.py rebuilds every type's values from it, bit for
// bit).
//
// A quantized weight is level * scale + offset, with an integer level exact in float16 and
// scale / offset constant over SCALE_ELEMENTS consecutive elements (offset 0 unless HAS_MIN);
// scale_offset(block, e, &scale, &offset) gives element e's.
// The tiles multiply the levels on the tensor cores and apply scale and offset to the float32
// sums afterwards. Levels come four at a time (elements e..e+3 of a block, e % 4 == 0) as two
// float16x2 bit patterns: `even` holds elements (e, e + 2) and `odd` (e + 1, e + 3), low half
// first, each the half 1024 + u with level = u - OFFSET (u < 1024 sits in the mantissa, so a
// mask and an OR build it; subtracting 1024 + OFFSET in float16 is exact).
// F16 weights come as their own halves in the same pairing (KIND_HALVES, scale 1); F32 / BF16
// as floats (KIND_FLOATS): the tiles split those into float16 parts.
// `load(p)` reads the little-endian uint32 at any byte address p (the device reads shared
// memory with two aligned words and a funnel shift).
#pragma once

#include "quant_blocks.cuh"

enum TileKind { KIND_LEVELS, KIND_HALVES, KIND_FLOATS };

constexpr uint32_t HALF_1024_PAIR = 0x64006400u;  // float16 1024.0 in both halves

// (bits & mask) | 1024.0 pair: one LOP3 on the device.
QK_HD uint32_t masked_1024_pair(uint32_t bits, uint32_t mask) {
#ifdef __CUDA_ARCH__
    uint32_t out;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(bits), "r"(mask), "r"(HALF_1024_PAIR));
    return out;
#else
    return (bits & mask) | HALF_1024_PAIR;
#endif
}

// Two 4-bit fields per pair from 4 packed bytes at bit `shift` of each byte.
QK_HD void nibble_pairs(uint32_t bytes, int shift, uint32_t* even, uint32_t* odd) {
    *even = masked_1024_pair(bytes >> shift, 0x000F000Fu);
    *odd = masked_1024_pair(bytes >> (shift + 8), 0x000F000Fu);
}

// Adds a fifth bit (bit 4) to each level from `bits`: element e + j's bit at bit 8 j.
QK_HD void add_byte_bits(uint32_t bits, uint32_t* even, uint32_t* odd) {
    *even |= (bits & 0x00010001u) << 4;
    *odd |= ((bits >> 8) & 0x00010001u) << 4;
}

// Q5_0 / Q5_1: the fifth bits of elements e..e+3 are bits 0..3 of qh >> e.
QK_HD uint32_t spread_nibble_bits(uint32_t nibble) {
    return (nibble & 1u) | ((nibble & 2u) << 7) | ((nibble & 4u) << 14) | ((nibble & 8u) << 21);
}

template <class T>
struct tile_levels;

// Q4_0 / Q4_1 / Q5_0 / Q5_1: one scale (and min) per 32-element block.
template <int QS, int QH, int OFFSET_, bool MIN>
struct legacy_levels {
    static constexpr TileKind KIND = KIND_LEVELS;
    static constexpr int SCALE_ELEMENTS = 32, OFFSET = OFFSET_;
    static constexpr bool HAS_MIN = MIN;
    template <class Load>
    static QK_HD void pairs(const uint8_t* block, int e, Load load, uint32_t* even, uint32_t* odd) {
        nibble_pairs(load(block + QS + e % 16), 4 * (e / 16), even, odd);
        if (QH >= 0) add_byte_bits(spread_nibble_bits((load(block + QH) >> e) & 15u), even, odd);
    }
    static QK_HD void scale_offset(const uint8_t* block, int, float* scale, float* offset) {
        *scale = load_half(block);
        *offset = MIN ? load_half(block + 2) : 0.0f;
    }
};

template <>
struct tile_levels<type_q4_0> : legacy_levels<2, -1, 8, false> {};
template <>
struct tile_levels<type_q4_1> : legacy_levels<4, -1, 0, true> {};
template <>
struct tile_levels<type_q5_0> : legacy_levels<6, 2, 16, false> {};
template <>
struct tile_levels<type_q5_1> : legacy_levels<8, 4, 0, true> {};

template <>
struct tile_levels<type_q8_0> {
    static constexpr TileKind KIND = KIND_LEVELS;
    static constexpr int SCALE_ELEMENTS = 32, OFFSET = 128;
    static constexpr bool HAS_MIN = false;
    template <class Load>
    static QK_HD void pairs(const uint8_t* block, int e, Load load, uint32_t* even, uint32_t* odd) {
        const uint32_t biased = load(block + 2 + e) ^ 0x80808080u;  // int8 + 128, per byte
        *even = masked_1024_pair(biased, 0x00FF00FFu);
        *odd = masked_1024_pair(biased >> 8, 0x00FF00FFu);
    }
    static QK_HD void scale_offset(const uint8_t* block, int, float* scale, float* offset) {
        *scale = load_half(block);
        *offset = 0.0f;
    }
};

// Q4_K / Q5_K: per 32-element sub-block g, scale d * sc and offset -(dmin * m).
template <bool FIFTH_BIT>
struct k_levels {
    static constexpr TileKind KIND = KIND_LEVELS;
    static constexpr int SCALE_ELEMENTS = 32, OFFSET = 0;
    static constexpr bool HAS_MIN = true;
    template <class Load>
    static QK_HD void pairs(const uint8_t* block, int e, Load load, uint32_t* even, uint32_t* odd) {
        const int g = e / GROUP, i = e % GROUP;
        const uint8_t* qs = block + (FIFTH_BIT ? 48 : 16);
        nibble_pairs(load(qs + 32 * (g / 2) + i), 4 * (g % 2), even, odd);
        if (FIFTH_BIT) add_byte_bits(load(block + 16 + i) >> g, even, odd);
    }
    static QK_HD void scale_offset(const uint8_t* block, int e, float* scale, float* offset) {
        int sc, m;
        k_scale_min(block + 4, e / GROUP, &sc, &m);
        *scale = mul_rn(load_half(block), float(sc));
        *offset = -mul_rn(load_half(block + 2), float(m));
    }
};

template <>
struct tile_levels<type_q4_K> : k_levels<false> {};
template <>
struct tile_levels<type_q5_K> : k_levels<true> {};

// Q6_K: 6-bit levels - 32, scale d * scales[e / 16] per 16 elements (see type_q6_K).
template <>
struct tile_levels<type_q6_K> {
    static constexpr TileKind KIND = KIND_LEVELS;
    static constexpr int SCALE_ELEMENTS = 16, OFFSET = 32;
    static constexpr bool HAS_MIN = false;
    template <class Load>
    static QK_HD void pairs(const uint8_t* block, int e, Load load, uint32_t* even, uint32_t* odd) {
        const int half = e / 128, quarter = (e % 128) / GROUP, i = e % GROUP;
        nibble_pairs(load(block + 64 * half + 32 * (quarter % 2) + i), 4 * (quarter / 2), even,
                     odd);
        const uint32_t top = load(block + 128 + 32 * half + i) >> (2 * quarter);
        *even |= (top & 0x00030003u) << 4;
        *odd |= ((top >> 8) & 0x00030003u) << 4;
    }
    static QK_HD void scale_offset(const uint8_t* block, int e, float* scale, float* offset) {
        scale_with_d(block, e, block + 208, scale, offset);
    }
    // Element e's scale from the block's int8 scales and the float16 d at `d`.
    static QK_HD void scale_with_d(const uint8_t* block, int e, const uint8_t* d, float* scale,
                                   float* offset) {
        *scale = mul_rn(load_half(d), float(int8_t(block[192 + e / SCALE_ELEMENTS])));
        *offset = 0.0f;
    }
};

// Q6_K's row-planar copy (cuda_plan.planar_q6_K_rows: the layout the device holds every Q6_K
// matrix in), as the batched product stages one block of it: its ql + qh and its scales at
// the file block's offsets, then the 16-byte piece of the row's d plane that holds its d
// (blocks 8 j .. 8 j + 7 share one). Every piece's source is 16-byte aligned, so the whole
// block is staged by cp.async, and every level word is 4-byte aligned in shared memory.
struct type_q6_K_planar {
    static constexpr int BLOCK_ELEMENTS = 256, BLOCK_BYTES = 210;
    static constexpr int QUANT_PIECES = type_q6_K::QUANT_BYTES / 16;  // 12, then scales, d
    static constexpr int STAGED_PIECES = QUANT_PIECES + 2, D_SLOTS = 8;  // d's a piece holds
    // Where staged piece `piece` (0 .. STAGED_PIECES - 1) of block k comes from: its byte in a
    // row of `blocks` blocks.
    static QK_HD int64_t piece_source(int blocks, int k, int piece) {
        constexpr int Q = type_q6_K::QUANT_BYTES, S = type_q6_K::SCALE_BYTES;
        if (piece < QUANT_PIECES) return int64_t(Q) * k + 16 * piece;
        if (piece == QUANT_PIECES) return int64_t(Q) * blocks + S * k;
        return int64_t(Q + S) * blocks + 16 * (k / D_SLOTS);
    }
    // Element e of staged block k as tile_levels<type_q6_K_planar> takes it: its d's slot in
    // the staged d piece rides above the block's 256 elements.
    static QK_HD int staged_element(int k, int e) { return e + BLOCK_ELEMENTS * (k % D_SLOTS); }
};

// A staged planar block's element comes as type_q6_K_planar::staged_element gives it; the
// levels and scales are the file block's.
template <>
struct tile_levels<type_q6_K_planar> : tile_levels<type_q6_K> {
    static constexpr int N = type_q6_K::BLOCK_ELEMENTS;
    template <class Load>
    static QK_HD void pairs(const uint8_t* block, int e, Load load, uint32_t* even, uint32_t* odd) {
        tile_levels<type_q6_K>::pairs(block, e % N, load, even, odd);
    }
    static QK_HD void scale_offset(const uint8_t* block, int e, float* scale, float* offset) {
        constexpr int D = type_q6_K::QUANT_BYTES + type_q6_K::SCALE_BYTES;
        scale_with_d(block, e % N, block + D + 2 * (e / N), scale, offset);
    }
};

// Every type as the device holds it, as X(suffix, struct) in QK_FOR_EACH_TYPE's order (its
// type codes): Q6_K row-planar (cuda_plan.holds_planar), the others as the file's blocks. The
// list the tiles', the batched product's and get_rows' entries follow.
#define QK_FOR_EACH_HELD_TYPE(X)                                        \
    QK_LEGACY_TYPES(X) X(q4_K, type_q4_K) X(q5_K, type_q5_K)            \
    X(q6_K_planar, type_q6_K_planar) QK_FLOAT_TYPES(X)

template <>
struct tile_levels<type_f16> {
    static constexpr TileKind KIND = KIND_HALVES;
    template <class Load>
    static QK_HD void pairs(const uint8_t* block, int e, Load load, uint32_t* even, uint32_t* odd) {
        const uint32_t first = load(block + 2 * e), second = load(block + 2 * e + 4);
        *even = (first & 0xFFFFu) | (second << 16);
        *odd = (first >> 16) | (second & 0xFFFF0000u);
    }
};

template <>
struct tile_levels<type_f32> {
    static constexpr TileKind KIND = KIND_FLOATS;
    template <class Load>
    static QK_HD void floats(const uint8_t* block, int e, Load load, float* out) {
        for (int j = 0; j < 4; ++j) out[j] = float_from_bits(load(block + 4 * (e + j)));
    }
};

template <>
struct tile_levels<type_bf16> {
    static constexpr TileKind KIND = KIND_FLOATS;
    template <class Load>
    static QK_HD void floats(const uint8_t* block, int e, Load load, float* out) {
        const uint32_t first = load(block + 2 * e), second = load(block + 2 * e + 4);
        out[0] = float_from_bits(first << 16);
        out[1] = float_from_bits(first & 0xFFFF0000u);
        out[2] = float_from_bits(second << 16);
        out[3] = float_from_bits(second & 0xFFFF0000u);
    }
};
