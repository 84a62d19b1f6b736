/* Decode attention for the int8 KV cache on the AMX tile unit (AMX-INT8), included by
 * paged_decode_int8.c: its layouts, arguments and formulas (decode_int8_keys.h for the keys), one
 * item per request and KV head, for head_dim 64, blocks of a multiple of 16 tokens and contexts of
 * up to INT8_AMX_MAX_SEQ tokens, for up to 8 query heads per KV head.
 *
 * Why: the VNNI passes spent about 48 cycles a (token, KV head) with the cache in the last-level
 * cache (two VPDPBUSD per four dimensions and query head for the keys; the byte table and
 * VDPBF16PS for the values), so the kernel read only 10-11 GB/s of its bytes from memory where the
 * bfloat16 kernel reads 15-19. On the tiles:
 * - keys: S [group][16 tokens] = Q [group][64] . K^T. The key block's layout, int8 [64 / 4][block
 *   size][4], is already a B tile (a row: 16 tokens' fours of one four of dimensions), loaded where
 *   it lies; the query is decode_int8_keys.h's quantized high and low parts stacked as the rows of
 *   one A tile, summed exactly in int32 on TDPBSSD (no bias: both operands signed), so the scores
 *   are the VNNI pass's bit for bit.
 * - values: O [group][64] = W [group][16 tokens] . V [16 tokens][64], the cached value rows loaded
 *   as B tiles where they lie. A B tile's 4-byte group holds four neighbouring dimensions of one
 *   token, so a weight placed at byte j of each group (the other three bytes zero) gives output
 *   dimensions 4n + j alone. The weights w_t = p_t * v_scale_t are quantized per item and query
 *   head in steps of a power of two at least max(w) / 32767 (so bfloat16-exact weights stay
 *   exact), split as w = 128 * high + low (high in [0, 255], low in [0, 127]), and multiplied
 *   unsigned by the signed values on TDPBUSD into int32: 15 bits, finer than the bfloat16 rounding
 *   of the weights on the VDPBF16PS pass. The 8 x group rows of weights (4 byte positions x 2
 *   parts x group) are written once as A rows and multiplied in 2 tiles (4 where group > 4), so
 *   each value tile is loaded once. Weights past the sequence are 0 and the values are integers,
 *   so whatever the rows past the sequence hold adds nothing.
 * An item whose weights are not finite (a NaN or infinite query) runs the VNNI passes, which give
 * NaN as the float32 passes would.
 *
 * Measured (48 requests x 375 tokens, two threads, a Sapphire Rapids-class VM): 1.2x the VNNI
 * passes with the cache in the last-level cache (0.50 -> 0.41 ms a layer), but only 1.1x from
 * memory (0.69 -> 0.63 ms): there the loads of the scattered rows wait, as on paged_decode_amx.c.
 * Against a float64 reference on the dequantized cache the largest error fell from 2-4e-3 (the
 * bfloat16 weights) to 1.3-2.4e-4 (the query's quantization). A tile's sums read back by the
 * vector unit at once held the next product back (0.58 ms from the last-level cache).
 * Stacking the rows (the query's parts in one A tile, the weights in 2 where each part and
 * position had its own, 10 products a 16-token tile down to 3) and prefetching each block's value
 * scales and midpoints before the key pass: 40 requests of 100-700 tokens over 30 layers' caches
 * 0.59 -> 0.53 ms a layer, 64 requests 1.00 -> 0.92 (docs/benchmarks.md, 2026-12-06, sixth
 * session). The A rows are written by vector stores and read by tile loads, so the scratch must
 * start on a cache line: from a 16-byte aligned malloc the gain was gone. */
#ifndef SPINDLE_PAGED_DECODE_INT8_AMX_H
#define SPINDLE_PAGED_DECODE_INT8_AMX_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "decode_common.h"
#include "decode_int8_keys.h"

