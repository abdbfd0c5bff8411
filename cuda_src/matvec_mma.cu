// Decode matrix x activations on the tensor cores, Q4_K and Q6_K: y[b][r] = sum_i W[r][i] *
// x[b][i] for any batch >= 1, each weight byte copied once into shared memory, then into an
// MMA fragment.
//
// Entry points (<type>: q4_K, q6_K; <act>: silu, gelu_tanh):
//   mul_mat_vec_mma_<type>(weights, int64 row_pitch, x, int x_stride, y, int y_stride,
//                          int rows, int n_in, int batch)
//       y[b][r] = W[r] . x[b] for r < rows, b < batch.
//   mul_mat_vec_mma_gate_up_<act>_<type>(gate_w, up_w, int64 row_pitch, x, int x_stride, y,
//                                        int y_stride, int ffn_rows, int n_in, int batch)
//       y[b][r] = act(gate[r] . x[b]) * (up[r] . x[b]), act as activation.cu's gated_<act>:
//       bit for bit mul_mat_vec_mma_<type> on both matrices, then gated_<act>.
//   mul_mat_vec_mma_qkv(the arguments of matvec.cu's mul_mat_vec_qkv)
//       q | k | v as mul_mat_vec_qkv lays them out and finishes them (biases, head norms,
//       RoPE, the K/V write: qkv_finish_ops.cuh's epilogue, per-head counters), each segment
//       Q4_K or Q6_K (its type code): bit for bit mul_mat_vec_mma_<type> x3 then qkv_finish.
//       Geometry: the three matrices' blocks of 16 rows one after the other.
// Layouts as matvec.cu's (weights rows row_pitch bytes apart from a 16-byte aligned base; x
// float32 [batch][x_stride], x_stride % 4 == 0, 16-byte aligned); n_in % 256 == 0. Q4_K rows
// hold the file's blocks; Q6_K rows the row-planar layout (cuda_plan.planar_q6_K_rows: the
// blocks' ql + qh, 192 bytes each, then their 16-byte scales, then their d), since the
// file's 210-byte blocks are only 2-byte aligned.
// Geometry (cuda_plan.matvec_mma_launch): 256 threads, a block per 16 output rows (the gate
// entry: 8 gate rows and the same 8 up rows), grid.x = ceil(rows / 16), and
// the staging ring in dynamic shared memory (cuda_plan.MATVEC_MMA_STAGING_BYTES: the launch
// asks for it, and the function must be allowed it).
//
// The block's 16 rows are one MMA row tile (m16n8k16); its 8 warps take the K-blocks (256
// elements) in turn, warp w blocks w, w + 8, ... Lane 4g + c holds rows g and g + 8 of the tile
// and its quarter c of each of their blocks (matvec_mma_blocks.cuh), every quant byte its own
// lane's: Q4_K's chunk c (two 16-byte pieces a row) and the 16-byte header; Q6_K's three
// runs, its 8 scale bytes and d. Each lane copies its pieces of a K-block into its own slots
// of a two-stage staging ring in dynamic shared memory (cp.async: no registers held while
// they fly) one of its K-blocks ahead, and reads them back once they are in. Its words become
// the A fragments directly (the exact levels as float16 integers), one MMA per word and nibble
// half (Q4_K) or quarter (Q6_K). The B fragment's eight columns are four lanes x (hi, lo):
// column 2c + p holds part p of x at lane c's elements and zero at every other lane's, so
// the tensor cores add each lane's own products (a sub-block of one row) into that lane's
// own accumulators, apart from the other sub-blocks: each lane then applies its sub-blocks'
// scales (and Q4_K's mins) to its own sums, no shuffles. The other lanes' B registers read
// 256 zero bytes.
//
// The activations are split into float16 hi + lo once per block and token, into a shared
// table laid out as the B fragments are read (one 16-byte load per lane gives the fragments of
// two MMAs: a word's two nibble halves), with each 32-element group's 2^e of the split
// (activation_split.cuh) and Q4_K's sub-block float32 sums of x for the mins; the table holds
// TABLE_BLOCKS K-blocks, shared among a pass's tokens, and n_in past a token's share goes in
// pieces, the warps' partial sums carried across.
//
// Numerics: products of exact levels with the float16 parts of x 2^-e (about 22 bits of x, e a
// power-of-two exponent per 32 elements that keeps them in float16's range for any float and
// is 0 for the usual magnitudes), summed in float32 by the tensor cores per sub-block, times
// 2^e (exact), then d * (scale * sum) - dmin * (min * sum(x)) per sub-block in float32 (Q6_K:
// d * the sum over sub-blocks of scale * sum): within the float32 summation bound of the
// exact product of the decoded weights, as the tiles are. (matvec.cu's CUDA-core matvec
// serves the other block types, never a Q4_K or Q6_K matrix.)
// Passes of MMA_MATVEC_TOKENS tokens (the fused QKV: one): each weight fragment unpacked once
// a pass serves the pass's tokens, each with its own MMAs and table; the batch's last odd
// token goes alone.
// Batch invariance: each token goes through the same operations in the same order whatever
// shares its pass (its table, the warps' K-blocks, the lanes' and warps' sums in fixed
// order): a row's result for a token never depends on the batch. A pass reads the weights
// again (from L2 after the first), so the matvec serves steps of up to 8 rows
// (cuda_plan.MATVEC_MMA_MAX_ROWS; the batched product takes more).
#include <type_traits>

