/* The key pass of paged_decode_int8.c: one request's query heads against one KV head's int8 keys,
 * which each block holds as int8 [head_dim / 4, block_size, 4] (attention/int8_kv_cache.py): a
 * row's dimensions in fours, the block's tokens side by side per four. Laid out so, one VPDPBUSD
 * multiplies 16 tokens' keys (four dimensions each) by a broadcast four of query values and sums
 * each token's dot product in its own lane: no sums across lanes, which took a quarter of the key
 * pass over rows, and no int8 -> bfloat16 table (another sixth).
 *
 * A key is k_t = k_mid_t + k_scale_t * q_t (q_t int8), so query_g . k_t = k_scale_t * (query_g .
 * q_t) + k_mid_t * sum(query_g): writes scores[g * padded + t] = scale * (query_g . k_t) for t <
 * seq_len and each head's largest score into max_score[g]. */
#ifndef SPINDLE_DECODE_INT8_KEYS_H
#define SPINDLE_DECODE_INT8_KEYS_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "decode_common.h"
#include "int8_bf16.h"

/* Blocks prefetched ahead of the one being read: a head's keys are head_dim * block_size
 * contiguous bytes in each block, but the blocks lie anywhere in the cache. */
#define KEY_PREFETCH_BLOCKS 4

/* Where one KV head's keys lie in the key half of the cache. */
typedef struct {
  const int8_t *data;   /* the head's keys in block 0: int8 [head_dim / 4, block_size, 4] */
  const int8_t *scales; /* the head's scales in block 0: float32 [block_size] */
  const int8_t *mids;   /* the head's midpoints in block 0: float32 [block_size] */
  int64_t block_bytes;
  int block_size;
} HeadKeys;

/* The head's keys and scales in the sequence's block b + KEY_PREFETCH_BLOCKS (from block 1 at
 * b = 0), where the sequence has one. */
static inline __attribute__((always_inline)) void prefetch_key_blocks(const HeadKeys *k, const int64_t *blocks,
                                                                      int64_t b, int64_t num_blocks, int head_dim) {
  const int64_t bytes = (int64_t)head_dim * k->block_size;
  for (int64_t a = b == 0 ? 1 : b + KEY_PREFETCH_BLOCKS; a <= b + KEY_PREFETCH_BLOCKS && a < num_blocks; a++) {
    const int64_t base = blocks[a] * k->block_bytes;
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(k->data + base + line, 0, 1);
    __builtin_prefetch(k->scales + base, 0, 1);
    __builtin_prefetch(k->mids + base, 0, 1);
  }
}

/* scale * sum(query_g) for each query head of the group: what a key's midpoint adds to its score,
 * per unit. */
static inline void query_sums(const float *q, int group, int head_dim, float scale, float *sums) {
  for (int g = 0; g < group; g++) {
    float s = 0.f;
    for (int d = 0; d < head_dim; d++) s += q[g * head_dim + d];
    sums[g] = s * scale;
  }
}

/* Any CPU (blocks of any size): float32 query against the keys widened to float32, 4 tokens of a
 * block at a time. Two tokens' fours widen into one vector of 8 and multiply a vector holding the
 * query's four twice, so each lane sums one (token, dimension mod 4) over the row; the 4 lanes of a
 * token are added once at the end. Reads past the block's last token stay inside the block (the
 * next four's keys, or the scales) and are not stored. With the group a constant (below) the sums
 * stay in registers. */
