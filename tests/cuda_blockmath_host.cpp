// Host build of cuda_src/quant_blocks.cuh for tests/test_cuda_blockmath.py: for every block
// type, dequantize_<type> decodes whole rows into floats (the exact decode get_rows uses).
// Compiled with g++ and
// -ffp-contract=off, so the decode rounds exactly as the device code (__fmul_rn / __fadd_rn).
// The CUDA-core matvec's slices (matvec_slices.cuh, its types alone), on rows `pitch` bytes
// apart: slice_weights_<type> rebuilds every weight from its slice (level * scale + offset),
// slice_dot_<type> takes each row's dot product slice by slice in order, as one lane of the
// kernel does.
// tile_values_<type> rebuilds every element from cuda_src/tile_levels.cuh (what the tensor-core
// tiles multiply): level * scale + offset, rounded as quants.py rounds.
// mma_lane_values_q4_K / _q6_K rebuild every Q4_K / Q6_K element from what each lane of the
// tensor-core matvec takes (cuda_src/matvec_mma_blocks.cuh): its words' float16 pairs and its
// scales. The Q6_K lane reads its block's bytes at the same offsets in the row-planar layout
// (ql, qh; scales; d), so file blocks serve here.
// split_scales gives each 32-element group's 2^-e and 2^e of the activations' float16 split
// (cuda_src/activation_split.cuh), as the tensor-core kernels find them.
// dequantize_planar_q6_K decodes row-planar Q6_K rows as get_rows_q6_K_planar does;
// tile_values_q6_K_planar stages each of their blocks as the prefill tiles do
// (type_q6_K_planar's pieces) and rebuilds every element from the staged bytes.
#include <cstring>
#include <vector>

#include "activation_split.cuh"
#include "matvec_mma_blocks.cuh"
#include "matvec_slices.cuh"
#include "tile_levels.cuh"

template <class T>
int64_t row_bytes(int64_t groups_per_row) {
    return groups_per_row / groups_per_block<T> * T::BLOCK_BYTES;
}

template <class T>
void dequantize_rows(const uint8_t* src, int64_t rows, int64_t groups_per_row, float* out) {
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < groups_per_row; ++g) {
            dequantize_row_group<T>(src + r * row_bytes<T>(groups_per_row), int(g),
                                    out + (r * groups_per_row + g) * GROUP);
        }
    }
}

// The pairs' float16 values, low half first: (element e, e + 2) and (e + 1, e + 3).
inline void unpair(uint32_t even, uint32_t odd, float* out) {
    out[0] = half_to_float(uint16_t(even));
    out[2] = half_to_float(uint16_t(even >> 16));
    out[1] = half_to_float(uint16_t(odd));
    out[3] = half_to_float(uint16_t(odd >> 16));
}

template <class T>
void tile_values(const uint8_t* block, int e, float* out) {
    using L = tile_levels<T>;
    if constexpr (L::KIND == KIND_FLOATS) {
        L::floats(block, e, load_u32, out);
    } else {
        uint32_t even, odd;
        L::pairs(block, e, load_u32, &even, &odd);
        unpair(even, odd, out);
        if constexpr (L::KIND == KIND_LEVELS) {
            for (int j = 0; j < 4; ++j) {
                float scale, offset;
                L::scale_offset(block, e + j, &scale, &offset);
                const float level = out[j] - float(1024 + L::OFFSET);  // exact: small integers
                const float scaled = mul_rn(level, scale);
                out[j] = L::HAS_MIN ? add_rn(scaled, offset) : scaled;
            }
        }
    }
}

template <class T>
void tile_values_rows(const uint8_t* src, int64_t rows, int64_t groups_per_row, float* out) {
    const int64_t blocks = groups_per_row / groups_per_block<T>;
    for (int64_t b = 0; b < rows * blocks; ++b) {
        for (int e = 0; e < T::BLOCK_ELEMENTS; e += 4) {
            tile_values<T>(src + b * T::BLOCK_BYTES, e, out + b * T::BLOCK_ELEMENTS + e);
        }
    }
}

extern "C" void split_scales(const float* x, int64_t groups, float* down, float* up) {
    for (int64_t g = 0; g < groups; ++g) {
        uint32_t largest = 0;
        for (int j = 0; j < SPLIT_GROUP; ++j) {
            const uint32_t magnitude = magnitude_bits(x[g * SPLIT_GROUP + j]);
            largest = magnitude > largest ? magnitude : largest;
        }
        const int e = split_exponent(largest);
        down[g] = power_of_two(-e);
        up[g] = power_of_two(e);
    }
}

