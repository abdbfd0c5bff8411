// Token candidates: what crosses from the device to the sampler instead of whole logits rows.
// Semantics (the Python side follows these; actors/sampling/ documents the same math):
//
// apply_token_mask(logits, vocab, mask_rows, words), grid (ceil(vocab / MASK_THREADS),
//   masked rows) of MASK_THREADS, before apply_penalties (structured output): masked row r is
//   logits row mask_rows[r], its ceil(vocab / 32) int32 words at words + r * ceil(vocab / 32)
//   (llguidance's layout); where bit t % 32 of word t / 32 is clear, token t may not come
//   next and its logit becomes -inf. Allowed logits are neither read nor written; the rows
//   without a mask are not launched over.
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
//   - then the logit biases (OpenAI's logit_bias), once every penalty is written: for every
//     id in bias_ids[bias_offsets[r] .. bias_offsets[r + 1]) (distinct within a row),
//     l = float(double(l) + bias_values[...]), a second float64 step rounded to float32.
//
// top_candidates(logits, ...), grid (slices, rows) of CANDIDATE_THREADS, every row's
//   parameters from device arrays (so a captured graph or any step can reuse the launch):
//   - the row's top k = most[row] logits (1 <= k <= min(vocab, width, MAX_CANDIDATES)),
//     descending, ties by the lower id; candidate 0 is therefore the argmax (lowest id on
//     ties); -0 and +0 count as equal; logits must not be NaN.
//   - log_z = log(sum_i exp((l_i - l_max) * inv_temp[row])), l_max = candidate 0's logit: the
//     log-partition of the tempered row relative to its max (the sampler adds l_max *
//     inv_temp for the absolute one). float32 exp terms summed in a fixed order: |error| <=
//     about 1e-4 for vocabularies up to 262144 (the relative error of a float32 sum of that
//     many positive terms, plus expf's 2 ulp). A row whose logits are all -inf has no
//     partition: its log_z is NaN.
//   - count: how many of the k candidates the row hands over (RowInputs' rule): at least
//     least[row], and where mass[row] > 0 enough that their weights exp((l - l_max) *
//     inv_temp) reach mass * exp(log_z), plus CANDIDATE_MARGIN against the float32 sums'
//     rounding, never more than k. A row whose top logit is not finite hands over 1.
//   out: one record of 2 + 2 * width 32-bit words per row: count (int), log_z (float),
//     ids[width] (int), logits[width] (float); columns past k are left as they were.
//   Selection is exact: a 4-pass radix select on order-preserving 32-bit keys finds the k-th
//   largest value, one pass gathers the values above it and, in id order, the lowest ids of
//   those equal to it, and a rank sort orders the k candidates.
//   Rows with k > SMALL_CANDIDATES: block 0 selects over the whole row (the other blocks of
//   the row leave at once). Rows with k <= SMALL_CANDIDATES (greedy and top-k sampling): the
//   row is cut into gridDim.x <= MAX_SLICES slices of ceil(vocab / gridDim.x) ids (host:
//   cuda_plan.candidate_slices); each block selects its slice's top min(k, slice) in order
//   and its (max, sum of exp((l - max) * inv_temp)), and writes them to
//   slice_partials[row][slice] (SLICE_WORDS words: max, sum, keys[SMALL_CANDIDATES],
//   ids[SMALL_CANDIDATES]). The last block of the row to finish (counted in counters[row],
//   which must be zero before the first launch; that block sets it back to zero) selects the
//   top k of the slices' candidates (they hold the row's top k: a member of it is in its
//   slice's top k) and merges the sums in a fixed order, so the record does not depend on
//   which block finished last.
//
// feed_greedy_tokens(records, record_words, token_ids, n), grid-stride: token_ids[i] = the id
//   of candidate 0 in row i's record (record_words apart): the tokens of the decode step the
//   CUDA backend runs ahead, on the device before the host has seen the records.
#include "device_common.cuh"

constexpr int CANDIDATE_THREADS = 1024;
constexpr int MAX_CANDIDATES = 1024;
constexpr int RADIX = 256;
// Candidates added past the mass target: the device sums in float32, the target is exact.
constexpr int CANDIDATE_MARGIN = 2;
// Rows asking for at most this many candidates are selected by several blocks (slices).
constexpr int SMALL_CANDIDATES = 64;
constexpr int MAX_SLICES = 32;
constexpr int SLICE_WORDS = 2 + 2 * SMALL_CANDIDATES;

