// Attention over the paged float16 KV cache (kv_cache.cu's layout), float32 math, GQA (query
// head h reads KV head h / (n_heads / n_kv_heads)), optional sliding window (`window` > 0:
// a query at position p sees keys (p - window, p]; 0: keys [0, p]), keys of the cached prefix
// included: the step's own keys must already be written (kv_write) before these run.
// q rows hold n_heads heads of head_dim floats (head_dim % 8 == 0, <= 256), unscaled: `scale`
// (1 / sqrt(head_dim)) multiplies q first, as forward.py does. out rows: [n_heads * head_dim].
// block_tables: int32 [items][table_stride], entry i = the pool block of positions
// [i * block_size, (i + 1) * block_size).
//
// Decode (one query per sequence; query / output row s belongs to sequence s), flash-decoding
// as llama.cpp's fattn-vec does it, split and combine in one kernel:
//   attention_decode, grid (n_splits, n_kv_heads * ceil(group / MAX_GROUP_HEADS), n_seqs),
//     DECODE_THREADS threads (group = n_heads / n_kv_heads). A block takes up to
//     MAX_GROUP_HEADS q heads of one KV head, so each K/V row is read once for all of them,
//     and split j of the sequence's visible keys [first + j * split_keys, first + (j + 1) *
//     split_keys). It streams its keys through shared memory in tiles (16-byte cp.async
//     copies, the next tile's keys in flight while this tile's values are summed).
//     used = min(n_splits, ceil(visible keys / split_keys)) splits hold keys; the others
//     return at once and write nothing. With one used split the block writes `out` itself;
//     otherwise each used split writes its (max, sum, acc[head_dim]) per head to
//     partial_max / partial_sum / partial_acc [n_seqs][n_heads][n_splits](head_dim), and the
//     last of them to finish (counted in counters[n_seqs][gridDim.y], which must be zero
//     before the first launch; that block sets its counter back to zero) merges the used
//     splits in split order: the result does not depend on which block finished last.
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
constexpr int QUERIES_PER_WARP = 2;
constexpr int PREFILL_QUERIES = ATTN_WARPS * QUERIES_PER_WARP;
// Staged key rows are padded by one 4-byte word: lanes reading rows j at the same feature
// then hit 32 different banks.
constexpr int KEY_TILE_LD = MAX_HEAD_DIM + 2;
constexpr int DECODE_THREADS = ATTN_WARPS * WARP;
constexpr int MAX_GROUP_HEADS = 8;
// A decode tile holds keys * head_dim <= DECODE_TILE_HALVES values of K (and of V), at most
// MAX_TILE_KEYS keys (two per lane in the softmax update), rows padded as `DecodeTile` says.
constexpr int DECODE_TILE_HALVES = 4096;
constexpr int MAX_TILE_KEYS = 2 * WARP;
constexpr int DECODE_TILE_PADDED = DECODE_TILE_HALVES + 8 * DECODE_THREADS;

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

// --- decode ------------------------------------------------------------------------------

__device__ __forceinline__ void copy_async_16(void* shared, const void* global) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global)
                 : "memory");
}

// How a decode block's threads map onto a tile of `keys` keys. Scores: thread t takes key
// t / threads_per_key and every threads_per_key-th 16-byte vector of it from t % threads_per_key
// on; rows are padded by 16 bytes per such thread, so the 8 threads of a 16-byte shared load
// phase hit 8 different 4-bank groups. Copies and values: thread t takes the vector
// t % vectors of keys t / vectors, t / vectors + key_groups, ...
struct DecodeTile {
    int keys, pitch, threads_per_key, vectors, key_groups;
};

__device__ DecodeTile decode_tile(int head_dim) {
    int keys = MAX_TILE_KEYS;
    while (keys * head_dim > DECODE_TILE_HALVES) keys /= 2;
    const int threads_per_key = DECODE_THREADS / keys;
    const int vectors = head_dim / 8;
    return DecodeTile{keys, head_dim + 8 * threads_per_key, threads_per_key, vectors,
                      DECODE_THREADS / vectors};
}

