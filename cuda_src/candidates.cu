// Token candidates: what crosses from the device to the sampler instead of whole logits rows.
// Semantics (the Python side follows these; actors/sampler.py documents the same math):
//
// apply_penalties(logits, ...), one block per row, in place on logits [rows][vocab] float32:
//   - repetition: for every id in the row's repetition list, l = l > 0 ? l / repetition
//                                                                  : l * repetition;
//   - then presence / frequency: for every (id, count) in the row's counted list,
//     l -= presence * (count > 0) + frequency * count.
//   A token in both lists gets both. Computed in float64 from the float32 logit and rounded to
//   float32 once, as sampler._penalty_edits does. Lists are CSR per row, ids strictly
//   ascending within a row (np.unique order): repetition ids rep_ids[rep_offsets[r] ..
//   rep_offsets[r + 1]); counted ids count_ids[...] with counts[...] at count_offsets[r] ...
//   Parameters are float64 per row (repetition 1 and presence = frequency = 0 are no-ops).
//
// top_candidates(logits, ...), one block of CANDIDATE_THREADS per row, every row's
//   parameters from device arrays (so a captured graph or any step can reuse the launch):
//   - the row's top k = most[row] logits (1 <= k <= min(vocab, width, MAX_CANDIDATES)),
//     descending, ties by the lower id; candidate 0 is therefore the argmax (lowest id on
//     ties); -0 and +0 count as equal; logits must not be NaN.
//   - log_z = log(sum_i exp((l_i - l_max) * inv_temp[row])), l_max = candidate 0's logit: the
//     log-partition of the tempered row relative to its max (the sampler adds l_max *
//     inv_temp for the absolute one). float32 exp terms, each thread summing its strided
//     share in order, then a tree: |error| <= about 1e-4 for vocabularies up to 262144 (the
//     relative error of a float32 sum of that many positive terms, plus expf's 2 ulp). A row
//     whose logits are all -inf has no partition: its log_z is NaN.
//   - count: how many of the k candidates the row hands over (RowInputs' rule): at least
//     least[row], and where mass[row] > 0 enough that their weights exp((l - l_max) *
//     inv_temp) reach mass * exp(log_z), plus CANDIDATE_MARGIN against the float32 sums'
//     rounding, never more than k. A row whose top logit is not finite hands over 1.
//   out: one record of 2 + 2 * width 32-bit words per row: count (int), log_z (float),
//     ids[width] (int), logits[width] (float); columns past k are left as they were.
//   Selection is exact: a 4-pass radix select on order-preserving 32-bit keys finds the k-th
//   largest value, one pass gathers the values above it and, in id order, the lowest ids of
//   those equal to it, and a rank sort orders the k candidates.
#include "device_common.cuh"

constexpr int CANDIDATE_THREADS = 1024;
constexpr int MAX_CANDIDATES = 1024;
constexpr int RADIX = 256;
// Candidates added past the mass target: the device sums in float32, the target is exact.
constexpr int CANDIDATE_MARGIN = 2;

__device__ bool sorted_contains(const int* ids, int n, int id) {
    int low = 0, high = n;
    while (low < high) {
        const int mid = (low + high) / 2;
        if (ids[mid] < id) low = mid + 1; else high = mid;
    }
    return low < n && ids[low] == id;
}

// The float64 steps are explicit (_rn intrinsics) so that none is fused into an FMA: each
// rounds as numpy's does, and the penalized logits equal the sampler's bit for bit.
__device__ double repeated(double value, double penalty) {
    return value > 0 ? __ddiv_rn(value, penalty) : __dmul_rn(value, penalty);
}

extern "C" __global__ void apply_penalties(
    float* __restrict__ logits, int vocab, const int* __restrict__ rep_offsets,
    const int* __restrict__ rep_ids, const double* __restrict__ repetition,
    const int* __restrict__ count_offsets, const int* __restrict__ count_ids,
    const int* __restrict__ counts, const double* __restrict__ presence,
    const double* __restrict__ frequency) {
    const int row = blockIdx.x;
    float* l = logits + int64_t(row) * vocab;
    const int* reps = rep_ids + rep_offsets[row];
    const int n_reps = rep_offsets[row + 1] - rep_offsets[row];
    const int* counted = count_ids + count_offsets[row];
    const int n_counted = count_offsets[row + 1] - count_offsets[row];
    // Each token is written once: counted tokens here (with their repetition if any) ...
    for (int k = threadIdx.x; k < n_counted; k += blockDim.x) {
        const int id = counted[k], count = counts[count_offsets[row] + k];
        double value = l[id];
        if (sorted_contains(reps, n_reps, id)) value = repeated(value, repetition[row]);
        value = __dsub_rn(value, __dadd_rn(__dmul_rn(presence[row], count > 0 ? 1.0 : 0.0),
                                           __dmul_rn(frequency[row], double(count))));
        l[id] = float(value);
    }
    // ... and the repeated tokens that are not counted here.
    for (int k = threadIdx.x; k < n_reps; k += blockDim.x) {
        const int id = reps[k];
        if (!sorted_contains(counted, n_counted, id)) {
            l[id] = float(repeated(l[id], repetition[row]));
        }
    }
}