constexpr int MASK_THREADS = 256;

// A thread per token: a warp's 32 tokens share one mask word (one broadcast load).
extern "C" __global__ void __launch_bounds__(MASK_THREADS) apply_token_mask(
    float* __restrict__ logits, int vocab, const int* __restrict__ mask_rows,
    const unsigned* __restrict__ words) {
    const int token = blockIdx.x * MASK_THREADS + threadIdx.x;
    if (token >= vocab) return;
    const int row_words = (vocab + 31) / 32;
    const unsigned word = words[int64_t(blockIdx.y) * row_words + token / 32];
    if (!((word >> (token % 32)) & 1u)) {
        logits[int64_t(mask_rows[blockIdx.y]) * vocab + token] = -INFINITY;
    }
}

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
    const double* __restrict__ frequency, const int* __restrict__ bias_offsets,
    const int* __restrict__ bias_ids, const double* __restrict__ bias_values) {
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
    __syncthreads();  // a biased token may be one another thread just penalized
    for (int k = bias_offsets[row] + threadIdx.x; k < bias_offsets[row + 1]; k += blockDim.x) {
        const int id = bias_ids[k];
        l[id] = float(__dadd_rn(double(l[id]), bias_values[k]));
    }
}

// Orders like the floats (with -0 == +0): larger float, larger key.
__device__ uint32_t order_key(float value) {
    const uint32_t bits = __float_as_uint(value == 0.0f ? 0.0f : value);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

// Shared memory of a selection: the radix histogram and the k selected (index, key) pairs.
struct Selection {
    int histogram[RADIX];
    uint2 digit;
    int warp_counts[WARP];
    int n_above;
    int index[MAX_CANDIDATES];
    uint32_t key[MAX_CANDIDATES];
};

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

// By warp 0: the digit (from the top) where the `wanted`-th largest counted key lies, and how
// many of the wanted keys lie in it. Lane L holds digits 255 - 8L down to 248 - 8L; a scan
// over the lanes finds the one whose run crosses `wanted` (1 <= wanted <= the keys counted).
__device__ void find_digit(const int* histogram, int wanted, uint2* digit) {
    const int lane = threadIdx.x;
    const int top = RADIX - 1 - 8 * lane;
    int run = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) run += histogram[top - i];
    int through = run;
#pragma unroll
    for (int offset = 1; offset < WARP; offset *= 2) {
        const int other = __shfl_up_sync(FULL_MASK, through, offset);
        if (lane >= offset) through += other;
    }
    int above = through - run;
    if (above < wanted && wanted <= through) {
        int d = top;
        while (above + histogram[d] < wanted) above += histogram[d--];
        *digit = make_uint2(uint32_t(d), uint32_t(wanted - above));
    }
}

// The k-th largest of the n keys key_of(i) and how many of the keys equal to it belong to
// the top k. Histograms are warp-aggregated: lanes with the same digit add once.
template <class KeyOf>
__device__ uint2 radix_select(KeyOf key_of, int n, int k, Selection& s) {
    const int lane = threadIdx.x % WARP;
    uint32_t prefix = 0, mask = 0;
    int wanted = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < RADIX; i += blockDim.x) s.histogram[i] = 0;
        __syncthreads();
        for (int base = 0; base < n; base += blockDim.x) {  // whole warps: match_any below
            const int i = base + threadIdx.x;
            const uint32_t key = i < n ? key_of(i) : 0u;
            const bool counted = i < n && (key & mask) == prefix;
            const int digit = counted ? int((key >> shift) & (RADIX - 1)) : -1;
            const unsigned peers = __match_any_sync(FULL_MASK, digit);
            if (counted && lane == __ffs(peers) - 1) atomicAdd(&s.histogram[digit], __popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < WARP) find_digit(s.histogram, wanted, &s.digit);
        __syncthreads();
        prefix |= s.digit.x << shift;
        mask |= uint32_t(RADIX - 1) << shift;
        wanted = int(s.digit.y);
        __syncthreads();  // s.digit is rewritten next pass
    }
    return make_uint2(prefix, uint32_t(wanted));
}

