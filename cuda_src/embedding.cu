// Embedding gather: out[i][:] = dequantize(table row ids[i]) * scale, exact per element
// (the decode is quants.py's bit for bit, then one float32 multiply, as forward.py's
// `x *= embed_scale`; scale = 1 leaves the rows as decoded).
// Entry points get_rows_<type>, per block type as the device holds it (<type> as in
// matmul_batch.cu: q6_K_planar for Q6_K, held row-planar, cuda_plan.planar_q6_K_rows).
// table: the GGUF token_embd rows at row_pitch bytes (see matvec.cu), a Q6_K table's
// row-planar; d_model % 32 == 0; out: float32 [n_ids][d_model]. Grid: n_ids blocks; any block
// size.
#include "tile_levels.cuh"

// How a table's row is decoded, a group at a time: its file blocks, or Q6_K row-planar.
template <class T>
struct held_row {
    static __device__ void group(const uint8_t* row, int, int g, float* out) {
        dequantize_row_group<T>(row, g, out);
    }
};

template <>
struct held_row<type_q6_K_planar> {
    static __device__ void group(const uint8_t* row, int d_model, int g, float* out) {
        dequantize_planar_q6_K_group(row, d_model / type_q6_K::BLOCK_ELEMENTS, g, out);
    }
};

template <class Row>
__device__ void get_rows(const uint8_t* __restrict__ table, int64_t row_pitch,
                         const int* __restrict__ ids, float* __restrict__ out, int d_model,
                         float scale) {
    const uint8_t* row = table + ids[blockIdx.x] * row_pitch;
    float* dest = out + int64_t(blockIdx.x) * d_model;
    for (int group = threadIdx.x; group < d_model / GROUP; group += blockDim.x) {
        float values[GROUP];
        Row::group(row, d_model, group, values);
#pragma unroll
        for (int i = 0; i < GROUP; ++i) dest[group * GROUP + i] = mul_rn(values[i], scale);
    }
}

#define QK_GET_ROWS_ENTRY(suffix, type)                                                    \
    extern "C" __global__ void get_rows_##suffix(const uint8_t* table, int64_t row_pitch,  \
                                                 const int* ids, float* out, int d_model,  \
                                                 float scale) {                             \
        get_rows<held_row<type>>(table, row_pitch, ids, out, d_model, scale);               \
    }

QK_FOR_EACH_HELD_TYPE(QK_GET_ROWS_ENTRY)
