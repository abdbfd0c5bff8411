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
// A block computes a tile of rows x tokens, each warp a sub-tile of MMA tiles of 16 x 8 (the
// prefill shape here; the decode tiles multiply the same stages but fetch differently: see
// mul_mat_decode_tiles). The inner dimension runs in
// stages of one 32-element group: activations (64 tokens x 32 floats, 8 KB) double-buffered
// through cp.async and split into hi / lo in place once in; weights in chunks of whole blocks
// (a K-quant block, four 32-element blocks, or one group of a float type) copied as the
// 16-byte aligned byte window holding them, also double-buffered and fetched a whole chunk
// ahead (Q4_K / Q5_K: with a table of each group's scale and offset, decoded once per chunk).
// Shared rows are an odd number of 16-byte units apart, the activations' 16-byte pieces are
// XOR-swizzled by token parity and the scale tables' entries by row, so every shared access
// is free of bank conflicts. Tokens past the edge are zero-filled (the activation copies and
// the split run unpredicated), rows past it are never loaded (stale values); neither is stored:
// an MMA keeps rows and tokens apart.
#include <type_traits>

#include "activation_ops.cuh"
#include "activation_split.cuh"
#include "device_common.cuh"
#include "mma_ops.cuh"
#include "qkv_finish_ops.cuh"
#include "tile_levels.cuh"

// Resident blocks per SM the registers are capped for (128 registers a thread at 4): 16 warps
// on sm_90 (228 KB of shared memory holds four blocks of up to 48 KB of static shared
// memory); sm_80's 164 KB holds three.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define TILE_BLOCKS_PER_SM 3
#else
#define TILE_BLOCKS_PER_SM 4
#endif

// Decode tiles: 2 warps, blocks capped at 128 registers a thread like the prefill tiles.
#define DECODE_TILE_BLOCKS_PER_SM 8

constexpr int MMA_K = 16;
constexpr int PIECE = 16;                  // bytes per cp.async
constexpr int X_PIECES = GROUP * 4 / PIECE;  // 16-byte pieces of one token's stage
static_assert(GROUP == SPLIT_GROUP, "a stage is one group of the activations' split");

__host__ __device__ constexpr int round_up16(int n) { return (n + PIECE - 1) / PIECE * PIECE; }

// A block's tile of ROWS x TOKENS, split among warps of WARP_ROWS x WARP_TOKENS (I x J MMA
// tiles of 16 x 8), warps across the rows first.
template <int ROWS_, int TOKENS_, int WARP_ROWS, int WARP_TOKENS>
struct tile_shape {
    static constexpr int ROWS = ROWS_, TOKENS = TOKENS_;
    static constexpr int I = WARP_ROWS / 16, J = WARP_TOKENS / 8;
    static constexpr int WARPS_ACROSS_ROWS = ROWS / WARP_ROWS;
    static constexpr int THREADS = WARP * WARPS_ACROSS_ROWS * (TOKENS / WARP_TOKENS);
    static __device__ int warp_rows(int warp) { return warp % WARPS_ACROSS_ROWS * WARP_ROWS; }
    static __device__ int warp_tokens(int warp) { return warp / WARPS_ACROSS_ROWS * WARP_TOKENS; }
};
using PrefillTile = tile_shape<64, 64, 32, 32>;
using DecodeTile = tile_shape<32, 8, 16, 8>;

template <class L>
__host__ __device__ constexpr bool has_offsets() {
    if constexpr (L::KIND == KIND_LEVELS) return L::HAS_MIN;
    return false;
}

