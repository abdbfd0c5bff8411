// The CUDA-core matvec's block math (host and device): every block type it serves
// (QK_FOR_EACH_MATVEC_TYPE: all but Q4_K and Q6_K, which matvec_mma.cu serves) cut into
// slices of 32 weights,
// each slice read with a few wide loads and unpacked several weights per instruction into
// exact float levels, and its dot product with x in the factored per-run form
//     sum_i w_i x_i = scale * sum_i level_i x_i  (+ offset * sum_i x_i for the affine types).
// A slice is two runs of 16 consecutive elements of the block (`first[r]`: the run's first
// element), each with one scale (and offset). Levels are exact small integers (times a power of
// two where that saves an instruction: Q4 high nibbles are kept as 16 q, their scale / 16), so
// fl(fl(level * scale) + offset) is the exact decode of quants.py (the host test proves it),
// and only the dot product rounds differently: within the float32 summation bound.
//
// Loads: a block sits at a multiple of BLOCK_BYTES from a 16-byte aligned row, so its fields
// are ALIGN-aligned (gcd(BLOCK_BYTES, 16)): Q5_K and the float types load 16-byte
// vectors, the others aligned 32-bit (or 64-bit) words funnel-shifted into place. No load
// passes the 4-byte word holding a block's last byte (inside the 16-byte row pitch).
#pragma once

#include "quant_blocks.cuh"

constexpr int SLICE_WEIGHTS = 32;
constexpr int RUN = 16;

struct Slice {
    float level[2][RUN];
    float scale[2];
    float offset[2];  // zero except for the affine types (Q4_1, Q5_1, Q5_K)
    int first[2];     // first element of each run within the block
};

// --- loads --------------------------------------------------------------------------------

QK_HD uint32_t load_word(const uint8_t* aligned) {
#ifdef __CUDA_ARCH__
    return __ldg(reinterpret_cast<const unsigned int*>(aligned));
#else
    uint32_t word;
    memcpy(&word, aligned, 4);
    return word;
#endif
}

QK_HD uint32_t funnel_right(uint32_t low, uint32_t high, int shift) {
#ifdef __CUDA_ARCH__
    return __funnelshift_r(low, high, shift);
#else
    return shift ? (low >> shift) | (high << (32 - shift)) : low;
#endif
}

// The BYTES bytes at p (ALIGN-aligned, BYTES even) as little-endian words; bytes of the last
// word past BYTES are unspecified. Reads only the aligned words that hold those bytes.
template <int ALIGN, int BYTES>
QK_HD void load_span(const uint8_t* p, uint32_t (&out)[(BYTES + 3) / 4]) {
    constexpr int WORDS = (BYTES + 3) / 4;
#ifdef __CUDA_ARCH__
    if constexpr (ALIGN >= 16 && BYTES % 16 == 0) {
#pragma unroll
        for (int v = 0; v < BYTES / 16; ++v) {
            const uint4 q = __ldg(reinterpret_cast<const uint4*>(p) + v);
            out[4 * v] = q.x, out[4 * v + 1] = q.y, out[4 * v + 2] = q.z, out[4 * v + 3] = q.w;
        }
        return;
    } else if constexpr (ALIGN >= 8 && BYTES % 8 == 0) {
#pragma unroll
        for (int v = 0; v < BYTES / 8; ++v) {
            const uint2 q = __ldg(reinterpret_cast<const uint2*>(p) + v);
            out[2 * v] = q.x, out[2 * v + 1] = q.y;
        }
        return;
    }
#endif
    if constexpr (ALIGN >= 4) {
        for (int k = 0; k < WORDS; ++k) out[k] = load_word(p + 4 * k);
    } else {
        // 2-byte aligned: the words from p rounded down, shifted by 16 bits when p is not
        // 4-aligned. The word after the last is read only when the span reaches into it.
        const int shift = int(reinterpret_cast<uintptr_t>(p) & 2) * 8;
        const uint8_t* base = p - shift / 8;
        uint32_t words[WORDS + 1];
        for (int k = 0; k < WORDS; ++k) words[k] = load_word(base + 4 * k);
        words[WORDS] = (BYTES % 4 == 0 && shift) ? load_word(base + 4 * WORDS) : 0u;
        for (int k = 0; k < WORDS; ++k) out[k] = funnel_right(words[k], words[k + 1], shift);
    }
}

