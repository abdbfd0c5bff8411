// One head of one token between the QKV product and attention: qkv_finish.cu runs it on the
// step's rows, the fused QKV products (matvec.cu's mul_mat_vec_qkv, matvec_mma.cu's
// mul_mat_vec_mma_qkv) in their epilogue. One body, so all round the same.
#pragma once

#include <cuda_fp16.h>

#include "device_common.cuh"
#include "head_ops.cuh"

// What the finish of a head reads besides the head itself (qkv_finish.cu's arguments).
struct QkvFinish {
    int n_heads, n_kv_heads, head_dim;
    const float* q_bias;  // the biases and norms may be null
    const float* k_bias;
    const float* v_bias;
    const float* q_norm;
    const float* k_norm;
    float eps;
    const int* positions;  // per token of the launch
    int rope_dim;
    double base;
    const float* freq_factors;  // may be null
    int neox;
    const int* slots;  // per token of the launch
    __half* k_cache;
    __half* v_cache;
};

// Head `head` (q heads, then k heads, then v heads) of token `token`, its head_dim floats at
// `v` (the qkv row itself or a copy of it), by one warp (`lane` its lane): bias, head RMSNorm,
// RoPE (q and k), then k and v rounded to float16 into the paged cache. The caller must
// __syncwarp() before reading v's elements in other lanes (RoPE pairs span lanes).
__device__ __forceinline__ void finish_head(float* v, int head, int token, const QkvFinish& f,
                                            int lane) {
    const int n_heads = f.n_heads, n_kv_heads = f.n_kv_heads, head_dim = f.head_dim;
    const bool is_q = head < n_heads, is_k = !is_q && head < n_heads + n_kv_heads;
    // The head's index within its segment (q, k or v).
    const int in_segment = is_q ? head : (head - n_heads) % n_kv_heads;
    const float* bias = is_q ? f.q_bias : is_k ? f.k_bias : f.v_bias;
    if (bias != nullptr) {
        const float* head_bias = bias + int64_t(in_segment) * head_dim;
        for (int i = lane; i < head_dim; i += WARP) v[i] += head_bias[i];
        __syncwarp();
    }
    const float* norm = is_q ? f.q_norm : is_k ? f.k_norm : nullptr;
    if (norm != nullptr) {
        warp_head_rms_norm(v, head_dim, norm, f.eps, lane);
        __syncwarp();  // RoPE pairs span lanes
    }
    if (is_q) {
        rope_head(v, f.positions[token], f.rope_dim, f.base, f.freq_factors, f.neox, lane, WARP);
        return;
    }
    if (is_k) {
        rope_head(v, f.positions[token], f.rope_dim, f.base, f.freq_factors, f.neox, lane, WARP);
        __syncwarp();
    }
    __half* cache = is_k ? f.k_cache : f.v_cache;
    const int64_t dest = int64_t(f.slots[token]) * n_kv_heads * head_dim +
                         int64_t(in_segment) * head_dim;
    for (int i = lane; i < head_dim; i += WARP) cache[dest + i] = __float2half_rn(v[i]);
}

// finish_head kept out of line: inlined, it made ptxas spill registers in the K-quant products
// of mul_mat_vec_qkv (at launch_bounds' 128), though it runs after them. It reads the
// QkvFinish from shared memory: a reference to a local copy would put that copy on the stack.
__device__ __noinline__ void finish_head_out_of_line(float* v, int head, int token,
                                                    const QkvFinish& finish, int lane) {
    finish_head(v, head, token, finish, lane);
}

// The epilogue of a fused QKV product, once the block has stored its rows [first, last] of
// the segment at column `column` of y for the activation rows [token0, token_end): it counts
// itself on each head its rows touch (head_counters: one per head of the q | k | v row for
// those activation rows, zero before the first launch; the last block of a head sets it back
// to zero), and finishes for those activation rows the heads it counted last (all their rows
// are then stored), a warp per (head, row) on its copy in `scratch` (head_dim floats a warp)
// read from L2 (other blocks wrote the rows; L1 is not coherent), written back to y after.
template <int MAX_ROWS>
__device__ void finish_completed_heads(int first, int last, int per_block, int column,
                                       const QkvFinish& finish, float* y, int y_stride,
                                       int token0, int token_end, int* head_counters,
                                       float* scratch) {
    constexpr int MAX_HEADS = MAX_ROWS / 8 + 1;  // head_dim % 8 == 0
    __shared__ bool completed[MAX_HEADS];
    __shared__ QkvFinish shared_finish;
    const int head_dim = finish.head_dim;
    const int first_head = first / head_dim, touched = last / head_dim - first_head + 1;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    if (tid == 0) shared_finish = finish;
    __threadfence();  // this block's rows are visible device-wide before it is counted
    __syncthreads();
    if (tid < touched) {
        const int head = first_head + tid;  // within the segment
        const int blocks =  // the blocks holding the head's rows
            ((head + 1) * head_dim - 1) / per_block - head * head_dim / per_block + 1;
        int* counter = head_counters + column / head_dim + head;
        completed[tid] = atomicAdd(counter, 1) == blocks - 1;
        if (completed[tid]) atomicExch(counter, 0);  // every block of the head has counted
    }
    __syncthreads();
    __threadfence();  // the other blocks' rows are read after their counts
    const int warp = tid / WARP, lane = tid % WARP;
    const int warps = blockDim.x * blockDim.y / WARP, tokens = token_end - token0;
    float* copy = scratch + warp * head_dim;
    for (int task = warp; task < touched * tokens; task += warps) {
        const int t = task / tokens, token = token0 + task % tokens;
        if (!completed[t]) continue;  // the whole warp skips
        const int head = column / head_dim + first_head + t;  // in the row: q, k, v heads
        float* row = y + int64_t(token) * y_stride + int64_t(head) * head_dim;
        for (int i = lane; i < head_dim; i += WARP) copy[i] = __ldcg(row + i);
        __syncwarp();
        finish_head_out_of_line(copy, head, token, shared_finish, lane);
        __syncwarp();
        for (int i = lane; i < head_dim; i += WARP) row[i] = copy[i];
        __syncwarp();  // the copy is rewritten by the warp's next task
    }
}

