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

// cp.async bookkeeping (sm_80+), shared by the kernels that stream tiles into shared memory:
// close this thread's current group of copies, and wait until at most `pending` of its latest
// groups are still in flight.
__device__ __forceinline__ void commit_copies() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int pending>
__device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}
