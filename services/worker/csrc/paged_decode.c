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
 * cost as much as the dot product itself. Work items are spread over the threads, so a single
 * request still uses every core. Vectors are GCC vector extensions of 8 floats: the compiler
 * picks AVX2, AVX-512 or NEON; nothing here names an instruction set.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"
#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#else
#define THREAD_NUM() 0
#endif

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16 /* query heads per KV head */
#define CHUNK 8      /* keys or values per pass of the inner loops */

/* Floats of scratch one thread needs: the group's scores, 8 widened rows, the group's outputs. */
int64_t scratch_floats_per_thread(int64_t max_seq_len, int group, int head_dim) {
  const int64_t padded = (max_seq_len + CHUNK - 1) / CHUNK * CHUNK;
  return (int64_t)group * padded + CHUNK * head_dim + (int64_t)group * head_dim;
}

/* Lane j of the result is the sum of d[j]'s 8 lanes. */
static inline v8f sum_lanes8(const v8f d[CHUNK]) {
  v8f a[4];
  for (int i = 0; i < 4; i++)
    a[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  const v8f b0 = __builtin_shufflevector(a[0], a[1], 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(a[0], a[1], 2, 3, 10, 11, 6, 7, 14, 15);
  const v8f b1 = __builtin_shufflevector(a[2], a[3], 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(a[2], a[3], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline v8f vmax(v8f a, v8f b) {
  const v8i a_wins = a > b;
  v8i ai, bi;
  memcpy(&ai, &a, sizeof a);
  memcpy(&bi, &b, sizeof b);
  const v8i m = (ai & a_wins) | (bi & ~a_wins);
  v8f r;
  memcpy(&r, &m, sizeof r);
  return r;
}

static inline float hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
  return m;
}

/* Scores s[0..n) -> exp(s - max), returned with their sum. */
static inline float softmax_numerators(float *s, int64_t n, float max_score) {
  v8f sum8 = {0};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const v8f e = exp_nonpositive(load_f32(s + t) - max_score);
    store_f32(s + t, e);
    sum8 += e;
  }
  float sum = hsum(sum8);
  for (; t < n; t++) {
    s[t] = expf(s[t] - max_score);
    sum += s[t];
  }
  return sum;
}

/* Rows t0 .. t0+n of one KV head as float32 rows: in place for a float32 cache, else widened
 * into `buf`. Rows past n repeat row t0, so the loops over a chunk never branch. The block walk
 * steps one row at a time: a division per row cost as much as the row's arithmetic. The next
 * chunk's rows are prefetched: rows a chunk apart lie more than a page apart, where the hardware
 * prefetchers stop (without it a float32 cache read 30% slower than with one query head a pass). */
#define DEFINE_ROWS(NAME, T, LOAD, IN_PLACE)                                                     \
  static inline __attribute__((always_inline)) void NAME(                                        \
      const T *cache, const int64_t *blocks, int64_t t0, int64_t seq_len, int64_t row,           \
      int block_size, float *buf, const int lanes, const float *rows[CHUNK]) {                   \
    const int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;                               \
    int64_t block = t0 / block_size, offset = t0 % block_size;                                   \
    const T *first = cache + (blocks[block] * block_size + offset) * row;                        \
    for (int j = 0; j < CHUNK; j++) {                                                            \
      const T *r = first;                                                                        \
      if (j < n) {                                                                               \
        r = cache + (blocks[block] * block_size + offset) * row;                                 \
        if (++offset == block_size) offset = 0, block++;                                         \
      }                                                                                          \
      if (IN_PLACE) {                                                                            \
        rows[j] = (const float *)(const void *)r;                                                \
      } else {                                                                                   \
        float *dst = buf + j * 8 * lanes;                                                        \
        for (int l = 0; l < lanes; l++) store_f32(dst + 8 * l, LOAD(r + 8 * l));                 \
        rows[j] = dst;                                                                           \
      }                                                                                          \
    }                                                                                            \
    const int64_t next = seq_len - t0 - n < CHUNK ? seq_len - t0 - n : CHUNK;                    \
    for (int64_t j = 0; j < next; j++) {                                                         \
      const char *r = (const char *)(cache + (blocks[block] * block_size + offset) * row);       \
      for (int b = 0; b < 8 * lanes * (int)sizeof(T); b += 64) __builtin_prefetch(r + b);        \
      if (++offset == block_size) offset = 0, block++;                                           \
    }                                                                                            \
  }

DEFINE_ROWS(rows_f32, float, load_f32, 1)
DEFINE_ROWS(rows_bf16, uint16_t, load_bf16, 0)

/* One request, one KV head and its `group` query heads; `lanes` is head_dim / 8. */
#define DEFINE_GROUP(NAME, T, ROWS)                                                              \
  static inline __attribute__((always_inline)) void NAME(                                        \
      const float *q, const T *key_cache, const T *value_cache, const int64_t *blocks,           \
      int64_t seq_len, int64_t row, int block_size, float scale, float *out, float *scratch,     \
      int group, const int lanes) {                                                              \
    const int head_dim = 8 * lanes;                                                              \
    const int64_t padded = (seq_len + CHUNK - 1) / CHUNK * CHUNK;                                \
    float *buf = scratch + (int64_t)group * padded;                                              \
    float *acc = buf + CHUNK * head_dim;                                                         \
    const float *rows[CHUNK];                                                                    \
    float inv_sum[MAX_GROUP];                                                                    \
    v8f max8[MAX_GROUP];                                                                         \
    for (int g = 0; g < group; g++) max8[g] = (v8f){0} - INFINITY;                               \
    for (int64_t t0 = 0; t0 < seq_len; t0 += CHUNK) {                                            \
      const int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;                             \
      ROWS(key_cache, blocks, t0, seq_len, row, block_size, buf, lanes, rows);                   \
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
    for (int64_t t0 = 0; t0 < seq_len; t0 += CHUNK) {                                            \
      const int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;                             \
      ROWS(value_cache, blocks, t0, seq_len, row, block_size, buf, lanes, rows);                 \
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

#define DEFINE_DECODE(NAME, T, ROWS)                                                             \
  DEFINE_GROUP(NAME##_group, T, ROWS)                                                            \
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
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if(num_threads > 1)")\
    for (int64_t item = 0; item < num_items; item++) {                                           \
      const int64_t req = item / num_kv_heads;                                                   \
      const int kv_head = (int)(item % num_kv_heads);                                            \
      float *s = scratch + (int64_t)THREAD_NUM() * per_thread;                                   \
      const int64_t *blocks = block_table + req * block_table_stride;                            \
      const int64_t offset = (int64_t)kv_head * head_dim;                                        \
      const int64_t first = (req * num_heads + (int64_t)kv_head * group) * head_dim;             \
      if (head_dim == 64)                                                                        \
        NAME##_group(query + first, key_cache + offset, value_cache + offset, blocks,            \
                     seq_lens[req], row, block_size, scale, out + first, s, group, 8);           \
      else if (head_dim == 128)                                                                  \
        NAME##_group(query + first, key_cache + offset, value_cache + offset, blocks,            \
                     seq_lens[req], row, block_size, scale, out + first, s, group, 16);          \
      else                                                                                       \
        NAME##_group(query + first, key_cache + offset, value_cache + offset, blocks,            \
                     seq_lens[req], row, block_size, scale, out + first, s, group, head_dim / 8);\
    }                                                                                            \
    return 0;                                                                                    \
  }

DEFINE_DECODE(paged_decode_f32, float, rows_f32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, rows_bf16)
