/* paged_decode.c's passes for a bfloat16 cache on CPUs with AVX512_BF16 (VDPBF16PS): included
 * there after its row walk (row_pointers_bf16), and only there. Elsewhere the macros are 0 and the
 * generic passes run. */
#ifndef SPINDLE_PAGED_DECODE_BF16_H
#define SPINDLE_PAGED_DECODE_BF16_H

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

/* The key pass for a bfloat16 cache where the CPU has VDPBF16PS: the query heads rounded to
 * bfloat16 pairs once (exact for a bfloat16 model's queries), multiplied with the cached keys as
 * they lie, 32 products a call summed in float32, so the keys are never widened. */
static inline __attribute__((always_inline)) void key_scores_pairs(
    const float *q, const uint16_t *key_cache, const int64_t *blocks, int64_t seq_len, int64_t row, int block_size,
    int shift, float scale, float *scores, int64_t padded, const int group, const int num_pairs, v8f *max8) {
  const int head_dim = 32 * num_pairs;
  __m512bh qb[MAX_GROUP][MAX_HEAD_DIM / 32];
  for (int g = 0; g < group; g++)
    for (int c = 0; c < num_pairs; c++)
      qb[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * head_dim + 32 * c + 16),
                                     _mm512_loadu_ps(q + g * head_dim + 32 * c));
  const uint16_t *rows[CHUNK];
  for (int64_t t0 = 0; t0 < seq_len; t0 += CHUNK) {
    const int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;
    row_pointers_bf16(key_cache, blocks, t0, seq_len, row, block_size, shift, head_dim, rows);
    for (int g = 0; g < group; g++) {
      __m512 d[CHUNK];
      for (int j = 0; j < CHUNK; j++) {
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], (__m512bh)_mm512_loadu_si512(rows[j]));
        for (int c = 1; c < num_pairs; c++)
          dot = _mm512_dpbf16_ps(dot, qb[g][c], (__m512bh)_mm512_loadu_si512(rows[j] + 32 * c));
        d[j] = dot;
      }
      v8f s = sum_lanes16x8(d) * scale;
      for (int j = (int)n; j < CHUNK; j++) s[j] = -INFINITY;
      store_f32(scores + g * padded + t0, s);
      max8[g] = vmax(max8[g], s);
    }
  }
}

/* The key pass, inlined with the common sizes constant (as the value pass below). */
static inline int key_scores_bf16_dot(const float *q, const uint16_t *key_cache, const int64_t *blocks,
                                      int64_t seq_len, int64_t row, int block_size, int shift, float scale,
                                      float *scores, int64_t padded, int group, int head_dim, v8f *max8) {
  if (head_dim % 32) return 0;
#define KEY_SCORES(G, P) key_scores_pairs(q, key_cache, blocks, seq_len, row, block_size, shift, scale, scores, \
                                          padded, G, P, max8)
  if (head_dim == 64 && group == 3) KEY_SCORES(3, 2);
  else if (head_dim == 64 && group == 4) KEY_SCORES(4, 2);
  else if (head_dim == 128 && group == 2) KEY_SCORES(2, 4);
  else KEY_SCORES(group, head_dim / 32);
#undef KEY_SCORES
  return 1;
}

/* probs [0, seq_len) rounded to bfloat16 and packed two to a 32-bit lane (p[2i], p[2i + 1]), in
 * place: pair i overwrites float i, which has been read by then. A last odd probability pairs with 0. */
