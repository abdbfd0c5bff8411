// Prefill matrix x activations on tensor cores: y[t][r] = sum_i W[r][i] * x[t][i] for many
// tokens t (mma.sync m16n8k16, float16 inputs, float32 accumulation; sm_80+).
//
// Numerics (entry points mul_mat_tiles_f16x2_<type>): each activation is split into float16
// parts, x = (hi + lo) 2^e with hi = f16(x 2^-e) and lo = f16(x 2^-e - hi) (about 22 bits of
// x), e a power-of-two exponent per token and stage (32 elements) that keeps the parts in
// float16's range for any float and is 0 for the usual magnitudes (activation_split.cuh), and
// both parts are multiplied by the weights' levels; each stage's float32 sums are multiplied
// by 2^e (exact) before they join the token's sums:
// - quantized types (tile_levels.cuh): the integer levels are exact in float16, so per scale
//   group (32 elements, Q6_K 16) the tensor cores sum levels x (hi + lo) in float32, and the
//   block's scale and offset are applied to the sums: y += scale * (2^e sum(level * x)) +
//   offset * sum(x). Two MMAs per product; sum(x) (the offset types', 32-element groups) is
//   each token's float32 sum of the stage, taken once a block by the threads that split it.
// - F16 weights: exact in float16, W x hi + W x lo, summed a stage, then 2^e times that.
// - F32 / BF16 weights: split as the activations (without a scale: |w| < 65,520),
//   W_hi x_hi + W_hi x_lo + W_lo x_hi, summed a stage, then 2^e times that.
// One float16 rounding of the activations moves logits past the 0.05 allowed (the emulated
// tiny qwen2: 0.054 off the CPU; with the split 0.024).
//
// Entry points, per block type (<type> as in matvec.cu; <act>: silu, gelu_tanh):
//   mul_mat_tiles_f16x2_<type>(weights, int64 row_pitch, x, int x_stride, y, int y_stride,
//                              int rows, int n_in, int n_tokens)
//       prefill: blocks of 64 rows x 64 tokens, 4 warps of 32 x 32 (tile_shape PrefillTile).
//   mul_mat_decode_tiles_f16x2_<type>(same arguments, float* partials, int* counters)
//       decode rows: blocks of 32 rows x 8 tokens, 2 warps of 16 x 8 (DecodeTile), so a lone
//       row pays for 8 tokens of tensor-core work, not 64; grid.z splits K (see
//       mul_mat_decode_tiles: partials n_tokens x gridDim.y * 32 floats a split, counters
//       one int a tile, zero-filled once and left zero).
//   mul_mat_decode_tiles_gate_up_<act>_f16x2_<type>(gate, up, int64 row_pitch, x, x_stride,
//                                                   y, y_stride, int ffn_rows, n_in, n_tokens,
//                                                   partials, counters)
//       y[t][f] = act(gate[f] . x[t]) * (up[f] . x[t]): 16 gate and the same 16 up rows a
//       block, bit for bit the decode tiles of gate and of up (launched with their K-split)
//       then activation.cu's gated_<act>.
//   mul_mat_decode_tiles_qkv_f16x2(matvec.cu's mul_mat_vec_qkv arguments, int splits_q,
//                                  int splits_k, int splits_v, partials, counters)
//       q, k and v (a block type each) into one qkv row and their heads finished, as
//       mul_mat_vec_qkv: bit for bit mul_mat_decode_tiles_f16x2_<type> of each matrix (its
//       K-split given: splits_<m> of the grid's gridDim.z, the largest) then qkv_finish.
//       Grid y: the row tiles of q, then k, then v; each segment's split partials after the
//       previous segment's (cuda_plan.decode_tiles_qkv_partials); head_counters: one per
//       head of the qkv row per token tile.
// Each computes every y value from its own weight row and token alone, in the same order
// whatever n_tokens is: a token's results do not depend on the batch (each entry point on
// its own; the prefill and decode tiles differ).
//
// Layouts as in matvec.cu: weights at row_pitch bytes per row (16-byte aligned rows), x
// [n_tokens][x_stride] float32 with 16-byte aligned rows (x_stride % 4 == 0), n_in % 32 == 0,
// y [n_tokens][y_stride] float32. Grid: (ceil(n_tokens / tile tokens), ceil(rows / tile
// rows)): token tiles fastest, so the blocks sharing a weight tile run together and read it
// from DRAM once.
//
// The tiles' pipeline and block math: tile_pipeline.cuh.
#include "tile_pipeline.cuh"