// How a type's weights are staged: BLOCKS whole blocks per chunk, copied as the 16-byte
// aligned window holding them (WINDOW bytes at most), ROW_STRIDE bytes apart in shared memory;
// a planar Q6_K block (type_q6_K_planar) as its STAGED_PIECES pieces from three planes.
template <class T>
struct tile_chunk {
    static constexpr bool PLANAR = std::is_same<T, type_q6_K_planar>::value;
    static constexpr int BLOCKS =
        T::BLOCK_ELEMENTS > GROUP || tile_levels<T>::KIND != KIND_LEVELS ? 1 : 4;
    static constexpr int ELEMENTS = BLOCKS * T::BLOCK_ELEMENTS;
    static constexpr int BYTES = BLOCKS * T::BLOCK_BYTES;
    static constexpr bool ALIGNED = PLANAR || BYTES % PIECE == 0;  // every chunk starts on a piece
    static constexpr int WINDOW = PLANAR    ? type_q6_K_planar::STAGED_PIECES * PIECE
                                  : ALIGNED ? BYTES
                                            : round_up16(BYTES + PIECE - 1);
    // An odd number of pieces: the 8 rows of a fragment read 8 distinct groups of 4 banks.
    static constexpr int ROW_STRIDE = (WINDOW / PIECE) % 2 ? WINDOW : WINDOW + PIECE;
    static constexpr int STAGES = ELEMENTS / GROUP;
    // Words of every level field start on 4-byte boundaries in shared memory.
    static constexpr bool WORD_ALIGNED = PLANAR || (ALIGNED && T::BLOCK_BYTES % 4 == 0);
    // Q4_K / Q5_K: each group's scale and offset (~20 instructions of 6-bit unpacking a row)
    // decoded once per chunk into a shared table of TABLE_GROUPS entries a row (see
    // scale_table_index).
    static constexpr bool SCALE_TABLE = has_offsets<tile_levels<T>>() &&
                                        T::BLOCK_ELEMENTS > GROUP;
    static constexpr int TABLE_GROUPS = ELEMENTS / GROUP;
    static_assert(!SCALE_TABLE || TABLE_GROUPS == 8, "scale_table_index swizzles 8 groups");

    // The pieces chunk `chunk` of a row of n_in elements is staged from (the last chunk's
    // window ends at the row's bytes rounded up to 16, within row_pitch), and where piece
    // `piece` of them lies in the row.
    static __device__ int pieces(int n_in, int chunk) {
        if constexpr (PLANAR) return type_q6_K_planar::STAGED_PIECES;
        const int row_bytes = n_in / T::BLOCK_ELEMENTS * T::BLOCK_BYTES;
        return (round_up16(min((chunk + 1) * BYTES, row_bytes)) - first_byte(chunk)) / PIECE;
    }
    static __device__ int64_t piece_source(int n_in, int chunk, int piece) {
        if constexpr (PLANAR) {
            return type_q6_K_planar::piece_source(n_in / T::BLOCK_ELEMENTS, chunk, piece);
        }
        return first_byte(chunk) + piece * PIECE;
    }
    // Where the chunk's first block starts in its staged window.
    static __device__ int window_offset(int chunk) { return PLANAR ? 0 : chunk * BYTES % PIECE; }
    // A stage's element `element` of the chunk as multiply_stage takes it: within its block,
    // a planar block's d slot added (see tile_levels<type_q6_K_planar>).
    static __device__ int stage_element(int chunk, int element) {
        if constexpr (PLANAR) return type_q6_K_planar::staged_element(chunk, element);
        return element % T::BLOCK_ELEMENTS;
    }

  private:
    static __device__ int first_byte(int chunk) { return chunk * BYTES / PIECE * PIECE; }
};

// Entry of row r's group in a scale table (8 float2 a row, 64 bytes): the groups XOR-swizzled
// by (r / 2) % 4, so the 8 rows g of a fragment's flush (one group; rows 8 apart share a
// swizzle) read 8 distinct 8-byte bank pairs, and the decode's half-warps (two whole rows)
// write 128 contiguous bytes. An odd row stride instead made the decode's writes conflict.
__host__ __device__ constexpr int scale_table_index(int r, int group) {
    return r * 8 + (group ^ ((r >> 1) & 3));
}

__device__ __forceinline__ void copy_piece_async(void* shared_dst, const void* global_src) {
    const uint32_t dst = uint32_t(__cvta_generic_to_shared(shared_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src)
                 : "memory");
}

