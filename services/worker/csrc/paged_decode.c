/* Paged attention for decode tokens on a CPU: one query token per request, its keys and values
 * read in place from the paged cache through the block table.
 *
 * The PyTorch path gathers every request's blocks into a padded tensor before attending, which
 * writes and re-reads the whole context once more per layer; here each request reads its cached
 * keys and values where they lie.
 *
 * Layouts (contiguous): query and out [num_reqs, num_heads, head_dim] float32; key_cache and
 * value_cache [num_blocks, block_size, num_kv_heads, head_dim] of float32 or bfloat16 (raw
 * uint16); block_table [num_reqs, block_table_stride] int64; seq_lens [num_reqs] int64;
 * scratch [num_threads, scratch_floats_per_thread(...)] float32. Softmax is exact (max, then exp
 * and sum), in float32. Query head j reads KV head j / (num_heads / num_kv_heads) (GQA).
 *
 * One work item is one request and one KV head with the `group` query heads that share it, so a
 * key or value row is read (and widened from bfloat16) once for the whole group, not once per
 * query head. Keys go 8 at a time: each query head's 8 dot products are summed across lanes
 * together (`sum_lanes8`), a handful of shuffles for 8 scores where one horizontal sum per score
 * cost as much as the dot product itself. Work items are spread over the threads by their
 * contexts' lengths (decode_items.h), so a single request still uses every core. Vectors are GCC
 * vector extensions of 8 floats: the compiler picks AVX2, AVX-512 or NEON. Only the bfloat16
 * passes for CPUs with AVX512_BF16 name instructions (paged_decode_bf16.h); every other build runs
 * the generic passes.
 */
#include <stdint.h>
#include <string.h>

#include "decode_common.h"
#include "decode_items.h"

/* paged_decode_amx.c: the bfloat16 cache's passes on the AMX tile unit */
int paged_decode_amx_supports(int head_dim, int group, int block_size);
int64_t paged_decode_amx_floats(int64_t max_seq_len, int group);
int paged_decode_bf16_amx(const float *query, const uint16_t *key_cache, const uint16_t *value_cache,
                          const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens, float *out,
                          int64_t num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                          float scale, int64_t max_seq_len, float *scratch, int64_t per_thread, int num_threads);

/* paged_decode_int8.c: the int8 cache's passes on the AMX tile unit */
int64_t paged_decode_int8_amx_floats(int64_t max_seq_len, int group);

/* Floats of scratch one thread needs, for the wrapper to allocate (both decode kernels). */
int64_t scratch_floats_per_thread(int64_t max_seq_len, int group, int head_dim) {
  const int64_t vector = decode_scratch_floats(max_seq_len, group, head_dim);
  const int64_t tiles = paged_decode_amx_floats(max_seq_len, group);
  const int64_t int8_tiles = paged_decode_int8_amx_floats(max_seq_len, group);
  const int64_t most = tiles > vector ? tiles : vector;
  return int8_tiles > most ? int8_tiles : most;
}

/* Rows are prefetched into L2 this many chunks ahead. One chunk ahead into L1 left the loop
 * waiting on memory, and prefetches into L1 gained nothing at any distance: SmolLM2's shapes over
 * caches cycled from memory, two threads, medians of alternating runs, 64 requests x 1000 tokens
 * bfloat16 6.5 ms a call at one chunk into L1, 5.8 at one into L2, 4.5 at 4 into L2 (4.7 at 8,
 * 6.5-7.2 at 2-8 into L1); float32 11.0 -> 5.6 ms; 1 request x 400 tokens 0.073 -> 0.052 ms. */
#define PREFETCH_CHUNKS 4
#define PREFETCH_LOCALITY 1

/* Block and offset of token t: shifts where block_size is a power of two (the default 16), no
 * division. With the value pass's probabilities paired once, 1.03-1.16x on SmolLM2's shapes from
 * memory (1 x 400 to 64 x 500 tokens; docs/benchmarks.md, "Column tiles"). */
static inline __attribute__((always_inline)) void locate(int64_t t, int block_size, int shift, int64_t *block,
                                                         int64_t *offset) {
  if (shift >= 0) {
    *block = t >> shift, *offset = t & (block_size - 1);
  } else {
    *block = t / block_size, *offset = t % block_size;
  }
}

