// Device-only helpers shared by the kernels: warp and block reductions.
#pragma once

#include <stdint.h>

constexpr int WARP = 32;
constexpr unsigned FULL_MASK = 0xFFFFFFFFu;

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset /= 2) {
        value += __shfl_xor_sync(FULL_MASK, value, offset);
    }
    return value;
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset /= 2) {
        value = fmaxf(value, __shfl_xor_sync(FULL_MASK, value, offset));
    }
    return value;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats of shared memory; the block must not be reusing it concurrently.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    value = warp_sum(value);
    __syncthreads();  // a previous call may still be reading scratch
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    const int warps = blockDim.x / WARP;
    value = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(value);
}

// cp.async (sm_80+), shared by the kernels that stream weights into shared memory: BYTES (4,
// 8 or 16, the addresses aligned to it) from global to shared memory without registers, in
// this thread's current group of copies (16 bytes bypass L1: weights are read once a block).
template <int BYTES>
__device__ __forceinline__ void copy_async(void* shared_dst, const void* global_src) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    const uint32_t dst = uint32_t(__cvta_generic_to_shared(shared_dst));
    if constexpr (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src)
                     : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(global_src),
                     "n"(BYTES)
                     : "memory");
    }
}

// Close this thread's current group of copies, and wait until at most `pending` of its latest
// groups are still in flight (a thread sees its own copies once their group is done).
__device__ __forceinline__ void commit_copies() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int pending>
__device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}