// cp.async of a piece when `in_range`, else 16 zero bytes (src-size 0: nothing is read from
// `fallback`, a valid address all the same): an unpredicated copy, no per-lane branch.
__device__ __forceinline__ void copy_piece_or_zeros(void* shared_dst, const void* global_src,
                                                    const void* fallback, bool in_range) {
    const uint32_t dst = uint32_t(__cvta_generic_to_shared(shared_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                 "l"(in_range ? global_src : fallback), "r"(in_range ? PIECE : 0)
                 : "memory");
}

// The little-endian word at any byte of shared memory: two aligned words and a funnel shift
// (the weight buffer ends in a spare piece, so the second word is always inside it).
struct shared_word_any {
    __device__ uint32_t operator()(const uint8_t* p) const {
        const uintptr_t address = reinterpret_cast<uintptr_t>(p);
        const uint32_t* word = reinterpret_cast<const uint32_t*>(address & ~uintptr_t(3));
        return __funnelshift_r(word[0], word[1], uint32_t(address & 3) * 8);
    }
};

struct shared_word_aligned {
    __device__ uint32_t operator()(const uint8_t* p) const {
        return *reinterpret_cast<const uint32_t*>(p);
    }
};

// The MMAs' k order: lane c's k = 2c, 2c+1, 2c+8, 2c+9 are the step's elements 4c, 4c+2, 4c+1,
// 4c+3 (a permutation of the 16, the same for weights and activations), so a lane's four
// elements are adjacent in memory: one float4 of activations, one word of packed levels.

// The activation fragment (hi and lo parts) of token tile j of the warp for the 16 elements
// from `k` (0 or 16): one piece of the split stage, piece (k / 4 + c) ^ swizzle of token t =
// warp_tokens + 8 j + g, i.e. the lane's k = 0 piece with bit 2 flipped by k (c < 4) and
// whole token rows added for j (t's parity is g's): one LOP3 and a constant offset.
__device__ __forceinline__ void activation_fragment(const uint4* stage, int warp_tokens, int j,
                                                    int k, uint32_t (&hi)[2], uint32_t (&lo)[2]) {
    const int g = threadIdx.x % WARP / 4, c = threadIdx.x % 4;
    const int lane_piece = (warp_tokens + g) * X_PIECES + (c ^ ((g & 1) << 2));
    const uint4 parts = stage[(lane_piece ^ (k / 4)) + 8 * j * X_PIECES];
    hi[0] = parts.x;
    hi[1] = parts.y;
    lo[0] = parts.z;
    lo[1] = parts.w;
}

// Weight fragments of the warp's I row tiles for elements e.. of the block at `block`
// (rows ROW_STRIDE bytes apart): levels (exact float16 integers) or float16 halves.
template <class T, class Load, int I>
__device__ __forceinline__ void weight_fragments(const uint8_t* block, int stride, int e,
                                                 uint32_t (&a)[I][4]) {
    using L = tile_levels<T>;
    const int g = threadIdx.x % WARP / 4, c = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < I; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint32_t even, odd;
            L::pairs(block + (16 * i + 8 * h + g) * stride, e + 4 * c, Load(), &even, &odd);
            if constexpr (L::KIND == KIND_LEVELS) {
                // float16 1024 + OFFSET in both halves (OFFSET < 1024 fills the mantissa)
                constexpr uint32_t bias_pair =
                    ((HALF_1024_PAIR & 0xFFFFu) | L::OFFSET) * 0x00010001u;
                even = sub_halves(even, bias_pair);
                odd = sub_halves(odd, bias_pair);
            }
            a[i][h] = even;
            a[i][2 + h] = odd;
        }
    }
}

// F32 / BF16 weight fragments split into float16 hi and lo parts.
template <class T, class Load, int I>
__device__ __forceinline__ void split_weight_fragments(const uint8_t* block, int stride, int e,
                                                       uint32_t (&hi)[I][4], uint32_t (&lo)[I][4]) {
    const int g = threadIdx.x % WARP / 4, c = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < I; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v[4];
            tile_levels<T>::floats(block + (16 * i + 8 * h + g) * stride, e + 4 * c, Load(), v);
            split_pair(v[0], v[2], &hi[i][h], &lo[i][h]);
            split_pair(v[1], v[3], &hi[i][2 + h], &lo[i][2 + h]);
        }
    }
}

// The lane's two tokens (2c, 2c + 1) of each of the warp's token tiles in a table of one
// float a token of the block's tile.
template <int J>
__device__ __forceinline__ void lane_token_pairs(const float* per_token, int warp_tokens,
                                                 float (&out)[J][2]) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const float2 pair = *reinterpret_cast<const float2*>(per_token + warp_tokens + 8 * j +
                                                             2 * (threadIdx.x % 4));
        out[j][0] = pair.x;
        out[j][1] = pair.y;
    }
}

