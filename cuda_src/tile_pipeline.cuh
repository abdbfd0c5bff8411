// The tensor-core tiles' pipeline and block math: the batched product's (matmul_batch.cu,
// whose opening comment is the numerics' contract).
//
// A block computes a tile of rows x tokens, each warp a sub-tile of MMA tiles of 16 x 8. The
// inner dimension runs in stages of one 32-element group:
// activations (up to 64 tokens x 32 floats, 8 KB) double-buffered through cp.async and split into
// hi / lo in place once in; weights in chunks of whole blocks (a K-quant block, four
// 32-element blocks, or one group of a float type) copied as the 16-byte aligned byte window
// holding them, also double-buffered and fetched a whole chunk ahead (Q4_K / Q5_K: with a
// table of each group's scale and offset, decoded once per chunk). Shared rows are an odd
// number of 16-byte units apart, the activations' 16-byte pieces are XOR-swizzled by token
// parity and the scale tables' entries by row, so every shared access is free of bank
// conflicts. Tokens past the edge are zero-filled (the activation copies and
// the split run unpredicated), rows past it are never loaded (stale values); neither is stored:
// an MMA keeps rows and tokens apart.
#pragma once

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
// The batched product (matmul_batch.cu): 64 weight rows x all N of a step's rows a block, 4
// warps of 16 rows x N, so each warp unpacks its weight fragments once a stage for N / 8 MMA
// column tiles and each weight byte is unpacked once per block.
template <int N>
using BatchTile = tile_shape<64, N, 16, N>;

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

// The lane's two tokens (2c, 2c + 1) of the warp's token tile j in a table of one float a
// token of the block's tile.
__device__ __forceinline__ float2 lane_token_pair(const float* per_token, int warp_tokens, int j) {
    return *reinterpret_cast<const float2*>(per_token + warp_tokens + 8 * j +
                                            2 * (threadIdx.x % 4));
}

// The warp's MMA tiles of a stage's sums times each token's 2^e (x_factors: one a token of
// the block's tile), exactly.
template <int I, int J>
__device__ __forceinline__ void scale_by_token(float (&part)[I][J][4], const float* x_factors,
                                               int warp_tokens) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const float2 factor = lane_token_pair(x_factors, warp_tokens, j);
#pragma unroll
        for (int i = 0; i < I; ++i) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                part[i][j][r] = __fmul_rn(part[i][j][r], r % 2 ? factor.y : factor.x);
            }
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
// once cost a third of a prefill chunk's MMAs).
template <class T, int I, int J, bool ROLLED>
__device__ __forceinline__ void multiply_stage(const uint8_t* block, int e, const float2* scales,
                                               int group, const uint4* stage, int warp_tokens,
                                               float (&acc)[I][J][4], const float* x_factors,
                                               const float* x_sums) {
    using L = tile_levels<T>;
    using C = tile_chunk<T>;
    using Load = typename std::conditional<C::WORD_ALIGNED, shared_word_aligned,
                                           shared_word_any>::type;
    constexpr int stride = C::ROW_STRIDE;
    // A warp of one row tile unrolls the loops, its addresses and first-MMA choice folded,
    // unless its job says ROLLED (registers).
    constexpr int UNROLL = ROLLED ? 1 : GROUP / MMA_K;
    if constexpr (L::KIND == KIND_LEVELS) {
        const int g = threadIdx.x % WARP / 4;
        static_assert(!L::HAS_MIN || L::SCALE_ELEMENTS == GROUP, "one x sum a stage");
#pragma unroll(UNROLL)
        for (int first = 0; first < GROUP; first += L::SCALE_ELEMENTS) {
            float part[I][J][4];
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
            // Each row's scale and offset, then token tile by token tile: the sums times
            // each token's 2^e, times the scale, plus the offset times the token's sum of x
            // (a tile's factors and sums loaded where they are used: a batched warp's eight
            // tiles' at once spilled registers).
            float scale[I][2], offset[I][2];
#pragma unroll
            for (int i = 0; i < I; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if constexpr (C::SCALE_TABLE) {
                        const float2 entry = scales[scale_table_index(16 * i + 8 * h + g, group)];
                        scale[i][h] = entry.x;
                        offset[i][h] = entry.y;
                    } else {
                        L::scale_offset(block + (16 * i + 8 * h + g) * stride, e + first,
                                        &scale[i][h], &offset[i][h]);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < J; ++j) {
                const float2 factor = lane_token_pair(x_factors, warp_tokens, j);  // 2^e
                const float2 sum = L::HAS_MIN ? lane_token_pair(x_sums, warp_tokens, j)
                                              : make_float2(0.0f, 0.0f);
#pragma unroll
                for (int i = 0; i < I; ++i) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int h = r / 2, q = r % 2;
                        float& out = acc[i][j][r];
                        out = fmaf(scale[i][h], __fmul_rn(part[i][j][r], q ? factor.y : factor.x),
                                   out);
                        if (L::HAS_MIN) out = fmaf(offset[i][h], q ? sum.y : sum.x, out);
                    }
                }
            }
        }
    } else {
        float part[I][J][4];  // the stage's sums, before 2^e
#pragma unroll(UNROLL)
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
            copy_async<PIECE>(dest + r * C::ROW_STRIDE + piece * PIECE,
                             row.bytes + C::piece_source(n_in, chunk, piece));
        }
    }
}

// The activation stages: each thread copies one piece (4 floats) of every
// Shape::THREADS / X_PIECES-th token (every shape's 16th) and,
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