#include "activation_ops.cuh"
#include "activation_split.cuh"
#include "device_common.cuh"
#include "matvec_mma_blocks.cuh"
#include "mma_ops.cuh"
#include "qkv_finish_ops.cuh"

constexpr int MMA_MATVEC_WARPS = 8;
constexpr int MMA_MATVEC_ROWS = 16;
constexpr int MMA_MATVEC_THREADS = MMA_MATVEC_WARPS * WARP;
// The staging ring: a thread's pieces of MMA_MATVEC_STAGES of its K-blocks, MMA_MATVEC_PIECES
// 16-byte slots each (the most a block type stages), slot p of every thread side by side
// (consecutive lanes, consecutive 16 bytes: no bank conflicts).
constexpr int MMA_MATVEC_STAGES = 2;
// Tokens a pass of the plain and gate + up entries: each unpacked weight fragment serves both
// (the fused QKV's two block types take one: two in one kernel spill registers).
constexpr int MMA_MATVEC_TOKENS = 2;
constexpr int MMA_MATVEC_PIECES = 8;
extern __shared__ uint4 mma_matvec_staging[];  // STAGES x PIECES x THREADS 16-byte slots
constexpr int K_BLOCK = 256;         // a K-block: one Q4_K or Q6_K block a row
constexpr int TABLE_BLOCKS = 32;     // K-blocks of activations a table holds: 8192 elements
// 16-byte entries a K-block: 4 chunks x 8 words x 2 parts (hi, lo).
constexpr int ENTRIES_PER_BLOCK = 64;
constexpr int ZERO_ENTRIES = 16;     // what the non-owner lanes read for a K-block's 8 words
constexpr int K_BLOCK_GROUPS = K_BLOCK / SPLIT_GROUP;

struct MmaMatvecShared {
    uint4 table[TABLE_BLOCKS * ENTRIES_PER_BLOCK + ZERO_ENTRIES];
    float factors[TABLE_BLOCKS * K_BLOCK_GROUPS];  // per K-block, its groups' 2^e
    float2 sums[TABLE_BLOCKS * 4];  // Q4_K: per K-block, its sub-blocks' sums of x, pairs (2c, 2c+1)
    float partial[MMA_MATVEC_WARPS][MMA_MATVEC_ROWS];
};

// The table of a pass of T tokens as a lane reads it: token t's K-block k of the piece at
// table block t * TABLE_BLOCKS / T + k (`entries`: the lane's entries of table block 0, a
// block `entry_step` on: 0 for the lanes that read the zero entries); the 2^e of its groups
// from the lane's first (`factors`, K_BLOCK_GROUPS a table block) and Q4_K's sums of x of its
// sub-blocks (`sums`, 4 a table block).
template <int T>
struct TableView {
    static constexpr int TOKEN_BLOCKS = TABLE_BLOCKS / T;  // K-blocks of a token a piece
    const uint4* entries;
    int entry_step;
    const float* factors;
    const float2* sums;

    static __device__ int at(int t, int k) { return t * TOKEN_BLOCKS + k; }
    __device__ const uint4* entries_of(int t, int k) const {
        return entries + at(t, k) * entry_step;
    }
    __device__ const float* factors_of(int t, int k) const {
        return factors + at(t, k) * K_BLOCK_GROUPS;
    }
    __device__ float2 sums_of(int t, int k) const { return sums[at(t, k) * 4]; }
};

// A table entry's two MMAs (its B registers .x, .y for the first, .z, .w for the second), each
// adding to its own chain of sums; `start` begins the chains.
__device__ __forceinline__ void entry_mmas(bool start, const uint4& b, const uint32_t (&a_first)[4],
                                           const uint32_t (&a_second)[4], float (&first)[4],
                                           float (&second)[4]) {
    const uint32_t b_first[2] = {b.x, b.y}, b_second[2] = {b.z, b.w};
    if (start) {
        mma_first(first, a_first, b_first);
        mma_first(second, a_second, b_second);
    } else {
        mma(first, a_first, b_first);
        mma(second, a_second, b_second);
    }
}

// The block types' lanes (quarter c of a K-block of rows g and g + 8). Each gives:
//   Lane: the lane's bytes of a K-block; Rows: the lane's addresses in a K-block of its rows,
//   rows_of(row_g, row_g8, n_blocks, c) those in K-block 0, advance(rows, blocks) moves them
//   on; PIECES: the 16-byte staging slots of a K-block; copy(rows, slots, stride): starts
//   copying the K-block into slots[0], slots[stride], ...; read(slots, stride, k, out):
//   K-block k from them, once its copies are in;
//   multiply(lane, entries, factors, sums, c, acc): the K-block's products (its groups' sums
//   times their `factors`, 2^e) added to acc[row];
//   first_element(c, i), SECOND_OFFSET: the elements of table entry i of chunk c (elements
//   first .. first + 3 for the entry's first MMA, SECOND_OFFSET on for its second);
//   GROUP_LANE_BITS: the lane bits (of lane 8c + i, fill_table's item) that vary among the
//   items whose elements share a 32-element group;
//   NEEDS_SUMS: whether multiply reads the sub-blocks' sums of x.