// The warp's MMA tiles of a stage's sums times each token's 2^e (x_factors: one a token of
// the block's tile), exactly.
template <int I, int J>
__device__ __forceinline__ void scale_by_token(float (&part)[I][J][4], const float* x_factors,
                                               int warp_tokens) {
    float factors[J][2];
    lane_token_pairs<J>(x_factors, warp_tokens, factors);
#pragma unroll
    for (int i = 0; i < I; ++i) {
#pragma unroll
        for (int j = 0; j < J; ++j) {
#pragma unroll
            for (int r = 0; r < 4; ++r) part[i][j][r] = __fmul_rn(part[i][j][r], factors[j][r % 2]);
        }
    }
}

// One 32-element stage of the warp's tile: acc[i][j] is row tile i, token tile j.
// `block` is the stage's weight block in the warp's first row, `e` the stage's first element
// within it, `scales` (SCALE_TABLE types) the warp's first row of the chunk's table and
// `group` the stage's group in it (the swizzle repeats every 8 rows). `x_factors`: each
// token's 2^e of the stage's split, one a token of the block's tile. The offset types need
// each token's sum of the stage's x: `x_sums`, the block's, one a token of the tile (summed
// once by the threads that split the stage; MMAs of ones x the activations in every warp
// once cost a third of the prefill's MMAs and half of a decode warp's).
template <class T, int I, int J>
__device__ __forceinline__ void multiply_stage(const uint8_t* block, int e, const float2* scales,
                                               int group, const uint4* stage, int warp_tokens,
                                               float (&acc)[I][J][4], const float* x_factors,
                                               const float* x_sums) {
    using L = tile_levels<T>;
    using C = tile_chunk<T>;
    using Load = typename std::conditional<C::WORD_ALIGNED, shared_word_aligned,
                                           shared_word_any>::type;
    constexpr int stride = C::ROW_STRIDE;
    // The prefill's 2 x 4 MMA tiles a warp keep the loops rolled (registers, code size); a
    // decode warp's single tile unrolls them, its addresses and first-MMA choice folded.
    constexpr int UNROLL = I * J > 1 ? 1 : GROUP / MMA_K;
    if constexpr (L::KIND == KIND_LEVELS) {
        const int g = threadIdx.x % WARP / 4;
        static_assert(!L::HAS_MIN || L::SCALE_ELEMENTS == GROUP, "one x sum a stage");
#pragma unroll(UNROLL)
        for (int first = 0; first < GROUP; first += L::SCALE_ELEMENTS) {
            float part[I][J][4], sums[J][2];
#pragma unroll(UNROLL)
            for (int k = first; k < first + L::SCALE_ELEMENTS; k += MMA_K) {
                uint32_t a[I][4];
                weight_fragments<T, Load, I>(block, stride, e + k, a);
#pragma unroll
                for (int j = 0; j < J; ++j) {
                    uint32_t x_hi[2], x_lo[2];
                    activation_fragment(stage, warp_tokens, j, k, x_hi, x_lo);
                    if (k == first) {
#pragma unroll
                        for (int i = 0; i < I; ++i) mma_first(part[i][j], a[i], x_lo);
                    } else {
#pragma unroll
                        for (int i = 0; i < I; ++i) mma(part[i][j], a[i], x_lo);
                    }
#pragma unroll
                    for (int i = 0; i < I; ++i) mma(part[i][j], a[i], x_hi);
                }
            }
            scale_by_token<I, J>(part, x_factors, warp_tokens);  // 2^e
            if (L::HAS_MIN) lane_token_pairs<J>(x_sums, warp_tokens, sums);
#pragma unroll
            for (int i = 0; i < I; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float scale, offset;
                    if constexpr (C::SCALE_TABLE) {
                        const float2 entry = scales[scale_table_index(16 * i + 8 * h + g, group)];
                        scale = entry.x;
                        offset = entry.y;
                    } else {
                        L::scale_offset(block + (16 * i + 8 * h + g) * stride, e + first,
                                        &scale, &offset);
                    }
#pragma unroll
                    for (int j = 0; j < J; ++j) {
#pragma unroll
                        for (int q = 0; q < 2; ++q) {
                            float& out = acc[i][j][2 * h + q];
                            out = fmaf(scale, part[i][j][2 * h + q], out);
                            if (L::HAS_MIN) out = fmaf(offset, sums[j][q], out);
                        }
                    }
                }
            }
        }
    } else {
        float part[I][J][4];  // the stage's sums, before 2^e
#pragma unroll
        for (int k = 0; k < GROUP; k += MMA_K) {
            if constexpr (L::KIND == KIND_HALVES) {
                uint32_t a[I][4];
                weight_fragments<T, Load, I>(block, stride, e + k, a);
#pragma unroll
                for (int j = 0; j < J; ++j) {
                    uint32_t x_hi[2], x_lo[2];
                    activation_fragment(stage, warp_tokens, j, k, x_hi, x_lo);
#pragma unroll
                    for (int i = 0; i < I; ++i) {
                        if (k == 0) {
                            mma_first(part[i][j], a[i], x_lo);
                        } else {
                            mma(part[i][j], a[i], x_lo);
                        }
                        mma(part[i][j], a[i], x_hi);
                    }
                }
            } else {
                uint32_t w_hi[I][4], w_lo[I][4];
                split_weight_fragments<T, Load, I>(block, stride, e + k, w_hi, w_lo);
#pragma unroll
                for (int j = 0; j < J; ++j) {
                    uint32_t x_hi[2], x_lo[2];
                    activation_fragment(stage, warp_tokens, j, k, x_hi, x_lo);
#pragma unroll
                    for (int i = 0; i < I; ++i) {  // the small products first
                        if (k == 0) {
                            mma_first(part[i][j], w_lo[i], x_hi);
                        } else {
                            mma(part[i][j], w_lo[i], x_hi);
                        }
                        mma(part[i][j], w_hi[i], x_lo);
                        mma(part[i][j], w_hi[i], x_hi);
                    }
                }
            }
        }
        scale_by_token<I, J>(part, x_factors, warp_tokens);  // 2^e
#pragma unroll
        for (int i = 0; i < I; ++i) {
#pragma unroll
            for (int j = 0; j < J; ++j) {
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[i][j][r] += part[i][j][r];
            }
        }
    }
}