// Words starting OFFSET bytes (even) into `in`.
template <int OFFSET, int N, int M>
QK_HD void words_from(const uint32_t (&in)[M], uint32_t (&out)[N]) {
    static_assert(OFFSET % 2 == 0 && OFFSET / 4 + N <= M, "span outside the loaded words");
    for (int k = 0; k < N; ++k) {
        const uint32_t high = OFFSET % 4 && OFFSET / 4 + k + 1 < M ? in[OFFSET / 4 + k + 1] : 0u;
        out[k] = funnel_right(in[OFFSET / 4 + k], high, 8 * (OFFSET % 4));
    }
}

// --- unpacking ----------------------------------------------------------------------------

// The four bytes of each of the four words, minus `bias`, as exact floats: 16 levels. On the
// device one PRMT puts a byte under the exponent of 2^23 and one FADD removes 2^23 + bias.
QK_HD void byte_levels(const uint32_t (&words)[4], float bias, float (&out)[RUN]) {
    for (int k = 0; k < 4; ++k) {
        for (int b = 0; b < 4; ++b) {
#ifdef __CUDA_ARCH__
            const float magic = __uint_as_float(__byte_perm(words[k], 0x4B000000u, 0x7650u | b));
            out[4 * k + b] = __fsub_rn(magic, 8388608.0f + bias);
#else
            out[4 * k + b] = float(int((words[k] >> (8 * b)) & 0xFFu)) - bias;
#endif
        }
    }
}

template <int N>
QK_HD void masked(const uint32_t (&in)[N], uint32_t mask, uint32_t (&out)[N]) {
    for (int k = 0; k < N; ++k) out[k] = in[k] & mask;
}

// Bit `bit` of each byte of four words, moved to bit 4 (the fifth bit of a level).
QK_HD void fifth_bits(const uint32_t (&bits)[4], int bit, uint32_t (&out)[4]) {
    for (int k = 0; k < 4; ++k) out[k] = ((bits[k] >> bit) & 0x01010101u) << 4;
}

// Bits 0..3 of qh spread to bit 4 of bytes 0..3 (Q5_0 / Q5_1: one qh bit per element).
QK_HD uint32_t spread_nibble(uint32_t nibble) {
    return ((nibble * 0x00204081u) & 0x01010101u) << 4;
}

// Nibble levels of 16 bytes (Q4_0 / Q4_1): low nibbles - bias in run 0, high nibbles kept in
// place (16 q - 16 bias) in run 1, whose scale is divided by 16 (exact: a power of two).
QK_HD void nibble_runs(const uint32_t (&qs)[4], float bias, Slice& s) {
    uint32_t part[4];
    masked(qs, 0x0F0F0F0Fu, part);
    byte_levels(part, bias, s.level[0]);
    masked(qs, 0xF0F0F0F0u, part);
    byte_levels(part, 16.0f * bias, s.level[1]);
}

// Q5_0 / Q5_1 run r: nibbles plus the fifth bit from qh (bit i: element i), one level a byte.
QK_HD void fifth_bit_run(const uint32_t (&qs)[4], uint32_t qh, int r, uint32_t (&out)[4]) {
    for (int k = 0; k < 4; ++k) {
        out[k] = ((qs[k] >> 4 * r) & 0x0F0F0F0Fu) | spread_nibble((qh >> (16 * r + 4 * k)) & 15);
    }
}

