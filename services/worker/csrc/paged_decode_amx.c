/* Decode attention for a bfloat16 KV cache on the AMX tile unit (AMX-BF16): paged_decode.c's
 * paged_decode_bf16 hands its work here where the CPU has the tiles, head_dim is 64 and blocks
 * hold a multiple of 16 tokens; the layouts and results are that kernel's (one query token per
 * request, exact float32 softmax, probabilities rounded to bfloat16 for the value sums).
 *
 * Why: on a 2-core Sapphire Rapids-class VM the VDPBF16PS passes took 1.05 ms a layer for 48
 * requests of 375 tokens with the cache in the last-level cache, one thread: the horizontal sums
 * of the key pass and the pair interleave of the value pass set the pace as much as the bytes.
 * On the tiles 1.1x from memory, where the tile loads then wait on the scattered rows
 * (docs/benchmarks.md, "Attention on AMX tiles"). On the tiles:
 * - keys: S^T [16 tokens][group] = K [16 tokens][64] . Q^T, the cached key rows loaded as A tiles
 *   where they lie (row stride: one token of all KV heads), Q^T as two B tiles made once per item;
 * - values: O [group][64] = P [group][tokens] . V [tokens][64], the cached value rows loaded as B
 *   tiles where they lie. A B tile's row pairs two neighbouring values of one token, so each
 *   probability is paired with a zero: once as (p, 0), giving the even dimensions, and once as
 *   (0, p), giving the odd ones, the same array read 2 bytes earlier. Nothing is interleaved.
 * The scores go through memory once (the tile is stored token-major and gathered head-major for
 * the softmax). A last partial tile of values is copied into zeros first, so rows past the
 * sequence never reach a sum, whatever the cache holds there. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

int paged_decode_amx_supports(int head_dim, int group, int block_size);

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include "amx_tiles.h"
#include "decode_items.h"
#ifdef _OPENMP
#include <omp.h>
#define AMX_THREAD_NUM() omp_get_thread_num()
#else
#define AMX_THREAD_NUM() 0
#endif

#define TOKENS 16        /* tokens per tile: rows of a key A tile, pair rows of a value B tile */
#define AMX_HEAD_DIM 64  /* two tiles of 32 values */
#define AMX_MAX_GROUP 16 /* query heads per KV head: columns of the key pass's C tile */
/* Tiles of rows prefetched into L1 ahead (blocks lie scattered, beyond the hardware prefetchers'
 * reach). 2, 4 and 8 tiles, into L1 or L2, and prefetching every KV head's rows ahead of the first
 * head's item, all ran within the noise of each other (48 requests x 375 tokens). */
#define PREFETCH_TILES 4

/* The library's switch for attention on the tiles, decode and prefill (paged_prefill_amx.h): on
 * by default, set by the worker from --cpu-amx-attention (attention/amx_attention.py). */
static int amx_enabled = 1;

/* Keys: tmm0-1 K (16 tokens x 32 values), tmm2-3 Q^T (16 pairs x group), tmm4 S^T (16 x group). */
static void config_keys(int group) {
  struct tile_config cfg;
  tile_config_init(&cfg);
  set_tile(&cfg, 0, TOKENS, 64), set_tile(&cfg, 1, TOKENS, 64);
  set_tile(&cfg, 2, 16, 4 * group), set_tile(&cfg, 3, 16, 4 * group), set_tile(&cfg, 4, TOKENS, 4 * group);
  _tile_loadconfig(&cfg);
}

/* Values: tmm0-1 V (16 tokens x 32 values), tmm5-6 P as (p, 0) and (0, p) (group x 16 tokens),
 * tmm2-3 the even and odd sums of values 0-31, tmm4 and tmm7 of values 32-63 (group x 16). */
static void config_values(int group) {
  struct tile_config cfg;
  tile_config_init(&cfg);
  set_tile(&cfg, 0, TOKENS, 64), set_tile(&cfg, 1, TOKENS, 64);
  set_tile(&cfg, 5, group, 64), set_tile(&cfg, 6, group, 64);
  set_tile(&cfg, 2, group, 64), set_tile(&cfg, 3, group, 64);
  set_tile(&cfg, 4, group, 64), set_tile(&cfg, 7, group, 64);
  _tile_loadconfig(&cfg);
}