// The staging stays inside each row's pitch; -1 where a piece would read past it.
extern "C" int tile_values_q6_K_planar(const uint8_t* src, int64_t rows, int64_t pitch,
                                       int64_t row_length, float* out) {
    using P = type_q6_K_planar;
    const int blocks = int(row_length / P::BLOCK_ELEMENTS);
    uint8_t staged[P::STAGED_PIECES * 16];
    for (int64_t r = 0; r < rows; ++r) {
        for (int k = 0; k < blocks; ++k) {
            for (int piece = 0; piece < P::STAGED_PIECES; ++piece) {
                const int64_t source = P::piece_source(blocks, k, piece);
                if (source % 16 != 0 || source + 16 > pitch) return -1;
                std::memcpy(staged + 16 * piece, src + r * pitch + source, 16);
            }
            float* block_out = out + r * row_length + int64_t(k) * P::BLOCK_ELEMENTS;
            for (int e = 0; e < P::BLOCK_ELEMENTS; e += 4) {
                tile_values<P>(staged, P::staged_element(k, e), block_out + e);
            }
        }
    }
    return 0;
}

extern "C" void dequantize_planar_q6_K(const uint8_t* src, int64_t rows, int64_t pitch,
                                       int64_t row_length, float* out) {
    const int blocks = int(row_length / type_q6_K::BLOCK_ELEMENTS);
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < row_length / GROUP; ++g) {
            dequantize_planar_q6_K_group(src + r * pitch, blocks, int(g),
                                         out + r * row_length + g * GROUP);
        }
    }
}

template <class T>
void slice_weights_rows(const uint8_t* src, int64_t rows, int64_t pitch, int64_t row_length,
                        float* out) {
    using S = slices_of<T>;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < row_length / T::BLOCK_ELEMENTS; ++b) {
            float* block_out = out + r * row_length + b * T::BLOCK_ELEMENTS;
            for (int s = 0; s < S::SLICES; ++s) {
                Slice slice;
                S::slice(src + r * pitch + b * T::BLOCK_BYTES, s, slice);
                for (int run = 0; run < 2; ++run) {
                    for (int i = 0; i < RUN; ++i) {
                        const float scaled = mul_rn(slice.level[run][i], slice.scale[run]);
                        block_out[slice.first[run] + i] =
                            S::AFFINE ? add_rn(scaled, slice.offset[run]) : scaled;
                    }
                }
            }
        }
    }
}

template <class T>
void slice_dot_rows(const uint8_t* src, int64_t rows, int64_t pitch, int64_t row_length,
                    const float* x, float* out) {
    using S = slices_of<T>;
    std::vector<float> run_sums(row_length / RUN);  // the kernel's table of x's run sums
    for (size_t e = 0; e < run_sums.size(); ++e) run_sums[e] = run_sum(x + e * RUN);
    for (int64_t r = 0; r < rows; ++r) {
        float acc = 0.0f;
        for (int64_t b = 0; b < row_length / T::BLOCK_ELEMENTS; ++b) {
            for (int s = 0; s < S::SLICES; ++s) {
                Slice slice;
                S::slice(src + r * pitch + b * T::BLOCK_BYTES, s, slice);
                acc = slice_dot<S::AFFINE>(slice, x + b * T::BLOCK_ELEMENTS, acc,
                                           run_sums.data() + b * T::BLOCK_ELEMENTS / RUN);
            }
        }
        out[r] = acc;
    }
}

// Elements 4i + j and 4i + j + 2 of a sub-block from a float16 pair of 1024 + `step` x level
// (the kernel subtracts the 1024 exactly), times the lane's scale (`step` x sc), plus its min.
inline void rebuild_pair(uint32_t pair, float step, float d, float scale, float dmin,
                         float min, float* first, float* third) {
    const float offset = -mul_rn(dmin, min), sc = scale * step;  // exact: powers of two
    *first = add_rn(mul_rn((half_to_float(uint16_t(pair)) - 1024.0f) / step, mul_rn(d, sc)),
                    offset);
    *third = add_rn(mul_rn((half_to_float(uint16_t(pair >> 16)) - 1024.0f) / step, mul_rn(d, sc)),
                    offset);
}