// Biased levels, for the affine types, whose dot product needs sum(x) anyway: each byte's
// value v (BITS bits at bit POS of the byte) as the float (1 + v / 2^BITS) / 2, exact, with no
// subtraction: one shift and one mask put v << (7 - BITS) in each byte, and one PRMT a byte
// under the top byte of 0.5f (0x3F000000): v lands in the top mantissa bits. The dot product
// sum((1 + v / 2^BITS) / 2 x) = (sum(x) + sum(v x) / 2^BITS) / 2 is then unbiased by the
// offset term (biased_scales).
template <int BITS, int POS>
QK_HD void biased_levels(const uint32_t (&words)[4], float (&out)[RUN]) {
    constexpr int SHIFT = 7 - BITS - POS;  // > 0: left
    constexpr uint32_t MASK = ((1u << BITS) - 1) << (7 - BITS);
    for (int k = 0; k < 4; ++k) {
        const uint32_t placed = SHIFT >= 0 ? words[k] << (SHIFT >= 0 ? SHIFT : 0)
                                           : words[k] >> (SHIFT < 0 ? -SHIFT : 0);
        const uint32_t bytes = placed & (MASK * 0x01010101u);
        for (int b = 0; b < 4; ++b) {
#ifdef __CUDA_ARCH__
            out[4 * k + b] = __uint_as_float(__byte_perm(bytes, 0x3F000000u, 0x7044u | (b << 8)));
#else
            const int v = int((bytes >> (8 * b + 7 - BITS)) & ((1u << BITS) - 1));
            out[4 * k + b] = 0.5f + float(v) / float(2 << BITS);
#endif
        }
    }
}

// Run r's factors for biased levels: w = scale v + offset = (2^(BITS+1) scale) (1 + v / 2^BITS)
// / 2 + (offset - 2^BITS scale).
template <int BITS>
QK_HD void biased_scales(float scale, float offset, Slice& s, int r) {
    s.scale[r] = scale * float(2 << BITS);
    s.offset[r] = offset - scale * float(1 << BITS);
}

QK_HD void plain_scales(Slice& s, float scale0, float scale1) {
    s.scale[0] = scale0, s.scale[1] = scale1;
    s.offset[0] = s.offset[1] = 0.0f;
    s.first[0] = 0, s.first[1] = RUN;
}

QK_HD float half_low(uint32_t word) { return half_to_float(uint16_t(word & 0xFFFFu)); }
QK_HD float half_high(uint32_t word) { return half_to_float(uint16_t(word >> 16)); }

// --- the block types' slices --------------------------------------------------------------
// Each type splits a slice into load(block, s, raw), the slice's own words (Q6_K's unpack
// reads the scales its block's 8 slices share), and unpack(block, raw, s, out), so the matvec
// can load the next slice while it multiplies this one; slice(block, s, out) does both: slice
// s (0 <= s < SLICES) of the block at `block`.
template <class Type>
struct sliced {
    static QK_HD void slice(const uint8_t* block, int s, Slice& out) {
        typename Type::Raw raw;
        Type::load(block, s, raw);
        Type::unpack(block, raw, s, out);
    }
};

struct slices_q4_0 : sliced<slices_q4_0> {
    static constexpr int SLICES = 1, ALIGN = 2;
    static constexpr bool AFFINE = false;
    struct Raw { uint32_t w[5]; };
    static QK_HD void load(const uint8_t* block, int, Raw& raw) {
        load_span<ALIGN, 18>(block, raw.w);  // d, qs[16]
    }
    static QK_HD void unpack(const uint8_t*, const Raw& raw, int, Slice& s) {
        uint32_t qs[4];
        words_from<2>(raw.w, qs);
        nibble_runs(qs, 8.0f, s);
        const float d = half_low(raw.w[0]);
        plain_scales(s, d, d * 0.0625f);
    }
};