// A tile's weight row: its bytes, and whether the matrix has it (rows past it are skipped).
struct WeightRow {
    const uint8_t* bytes;
    bool present;
};

// Starts copying weight chunk `chunk` of the tile's rows into `dest` (the aligned window, in
// pieces): row_at(r) is the tile's row r.
template <class T, class Shape, class RowAt>
__device__ __forceinline__ void copy_weight_rows(uint8_t* dest, RowAt row_at, int n_in,
                                                 int chunk) {
    using C = tile_chunk<T>;
    const int pieces = C::pieces(n_in, chunk);
    constexpr int MAX_PIECES = C::WINDOW / PIECE;
    for (int i = threadIdx.x; i < Shape::ROWS * MAX_PIECES; i += Shape::THREADS) {
        const int r = i / MAX_PIECES, piece = i % MAX_PIECES;
        const WeightRow row = row_at(r);
        if (piece < pieces && row.present) {
            copy_piece_async(dest + r * C::ROW_STRIDE + piece * PIECE,
                             row.bytes + C::piece_source(n_in, chunk, piece));
        }
    }
}

// The same for rows row0.. of one matrix (rows past `rows` skipped).
template <class T, class Shape>
__device__ __forceinline__ void copy_weight_chunk(uint8_t* dest, const uint8_t* weights,
                                                  int64_t row_pitch, int row0, int rows,
                                                  int n_in, int chunk) {
    copy_weight_rows<T, Shape>(
        dest,
        [&](int r) { return WeightRow{weights + (row0 + r) * row_pitch, row0 + r < rows}; },
        n_in, chunk);
}

// The activation stages: each thread copies one piece (4 floats) of every
// Shape::THREADS / X_PIECES-th token (prefill: 16th; decode: its one token) and,
// once its copies are in, splits those same pieces in place (cp.async.wait_group makes a
// thread's own copies visible to it; the barrier after it publishes the split to the block).
// A piece of elements (e, e+1, e+2, e+3) becomes the halves {hi(e, e+2), hi(e+1, e+3),
// lo(e, e+2), lo(e+1, e+3)}: a lane's whole activation fragment in one shared load.
// Pieces are XOR-swizzled by token parity (the 8 lanes of a 16-byte shared access read two
// tokens: halves 0-3 and 4-7 of the 8 pieces) and each thread's swizzle is the same for all
// of its tokens.
template <class Shape>
struct stage_passes {
    static constexpr int TOKENS_PER_PASS = Shape::THREADS / X_PIECES;
    static constexpr int PASSES = Shape::TOKENS / TOKENS_PER_PASS;
    static_assert(TOKENS_PER_PASS % 2 == 0 && Shape::TOKENS % TOKENS_PER_PASS == 0, "");
};