// Decode tiles: 2 warps, blocks capped at 128 registers a thread like the prefill tiles.
#define DECODE_TILE_BLOCKS_PER_SM 8

using DecodeTile = tile_shape<32, 8, 16, 8>;

// The decode tiles (DecodeTile: 32 rows x 8 tokens, 2 warps), the same stages as
// mul_mat_tiles with another pipeline. A stage has little MMA work here, so the weights must
// be fetched far ahead: they alone go through cp.async, one group a chunk, DECODE_BUFFERS - 1
// chunks in flight (mul_mat_tiles's shared group sequence forces each chunk in two stages
// after it starts). The activations (one piece a thread a stage) are plain loads issued a
// stage ahead, split and stored at the top of their stage; tokens past n_tokens are zeros.
// The scale table of a chunk is decoded once it is in, at its first stage. The offset types'
// sums of x are taken once a stage by the threads that split it (not by MMAs in every warp).
//
// K-split: blockIdx.z = split of the job's splits (DecodeSplits; gridDim.z for one matrix)
// takes chunks [split C / splits, (split + 1) C / splits) of the row's C chunks (splits chosen
// from the matrix alone: cuda_plan decode_tiles_splits). With one split a block has its
// tile's sums; with more each stores its sums in the job's partials ([split][token][tile
// row], n_tokens x tiles * 32 a split), is counted on its tile's counter (`counters`, [token
// tile + row tile * gridDim.x], zero between launches), and the last of the tile's splits
// adds the splits' sums in split order and zeroes the counter. The job (DecodeMatrix,
// DecodeGateUp, DecodeQkvSegment) stores the tile's sums.
constexpr int DECODE_BUFFERS = 3;

// A decode tiles block's shared memory for block type T: a struct, so that one kernel can
// hold several types' in a union (mul_mat_decode_tiles_qkv) and use the largest only.
template <class T>
struct DecodeTileShared {
    using C = tile_chunk<T>;
    static constexpr int CHUNK_BYTES = DecodeTile::ROWS * C::ROW_STRIDE;
    __align__(16) uint8_t weight_chunks[DECODE_BUFFERS * CHUNK_BYTES + PIECE];
    __align__(16) uint4 x_stages[2][DecodeTile::TOKENS * X_PIECES];
    float2 scale_table[C::SCALE_TABLE ? DecodeTile::ROWS * C::TABLE_GROUPS : 1];
    __align__(8) float x_factors[2][DecodeTile::TOKENS];  // a stage's 2^e a token
    __align__(8) float x_sums[2][DecodeTile::TOKENS];     // a stage's x summed a token
    float tile_sums[DecodeTile::TOKENS][DecodeTile::ROWS];
    bool last_split;
};

// How a decode tiles block splits K: `count` splits (this block blockIdx.z of them), the
// splits' sums at `partials` ([split][token][`rows`], the block's tile at row `tile` * 32).
struct DecodeSplits {
    int count;
    float* partials;
    int rows, tile;
};

// One matrix's launch: gridDim.z splits, partials over every row tile of the grid.
__device__ DecodeSplits grid_splits(float* partials) {
    return DecodeSplits{int(gridDim.z), partials, int(gridDim.y) * DecodeTile::ROWS,
                        int(blockIdx.y)};
}

