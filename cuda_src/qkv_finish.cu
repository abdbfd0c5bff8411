// qkv_finish: everything between the QKV projection and attention, for every token of a run
// of rows in one launch (it replaces add_bias x3, head_rms_norm x2, rope and kv_write, and
// rounds exactly as they do: the same device functions, head_ops.cuh, in the same order).
// The backend runs it after the tensor-core tiles' q, k and v; mul_mat_vec_qkv (matvec.cu)
// does the same work in its epilogue with the same body, qkv_finish_ops.cuh's finish_head.
// Per head of token t's row qkv[t * row_stride ...] (q heads, then k heads, then v heads, each
// head_dim floats):
//   1. bias (qwen2; q_bias / k_bias / v_bias may be null): v += bias, one rounding each;
//   2. q / k head RMSNorm (gemma-3; q_norm / k_norm may be null), one weight per segment;
//   3. RoPE of q and k heads at positions[t] (rope.cu: NORM / NEOX, per-call base, optional
//      freq_factors);
//   4. k and v heads rounded to float16 into the paged cache (kv_cache.cu's layout) at slot
//      slots[t]; the row keeps the float32 values, so attention reads q from it.
// One warp per head: grid (ceil((n_heads + 2 n_kv_heads) / 4), n_tokens), 128 threads.
#include "qkv_finish_ops.cuh"

constexpr int QKV_FINISH_HEADS_PER_BLOCK = 4;

extern "C" __global__ void __launch_bounds__(QKV_FINISH_HEADS_PER_BLOCK * WARP)
    qkv_finish(float* __restrict__ qkv, int row_stride, int n_heads, int n_kv_heads,
               int head_dim, const float* __restrict__ q_bias, const float* __restrict__ k_bias,
               const float* __restrict__ v_bias, const float* __restrict__ q_norm,
               const float* __restrict__ k_norm, float eps, const int* __restrict__ positions,
               int rope_dim, double base, const float* __restrict__ freq_factors, int neox,
               const int* __restrict__ slots, __half* __restrict__ k_cache,
               __half* __restrict__ v_cache) {
    const int head = blockIdx.x * QKV_FINISH_HEADS_PER_BLOCK + threadIdx.x / WARP;
    if (head >= n_heads + 2 * n_kv_heads) return;  // the whole warp leaves
    const QkvFinish finish{n_heads, n_kv_heads, head_dim, q_bias, k_bias, v_bias, q_norm,
                           k_norm, eps, positions, rope_dim, base, freq_factors, neox, slots,
                           k_cache, v_cache};
    const int token = blockIdx.y;
    finish_head(qkv + int64_t(token) * row_stride + int64_t(head) * head_dim, head, token,
                finish, threadIdx.x % WARP);
}