static inline void bf16_prob_pairs(float *probs, int64_t seq_len) {
  uint32_t *pairs = (uint32_t *)probs;
  for (int64_t t = 0; t < seq_len; t += 32) {
    const int64_t left = seq_len - t;
    const __mmask16 low = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
    const __mmask16 high = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
    const __m512 a = _mm512_maskz_loadu_ps(low, probs + t), b = _mm512_maskz_loadu_ps(high, probs + t + 16);
    const int64_t num_pairs = (left + 1) / 2;
    const __mmask16 store = num_pairs >= 16 ? 0xffff : (__mmask16)((1u << num_pairs) - 1);
    _mm512_mask_storeu_epi32(pairs + t / 2, store, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

/* The value pass for a bfloat16 cache where the CPU has VDPBF16PS: two keys' value rows are
 * interleaved (one VPERMT2W per 16 dimensions) and weighted by their probabilities rounded to
 * bfloat16 (as GPU flash attention rounds them, paired once up front), the sums float32.
 * acc [group][head_dim]. Inlined with constant group and num_vectors where they are common, so the
 * sums stay in registers: with runtime sizes they lived on the stack, a load and a store per
 * product. */
static inline __attribute__((always_inline)) void value_sums_pairs(
    const uint16_t *value_cache, const int64_t *blocks, int64_t seq_len, int64_t row, int block_size, int shift,
    const float *probs, int64_t padded, const int group, const int num_vectors, float *acc) {
  uint16_t low_index[32], high_index[32];
  for (int i = 0; i < 32; i++) {
    low_index[i] = (uint16_t)(i / 2 + (i % 2 ? 32 : 0));
    high_index[i] = (uint16_t)(low_index[i] + 16);
  }
  const __m512i low = _mm512_loadu_si512(low_index), high = _mm512_loadu_si512(high_index);
  __m512 sums[MAX_GROUP][MAX_HEAD_DIM / 16];
  for (int g = 0; g < group; g++)
    for (int v = 0; v < num_vectors; v++) sums[g][v] = _mm512_setzero_ps();
  const uint16_t *rows[CHUNK];
  for (int64_t t0 = 0; t0 < seq_len; t0 += CHUNK) {
    row_pointers_bf16(value_cache, blocks, t0, seq_len, row, block_size, shift, 16 * num_vectors, rows);
    for (int j = 0; j < CHUNK && t0 + j < seq_len; j += 2) {
      __m512bh pairs[MAX_HEAD_DIM / 16];
      for (int c = 0; c < num_vectors / 2; c++) {
        const __m512i a = _mm512_loadu_si512(rows[j] + 32 * c), b = _mm512_loadu_si512(rows[j + 1] + 32 * c);
        pairs[2 * c] = (__m512bh)_mm512_permutex2var_epi16(a, low, b);
        pairs[2 * c + 1] = (__m512bh)_mm512_permutex2var_epi16(a, high, b);
      }
      for (int g = 0; g < group; g++) {
        const uint32_t *p = (const uint32_t *)(probs + g * padded);
        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)p[(t0 + j) / 2]);
        for (int v = 0; v < num_vectors; v++) sums[g][v] = _mm512_dpbf16_ps(sums[g][v], pairs[v], w);
      }
    }
  }
  for (int g = 0; g < group; g++)
    for (int v = 0; v < num_vectors; v++) _mm512_storeu_ps(acc + g * 16 * num_vectors + 16 * v, sums[g][v]);
}

static inline int value_sums_bf16_dot(const uint16_t *value_cache, const int64_t *blocks, int64_t seq_len,
                                      int64_t row, int block_size, int shift, float *probs, int64_t padded,
                                      int group, int head_dim, float *acc) {
  if (head_dim % 32) return 0;
  for (int g = 0; g < group; g++) bf16_prob_pairs(probs + g * padded, seq_len);
#define VALUE_SUMS(G, V) \
  value_sums_pairs(value_cache, blocks, seq_len, row, block_size, shift, probs, padded, G, V, acc)
  if (head_dim == 64 && group == 1) VALUE_SUMS(1, 4);
  else if (head_dim == 64 && group == 2) VALUE_SUMS(2, 4);
  else if (head_dim == 64 && group == 3) VALUE_SUMS(3, 4);
  else if (head_dim == 64 && group == 4) VALUE_SUMS(4, 4);
  else if (head_dim == 128 && group == 1) VALUE_SUMS(1, 8);
  else if (head_dim == 128 && group == 2) VALUE_SUMS(2, 8);
  else VALUE_SUMS(group, head_dim / 16);
#undef VALUE_SUMS
  return 1;
}
#define KEY_SCORES_BF16_DOT key_scores_bf16_dot
#define VALUE_SUMS_BF16_DOT value_sums_bf16_dot
#else
#define KEY_SCORES_BF16_DOT(...) 0
#define VALUE_SUMS_BF16_DOT(...) 0
#endif

#endif
