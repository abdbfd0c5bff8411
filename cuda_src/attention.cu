// Attention over the paged float16 KV cache (kv_cache.cu's layout), float32 math, GQA (query
// head h reads KV head h / (n_heads / n_kv_heads)), optional sliding window (`window` > 0:
// a query at position p sees keys (p - window, p]; 0: keys [0, p]), keys of the cached prefix
// included: the step's own keys must already be written (kv_write) before these run.
// q rows hold n_heads heads of head_dim floats (head_dim % 8 == 0, <= 256), unscaled: `scale`
// (1 / sqrt(head_dim)) multiplies q first, as forward.py does. out rows: [n_heads * head_dim].
// block_tables: int32 [items][table_stride], entry i = the pool block of positions
// [i * block_size, (i + 1) * block_size).
//
// Decode (one query per sequence; query / output row s belongs to sequence s), flash-decoding:
//   attention_decode_split, grid (n_splits, n_heads, n_seqs), ATTN_WARPS * 32 threads: split j
//     covers the sequence's visible keys [first + j * split_keys, first + (j + 1) * split_keys)
//     and writes its (max, sum, acc[head_dim]) to partial_max / partial_sum / partial_acc
//     [n_seqs][n_heads][n_splits](head_dim); splits past the keys write (-inf, 0, 0).
//   attention_decode_combine, grid (n_heads, n_seqs), 256 threads: merges the splits.
// Prefill (items of several tokens at positions item_start + i, query rows item_first_row + i):
//   attention_prefill, grid (ceil(max item_tokens / PREFILL_QUERIES), n_heads, n_items),
//   ATTN_WARPS * 32 threads: a block takes PREFILL_QUERIES consecutive queries of one item and
//   head, causal. It walks the keys its queries see in tiles of 32, staged in shared memory
//   once for all of them; each warp folds a tile into the online softmax of each of its
//   queries (one key per lane for the scores, one feature per lane for the values).
#include <cuda_fp16.h>

#include "device_common.cuh"

constexpr int MAX_HEAD_DIM = 256;
constexpr int DIMS_PER_LANE = MAX_HEAD_DIM / WARP;
constexpr int ATTN_WARPS = 4;
constexpr int COMBINE_THREADS = 256;
constexpr int QUERIES_PER_WARP = 2;
constexpr int PREFILL_QUERIES = ATTN_WARPS * QUERIES_PER_WARP;
// Staged key rows are padded by one 4-byte word: lanes reading rows j at the same feature
// then hit 32 different banks.
constexpr int KEY_TILE_LD = MAX_HEAD_DIM + 2;

// One sequence's keys and values of one KV head in one layer's cache.
struct PagedHead {
    const __half* k;
    const __half* v;
    const int* table;
    int block_size;
    int kv_dim;
    int head_offset;

    __device__ int64_t offset(int position) const {
        const int64_t slot =
            int64_t(table[position / block_size]) * block_size + position % block_size;
        return slot * kv_dim + head_offset;
    }
};

// A lane's share of a running softmax: the warp-wide max and sum of exp(score - max), and the
// weighted value sums of features lane, lane + 32, ...
struct OnlineSoftmax {
    float max = -INFINITY;
    float sum = 0.0f;
    float acc[DIMS_PER_LANE] = {};
};

__device__ float key_score(const float* q, const __half* key, int head_dim) {
    float score = 0.0f;
    for (int d = 0; d < head_dim; d += 8) {
        const uint4 raw = *reinterpret_cast<const uint4*>(key + d);
        const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 k = __half22float2(pairs[i]);
            score += q[d + 2 * i] * k.x + q[d + 2 * i + 1] * k.y;
        }
    }
    return score;
}

// Fold a chunk of up to 32 keys into the warp's softmax state: lane j holds key j's score
// (-inf where the query must not see it), value_row(j) gives key j's value row (every lane
// calls it with the same j). A chunk with nothing visible changes nothing.
template <class ValueRow>
__device__ void fold_chunk(OnlineSoftmax& state, float score, int keys_here, int head_dim,
                           ValueRow value_row) {
    const int lane = threadIdx.x % WARP;
    const float chunk_max = warp_max(score);
    if (chunk_max == -INFINITY) return;
    const float new_max = fmaxf(state.max, chunk_max);
    const float correction = expf(state.max - new_max);  // 0 while the state is empty
    const float weight = expf(score - new_max);          // 0 for an invisible key
    state.sum = state.sum * correction + warp_sum(weight);
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) state.acc[i] *= correction;
    for (int j = 0; j < keys_here; ++j) {
        const float w = __shfl_sync(FULL_MASK, weight, j);
        const __half* value = value_row(j);
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) {
            const int d = lane + WARP * i;
            if (d < head_dim) state.acc[i] += w * __half2float(value[d]);
        }
    }
    state.max = new_max;
}