// Start copying the rows of keys [base, base + count) of one cache (K or V) into `tile`.
__device__ void stage_tile(const __half* cache, const PagedHead& head, int base, int count,
                           const DecodeTile& tile_shape, __half* tile) {
    const int vector = threadIdx.x % tile_shape.vectors;
    for (int j = threadIdx.x / tile_shape.vectors;
         j < count && threadIdx.x < tile_shape.key_groups * tile_shape.vectors;
         j += tile_shape.key_groups) {
        copy_async_16(tile + j * tile_shape.pitch + 8 * vector,
                      cache + head.offset(base + j) + 8 * vector);
    }
}

__device__ __forceinline__ void halves_to_floats(const uint4& raw, float* out) {
    const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 pair = __half22float2(pairs[i]);
        out[2 * i] = pair.x;
        out[2 * i + 1] = pair.y;
    }
}

// Scores of the tile's keys for the block's heads into weights[h][j] (-inf past `count`).
__device__ void tile_scores(const float (*q)[MAX_HEAD_DIM], int heads, const __half* k_tile,
                            int count, const DecodeTile& shape,
                            float (*weights)[MAX_TILE_KEYS]) {
    const int key = threadIdx.x / shape.threads_per_key;
    const int part = threadIdx.x % shape.threads_per_key;
    float dot[MAX_GROUP_HEADS] = {};
    for (int c = part; c < shape.vectors; c += shape.threads_per_key) {
        float k[8];
        halves_to_floats(*reinterpret_cast<const uint4*>(k_tile + key * shape.pitch + 8 * c), k);
#pragma unroll
        for (int h = 0; h < MAX_GROUP_HEADS; ++h) {
            if (h < heads) {
                const float4 lo = *reinterpret_cast<const float4*>(&q[h][8 * c]);
                const float4 hi = *reinterpret_cast<const float4*>(&q[h][8 * c + 4]);
                dot[h] += lo.x * k[0] + lo.y * k[1] + lo.z * k[2] + lo.w * k[3] +
                          hi.x * k[4] + hi.y * k[5] + hi.z * k[6] + hi.w * k[7];
            }
        }
    }
#pragma unroll
    for (int h = 0; h < MAX_GROUP_HEADS; ++h) {
        if (h < heads) {  // block-uniform; a key's threads are neighbouring lanes
            for (int offset = 1; offset < shape.threads_per_key; offset *= 2) {
                dot[h] += __shfl_xor_sync(FULL_MASK, dot[h], offset);
            }
            if (part == 0) weights[h][key] = key < count ? dot[h] : -INFINITY;
        }
    }
}

// Warp w folds the tile's scores of heads w, w + ATTN_WARPS, ... into their running max and
// sum (registers of that warp), turns the scores into weights exp(score - max) and leaves the
// factor for the heads' earlier value sums in correction[h]. A tile whose scores are all -inf
// (only a float16 overflow in K makes one) changes nothing.
__device__ void fold_tile_softmax(int heads, int keys, float (*weights)[MAX_TILE_KEYS],
                                  float* correction, float* running_max, float* running_sum) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
#pragma unroll
    for (int r = 0; r < MAX_GROUP_HEADS / ATTN_WARPS; ++r) {
        const int h = warp + ATTN_WARPS * r;
        if (h >= heads) break;  // warp-uniform
        const float first = lane < keys ? weights[h][lane] : -INFINITY;
        const float second = lane + WARP < keys ? weights[h][lane + WARP] : -INFINITY;
        const float tile_max = warp_max(fmaxf(first, second));
        const bool empty = tile_max == -INFINITY;
        const float new_max = fmaxf(running_max[r], tile_max);
        const float first_weight = empty ? 0.0f : expf(first - new_max);
        const float second_weight = empty ? 0.0f : expf(second - new_max);
        if (lane < keys) weights[h][lane] = first_weight;
        if (lane + WARP < keys) weights[h][lane + WARP] = second_weight;
        const float factor = empty ? 1.0f : expf(running_max[r] - new_max);  // 0 at first
        running_sum[r] = running_sum[r] * factor + warp_sum(first_weight + second_weight);
        running_max[r] = new_max;
        if (lane == 0) correction[h] = factor;
    }
}