// Q4_K: chunk c of the quants (sub-blocks 2c, 2c + 1) and the header, file layout.
struct MmaQ4K {
    // The lane's first group of a K-block: sub-block 2c's.
    static constexpr __host__ __device__ int first_group(int c) { return 2 * c; }
    static constexpr int SECOND_OFFSET = 32;
    static constexpr int GROUP_LANE_BITS = 0b00111;  // a chunk's 8 items
    static constexpr bool NEEDS_SUMS = true;
    static constexpr __host__ __device__ int first_element(int c, int i) { return 64 * c + 4 * i; }

    struct Lane {
        uint4 head[2], quants[2][2];
    };

    // The lane's addresses in K-block 0 of rows g and g + 8: the header, its chunk.
    struct Rows {
        const uint8_t *head[2], *chunk[2];
    };

    static __device__ __forceinline__ Rows rows_of(const uint8_t* row_g, const uint8_t* row_g8,
                                                   int, int c) {
        return {{row_g, row_g8}, {row_g + 16 + 32 * c, row_g8 + 16 + 32 * c}};
    }

    // Per row: the header, then the chunk's two pieces.
    static constexpr int PIECES = 6;

    static __device__ __forceinline__ void advance(Rows& rows, int blocks) {
        const int64_t bytes = int64_t(blocks) * type_q4_K::BLOCK_BYTES;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            rows.head[r] += bytes;
            rows.chunk[r] += bytes;
        }
    }

    static __device__ __forceinline__ void copy(const Rows& rows, uint4* slots, int stride) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            copy_async<16>(slots + 3 * r * stride, rows.head[r]);
            copy_async<16>(slots + (3 * r + 1) * stride, rows.chunk[r]);
            copy_async<16>(slots + (3 * r + 2) * stride, rows.chunk[r] + 16);
        }
    }

    static __device__ __forceinline__ void read(const uint4* slots, int stride, int,
                                                Lane& out) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            out.head[r] = slots[3 * r * stride];
            out.quants[r][0] = slots[(3 * r + 1) * stride];
            out.quants[r][1] = slots[(3 * r + 2) * stride];
        }
    }

    // 16 MMAs a token (a word's low nibbles, then its high ones, per word; each word's A
    // fragments unpacked once for the T tokens), then each row's two sub-blocks' scales and
    // mins, token by token.
    template <int T>
    static __device__ __forceinline__ void multiply(const Lane& block, const TableView<T>& table,
                                                    int k, int c, float (&acc)[T][2]) {
        // Per token: (row g: hi, lo part; row g + 8: hi, lo) of sub-blocks 2c, 2c + 1
        float low[T][4], high[T][4];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const NibblePairs g = nibble_pairs_of(word_of(block.quants[0][i / 4], i % 4));
            const NibblePairs g8 = nibble_pairs_of(word_of(block.quants[1][i / 4], i % 4));
            auto level = [](uint32_t biased) { return sub_halves(biased, HALF_1024_PAIR); };
            const uint32_t a_low[4] = {level(g.low02), level(g8.low02), level(g.low13),
                                       level(g8.low13)};
            const uint32_t a_high[4] = {level(g.high02), level(g8.high02), level(g.high13),
                                        level(g8.high13)};
#pragma unroll
            for (int t = 0; t < T; ++t) {
                entry_mmas(i == 0, table.entries_of(t, k)[2 * i], a_low, a_high, low[t],
                           high[t]);
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint4 head = block.head[r];
            const LaneScales s = lane_scales(head.y, head.z, head.w, c);
            const float2 d = unpack_halves(head.x);  // d, dmin
#pragma unroll
            for (int t = 0; t < T; ++t) {
                // 2^e of sub-blocks 2c, 2c + 1
                const float2 factor = *reinterpret_cast<const float2*>(table.factors_of(t, k));
                const float2 sums = table.sums_of(t, k);
                // Rounded as written (no contraction left to the compiler), so rows g and
                // g + 8 round alike: the fused gate+up entry puts a row where the plain one
                // may not.
                const float sum_low =
                    __fmul_rn(__fadd_rn(low[t][2 * r], low[t][2 * r + 1]), factor.x);
                const float sum_high =
                    __fmul_rn(__fadd_rn(high[t][2 * r], high[t][2 * r + 1]), factor.y);
                const float scaled =
                    __fmaf_rn(s.scale_high, sum_high, __fmul_rn(s.scale_low, sum_low));
                const float mins = __fmaf_rn(s.min_high, sums.y, __fmul_rn(s.min_low, sums.x));
                acc[t][r] = __fmaf_rn(-d.y, mins, __fmaf_rn(d.x, scaled, acc[t][r]));
            }
        }
    }

    static __device__ __forceinline__ uint32_t word_of(const uint4& q, int i) {
        return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
    }
};

