// Sampling: sparse logits processors, then one CTA per row for greedy, temperature, min-p,
// top-k, top-p and the seeded draw.
//
// Passes over a row's vocabulary, only for the knobs the row uses:
//   1. max and argmax (greedy rows stop here; min-p becomes a logit threshold M + T ln(min_p));
//   2. top-k and top-p thresholds by radix select on the logits' order-preserving bit patterns,
//      4 passes of 8 bits each (a count histogram for top-k, a probability-mass one for top-p),
//      never sorting the vocabulary;
//   3. the draw: argmax over kept tokens of x / T + Gumbel noise (the exponential race), the
//      noise from Philox keyed by the row's seed and counted by (token, offset), so a seed gives
//      the same token wherever its request sits in the batch.
// A row with only a temperature needs one pass (3 alone).
#include "common.cuh"

namespace spindle {

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// Logit bias, penalties and bans, one thread per (row, token) entry; entries are unique per row
// (merged on the host), so no two threads touch the same logit. flags: 1 = token seen in the
// prompt or output (repetition applies), 2 = banned (min_tokens not reached).
template <int THREADS>
__global__ void __launch_bounds__(THREADS) apply_sparse_logits(
    float* __restrict__ logits, long long row_stride, const int* __restrict__ entry_row,
    const int* __restrict__ entry_token, const int* __restrict__ entry_output_count,
    const float* __restrict__ entry_bias, const int* __restrict__ entry_flags,
    const float* __restrict__ presence, const float* __restrict__ frequency,
    const float* __restrict__ repetition, int num_entries) {
  const int i = blockIdx.x * THREADS + threadIdx.x;
  if (i >= num_entries) return;
  const int row = entry_row[i];
  float* logit = logits + row * row_stride + entry_token[i];
  float v = *logit + entry_bias[i];
  const int flags = entry_flags[i];
  if (flags & 1) {
    const float rep = repetition[row];
    v = v > 0.0f ? v / rep : v * rep;
    const int count = entry_output_count[i];
    v -= frequency[row] * (float)count;
    if (count > 0) v -= presence[row];
  }
  if (flags & 2) v = neg_inf();
  *logit = v;
}

// Float bits mapped so that unsigned order is float order (negatives flipped).
__device__ __forceinline__ unsigned int order_key(float x) {
  const unsigned int u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_to_float(unsigned int key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

template <int NUM_WARPS>
__device__ __forceinline__ void block_argmax(float& v, int& i, float* scratch_v, int* scratch_i) {
  warp_argmax(v, i);
  if ((threadIdx.x & 31) == 0) {
    scratch_v[threadIdx.x >> 5] = v;
    scratch_i[threadIdx.x >> 5] = i;
  }
  __syncthreads();  // [barrier:argmax]
  v = scratch_v[0];
  i = scratch_i[0];
  for (int w = 1; w < NUM_WARPS; ++w) {
    if (beats(scratch_v[w], scratch_i[w], v, i)) {
      v = scratch_v[w];
      i = scratch_i[w];
    }
  }
  __syncthreads();  // the scratch is reused right after
}

// Radix select: the smallest kept value v such that the weight of kept tokens strictly above v
// is below `target` (weight 1 per token: v is the k-th largest for target k; weight
// exp((x - m) / T): v is the top-p cut for target top_p * mass). Kept = x >= lower.
// `relative` makes the target a fraction of the total weight, known after the first pass.
template <int THREADS>
__device__ float radix_select(const float* x, int vocab_size, float lower, bool by_mass, float m, float inv_t,
                              float target, bool relative, float (*hist)[256], float* bins,
                              unsigned int* state_u, float* state_f) {
  constexpr int NUM_WARPS = THREADS / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    state_u[0] = 0;  // prefix
    state_u[1] = 0;  // prefix mask
    state_f[0] = 0;  // weight above the prefix
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < NUM_WARPS * 256; i += THREADS) hist[i / 256][i % 256] = 0.0f;
    __syncthreads();  // [barrier:hist-clear] also publishes the state of the last round
    const unsigned int prefix = state_u[0], mask = state_u[1];
    const float above = state_f[0];
    for (int i = tid; i < vocab_size; i += THREADS) {
      const float xi = x[i];
      if (!(xi >= lower)) continue;
      const unsigned int key = order_key(xi);
      if ((key & mask) != prefix) continue;
      atomicAdd(&hist[warp][(key >> shift) & 255u], by_mass ? expf((xi - m) * inv_t) : 1.0f);
    }
    __syncthreads();  // [barrier:hist-full]
    for (int b = tid; b < 256; b += THREADS) {
      float total = 0.0f;
      for (int w = 0; w < NUM_WARPS; ++w) total += hist[w][b];
      bins[b] = total;
    }
    __syncthreads();  // [barrier:bins]
    if (warp == 0) {
      // Lane l owns bins 8l..8l+7; `higher` = weight in the bins of lanes above it.
      float lane_total = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) lane_total += bins[8 * lane + j];
      float inclusive = lane_total;  // suffix sum over lanes >= lane
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const float o = __shfl_down_sync(0xffffffffu, inclusive, d);
        if (lane + d < 32) inclusive += o;
      }
      if (relative && shift == 24) target *= __shfl_sync(0xffffffffu, inclusive, 0);
      // The lowest non-empty bin whose higher bins weigh less than the target.
      float run = inclusive - lane_total;
      int best = 256;
      float best_run = 0.0f;
      for (int j = 7; j >= 0; --j) {
        const float h = bins[8 * lane + j];
        if (h > 0.0f && above + run < target) {
          best = 8 * lane + j;
          best_run = run;
        }
        run += h;
      }
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) best = min(best, __shfl_xor_sync(0xffffffffu, best, d));
      best_run = __shfl_sync(0xffffffffu, best_run, (best & 255) >> 3);
      if (lane == 0) {
        state_u[0] = prefix | ((unsigned int)(best & 255) << shift);
        state_u[1] = mask | (255u << shift);
        state_f[0] = above + best_run;
      }
    }
  }
  __syncthreads();  // [barrier:select-done]
  const float v = key_to_float(state_u[0]);
  __syncthreads();  // state is reused by the next select
  return v;
}