// What a decode tiles launch computes, as several jobs share the kernel: which weight row is
// the block's tile row r (`row(r)`), how K splits (`splits(partials)`), and what becomes of
// the tile's sums (`store(sums, token0, n_tokens)`, sums[t][r] the tile's token t and row r,
// every thread of the block taking part).
// One matrix: tile rows are matrix rows, y[t][row] their sums.
struct DecodeMatrix {
    const uint8_t* weights;
    int64_t row_pitch;
    int rows;
    float* y;
    int y_stride;

    __device__ int first_row() const { return blockIdx.y * DecodeTile::ROWS; }
    __device__ WeightRow row(int r) const {
        return WeightRow{weights + (first_row() + r) * row_pitch, first_row() + r < rows};
    }
    __device__ DecodeSplits splits(float* partials) const { return grid_splits(partials); }
    __device__ void store(const float (&sums)[DecodeTile::TOKENS][DecodeTile::ROWS], int token0,
                          int n_tokens) const {
        for (int e = threadIdx.x; e < DecodeTile::ROWS * DecodeTile::TOKENS; e += blockDim.x) {
            const int r = e % DecodeTile::ROWS, t = e / DecodeTile::ROWS;
            if (first_row() + r < rows && token0 + t < n_tokens) {
                y[int64_t(token0 + t) * y_stride + first_row() + r] = sums[t][r];
            }
        }
    }
};

// Gate and up with the activation: tile rows 0..15 are gate rows f0.., rows 16..31 the same
// up rows (warp 0 and warp 1), y[t][f] = act(gate . x) * (up . x) as activation.cu's gated_<act>.
template <class Op>
struct DecodeGateUp : GateUpRows<DecodeTile::ROWS / 2> {
    static constexpr int HALF = DecodeTile::ROWS / 2;
    __device__ DecodeSplits splits(float* partials) const { return grid_splits(partials); }
    __device__ void store(const float (&sums)[DecodeTile::TOKENS][DecodeTile::ROWS], int token0,
                          int n_tokens) const {
        for (int e = threadIdx.x; e < HALF * DecodeTile::TOKENS; e += blockDim.x) {
            const int r = e % HALF, t = e / HALF;
            if (first_row() + r < ffn_rows && token0 + t < n_tokens) {
                y[int64_t(token0 + t) * y_stride + first_row() + r] =
                    Op::apply(sums[t][r]) * sums[t][HALF + r];
            }
        }
    }
};

// The tile's sums from its splits' partials, added in split order, by the tile's last
// block; tokens past n_tokens left out.
__device__ void combine_decode_splits(const DecodeSplits& splits, int n_tokens, int token0,
                                      float (&sums)[DecodeTile::TOKENS][DecodeTile::ROWS]) {
    const int64_t split_floats = int64_t(n_tokens) * splits.rows;
    for (int e = threadIdx.x; e < DecodeTile::ROWS * DecodeTile::TOKENS; e += blockDim.x) {
        const int r = e % DecodeTile::ROWS, t = e / DecodeTile::ROWS;
        if (token0 + t >= n_tokens) continue;
        const float* part = splits.partials + int64_t(token0 + t) * splits.rows +
                            splits.tile * DecodeTile::ROWS + r;
        float sum = __ldcg(part);  // written by other blocks: L2, not a stale L1 line
        for (int split = 1; split < splits.count; ++split) {
            sum += __ldcg(part + split * split_floats);
        }
        sums[t][r] = sum;
    }
}