// The fused QKV kernels' parameters (matvec.cu documents mul_mat_vec_qkv's; matvec_mma.cu's
// mul_mat_vec_mma_qkv takes the same), and the same names as arguments.
#define QK_QKV_PARAMETERS                                                                    \
    const uint8_t *w_q, int64_t pitch_q, int type_q, int rows_q, const uint8_t *w_k,        \
        int64_t pitch_k, int type_k, int rows_k, const uint8_t *w_v, int64_t pitch_v,       \
        int type_v, int rows_v, const float *x, int x_stride, float *y, int y_stride,       \
        int n_in, int batch, int head_dim, const float *q_bias, const float *k_bias,        \
        const float *v_bias, const float *q_norm, const float *k_norm, float eps,           \
        const int *positions, int rope_dim, double base, const float *freq_factors,         \
        int neox, const int *slots, __half *k_cache, __half *v_cache, int *head_counters
#define QK_QKV_ARGUMENTS                                                                     \
    w_q, pitch_q, type_q, rows_q, w_k, pitch_k, type_k, rows_k, w_v, pitch_v, type_v,       \
        rows_v, x, x_stride, y, y_stride, n_in, batch, head_dim, q_bias, k_bias, v_bias,    \
        q_norm, k_norm, eps, positions, rope_dim, base, freq_factors, neox, slots, k_cache, \
        v_cache, head_counters

// One segment of a fused QKV kernel: blocks [block_first, ...) compute rows of one matrix
// into columns [column, column + rows) of y.
struct QkvSegment {
    const uint8_t* weights;
    int64_t pitch;
    int type_code, rows, column, block_first;
};

// Where a fused QKV kernel's block stands: `block` its index along the three matrices'
// blocks (one after the other, `per_block` rows of one matrix each, at most MAX_ROWS), the
// activation rows [token0, token_end) it computes, and their head counters (`counters`, a
// counter per head of the q | k | v row).
struct QkvBlock {
    int block, per_block, token0, token_end;
    int* counters;
};

// The segment of block `block` (per_block rows of one matrix a block).
__device__ __forceinline__ QkvSegment qkv_segment_of_block(int block, int per_block,
                                                           QK_QKV_PARAMETERS) {
    const int blocks_q = (rows_q + per_block - 1) / per_block;
    const int blocks_k = (rows_k + per_block - 1) / per_block;
    if (block < blocks_q) return {w_q, pitch_q, type_q, rows_q, 0, 0};
    if (block < blocks_q + blocks_k) return {w_k, pitch_k, type_k, rows_k, rows_q, blocks_q};
    return {w_v, pitch_v, type_v, rows_v, rows_q + rows_k, blocks_q + blocks_k};
}

// A fused QKV kernel's epilogue, once the block has stored its rows of `seg`:
// finish_completed_heads, `scratch` holding a head_dim copy a warp (free once the products
// are done).
template <int MAX_ROWS>
__device__ void finish_qkv_block(const QkvBlock& at, const QkvSegment& seg, float* scratch,
                                 QK_QKV_PARAMETERS) {
    const QkvFinish finish{rows_q / head_dim, rows_k / head_dim, head_dim, q_bias, k_bias,
                           v_bias, q_norm, k_norm, eps, positions, rope_dim, base,
                           freq_factors, neox, slots, k_cache, v_cache};
    const int first = (at.block - seg.block_first) * at.per_block;
    finish_completed_heads<MAX_ROWS>(first, min(first + at.per_block, seg.rows) - 1,
                                     at.per_block, seg.column, finish, y, y_stride, at.token0,
                                     at.token_end, at.counters, scratch);
}

// A fused matvec QKV kernel's block: `products(seg)` stores its rows of its segment, then
// finish_qkv_block.
template <int MAX_ROWS, class Products>
__device__ void fused_qkv_block(const QkvBlock& at, float* scratch, Products products,
                                QK_QKV_PARAMETERS) {
    const QkvSegment seg = qkv_segment_of_block(at.block, at.per_block, QK_QKV_ARGUMENTS);
    products(seg);
    finish_qkv_block<MAX_ROWS>(at, seg, scratch, QK_QKV_ARGUMENTS);
}