// Q6_K, row-planar: the lane's sub-blocks 8h + 2t + v (h = c / 2, v = c % 2, t = 0..3),
// three 16-byte runs, 8 scale bytes and d a row.
struct MmaQ6K {
    // The lane's first group of a K-block: half c / 2's first quarter.
    static constexpr __host__ __device__ int first_group(int c) { return 4 * (c / 2); }
    static constexpr int SECOND_OFFSET = 64;  // quarter u + 2 beside quarter u
    // The 4 items of a quarter's words in both lanes of a half: c % 2 and i % 4 vary.
    static constexpr int GROUP_LANE_BITS = 0b01011;
    static constexpr bool NEEDS_SUMS = false;
    // Entry i of chunk c: quarter i / 4's word i % 4 (then quarter i / 4 + 2's).
    static constexpr __host__ __device__ int first_element(int c, int i) {
        return 128 * (c / 2) + 16 * (c % 2) + 32 * (i / 4) + 4 * (i % 4);
    }

    struct Lane {
        uint4 runs[2][3];     // per row: ql (quarters 0, 2), ql (1, 3), qh
        uint2 scales[2];      // per row: scales 8h .. 8h + 7
        unsigned short d[2];  // per row: d's bits, converted when multiplied
    };

    // The lane's addresses in a K-block of rows g and g + 8: its first ql run (the second is
    // 32 bytes on), its qh run, its scales and d.
    struct Rows {
        const uint8_t *ql[2], *qh[2], *scales[2], *d[2];
    };

    static __device__ __forceinline__ Rows rows_of(const uint8_t* row_g, const uint8_t* row_g8,
                                                   int n_blocks, int c) {
        const int h = c / 2, v = c % 2;
        const int64_t scales = int64_t(n_blocks) * 192 + 8 * h, d = int64_t(n_blocks) * 208;
        return {{row_g + 64 * h + 16 * v, row_g8 + 64 * h + 16 * v},
                {row_g + 128 + 32 * h + 16 * v, row_g8 + 128 + 32 * h + 16 * v},
                {row_g + scales, row_g8 + scales},
                {row_g + d, row_g8 + d}};
    }

    static __device__ __forceinline__ void advance(Rows& rows, int blocks) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            rows.ql[r] += 192 * blocks;
            rows.qh[r] += 192 * blocks;
            rows.scales[r] += 16 * blocks;
            rows.d[r] += 2 * blocks;
        }
    }

    // Per row its three runs; then both rows' scales (8 bytes each) in one slot, and the
    // 4-byte words holding their d in another: the d plane starts 16-byte aligned (n_blocks x
    // 208 bytes into a 16-byte aligned row), so block k's d is the high half of its word
    // where k is odd, and the word of the last d ends within the row's pitch.
    static constexpr int PIECES = 8;

    static __device__ __forceinline__ void copy(const Rows& rows, uint4* slots, int stride) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            copy_async<16>(slots + 3 * r * stride, rows.ql[r]);
            copy_async<16>(slots + (3 * r + 1) * stride, rows.ql[r] + 32);
            copy_async<16>(slots + (3 * r + 2) * stride, rows.qh[r]);
            copy_async<8>(reinterpret_cast<uint2*>(slots + 6 * stride) + r, rows.scales[r]);
            const uintptr_t d_word = reinterpret_cast<uintptr_t>(rows.d[r]) & ~uintptr_t(3);
            copy_async<4>(reinterpret_cast<uint32_t*>(slots + 7 * stride) + r,
                          reinterpret_cast<const void*>(d_word));
        }
    }

    static __device__ __forceinline__ void read(const uint4* slots, int stride, int k,
                                                Lane& out) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int run = 0; run < 3; ++run) out.runs[r][run] = slots[(3 * r + run) * stride];
        }
        const uint4 scales = slots[6 * stride], d_words = slots[7 * stride];
        out.scales[0] = make_uint2(scales.x, scales.y);
        out.scales[1] = make_uint2(scales.z, scales.w);
        const int d_shift = 16 * (k % 2);
        out.d[0] = static_cast<unsigned short>(d_words.x >> d_shift);
        out.d[1] = static_cast<unsigned short>(d_words.y >> d_shift);
    }

    // Quarter u and u + 2 of word j of row r's runs: their A pairs (the levels less 32).
    template <int QUARTER>
    static __device__ __forceinline__ void quarter_pairs(const Lane& block, int j,
                                                         uint32_t (&a)[4]) {
        uint32_t levels[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            levels[r] = six_bit_levels<QUARTER>(MmaQ4K::word_of(block.runs[r][0], j),
                                                MmaQ4K::word_of(block.runs[r][1], j),
                                                MmaQ4K::word_of(block.runs[r][2], j));
        }
        a[0] = sub_halves(level_pair(levels[0], false), HALF_1056_PAIR);
        a[1] = sub_halves(level_pair(levels[1], false), HALF_1056_PAIR);
        a[2] = sub_halves(level_pair(levels[0], true), HALF_1056_PAIR);
        a[3] = sub_halves(level_pair(levels[1], true), HALF_1056_PAIR);
    }

    // Quarters u and u + 2 (4 MMAs each a token, each word's A fragments unpacked once for
    // the T tokens), their sums scaled into each token's block sum per row (the 2^e of half
    // h's groups, quarter by quarter).
    template <int U, int T>
    static __device__ __forceinline__ void multiply_quarters(const Lane& block,
                                                             const TableView<T>& table, int k,
                                                             int c, float (&block_sum)[T][2]) {
        float first[T][4], second[T][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint32_t a_first[4], a_second[4];
            quarter_pairs<U>(block, j, a_first);
            quarter_pairs<U + 2>(block, j, a_second);
#pragma unroll
            for (int t = 0; t < T; ++t) {
                entry_mmas(j == 0, table.entries_of(t, k)[2 * (4 * U + j)], a_first, a_second,
                           first[t], second[t]);
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint2 sc = block.scales[r];
            const float scale_first = q6_K_lane_scale(sc.x, sc.y, U, c % 2);
            const float scale_second = q6_K_lane_scale(sc.x, sc.y, U + 2, c % 2);
#pragma unroll
            for (int t = 0; t < T; ++t) {
                const float* factors = table.factors_of(t, k);
                const float sum_first =
                    __fmul_rn(__fadd_rn(first[t][2 * r], first[t][2 * r + 1]), factors[U]);
                const float sum_second =
                    __fmul_rn(__fadd_rn(second[t][2 * r], second[t][2 * r + 1]), factors[U + 2]);
                const float scaled =
                    __fmaf_rn(scale_second, sum_second, __fmul_rn(scale_first, sum_first));
                block_sum[t][r] = U == 0 ? scaled : __fadd_rn(block_sum[t][r], scaled);
            }
        }
    }

    template <int T>
    static __device__ __forceinline__ void multiply(const Lane& block, const TableView<T>& table,
                                                    int k, int c, float (&acc)[T][2]) {
        float block_sum[T][2];
        multiply_quarters<0>(block, table, k, c, block_sum);
        multiply_quarters<1>(block, table, k, c, block_sum);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float d = half_to_float(block.d[r]);
#pragma unroll
            for (int t = 0; t < T; ++t) acc[t][r] = __fmaf_rn(d, block_sum[t][r], acc[t][r]);
        }
    }
};