// The block's tile of the job (see above); true when this block stored it (its only or last
// split), false for the other splits.
template <class T, class Job>
__device__ bool mul_mat_decode_tiles(const Job& job, DecodeTileShared<T>& shared,
                                     const float* __restrict__ x, int x_stride, int n_in,
                                     int n_tokens, float* __restrict__ partials,
                                     int* __restrict__ counters) {
    using Shape = DecodeTile;
    using C = tile_chunk<T>;
    static_assert(stage_passes<Shape>::PASSES == 1, "a thread holds one piece of a stage");
    constexpr int CHUNK_BYTES = DecodeTileShared<T>::CHUNK_BYTES;
    uint8_t* const weight_chunks = shared.weight_chunks;
    auto& x_stages = shared.x_stages;
    float2* const scale_table = shared.scale_table;
    auto& x_factors = shared.x_factors;
    auto& x_sums = shared.x_sums;
    auto& tile_sums = shared.tile_sums;
    const DecodeSplits splits = job.splits(partials);
    const int split_count = splits.count;

    const int token0 = blockIdx.x * Shape::TOKENS;
    const int warp = threadIdx.x / WARP;
    const int warp_rows = Shape::warp_rows(warp), warp_tokens = Shape::warp_tokens(warp);
    const int n_stages = n_in / GROUP, n_chunks = (n_stages + C::STAGES - 1) / C::STAGES;
    const int split = blockIdx.z;
    const int first_chunk = split * n_chunks / split_count;
    const int end_chunk = (split + 1) * n_chunks / split_count;
    const int first_stage = first_chunk * C::STAGES;
    const int end_stage = min(end_chunk * C::STAGES, n_stages);
    // This thread's piece of each stage: 4 floats of one token.
    const int own_token = threadIdx.x / X_PIECES;
    const bool in_range = token0 + own_token < n_tokens;
    const float4* own_x = reinterpret_cast<const float4*>(
        x + int64_t(token0 + own_token) * x_stride + 4 * (threadIdx.x % X_PIECES));
    uint4* const own_piece = x_stages[0] + own_piece_index();  // in stage buffer 0
    auto row_at = [&](int r) { return job.row(r); };

    float acc[Shape::I][Shape::J][4] = {};
    for (int chunk = first_chunk; chunk < first_chunk + DECODE_BUFFERS - 1; ++chunk) {
        if (chunk < end_chunk) {
            copy_weight_rows<T, Shape>(weight_chunks + chunk % DECODE_BUFFERS * CHUNK_BYTES,
                                       row_at, n_in, chunk);
        }
        commit_copies();
    }
    float4 next = in_range ? __ldg(own_x + first_stage * (GROUP / 4))
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int chunk = first_chunk; chunk < end_chunk; ++chunk) {
        const uint8_t* chunk_bytes = weight_chunks + chunk % DECODE_BUFFERS * CHUNK_BYTES;
        wait_copies<DECODE_BUFFERS - 2>();  // this thread's copies of `chunk` are in
        __syncthreads();  // everyone's are; every warp is done with chunk - 1's buffer
        const int ahead = chunk + DECODE_BUFFERS - 1;  // into chunk - 1's buffer
        if (ahead < end_chunk) {
            copy_weight_rows<T, Shape>(weight_chunks + ahead % DECODE_BUFFERS * CHUNK_BYTES,
                                       row_at, n_in, ahead);
        }
        commit_copies();  // one group a chunk, empty past the last
        if constexpr (C::SCALE_TABLE) decode_scale_table<T, Shape>(scale_table, chunk_bytes);
        // The chunk's stages four at a time: a K-quant's eight unrolled whole (each stage's
        // element, block and group constants) spilled Q6_K's registers once each stage's
        // split found its token's exponent.
#pragma unroll 4
        for (int in_chunk = 0; in_chunk < C::STAGES; ++in_chunk) {
            const int s = chunk * C::STAGES + in_chunk;
            if (s >= end_stage) break;  // a row's last chunk of 32-element blocks may be short
            const int buffer = s % 2;
            own_piece[buffer * Shape::TOKENS * X_PIECES] = split_token_piece(
                make_uint4(__float_as_uint(next.x), __float_as_uint(next.y),
                           __float_as_uint(next.z), __float_as_uint(next.w)),
                &x_factors[buffer][own_token]);
            if constexpr (has_offsets<tile_levels<T>>()) {
                const float sum = stage_token_sum(next.x, next.y, next.z, next.w);
                if (threadIdx.x % X_PIECES == 0) x_sums[buffer][own_token] = sum;
            }
            __syncthreads();  // stage s split (and a new chunk's table decoded) for every warp
            if (s + 1 < end_stage && in_range) next = __ldg(own_x + (s + 1) * (GROUP / 4));
            const int element = in_chunk * GROUP;  // within the chunk
            const uint8_t* block = chunk_bytes + warp_rows * C::ROW_STRIDE +
                                   C::window_offset(chunk) +
                                   element / T::BLOCK_ELEMENTS * T::BLOCK_BYTES;
            multiply_stage<T, Shape::I, Shape::J>(
                block, C::stage_element(chunk, element),
                scale_table + (C::SCALE_TABLE ? warp_rows * C::TABLE_GROUPS : 0), in_chunk,
                x_stages[buffer], warp_tokens, acc, x_factors[buffer], x_sums[buffer]);
        }
    }
    if (split_count == 1) {
        store_tile<Shape>(acc, &tile_sums[0][0], Shape::ROWS, warp_rows, warp_tokens,
                          Shape::ROWS, Shape::TOKENS);
    } else {
        // Partials a token: every tile row of the job's (rows past the matrix included).
        const int rows = splits.rows;
        store_tile<Shape>(acc, splits.partials + int64_t(split) * n_tokens * rows, rows,
                          splits.tile * Shape::ROWS + warp_rows, token0 + warp_tokens, rows,
                          n_tokens);
        __threadfence();  // this split's sums are visible device-wide before it is counted
        __syncthreads();
        if (threadIdx.x == 0) {
            int* counter = counters + blockIdx.x + blockIdx.y * gridDim.x;
            shared.last_split = atomicAdd(counter, 1) == splits.count - 1;
            if (shared.last_split) atomicExch(counter, 0);  // every split has counted
        }
        __syncthreads();
        if (!shared.last_split) return false;
        __threadfence();  // the other splits' sums are read after their counts
        combine_decode_splits(splits, n_tokens, token0, tile_sums);
    }
    __syncthreads();  // the tile's sums are in for every thread
    job.store(tile_sums, token0, n_tokens);
    return true;
}