// grid: (num_rows), block: THREADS. temperature <= 0 means greedy; top_k <= 0 or >= vocab,
// top_p >= 1 and min_p <= 0 mean off. Writes one token id per row.
// The minimum-blocks bound stops ptxas from squeezing registers for full occupancy (it spills).
template <int THREADS>
__global__ void __launch_bounds__(THREADS, 512 / THREADS) sample_rows(
    long long* __restrict__ out_tokens, const float* __restrict__ logits, long long row_stride,
    int vocab_size, const float* __restrict__ temperature, const int* __restrict__ top_k,
    const float* __restrict__ top_p, const float* __restrict__ min_p,
    const unsigned long long* __restrict__ seeds, const unsigned long long* __restrict__ offsets) {
  constexpr int NUM_WARPS = THREADS / 32;
  __shared__ float scratch_v[NUM_WARPS];
  __shared__ int scratch_i[NUM_WARPS];
  __shared__ float hist[NUM_WARPS][256];
  __shared__ float bins[256];
  __shared__ unsigned int state_u[2];
  __shared__ float state_f[1];

  const int row = blockIdx.x, tid = threadIdx.x;
  const float* x = logits + row * row_stride;
  const float t = temperature[row];
  const bool greedy = !(t > 0.0f);
  const int k = top_k[row];
  const bool use_top_k = k > 0 && k < vocab_size;
  const float p = top_p[row];
  const bool use_top_p = p < 1.0f;
  const float mp = min_p[row];
  const bool use_min_p = mp > 0.0f;

  float m = 0.0f;
  if (greedy || use_top_k || use_top_p || use_min_p) {  // pass 1: max and argmax
    float v = neg_inf();
    int i_best = 0x7fffffff;
    for (int i = tid; i < vocab_size; i += THREADS) {
      const float xi = x[i];
      if (beats(xi, i, v, i_best)) {
        v = xi;
        i_best = i;
      }
    }
    block_argmax<NUM_WARPS>(v, i_best, scratch_v, scratch_i);
    if (greedy) {
      if (tid == 0) out_tokens[row] = i_best;
      return;  // the whole CTA leaves: a uniform branch
    }
    m = v;
  }
  const float inv_t = 1.0f / t;
  float lower = neg_inf();  // kept tokens: x >= lower
  if (use_min_p) lower = m + t * logf(mp);
  if (use_top_k)
    lower = fmaxf(lower, radix_select<THREADS>(x, vocab_size, lower, false, m, inv_t, (float)k, false, hist, bins,
                                              state_u, state_f));
  if (use_top_p)
    lower = fmaxf(lower, radix_select<THREADS>(x, vocab_size, lower, true, m, inv_t, p, true, hist, bins,
                                              state_u, state_f));

  // The draw: Philox gives 4 words per call, so thread g handles tokens 4g..4g+3.
  const unsigned long long seed = seeds[row], offset = offsets[row];
  float best_v = neg_inf();
  int best_i = 0x7fffffff;
  for (int g = tid; 4 * g < vocab_size; g += THREADS) {
    const Philox r = philox4x32_10((unsigned int)g, (unsigned int)offset, (unsigned int)(offset >> 32), 0u,
                                   (unsigned int)seed, (unsigned int)(seed >> 32));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 4 * g + j;
      const float xi = i < vocab_size ? x[i] : neg_inf();  // no break: r.v[j] stays in registers
      const float key = xi * inv_t + gumbel_from_bits(r.v[j]);
      if (i < vocab_size && xi >= lower && beats(key, i, best_v, best_i)) {
        best_v = key;
        best_i = i;
      }
    }
  }
  block_argmax<NUM_WARPS>(best_v, best_i, scratch_v, scratch_i);
  if (tid == 0) out_tokens[row] = best_i;
}

}  // namespace spindle