// Whether the items on the lanes that differ from lane 8c + i in Block::GROUP_LANE_BITS alone
// are exactly those whose elements share the 32-element groups of item (c, i)'s.
template <class Block>
__host__ __device__ constexpr bool group_lanes_hold_whole_groups() {
    for (int lane = 0; lane < WARP; ++lane) {
        for (int other = 0; other < WARP; ++other) {
            const bool same_lanes = (lane & ~Block::GROUP_LANE_BITS) ==
                                    (other & ~Block::GROUP_LANE_BITS);
            const bool same_group = Block::first_element(lane / 8, lane % 8) / SPLIT_GROUP ==
                                    Block::first_element(other / 8, other % 8) / SPLIT_GROUP;
            if (same_lanes != same_group) return false;
        }
    }
    return Block::SECOND_OFFSET % SPLIT_GROUP == 0;  // the second run's group: as the first's
}

// The lanes of lane 0's group (bit l: lane l), as group_lanes_hold_whole_groups reads them.
template <class Block>
__host__ __device__ constexpr uint32_t lane_zero_group() {
    uint32_t lanes = 0;
    for (int lane = 0; lane < WARP; ++lane) {
        if ((lane & ~Block::GROUP_LANE_BITS) == 0) lanes |= 1u << lane;
    }
    return lanes;
}

// Largest magnitude of 4 floats.
__device__ __forceinline__ uint32_t largest_magnitude(const float4& v) {
    return max(max(magnitude_bits(v.x), magnitude_bits(v.y)),
               max(magnitude_bits(v.z), magnitude_bits(v.w)));
}

