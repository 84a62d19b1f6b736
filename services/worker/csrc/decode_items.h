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
#define ITEMS_THREAD_NUM() omp_get_thread_num()
#define ITEMS_NUM_THREADS() omp_get_num_threads()
#else
#define ITEMS_THREAD_NUM() 0
#define ITEMS_NUM_THREADS() 1
#endif

/* An item's work that does not grow with its context (the query's conversion, the softmax's
 * division, the output's store), in tokens' worth: an estimate, small beside contexts of hundreds
 * of tokens, so the split does not hinge on it. */
#define ITEM_FIXED_TOKENS 16

static inline int64_t item_cost(const int64_t *seq_lens, int64_t req) {
  return (seq_lens[req] > 0 ? seq_lens[req] : 0) + ITEM_FIXED_TOKENS;
}

/* Items [*begin, *end) of `num_reqs * num_kv_heads` for thread `thread` of `num_threads`: those
 * whose cost midpoint falls in the thread's share of the total, so the runs are contiguous,
 * disjoint and cover every item. */
static inline void balanced_items(const int64_t *seq_lens, int64_t num_reqs, int num_kv_heads, int thread,
                                  int num_threads, int64_t *begin, int64_t *end) {
  int64_t total = 0;
  for (int64_t r = 0; r < num_reqs; r++) total += item_cost(seq_lens, r);
  total *= num_kv_heads;
  /* item i is the thread's when lo <= cum_i + cost_i / 2 < hi; doubled to stay in integers */
  const int64_t lo2 = 2 * total * thread / num_threads, hi2 = 2 * total * (thread + 1) / num_threads;
  int64_t cum = 0, item = 0, first = -1, last = -1;
  for (int64_t r = 0; r < num_reqs; r++) {
    const int64_t cost = item_cost(seq_lens, r);
    for (int h = 0; h < num_kv_heads; h++, item++, cum += cost) {
      const int64_t mid2 = 2 * cum + cost;
      if (mid2 < lo2) continue;
      if (mid2 >= hi2 && thread < num_threads - 1) goto done;
      if (first < 0) first = item;
      last = item;
    }
  }
done:
  *begin = first < 0 ? 0 : first;
  *end = first < 0 ? 0 : last + 1;
}

#endif