// The top k (1 <= k <= n) of the n keys key_of(i), by key descending then index ascending,
// as unordered (index, key) pairs in s.index / s.key [0, k).
template <class KeyOf>
__device__ void select_top(KeyOf key_of, int n, int k, Selection& s) {
    const uint2 selected = radix_select(key_of, n, k, s);
    const uint32_t threshold = selected.x;
    const int ties_wanted = int(selected.y);
    if (threadIdx.x == 0) s.n_above = 0;
    __syncthreads();
    int ties_seen = 0;
    for (int chunk = 0; chunk < n; chunk += blockDim.x) {
        const int i = chunk + threadIdx.x;
        const uint32_t key = i < n ? key_of(i) : 0u;
        if (i < n && key > threshold) {
            const int slot = atomicAdd(&s.n_above, 1);
            s.index[slot] = i;
            s.key[slot] = key;
        }
        const bool tie = i < n && key == threshold;
        const int2 tied = block_exclusive_count(tie, s.warp_counts);
        if (tie && ties_seen + tied.x < ties_wanted) {
            const int slot = k - ties_wanted + ties_seen + tied.x;
            s.index[slot] = i;
            s.key[slot] = key;
        }
        ties_seen += tied.y;
    }
    __syncthreads();
}

// Where selected pair c goes in the order: key descending, index ascending.
__device__ int selection_rank(const Selection& s, int k, int c) {
    int rank = 0;
    for (int j = 0; j < k; ++j) {
        rank += s.key[j] > s.key[c] || (s.key[j] == s.key[c] && s.index[j] < s.index[c]);
    }
    return rank;
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

// The record's count and log_z from the k sorted candidate logits (shared, complete) and
// the row's sum of exp((l - top) * scale): by warp 0, every lane seeing the same values.
__device__ void finish_record(int* record, const float* sorted_logits, int k, float scale,
                              float total, int least, float mass) {
    if (threadIdx.x >= WARP) return;
    const float top = sorted_logits[0];
    const float target = mass * total;
    const int reach = target > 0.0f && isfinite(top)
                          ? candidates_below(sorted_logits, k, top, scale, target) +
                                CANDIDATE_MARGIN
                          : 0;
    if (threadIdx.x == 0) {
        record[0] = isfinite(top) ? min(k, max(least, reach)) : 1;
        reinterpret_cast<float*>(record)[1] = logf(total);
    }
}

// The ordered candidates: ids[index[c]] (index itself where ids is null) and their logits,
// to the record and to sorted_logits.
__device__ void write_candidates(const Selection& s, int k, const int* ids, const float* l,
                                 int* cand_ids, float* cand_logits, float* sorted_logits) {
    for (int c = threadIdx.x; c < k; c += blockDim.x) {
        const int rank = selection_rank(s, k, c);
        const int id = ids ? ids[s.index[c]] : s.index[c];
        cand_ids[rank] = id;
        cand_logits[rank] = l[id];
        sorted_logits[rank] = l[id];
    }
    __syncthreads();
}

// sum over i < n of exp((l[i] - top) * scale), 0 where top is -inf (nothing to weigh).
__device__ float exp_sum(const float* l, int n, float top, float scale, float* scratch) {
    float sum = 0.0f;
    if (top != -INFINITY) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) sum += expf((l[i] - top) * scale);
    }
    return block_sum(sum, scratch);
}

// The slice's top k_here in order and its exp sum, to its partial record.
__device__ void slice_partial(const float* slice, int n, int k_here, int begin, float scale,
                              Selection& s, float* slice_top, float* scratch, int* partial) {
    if (k_here > 0) {  // block-uniform
        select_top([&](int i) { return order_key(slice[i]); }, n, k_here, s);
        for (int c = threadIdx.x; c < k_here; c += blockDim.x) {
            const int rank = selection_rank(s, k_here, c);
            partial[2 + rank] = int(s.key[c]);
            partial[2 + SMALL_CANDIDATES + rank] = begin + s.index[c];
            if (rank == 0) *slice_top = slice[s.index[c]];
        }
    } else if (threadIdx.x == 0) {
        *slice_top = -INFINITY;
    }
    __syncthreads();
    const float top = *slice_top;
    const float sum = exp_sum(slice, n, top, scale, scratch);
    if (threadIdx.x == 0) {
        reinterpret_cast<float*>(partial)[0] = top;
        reinterpret_cast<float*>(partial)[1] = sum;
    }
}