// K-blocks [first, first + count) of one activation row into the table from its block `at`:
// an item per (block,
// chunk c, entry i) splits elements e .. e + 3 (e = first_element(c, i)) and e + SECOND_OFFSET
// .. + 3, each run scaled by 2^-e of its group (the items of a group find its exponent in one
// warp reduction over their lanes; the group's first item stores 2^e), into the hi entry and
// the lo entry (each: the first MMA's two B registers, then the second's); for Q4_K the eight
// items of a chunk sum its sub-blocks in one fixed shuffle tree.
template <class Block>
__device__ void fill_table(const float* __restrict__ x, int first, int count, int at,
                           MmaMatvecShared& shared) {
    static_assert(group_lanes_hold_whole_groups<Block>(), "a group's exponent from its lanes");
    constexpr uint32_t GROUP_LANES = lane_zero_group<Block>();
    for (int item = threadIdx.x; item < count * 32; item += blockDim.x) {  // whole warps
        const int block = item / 32, c = item / 8 % 4, i = item % 8;
        const int element = Block::first_element(c, i);
        const float* elements = x + int64_t(first + block) * K_BLOCK + element;
        const float4 low = *reinterpret_cast<const float4*>(elements);
        const float4 high = *reinterpret_cast<const float4*>(elements + Block::SECOND_OFFSET);
        const uint32_t group_lanes = GROUP_LANES << (item % WARP & ~Block::GROUP_LANE_BITS);
        const int e_low = split_exponent(__reduce_max_sync(group_lanes, largest_magnitude(low)));
        const int e_high =
            split_exponent(__reduce_max_sync(group_lanes, largest_magnitude(high)));
        const float down_low = power_of_two(-e_low), down_high = power_of_two(-e_high);
        uint4 hi, lo;
        split_pair(__fmul_rn(low.x, down_low), __fmul_rn(low.z, down_low), &hi.x, &lo.x);
        split_pair(__fmul_rn(low.y, down_low), __fmul_rn(low.w, down_low), &hi.y, &lo.y);
        split_pair(__fmul_rn(high.x, down_high), __fmul_rn(high.z, down_high), &hi.z, &lo.z);
        split_pair(__fmul_rn(high.y, down_high), __fmul_rn(high.w, down_high), &hi.w, &lo.w);
        if (element % SPLIT_GROUP == 0) {
            float* factors =
                shared.factors + (at + block) * K_BLOCK_GROUPS + element / SPLIT_GROUP;
            factors[0] = power_of_two(e_low);
            factors[Block::SECOND_OFFSET / SPLIT_GROUP] = power_of_two(e_high);
        }
        uint4* entry = shared.table + (at + block) * ENTRIES_PER_BLOCK + (8 * c + i) * 2;
        entry[0] = hi;
        entry[1] = lo;
        if constexpr (Block::NEEDS_SUMS) {
            float2 sums = make_float2((low.x + low.y) + (low.z + low.w),
                                      (high.x + high.y) + (high.z + high.w));
#pragma unroll
            for (int offset = 1; offset < 8; offset *= 2) {
                sums.x += __shfl_xor_sync(FULL_MASK, sums.x, offset);
                sums.y += __shfl_xor_sync(FULL_MASK, sums.y, offset);
            }
            if (i == 0) shared.sums[(at + block) * 4 + c] = sums;
        }
    }
}

// Tokens b .. b + T - 1 through the block's 16 rows (`rows`: this lane's addresses in their
// K-block 0): their dot products into acc[t][row g, row g + 8] of this lane's chunk, each
// token's in the same operations and order whatever T. The table holds TABLE_BLOCKS / T
// K-blocks of each token a piece.
template <class Block, int T>
__device__ void mma_matvec_pass(const typename Block::Rows& rows, const TableView<T>& table,
                                const float* __restrict__ x, int x_stride, int n_blocks, int b,
                                MmaMatvecShared& shared, float (&acc)[T][2]) {
    static_assert(Block::PIECES <= MMA_MATVEC_PIECES, "a K-block's pieces fit a stage");
    static_assert(MMA_MATVEC_STAGES == 2, "the loop copies one K-block ahead");
    const int warp = threadIdx.x / WARP, c = threadIdx.x % 4;
    // K-block k's products from its copies in `stage`, once they are in.
    auto multiply_staged = [&](int k, const uint4* stage) {
        typename Block::Lane block;
        Block::read(stage, MMA_MATVEC_THREADS, k, block);
        Block::template multiply<T>(block, table, k, c, acc);
    };
    for (int first = 0; first < n_blocks; first += table.TOKEN_BLOCKS) {
        const int count = min(table.TOKEN_BLOCKS, n_blocks - first);
        // The warp's K-blocks k = warp, warp + 8, ... of the piece, in the two stages of its
        // threads' slots in turn: each block's copies (a group) are issued before the MMAs of
        // the block before it, into the stage that block's copies were read from (its MMAs
        // took those registers), and the last block of the piece is multiplied after the loop
        // (a loop without a branch to skip the copy past it). The first copies fly while the
        // table fills; every copy of a piece is read inside it.
        typename Block::Rows at = rows;
        Block::advance(at, first + warp);
        // This thread's slots of block k's stage from mma_matvec_staging + stage; the other
        // stage's STAGE_SLOTS on or back.
        constexpr int STAGE_SLOTS = MMA_MATVEC_PIECES * MMA_MATVEC_THREADS;
        uint4* const slots = mma_matvec_staging + threadIdx.x;
        int stage = 0;
        if (warp < count) Block::copy(at, slots, MMA_MATVEC_THREADS);
        commit_copies();
        Block::advance(at, MMA_MATVEC_WARPS);  // block k + 8's
        __syncthreads();  // the previous piece's table is read
#pragma unroll
        for (int t = 0; t < T; ++t) {
            fill_table<Block>(x + int64_t(b + t) * x_stride, first, count, table.at(t, 0),
                              shared);
        }
        __syncthreads();
        int k = warp;
#pragma unroll 1  // a K-block an iteration: the budget tool reads its SASS per weight byte
        for (; k + MMA_MATVEC_WARPS < count; k += MMA_MATVEC_WARPS) {
            Block::copy(at, slots + (stage ^ STAGE_SLOTS), MMA_MATVEC_THREADS);
            commit_copies();
            Block::advance(at, MMA_MATVEC_WARPS);
            wait_copies<1>();  // block k's copies are in
            multiply_staged(k, slots + stage);
            stage ^= STAGE_SLOTS;
        }
        if (k < count) {
            wait_copies<0>();
            multiply_staged(k, slots + stage);
        }
    }
}

