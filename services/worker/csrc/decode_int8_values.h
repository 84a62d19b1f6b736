/* The value side of paged_decode_int8.c: where one KV head's int8 value rows lie in the cache, the
 * walk over a sequence's rows in chunks (with their scales and midpoints, prefetched ahead), and the
 * value pass on VDPBF16PS where the build has it. A value is v_t = v_mid_t + v_scale_t * q_t (q_t
 * int8), so sum_t p_t v_t = sum_t (p_t v_scale_t) q_t + sum_t p_t v_mid_t. */
#ifndef SPINDLE_DECODE_INT8_VALUES_H
#define SPINDLE_DECODE_INT8_VALUES_H

#include <stdint.h>
#include <string.h>

#include "decode_common.h"
#include "int8_bf16.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Value rows are prefetched into L2 this many chunks ahead. A row is one line at head_dim 64, so a
 * chunk's 8 lines ahead left the loop waiting on memory: SmolLM2's shapes, 64 requests x 1000
 * tokens over caches cycled from memory, two threads: 4.6 ms a call at one chunk ahead into L1
 * (as paged_decode.c), 3.6 ms at two into L1, 2.1 ms at 8 chunks into L2. */
#define PREFETCH_CHUNKS 8
#define PREFETCH_LOCALITY 1

/* Where one KV head's rows lie in the value half of the cache. */
typedef struct {
  const int8_t *data;   /* the head's row in token slot 0 of block 0 */
  const int8_t *scales; /* the head's scale in token slot 0 of block 0 (float32 bytes) */
  const int8_t *mids;   /* the head's midpoint in token slot 0 of block 0 (float32 bytes) */
  int64_t block_bytes;
  int64_t row_bytes;   /* num_kv_heads * head_dim: one token's data, all KV heads */
  int64_t scale_bytes; /* from one token's scale to the next's: 4, a head's scales are contiguous */
  int block_size;
} HeadRows;

/* Rows t0 .. t0+n of one KV head, for blocks of any size: their data, scales and midpoints; rows
 * past n repeat row t0 (its scale and midpoint too), so the loops over a chunk never branch. As in paged_decode.c the
 * block walk steps one row at a time (a division per row cost as much as the row's arithmetic).
 * The rows and scales PREFETCH_CHUNKS chunks ahead are prefetched (at the first chunk, every chunk
 * up to there): rows a chunk apart lie farther apart than the hardware prefetchers follow. */
static inline __attribute__((always_inline)) void scattered_rows(const HeadRows *h, const int64_t *blocks,
                                                                 int64_t t0, int64_t seq_len, int head_dim,
                                                                 const int8_t *rows[CHUNK], float scales[CHUNK],
                                                                 float mids[CHUNK]) {
  const int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;
  int64_t block = t0 / h->block_size, offset = t0 % h->block_size;
  for (int j = 0; j < CHUNK; j++) {
    if (j < n) {
      const int64_t base = blocks[block] * h->block_bytes;
      rows[j] = h->data + base + offset * h->row_bytes;
      memcpy(&scales[j], h->scales + base + offset * h->scale_bytes, sizeof(float));
      memcpy(&mids[j], h->mids + base + offset * h->scale_bytes, sizeof(float));
      if (++offset == h->block_size) offset = 0, block++;
    } else {
      rows[j] = rows[0];
      scales[j] = scales[0];
      mids[j] = mids[0];
    }
  }
  const int64_t ahead = t0 + PREFETCH_CHUNKS * CHUNK;
  for (int64_t tp = t0 == 0 ? CHUNK : ahead; tp <= ahead && tp < seq_len; tp += CHUNK) {
    const int64_t np = seq_len - tp < CHUNK ? seq_len - tp : CHUNK;
    block = tp / h->block_size, offset = tp % h->block_size;
    for (int64_t j = 0; j < np; j++) {
      const int64_t base = blocks[block] * h->block_bytes;
      for (int b = 0; b < head_dim; b += 64)
        __builtin_prefetch(h->data + base + offset * h->row_bytes + b, 0, PREFETCH_LOCALITY);
      __builtin_prefetch(h->scales + base + offset * h->scale_bytes, 0, PREFETCH_LOCALITY);
      __builtin_prefetch(h->mids + base + offset * h->scale_bytes, 0, PREFETCH_LOCALITY);
      if (++offset == h->block_size) offset = 0, block++;
    }
  }
}

/* scattered_rows where a chunk lies in one block (blocks of a multiple of CHUNK tokens): its rows a
 * fixed stride apart, its scales and midpoints one vector each; the rows, scales and midpoints of
 * the block VALUE_PREFETCH_BLOCKS ahead prefetched at each block's first chunk (at the first,
 * every block up to there). */