static inline __attribute__((always_inline)) void key_scores_float_impl(const float *q, const HeadKeys *keys,
                                                                        const int64_t *blocks, int64_t seq_len,
                                                                        float scale, float *scores, int64_t padded,
                                                                        const int group, int head_dim,
                                                                        float *max_score) {
  const int bs = keys->block_size;
  const int64_t num_blocks = (seq_len + bs - 1) / bs;
  v8f twice[MAX_GROUP][MAX_HEAD_DIM / 4]; /* query g's four p in lanes 0-3 and again in 4-7 */
  float q_sums[MAX_GROUP];
  query_sums(q, group, head_dim, scale, q_sums);
  for (int g = 0; g < group; g++) {
    max_score[g] = -INFINITY;
    for (int p = 0; p < head_dim / 4; p++)
      for (int l = 0; l < 8; l++) twice[g][p][l] = q[g * head_dim + 4 * p + l % 4];
  }
  for (int64_t b = 0; b < num_blocks; b++) {
    prefetch_key_blocks(keys, blocks, b, num_blocks, head_dim);
    const int8_t *base = keys->data + blocks[b] * keys->block_bytes;
    const int8_t *scale_bytes = keys->scales + blocks[b] * keys->block_bytes;
    const int8_t *mid_bytes = keys->mids + blocks[b] * keys->block_bytes;
    const int64_t t0 = b * bs;
    const int n = seq_len - t0 < bs ? (int)(seq_len - t0) : bs;
    for (int o0 = 0; o0 < n; o0 += 4) {
      const int m = n - o0 < 4 ? n - o0 : 4;
      v8f sums[MAX_GROUP][2];
      for (int g = 0; g < group; g++) sums[g][0] = sums[g][1] = (v8f){0};
      for (int p = 0; p < head_dim / 4; p++) {
        const int8_t *r = base + (int64_t)p * 4 * bs + 4 * o0;
        const v8f k01 = load_int8(r), k23 = load_int8(r + 8); /* tokens o0, o0+1 and o0+2, o0+3 */
        for (int g = 0; g < group; g++) sums[g][0] += twice[g][p] * k01, sums[g][1] += twice[g][p] * k23;
      }
      float row_scales[4], row_mids[4];
      memcpy(row_scales, scale_bytes + 4 * o0, sizeof(float) * m);
      memcpy(row_mids, mid_bytes + 4 * o0, sizeof(float) * m);
      for (int g = 0; g < group; g++) {
        const v8f a = __builtin_shufflevector(sums[g][0], sums[g][1], 0, 2, 4, 6, 8, 10, 12, 14) +
                      __builtin_shufflevector(sums[g][0], sums[g][1], 1, 3, 5, 7, 9, 11, 13, 15);
        const v8f dot = __builtin_shufflevector(a, a, 0, 2, 4, 6, 0, 2, 4, 6) +
                        __builtin_shufflevector(a, a, 1, 3, 5, 7, 1, 3, 5, 7); /* lanes 0-3: the 4 tokens */
        for (int t = 0; t < m; t++) {
          const float s = dot[t] * (row_scales[t] * scale) + row_mids[t] * q_sums[g];
          scores[g * padded + t0 + o0 + t] = s;
          max_score[g] = s > max_score[g] || s != s ? s : max_score[g];
        }
      }
    }
  }
}

#define KEY_SCORES_FLOAT_GROUP(G)                                                                    \
  case G:                                                                                          \
    key_scores_float_impl(q, keys, blocks, seq_len, scale, scores, padded, G, head_dim, max_score); \
    return;
static void key_scores_float(const float *q, const HeadKeys *keys, const int64_t *blocks, int64_t seq_len,
                             float scale, float *scores, int64_t padded, int group, int head_dim, float *max_score) {
  switch (group) {
    KEY_SCORES_FLOAT_GROUP(1)
    KEY_SCORES_FLOAT_GROUP(2)
    KEY_SCORES_FLOAT_GROUP(3)
    KEY_SCORES_FLOAT_GROUP(4)
    KEY_SCORES_FLOAT_GROUP(5)
    KEY_SCORES_FLOAT_GROUP(6)
    KEY_SCORES_FLOAT_GROUP(7)
    KEY_SCORES_FLOAT_GROUP(8)
    default:
      key_scores_float_impl(q, keys, blocks, seq_len, scale, scores, padded, group, head_dim, max_score);
  }
}

#if HAS_INT8_BF16_TABLE && defined(__AVX512VNNI__)
/* One query head quantized in steps of its largest |value| / 16256 (127 * 128: 2^-14 of it, finer
 * than the bfloat16 rounding of the value pass's weights), each value q split into a high part in
 * [-127, 127] and a low part in [-64, 63], q = 128 * high + low, every four of each part packed in
 * one int32 for VPDPBUSD; `offset` is 128 * sum(q), what the keys' unsigned bias adds (below). A
 * head with no finite largest value gets a NaN or infinite step, so its scores come out NaN as the
 * float32 passes' would. */
