// Host build of cuda_src/quant_blocks.cuh for tests/test_cuda_blockmath.py: for every block
// type, dequantize_<type> decodes whole rows into floats (the exact decode get_rows uses).
// Compiled with g++ and
// -ffp-contract=off, so the decode rounds exactly as the device code (__fmul_rn / __fadd_rn).
// The matvec's slices (matvec_slices.cuh), on rows `pitch` bytes apart: slice_weights_<type>
// rebuilds every weight from its slice (level * scale + offset), slice_dot_<type> takes each
// row's dot product slice by slice in order, as one lane of the kernel does.
// tile_values_<type> rebuilds every element from cuda_src/tile_levels.cuh (what the tensor-core
// tiles multiply): level * scale + offset, rounded as quants.py rounds.
#include <vector>

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

#define QK_EXPORT_HOST(suffix, type)                                                          \
    extern "C" void dequantize_##suffix(const uint8_t* src, int64_t rows, int64_t groups,     \
                                        float* out) {                                         \
        dequantize_rows<type>(src, rows, groups, out);                                        \
    }                                                                                         \
    extern "C" void tile_values_##suffix(const uint8_t* src, int64_t rows, int64_t groups,    \
                                         float* out) {                                        \
        tile_values_rows<type>(src, rows, groups, out);                                       \
    }                                                                                         \
    extern "C" void slice_weights_##suffix(const uint8_t* src, int64_t rows, int64_t pitch,   \
                                           int64_t row_length, float* out) {                  \
        slice_weights_rows<type>(src, rows, pitch, row_length, out);                          \
    }                                                                                         \
    extern "C" void slice_dot_##suffix(const uint8_t* src, int64_t rows, int64_t pitch,       \
                                       int64_t row_length, const float* x, float* out) {      \
        slice_dot_rows<type>(src, rows, pitch, row_length, x, out);                           \
    }

QK_FOR_EACH_TYPE(QK_EXPORT_HOST)