// Orders like the floats (with -0 == +0): larger float, larger key.
__device__ uint32_t order_key(float value) {
    const uint32_t bits = __float_as_uint(value == 0.0f ? 0.0f : value);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

// Exclusive count of `flag` over the block's threads in thread order, and the block's total.
__device__ int2 block_exclusive_count(bool flag, int* warp_counts) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const unsigned ballot = __ballot_sync(FULL_MASK, flag);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = __popc(ballot & ((1u << lane) - 1u)), total = 0;
    for (int w = 0; w < int(blockDim.x) / WARP; ++w) {
        if (w < warp) before += warp_counts[w];
        total += warp_counts[w];
    }
    __syncthreads();  // the next call rewrites warp_counts
    return make_int2(before, total);
}

// The k-th largest key of the row and how many of the keys equal to it belong to the top k.
__device__ uint2 radix_select(const float* l, int vocab, int k, int* histogram, uint2* result) {
    uint32_t prefix = 0, mask = 0;
    int wanted = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < RADIX; i += blockDim.x) histogram[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const uint32_t key = order_key(l[i]);
            if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & (RADIX - 1)], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int above = 0, digit = RADIX - 1;
            while (above + histogram[digit] < wanted) above += histogram[digit--];
            *result = make_uint2(uint32_t(digit), uint32_t(wanted - above));
        }
        __syncthreads();
        prefix |= result->x << shift;
        mask |= uint32_t(RADIX - 1) << shift;
        wanted = int(result->y);
        __syncthreads();  // result is rewritten next pass
    }
    return make_uint2(prefix, uint32_t(wanted));
}

// How many of the k sorted candidates reach `target` weight (+ CANDIDATE_MARGIN), by warp 0:
// each lane sums a run of consecutive candidates, a scan over the lanes gives each run's
// starting weight, then each lane counts its candidates whose running weight is below target.
__device__ int candidates_below(const float* sorted_logits, int k, float top, float scale,
                                float target) {
    const int lane = threadIdx.x % WARP;
    const int per_lane = (k + WARP - 1) / WARP;
    const int first = lane * per_lane, last = min(k, first + per_lane);
    float run = 0.0f;
    for (int c = first; c < last; ++c) run += expf((sorted_logits[c] - top) * scale);
    float before = run;
#pragma unroll
    for (int offset = 1; offset < WARP; offset *= 2) {
        const float other = __shfl_up_sync(FULL_MASK, before, offset);
        if (lane >= offset) before += other;
    }
    before -= run;  // the weight of the runs of the lanes before this one
    int below = 0;
    for (int c = first; c < last; ++c) {
        before += expf((sorted_logits[c] - top) * scale);
        below += before < target;
    }
    return __reduce_add_sync(FULL_MASK, below);
}

extern "C" __global__ void __launch_bounds__(CANDIDATE_THREADS) top_candidates(
    const float* __restrict__ logits, int vocab, const int* __restrict__ least,
    const int* __restrict__ most, const float* __restrict__ mass,
    const float* __restrict__ inv_temp, int width, int* __restrict__ out) {
    __shared__ int histogram[RADIX];
    __shared__ uint2 select_result;
    __shared__ int warp_counts[WARP];
    __shared__ float scratch[WARP];
    __shared__ int ids[MAX_CANDIDATES];
    __shared__ uint32_t keys[MAX_CANDIDATES];
    __shared__ float sorted_logits[MAX_CANDIDATES];
    __shared__ int n_above;
    __shared__ int count;
    const int row = blockIdx.x;
    const int k = most[row];
    const float* l = logits + int64_t(row) * vocab;
    int* record = out + int64_t(row) * (2 + 2 * width);
    int* cand_ids = record + 2;
    float* cand_logits = reinterpret_cast<float*>(record + 2 + width);

    const uint2 selected = radix_select(l, vocab, k, histogram, &select_result);
    const uint32_t threshold = selected.x;
    const int ties_wanted = int(selected.y);
    if (threadIdx.x == 0) n_above = 0;
    __syncthreads();
    int ties_seen = 0;
    for (int chunk = 0; chunk < vocab; chunk += blockDim.x) {
        const int i = chunk + threadIdx.x;
        const uint32_t key = i < vocab ? order_key(l[i]) : 0u;
        if (i < vocab && key > threshold) {
            const int slot = atomicAdd(&n_above, 1);
            ids[slot] = i;
            keys[slot] = key;
        }
        const bool tie = i < vocab && key == threshold;
        const int2 tied = block_exclusive_count(tie, warp_counts);
        if (tie && ties_seen + tied.x < ties_wanted) {
            const int slot = k - ties_wanted + ties_seen + tied.x;
            ids[slot] = i;
            keys[slot] = key;
        }
        ties_seen += tied.y;
    }
    __syncthreads();

    for (int c = threadIdx.x; c < k; c += blockDim.x) {
        int rank = 0;
        for (int j = 0; j < k; ++j) {
            rank += keys[j] > keys[c] || (keys[j] == keys[c] && ids[j] < ids[c]);
        }
        cand_ids[rank] = ids[c];
        cand_logits[rank] = l[ids[c]];
        sorted_logits[rank] = l[ids[c]];
    }
    __syncthreads();
    const float top = sorted_logits[0];
    const float scale = inv_temp[row];
    float sum = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += expf((l[i] - top) * scale);
    const float total = block_sum(sum, scratch);
    const float target = mass[row] * total;
    if (threadIdx.x < WARP) {
        // Warp-uniform: every lane of warp 0 sees the same row values.
        const int reach = target > 0.0f && isfinite(top)
                              ? candidates_below(sorted_logits, k, top, scale, target) +
                                    CANDIDATE_MARGIN
                              : 0;
        if (threadIdx.x == 0) count = isfinite(top) ? min(k, max(least[row], reach)) : 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        record[0] = count;
        reinterpret_cast<float*>(record)[1] = logf(total);
    }
}
