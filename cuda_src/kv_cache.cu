// KV write: the step's keys and values into the paged float16 cache of one layer.
// Cache layout per layer, K and V separate: [block][pos_in_block][kv_head][head_dim] float16,
// so slot s = block * block_size + pos_in_block starts at s * kv_dim (kv_dim = kv_heads *
// head_dim). Token t's key is k[t * row_stride ...] and its value v[t * row_stride ...] (both
// point into the fused qkv rows); slots[t] is its slot. Rounded to nearest float16.
// Grid-stride: any grid and block size.
#include <cuda_fp16.h>

extern "C" __global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v,
                                    int row_stride, const int* __restrict__ slots, int n_tokens,
                                    int kv_dim, __half* __restrict__ k_cache,
                                    __half* __restrict__ v_cache) {
    const int64_t total = int64_t(n_tokens) * kv_dim;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
         e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t t = e / kv_dim, j = e % kv_dim;
        const int64_t dest = int64_t(slots[t]) * kv_dim + j;
        k_cache[dest] = __float2half_rn(k[t * row_stride + j]);
        v_cache[dest] = __float2half_rn(v[t * row_stride + j]);
    }
}