__device__ __forceinline__ int own_piece_index() {
    const int piece = threadIdx.x % X_PIECES, first = threadIdx.x / X_PIECES;
    return first * X_PIECES + (piece ^ ((first & 1) << 2));
}

// Decodes the scale table of a chunk (SCALE_TABLE types: one block a row) once it is in.
template <class T, class Shape>
__device__ __forceinline__ void decode_scale_table(float2* table, const uint8_t* chunk) {
    using C = tile_chunk<T>;
    constexpr int groups = C::TABLE_GROUPS;
    for (int i = threadIdx.x; i < Shape::ROWS * groups; i += Shape::THREADS) {
        const int r = i / groups, group = i % groups;
        float scale, offset;
        tile_levels<T>::scale_offset(chunk + r * C::ROW_STRIDE, group * GROUP, &scale, &offset);
        table[scale_table_index(r, group)] = make_float2(scale, offset);
    }
}

// Starts copying stage `stage` (elements [32 stage, 32 stage + 32)) of the tile's tokens
// (`x` at the tile's first token, `tokens` of them; zeros for the tokens past them).
template <class Shape>
__device__ __forceinline__ void copy_activation_stage(uint4* dest, const float* x,
                                                      int64_t x_stride, int tokens, int stage) {
    using P = stage_passes<Shape>;
    const int first = threadIdx.x / X_PIECES;
    const float* src = x + first * x_stride + stage * GROUP + 4 * (threadIdx.x % X_PIECES);
    uint4* dst = dest + own_piece_index();
#pragma unroll
    for (int pass = 0; pass < P::PASSES; ++pass) {
        copy_piece_or_zeros(dst + pass * P::TOKENS_PER_PASS * X_PIECES,
                            src + pass * P::TOKENS_PER_PASS * x_stride, x,
                            first + pass * P::TOKENS_PER_PASS < tokens);
    }
}

// A piece of 4 floats' bits (elements e .. e+3), times `down` (2^-e), split as the
// activation fragments read it.
__device__ __forceinline__ uint4 split_piece(uint4 v, float down) {
    auto scaled = [down](uint32_t bits) { return __fmul_rn(__uint_as_float(bits), down); };
    uint4 parts;
    split_pair(scaled(v.x), scaled(v.z), &parts.x, &parts.z);
    split_pair(scaled(v.y), scaled(v.w), &parts.y, &parts.w);
    return parts;
}

// A piece of a token's stage (v: 4 floats' bits) split with the token's exponent for the
// stage (activation_split.cuh), found by the X_PIECES consecutive lanes that hold the token's
// pieces together (one warp reduction); its first lane stores 2^e at `factor`.
__device__ __forceinline__ uint4 split_token_piece(uint4 v, float* factor) {
    auto magnitude = [](uint32_t bits) { return magnitude_bits(__uint_as_float(bits)); };
    const uint32_t token_lanes = ((1u << X_PIECES) - 1)
                                 << (threadIdx.x % WARP / X_PIECES * X_PIECES);
    const uint32_t largest =
        max(max(magnitude(v.x), magnitude(v.y)), max(magnitude(v.z), magnitude(v.w)));
    const int e = split_exponent(__reduce_max_sync(token_lanes, largest));
    if (threadIdx.x % X_PIECES == 0) *factor = power_of_two(e);
    return split_piece(v, power_of_two(-e));
}

// A token's sum of a stage's 32 values, from the X_PIECES consecutive lanes that hold its
// pieces (x0..x3 this lane's), in a fixed tree: every one of them gets it.
__device__ __forceinline__ float stage_token_sum(float x0, float x1, float x2, float x3) {
    float sum = (x0 + x1) + (x2 + x3);
#pragma unroll
    for (int lanes = 1; lanes < X_PIECES; lanes *= 2) sum += __shfl_xor_sync(FULL_MASK, sum, lanes);
    return sum;
}

