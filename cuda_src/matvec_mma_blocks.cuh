// What the tensor-core matvec (matvec_mma.cu) takes from a Q4_K block, per lane, shared by host
// and device code (tests/test_cuda_blockmath.py rebuilds every weight from it, bit for bit).
//
// Lane c of a row (c = 0..3) owns the block's 32-byte chunk c of qs: sub-block 2c in the low
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