// A matrix's rows rounded up to whole decode tiles (its partials' rows a split).
__device__ __forceinline__ int whole_tile_rows(int rows) {
    return (rows + DecodeTile::ROWS - 1) / DecodeTile::ROWS * DecodeTile::ROWS;
}

// One segment (q, k or v) of mul_mat_decode_tiles_qkv: the block's tile rows are its rows
// from (blockIdx.y - block_first) * 32, its sums go to y at the segment's column, K splits as
// the segment's own launch would (`count` splits, partials at `partials` (floats), the
// segment's tiles only).
struct DecodeQkvSegment {
    QkvSegment seg;
    int split_count;
    int64_t partials;
    float* y;
    int y_stride;

    __device__ int first_row() const { return (blockIdx.y - seg.block_first) * DecodeTile::ROWS; }
    __device__ WeightRow row(int r) const {
        return WeightRow{seg.weights + (first_row() + r) * seg.pitch, first_row() + r < seg.rows};
    }
    __device__ DecodeSplits splits(float* all_partials) const {
        return DecodeSplits{split_count, all_partials + partials, whole_tile_rows(seg.rows),
                            int(blockIdx.y) - seg.block_first};
    }
    __device__ void store(const float (&sums)[DecodeTile::TOKENS][DecodeTile::ROWS], int token0,
                          int n_tokens) const {
        for (int e = threadIdx.x; e < DecodeTile::ROWS * DecodeTile::TOKENS; e += blockDim.x) {
            const int r = e % DecodeTile::ROWS, t = e / DecodeTile::ROWS;
            if (first_row() + r < seg.rows && token0 + t < n_tokens) {
                y[int64_t(token0 + t) * y_stride + seg.column + first_row() + r] = sums[t][r];
            }
        }
    }
};