/* The value sums' int32 bound: each token adds at most 255 * 127 to a sum. */
#define INT8_AMX_MAX_SEQ 65536
#define INT8_AMX_TOKENS 16
#define INT8_AMX_HEAD_DIM 64

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && HAS_INT8_KEY_DOT && HAS_INT8_BF16_TABLE
#include "amx_tiles.h"

int attention_amx_enabled(void); /* paged_decode_amx.c: --cpu-amx-attention, and the tile state */

/* Value tiles of rows prefetched ahead (the blocks lie scattered), as paged_decode_amx.c does; the
 * keys' blocks as decode_int8_keys.h prefetches them (without, 48 requests x 375 tokens from memory
 * ran 0.73 against 0.63 ms a layer). */
#define INT8_AMX_PREFETCH_TILES 4

/* A tile product costs about as much for 3 rows of A as for 12 (3.4 against 4.8 ns on a Sapphire
 * Rapids-class VM), so the item's rows are stacked into as few A tiles as 16 rows take: the keys'
 * query parts (high then low, 2 * group rows) in one tile, the value weights (4 byte positions x 2
 * parts x group rows) in 4 / P tiles of 2 * group * P rows, P positions a tile (2 where group <= 4,
 * else 1). Every tile but the B tiles has R = 2 * group * P rows:
 * tmm0 A (the query's parts; then value weights), tmm2 A (value weights), tmm1 and tmm7 B (16
 * tokens' keys or value rows), tmm3-4 C (two key tiles' sums; the value sums), tmm5-6 C (the value
 * sums where P is 1). In the key pass's A tile, rows past 2 * group are zero. */
static inline int int8_amx_positions_per_tile(int group) { return 4 * group <= 16 ? 2 : 1; }

static void config_int8_tiles(int group) {
  const int rows = 2 * group * int8_amx_positions_per_tile(group);
  struct tile_config cfg;
  tile_config_init(&cfg);
  for (int t = 0; t < 8; t++) set_tile(&cfg, t, rows, 64);
  set_tile(&cfg, 1, INT8_AMX_TOKENS, 64);
  set_tile(&cfg, 7, INT8_AMX_TOKENS, 64);
  _tile_loadconfig(&cfg);
}

/* Floats of scratch one item needs: the scores (then the weights) head-major, the value weights'
 * A rows [padded / 16][4 positions][2 parts][group][16] (the key pass's stored sums use their
 * space first), the value pass's C tiles stored [4][2][group][16]. */
static inline int64_t int8_amx_item_floats(int64_t max_seq_len, int group) {
  const int64_t padded = (max_seq_len + INT8_AMX_TOKENS - 1) / INT8_AMX_TOKENS * INT8_AMX_TOKENS;
  return group * padded + 8 * group * padded + 8 * group * 16;
}

static inline int int8_amx_supports(int64_t num_reqs, int head_dim, int group, int block_size, int64_t max_seq_len) {
  return num_reqs >= 4 && head_dim == INT8_AMX_HEAD_DIM && group <= 8 && block_size % INT8_AMX_TOKENS == 0 &&
         max_seq_len <= INT8_AMX_MAX_SEQ && attention_amx_enabled();
}

/* Scores of the item's group into scores[g * padded + t] (t < seq_len), each head's largest into
 * max_score: decode_int8_keys.h's formula and quantized query, the sums on TDPBSSD. Every tile's
 * sums are stored first (c_rows [num_tiles][rows][16]: the high parts' sums in rows 0 .. group - 1,
 * the low parts' after), two tiles at a time on alternating registers, and turned into scores
 * after: a tile's stores read back at once by the vector unit held each next product back. */
