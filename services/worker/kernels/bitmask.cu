// Grammar bitmask: -inf for every token a grammar forbids, on the constrained rows only.
//
// The bitmask is in xgrammar's layout: int32 words, bit t % 32 of word t / 32 set where token t
// is allowed. Bitmask row j belongs to logits row row_indices[j]; rows not listed are never
// read or written, and bits past the vocabulary in the last word are ignored.
#include "common.cuh"

namespace spindle {

// grid: (ceil(vocab_size / (THREADS * TOKENS_PER_THREAD)), num_constrained_rows), block: THREADS.
// A thread per token: the 32 lanes of a warp test the 32 bits of one word (one broadcast load)
// and own 32 consecutive logits (one 128-byte store), so loads and stores are coalesced. A thread
// per word would have neighbouring lanes write 128 bytes apart. Nothing is loaded from the
// logits: only forbidden tokens are written.
template <int THREADS, int TOKENS_PER_THREAD>
__global__ void __launch_bounds__(THREADS) apply_token_bitmask(
    float* __restrict__ logits, long long row_stride, const int* __restrict__ bitmask,
    long long words_per_row, const int* __restrict__ row_indices, int vocab_size) {
  const long long row = row_indices[blockIdx.y];  // [index:row]
  float* x = logits + row * row_stride;
  const unsigned int* words = reinterpret_cast<const unsigned int*>(bitmask) + blockIdx.y * words_per_row;
  const int tile_start = blockIdx.x * (THREADS * TOKENS_PER_THREAD);
#pragma unroll
  for (int j = 0; j < TOKENS_PER_THREAD; ++j) {
    const int t = tile_start + j * THREADS + threadIdx.x;
    if (t < vocab_size && !((words[t >> 5] >> (t & 31)) & 1u))  // [index:bit]
      x[t] = __uint_as_float(0xff800000u);  // -inf
  }
}

}  // namespace spindle