// Partial floats a token of a segment's K-split (none with one split).
__device__ int64_t segment_partial_rows(int rows, int splits) {
    return splits > 1 ? int64_t(splits) * whole_tile_rows(rows) : 0;
}

// The largest head mul_mat_decode_tiles_qkv finishes (attention.cu's MAX_HEAD_DIM).
constexpr int DECODE_QKV_MAX_HEAD_DIM = 256;

// The shared memory of every block type's decode tiles in one place (a block multiplies one
// segment, of one type), and the finish's head copies (a head_dim copy a warp, used once the
// products are done).
#define QK_DECODE_SHARED_MEMBER(suffix, type) DecodeTileShared<type> suffix;
union DecodeQkvShared {
    QK_FOR_EACH_TYPE(QK_DECODE_SHARED_MEMBER)
    float head_copies[DecodeTile::THREADS / WARP * DECODE_QKV_MAX_HEAD_DIM];
};

// The block's tile of its segment, bit for bit mul_mat_decode_tiles_f16x2_<type> of the
// segment's matrix; whether it stored the tile. Type codes as mul_mat_vec_qkv's.
template <class T>
__device__ __noinline__ bool decode_qkv_tile(const DecodeQkvSegment& job,
                                             DecodeTileShared<T>& shared,
                                             const float* __restrict__ x, int x_stride,
                                             int n_in, int n_tokens, float* partials,
                                             int* counters) {
    return mul_mat_decode_tiles<T>(job, shared, x, x_stride, n_in, n_tokens, partials,
                                   counters);
}

#define QK_DECODE_QKV_CASE(suffix, type)                                                     \
    if (job.seg.type_code == code++) {                                                       \
        return decode_qkv_tile<type>(job, shared.suffix, x, x_stride, n_in, n_tokens,        \
                                     partials, counters);                                    \
    }

__device__ bool decode_qkv_segment_of_its_type(const DecodeQkvSegment& job,
                                               DecodeQkvShared& shared,
                                               const float* __restrict__ x, int x_stride,
                                               int n_in, int n_tokens, float* partials,
                                               int* counters) {
    int code = 0;  // the segment's type is block-uniform: every thread takes the same case
    QK_FOR_EACH_TYPE(QK_DECODE_QKV_CASE)
    __trap();  // a type code cuda_plan.kernel_type_code never gives
}

// mul_mat_decode_tiles_qkv_f16x2: q, k and v (a block type each) on the decode tiles, each
// tile's K-split its matrix's own (splits_q, splits_k, splits_v), the heads finished in the
// epilogue per token tile (head_counters: n_heads + 2 n_kv_heads counters a token tile).
extern "C" __global__ void __launch_bounds__(DecodeTile::THREADS, DECODE_TILE_BLOCKS_PER_SM)
    mul_mat_decode_tiles_qkv_f16x2(QK_QKV_PARAMETERS, int splits_q, int splits_k, int splits_v,
                                   float* partials, int* tile_counters) {
    __shared__ DecodeQkvShared shared;
    // The segment's job in shared memory and the product out of line (decode_qkv_tile): the
    // eleven products inlined here spilled registers (no one of them alone did).
    __shared__ DecodeQkvSegment job;
    const QkvSegment seg = qkv_segment_of_block(blockIdx.y, DecodeTile::ROWS, QK_QKV_ARGUMENTS);
    const bool is_q = seg.column == 0, is_k = !is_q && seg.column == rows_q;
    const int split_count = is_q ? splits_q : is_k ? splits_k : splits_v;
    if (int(blockIdx.z) >= split_count) return;  // a split of a longer segment
    if (threadIdx.x == 0) {
        const int64_t partials_k = segment_partial_rows(rows_q, splits_q) * batch;
        const int64_t partials_v = partials_k + segment_partial_rows(rows_k, splits_k) * batch;
        job = {seg, split_count, is_q ? 0 : is_k ? partials_k : partials_v, y, y_stride};
    }
    __syncthreads();
    if (!decode_qkv_segment_of_its_type(job, shared, x, x_stride, n_in, batch, partials,
                                        tile_counters)) {
        return;  // not the tile's last split
    }
    const int token0 = blockIdx.x * DecodeTile::TOKENS;
    const int heads = (rows_q + rows_k + rows_v) / head_dim;
    finish_qkv_block<DecodeTile::ROWS>(
        QkvBlock{int(blockIdx.y), DecodeTile::ROWS, token0,
                 min(token0 + DecodeTile::TOKENS, batch), head_counters + blockIdx.x * heads},
        job.seg, shared.head_copies, QK_QKV_ARGUMENTS);
}