// A tiles block's shared memory for block type T and tile Shape: two chunks of weights (plus
// a spare piece for shared_word_any's second word), two stages of activations with each
// token's 2^e (and its sum of x for the offset types), two chunks' scale tables (one unused
// entry for the types without).
template <class T, class Shape>
struct TileShared {
    using C = tile_chunk<T>;
    static constexpr int CHUNK_BYTES = Shape::ROWS * C::ROW_STRIDE;
    static constexpr int TABLE_ENTRIES = Shape::ROWS * C::TABLE_GROUPS;
    static constexpr bool SUMS = has_offsets<tile_levels<T>>();  // a stage's x summed a token
    __align__(16) uint8_t weight_chunks[2 * CHUNK_BYTES + PIECE];
    __align__(16) uint4 x_stages[2][Shape::TOKENS * X_PIECES];
    __align__(8) float x_sums[2][SUMS ? Shape::TOKENS : 2];
    __align__(8) float x_factors[2][Shape::TOKENS];
    float2 scale_tables[C::SCALE_TABLE ? 2 * TABLE_ENTRIES : 1];
};

// What a tiles launch computes (a job): which weight row is the block's tile row r
// (`row(r)`), and what becomes of each warp's sums (`store(acc, scratch, warp_rows, token0,
// warp_tokens, n_tokens)`, every thread of the block taking part; `scratch`: the block's
// activation stages, free once the products are done, Shape::TOKENS x 64 floats); ROLLED:
// whether a stage's loops stay rolled (multiply_stage).
// One matrix: the tile rows are the matrix's rows from blockIdx.y * ROWS, y[t][row] their sums.
template <class Shape>
struct TileMatrix {
    static constexpr bool ROLLED = false;
    const uint8_t* weights;
    int64_t row_pitch;
    int rows;
    float* y;
    int y_stride;

    __device__ int first_row() const { return blockIdx.y * Shape::ROWS; }
    __device__ WeightRow row(int r) const {
        return WeightRow{weights + (first_row() + r) * row_pitch, first_row() + r < rows};
    }
    __device__ void store(const float (&acc)[Shape::I][Shape::J][4], float*, int warp_rows,
                          int token0, int warp_tokens, int n_tokens) const {
        store_tile<Shape>(acc, y, y_stride, first_row() + warp_rows, token0 + warp_tokens, rows,
                          n_tokens);
    }
};

// Gate and up in one tile: tile rows 0..HALF-1 are gate rows f0.. (f0 = blockIdx.y * HALF),
// rows HALF.. the same up rows; y[t][f] = act(gate . x) * (up . x) is the jobs' to store.
template <int HALF>
struct GateUpRows {
    const uint8_t* gate;
    const uint8_t* up;
    int64_t row_pitch;
    int ffn_rows;
    float* y;
    int y_stride;

    __device__ int first_row() const { return blockIdx.y * HALF; }
    __device__ WeightRow row(int r) const {
        const int f = first_row() + r % HALF;
        return WeightRow{(r < HALF ? gate : up) + f * row_pitch, f < ffn_rows};
    }
};

// The block's tile of the job: stages of 32 elements, activations one stage and weights one
// chunk ahead (cp.async, double-buffered), then the job's store.
template <class T, class Shape, class Job>
__device__ void mul_mat_tiles(const Job& job, TileShared<T, Shape>& shared,
                              const float* __restrict__ x, int x_stride, int n_in, int n_tokens) {
    using C = tile_chunk<T>;
    using S = TileShared<T, Shape>;
    uint8_t* const weight_chunks = shared.weight_chunks;
    auto& x_stages = shared.x_stages;
    auto& x_sums = shared.x_sums;
    auto& x_factors = shared.x_factors;
    float2* const scale_tables = shared.scale_tables;
    constexpr int CHUNK_BYTES = S::CHUNK_BYTES, TABLE_ENTRIES = S::TABLE_ENTRIES;

    const int token0 = blockIdx.x * Shape::TOKENS;
    const int warp = threadIdx.x / WARP;
    const int warp_rows = Shape::warp_rows(warp), warp_tokens = Shape::warp_tokens(warp);
    const int n_stages = n_in / GROUP;
    const float* tile_x = x + int64_t(token0) * x_stride;
    const int tile_tokens = n_tokens - token0;
    auto row_at = [&](int r) { return job.row(r); };

    float acc[Shape::I][Shape::J][4] = {};

    // cp.async groups: each stage commits its next activation stage, then its weight chunk
    // (empty unless the stage opens a chunk). A stage needs the activations committed by the
    // one before and its chunk, committed a whole chunk earlier: every group but the newest.
    // With one-stage chunks the newest holds that chunk: wait for all.
    constexpr int PENDING = C::STAGES > 1 ? 1 : 0;
    copy_weight_rows<T, Shape>(weight_chunks, row_at, n_in, 0);
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
                                S::SUMS ? x_sums[s % 2] : nullptr);
        __syncthreads();  // stage s is in and split; every warp is done with stage s - 1
        if (s + 1 < n_stages) {
            copy_activation_stage<Shape>(x_stages[(s + 1) % 2], tile_x, x_stride, tile_tokens,
                                         s + 1);
        }
        commit_copies();
        const int chunk = s / C::STAGES;
        const bool next_chunk = (chunk + 1) * C::STAGES < n_stages;
        if (s % C::STAGES == 0 && next_chunk) {
            copy_weight_rows<T, Shape>(weight_chunks + (chunk + 1) % 2 * CHUNK_BYTES, row_at,
                                       n_in, chunk + 1);
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
        multiply_stage<T, Shape::I, Shape::J, Job::ROLLED>(
            block, C::stage_element(chunk, element), scales, s % C::STAGES, x_stages[s % 2],
            warp_tokens, acc, x_factors[s % 2], x_sums[s % 2]);
    }
    job.store(acc, reinterpret_cast<float*>(&x_stages[0][0]), warp_rows, token0, warp_tokens,
              n_tokens);
}
