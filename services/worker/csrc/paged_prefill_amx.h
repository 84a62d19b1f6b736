/* paged_prefill.c's work item on the AMX tile unit (AMX-BF16), for head_dim 64: included there
 * after its tile loader, and only there. The items, their order, the tile of keys and values read
 * from the cache (load_tile) and the results are that file's; the products run on tiles:
 * - scores: S [16 rows][16 keys] = Q [16 rows][64] . K^T, the item's queries packed once as A tiles
 *   [rows][64], each tile of keys transposed once into B tiles [32 dimension pairs][16 keys];
 * - outputs: O [16 rows][64] += P [16 rows][64 keys] . V, P the probabilities rounded to bfloat16
 *   (as the vector path rounds them) row-major, V load_tile's key pairs interleaved per dimension,
 *   which is the B tile layout as it stands; O is held in memory between tiles of keys (loaded into
 *   the C tiles, summed into and stored back), so the online softmax rescales it in place.
 * The softmax is the vector path's, a row at a time over its 64 keys: base-2 exponentials of
 * log2-scaled scores, float32 sums. Every tile is 16 rows x 64 bytes: one tile configuration.
 *
 * Why: on a 2-core Sapphire Rapids-class VM the vector kernel ran at about 156 GFLOP/s, 34% of a
 * 2,160-token prefill step of SmolLM2-135M (docs/benchmarks.md, "AMX"), where TDPBF16PS does 16 x
 * 16 x 32 products in 12 cycles. */
#ifndef SPINDLE_PAGED_PREFILL_AMX_H
#define SPINDLE_PAGED_PREFILL_AMX_H

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define PREFILL_AMX 1
#define AMX_DIM 64
#define AMX_KEYS 16 /* keys per score tile */

#include "amx_tiles.h"

int attention_amx_enabled(void); /* paged_decode_amx.c: the library's switch */

/* The scratch of the vector path, laid out for tiles: q_pairs holds the packed queries
 * [ROWS_PER_ITEM][64] bfloat16, acc the output sums [ROWS_PER_ITEM][64], scores [ROWS_PER_ITEM]
 * [KV_TILE], prob_pairs the probabilities [ROWS_PER_ITEM][KV_TILE] bfloat16, key_pairs the
 * keys transposed [KV_TILE / 16][2][16 pairs][16 keys]. */