// Splits the pieces this thread copied into `stage` (see above), in place (zeros stay zeros),
// puts each token's 2^e in `factors` and its sum of the stage in `sums` (the offset types'
// tables; nullptr: none).
template <class Shape>
__device__ __forceinline__ void split_own_pieces(uint4* stage, float* factors, float* sums) {
    using P = stage_passes<Shape>;
    uint4* own = stage + own_piece_index();
#pragma unroll
    for (int pass = 0; pass < P::PASSES; ++pass) {
        uint4& piece = own[pass * P::TOKENS_PER_PASS * X_PIECES];
        const uint4 v = piece;
        if (sums != nullptr) {
            const float sum = stage_token_sum(__uint_as_float(v.x), __uint_as_float(v.y),
                                              __uint_as_float(v.z), __uint_as_float(v.w));
            if (threadIdx.x % X_PIECES == 0) {
                sums[threadIdx.x / X_PIECES + pass * P::TOKENS_PER_PASS] = sum;
            }
        }
        piece = split_token_piece(
            v, &factors[threadIdx.x / X_PIECES + pass * P::TOKENS_PER_PASS]);
    }
}

// y of the warp's tile (rows from `row`, tokens from `token`), inside rows x n_tokens.
template <class Shape>
__device__ __forceinline__ void store_tile(const float (&acc)[Shape::I][Shape::J][4],
                                           float* __restrict__ y, int y_stride, int row,
                                           int token, int rows, int n_tokens) {
    const int g = threadIdx.x % WARP / 4, c = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < Shape::I; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row + 16 * i + 8 * h + g;
#pragma unroll
            for (int j = 0; j < Shape::J; ++j) {
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int t = token + 8 * j + 2 * c + q;
                    if (r < rows && t < n_tokens) {
                        y[int64_t(t) * y_stride + r] = acc[i][j][2 * h + q];
                    }
                }
            }
        }
    }
}