static inline void quantize_query_int15(const float *q, int head_dim, int32_t *high, int32_t *low, int32_t *offset,
                                        float *step) {
  __m512 amax16 = _mm512_setzero_ps();
  for (int d = 0; d < head_dim; d += 16) amax16 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(q + d)), amax16);
  float amax = _mm512_reduce_max_ps(amax16);
  for (int d = 0; d < head_dim; d++) /* a NaN the max above passed over */
    if (q[d] != q[d]) amax = q[d];
  const int finite = amax > 0.f && amax <= FLT_MAX;
  const __m512 inv = _mm512_set1_ps(finite ? 16256.f / amax : 0.f);
  const __m512i limit = _mm512_set1_epi32(16256), half = _mm512_set1_epi32(64);
  __m512i sum = _mm512_setzero_si512();
  for (int d = 0; d < head_dim; d += 16) { /* head_dim is a multiple of 64 here */
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + d), inv)); /* nearest, ties to even */
    v = _mm512_max_epi32(_mm512_min_epi32(v, limit), _mm512_sub_epi32(_mm512_setzero_si512(), limit));
    const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(v, half), 7); /* floor((v + 64) / 128) in [-127, 127] */
    const __m512i l = _mm512_sub_epi32(v, _mm512_slli_epi32(h, 7));  /* in [-64, 63] */
    _mm_storeu_si128((__m128i *)((int8_t *)high + d), _mm512_cvtepi32_epi8(h));
    _mm_storeu_si128((__m128i *)((int8_t *)low + d), _mm512_cvtepi32_epi8(l));
    sum = _mm512_add_epi32(sum, v);
  }
  *offset = 128 * _mm512_reduce_add_epi32(sum);
  *step = finite ? amax / 16256.f : amax;
}

/* 16 tokens' scores from their exact int32 dot products with the quantized query (decode_int8_keys.h's
 * formula: scale is folded into step and q_sum), stored where valid and kept in the running max. */
static inline __attribute__((always_inline)) void store_scores16(__m512i dot_int, __m512 row_scales, __m512 row_mids,
                                                                 float q_sum, float step, __mmask16 valid,
                                                                 float *dst, __m512 *max16) {
  const __m512 dot = _mm512_cvtepi32_ps(dot_int);
  const __m512 s = _mm512_fmadd_ps(row_mids, _mm512_set1_ps(q_sum),
                                   _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(step)), row_scales));
  _mm512_mask_storeu_ps(dst, valid, s);
  *max16 = _mm512_mask_max_ps(*max16, valid, *max16, s);
}

/* Each head's largest score from its 16 running maxima (a NaN wins, as in the float32 passes). */
static inline void reduce_max_scores(const __m512 *max16, int group, float *max_score) {
  for (int g = 0; g < group; g++) {
    float lanes[16];
    _mm512_storeu_ps(lanes, max16[g]);
    max_score[g] = lanes[0];
    for (int l = 1; l < 16; l++)
      max_score[g] = lanes[l] > max_score[g] || lanes[l] != lanes[l] ? lanes[l] : max_score[g];
  }
}

/* Independent sums per part of a head: one chain of 16 dependent VPDPBUSD (head_dim 64) waited on
 * their latency, not their throughput. */
#define KEY_SUMS 4

/* Where the CPU has AVX512_VNNI (and the build's table: Zen 4, Sapphire Rapids) and blocks are a
 * multiple of 16 tokens: 16 tokens a pass. VPDPBUSD multiplies unsigned by signed bytes, so the
 * keys take a bias of 128 (k ^ 0x80 = k + 128), paid back by `offset`: sum((k + 128) q) = sum(k q)
 * + 128 sum(q). The pass's keys are loaded and biased once for all the group's heads (they stay in
 * registers at head_dim 64); each head takes two VPDPBUSD per four dimensions (its high and low
 * parts), summed exactly in int32: |128 * high sums| <= 128 * 255 * 127 * 256 < 2^31. */