extern "C" void mma_lane_values_q4_K(const uint8_t* src, int64_t blocks, float* out) {
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = src + b * type_q4_K::BLOCK_BYTES;
        float* values = out + b * type_q4_K::BLOCK_ELEMENTS;
        const float d = load_half(block), dmin = load_half(block + 2);
        for (int c = 0; c < 4; ++c) {
            const LaneScales s =
                lane_scales(load_u32(block + 4), load_u32(block + 8), load_u32(block + 12), c);
            for (int i = 0; i < 8; ++i) {
                const NibblePairs p = nibble_pairs_of(load_u32(block + 16 + 32 * c + 4 * i));
                float* low = values + 64 * c + 4 * i;  // sub-block 2c, elements 4i..4i+3
                float* high = low + 32;                 // sub-block 2c + 1
                rebuild_pair(p.low02, 1.0f, d, s.scale_low, dmin, s.min_low, low, low + 2);
                rebuild_pair(p.low13, 1.0f, d, s.scale_low, dmin, s.min_low, low + 1,
                             low + 3);
                rebuild_pair(p.high02, 16.0f, d, s.scale_high, dmin, s.min_high, high,
                             high + 2);
                rebuild_pair(p.high13, 16.0f, d, s.scale_high, dmin, s.min_high, high + 1,
                             high + 3);
            }
        }
    }
}

// Quarter t's elements 4j .. 4j + 3 of the lane's 16 from its levels: the float16 pairs less
// 1056 (exact), times d * sc as quants.py rounds it.
inline void rebuild_quarter(uint32_t levels, float scale, float* out) {
    float pair_values[4];
    unpair(level_pair(levels, false), level_pair(levels, true), pair_values);
    for (int e = 0; e < 4; ++e) out[e] = mul_rn(pair_values[e] - 1056.0f, scale);
}

extern "C" void mma_lane_values_q6_K(const uint8_t* src, int64_t blocks, float* out) {
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = src + b * type_q6_K::BLOCK_BYTES;
        float* values = out + b * type_q6_K::BLOCK_ELEMENTS;
        const float d = load_half(block + 208);
        for (int c = 0; c < 4; ++c) {
            const int h = c / 2, v = c % 2;
            const uint32_t scales0 = load_u32(block + 192 + 8 * h);
            const uint32_t scales1 = load_u32(block + 196 + 8 * h);
            for (int j = 0; j < 4; ++j) {
                const uint32_t first = load_u32(block + 64 * h + 16 * v + 4 * j);
                const uint32_t second = load_u32(block + 64 * h + 32 + 16 * v + 4 * j);
                const uint32_t top = load_u32(block + 128 + 32 * h + 16 * v + 4 * j);
                const uint32_t levels[4] = {six_bit_levels<0>(first, second, top),
                                            six_bit_levels<1>(first, second, top),
                                            six_bit_levels<2>(first, second, top),
                                            six_bit_levels<3>(first, second, top)};
                for (int t = 0; t < 4; ++t) {
                    const float scale = mul_rn(d, q6_K_lane_scale(scales0, scales1, t, v));
                    rebuild_quarter(levels[t], scale,
                                    values + 128 * h + 32 * t + 16 * v + 4 * j);
                }
            }
        }
    }
}

#define QK_EXPORT_HOST(suffix, type)                                                          \
    extern "C" void dequantize_##suffix(const uint8_t* src, int64_t rows, int64_t groups,     \
                                        float* out) {                                         \
        dequantize_rows<type>(src, rows, groups, out);                                        \
    }                                                                                         \
    extern "C" void tile_values_##suffix(const uint8_t* src, int64_t rows, int64_t groups,    \
                                         float* out) {                                        \
        tile_values_rows<type>(src, rows, groups, out);                                       \
    }

#define QK_EXPORT_SLICES(suffix, type)                                                        \
    extern "C" void slice_weights_##suffix(const uint8_t* src, int64_t rows, int64_t pitch,   \
                                           int64_t row_length, float* out) {                  \
        slice_weights_rows<type>(src, rows, pitch, row_length, out);                          \
    }                                                                                         \
    extern "C" void slice_dot_##suffix(const uint8_t* src, int64_t rows, int64_t pitch,       \
                                       int64_t row_length, const float* x, float* out) {      \
        slice_dot_rows<type>(src, rows, pitch, row_length, x, out);                           \
    }

QK_FOR_EACH_TYPE(QK_EXPORT_HOST)
QK_FOR_EACH_MATVEC_TYPE(QK_EXPORT_SLICES)
