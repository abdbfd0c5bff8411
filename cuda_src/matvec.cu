// Decode matrix x activations, float32: y[b][r] = sum_i W[r][i] * x[b][i] for any batch >= 1.
//
// The CUDA-core matvec: the fallback of the matvec rows (decode steps of up to 8 rows, short
// prompts) for the block types the tensor cores' matvec (matvec_mma.cu: Q4_K, Q6_K) does not
// serve.
//
// Entry points (<type>: q4_0 q4_1 q5_0 q5_1 q8_0 q5_K f32 f16 bf16, cuda_plan.MATVEC_TYPES;
// <act>: silu, gelu_tanh):
//   mul_mat_vec_<type>(weights, int64 row_pitch, x, int x_stride, y, int y_stride, int rows,
//                      int n_in, int batch)
//       y[b][r] = W[r] . x[b] for r < rows, b < batch.
//   mul_mat_vec_gate_up_<act>_<type>(gate_w, up_w, int64 row_pitch, x, int x_stride, y,
//                                    int y_stride, int ffn_rows, int n_in, int batch)
//       y[b][r] = act(gate[r] . x[b]) * (up[r] . x[b]), act exactly as activation.cu's
//       gated_<act>: bit for bit mul_mat_vec_<type> on both matrices, then gated_<act>.
//   mul_mat_vec_qkv(w_q, int64 pitch_q, int type_q, int rows_q, w_k, int64 pitch_k, int type_k,
//                   int rows_k, w_v, int64 pitch_v, int type_v, int rows_v, x, int x_stride, y,
//                   int y_stride, int n_in, int batch, int head_dim, q_bias, k_bias, v_bias,
//                   q_norm, k_norm, float eps, positions, int rope_dim, double base,
//                   freq_factors, int neox, slots, k_cache, v_cache, int* head_counters)
//       three matrices of possibly different block types, each with an entry above (type
//       code: the index of the type in cuda_plan.KERNEL_TYPE_SUFFIX), y rows = q | k | v concatenated (rows_q + rows_k +
//       rows_v wide, each a whole number of heads of head_dim), each product bit for bit
//       mul_mat_vec_<type> of its matrix; then every head of every row finished as
//       qkv_finish.cu does (from head_dim on, its arguments after n_kv_heads; positions and
//       slots per activation row): bit for bit mul_mat_vec_<type> x3 then qkv_finish, y and
//       both caches. The block that stores a head's last rows finishes it: a block counts
//       itself on each head its rows touch (head_counters[n_heads + 2 n_kv_heads], zero
//       before the first launch; the last block of a head sets its counter back to zero).
//
// Layouts (the CUDA backend must follow them):
//   weights  rows of the GGUF tensor as stored in the file, each row at `row_pitch` bytes
//            from the previous one; row_pitch is the row's bytes rounded up to 16 and the
//            base is 16-byte aligned (cuda_plan.row_pitch). n_in % 32 == 0 (K-quants: 256);
//            n_in <= 131,072 for Q4_1, Q5_1, Q4_K, Q5_K (their run sums of x in shared memory).
//   x        float32 [batch][x_stride], x_stride % 4 == 0, 16-byte aligned.
//   y        float32 [batch][y_stride] (a stride lets gate and up share one buffer).
//
// Geometry (cuda_plan.matvec_launch): blockDim = (32 * MATVEC_WARPS / splits, splits), splits
// a power of two <= MATVEC_WARPS chosen from n_in alone; grid.x = ceil(rows / rows per block),
// MATVEC_ROWS_PER_WARP rows per warp. A warp's lanes form MATVEC_ROWS_PER_WARP groups of
// MATVEC_LANES_PER_ROW; every group walks the same slices (matvec_slices.cuh: 32 weights,
// 16-byte loads where the block type's alignment allows) of its own row, so one x load serves
// all the warp's rows and lanes of a group read neighbouring weight bytes. Warp y = split s
// takes the row's K-blocks [s n / splits, (s + 1) n / splits); the lanes of a group meet in
// shuffles, the splits in shared memory, summed in split order.
//
// Batch invariance: activation rows go in chunks of up to MATVEC_CHUNK (each slice decoded once
// per chunk, its weights then held in registers for the chunk's rows; weights reach DRAM once,
// the later chunks find them in L2); a lone row takes a loop of its own. Row b's result takes
// the same operations in the same order whatever the batch, and whichever entry point computes
// it: bit for bit the same.
// Accuracy: each slice's dot product is the factored form of matvec_slices.cuh; the result is
// within the float32 summation bound of the exact product of the decoded weights.
#include "activation_ops.cuh"
#include "device_common.cuh"
#include "matvec_slices.cuh"
#include "qkv_finish_ops.cuh"