static void attend_item_amx(const prefill_args *a, const work_item *item, scratch *s) {
  const item_rows span = rows_of(a, item);
  const int64_t query_start = span.query_start, context_len = span.context_len;
  const int group = a->group, first_row = item->first_row, num_rows = span.num_rows, ng = span.ng;
  const int64_t *blocks = span.blocks;
  const int64_t head_offset = (int64_t)item->kv_head * AMX_DIM;
  uint16_t *q = (uint16_t *)s->q_pairs, *probs = (uint16_t *)s->prob_pairs;
  float *acc = (float *)s->acc, *scores = (float *)s->scores;
  uint32_t *key_t = s->key_pairs;
  float max_score[ROWS_PER_ITEM], sum[ROWS_PER_ITEM];
  int32_t pos[ROWS_PER_ITEM];
  uint16_t *out_rows[ROWS_PER_ITEM];
  for (int r = 0; r < ng * LANES; r++) {
    const int row = r < num_rows ? r : num_rows - 1; /* padding rows repeat the last: finite, not written */
    const int64_t token = query_start + (first_row + row) / group;
    const int64_t head = (int64_t)item->kv_head * group + (first_row + row) % group;
    pos[r] = (int32_t)(context_len + (first_row + row) / group);
    memcpy(q + r * AMX_DIM, a->query + token * a->query_row_stride + head * AMX_DIM, AMX_DIM * 2);
    out_rows[r] = r < num_rows ? a->out + token * a->out_row_stride + head * AMX_DIM : NULL;
    max_score[r] = -__builtin_inff(), sum[r] = 0.f;
    memset(acc + r * AMX_DIM, 0, AMX_DIM * sizeof(float));
  }
  load_uniform_tiles();
  const __m512 log2_scale = _mm512_set1_ps(a->log2_scale);
  const int64_t num_keys = (int64_t)pos[num_rows - 1] + 1;
  for (int64_t k0 = 0; k0 < num_keys; k0 += KV_TILE) {
    const int tile_keys = num_keys - k0 < KV_TILE ? (int)(num_keys - k0) : KV_TILE;
    const int64_t after = num_keys - k0 - tile_keys;
    load_tile(a, blocks, head_offset, k0, tile_keys, after < KV_TILE ? (int)after : KV_TILE, s, AMX_DIM);
    const int num_blocks = (tile_keys + AMX_KEYS - 1) / AMX_KEYS;
    /* load_tile zeroes up to a multiple of KEY_BLOCK; the tiles read whole blocks of 16 and 32 */
    const int padded = (tile_keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    for (int j = padded; j < KV_TILE; j++) memset(s->keys + j * AMX_DIM, 0, AMX_DIM * 2);
    if (padded < KV_TILE)
      memset((uint32_t *)s->value_pairs + padded / 2 * AMX_DIM, 0, (KV_TILE - padded) / 2 * AMX_DIM * 4);
    for (int kb = 0; kb < num_blocks; kb++)
      for (int c = 0; c < 2; c++) {
        __m512 m[LANES];
        for (int j = 0; j < LANES; j++) m[j] = _mm512_loadu_ps(s->keys + (kb * AMX_KEYS + j) * AMX_DIM + 32 * c);
        transpose16(m);
        for (int p = 0; p < LANES; p++) _mm512_storeu_ps(key_t + ((kb * 2 + c) * 16 + p) * 16, m[p]);
      }
    for (int g = 0; g < ng; g++) {
      const int last_pos = pos[g * LANES + LANES - 1];
      if (last_pos < k0) continue; /* rows ascend in position: this group sees no key here */
      const int seen = (int)((last_pos - k0) / AMX_KEYS + 1) < num_blocks ? (int)((last_pos - k0) / AMX_KEYS + 1)
                                                                        : num_blocks;
      _tile_loadd(0, q + g * LANES * AMX_DIM, AMX_DIM * 2);
      _tile_loadd(1, q + g * LANES * AMX_DIM + 32, AMX_DIM * 2);
      for (int kb = 0; kb < seen; kb++) {
        _tile_loadd(2, key_t + (kb * 2) * 256, 64);
        _tile_loadd(3, key_t + (kb * 2 + 1) * 256, 64);
        _tile_zero(4);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(4, 1, 3);
        _tile_stored(4, scores + g * LANES * KV_TILE + kb * AMX_KEYS, KV_TILE * 4);
      }
      /* online softmax, a row at a time over the keys it sees */
      for (int r = g * LANES; r < g * LANES + LANES; r++) {
        const int64_t visible = pos[r] - k0 + 1;
        const int n = visible < tile_keys ? (int)visible : tile_keys;
        uint16_t *p_row = probs + r * KV_TILE;
        if (n <= 0) {
          memset(p_row, 0, KV_TILE * 2);
          continue;
        }
        __m512 sc[KV_TILE / LANES];
        __m512 row_max = _mm512_set1_ps(-__builtin_inff());
        for (int v = 0; v < KV_TILE / LANES; v++) {
          const int left = n - v * LANES;
          const __mmask16 keep = left >= LANES ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
          sc[v] = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-__builtin_inff()),
                                       _mm512_mul_ps(_mm512_loadu_ps(scores + r * KV_TILE + v * LANES), log2_scale));
          row_max = _mm512_max_ps(row_max, sc[v]);
        }
        const float new_max = fmaxf(max_score[r], _mm512_reduce_max_ps(row_max));
        const float alpha = exp2f(max_score[r] - new_max); /* 0 on the first keys: -inf - finite */
        max_score[r] = new_max;
        const __m512 m = _mm512_set1_ps(new_max);
        __m512 tile_sum = _mm512_setzero_ps();
        for (int v = 0; v < KV_TILE / LANES; v += 2) {
          const __m512 p0 = exp2_nonpositive16(_mm512_sub_ps(sc[v], m));
          const __m512 p1 = exp2_nonpositive16(_mm512_sub_ps(sc[v + 1], m));
          tile_sum = _mm512_add_ps(tile_sum, _mm512_add_ps(p0, p1));
          _mm512_storeu_si512(p_row + v * LANES, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        sum[r] = sum[r] * alpha + _mm512_reduce_add_ps(tile_sum);
        if (alpha != 1.f) {
          const __m512 a16 = _mm512_set1_ps(alpha);
          for (int d = 0; d < AMX_DIM; d += LANES)
            _mm512_storeu_ps(acc + r * AMX_DIM + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * AMX_DIM + d), a16));
        }
      }
      /* O += P . V: P's two halves of 32 keys as A tiles, the value pairs as B tiles */
      const int num_halves = seen * AMX_KEYS > 32 ? 2 : 1;
      _tile_loadd(0, probs + g * LANES * KV_TILE, KV_TILE * 2);
      if (num_halves == 2) _tile_loadd(1, probs + g * LANES * KV_TILE + 32, KV_TILE * 2);
      float *o = acc + g * LANES * AMX_DIM;
      _tile_loadd(4, o, AMX_DIM * 4);
      _tile_loadd(5, o + 16, AMX_DIM * 4);
      _tile_loadd(6, o + 32, AMX_DIM * 4);
      _tile_loadd(7, o + 48, AMX_DIM * 4);
      const uint32_t *vp = (const uint32_t *)s->value_pairs;
#define VALUE_HALF(A, H)                                                                    \
  _tile_loadd(2, vp + (H) * 16 * AMX_DIM, AMX_DIM * 4);                                      \
  _tile_loadd(3, vp + (H) * 16 * AMX_DIM + 16, AMX_DIM * 4);                                 \
  _tile_dpbf16ps(4, A, 2);                                                                   \
  _tile_dpbf16ps(5, A, 3);                                                                   \
  _tile_loadd(2, vp + (H) * 16 * AMX_DIM + 32, AMX_DIM * 4);                                 \
  _tile_loadd(3, vp + (H) * 16 * AMX_DIM + 48, AMX_DIM * 4);                                 \
  _tile_dpbf16ps(6, A, 2);                                                                   \
  _tile_dpbf16ps(7, A, 3);
      VALUE_HALF(0, 0)
      if (num_halves == 2) {
        VALUE_HALF(1, 1)
      }
#undef VALUE_HALF
      _tile_stored(4, o, AMX_DIM * 4);
      _tile_stored(5, o + 16, AMX_DIM * 4);
      _tile_stored(6, o + 32, AMX_DIM * 4);
      _tile_stored(7, o + 48, AMX_DIM * 4);
    }
  }
  _tile_release();
  for (int r = 0; r < num_rows; r++) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
    for (int d = 0; d < AMX_DIM; d += 16)
      _mm256_storeu_si256((__m256i *)(out_rows[r] + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + r * AMX_DIM + d), inv)));
  }
}
#else
#define PREFILL_AMX 0
#endif

#endif