// acc[h][i] (feature 8 * vector + i) = acc * correction[h] + the weighted values of this
// thread's keys of the tile.
__device__ void fold_tile_values(int heads, const __half* v_tile, int count,
                                 const DecodeTile& shape, const float (*weights)[MAX_TILE_KEYS],
                                 const float* correction, float (*acc)[8]) {
    const int vector = threadIdx.x % shape.vectors, first = threadIdx.x / shape.vectors;
    if (first >= shape.key_groups) return;  // no barrier or shuffle below
#pragma unroll
    for (int h = 0; h < MAX_GROUP_HEADS; ++h) {
        if (h < heads) {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[h][i] *= correction[h];
        }
    }
    for (int j = first; j < count; j += shape.key_groups) {
        float v[8];
        halves_to_floats(*reinterpret_cast<const uint4*>(v_tile + j * shape.pitch + 8 * vector),
                         v);
#pragma unroll
        for (int h = 0; h < MAX_GROUP_HEADS; ++h) {
            if (h < heads) {
                const float w = weights[h][j];
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[h][i] += w * v[i];
            }
        }
    }
}

// The merged result of the used splits for head `head`, feature d, in split order.
__device__ float combine_splits(const float* partial_acc, const float* partial_max,
                                const float* partial_sum, int64_t first, int used, int head_dim,
                                int d) {
    float overall = -INFINITY;
    for (int s = 0; s < used; ++s) overall = fmaxf(overall, __ldcg(partial_max + first + s));
    float sum = 0.0f, acc = 0.0f;
    for (int s = 0; s < used; ++s) {
        const float weight = rescale(__ldcg(partial_max + first + s), overall);
        sum += weight * __ldcg(partial_sum + first + s);
        acc += weight * __ldcg(partial_acc + (first + s) * head_dim + d);
    }
    return acc / sum;
}

extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attention_decode(
    const float* __restrict__ q, int q_stride, const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache, const int* __restrict__ block_tables, int table_stride,
    const int* __restrict__ positions, int block_size, int n_heads, int n_kv_heads, int head_dim,
    float scale, int window, int split_keys, float* __restrict__ partial_acc,
    float* __restrict__ partial_max, float* __restrict__ partial_sum, int* __restrict__ counters,
    float* __restrict__ out, int out_stride) {
    // q (scaled), then the heads' value sums at the end.
    __shared__ __align__(16) float q_scaled[MAX_GROUP_HEADS][MAX_HEAD_DIM];
    __shared__ __align__(16) __half k_tile[DECODE_TILE_PADDED];
    __shared__ __align__(16) __half v_tile[DECODE_TILE_PADDED];
    __shared__ float weights[MAX_GROUP_HEADS][MAX_TILE_KEYS];
    __shared__ float correction[MAX_GROUP_HEADS], head_max[MAX_GROUP_HEADS],
        head_sum[MAX_GROUP_HEADS];
    __shared__ bool last_block;
    const int split = blockIdx.x, seq = blockIdx.z, n_splits = gridDim.x;
    const int position = positions[seq];
    const int first_key = first_visible_key(position, window);
    const int used = min(n_splits, (position - first_key + split_keys) / split_keys);
    if (split >= used) return;  // the whole block leaves: nothing to write
    const int low = first_key + split * split_keys;
    const int high = min(position, low + split_keys - 1);

    const int group = n_heads / n_kv_heads;
    const int chunks = (group + MAX_GROUP_HEADS - 1) / MAX_GROUP_HEADS;
    const int kv_head = blockIdx.y / chunks, chunk = blockIdx.y % chunks;
    const int first_head = kv_head * group + chunk * MAX_GROUP_HEADS;
    const int heads = min(MAX_GROUP_HEADS, group - chunk * MAX_GROUP_HEADS);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const DecodeTile shape = decode_tile(head_dim);
    const PagedHead kv{k_cache, v_cache, block_tables + int64_t(seq) * table_stride, block_size,
                       n_kv_heads * head_dim, kv_head * head_dim};

    stage_tile(k_cache, kv, low, min(shape.keys, high - low + 1), shape, k_tile);
    commit_copies();
    stage_tile(v_cache, kv, low, min(shape.keys, high - low + 1), shape, v_tile);
    commit_copies();
    for (int e = threadIdx.x; e < heads * head_dim; e += DECODE_THREADS) {
        const int h = e / head_dim, d = e % head_dim;
        q_scaled[h][d] = q[int64_t(seq) * q_stride + (first_head + h) * head_dim + d] * scale;
    }
    float running_max[MAX_GROUP_HEADS / ATTN_WARPS], running_sum[MAX_GROUP_HEADS / ATTN_WARPS];
#pragma unroll
    for (int r = 0; r < MAX_GROUP_HEADS / ATTN_WARPS; ++r) {
        running_max[r] = -INFINITY;
        running_sum[r] = 0.0f;
    }
    float acc[MAX_GROUP_HEADS][8] = {};
    for (int base = low; base <= high; base += shape.keys) {
        const int count = min(shape.keys, high - base + 1);
        const int next = min(shape.keys, high - base - shape.keys + 1);  // <= 0: none
        wait_copies<1>();  // this tile's keys (its values may still be in flight)
        __syncthreads();   // every thread's copies; q staged; the last tile's weights used
        tile_scores(q_scaled, heads, k_tile, count, shape, weights);
        __syncthreads();  // the key tile is free
        stage_tile(k_cache, kv, base + shape.keys, next, shape, k_tile);
        commit_copies();
        fold_tile_softmax(heads, shape.keys, weights, correction, running_max, running_sum);
        wait_copies<1>();  // this tile's values
        __syncthreads();
        fold_tile_values(heads, v_tile, count, shape, weights, correction, acc);
        __syncthreads();  // the value tile and the weights are free
        stage_tile(v_cache, kv, base + shape.keys, next, shape, v_tile);
        commit_copies();
    }
    wait_copies<0>();  // only empty groups remain; nothing may land in the tiles below
#pragma unroll
    for (int r = 0; r < MAX_GROUP_HEADS / ATTN_WARPS; ++r) {
        const int h = warp + ATTN_WARPS * r;
        if (h < heads && lane == 0) {
            head_max[h] = running_max[r];
            head_sum[h] = running_sum[r];
        }
    }
    // Sum the key groups' value sums of each head, in key-group order, into q_scaled[h].
    float* group_sums = reinterpret_cast<float*>(k_tile);  // [key_groups][head_dim]
    const int vector = threadIdx.x % shape.vectors, key_group = threadIdx.x / shape.vectors;
#pragma unroll
    for (int h = 0; h < MAX_GROUP_HEADS; ++h) {
        if (h >= heads) break;  // block-uniform
        if (key_group < shape.key_groups) {
            float4* to = reinterpret_cast<float4*>(group_sums + key_group * head_dim + 8 * vector);
            to[0] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
            to[1] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
        }
        __syncthreads();
        for (int d = threadIdx.x; d < head_dim; d += DECODE_THREADS) {
            float sum = 0.0f;
            for (int g = 0; g < shape.key_groups; ++g) sum += group_sums[g * head_dim + d];
            q_scaled[h][d] = sum;
        }
        __syncthreads();
    }

    const int64_t first_partial = (int64_t(seq) * n_heads + first_head) * n_splits;
    if (used == 1) {
        for (int e = threadIdx.x; e < heads * head_dim; e += DECODE_THREADS) {
            const int h = e / head_dim, d = e % head_dim;
            out[int64_t(seq) * out_stride + (first_head + h) * head_dim + d] =
                q_scaled[h][d] / head_sum[h];
        }
        return;
    }
    for (int e = threadIdx.x; e < heads * head_dim; e += DECODE_THREADS) {
        const int h = e / head_dim, d = e % head_dim;
        partial_acc[(first_partial + h * n_splits + split) * head_dim + d] = q_scaled[h][d];
    }
    if (threadIdx.x < heads) {
        partial_max[first_partial + threadIdx.x * n_splits + split] = head_max[threadIdx.x];
        partial_sum[first_partial + threadIdx.x * n_splits + split] = head_sum[threadIdx.x];
    }
    __threadfence();  // this block's partials are visible device-wide before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        int* counter = counters + int64_t(seq) * gridDim.y + blockIdx.y;
        last_block = atomicAdd(counter, 1) == used - 1;
        if (last_block) atomicExch(counter, 0);  // every used split has counted
    }
    __syncthreads();
    if (!last_block) return;
    __threadfence();  // the other splits' partials are read after their counts (L2: __ldcg)
    for (int e = threadIdx.x; e < heads * head_dim; e += DECODE_THREADS) {
        const int h = e / head_dim, d = e % head_dim;
        out[int64_t(seq) * out_stride + (first_head + h) * head_dim + d] =
            combine_splits(partial_acc, partial_max, partial_sum, first_partial + h * n_splits,
                           used, head_dim, d);
    }
}

// --- prefill -----------------------------------------------------------------------------

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
