/* Paged attention for decode tokens on a CPU: one query token per request, its keys and values
 * read in place from the paged cache through the block table.
 *
 * The PyTorch path gathers every request's blocks into a padded tensor before attending, which
 * writes and re-reads the whole context once more per layer; at batch 64 and a few hundred tokens
 * of context that copy costs more than the model's matmuls. Here each request reads each cached
 * token's keys once and its values once, a whole token row (all KV heads) at a time.
 *
 * Layouts (contiguous): query and out [num_reqs, num_heads, head_dim] float32; key_cache and
 * value_cache [num_blocks, block_size, num_kv_heads, head_dim] of float32 or bfloat16 (raw
 * uint16); block_table [num_reqs, block_table_stride] int64; seq_lens [num_reqs] int64;
 * scratch [num_threads, num_heads, max_seq_len] float32. Softmax is exact (max, then exp and
 * sum), in float32. Query head j reads KV head j / (num_heads / num_kv_heads) (GQA).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#else
#define THREAD_NUM() 0
#endif

static inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = (uint32_t)x << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)

#define DEFINE_DECODE(NAME, T, LOAD)                                                             \
  static void NAME##_request(const float *q, const T *key_cache, const T *value_cache,           \
                             const int64_t *blocks, int64_t seq_len, float *out, int num_heads,  \
                             int num_kv_heads, int head_dim, int block_size, float scale,        \
                             float *scores) {                                                    \
    const int group = num_heads / num_kv_heads;                                                  \
    const int64_t row = (int64_t)num_kv_heads * head_dim; /* one token's keys, all heads */      \
    for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {                                       \
      const T *k = key_cache + blocks[t0 / block_size] * block_size * row;                       \
      const int64_t n = seq_len - t0 < block_size ? seq_len - t0 : block_size;                   \
      for (int64_t i = 0; i < n; i++, k += row)                                                  \
        for (int h = 0; h < num_heads; h++) {                                                    \
          const float *qh = q + h * head_dim;                                                    \
          const T *kh = k + (h / group) * head_dim;                                              \
          float dot = 0.f;                                                                       \
          _Pragma("omp simd reduction(+:dot)")                                                   \
          for (int d = 0; d < head_dim; d++) dot += qh[d] * LOAD(kh[d]);                         \
          scores[h * seq_len + t0 + i] = dot * scale;                                            \
        }                                                                                        \
    }                                                                                            \
    for (int h = 0; h < num_heads; h++) {                                                        \
      float *s = scores + h * seq_len, max_score = -INFINITY, sum = 0.f;                         \
      for (int64_t t = 0; t < seq_len; t++) max_score = s[t] > max_score ? s[t] : max_score;     \
      for (int64_t t = 0; t < seq_len; t++) {                                                    \
        s[t] = expf(s[t] - max_score);                                                           \
        sum += s[t];                                                                             \
      }                                                                                          \
      const float inv_sum = 1.f / sum;                                                           \
      for (int64_t t = 0; t < seq_len; t++) s[t] *= inv_sum;                                     \
    }                                                                                            \
    memset(out, 0, sizeof(float) * num_heads * head_dim);                                        \
    for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {                                       \
      const T *v = value_cache + blocks[t0 / block_size] * block_size * row;                     \
      const int64_t n = seq_len - t0 < block_size ? seq_len - t0 : block_size;                   \
      for (int64_t i = 0; i < n; i++, v += row)                                                  \
        for (int h = 0; h < num_heads; h++) {                                                    \
          const float p = scores[h * seq_len + t0 + i];                                          \
          const T *vh = v + (h / group) * head_dim;                                              \
          float *o = out + h * head_dim;                                                         \
          _Pragma("omp simd")                                                                    \
          for (int d = 0; d < head_dim; d++) o[d] += p * LOAD(vh[d]);                            \
        }                                                                                        \
    }                                                                                            \
  }                                                                                              \
                                                                                                 \
  int NAME(const float *query, const T *key_cache, const T *value_cache,                         \
           const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens,      \
           float *out, int64_t num_reqs, int num_heads, int num_kv_heads, int head_dim,          \
           int block_size, float scale, int64_t max_seq_len, float *scratch, int num_threads) {  \
    if (num_kv_heads <= 0 || num_heads % num_kv_heads) return 1;                                 \
    _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 1)")                    \
    for (int64_t req = 0; req < num_reqs; req++) {                                               \
      const int64_t head = req * num_heads;                                                      \
      NAME##_request(query + head * head_dim, key_cache, value_cache,                            \
                     block_table + req * block_table_stride, seq_lens[req],                      \
                     out + head * head_dim, num_heads, num_kv_heads, head_dim, block_size,       \
                     scale, scratch + (int64_t)THREAD_NUM() * num_heads * max_seq_len);          \
    }                                                                                            \
    return 0;                                                                                    \
  }

DEFINE_DECODE(paged_decode_f32, float, LOAD_F32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, LOAD_BF16)