struct slices_q4_1 : sliced<slices_q4_1> {
    static constexpr int SLICES = 1, ALIGN = 4;
    static constexpr bool AFFINE = true;
    struct Raw { uint32_t w[5]; };
    static QK_HD void load(const uint8_t* block, int, Raw& raw) {
        load_span<ALIGN, 20>(block, raw.w);  // d, m, qs[16]
    }
    static QK_HD void unpack(const uint8_t*, const Raw& raw, int, Slice& s) {
        uint32_t qs[4];
        words_from<4>(raw.w, qs);
        biased_levels<4, 0>(qs, s.level[0]);
        biased_levels<4, 4>(qs, s.level[1]);
        plain_scales(s, 0.0f, 0.0f);
        for (int r = 0; r < 2; ++r) biased_scales<4>(half_low(raw.w[0]), half_high(raw.w[0]), s, r);
    }
};

struct slices_q5_0 : sliced<slices_q5_0> {
    static constexpr int SLICES = 1, ALIGN = 2;
    static constexpr bool AFFINE = false;
    struct Raw { uint32_t w[6]; };
    static QK_HD void load(const uint8_t* block, int, Raw& raw) {
        load_span<ALIGN, 22>(block, raw.w);  // d, qh[4], qs[16]
    }
    static QK_HD void unpack(const uint8_t*, const Raw& raw, int, Slice& s) {
        uint32_t qh[1], qs[4], run[4];
        words_from<2>(raw.w, qh);
        words_from<6>(raw.w, qs);
        for (int r = 0; r < 2; ++r) {
            fifth_bit_run(qs, qh[0], r, run);
            byte_levels(run, 16.0f, s.level[r]);
        }
        const float d = half_low(raw.w[0]);
        plain_scales(s, d, d);
    }
};

struct slices_q5_1 : sliced<slices_q5_1> {
    static constexpr int SLICES = 1, ALIGN = 8;
    static constexpr bool AFFINE = true;
    struct Raw { uint32_t w[6]; };
    static QK_HD void load(const uint8_t* block, int, Raw& raw) {
        load_span<ALIGN, 24>(block, raw.w);  // d, m, qh[4], qs[16]
    }
    static QK_HD void unpack(const uint8_t*, const Raw& raw, int, Slice& s) {
        uint32_t qs[4], run[4];
        words_from<8>(raw.w, qs);
        plain_scales(s, 0.0f, 0.0f);
        for (int r = 0; r < 2; ++r) {
            fifth_bit_run(qs, raw.w[1], r, run);
            biased_levels<5, 0>(run, s.level[r]);
            biased_scales<5>(half_low(raw.w[0]), half_high(raw.w[0]), s, r);
        }
    }
};

struct slices_q8_0 : sliced<slices_q8_0> {
    static constexpr int SLICES = 1, ALIGN = 2;
    static constexpr bool AFFINE = false;
    struct Raw { uint32_t w[9]; };
    static QK_HD void load(const uint8_t* block, int, Raw& raw) {
        load_span<ALIGN, 34>(block, raw.w);  // d, qs[32] int8
    }
    static QK_HD void unpack(const uint8_t*, const Raw& raw, int, Slice& s) {
        uint32_t run[4];
        for (int r = 0; r < 2; ++r) {
            // int8 + 128 is the byte with its top bit flipped: levels = that - 128.
            for (int k = 0; k < 4; ++k) {
                run[k] = funnel_right(raw.w[4 * r + k], raw.w[4 * r + k + 1], 16) ^ 0x80808080u;
            }
            byte_levels(run, 128.0f, s.level[r]);
        }
        const float d = half_low(raw.w[0]);
        plain_scales(s, d, d);
    }
};