static inline const uint16_t *tile_rows(const uint16_t *cache, const int64_t *blocks, int64_t t0, int block_size,
                                        int shift, int64_t row) {
  const int64_t block = shift >= 0 ? t0 >> shift : t0 / block_size;
  const int64_t offset = shift >= 0 ? t0 & (block_size - 1) : t0 % block_size;
  return cache + (blocks[block] * block_size + offset) * row;
}

static inline void prefetch_tile(const uint16_t *rows, int64_t row) {
  for (int j = 0; j < TOKENS; j++) {
    const char *r = (const char *)(rows + j * row);
    __builtin_prefetch(r, 0, 3), __builtin_prefetch(r + 64, 0, 3);
  }
}

/* Floats of scratch one item needs (the per-thread scratch of paged_decode.c covers it). */
static inline int64_t item_floats(int64_t num_tiles, int group) {
  return num_tiles * TOKENS * group /* scores */ + group * (num_tiles * TOKENS + TOKENS) /* probability slots */
         + 4 * group * 16 /* sums */ + TOKENS * AMX_HEAD_DIM / 2 /* a zero-padded value tile */;
}

/* One request, one KV head and its `group` query heads. q [group][64] float32, the caches offset
 * to this KV head, out [group][64]. */
static void attend_item(const float *q, const uint16_t *key_cache, const uint16_t *value_cache,
                        const int64_t *blocks, int64_t seq_len, int64_t row, int block_size, int shift, float scale,
                        float *out, float *scratch, int group) {
  const int64_t num_tiles = (seq_len + TOKENS - 1) / TOKENS, padded = num_tiles * TOKENS;
  const int64_t stride = row * 2; /* bytes between tokens */
  float *scores = scratch;                                  /* [padded][group] */
  uint32_t *slots = (uint32_t *)(scores + padded * group);  /* [group][1 + padded + 15] */
  const int64_t slot_stride = padded + TOKENS;
  float *sums = (float *)(slots + group * slot_stride);     /* [4][group][16] */
  uint16_t *tail = (uint16_t *)(sums + 4 * group * 16);     /* [16][64] */

  /* Q^T as two B tiles: qt[c][r][n] holds query n's values 32c + 2r and 32c + 2r + 1. */
  uint32_t qt[2][16][AMX_MAX_GROUP];
  for (int n = 0; n < group; n++) {
    uint32_t pairs[32];
    for (int c = 0; c < 2; c++)
      _mm512_storeu_si512(pairs + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + n * 64 + 32 * c + 16),
                                                                       _mm512_loadu_ps(q + n * 64 + 32 * c)));
    for (int c = 0; c < 2; c++)
      for (int r = 0; r < 16; r++) qt[c][r][n] = pairs[16 * c + r];
  }

  config_keys(group);
  _tile_loadd(2, qt[0], AMX_MAX_GROUP * 4);
  _tile_loadd(3, qt[1], AMX_MAX_GROUP * 4);
  for (int64_t i = 0; i < num_tiles; i++) {
    const uint16_t *k = tile_rows(key_cache, blocks, i * TOKENS, block_size, shift, row);
    if (i + PREFETCH_TILES < num_tiles)
      prefetch_tile(tile_rows(key_cache, blocks, (i + PREFETCH_TILES) * TOKENS, block_size, shift, row), row);
    _tile_loadd(0, k, stride);
    _tile_loadd(1, k + 32, stride);
    _tile_zero(4);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(4, 1, 3);
    _tile_stored(4, scores + i * TOKENS * group, 4 * group);
  }
  for (int64_t t = seq_len; t < padded; t++)
    for (int g = 0; g < group; g++) scores[t * group + g] = -INFINITY;
  /* start the value rows on their way while the softmax runs */
  for (int64_t i = 0; i < PREFETCH_TILES && i < num_tiles; i++)
    prefetch_tile(tile_rows(value_cache, blocks, i * TOKENS, block_size, shift, row), row);

  /* Each head's maximum: vector v of the token-major scores holds head (16v + lane) % group in
   * each lane, the same heads for every v of one v % group. */
  __m512 max16[AMX_MAX_GROUP];
  for (int r = 0; r < group; r++) max16[r] = _mm512_set1_ps(-INFINITY);
  for (int64_t v = 0, r = 0; v < num_tiles * group; v++, r = r + 1 == group ? 0 : r + 1)
    max16[r] = _mm512_max_ps(max16[r], _mm512_loadu_ps(scores + 16 * v));
  float max_score[AMX_MAX_GROUP], inv_sum[AMX_MAX_GROUP];
  for (int g = 0; g < group; g++) max_score[g] = -INFINITY;
  for (int r = 0; r < group; r++) {
    float lanes[16];
    _mm512_storeu_ps(lanes, max16[r]);
    for (int l = 0; l < 16; l++) {
      const int g = (16 * r + l) % group;
      max_score[g] = lanes[l] > max_score[g] ? lanes[l] : max_score[g];
    }
  }
  /* e^(scale (s - max)) head-major, summed in float32 and rounded to bfloat16 into (p, 0) slots */
  const __m512i gather = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(group));
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int g = 0; g < group; g++) {
    uint32_t *p = slots + g * slot_stride;
    const __m512 m = _mm512_set1_ps(max_score[g]);
    v16f sum = {0};
    p[0] = 0;
    for (int64_t i = 0; i < num_tiles; i++) {
      const __m512 s = _mm512_i32gather_ps(gather, scores + i * TOKENS * group + g, 4);
      v16f e = exp_nonpositive16((v16f)_mm512_mul_ps(_mm512_sub_ps(s, m), scale16));
      const int64_t left = seq_len - i * TOKENS;
      if (left < TOKENS) e = (v16f)_mm512_maskz_mov_ps((__mmask16)((1u << left) - 1), (__m512)e);
      sum += e;
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh((__m512)e);
      _mm512_storeu_si512(p + 1 + i * TOKENS, _mm512_cvtepu16_epi32(rounded));
    }
    inv_sum[g] = 1.f / _mm512_reduce_add_ps((__m512)sum);
  }

  config_values(group);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(7);
  for (int64_t i = 0; i < num_tiles; i++) {
    const uint16_t *v = tile_rows(value_cache, blocks, i * TOKENS, block_size, shift, row);
    int64_t v_stride = stride;
    if (i + PREFETCH_TILES < num_tiles)
      prefetch_tile(tile_rows(value_cache, blocks, (i + PREFETCH_TILES) * TOKENS, block_size, shift, row), row);
    const int64_t left = seq_len - i * TOKENS;
    if (left < TOKENS) {
      memset(tail, 0, TOKENS * AMX_HEAD_DIM * 2);
      for (int64_t j = 0; j < left; j++) memcpy(tail + j * AMX_HEAD_DIM, v + j * row, AMX_HEAD_DIM * 2);
      v = tail, v_stride = AMX_HEAD_DIM * 2;
    }
    const char *even = (const char *)(slots + 1 + i * TOKENS);
    _tile_loadd(0, v, v_stride);
    _tile_loadd(1, v + 32, v_stride);
    _tile_loadd(5, even, slot_stride * 4);
    _tile_loadd(6, even - 2, slot_stride * 4);
    _tile_dpbf16ps(2, 5, 0);
    _tile_dpbf16ps(3, 6, 0);
    _tile_dpbf16ps(4, 5, 1);
    _tile_dpbf16ps(7, 6, 1);
  }
  _tile_stored(2, sums, 64);
  _tile_stored(3, sums + group * 16, 64);
  _tile_stored(4, sums + 2 * group * 16, 64);
  _tile_stored(7, sums + 3 * group * 16, 64);
  /* out[g][32h + 2n] = even sums, out[g][32h + 2n + 1] = odd sums */
  const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int g = 0; g < group; g++) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    for (int h = 0; h < 2; h++) {
      const __m512 even = _mm512_loadu_ps(sums + (2 * h) * group * 16 + g * 16);
      const __m512 odd = _mm512_loadu_ps(sums + (2 * h + 1) * group * 16 + g * 16);
      _mm512_storeu_ps(out + g * 64 + 32 * h, _mm512_mul_ps(_mm512_permutex2var_ps(even, low, odd), inv));
      _mm512_storeu_ps(out + g * 64 + 32 * h + 16, _mm512_mul_ps(_mm512_permutex2var_ps(even, high, odd), inv));
    }
  }
}