// Fold keys first, first + 32, ... (chunks of 32 starting every `chunk_stride` keys) up to
// `last`, read straight from the paged cache; q (scaled) is in shared memory.
__device__ void attend_keys(const float* q, const PagedHead& head, int head_dim, int first,
                            int last, int chunk_stride, OnlineSoftmax& state) {
    const int lane = threadIdx.x % WARP;
    for (int base = first; base <= last; base += chunk_stride) {
        const int key = base + lane;
        const bool visible = key <= last;
        const int64_t offset = visible ? head.offset(key) : 0;
        const float score = visible ? key_score(q, head.k + offset, head_dim) : -INFINITY;
        fold_chunk(state, score, min(WARP, last - base + 1), head_dim,
                   [&](int j) { return head.v + __shfl_sync(FULL_MASK, offset, j); });
    }
}

// exp(m - overall) as the weight of a partial result with max m; 0 for an empty one.
__device__ float rescale(float m, float overall) {
    return m == -INFINITY ? 0.0f : expf(m - overall);
}

__device__ int first_visible_key(int position, int window) {
    return window > 0 ? max(0, position - window + 1) : 0;
}

__device__ PagedHead paged_head(const __half* k_cache, const __half* v_cache, const int* table,
                                int block_size, int n_heads, int n_kv_heads, int head_dim,
                                int head) {
    return PagedHead{k_cache, v_cache, table, block_size, n_kv_heads * head_dim,
                     (head / (n_heads / n_kv_heads)) * head_dim};
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP) attention_decode_split(
    const float* __restrict__ q, int q_stride, const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache, const int* __restrict__ block_tables, int table_stride,
    const int* __restrict__ positions, int block_size, int n_heads, int n_kv_heads, int head_dim,
    float scale, int window, int split_keys, float* __restrict__ partial_acc,
    float* __restrict__ partial_max, float* __restrict__ partial_sum) {
    __shared__ float q_scaled[MAX_HEAD_DIM];
    __shared__ float warp_max_of[ATTN_WARPS], warp_sum_of[ATTN_WARPS];
    __shared__ float warp_acc_of[ATTN_WARPS][MAX_HEAD_DIM];
    const int split = blockIdx.x, head = blockIdx.y, seq = blockIdx.z;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int position = positions[seq];
    const int low = first_visible_key(position, window) + split * split_keys;
    const int high = min(position, low + split_keys - 1);

    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        q_scaled[d] = q[int64_t(seq) * q_stride + head * head_dim + d] * scale;
    }
    __syncthreads();
    const PagedHead kv = paged_head(k_cache, v_cache, block_tables + int64_t(seq) * table_stride,
                                    block_size, n_heads, n_kv_heads, head_dim, head);
    OnlineSoftmax state;
    attend_keys(q_scaled, kv, head_dim, low + warp * WARP, high, ATTN_WARPS * WARP, state);
    if (lane == 0) {
        warp_max_of[warp] = state.max;
        warp_sum_of[warp] = state.sum;
    }
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        if (lane + WARP * i < head_dim) warp_acc_of[warp][lane + WARP * i] = state.acc[i];
    }
    __syncthreads();

    float overall = -INFINITY;
    for (int w = 0; w < ATTN_WARPS; ++w) overall = fmaxf(overall, warp_max_of[w]);
    const int64_t index = (int64_t(seq) * n_heads + head) * gridDim.x + split;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) {
            acc += rescale(warp_max_of[w], overall) * warp_acc_of[w][d];
        }
        partial_acc[index * head_dim + d] = acc;
    }
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) {
            sum += rescale(warp_max_of[w], overall) * warp_sum_of[w];
        }
        partial_max[index] = overall;
        partial_sum[index] = sum;
    }
}

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) attention_decode_combine(
    const float* __restrict__ partial_acc, const float* __restrict__ partial_max,
    const float* __restrict__ partial_sum, int n_splits, int n_heads, int head_dim,
    float* __restrict__ out, int out_stride) {
    const int head = blockIdx.x, seq = blockIdx.y;
    const int64_t first = (int64_t(seq) * n_heads + head) * n_splits;
    float overall = -INFINITY;
    for (int s = 0; s < n_splits; ++s) overall = fmaxf(overall, partial_max[first + s]);
    float sum = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
        sum += rescale(partial_max[first + s], overall) * partial_sum[first + s];
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < n_splits; ++s) {
            const float weight = rescale(partial_max[first + s], overall);
            acc += weight * partial_acc[(first + s) * head_dim + d];
        }
        out[int64_t(seq) * out_stride + head * head_dim + d] = acc / sum;
    }
}