// The block's 16 rows (row_g, row_g8: this lane's rows g and g + 8) times each activation
// row, T rows a pass (each unpacked weight fragment serving them all) and one at a time past
// the last whole pass; epilogue(total, b) stores token b's results, total(r) = row r's dot
// product.
template <class Block, int T, class Epilogue>
__device__ void mma_matvec(const uint8_t* __restrict__ row_g, const uint8_t* __restrict__ row_g8,
                           const float* __restrict__ x, int x_stride, int n_in, int batch,
                           MmaMatvecShared& shared, Epilogue epilogue) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int g = lane / 4, c = lane % 4;
    // B registers: lane 4n + c' holds column n for lane c''s k, so it reads part n % 2 of
    // chunk c' where n / 2 == c' and zeros elsewhere.
    const int column = lane / 4;
    const bool owner = column / 2 == c;
    const uint4* entries = owner ? shared.table + 16 * c + column % 2
                                 : shared.table + TABLE_BLOCKS * ENTRIES_PER_BLOCK;
    const int entry_step = owner ? ENTRIES_PER_BLOCK : 0;
    const float* factors = shared.factors + Block::first_group(c);
    const float2* sums = shared.sums + c;
    if (threadIdx.x < ZERO_ENTRIES) {
        shared.table[TABLE_BLOCKS * ENTRIES_PER_BLOCK + threadIdx.x] = make_uint4(0, 0, 0, 0);
    }
    const int n_blocks = n_in / K_BLOCK;
    const typename Block::Rows rows = Block::rows_of(row_g, row_g8, n_blocks, c);
    // Token b's sums of the 16 rows (acc: this lane's chunk of rows g, g + 8) to `epilogue`.
    auto finish = [&](float (&acc)[2], int b) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // the chunks' sums of a row, in one fixed tree
            acc[r] += __shfl_xor_sync(FULL_MASK, acc[r], 1);
            acc[r] += __shfl_xor_sync(FULL_MASK, acc[r], 2);
        }
        if (c == 0) {
            shared.partial[warp][g] = acc[0];
            shared.partial[warp][g + 8] = acc[1];
        }
        __syncthreads();
        auto total = [&](int r) {
            float sum = shared.partial[0][r];
#pragma unroll
            for (int w = 1; w < MMA_MATVEC_WARPS; ++w) sum += shared.partial[w][r];
            return sum;
        };
        epilogue(total, b);
        __syncthreads();  // partial is rewritten by the next token
    };
    int b = 0;
    for (; b + T <= batch; b += T) {
        float acc[T][2] = {};
        mma_matvec_pass<Block, T>(rows, {entries, entry_step, factors, sums}, x, x_stride,
                                  n_blocks, b, shared, acc);
#pragma unroll
        for (int t = 0; t < T; ++t) finish(acc[t], b + t);
    }
    if constexpr (T > 1) {
        for (; b < batch; ++b) {
            float acc[1][2] = {};
            mma_matvec_pass<Block, 1>(rows, {entries, entry_step, factors, sums}, x, x_stride,
                                      n_blocks, b, shared, acc);
            finish(acc[0], b);
        }
    }
}

// Two blocks per SM at least (16 resident warps): ptxas may take up to 128 registers.
#define QK_MMA_MATVEC_BOUNDS __launch_bounds__(MMA_MATVEC_THREADS, 2)

// Block `block` of a matrix's 16-row blocks (rows [16 block, 16 block + 16) of y's columns).
template <class Block, int T>
__device__ void mma_matvec_rows(const uint8_t* weights, int64_t row_pitch, const float* x,
                                int x_stride, float* y, int y_stride, int rows, int n_in,
                                int batch, int block, MmaMatvecShared& shared) {
    const int first = block * MMA_MATVEC_ROWS, g = threadIdx.x % WARP / 4;
    // Rows past the matrix read row 0 (a valid address) and are never stored.
    auto row_at = [&](int r) { return weights + (r < rows ? r : 0) * row_pitch; };
    auto store = [&](auto total, int b) {
        const int r = threadIdx.x;
        if (r < MMA_MATVEC_ROWS && first + r < rows) {
            y[int64_t(b) * y_stride + first + r] = total(r);
        }
    };
    mma_matvec<Block, T>(row_at(first + g), row_at(first + g + 8), x, x_stride, n_in, batch,
                         shared, store);
}