#define QK_DECODE_GATE_UP_ENTRY(act, op, suffix, type)                                           \
    extern "C" __global__ void __launch_bounds__(DecodeTile::THREADS, DECODE_TILE_BLOCKS_PER_SM)  \
        mul_mat_decode_tiles_gate_up_##act##_f16x2_##suffix(                                     \
            const uint8_t* gate, const uint8_t* up, int64_t row_pitch, const float* x,           \
            int x_stride, float* y, int y_stride, int ffn_rows, int n_in, int n_tokens,          \
            float* partials, int* counters) {                                                    \
        __shared__ DecodeTileShared<type> shared;                                                \
        mul_mat_decode_tiles<type>(DecodeGateUp<op>{{gate, up, row_pitch, ffn_rows, y, y_stride}},\
                                   shared, x, x_stride, n_in, n_tokens, partials, counters);     \
    }

#define QK_PREFILL_TILES_ENTRY(suffix, type)                                                     \
    extern "C" __global__ void __launch_bounds__(PrefillTile::THREADS, TILE_BLOCKS_PER_SM)        \
        mul_mat_tiles_f16x2_##suffix(const uint8_t* weights, int64_t row_pitch, const float* x,  \
                                     int x_stride, float* y, int y_stride, int rows, int n_in,   \
                                     int n_tokens) {                                             \
        __shared__ TileShared<type, PrefillTile> shared;                                         \
        mul_mat_tiles<type>(TileMatrix<PrefillTile>{weights, row_pitch, rows, y, y_stride},       \
                            shared, x, x_stride, n_in, n_tokens);                                \
    }

#define QK_MATMUL_ENTRIES(suffix, type)                                                          \
    QK_PREFILL_TILES_ENTRY(suffix, type)                                                         \
    extern "C" __global__ void __launch_bounds__(DecodeTile::THREADS, DECODE_TILE_BLOCKS_PER_SM)  \
        mul_mat_decode_tiles_f16x2_##suffix(const uint8_t* weights, int64_t row_pitch,           \
                                            const float* x, int x_stride, float* y,             \
                                            int y_stride, int rows, int n_in, int n_tokens,      \
                                            float* partials, int* counters) {                    \
        __shared__ DecodeTileShared<type> shared;                                                \
        mul_mat_decode_tiles<type>(DecodeMatrix{weights, row_pitch, rows, y, y_stride}, shared, \
                                   x, x_stride, n_in, n_tokens, partials, counters);             \
    }                                                                                            \
    QK_DECODE_GATE_UP_ENTRY(silu, silu_op, suffix, type)                                         \
    QK_DECODE_GATE_UP_ENTRY(gelu_tanh, gelu_tanh_op, suffix, type)

QK_FOR_EACH_TYPE(QK_MATMUL_ENTRIES)

// A Q6_K matrix held row-planar (the matvec_mma route's; cuda_plan.planar_q6_K_rows): the
// prefill tiles of its file blocks, bit for bit.
QK_PREFILL_TILES_ENTRY(q6_K_planar, type_q6_K_planar)