static inline void int8_amx_key_scores(const float *q, const HeadKeys *keys, const int64_t *blocks, int64_t seq_len,
                                       float scale, float *scores, int64_t padded, int group, int rows,
                                       int32_t *c_rows, float *max_score) {
  int32_t parts[16][INT8_AMX_HEAD_DIM / 4] = {{0}}, offset;
  float step[MAX_GROUP], q_sums[MAX_GROUP];
  __m512 max16[MAX_GROUP];
  query_sums(q, group, INT8_AMX_HEAD_DIM, scale, q_sums);
  for (int g = 0; g < group; g++) {
    quantize_query_int15(q + g * INT8_AMX_HEAD_DIM, INT8_AMX_HEAD_DIM, parts[g], parts[group + g], &offset, &step[g]);
    step[g] *= scale;
    max16[g] = _mm512_set1_ps(-INFINITY);
  }
  _tile_loadd(0, parts, sizeof parts[0]);
  const int bs = keys->block_size;
  const int64_t num_blocks = (seq_len + bs - 1) / bs, tile_ints = 16 * rows;
  for (int64_t t0 = 0; t0 < seq_len; t0 += 2 * INT8_AMX_TOKENS) {
    const int64_t b = t0 / bs, o0 = t0 % bs, t1 = t0 + INT8_AMX_TOKENS;
    if (o0 == 0) prefetch_key_blocks(keys, blocks, b, num_blocks, INT8_AMX_HEAD_DIM);
    int32_t *c = c_rows + t0 / INT8_AMX_TOKENS * tile_ints;
    _tile_loadd(1, keys->data + blocks[b] * keys->block_bytes + 4 * o0, 4 * bs);
    _tile_zero(3);
    _tile_dpbssd(3, 0, 1);
    if (t1 < seq_len) { /* the next tile of 16 (blocks hold a multiple of 16 tokens) */
      const int64_t b1 = t1 / bs, o1 = t1 % bs;
      if (o1 == 0) prefetch_key_blocks(keys, blocks, b1, num_blocks, INT8_AMX_HEAD_DIM);
      _tile_loadd(7, keys->data + blocks[b1] * keys->block_bytes + 4 * o1, 4 * bs);
      _tile_zero(4);
      _tile_dpbssd(4, 0, 7);
      _tile_stored(4, c + tile_ints, 64);
    }
    _tile_stored(3, c, 64);
  }
  for (int64_t t0 = 0; t0 < seq_len; t0 += INT8_AMX_TOKENS) {
    const int64_t base = blocks[t0 / bs] * keys->block_bytes, o0 = t0 % bs, left = seq_len - t0;
    const int32_t *c = c_rows + t0 / INT8_AMX_TOKENS * tile_ints;
    const __mmask16 valid = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 row_scales = _mm512_loadu_ps((const float *)(keys->scales + base + 4 * o0));
    const __m512 row_mids = _mm512_loadu_ps((const float *)(keys->mids + base + 4 * o0));
    for (int g = 0; g < group; g++) {
      const __m512i hi = _mm512_loadu_si512(c + 16 * g), lo = _mm512_loadu_si512(c + 16 * (group + g));
      store_scores16(_mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo), row_scales, row_mids, q_sums[g], step[g], valid,
                     scores + g * padded + t0, &max16[g]);
    }
  }
  reduce_max_scores(max16, group, max_score);
}

/* The rows of one KV head for tokens t0 .. t0 + 15 (one block holds them all). */
static inline const int8_t *value_tile(const HeadRows *v, const int64_t *blocks, int64_t t0) {
  return v->data + blocks[t0 / v->block_size] * v->block_bytes + (t0 % v->block_size) * v->row_bytes;
}

static inline void prefetch_value_tile(const HeadRows *v, const int64_t *blocks, int64_t t0) {
  const int8_t *rows = value_tile(v, blocks, t0);
  for (int j = 0; j < INT8_AMX_TOKENS; j++) __builtin_prefetch(rows + j * v->row_bytes, 0, 3);
}

/* One request, one KV head and its `group` query heads. Returns 0 where the weights are not
 * finite (nothing written to out; the caller runs the VNNI passes), 1 when out holds the result. */
