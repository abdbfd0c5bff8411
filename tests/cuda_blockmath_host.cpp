// Host build of cuda_src/quant_blocks.cuh for tests/test_cuda_blockmath.py: for every block
// type, dequantize_<type> decodes whole rows into floats and dot_<type> takes each row's dot
// product with x, summing the groups' dot products in order. Compiled with g++ and
// -ffp-contract=off, so the decode rounds exactly as the device code (__fmul_rn / __fadd_rn).
#include "quant_blocks.cuh"

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

template <class T>
void dot_rows(const uint8_t* src, int64_t rows, int64_t groups_per_row, const float* x,
              float* out) {
    for (int64_t r = 0; r < rows; ++r) {
        float sum = 0.0f;
        for (int64_t g = 0; g < groups_per_row; ++g) {
            sum += dot_row_group<T>(src + r * row_bytes<T>(groups_per_row), int(g), x + g * GROUP);
        }
        out[r] = sum;
    }
}

#define QK_EXPORT_HOST(suffix, type)                                                          \
    extern "C" void dequantize_##suffix(const uint8_t* src, int64_t rows, int64_t groups,     \
                                        float* out) {                                         \
        dequantize_rows<type>(src, rows, groups, out);                                        \
    }                                                                                         \
    extern "C" void dot_##suffix(const uint8_t* src, int64_t rows, int64_t groups,            \
                                 const float* x, float* out) {                                \
        dot_rows<type>(src, rows, groups, x, out);                                            \
    }

QK_FOR_EACH_TYPE(QK_EXPORT_HOST)
