/* How the decode-attention kernels share a step's work items (one request's KV head with its group
 * of query heads, request-major) among their threads: each thread takes a contiguous run of items
 * holding its share of the summed context lengths. An item's work grows with its request's
 * context, and a step's requests differ by hundreds of tokens, so a split by item count left the
 * thread with the longer requests working while the other waited at the barrier: by the
 * harness's chat requests' context lengths, 12% and 8% over the balanced split's attention time
 * at c=32 and c=64. */
#ifndef SPINDLE_DECODE_ITEMS_H
#define SPINDLE_DECODE_ITEMS_H

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* An item's work that does not grow with its context (the query's conversion, the softmax's
 * division, the output's store), in tokens' worth: an estimate, small beside contexts of hundreds
 * of tokens, so the split does not hinge on it. */
#define ITEM_FIXED_TOKENS 16

static inline int64_t item_cost(const int64_t *seq_lens, int64_t req) {
  return (seq_lens[req] > 0 ? seq_lens[req] : 0) + ITEM_FIXED_TOKENS;
}

/* How many items lie before the first whose cost midpoint reaches bound2 / 2 (doubled to stay in
 * integers); midpoints grow with the item, so the items before it are exactly those below. */
static inline int64_t items_below(const int64_t *seq_lens, int64_t num_reqs, int num_kv_heads, int64_t bound2) {
  int64_t cum = 0, item = 0;
  for (int64_t r = 0; r < num_reqs; r++) {
    const int64_t cost = item_cost(seq_lens, r);
    for (int h = 0; h < num_kv_heads; h++, item++, cum += cost)
      if (2 * cum + cost >= bound2) return item;
  }
  return item;
}

/* The calling thread's items [*begin, *end) of `num_reqs * num_kv_heads`: those whose cost
 * midpoint falls in its share of the total, so the threads' runs are contiguous, disjoint and
 * cover every item. Called inside the parallel region. */
static inline void thread_items(const int64_t *seq_lens, int64_t num_reqs, int num_kv_heads, int64_t *begin,
                                int64_t *end) {
#ifdef _OPENMP
  const int thread = omp_get_thread_num(), num_threads = omp_get_num_threads();
#else
  const int thread = 0, num_threads = 1;
#endif
  int64_t total = 0;
  for (int64_t r = 0; r < num_reqs; r++) total += item_cost(seq_lens, r);
  total *= num_kv_heads;
  const int64_t lo2 = 2 * total * thread / num_threads, hi2 = 2 * total * (thread + 1) / num_threads;
  *begin = items_below(seq_lens, num_reqs, num_kv_heads, lo2);
  *end = thread == num_threads - 1 ? num_reqs * num_kv_heads : items_below(seq_lens, num_reqs, num_kv_heads, hi2);
}

#endif