// Q5_K: the 6-bit scales and mins of sub-blocks 2p and 2p + 1 from the header's packed
// bytes (words 1..3: bytes 0..3 scales 0..3 with the top bits of scales 4..7 above, bytes 4..7
// mins 0..3 likewise, bytes 8..11 the low nibbles of scales / mins 4..7), all eight at once
// with masks as llama.cpp does, then the pair picked out.
QK_HD void k_scale_min_pair(const uint32_t (&header)[4], int p, int (&scale)[2], int (&min)[2]) {
    const uint32_t high_bits_scales = (header[1] >> 2) & 0x30303030u;
    const uint32_t high_bits_mins = (header[2] >> 2) & 0x30303030u;
    const uint32_t scales = p < 2 ? header[1] & 0x3F3F3F3Fu
                                  : (header[3] & 0x0F0F0F0Fu) | high_bits_scales;
    const uint32_t mins = p < 2 ? header[2] & 0x3F3F3F3Fu
                                : ((header[3] >> 4) & 0x0F0F0F0Fu) | high_bits_mins;
    const int shift = 16 * (p % 2);
    for (int r = 0; r < 2; ++r) {
        scale[r] = int((scales >> (shift + 8 * r)) & 0xFFu);
        min[r] = int((mins >> (shift + 8 * r)) & 0xFFu);
    }
}

// Slice s = 2 p + t of a Q5_K block: qs bytes [32 p + 16 t, +16), sub-blocks 2p (low
// nibbles, run 0) and 2p + 1 (high nibbles, run 1), elements 16 t .. 16 t + 15 of each.
// Levels are biased (1 + v / 2^BITS): scale and offset as `biased_scales` makes them.
template <int BITS>
QK_HD void k_affine_runs(const uint32_t (&header)[4], int s, Slice& out) {
    const float d = half_low(header[0]), dmin = half_high(header[0]);
    const int p = s / 2, t = s % 2;
    int sc[2], m[2];
    k_scale_min_pair(header, p, sc, m);
    for (int r = 0; r < 2; ++r) {
        biased_scales<BITS>(mul_rn(d, float(sc[r])), -mul_rn(dmin, float(m[r])), out, r);
        out.first[r] = 64 * p + 32 * r + 16 * t;
    }
}

struct slices_q5_K : sliced<slices_q5_K> {
    static constexpr int SLICES = 8, ALIGN = 16;
    static constexpr bool AFFINE = true;
    struct Raw { uint32_t header[4], qh[4], qs[4]; };
    static QK_HD void load(const uint8_t* block, int s, Raw& raw) {
        load_span<ALIGN, 16>(block, raw.header);  // d, dmin, scales[12]
        load_span<ALIGN, 16>(block + 16 + 16 * (s % 2), raw.qh);
        load_span<ALIGN, 16>(block + 48 + 16 * s, raw.qs);
    }
    static QK_HD void unpack(const uint8_t*, const Raw& raw, int s, Slice& out) {
        uint32_t part[4], top[4];
        const int g = 2 * (s / 2);
        for (int r = 0; r < 2; ++r) {
            fifth_bits(raw.qh, g + r, top);
            for (int k = 0; k < 4; ++k) part[k] = ((raw.qs[k] >> 4 * r) & 0x0F0F0F0Fu) | top[k];
            biased_levels<5, 0>(part, out.level[r]);
        }
        k_affine_runs<5>(raw.header, s, out);
    }
};

struct slices_f32 : sliced<slices_f32> {
    static constexpr int SLICES = 1, ALIGN = 16;
    static constexpr bool AFFINE = false;
    struct Raw { uint32_t w[32]; };
    static QK_HD void load(const uint8_t* block, int, Raw& raw) {
        load_span<ALIGN, 128>(block, raw.w);
    }
    static QK_HD void unpack(const uint8_t*, const Raw& raw, int, Slice& s) {
        for (int i = 0; i < GROUP; ++i) s.level[i / RUN][i % RUN] = float_from_bits(raw.w[i]);
        plain_scales(s, 1.0f, 1.0f);
    }
};