// Tile rows g are gate rows, rows g + 8 the same up rows: 8 feed-forward rows a block.
template <class Block, class Op>
__device__ void mma_matvec_gate_up(const uint8_t* gate_w, const uint8_t* up_w,
                                   int64_t row_pitch, const float* x, int x_stride, float* y,
                                   int y_stride, int ffn_rows, int n_in, int batch,
                                   MmaMatvecShared& shared) {
    constexpr int HALF = MMA_MATVEC_ROWS / 2;
    const int first = blockIdx.x * HALF, g = threadIdx.x % WARP / 4;
    const int64_t offset = (first + g < ffn_rows ? first + g : 0) * row_pitch;
    auto store = [&](auto total, int b) {
        const int f = threadIdx.x;
        if (f < HALF && first + f < ffn_rows) {
            y[int64_t(b) * y_stride + first + f] = Op::apply(total(f)) * total(f + HALF);
        }
    };
    mma_matvec<Block, MMA_MATVEC_TOKENS>(gate_w + offset, up_w + offset, x, x_stride, n_in,
                                         batch, shared, store);
}

#define QK_MMA_MATVEC_ENTRIES(suffix, block)                                                   \
    extern "C" __global__ void QK_MMA_MATVEC_BOUNDS mul_mat_vec_mma_##suffix(                  \
        const uint8_t* weights, int64_t row_pitch, const float* x, int x_stride, float* y,     \
        int y_stride, int rows, int n_in, int batch) {                                         \
        __shared__ MmaMatvecShared shared;                                                     \
        mma_matvec_rows<block, MMA_MATVEC_TOKENS>(weights, row_pitch, x, x_stride, y,           \
                                                  y_stride, rows, n_in, batch, blockIdx.x,     \
                                                  shared);                                     \
    }                                                                                          \
    QK_MMA_GATE_UP_ENTRY(silu, silu_op, suffix, block)                                         \
    QK_MMA_GATE_UP_ENTRY(gelu_tanh, gelu_tanh_op, suffix, block)

#define QK_MMA_GATE_UP_ENTRY(act, op, suffix, block)                                           \
    extern "C" __global__ void QK_MMA_MATVEC_BOUNDS mul_mat_vec_mma_gate_up_##act##_##suffix(  \
        const uint8_t* gate_w, const uint8_t* up_w, int64_t row_pitch, const float* x,         \
        int x_stride, float* y, int y_stride, int ffn_rows, int n_in, int batch) {             \
        __shared__ MmaMatvecShared shared;                                                     \
        mma_matvec_gate_up<block, op>(gate_w, up_w, row_pitch, x, x_stride, y, y_stride,       \
                                      ffn_rows, n_in, batch, shared);                          \
    }

QK_MMA_MATVEC_ENTRIES(q4_K, MmaQ4K)
QK_MMA_MATVEC_ENTRIES(q6_K, MmaQ6K)

// The lane traits of a quant_blocks.cuh block type, where this kernel has them.
template <class T>
struct mma_lanes_of {
    using type = void;
};
template <>
struct mma_lanes_of<type_q4_K> {
    using type = MmaQ4K;
};
template <>
struct mma_lanes_of<type_q6_K> {
    using type = MmaQ6K;
};

template <class T>
__device__ void mma_qkv_segment(const QkvSegment& seg, const float* x, int x_stride,
                                float* y, int y_stride, int n_in, int batch,
                                MmaMatvecShared& shared) {
    using Lanes = typename mma_lanes_of<T>::type;
    if constexpr (std::is_void_v<Lanes>) {
        __trap();  // cuda_plan launches it only for the types this kernel serves
    } else {
        mma_matvec_rows<Lanes, 1>(seg.weights, seg.pitch, x, x_stride, y + seg.column, y_stride,
                               seg.rows, n_in, batch, int(blockIdx.x) - seg.block_first,
                               shared);
    }
}

// Type codes: the order of QK_FOR_EACH_TYPE (= cuda_plan.KERNEL_TYPE_SUFFIX).
#define QK_MMA_QKV_CASE(suffix, type)                                                 \
    if (seg.type_code == code++) {                                                    \
        mma_qkv_segment<type>(seg, x, x_stride, y, y_stride, n_in, batch, shared);    \
        return;                                                                       \
    }

__device__ void mma_qkv_segment_of_its_type(const QkvSegment& seg, const float* x,
                                            int x_stride, float* y, int y_stride, int n_in,
                                            int batch, MmaMatvecShared& shared) {
    int code = 0;  // the segment's type is block-uniform: every thread takes the same case
    QK_FOR_EACH_TYPE(QK_MMA_QKV_CASE)
}

extern "C" __global__ void QK_MMA_MATVEC_BOUNDS mul_mat_vec_mma_qkv(QK_QKV_PARAMETERS) {
    __shared__ MmaMatvecShared shared;
    // The activation table holds a head_dim copy a warp once the products are done with it.
    fused_qkv_block<MMA_MATVEC_ROWS>(
        QkvBlock{int(blockIdx.x), MMA_MATVEC_ROWS, 0, batch, head_counters},
        reinterpret_cast<float*>(shared.table),
        [&](const QkvSegment& seg) {
            mma_qkv_segment_of_its_type(seg, x, x_stride, y, y_stride, n_in, batch, shared);
        },
        QK_QKV_ARGUMENTS);
}