int paged_decode_amx_supports(int head_dim, int group, int block_size) {
  return amx_enabled && head_dim == AMX_HEAD_DIM && group >= 1 && group <= AMX_MAX_GROUP && block_size > 0 &&
         block_size % TOKENS == 0 && gemm_amx_available();
}

/* paged_decode_bf16's arguments (paged_decode.c), scratch sized by decode_scratch_floats; the
 * caller has checked paged_decode_amx_supports. */
int paged_decode_bf16_amx(const float *query, const uint16_t *key_cache, const uint16_t *value_cache,
                          const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens, float *out,
                          int64_t num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                          float scale, int64_t max_seq_len, float *scratch, int64_t per_thread, int num_threads) {
  const int group = num_heads / num_kv_heads;
  const int shift = (block_size & (block_size - 1)) == 0 ? __builtin_ctz((unsigned)block_size) : -1;
  const int64_t row = (int64_t)num_kv_heads * head_dim;
  const int64_t num_items = num_reqs * num_kv_heads;
  (void)max_seq_len;
  if (num_threads > num_items) num_threads = num_items > 1 ? (int)num_items : 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    float *s = scratch + (int64_t)AMX_THREAD_NUM() * per_thread;
    int64_t begin, end;
    thread_items(seq_lens, num_reqs, num_kv_heads, &begin, &end);
    for (int64_t item = begin; item < end; item++) {
      const int64_t req = item / num_kv_heads;
      const int kv_head = (int)(item % num_kv_heads);
      const int64_t first = (req * num_heads + (int64_t)kv_head * group) * head_dim;
      if (seq_lens[req] <= 0) {
        memset(out + first, 0, sizeof(float) * group * head_dim);
        continue;
      }
      attend_item(query + first, key_cache + kv_head * head_dim, value_cache + kv_head * head_dim,
                  block_table + req * block_table_stride, seq_lens[req], row, block_size, shift, scale, out + first,
                  s, group);
    }
    _tile_release();
  }
  return 0;
}

