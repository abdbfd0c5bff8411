// What the tensor-core matvec (matvec_mma.cu) takes from a Q4_K or Q6_K block, per lane, shared
// by host and device code (tests/test_cuda_blockmath.py rebuilds every weight from it, bit for
// bit).
//
// Q4_K. Lane c of a row (c = 0..3) owns the block's 32-byte chunk c of qs: sub-block 2c in the low
// nibbles, 2c + 1 in the high ones (quant_blocks.cuh's type_q4_K). Word i of the chunk (bytes
// 4i..4i+3) holds elements 4i..4i+3 of both sub-blocks; they become the MMA's float16 pairs
// (elements 4i, 4i + 2) and (4i + 1, 4i + 3), low half first, as the tiles pair them.
//
// The levels are exact float16 integers: a nibble masked in place and ORed into 1024.0 is the
// half 1024 + u (bits 0..3) or 1024 + 16 u (bits 4..7), one LOP3 a pair; the kernel subtracts
// 1024 in float16 (exact), leaving u or 16 u. Normal numbers on purpose: PTX leaves the tensor
// cores' handling of subnormal inputs unspecified (levels u * 2^-24 would save the
// subtraction). The high nibbles' sub-block carries the 16 back in its scale (sc / 16, exact).
#pragma once

#include "tile_levels.cuh"

constexpr uint32_t LOW_NIBBLE_PAIR = 0x000F000Fu, HIGH_NIBBLE_PAIR = 0x00F000F0u;

// The four float16 pairs of word `bits`, 1024 + level: low nibbles (sub-block 2c) of bytes
// (0, 2) and (1, 3), then high nibbles (sub-block 2c + 1, 16 x the nibble) of the same bytes.
struct NibblePairs {
    uint32_t low02, low13, high02, high13;
};

QK_HD NibblePairs nibble_pairs_of(uint32_t bits) {
    const uint32_t odd = bits >> 8;
    return {masked_1024_pair(bits, LOW_NIBBLE_PAIR), masked_1024_pair(odd, LOW_NIBBLE_PAIR),
            masked_1024_pair(bits, HIGH_NIBBLE_PAIR), masked_1024_pair(odd, HIGH_NIBBLE_PAIR)};
}

// The byte of `bits` at bit `shift` times 2^(EXPONENT - 150), exactly: the float whose
// exponent field is EXPONENT and whose low mantissa byte is the byte, minus the same float with
// a zero byte (two bit operations and one exact subtraction).
template <int EXPONENT>
QK_HD float byte_times_power(uint32_t bits, int shift) {
    constexpr uint32_t base = uint32_t(EXPONENT) << 23;
    return float_from_bits(base | ((bits >> shift) & 0xFFu)) - float_from_bits(base);
}

constexpr int EXPONENT_ONE = 150;                      // byte * 2^0
constexpr int EXPONENT_SIXTEENTH = EXPONENT_ONE - 4;   // byte * 2^-4

// Lane c's sub-blocks 2c and 2c + 1 of a block whose header words are `packed` (the 12 scale
// bytes as three little-endian words): their 6-bit scales (the high nibbles' over 16) and
// their 6-bit mins, as floats. One formula for every lane (no divergence): lanes 0 and 1 read
// bytes 2c, 2c + 1 of words 0 (scales) and 1 (mins); lanes 2 and 3 the same bytes of word 2
// (low bits) and of words 0 and 1 (the top two bits), as k_scale_min does byte by byte.
struct LaneScales {
    float scale_low, scale_high, min_low, min_high;
};

QK_HD LaneScales lane_scales(uint32_t word0, uint32_t word1, uint32_t word2, int c) {
    const bool first = c < 2;
    const uint32_t low_mask = first ? 0x3F3F3F3Fu : 0x0F0F0F0Fu;
    const uint32_t top_mask = first ? 0u : 0x30303030u;
    const uint32_t scales = ((first ? word0 : word2) & low_mask) | ((word0 >> 2) & top_mask);
    const uint32_t mins = ((first ? word1 : word2 >> 4) & low_mask) | ((word1 >> 2) & top_mask);
    const int shift = 16 * (c % 2);  // bytes 2c, 2c + 1 of each word (mod 4)
    return {byte_times_power<EXPONENT_ONE>(scales, shift),
            byte_times_power<EXPONENT_SIXTEENTH>(scales, shift + 8),
            byte_times_power<EXPONENT_ONE>(mins, shift),
            byte_times_power<EXPONENT_ONE>(mins, shift + 8)};
}