// The 16-bit float types: 32 elements in 16 words, two a word (low half first); Halves says
// how a half becomes a float.
template <class Halves, class Type>
struct slices_of_halves : sliced<Type> {
    static constexpr int SLICES = 1, ALIGN = 16;
    static constexpr bool AFFINE = false;
    struct Raw { uint32_t w[16]; };
    static QK_HD void load(const uint8_t* block, int, Raw& raw) {
        load_span<ALIGN, 64>(block, raw.w);
    }
    static QK_HD void unpack(const uint8_t*, const Raw& raw, int, Slice& s) {
        for (int i = 0; i < GROUP / 2; ++i) {
            s.level[i / 8][2 * (i % 8)] = Halves::to_float(uint16_t(raw.w[i]));
            s.level[i / 8][2 * (i % 8) + 1] = Halves::to_float(uint16_t(raw.w[i] >> 16));
        }
        plain_scales(s, 1.0f, 1.0f);
    }
};

struct f16_halves {
    static QK_HD float to_float(uint16_t h) { return half_to_float(h); }
};
struct bf16_halves {
    static QK_HD float to_float(uint16_t b) { return bf16_to_float(b); }
};
struct slices_f16 : slices_of_halves<f16_halves, slices_f16> {};
struct slices_bf16 : slices_of_halves<bf16_halves, slices_bf16> {};

// The types the CUDA-core matvec serves (cuda_plan.MATVEC_TYPES), as X(suffix, struct).
#define QK_FOR_EACH_MATVEC_TYPE(X) QK_LEGACY_TYPES(X) X(q5_K, type_q5_K) QK_FLOAT_TYPES(X)

template <class T> struct slices_of;
#define QK_SLICES_OF(suffix, type) \
    template <>                    \
    struct slices_of<type> : slices_##suffix {};
QK_FOR_EACH_MATVEC_TYPE(QK_SLICES_OF)
#undef QK_SLICES_OF

// --- the factored dot product -------------------------------------------------------------

QK_HD void load4(const float* x, float (&out)[4]) {
#ifdef __CUDA_ARCH__
    const float4 v = __ldg(reinterpret_cast<const float4*>(x));
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
#else
    for (int i = 0; i < 4; ++i) out[i] = x[i];
#endif
}

QK_HD float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
    return __fmaf_rn(a, b, c);
#else
    return __builtin_fmaf(a, b, c);
#endif
}

// The sum of a run's 16 x: two interleaved chains (even and odd elements), then their sum.
// The kernel keeps these in a table per block (the affine types' offset terms read them).
QK_HD float run_sum(const float* x) {
    float sum[2] = {0.0f, 0.0f};
    for (int q = 0; q < RUN / 4; ++q) {
        float v[4];
        load4(x + 4 * q, v);
        for (int i = 0; i < 4; ++i) sum[i % 2] = add_rn(sum[i % 2], v[i]);
    }
    return add_rn(sum[0], sum[1]);
}

// acc + the slice's dot product with x (x: the block's first element; 16-byte aligned runs).
// Fixed operations in a fixed order, the same on host and device: two interleaved FMA chains
// per run, then scale (and for the affine types offset times the run's sum of x, from
// `run_sums`: run_sum of the block's runs) into acc.
template <bool AFFINE>
QK_HD float slice_dot(const Slice& s, const float* x, float acc, const float* run_sums) {
    for (int r = 0; r < 2; ++r) {
        float dot[2] = {0.0f, 0.0f};
        for (int q = 0; q < RUN / 4; ++q) {
            float v[4];
            load4(x + s.first[r] + 4 * q, v);
            for (int i = 0; i < 4; ++i) {
                dot[i % 2] = fma_rn(s.level[r][4 * q + i], v[i], dot[i % 2]);
            }
        }
        acc = fma_rn(s.scale[r], add_rn(dot[0], dot[1]), acc);
        if (AFFINE) acc = fma_rn(s.offset[r], run_sums[s.first[r] / RUN], acc);
    }
    return acc;
}