// q . k for a key row staged in shared memory (KEY_TILE_LD layout), q scaled in shared memory.
__device__ float staged_key_score(const float* q, const __half* key, int head_dim) {
    const __half2* pairs = reinterpret_cast<const __half2*>(key);
    float score = 0.0f;
    for (int d = 0; d < head_dim; d += 2) {
        const float2 k = __half22float2(pairs[d / 2]);
        score += q[d] * k.x + q[d + 1] * k.y;
    }
    return score;
}

// Copy keys [base, base + count) of the paged head into the tiles, 16 bytes at a time.
__device__ void stage_keys(const PagedHead& head, int base, int count, int head_dim,
                           __half (*k_tile)[KEY_TILE_LD], __half (*v_tile)[MAX_HEAD_DIM]) {
    const int vectors_per_row = head_dim / 8;
    for (int e = threadIdx.x; e < count * vectors_per_row; e += blockDim.x) {
        const int j = e / vectors_per_row, d = 8 * (e % vectors_per_row);
        const int64_t offset = head.offset(base + j) + d;
        const uint4 k = *reinterpret_cast<const uint4*>(head.k + offset);
        // Padded rows are only 4-byte aligned: store the vector as words.
        uint32_t* k_row = reinterpret_cast<uint32_t*>(&k_tile[j][d]);
        k_row[0] = k.x;
        k_row[1] = k.y;
        k_row[2] = k.z;
        k_row[3] = k.w;
        *reinterpret_cast<uint4*>(&v_tile[j][d]) = *reinterpret_cast<const uint4*>(head.v + offset);
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP) attention_prefill(
    const float* __restrict__ q, int q_stride, const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache, const int* __restrict__ block_tables, int table_stride,
    const int* __restrict__ item_first_row, const int* __restrict__ item_tokens,
    const int* __restrict__ item_start, int block_size, int n_heads, int n_kv_heads,
    int head_dim, float scale, int window, float* __restrict__ out, int out_stride) {
    __shared__ float q_scaled[PREFILL_QUERIES][MAX_HEAD_DIM];
    __shared__ __align__(16) __half k_tile[WARP][KEY_TILE_LD];
    __shared__ __align__(16) __half v_tile[WARP][MAX_HEAD_DIM];
    const int head = blockIdx.y, item = blockIdx.z;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int first_query = blockIdx.x * PREFILL_QUERIES;
    const int n_queries = min(PREFILL_QUERIES, item_tokens[item] - first_query);
    if (n_queries <= 0) return;  // the whole block leaves
    const int64_t first_row = item_first_row[item] + first_query;
    const int first_position = item_start[item] + first_query;

    for (int e = threadIdx.x; e < n_queries * head_dim; e += blockDim.x) {
        const int i = e / head_dim, d = e % head_dim;
        q_scaled[i][d] = q[(first_row + i) * q_stride + head * head_dim + d] * scale;
    }
    const PagedHead kv = paged_head(k_cache, v_cache, block_tables + int64_t(item) * table_stride,
                                    block_size, n_heads, n_kv_heads, head_dim, head);
    OnlineSoftmax state[QUERIES_PER_WARP];
    const int last_key = first_position + n_queries - 1;
    for (int base = first_visible_key(first_position, window); base <= last_key; base += WARP) {
        const int keys_here = min(WARP, last_key - base + 1);
        __syncthreads();  // the previous tile is consumed (and, the first time, q is staged)
        stage_keys(kv, base, keys_here, head_dim, k_tile, v_tile);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < QUERIES_PER_WARP; ++r) {
            const int i = warp * QUERIES_PER_WARP + r;
            if (i >= n_queries) break;  // warp-uniform
            const int position = first_position + i, key = base + lane;
            const bool visible = lane < keys_here && key <= position &&
                                 key >= first_visible_key(position, window);
            const float score =
                visible ? staged_key_score(q_scaled[i], k_tile[lane], head_dim) : -INFINITY;
            fold_chunk(state[r], score, keys_here, head_dim, [&](int j) { return v_tile[j]; });
        }
    }
#pragma unroll
    for (int r = 0; r < QUERIES_PER_WARP; ++r) {
        const int i = warp * QUERIES_PER_WARP + r;
        if (i >= n_queries) break;
#pragma unroll
        for (int k = 0; k < DIMS_PER_LANE; ++k) {
            const int d = lane + WARP * k;
            if (d < head_dim) {
                out[(first_row + i) * out_stride + head * head_dim + d] =
                    state[r].acc[k] / state[r].sum;
            }
        }
    }
}