/* Pointers to rows t0 .. t0+n of one KV head; rows past n repeat row t0, so the loops over a
 * chunk never branch. Within one block rows are `row` apart; the walk steps block by block. The
 * rows PREFETCH_CHUNKS chunks ahead are prefetched (at the first chunk, every chunk up to there):
 * rows a chunk apart lie more than a page apart, where the hardware prefetchers stop. `shift` is
 * log2(block_size), or -1 where it is not a power of two. */
#define DEFINE_ROW_POINTERS(NAME, T)                                                             \
  static inline __attribute__((always_inline)) void NAME(                                        \
      const T *cache, const int64_t *blocks, int64_t t0, int64_t seq_len, int64_t row,           \
      int block_size, int shift, int head_dim, const T *rows[CHUNK]) {                           \
    const int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;                               \
    int64_t block, offset;                                                                       \
    locate(t0, block_size, shift, &block, &offset);                                              \
    const T *first = cache + (blocks[block] * block_size + offset) * row;                        \
    if (offset + n <= block_size) { /* the chunk lies in one block */                            \
      for (int j = 0; j < CHUNK; j++) rows[j] = j < n ? first + j * row : first;                 \
    } else {                                                                                     \
      for (int j = 0; j < CHUNK; j++) {                                                          \
        rows[j] = first;                                                                         \
        if (j < n) {                                                                             \
          rows[j] = cache + (blocks[block] * block_size + offset) * row;                         \
          if (++offset == block_size) offset = 0, block++;                                       \
        }                                                                                        \
      }                                                                                          \
    }                                                                                            \
    const int64_t ahead = t0 + PREFETCH_CHUNKS * CHUNK;                                          \
    for (int64_t tp = t0 == 0 ? CHUNK : ahead; tp <= ahead && tp < seq_len; tp += CHUNK) {       \
      const int64_t np = seq_len - tp < CHUNK ? seq_len - tp : CHUNK;                            \
      locate(tp, block_size, shift, &block, &offset);                                            \
      for (int64_t j = 0; j < np; j++) {                                                         \
        const char *r = (const char *)(cache + (blocks[block] * block_size + offset) * row);     \
        for (int b = 0; b < head_dim * (int)sizeof(T); b += 64)                                  \
          __builtin_prefetch(r + b, 0, PREFETCH_LOCALITY);                                       \
        if (++offset == block_size) offset = 0, block++;                                         \
      }                                                                                          \
    }                                                                                            \
  }

DEFINE_ROW_POINTERS(row_pointers_f32, float)
DEFINE_ROW_POINTERS(row_pointers_bf16, uint16_t)

/* The chunk's rows as float32: in place for a float32 cache, widened into `buf` for bfloat16. */
static inline __attribute__((always_inline)) void rows_f32(
    const float *cache, const int64_t *blocks, int64_t t0, int64_t seq_len, int64_t row,
    int block_size, int shift, float *buf, const int lanes, const float *rows[CHUNK]) {
  (void)buf;
  row_pointers_f32(cache, blocks, t0, seq_len, row, block_size, shift, 8 * lanes, rows);
}

static inline __attribute__((always_inline)) void rows_bf16(
    const uint16_t *cache, const int64_t *blocks, int64_t t0, int64_t seq_len, int64_t row,
    int block_size, int shift, float *buf, const int lanes, const float *rows[CHUNK]) {
  const uint16_t *raw[CHUNK];
  row_pointers_bf16(cache, blocks, t0, seq_len, row, block_size, shift, 8 * lanes, raw);
  for (int j = 0; j < CHUNK; j++) {
    float *dst = buf + j * 8 * lanes;
    for (int l = 0; l < lanes; l++) store_f32(dst + 8 * l, load_bf16(raw[j] + 8 * l));
    rows[j] = dst;
  }
}

#include "paged_decode_bf16.h" /* the key and value passes on VDPBF16PS */

/* The generic passes: query heads and probabilities in float32 against rows widened to float32. */
#define KEY_SCORES_NONE(...) 0
#define VALUE_SUMS_NONE(...) 0