constexpr int MATVEC_WARPS = 8;
constexpr int MATVEC_ROWS_PER_WARP = 4;
constexpr int MATVEC_LANES_PER_ROW = WARP / MATVEC_ROWS_PER_WARP;
constexpr int MATVEC_CHUNK = 8;
constexpr int MATVEC_MAX_ROWS_PER_BLOCK = MATVEC_WARPS * MATVEC_ROWS_PER_WARP;
// Run sums of x held per block: 8 activation rows a chunk for n_in <= 16,384, fewer beyond,
// one up to n_in = 131,072 (the affine types' limit).
constexpr int MATVEC_TABLE_FLOATS = 8192;

// Per block: each (split, row) pair's sum for the chunk's activation rows, and for the affine
// types the sums of the chunk's 16-element runs of x (run_sum; [row][run]), taken once per
// block instead of once per weight row.
struct MatvecShared {
    float partial[MATVEC_MAX_ROWS_PER_BLOCK][MATVEC_CHUNK];  // [split * rows per block + row]
    float run_sums[MATVEC_TABLE_FLOATS];
};

// Lane `lane` of its row group: the row's dot products with activation rows [b0, b0 + count)
// over the split's K-blocks, one partial sum per lane. A lane keeps one slice index and walks
// the blocks MATVEC_LANES_PER_ROW / SLICES apart, so its pointers advance by constants.
// CHUNK: the activation rows this instantiation can take (1: the lone row of a batch of one,
// or the last of 9). run_sums: the chunk's run sums of x (affine types; n_in / RUN a row).
template <class T, int CHUNK>
__device__ void lane_partials(const uint8_t* __restrict__ row, int n_in, int split, int splits,
                              int lane, const float* __restrict__ x, int x_stride, int b0,
                              int count, const float* run_sums, float (&acc)[CHUNK]) {
    using S = slices_of<T>;
    static_assert(MATVEC_LANES_PER_ROW % S::SLICES == 0, "a lane keeps its slice index");
    constexpr int STEP = MATVEC_LANES_PER_ROW / S::SLICES;  // blocks between a lane's slices
    const int n_blocks = n_in / T::BLOCK_ELEMENTS;
    const int last = (split + 1) * n_blocks / splits;
    const int slice = lane % S::SLICES;
    int block = split * n_blocks / splits + lane / S::SLICES;
    const uint8_t* w = row + int64_t(block) * T::BLOCK_BYTES;
    const float* xs = x + int64_t(block) * T::BLOCK_ELEMENTS + int64_t(b0) * x_stride;
    const float* sums = run_sums + block * (T::BLOCK_ELEMENTS / RUN);
#pragma unroll
    for (int j = 0; j < CHUNK; ++j) acc[j] = 0.0f;
    // A lone row's loop loads the next slice's words before it multiplies this one: each
    // lane keeps a slice's loads in flight while it computes (the one-row matvec measured
    // latency-bound when a pass waited for its own loads at its top). Past the split's last
    // block the load repeats the current slice's words (in L1), so no address leaves the row.
    // The chunk loop (8 rows a slice) has the registers for neither, nor the need.
    constexpr bool PREFETCH = CHUNK == 1 && sizeof(typename S::Raw) <= 9 * sizeof(uint32_t);
    typename S::Raw raw;
    if (PREFETCH && block < last) S::load(w, slice, raw);
#pragma unroll 1  // one slice a pass: the budget tool reads the pass's SASS per weight byte
    for (; block < last; block += STEP, w += STEP * T::BLOCK_BYTES,
                         xs += STEP * T::BLOCK_ELEMENTS,
                         sums += STEP * (T::BLOCK_ELEMENTS / RUN)) {
        Slice s;
        if constexpr (PREFETCH) {
            typename S::Raw next;
            S::load(block + STEP < last ? w + STEP * T::BLOCK_BYTES : w, slice, next);
            S::unpack(w, raw, slice, s);
            raw = next;
        } else {
            S::slice(w, slice, s);
        }
#pragma unroll
        for (int j = 0; j < CHUNK; ++j) {
            if (j < count) {
                acc[j] = slice_dot<S::AFFINE>(s, xs + int64_t(j) * x_stride, acc[j],
                                              sums + j * (n_in / RUN));
            }
        }
    }
}