// Whether this block is the last of `blocks` to count itself in *counter (its writes are
// made visible first; the last one resets the counter for the next launch and may then read
// the others' writes through L2).
__device__ bool last_to_finish(int* counter, int blocks, bool* flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        *flag = atomicAdd(counter, 1) == blocks - 1;
        if (*flag) atomicExch(counter, 0);
    }
    __syncthreads();
    const bool last = *flag;
    if (last) __threadfence();
    return last;
}

extern "C" __global__ void __launch_bounds__(CANDIDATE_THREADS) top_candidates(
    const float* __restrict__ logits, int vocab, const int* __restrict__ least,
    const int* __restrict__ most, const float* __restrict__ mass,
    const float* __restrict__ inv_temp, int width, int* __restrict__ out,
    int* __restrict__ slice_partials, int* __restrict__ counters) {
    __shared__ Selection selection;
    __shared__ float scratch[WARP];
    __shared__ float sorted_logits[MAX_CANDIDATES];
    __shared__ uint32_t pool_keys[MAX_SLICES * SMALL_CANDIDATES];
    __shared__ int pool_ids[MAX_SLICES * SMALL_CANDIDATES];
    __shared__ float slice_top, row_total;
    __shared__ int pool_size;
    __shared__ bool last_block;
    const int row = blockIdx.y;
    const int k = most[row];
    const float scale = inv_temp[row];
    const float* l = logits + int64_t(row) * vocab;
    int* record = out + int64_t(row) * (2 + 2 * width);
    int* cand_ids = record + 2;
    float* cand_logits = reinterpret_cast<float*>(record + 2 + width);

    if (k > SMALL_CANDIDATES) {
        if (blockIdx.x != 0) return;  // the whole block leaves
        select_top([&](int i) { return order_key(l[i]); }, vocab, k, selection);
        write_candidates(selection, k, nullptr, l, cand_ids, cand_logits, sorted_logits);
        const float total = exp_sum(l, vocab, sorted_logits[0], scale, scratch);
        finish_record(record, sorted_logits, k, scale,
                      sorted_logits[0] == -INFINITY ? NAN : total, least[row], mass[row]);
        return;
    }

    const int slices = gridDim.x, slice = (vocab + slices - 1) / slices;
    const int begin = blockIdx.x * slice, n = max(0, min(slice, vocab - begin));
    int* partials = slice_partials + int64_t(row) * MAX_SLICES * SLICE_WORDS;
    slice_partial(l + begin, n, min(k, n), begin, scale, selection, &slice_top, scratch,
                  partials + blockIdx.x * SLICE_WORDS);
    if (!last_to_finish(counters + row, slices, &last_block)) return;

    // The last block: the slices' candidates, in slice order, into the pool.
    int offset = 0;
    for (int b = 0; b < slices; ++b) {
        const int k_b = min(k, max(0, min(slice, vocab - b * slice)));
        const int* part = partials + b * SLICE_WORDS;
        for (int c = threadIdx.x; c < k_b; c += blockDim.x) {
            pool_keys[offset + c] = uint32_t(__ldcg(part + 2 + c));
            pool_ids[offset + c] = __ldcg(part + 2 + SMALL_CANDIDATES + c);
        }
        offset += k_b;
    }
    if (threadIdx.x < WARP) {
        // The slices' sums, rescaled to the row's max, summed in a fixed order (one tree).
        const int lane = threadIdx.x;
        const float* part = reinterpret_cast<const float*>(partials + lane * SLICE_WORDS);
        const float top = lane < slices ? __ldcg(part) : -INFINITY;
        const float row_max = warp_max(top);
        const float term =
            top == -INFINITY ? 0.0f : __ldcg(part + 1) * expf((top - row_max) * scale);
        const float total = warp_sum(term);
        if (lane == 0) row_total = row_max == -INFINITY ? NAN : total;
    }
    if (threadIdx.x == 0) pool_size = offset;
    __syncthreads();
    // Equal keys keep id order in the pool (slices ascending, each slice's in order), so the
    // pool index breaks ties as the id does.
    select_top([&](int i) { return pool_keys[i]; }, pool_size, k, selection);
    write_candidates(selection, k, pool_ids, l, cand_ids, cand_logits, sorted_logits);
    finish_record(record, sorted_logits, k, scale, row_total, least[row], mass[row]);
}

extern "C" __global__ void feed_greedy_tokens(const int* __restrict__ records, int record_words,
                                              int* __restrict__ token_ids, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        token_ids[i] = records[int64_t(i) * record_words + 2];
    }
}
