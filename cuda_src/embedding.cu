// Embedding gather: out[i][:] = dequantize(table row ids[i]) * scale, exact per element
// (the decode is quants.py's bit for bit, then one float32 multiply, as forward.py's
// `x *= embed_scale`; scale = 1 leaves the rows as decoded).
// table: the GGUF token_embd rows at row_pitch bytes (see matvec.cu); d_model % 32 == 0;
// out: float32 [n_ids][d_model]. Grid: n_ids blocks; any block size.
#include "quant_blocks.cuh"

template <class T>
__device__ void get_rows(const uint8_t* __restrict__ table, int64_t row_pitch,
                         const int* __restrict__ ids, float* __restrict__ out, int d_model,
                         float scale) {
    const uint8_t* row = table + ids[blockIdx.x] * row_pitch;
    float* dest = out + int64_t(blockIdx.x) * d_model;
    for (int group = threadIdx.x; group < d_model / GROUP; group += blockDim.x) {
        float values[GROUP];
        dequantize_row_group<T>(row, group, values);
#pragma unroll
        for (int i = 0; i < GROUP; ++i) dest[group * GROUP + i] = mul_rn(values[i], scale);
    }
}

#define QK_GET_ROWS_ENTRY(suffix, type)                                                    \
    extern "C" __global__ void get_rows_##suffix(const uint8_t* table, int64_t row_pitch,  \
                                                 const int* ids, float* out, int d_model,  \
                                                 float scale) {                             \
        get_rows<type>(table, row_pitch, ids, out, d_model, scale);                         \
    }

QK_FOR_EACH_TYPE(QK_GET_ROWS_ENTRY)