#define VALUE_PREFETCH_BLOCKS 4
static inline __attribute__((always_inline)) void chunk_rows(const HeadRows *h, const int64_t *blocks, int64_t t0,
                                                             int64_t seq_len, int head_dim,
                                                             const int8_t *rows[CHUNK], float scales[CHUNK],
                                                             float mids[CHUNK]) {
  const int bs = h->block_size;
  const int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK, b = t0 / bs, offset = t0 % bs;
  const int64_t base = blocks[b] * h->block_bytes;
  for (int j = 0; j < CHUNK; j++) rows[j] = h->data + base + (offset + (j < n ? j : 0)) * h->row_bytes;
  memcpy(scales, h->scales + base + offset * h->scale_bytes, sizeof(float) * CHUNK); /* past n: weighted 0 */
  memcpy(mids, h->mids + base + offset * h->scale_bytes, sizeof(float) * CHUNK);
  if (offset) return;
  const int64_t num_blocks = (seq_len + bs - 1) / bs;
  for (int64_t a = b == 0 ? 1 : b + VALUE_PREFETCH_BLOCKS; a <= b + VALUE_PREFETCH_BLOCKS && a < num_blocks; a++) {
    const int64_t ahead = blocks[a] * h->block_bytes;
    for (int j = 0; j < bs; j++)
      for (int c = 0; c < head_dim; c += 64)
        __builtin_prefetch(h->data + ahead + j * h->row_bytes + c, 0, PREFETCH_LOCALITY);
    for (int c = 0; c < 4 * bs; c += 64) {
      __builtin_prefetch(h->scales + ahead + c, 0, PREFETCH_LOCALITY);
      __builtin_prefetch(h->mids + ahead + c, 0, PREFETCH_LOCALITY);
    }
  }
}

/* A chunk's value rows, scales and midpoints (rows past the sequence repeat one of the chunk's
 * rows). */
static inline __attribute__((always_inline)) void head_rows(const HeadRows *h, const int64_t *blocks, int64_t t0,
                                                            int64_t seq_len, int head_dim,
                                                            const int8_t *rows[CHUNK], float scales[CHUNK],
                                                            float mids[CHUNK]) {
  if (h->block_size % CHUNK == 0)
    chunk_rows(h, blocks, t0, seq_len, head_dim, rows, scales, mids);
  else
    scattered_rows(h, blocks, t0, seq_len, head_dim, rows, scales, mids);
}

/* sum_j p_j * v_mid_j over a chunk's first n rows, added to mid_sum: what the rows' midpoints add
 * to every dimension of the head's output (before the softmax's division). */
static inline __attribute__((always_inline)) v8f add_mid_sums(v8f mid_sum, const float *p, const float mids[CHUNK],
                                                              int64_t n) {
  v8f m = load_f32(p) * load_f32(mids);
  for (int j = (int)n; j < CHUNK; j++) m[j] = 0.f; /* past the sequence: not a row of it */
  return mid_sum + m;
}

static inline float sum8(v8f v) {
  float s = 0.f;
  for (int l = 0; l < 8; l++) s += v[l];
  return s;
}

/* The chunk's rows widened to float32 into buf [CHUNK, head_dim]. */
static inline __attribute__((always_inline)) void widen_rows(const int8_t *rows[CHUNK], int lanes, float *buf) {
  for (int j = 0; j < CHUNK; j++)
    for (int l = 0; l < lanes; l++) store_f32(buf + (j * lanes + l) * 8, load_int8(rows[j] + 8 * l));
}

#if HAS_INT8_BF16_TABLE
/* The value pass on VDPBF16PS: two keys' int8 rows interleaved byte by byte before the table
 * conversion, so each 32-bit lane holds (v_j[d], v_j+1[d]) in bfloat16, against the pair of
 * weights (p_j v_scale_j, p_j+1 v_scale_j+1) rounded to bfloat16; each pair is converted once for
 * the whole group. The interleave and the table both work within 128-bit lanes: sums[4c + m] lane
 * 4L + i holds dimension 64c + 16L + 4m + i, put back in order once at the end. acc [group]
 * [head_dim]. Every pair of a chunk is taken, those past the sequence weighted 0 (their rows
 * repeat row t0), so the loops have constant bounds and, with the group constant (below), the
 * group's sums stay in registers. */