static inline __attribute__((always_inline)) void key_scores_int8_impl(const float *q, const HeadKeys *keys,
                                                                       const int64_t *blocks, int64_t seq_len,
                                                                       float scale, float *scores, int64_t padded,
                                                                       int group, const int head_dim,
                                                                       float *max_score) {
  const int bs = keys->block_size;
  const int64_t num_blocks = (seq_len + bs - 1) / bs;
  int32_t high[MAX_GROUP][MAX_HEAD_DIM / 4], low[MAX_GROUP][MAX_HEAD_DIM / 4], offset[MAX_GROUP];
  float step[MAX_GROUP], q_sums[MAX_GROUP];
  __m512 max16[MAX_GROUP];
  query_sums(q, group, head_dim, scale, q_sums);
  for (int g = 0; g < group; g++) {
    quantize_query_int15(q + g * head_dim, head_dim, high[g], low[g], &offset[g], &step[g]);
    step[g] *= scale;
    max16[g] = _mm512_set1_ps(-INFINITY);
  }
  const __m512i bias = _mm512_set1_epi8((char)0x80);
  for (int64_t b = 0; b < num_blocks; b++) {
    prefetch_key_blocks(keys, blocks, b, num_blocks, head_dim);
    const int8_t *base = keys->data + blocks[b] * keys->block_bytes;
    const int8_t *scale_bytes = keys->scales + blocks[b] * keys->block_bytes;
    const int8_t *mid_bytes = keys->mids + blocks[b] * keys->block_bytes;
    const int64_t t0 = b * bs;
    for (int o0 = 0; o0 < bs && t0 + o0 < seq_len; o0 += 16) {
      const int64_t left = seq_len - t0 - o0;
      const __mmask16 valid = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      __m512i k[MAX_HEAD_DIM / 4];
      for (int p = 0; p < head_dim / 4; p++)
        k[p] = _mm512_xor_si512(_mm512_loadu_si512(base + (int64_t)p * 4 * bs + 4 * o0), bias);
      const __m512 row_scales = _mm512_loadu_ps((const float *)(scale_bytes + 4 * o0));
      const __m512 row_mids = _mm512_loadu_ps((const float *)(mid_bytes + 4 * o0));
      for (int g = 0; g < group; g++) {
        __m512i hi[KEY_SUMS], lo[KEY_SUMS];
        for (int a = 0; a < KEY_SUMS; a++) hi[a] = lo[a] = _mm512_setzero_si512();
        for (int p = 0; p < head_dim / 4; p++) {
          hi[p % KEY_SUMS] = _mm512_dpbusd_epi32(hi[p % KEY_SUMS], k[p], _mm512_set1_epi32(high[g][p]));
          lo[p % KEY_SUMS] = _mm512_dpbusd_epi32(lo[p % KEY_SUMS], k[p], _mm512_set1_epi32(low[g][p]));
        }
        for (int a = 1; a < KEY_SUMS; a++)
          hi[0] = _mm512_add_epi32(hi[0], hi[a]), lo[0] = _mm512_add_epi32(lo[0], lo[a]);
        const __m512i dot_int = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[0], 7), lo[0]),
                                                 _mm512_set1_epi32(offset[g]));
        store_scores16(dot_int, row_scales, row_mids, q_sums[g], step[g], valid, scores + g * padded + t0 + o0,
                       &max16[g]);
      }
    }
  }
  reduce_max_scores(max16, group, max_score);
}
#define HAS_INT8_KEY_DOT 1
#else
#define HAS_INT8_KEY_DOT 0
#endif

static inline void key_scores(const float *q, const HeadKeys *keys, const int64_t *blocks, int64_t seq_len,
                              float scale, float *scores, int64_t padded, int group, int head_dim, float *max_score) {
#if HAS_INT8_KEY_DOT
  if (keys->block_size % 16 == 0 && head_dim % 64 == 0) {
    if (head_dim == 64)
      key_scores_int8_impl(q, keys, blocks, seq_len, scale, scores, padded, group, 64, max_score);
    else if (head_dim == 128)
      key_scores_int8_impl(q, keys, blocks, seq_len, scale, scores, padded, group, 128, max_score);
    else
      key_scores_int8_impl(q, keys, blocks, seq_len, scale, scores, padded, group, head_dim, max_score);
    return;
  }
#endif
  key_scores_float(q, keys, blocks, seq_len, scale, scores, padded, group, head_dim, max_score);
}

#endif