// The block's rows: row `local` (< MATVEC_MAX_ROWS_PER_BLOCK) of the block, or nullptr.
// For every chunk of activation rows, `epilogue(total, count, b0)` gets a function
// total(local, j) = row local's dot product with activation row b0 + j.
template <class T, class RowAt, class Epilogue>
__device__ void matvec_block(RowAt row_at, const float* __restrict__ x, int x_stride, int n_in,
                             int batch, MatvecShared& shared, Epilogue epilogue) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int group = lane / MATVEC_LANES_PER_ROW, member = lane % MATVEC_LANES_PER_ROW;
    const int split = threadIdx.y, splits = blockDim.y;
    const int local = warp * MATVEC_ROWS_PER_WARP + group;
    const int per_block = blockDim.x / WARP * MATVEC_ROWS_PER_WARP;
    const uint8_t* row = row_at(local);  // nullptr past the matrix: no loads, no result
    const int threads = blockDim.x * blockDim.y;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    // An affine type's run sums come from a table the block fills once per chunk of
    // activation rows (as many rows as it holds, up to MATVEC_CHUNK), the others' need none.
    constexpr bool AFFINE = slices_of<T>::AFFINE;
    const int runs = n_in / RUN;
    if (AFFINE && runs > MATVEC_TABLE_FLOATS) __trap();  // past the contract: fail loudly
    const int chunk = AFFINE ? min(MATVEC_CHUNK, MATVEC_TABLE_FLOATS / runs) : MATVEC_CHUNK;
    for (int b0 = 0; b0 < batch; b0 += chunk) {
        const int count = min(chunk, batch - b0);
        if (AFFINE) {
            for (int e = tid; e < count * runs; e += threads) {
                shared.run_sums[e] = run_sum(x + int64_t(b0 + e / runs) * x_stride +
                                             (e % runs) * RUN);
            }
            __syncthreads();
        }
        float acc[MATVEC_CHUNK] = {};
        if (row != nullptr && count == 1) {  // block-uniform: the batch-1 headline's own loop
            float lone[1];
            lane_partials<T, 1>(row, n_in, split, splits, member, x, x_stride, b0, count,
                                shared.run_sums, lone);
            acc[0] = lone[0];
        } else if (row != nullptr) {
            lane_partials<T, MATVEC_CHUNK>(row, n_in, split, splits, member, x, x_stride, b0,
                                           count, shared.run_sums, acc);
        }
#pragma unroll
        for (int j = 0; j < MATVEC_CHUNK; ++j) {  // every lane: the shuffles are warp-wide
#pragma unroll
            for (int offset = MATVEC_LANES_PER_ROW / 2; offset > 0; offset /= 2) {
                acc[j] += __shfl_xor_sync(FULL_MASK, acc[j], offset);
            }
        }
        if (member == 0) {
#pragma unroll
            for (int j = 0; j < MATVEC_CHUNK; ++j) {
                shared.partial[split * per_block + local][j] = acc[j];
            }
        }
        __syncthreads();
        auto total = [&](int r, int j) {
            float sum = shared.partial[r][j];
            for (int s = 1; s < splits; ++s) sum += shared.partial[s * per_block + r][j];
            return sum;
        };
        epilogue(total, tid, threads, count, b0);
        __syncthreads();  // partial is rewritten by the next chunk
    }
}