static inline __attribute__((always_inline)) void value_sums_impl(const HeadRows *values, const int64_t *blocks,
                                                                  int64_t seq_len, const float *probs,
                                                                  int64_t padded, const int group,
                                                                  const int head_dim, float *acc, float *mid_sums) {
  const int num_vectors = head_dim / 16;
  const Bf16Tables t = load_bf16_tables();
  __m512 sums[MAX_GROUP][MAX_HEAD_DIM / 16];
  for (int g = 0; g < group; g++)
    for (int v = 0; v < num_vectors; v++) sums[g][v] = _mm512_setzero_ps();
  const int8_t *rows[CHUNK];
  float row_scales[CHUNK], row_mids[CHUNK];
  v8f mid8[MAX_GROUP];
  for (int g = 0; g < group; g++) mid8[g] = (v8f){0};
  for (int64_t t0 = 0; t0 < seq_len; t0 += CHUNK) {
    const int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;
    head_rows(values, blocks, t0, seq_len, head_dim, rows, row_scales, row_mids);
    uint32_t weights[MAX_GROUP][CHUNK / 2]; /* bfloat16 pairs (p_j v_scale_j, p_j+1 v_scale_j+1) */
    for (int g = 0; g < group; g++) {
      mid8[g] = add_mid_sums(mid8[g], probs + g * padded + t0, row_mids, n);
      v8f w = load_f32(probs + g * padded + t0) * load_f32(row_scales);
      for (int j = (int)n; j < CHUNK; j++) w[j] = 0.f; /* past the sequence the scores are -inf */
      const __m128bh h = _mm256_cvtneps_pbh((__m256)w);
      memcpy(weights[g], &h, sizeof weights[g]);
    }
    for (int i = 0; i < CHUNK / 2; i++) {
      __m512bh pair[MAX_HEAD_DIM / 16];
      for (int c = 0; c < head_dim / 64; c++) {
        const __m512i a = _mm512_loadu_si512(rows[2 * i] + 64 * c), b = _mm512_loadu_si512(rows[2 * i + 1] + 64 * c);
        int8_line_to_bf16(&t, _mm512_unpacklo_epi8(a, b), &pair[4 * c], &pair[4 * c + 1]);
        int8_line_to_bf16(&t, _mm512_unpackhi_epi8(a, b), &pair[4 * c + 2], &pair[4 * c + 3]);
      }
      for (int g = 0; g < group; g++) {
        const __m512bh wi = (__m512bh)_mm512_set1_epi32((int)weights[g][i]);
        for (int v = 0; v < num_vectors; v++) sums[g][v] = _mm512_dpbf16_ps(sums[g][v], pair[v], wi);
      }
    }
  }
  for (int g = 0; g < group; g++) mid_sums[g] = sum8(mid8[g]);
  for (int g = 0; g < group; g++)
    for (int v = 0; v < num_vectors; v++) {
      float lanes[16];
      _mm512_storeu_ps(lanes, sums[g][v]);
      float *dst = acc + g * head_dim + 64 * (v / 4) + 4 * (v % 4);
      for (int l = 0; l < 4; l++) memcpy(dst + 16 * l, lanes + 4 * l, 4 * sizeof(float));
    }
}

/* The value pass with head_dim constant where it is 64 or 128 (the loops over a row unroll), and
 * the group where it is 1 to 8 (GQA's usual groups: the sums then stay in registers). */
#define VALUE_SUMS_GROUP(G)                                                                                   \
  case G:                                                                                                     \
    if (head_dim == 64) value_sums_impl(values, blocks, seq_len, probs, padded, G, 64, acc, mid_sums);        \
    else if (head_dim == 128) value_sums_impl(values, blocks, seq_len, probs, padded, G, 128, acc, mid_sums); \
    else value_sums_impl(values, blocks, seq_len, probs, padded, G, head_dim, acc, mid_sums);                 \
    return 1;
static int value_sums_table(const HeadRows *values, const int64_t *blocks, int64_t seq_len, const float *probs,
                            int64_t padded, int group, int head_dim, float *acc, float *mid_sums) {
  if (head_dim % 64) return 0;
  switch (group) {
    VALUE_SUMS_GROUP(1)
    VALUE_SUMS_GROUP(2)
    VALUE_SUMS_GROUP(3)
    VALUE_SUMS_GROUP(4)
    VALUE_SUMS_GROUP(5)
    VALUE_SUMS_GROUP(6)
    VALUE_SUMS_GROUP(7)
    VALUE_SUMS_GROUP(8)
    default:
      value_sums_impl(values, blocks, seq_len, probs, padded, group, head_dim, acc, mid_sums);
      return 1;
  }
}
#define VALUE_SUMS_FAST value_sums_table
#else
#define VALUE_SUMS_FAST(...) 0
#endif

#endif