// Q6_K, read from the row-planar layout (cuda_plan.planar_q6_K_rows: a row's blocks' ql + qh,
// then their scales, then their d; every load aligned, where the file's 210-byte blocks are
// only 2-byte aligned). Lane c of a row (half h = c / 2, v = c % 2) owns positions 16 v ..
// 16 v + 15 of half h in all four quarters: sub-blocks 8 h + 2 t + v (t = 0..3), whole. It
// loads three 16-byte runs: ql bytes 64 h + 16 v (quarters 0 and 2 in the low and high
// nibbles), ql bytes 64 h + 32 + 16 v (quarters 1 and 3) and qh bytes 128 + 32 h + 16 v (two
// top bits of each quarter); word j of a run holds positions 16 v + 4 j .. 16 v + 4 j + 3.
//
// A quarter's four 6-bit levels u of a word come out as four bytes (two masks and a shift),
// each pair of bytes becomes a float16 pair 1024 + u with one byte permute, and the kernel
// subtracts 1056 in float16 (exact): the level u - 32 itself, no min and no sum of x.
constexpr uint32_t LEVEL_NIBBLES = 0x0F0F0F0Fu, LEVEL_TOP_BITS = 0x30303030u;
constexpr uint32_t HALF_1056_PAIR = 0x64206420u;  // float16 1056.0 = 1024 + 32 in both halves

// Quarter QUARTER's levels at word j, one byte each: its nibbles (quarters 0 and 2 from the
// first ql run, 1 and 3 from the second; low nibbles for 0 and 1) and its top bits (bits
// 2 QUARTER and 2 QUARTER + 1 of each qh byte) moved to bits 4 and 5.
template <int QUARTER>
QK_HD uint32_t six_bit_levels(uint32_t first_run, uint32_t second_run, uint32_t top) {
    const uint32_t nibbles = (QUARTER % 2 ? second_run : first_run) >> (4 * (QUARTER / 2));
    uint32_t tops;  // bits 2 QUARTER .. 2 QUARTER + 1 of each byte at bits 4 .. 5
    if constexpr (QUARTER <= 2) {
        tops = top << (4 - 2 * QUARTER);
    } else {
        tops = top >> (2 * QUARTER - 4);
    }
    return (nibbles & LEVEL_NIBBLES) | (tops & LEVEL_TOP_BITS);
}

// Bytes of a and b picked by the selector's nibbles (0..3: a's bytes, 4..7: b's), as the
// device's byte permute.
QK_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef __CUDA_ARCH__
    return __byte_perm(a, b, selector);
#else
    const uint64_t both = (uint64_t(b) << 32) | a;
    uint32_t out = 0;
    for (int i = 0; i < 4; ++i) {
        const int pick = (selector >> (4 * i)) & 7;
        out |= uint32_t((both >> (8 * pick)) & 0xFFu) << (8 * i);
    }
    return out;
#endif
}

// Float16 pairs 1024 + level of bytes (0, 2) (`odd` false) or (1, 3): each byte is a low
// mantissa byte under 0x64, the high byte of 1024.0.
constexpr uint32_t BYTES_0x64 = 0x64646464u;
QK_HD uint32_t level_pair(uint32_t levels, bool odd) {
    return byte_perm(levels, BYTES_0x64, odd ? 0x4341u : 0x4240u);
}

// Sub-block 8 h + 2 t + v's int8 scale from the lane's 8 scale bytes of half h (scales
// 8 h .. 8 h + 7 as two little-endian words): byte 2 t + v.
QK_HD float q6_K_lane_scale(uint32_t first_word, uint32_t second_word, int t, int v) {
    const uint32_t word = t < 2 ? first_word : second_word;
    return float(int8_t((word >> (8 * (2 * (t % 2) + v))) & 0xFFu));
}