// Rows per block of a launch: the warps of one split, MATVEC_ROWS_PER_WARP rows each.
__device__ __forceinline__ int rows_per_block() {
    return blockDim.x / WARP * MATVEC_ROWS_PER_WARP;
}

template <class T>
__device__ void mul_mat_vec(const uint8_t* __restrict__ weights, int64_t row_pitch,
                            const float* __restrict__ x, int x_stride, float* __restrict__ y,
                            int y_stride, int rows, int n_in, int batch, MatvecShared& shared) {
    const int per_block = rows_per_block(), first = blockIdx.x * per_block;
    const int here = min(per_block, rows - first);
    auto row_at = [&](int local) -> const uint8_t* {
        return local < here ? weights + (first + local) * row_pitch : nullptr;
    };
    matvec_block<T>(row_at, x, x_stride, n_in, batch, shared,
                    [&](auto total, int tid, int threads, int count, int b0) {
                        for (int e = tid; e < here * count; e += threads) {
                            const int r = e % here, j = e / here;
                            y[int64_t(b0 + j) * y_stride + first + r] = total(r, j);
                        }
                    });
}

// Gate and up rows interleaved: block-local row 2i is gate row first + i, 2i + 1 up row.
template <class T, class Op>
__device__ void mul_mat_vec_gate_up(const uint8_t* __restrict__ gate_w,
                                    const uint8_t* __restrict__ up_w, int64_t row_pitch,
                                    const float* __restrict__ x, int x_stride,
                                    float* __restrict__ y, int y_stride, int ffn_rows, int n_in,
                                    int batch, MatvecShared& shared) {
    const int per_block = rows_per_block() / 2, first = blockIdx.x * per_block;
    const int here = min(per_block, ffn_rows - first);
    auto row_at = [&](int local) -> const uint8_t* {
        if (local / 2 >= here) return nullptr;
        return (local % 2 ? up_w : gate_w) + (first + local / 2) * row_pitch;
    };
    matvec_block<T>(row_at, x, x_stride, n_in, batch, shared,
                    [&](auto total, int tid, int threads, int count, int b0) {
                        for (int e = tid; e < here * count; e += threads) {
                            const int r = e % here, j = e / here;
                            y[int64_t(b0 + j) * y_stride + first + r] =
                                Op::apply(total(2 * r, j)) * total(2 * r + 1, j);
                        }
                    });
}

// The types with entries here (matvec_slices.cuh's QK_FOR_EACH_MATVEC_TYPE): those
// mul_mat_vec_mma does not serve.
template <class T>
constexpr bool has_matvec_entry = false;
#define QK_HAS_MATVEC_ENTRY(suffix, type) \
    template <>                           \
    constexpr bool has_matvec_entry<type> = true;
QK_FOR_EACH_MATVEC_TYPE(QK_HAS_MATVEC_ENTRY)

template <class T>
__device__ void qkv_segment(const QkvSegment& seg, const float* __restrict__ x, int x_stride,
                            float* __restrict__ y, int y_stride, int n_in, int batch,
                            MatvecShared& shared) {
    if constexpr (!has_matvec_entry<T>) {
        __trap();  // cuda_plan launches it only where mul_mat_vec_mma serves none of q, k, v
    } else {
        const int per_block = rows_per_block();
        const int first = (int(blockIdx.x) - seg.block_first) * per_block;
        const int here = min(per_block, seg.rows - first);
        auto row_at = [&](int local) -> const uint8_t* {
            return local < here ? seg.weights + (first + local) * seg.pitch : nullptr;
        };
        matvec_block<T>(row_at, x, x_stride, n_in, batch, shared,
                        [&](auto total, int tid, int threads, int count, int b0) {
                            for (int e = tid; e < here * count; e += threads) {
                                const int r = e % here, j = e / here;
                                y[int64_t(b0 + j) * y_stride + seg.column + first + r] =
                                    total(r, j);
                            }
                        });
    }
}