int64_t paged_decode_amx_floats(int64_t max_seq_len, int group) {
  return item_floats((max_seq_len + TOKENS - 1) / TOKENS, group);
}

int attention_amx_enable(int enable) {
  amx_enabled = enable != 0;
  return amx_enabled && gemm_amx_available();
}

int attention_amx_enabled(void) { return amx_enabled && gemm_amx_available(); }
#else
int paged_decode_amx_supports(int head_dim, int group, int block_size) {
  (void)head_dim, (void)group, (void)block_size;
  return 0;
}

int paged_decode_bf16_amx(const float *query, const uint16_t *key_cache, const uint16_t *value_cache,
                          const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens, float *out,
                          int64_t num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                          float scale, int64_t max_seq_len, float *scratch, int64_t per_thread, int num_threads) {
  (void)query, (void)key_cache, (void)value_cache, (void)block_table, (void)block_table_stride, (void)seq_lens;
  (void)out, (void)num_reqs, (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale;
  (void)max_seq_len, (void)scratch, (void)per_thread, (void)num_threads;
  return 4;
}

int64_t paged_decode_amx_floats(int64_t max_seq_len, int group) {
  (void)max_seq_len, (void)group;
  return 0;
}

int attention_amx_enable(int enable) {
  (void)enable;
  return 0;
}

int attention_amx_enabled(void) { return 0; }
#endif