/* One request, one KV head and its `group` query heads; `lanes` is head_dim / 8. */
#define DEFINE_GROUP(NAME, T, ROWS, FAST_KEY_SCORES, FAST_VALUE_SUMS)                            \
  static inline __attribute__((always_inline)) void NAME(                                        \
      const float *q, const T *key_cache, const T *value_cache, const int64_t *blocks,           \
      int64_t seq_len, int64_t row, int block_size, float scale, float *out, float *scratch,     \
      int group, const int lanes) {                                                              \
    const int head_dim = 8 * lanes;                                                              \
    const int shift = (block_size & (block_size - 1)) == 0 ? __builtin_ctz((unsigned)block_size) : -1; \
    const int64_t padded = (seq_len + CHUNK - 1) / CHUNK * CHUNK;                                \
    float *buf = scratch + (int64_t)group * padded;                                              \
    float *acc = buf + CHUNK * head_dim;                                                         \
    const float *rows[CHUNK];                                                                    \
    float inv_sum[MAX_GROUP];                                                                    \
    v8f max8[MAX_GROUP];                                                                         \
    for (int g = 0; g < group; g++) max8[g] = (v8f){0} - INFINITY;                               \
    const int fast = FAST_KEY_SCORES(q, key_cache, blocks, seq_len, row, block_size, shift, scale,\
                                     scratch, padded, group, head_dim, max8);                    \
    for (int64_t t0 = 0; !fast && t0 < seq_len; t0 += CHUNK) {                                   \
      const int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;                             \
      ROWS(key_cache, blocks, t0, seq_len, row, block_size, shift, buf, lanes, rows);            \
      for (int g = 0; g < group; g++) {                                                          \
        v8f qv[MAX_HEAD_DIM / 8], d[CHUNK];                                                      \
        for (int l = 0; l < lanes; l++) qv[l] = load_f32(q + g * head_dim + 8 * l) * scale;      \
        for (int j = 0; j < CHUNK; j++) {                                                        \
          v8f dot = qv[0] * load_f32(rows[j]);                                                   \
          for (int l = 1; l < lanes; l++) dot += qv[l] * load_f32(rows[j] + 8 * l);              \
          d[j] = dot;                                                                            \
        }                                                                                        \
        v8f scores = sum_lanes8(d);                                                              \
        for (int j = (int)n; j < CHUNK; j++) scores[j] = -INFINITY;                              \
        store_f32(scratch + g * padded + t0, scores);                                            \
        max8[g] = vmax(max8[g], scores);                                                         \
      }                                                                                          \
    }                                                                                            \
    for (int g = 0; g < group; g++) {                                                            \
      inv_sum[g] = 1.f / softmax_numerators(scratch + g * padded, seq_len, hmax(max8[g]));       \
      memset(acc + g * head_dim, 0, sizeof(float) * head_dim);                                   \
    }                                                                                            \
    const int fast_values = FAST_VALUE_SUMS(value_cache, blocks, seq_len, row, block_size, shift,\
                                            scratch, padded, group, head_dim, acc);              \
    for (int64_t t0 = 0; !fast_values && t0 < seq_len; t0 += CHUNK) {                            \
      const int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;                             \
      ROWS(value_cache, blocks, t0, seq_len, row, block_size, shift, buf, lanes, rows);          \
      for (int g = 0; g < group; g++) {                                                          \
        const float *p = scratch + g * padded + t0;                                              \
        v8f a[MAX_HEAD_DIM / 8];                                                                 \
        for (int l = 0; l < lanes; l++) a[l] = load_f32(acc + g * head_dim + 8 * l);             \
        for (int j = 0; j < n; j++)                                                              \
          for (int l = 0; l < lanes; l++) a[l] += p[j] * load_f32(rows[j] + 8 * l);              \
        for (int l = 0; l < lanes; l++) store_f32(acc + g * head_dim + 8 * l, a[l]);             \
      }                                                                                          \
    }                                                                                            \
    for (int g = 0; g < group; g++)                                                              \
      for (int l = 0; l < lanes; l++)                                                            \
        store_f32(out + g * head_dim + 8 * l, load_f32(acc + g * head_dim + 8 * l) * inv_sum[g]);   \
  }