template <class T, class Shape>
__device__ void mul_mat_tiles(const uint8_t* __restrict__ weights, int64_t row_pitch,
                              const float* __restrict__ x, int x_stride, float* __restrict__ y,
                              int y_stride, int rows, int n_in, int n_tokens) {
    using C = tile_chunk<T>;
    // Two chunks of weights (plus a spare piece for shared_word_any's second word) and two
    // stages of activations.
    __shared__ __align__(16) uint8_t weight_chunks[2 * Shape::ROWS * C::ROW_STRIDE + PIECE];
    __shared__ __align__(16) uint4 x_stages[2][Shape::TOKENS * X_PIECES];
    constexpr bool SUMS = has_offsets<tile_levels<T>>();  // a stage's x summed a token
    __shared__ __align__(8) float x_sums[2][SUMS ? Shape::TOKENS : 2];
    __shared__ __align__(8) float x_factors[2][Shape::TOKENS];  // a stage's 2^e a token
    // Two chunks' scale tables (one unused entry for the types without).
    __shared__ float2 scale_tables[C::SCALE_TABLE ? 2 * Shape::ROWS * C::TABLE_GROUPS : 1];
    constexpr int CHUNK_BYTES = Shape::ROWS * C::ROW_STRIDE, TABLE_ENTRIES = Shape::ROWS *
                                                                           C::TABLE_GROUPS;

    const int token0 = blockIdx.x * Shape::TOKENS, row0 = blockIdx.y * Shape::ROWS;
    const int warp = threadIdx.x / WARP;
    const int warp_rows = Shape::warp_rows(warp), warp_tokens = Shape::warp_tokens(warp);
    const int n_stages = n_in / GROUP;
    const float* tile_x = x + int64_t(token0) * x_stride;
    const int tile_tokens = n_tokens - token0;

    float acc[Shape::I][Shape::J][4] = {};

    // cp.async groups: each stage commits its next activation stage, then its weight chunk
    // (empty unless the stage opens a chunk). A stage needs the activations committed by the
    // one before and its chunk, committed a whole chunk earlier: every group but the newest.
    // With one-stage chunks the newest holds that chunk: wait for all.
    constexpr int PENDING = C::STAGES > 1 ? 1 : 0;
    copy_weight_chunk<T, Shape>(weight_chunks, weights, row_pitch, row0, rows, n_in, 0);
    copy_activation_stage<Shape>(x_stages[0], tile_x, x_stride, tile_tokens, 0);
    commit_copies();
    commit_copies();
    if constexpr (C::SCALE_TABLE) {  // chunk 0's table (the first stage's barrier publishes it)
        wait_copies<0>();
        __syncthreads();
        decode_scale_table<T, Shape>(scale_tables, weight_chunks);
    }
    for (int s = 0; s < n_stages; ++s) {
        wait_copies<PENDING>();
        split_own_pieces<Shape>(x_stages[s % 2], x_factors[s % 2],
                                SUMS ? x_sums[s % 2] : nullptr);
        __syncthreads();  // stage s is in and split; every warp is done with stage s - 1
        if (s + 1 < n_stages) {
            copy_activation_stage<Shape>(x_stages[(s + 1) % 2], tile_x, x_stride, tile_tokens,
                                         s + 1);
        }
        commit_copies();
        const int chunk = s / C::STAGES;
        const bool next_chunk = (chunk + 1) * C::STAGES < n_stages;
        if (s % C::STAGES == 0 && next_chunk) {
            copy_weight_chunk<T, Shape>(weight_chunks + (chunk + 1) % 2 * CHUNK_BYTES, weights,
                                        row_pitch, row0, rows, n_in, chunk + 1);
        }
        commit_copies();
        if constexpr (C::SCALE_TABLE) {
            // The next chunk is in (committed STAGES - 1 stages ago); the next barrier
            // publishes its table, and the buffer's last reader (chunk - 1) is done.
            if (s % C::STAGES == C::STAGES - 1 && next_chunk) {
                decode_scale_table<T, Shape>(scale_tables + (chunk + 1) % 2 * TABLE_ENTRIES,
                                             weight_chunks + (chunk + 1) % 2 * CHUNK_BYTES);
            }
        }

        const int element = (s % C::STAGES) * GROUP;  // within the chunk
        const uint8_t* block = weight_chunks + chunk % 2 * CHUNK_BYTES +
                               warp_rows * C::ROW_STRIDE + C::window_offset(chunk) +
                               element / T::BLOCK_ELEMENTS * T::BLOCK_BYTES;
        const float2* scales = scale_tables + (C::SCALE_TABLE ? chunk % 2 * TABLE_ENTRIES +
                                               warp_rows * C::TABLE_GROUPS : 0);
        multiply_stage<T, Shape::I, Shape::J>(block, C::stage_element(chunk, element), scales,
                                              s % C::STAGES, x_stages[s % 2], warp_tokens, acc,
                                              x_factors[s % 2], x_sums[s % 2]);
    }
    store_tile<Shape>(acc, y, y_stride, row0 + warp_rows, token0 + warp_tokens, rows, n_tokens);
}

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
struct DecodeGateUp {
    const uint8_t* gate;
    const uint8_t* up;
    int64_t row_pitch;
    int ffn_rows;
    float* y;
    int y_stride;

    static constexpr int HALF = DecodeTile::ROWS / 2;
    __device__ int first_row() const { return blockIdx.y * HALF; }
    __device__ WeightRow row(int r) const {
        const int f = first_row() + r % HALF;
        return WeightRow{(r < HALF ? gate : up) + f * row_pitch, f < ffn_rows};
    }
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
        mul_mat_decode_tiles<type>(DecodeGateUp<op>{gate, up, row_pitch, ffn_rows, y, y_stride}, \
                                   shared, x, x_stride, n_in, n_tokens, partials, counters);     \
    }

#define QK_PREFILL_TILES_ENTRY(suffix, type)                                                     \
    extern "C" __global__ void __launch_bounds__(PrefillTile::THREADS, TILE_BLOCKS_PER_SM)        \
        mul_mat_tiles_f16x2_##suffix(const uint8_t* weights, int64_t row_pitch, const float* x,  \
                                     int x_stride, float* y, int y_stride, int rows, int n_in,   \
                                     int n_tokens) {                                             \
        mul_mat_tiles<type, PrefillTile>(weights, row_pitch, x, x_stride, y, y_stride, rows,     \
                                         n_in, n_tokens);                                        \
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
