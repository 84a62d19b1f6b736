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
#include "decode_items.h"
#include "decode_int8_keys.h"
#include "decode_int8_values.h"
#include "int8_bf16.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define PAGED_DECODE_INT8_BAD_BLOCK_BYTES 4

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
    int64_t begin, end;
    thread_items(seq_lens, num_reqs, num_kv_heads, &begin, &end);
    for (int64_t item = begin; item < end; item++) {
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
