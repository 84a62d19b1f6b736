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
 * scratch [num_threads, max_seq_len] float32. Softmax is exact (max, then exp and sum), in
 * float32. Query head j reads KV head j / (num_heads / num_kv_heads) (GQA).
 *
 * Each query head keeps its query and its output in registers, 8 lanes of head_dim per vector
 * (GCC vector extensions: the compiler picks AVX2, AVX-512 or NEON; nothing here names an
 * instruction set), so a key row costs head_dim / 8 independent multiply-adds and so does a value
 * row. head_dim 64 and 128 get loops of fixed length, which the compiler unrolls into registers;
 * any other multiple of 8 up to MAX_HEAD_DIM runs the same code with a loop bound read at run time.
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

/* Scores s[0..n) -> exp(s - max), returned with their sum. */
static inline float softmax_numerators(float *s, int64_t n, float max_score) {
  v8f sum8 = {0};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const v8f e = exp_nonpositive(load_f32(s + t) - max_score);
    memcpy(s + t, &e, sizeof e);
    sum8 += e;
  }
  float sum = hsum(sum8);
  for (; t < n; t++) {
    s[t] = expf(s[t] - max_score);
    sum += s[t];
  }
  return sum;
}

/* One request, one query head: qv and acc live in registers when LANES is a constant. */
#define DEFINE_HEAD(NAME, T, LOAD)                                                               \
  static inline __attribute__((always_inline)) void NAME(                                        \
      const float *q, const T *key_cache, const T *value_cache, const int64_t *blocks,           \
      int64_t seq_len, int64_t row, int block_size, float scale, float *out, float *s,           \
      const int lanes) {                                                                         \
    v8f qv[MAX_HEAD_DIM / 8], acc[MAX_HEAD_DIM / 8];                                             \
    for (int l = 0; l < lanes; l++) qv[l] = load_f32(q + 8 * l) * scale;                         \
    float max_score = -INFINITY;                                                                 \
    for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {                                       \
      const T *k = key_cache + blocks[t0 / block_size] * block_size * row;                       \
      const int64_t n = seq_len - t0 < block_size ? seq_len - t0 : block_size;                   \
      for (int64_t i = 0; i < n; i++, k += row) {                                                \
        v8f dot = qv[0] * LOAD(k);                                                               \
        for (int l = 1; l < lanes; l++) dot += qv[l] * LOAD(k + 8 * l);                          \
        const float score = hsum(dot);                                                           \
        s[t0 + i] = score;                                                                       \
        max_score = score > max_score ? score : max_score;                                       \
      }                                                                                          \
    }                                                                                            \
    const float inv_sum = 1.f / softmax_numerators(s, seq_len, max_score);                       \
    for (int l = 0; l < lanes; l++) acc[l] = (v8f){0};                                           \
    for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {                                       \
      const T *v = value_cache + blocks[t0 / block_size] * block_size * row;                     \
      const int64_t n = seq_len - t0 < block_size ? seq_len - t0 : block_size;                   \
      for (int64_t i = 0; i < n; i++, v += row) {                                                \
        const float p = s[t0 + i];                                                               \
        for (int l = 0; l < lanes; l++) acc[l] += p * LOAD(v + 8 * l);                           \
      }                                                                                          \
    }                                                                                            \
    for (int l = 0; l < lanes; l++) {                                                            \
      const v8f o = acc[l] * inv_sum;                                                            \
      memcpy(out + 8 * l, &o, sizeof o);                                                         \
    }                                                                                            \
  }

#define DEFINE_DECODE(NAME, T, LOAD)                                                             \
  DEFINE_HEAD(NAME##_head, T, LOAD)                                                              \
                                                                                                 \
  int NAME(const float *query, const T *key_cache, const T *value_cache,                         \
           const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens,      \
           float *out, int64_t num_reqs, int num_heads, int num_kv_heads, int head_dim,          \
           int block_size, float scale, int64_t max_seq_len, float *scratch, int num_threads) {  \
    if (num_kv_heads <= 0 || num_heads % num_kv_heads) return 1;                                 \
    if (head_dim <= 0 || head_dim % 8 || head_dim > MAX_HEAD_DIM) return 2;                      \
    const int group = num_heads / num_kv_heads;                                                  \
    const int64_t row = (int64_t)num_kv_heads * head_dim; /* one token, all KV heads */          \
    if (num_threads > num_reqs) num_threads = num_reqs > 1 ? (int)num_reqs : 1;                  \
    _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 1) if(num_threads > 1)")\
    for (int64_t req = 0; req < num_reqs; req++) {                                               \
      float *s = scratch + (int64_t)THREAD_NUM() * max_seq_len;                                  \
      const int64_t *blocks = block_table + req * block_table_stride;                            \
      for (int h = 0; h < num_heads; h++) {                                                      \
        const int64_t offset = (int64_t)(h / group) * head_dim;                                  \
        const float *q = query + (req * num_heads + h) * head_dim;                               \
        float *o = out + (req * num_heads + h) * head_dim;                                       \
        if (head_dim == 64)                                                                      \
          NAME##_head(q, key_cache + offset, value_cache + offset, blocks, seq_lens[req], row,   \
                      block_size, scale, o, s, 8);                                               \
        else if (head_dim == 128)                                                                \
          NAME##_head(q, key_cache + offset, value_cache + offset, blocks, seq_lens[req], row,   \
                      block_size, scale, o, s, 16);                                              \
        else                                                                                     \
          NAME##_head(q, key_cache + offset, value_cache + offset, blocks, seq_lens[req], row,   \
                      block_size, scale, o, s, head_dim / 8);                                    \
      }                                                                                          \
    }                                                                                            \
    return 0;                                                                                    \
  }

DEFINE_DECODE(paged_decode_f32, float, load_f32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, load_bf16)