static int attend_int8_amx(const float *q, const HeadKeys *keys, const HeadRows *values, const int64_t *blocks,
                           int64_t seq_len, float scale, float *out, float *scratch, int group) {
  const int64_t padded = (seq_len + INT8_AMX_TOKENS - 1) / INT8_AMX_TOKENS * INT8_AMX_TOKENS;
  const int per_tile = int8_amx_positions_per_tile(group), rows = 2 * group * per_tile;
  const int64_t tile_set_ints = 8 * 16 * group; /* one 16-token tile's A rows, all positions */
  float *scores = scratch;                                     /* [group][padded] */
  int32_t *a_rows = (int32_t *)(scores + group * padded);      /* [padded / 16][4][2][group][16] */
  int32_t *c_rows = a_rows + padded / INT8_AMX_TOKENS * tile_set_ints; /* [4][2][group][16] */
  float max_score[MAX_GROUP], inv_sum[MAX_GROUP], mid_sums[MAX_GROUP], steps[MAX_GROUP];

  for (int64_t b = 0; b * values->block_size < seq_len; b++) { /* read by the weights' pass, after the keys */
    const int64_t base = blocks[b] * values->block_bytes;
    __builtin_prefetch(values->scales + base, 0, 1);
    __builtin_prefetch(values->mids + base, 0, 1);
  }
  int8_amx_key_scores(q, keys, blocks, seq_len, scale, scores, padded, group, rows, a_rows, max_score);
  for (int64_t t0 = 0; t0 < INT8_AMX_PREFETCH_TILES * INT8_AMX_TOKENS && t0 < seq_len; t0 += INT8_AMX_TOKENS)
    prefetch_value_tile(values, blocks, t0);
  for (int g = 0; g < group; g++) inv_sum[g] = 1.f / softmax_numerators(scores + g * padded, seq_len, max_score[g]);

  /* w_t = p_t * v_scale_t in place of p_t, and sum_t p_t * v_mid_t; then the weights quantized and
   * written as A rows: the part's weight of token k in byte j of 32-bit lane k for position j. */
  for (int g = 0; g < group; g++) {
    float *w = scores + g * padded;
    __m512 max16 = _mm512_setzero_ps(), mid16 = _mm512_setzero_ps();
    __mmask16 nan_lanes = 0;
    for (int64_t t0 = 0; t0 < padded; t0 += INT8_AMX_TOKENS) {
      const int64_t left = seq_len - t0, base = blocks[t0 / values->block_size] * values->block_bytes,
                    o0 = t0 % values->block_size;
      const __mmask16 valid = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      const __m512 p = _mm512_maskz_loadu_ps(valid, w + t0);
      const __m512 s = _mm512_maskz_loadu_ps(valid, (const float *)(values->scales + base) + o0);
      const __m512 m = _mm512_maskz_loadu_ps(valid, (const float *)(values->mids + base) + o0);
      const __m512 x = _mm512_mul_ps(p, s);
      mid16 = _mm512_fmadd_ps(p, m, mid16);
      max16 = _mm512_max_ps(max16, x);
      nan_lanes |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      _mm512_storeu_ps(w + t0, x);
    }
    const float wmax = _mm512_reduce_max_ps(max16);
    mid_sums[g] = _mm512_reduce_add_ps(mid16);
    if (nan_lanes || !(wmax <= FLT_MAX) || !(fabsf(mid_sums[g]) <= FLT_MAX)) return 0;
    int e = 0;
    if (wmax > 0.f) frexpf(wmax / 32767.f, &e);
    steps[g] = wmax > 0.f ? ldexpf(1.f, e) : 1.f; /* 2^e > max / 32767: max / step <= 32767 */
    const __m512 inv_step = _mm512_set1_ps(1.f / steps[g]);
    const __m512i limit = _mm512_set1_epi32(32767), low_bits = _mm512_set1_epi32(127);
    for (int64_t t0 = 0; t0 < padded; t0 += INT8_AMX_TOKENS) {
      __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(w + t0), inv_step)); /* >= 0: past seq 0 */
      x = _mm512_min_epi32(x, limit);
      const __m512i hi = _mm512_srli_epi32(x, 7), lo = _mm512_and_si512(x, low_bits);
      int32_t *dst = a_rows + t0 / INT8_AMX_TOKENS * tile_set_ints + 16 * g;
      for (int j = 0; j < 4; j++) { /* row (j, part, g) at 16 * ((2 * j + part) * group + g) */
        _mm512_storeu_si512(dst + 16 * (2 * j) * group, _mm512_slli_epi32(hi, 8 * j));
        _mm512_storeu_si512(dst + 16 * (2 * j + 1) * group, _mm512_slli_epi32(lo, 8 * j));
      }
    }
  }

  /* C tile k holds positions per_tile * k ..: its rows (position, part, head) as the A rows. */
  _tile_zero(3);
  _tile_zero(4);
  if (per_tile == 1) {
    _tile_zero(5);
    _tile_zero(6);
  }
  const int64_t a_tile_ints = 16 * rows;
  for (int64_t t0 = 0; t0 < padded; t0 += INT8_AMX_TOKENS) {
    if (t0 + INT8_AMX_PREFETCH_TILES * INT8_AMX_TOKENS < seq_len)
      prefetch_value_tile(values, blocks, t0 + INT8_AMX_PREFETCH_TILES * INT8_AMX_TOKENS);
    const int32_t *a = a_rows + t0 / INT8_AMX_TOKENS * tile_set_ints;
    _tile_loadd(1, value_tile(values, blocks, t0), values->row_bytes);
    _tile_loadd(0, a, 64);
    _tile_loadd(2, a + a_tile_ints, 64);
    _tile_dpbusd(3, 0, 1);
    _tile_dpbusd(4, 2, 1);
    if (per_tile == 1) {
      _tile_loadd(0, a + 2 * a_tile_ints, 64);
      _tile_loadd(2, a + 3 * a_tile_ints, 64);
      _tile_dpbusd(5, 0, 1);
      _tile_dpbusd(6, 2, 1);
    }
  }
  _tile_stored(3, c_rows, 64);
  _tile_stored(4, c_rows + a_tile_ints, 64);
  if (per_tile == 1) {
    _tile_stored(5, c_rows + 2 * a_tile_ints, 64);
    _tile_stored(6, c_rows + 3 * a_tile_ints, 64);
  }
  for (int g = 0; g < group; g++) {
    float o[4][16];
    for (int j = 0; j < 4; j++) {
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_loadu_si512(c_rows + 16 * ((2 * j) * group + g)));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_loadu_si512(c_rows + 16 * ((2 * j + 1) * group + g)));
      _mm512_storeu_ps(o[j], _mm512_fmadd_ps(hi, _mm512_set1_ps(128.f), lo));
    }
    for (int n = 0; n < 16; n++)
      for (int j = 0; j < 4; j++)
        out[g * INT8_AMX_HEAD_DIM + 4 * n + j] = (o[j][n] * steps[g] + mid_sums[g]) * inv_sum[g];
  }
  return 1;
}

static inline void release_int8_tiles(void) { _tile_release(); }
#else
/* Builds without AMX-INT8: the tiles are never chosen, so the caller needs no conditional code. */
static inline int64_t int8_amx_item_floats(int64_t max_seq_len, int group) {
  (void)max_seq_len, (void)group;
  return 0;
}
static inline int int8_amx_supports(int64_t num_reqs, int head_dim, int group, int block_size, int64_t max_seq_len) {
  (void)num_reqs, (void)head_dim, (void)group, (void)block_size, (void)max_seq_len;
  return 0;
}
static inline void config_int8_tiles(int group) { (void)group; }
static inline void release_int8_tiles(void) {}
static inline int attend_int8_amx(const float *q, const HeadKeys *keys, const HeadRows *values, const int64_t *blocks,
                                  int64_t seq_len, float scale, float *out, float *scratch, int group) {
  (void)q, (void)keys, (void)values, (void)blocks, (void)seq_len, (void)scale, (void)out, (void)scratch, (void)group;
  return 0;
}
#endif

/* Floats of scratch one thread needs for the tile passes (0 where the build has none), for
 * paged_decode.c's scratch_floats_per_thread. */
int64_t paged_decode_int8_amx_floats(int64_t max_seq_len, int group);

#endif