#define DEFINE_DECODE(NAME, T, ROWS, FAST_KEY_SCORES, FAST_VALUE_SUMS)                           \
  DEFINE_GROUP(NAME##_group, T, ROWS, FAST_KEY_SCORES, FAST_VALUE_SUMS)                          \
                                                                                                 \
  int NAME(const float *query, const T *key_cache, const T *value_cache,                         \
           const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens,      \
           float *out, int64_t num_reqs, int num_heads, int num_kv_heads, int head_dim,          \
           int block_size, float scale, int64_t max_seq_len, float *scratch, int num_threads) {  \
    if (num_kv_heads <= 0 || num_heads % num_kv_heads) return 1;                                 \
    if (head_dim <= 0 || head_dim % 8 || head_dim > MAX_HEAD_DIM) return 2;                      \
    const int group = num_heads / num_kv_heads;                                                  \
    if (group > MAX_GROUP) return 3;                                                             \
    const int64_t row = (int64_t)num_kv_heads * head_dim; /* one token, all KV heads */          \
    const int64_t per_thread = scratch_floats_per_thread(max_seq_len, group, head_dim);          \
    const int64_t num_items = num_reqs * num_kv_heads;                                           \
    if (num_threads > num_items) num_threads = num_items > 1 ? (int)num_items : 1;               \
    _Pragma("omp parallel num_threads(num_threads) if(num_threads > 1)")                         \
    {                                                                                            \
      float *s = scratch + (int64_t)THREAD_NUM() * per_thread;                                   \
      int64_t begin, end;                                                                        \
      thread_items(seq_lens, num_reqs, num_kv_heads, &begin, &end);                              \
      for (int64_t item = begin; item < end; item++) {                                           \
        const int64_t req = item / num_kv_heads;                                                 \
        const int kv_head = (int)(item % num_kv_heads);                                          \
        const int64_t *blocks = block_table + req * block_table_stride;                          \
        const int64_t offset = (int64_t)kv_head * head_dim;                                      \
        const int64_t first = (req * num_heads + (int64_t)kv_head * group) * head_dim;           \
        if (head_dim == 64)                                                                      \
          NAME##_group(query + first, key_cache + offset, value_cache + offset, blocks,          \
                       seq_lens[req], row, block_size, scale, out + first, s, group, 8);         \
        else if (head_dim == 128)                                                                \
          NAME##_group(query + first, key_cache + offset, value_cache + offset, blocks,          \
                       seq_lens[req], row, block_size, scale, out + first, s, group, 16);        \
        else                                                                                     \
          NAME##_group(query + first, key_cache + offset, value_cache + offset, blocks,          \
                       seq_lens[req], row, block_size, scale, out + first, s, group,             \
                       head_dim / 8);                                                            \
      }                                                                                          \
    }                                                                                            \
    return 0;                                                                                    \
  }

DEFINE_DECODE(paged_decode_f32, float, rows_f32, KEY_SCORES_NONE, VALUE_SUMS_NONE)
DEFINE_DECODE(paged_decode_bf16_vector, uint16_t, rows_bf16, KEY_SCORES_BF16_DOT, VALUE_SUMS_BF16_DOT)

/* A bfloat16 cache: on the AMX tile unit where paged_decode_amx.c serves the shape and the step has
 * AMX_MIN_REQS requests, else the vector passes. Below that the tiles gained nothing on the kernel
 * (1 and 2 requests of 400 tokens: 26.9 / 39.4 us a layer against 28.0 / 39.4; 4: 65.0 against
 * 72.1), and one stream served ran slower with them (94.4 against 101.4 tok/s, 256 tokens, cause
 * not measured). */
#define AMX_MIN_REQS 4
int paged_decode_bf16(const float *query, const uint16_t *key_cache, const uint16_t *value_cache,
                      const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens, float *out,
                      int64_t num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                      int64_t max_seq_len, float *scratch, int num_threads) {
  if (num_reqs >= AMX_MIN_REQS && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
      paged_decode_amx_supports(head_dim, num_heads / num_kv_heads, block_size))
    return paged_decode_bf16_amx(query, key_cache, value_cache, block_table, block_table_stride, seq_lens, out,
                                 num_reqs, num_heads, num_kv_heads, head_dim, block_size, scale, max_seq_len, scratch,
                                 scratch_floats_per_thread(max_seq_len, num_heads / num_kv_heads, head_dim),
                                 num_threads);
  return paged_decode_bf16_vector(query, key_cache, value_cache, block_table, block_table_stride, seq_lens, out,
                                  num_reqs, num_heads, num_kv_heads, head_dim, block_size, scale, max_seq_len, scratch,
                                  num_threads);
}
