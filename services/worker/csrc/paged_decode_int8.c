/* Paged attention for decode tokens on a CPU over an int8 KV cache: one query token per request,
 * its keys and values read in place through the block table, as paged_decode.c does for float32
 * and bfloat16 caches.
 *
 * Cache layout (attention/int8_kv_cache.py): one int8 tensor per layer, [2, num_blocks,
 * block_bytes], keys then values. A key block holds, per KV head, int8 [head_dim / 4, block_size,
 * 4]: each row's dimensions in fours, the block's tokens side by side per four, so one pass takes
 * 16 tokens' scores at once with no sum across lanes (decode_int8_keys.h). A value block holds
 * int8 [block_size, num_kv_heads, head_dim] rows. Both end with their float32 scales
 * [num_kv_heads, block_size], then their float32 midpoints [num_kv_heads, block_size].
 * Element d of a (token, KV head) row is mid + q[d] * scale, q in [-127, 127]. So score_t = scale
 * * (k_scale_t * (query . k_int8_t) + k_mid_t * sum(query)), and the output is (sum_t p_t *
 * v_scale_t * v_int8_t + sum_t p_t * v_mid_t) / sum_t p_t: a row's scale and midpoint apply to its
 * one score or to its one weight, never to its head_dim values.
 *
 * query and out [num_reqs, num_heads, head_dim] float32; block_table [num_reqs,
 * block_table_stride] int64; seq_lens [num_reqs] int64; scratch [num_threads,
 * scratch_floats_per_thread(...)] float32 (paged_decode.c exports it; the same need). Work items,
 * the exact float32 softmax and the status codes are paged_decode.c's, plus 4 for a block_bytes
 * that does not match the shapes.
 *
 * Three sets of passes:
 *  - generic (any CPU): float32 query and weights against the int8 keys and values widened to
 *    float32;
 *  - where the CPU has AVX512_BF16 and AVX512_VBMI (Zen 4, Sapphire Rapids) and head_dim is a
 *    multiple of 64: the keys (blocks of a multiple of 16 tokens; with AVX512_VNNI) against each
 *    query head quantized in steps of 2^-14 of its largest |value|, summed exactly in int32 on
 *    VPDPBUSD (decode_int8_keys.h); the values turned into bfloat16 by the byte table of
 *    int8_bf16.h (exact for |q| <= 127) and multiplied on VDPBF16PS against the weights p_t *
 *    v_scale_t rounded to bfloat16, as the bfloat16 kernel rounds them;
 *  - where the CPU also has AMX-INT8 (the library's attention switch on), head_dim is 64, groups
 *    are of at most 8 query heads, blocks hold a multiple of 16 tokens and a step has at least 4
 *    requests: both passes on the tile unit (paged_decode_int8_amx.h), the same scores, the values
 *    against 15-bit weights (scratch on a cache line, or those passes lose their gain).
 */
#include <stdint.h>
#include <string.h>

#include "decode_common.h"
#include "decode_int8_keys.h"
#include "int8_bf16.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define PAGED_DECODE_INT8_BAD_BLOCK_BYTES 4
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

/* One request, one KV head and its `group` query heads; `lanes` is head_dim / 8. */
static inline __attribute__((always_inline)) void decode_group(const float *q, const HeadKeys *keys,
                                                               const HeadRows *values, const int64_t *blocks,
                                                               int64_t seq_len, float scale, float *out,
                                                               float *scratch, int group, const int lanes) {
  const int head_dim = 8 * lanes;
  const int64_t padded = (seq_len + CHUNK - 1) / CHUNK * CHUNK;
  float *buf = scratch + (int64_t)group * padded;
  float *acc = buf + CHUNK * head_dim;
  const int8_t *rows[CHUNK];
  float row_scales[CHUNK], row_mids[CHUNK], inv_sum[MAX_GROUP], max_score[MAX_GROUP], mid_sums[MAX_GROUP];
  v8f mid8[MAX_GROUP];
  key_scores(q, keys, blocks, seq_len, scale, scratch, padded, group, head_dim, max_score);
  for (int g = 0; g < group; g++) {
    inv_sum[g] = 1.f / softmax_numerators(scratch + g * padded, seq_len, max_score[g]);
    memset(acc + g * head_dim, 0, sizeof(float) * head_dim);
    mid8[g] = (v8f){0};
  }
  const int fast_values = VALUE_SUMS_FAST(values, blocks, seq_len, scratch, padded, group, head_dim, acc, mid_sums);
  for (int64_t t0 = 0; !fast_values && t0 < seq_len; t0 += CHUNK) {
    const int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;
    head_rows(values, blocks, t0, seq_len, head_dim, rows, row_scales, row_mids);
    widen_rows(rows, lanes, buf);
    for (int g = 0; g < group; g++) {
      const float *p = scratch + g * padded + t0;
      mid8[g] = add_mid_sums(mid8[g], p, row_mids, n);
      v8f a[MAX_HEAD_DIM / 8];
      for (int l = 0; l < lanes; l++) a[l] = load_f32(acc + g * head_dim + 8 * l);
      for (int j = 0; j < n; j++) {
        const float w = p[j] * row_scales[j];
        for (int l = 0; l < lanes; l++) a[l] += w * load_f32(buf + j * head_dim + 8 * l);
      }
      for (int l = 0; l < lanes; l++) store_f32(acc + g * head_dim + 8 * l, a[l]);
    }
  }
  for (int g = 0; !fast_values && g < group; g++) mid_sums[g] = sum8(mid8[g]);
  for (int g = 0; g < group; g++)
    for (int l = 0; l < lanes; l++)
      store_f32(out + g * head_dim + 8 * l, (load_f32(acc + g * head_dim + 8 * l) + mid_sums[g]) * inv_sum[g]);
}