// Two blocks per SM at least (16 resident warps): ptxas may take up to 128 registers.
#define QK_MATVEC_BOUNDS __launch_bounds__(MATVEC_WARPS * WARP, 2)

#define QK_MATVEC_ENTRY(suffix, type)                                                          \
    extern "C" __global__ void QK_MATVEC_BOUNDS mul_mat_vec_##suffix(                          \
        const uint8_t* weights, int64_t row_pitch, const float* x, int x_stride, float* y,     \
        int y_stride, int rows, int n_in, int batch) {                                         \
        __shared__ MatvecShared shared;                                                        \
        mul_mat_vec<type>(weights, row_pitch, x, x_stride, y, y_stride, rows, n_in, batch,     \
                          shared);                                                             \
    }

#define QK_GATE_UP_ENTRY(act, op, suffix, type)                                                \
    extern "C" __global__ void QK_MATVEC_BOUNDS mul_mat_vec_gate_up_##act##_##suffix(          \
        const uint8_t* gate_w, const uint8_t* up_w, int64_t row_pitch, const float* x,         \
        int x_stride, float* y, int y_stride, int ffn_rows, int n_in, int batch) {             \
        __shared__ MatvecShared shared;                                                        \
        mul_mat_vec_gate_up<type, op>(gate_w, up_w, row_pitch, x, x_stride, y, y_stride,       \
                                      ffn_rows, n_in, batch, shared);                          \
    }
#define QK_GATE_UP_ENTRIES(suffix, type)                    \
    QK_GATE_UP_ENTRY(silu, silu_op, suffix, type)           \
    QK_GATE_UP_ENTRY(gelu_tanh, gelu_tanh_op, suffix, type)

QK_FOR_EACH_MATVEC_TYPE(QK_MATVEC_ENTRY)
QK_FOR_EACH_MATVEC_TYPE(QK_GATE_UP_ENTRIES)

// The block's rows of its segment, bit for bit mul_mat_vec_<type> of the segment's matrix.
// Type codes: the order of QK_FOR_EACH_TYPE (= cuda_plan.KERNEL_TYPE_SUFFIX).
#define QK_QKV_CASE(suffix, type)                                                 \
    if (seg.type_code == code++) {                                                \
        qkv_segment<type>(seg, x, x_stride, y, y_stride, n_in, batch, shared);    \
        return;                                                                   \
    }

__device__ void qkv_segment_of_its_type(const QkvSegment& seg, const float* __restrict__ x,
                                        int x_stride, float* __restrict__ y, int y_stride,
                                        int n_in, int batch, MatvecShared& shared) {
    int code = 0;  // the segment's type is block-uniform: every thread takes the same case
    QK_FOR_EACH_TYPE(QK_QKV_CASE)
}

extern "C" __global__ void QK_MATVEC_BOUNDS mul_mat_vec_qkv(QK_QKV_PARAMETERS) {
    __shared__ MatvecShared shared;
    // run_sums holds a head_dim copy a warp once the products are done with it.
    fused_qkv_block<MATVEC_MAX_ROWS_PER_BLOCK>(
        QkvBlock{int(blockIdx.x), rows_per_block(), 0, batch, head_counters}, shared.run_sums,
        [&](const QkvSegment& seg) {
            qkv_segment_of_its_type(seg, x, x_stride, y, y_stride, n_in, batch, shared);
        },
        QK_QKV_ARGUMENTS);
}