/* The same items on the AMX tile unit (needs HeadKeys, HeadRows and the passes above). */
#include "paged_decode_int8_amx.h"

/* key_cache and value_cache are the two halves of the layer's tensor, block_bytes per block.
 * Returns 0, or 1 (query heads not a multiple of KV heads), 2 (head_dim not a multiple of 8 up to
 * MAX_HEAD_DIM), 3 (more than MAX_GROUP query heads per KV head), 4 (block_bytes is not
 * block_size * num_kv_heads * (head_dim + 8)). */
int paged_decode_int8(const float *query, const int8_t *key_cache, const int8_t *value_cache, int64_t block_bytes,
                      const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens, float *out,
                      int64_t num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                      int64_t max_seq_len, float *scratch, int num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads) return 1;
  if (head_dim <= 0 || head_dim % 8 || head_dim > MAX_HEAD_DIM) return 2;
  const int group = num_heads / num_kv_heads;
  if (group > MAX_GROUP) return 3;
  const int64_t data_bytes = (int64_t)block_size * num_kv_heads * head_dim;
  const int64_t meta_bytes = (int64_t)block_size * num_kv_heads * 4; /* scales, then midpoints */
  if (block_size <= 0 || block_bytes != data_bytes + 2 * meta_bytes)
    return PAGED_DECODE_INT8_BAD_BLOCK_BYTES;
  int64_t per_thread = decode_scratch_floats(max_seq_len, group, head_dim);
  const int64_t num_items = num_reqs * num_kv_heads;
  if (num_threads > num_items) num_threads = num_items > 1 ? (int)num_items : 1;
  const int use_tiles = int8_amx_supports(num_reqs, head_dim, group, block_size, max_seq_len);
  if (use_tiles && int8_amx_item_floats(max_seq_len, group) > per_thread)
    per_thread = int8_amx_item_floats(max_seq_len, group);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    float *s = scratch + (int64_t)THREAD_NUM() * per_thread;
    if (use_tiles) config_int8_tiles(group);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < num_items; item++) {
      const int64_t req = item / num_kv_heads;
      const int kv_head = (int)(item % num_kv_heads);
      const int64_t *blocks = block_table + req * block_table_stride;
      const int64_t row_bytes = (int64_t)num_kv_heads * head_dim;
      const int64_t meta = data_bytes + 4 * (int64_t)kv_head * block_size;
      const HeadKeys keys = {key_cache + (int64_t)kv_head * head_dim * block_size, key_cache + meta,
                             key_cache + meta + meta_bytes, block_bytes, block_size};
      const HeadRows values = {value_cache + (int64_t)kv_head * head_dim, value_cache + meta,
                               value_cache + meta + meta_bytes, block_bytes, row_bytes, 4, block_size};
      const int64_t first = (req * num_heads + (int64_t)kv_head * group) * head_dim;
      if (use_tiles && seq_lens[req] > 0 &&
          attend_int8_amx(query + first, &keys, &values, blocks, seq_lens[req], scale, out + first, s, group))
        continue;
      if (head_dim == 64)
        decode_group(query + first, &keys, &values, blocks, seq_lens[req], scale, out + first, s, group, 8);
      else if (head_dim == 128)
        decode_group(query + first, &keys, &values, blocks, seq_lens[req], scale, out + first, s, group, 16);
      else
        decode_group(query + first, &keys, &values, blocks, seq_lens[req], scale, out + first, s, group, head_dim / 8);
    }
    if (use_tiles) release_int8_tiles();
  }
  return 0;
}

int64_t paged_decode_int8_amx_floats(int64_t max_seq_len, int group) {
  return int8_amx_item_floats(max_seq_len, group);
}

/* 1 where head sizes that are a multiple of 64 multiply on VDPBF16PS (query and weights rounded to
 * bfloat16), 0 where every pass is float32. */
int paged_decode_int8_has_bf16_dot(void) { return HAS_INT8_BF16_TABLE; }
