/* Paged prefill attention for a bfloat16 cache on CPUs with AVX512_BF16: every prefill and
 * chunked-prefill slice of a step attended in one call, keys and values read from the paged cache
 * through the block table (this step's K/V are already there).
 *
 * PyTorch's SDPA reaches 35-90 GFLOP/s on a small model's heads (64 dims, 3 query heads per KV
 * head, 2 cores); here each key and value row is read once for up to 96 query rows and multiplied
 * with VDPBF16PS (32 bfloat16 products summed into 16 float32 lanes per instruction): 120-290
 * GFLOP/s (benchmarks/prefill_attention_bench.py).
 *
 * Work item: one slice, one KV head, and up to ROW_GROUPS x 16 query rows, a row being one (query
 * token, query head of the group) pair in token-major order, so an item's rows need not start at a
 * token boundary. The (slice, KV head) pairs go costliest first, each one's items together (the
 * threads then share its keys and values in cache) and costliest first (late causal rows see more
 * keys); the threads take items dynamically.
 *
 * Lanes: a vector holds one value of 16 query rows. The queries are packed once per item as
 * bfloat16 pairs [head_dim / 2][16 rows][2] (a 16 x 16 transpose per 32 dimensions); each pair of
 * a key's dimensions is broadcast, so the scores of 16 rows for one key take head_dim / 2
 * instructions and no horizontal sums, and the online softmax's row maxima and sums are lane-wise.
 * Probabilities are rounded to bfloat16 (as GPU flash attention rounds them) and interleaved for
 * two keys [16 rows][2]; the value rows of those two keys are interleaved per dimension (one
 * VPERMT2W per 16 dimensions) and broadcast, so the output sums of 16 rows for one dimension take
 * one instruction per key pair. Sums and the softmax stay float32 (exp2 of log2-scaled scores).
 * Keys go in tiles of KV_TILE (copied once per item and tile), in blocks of KEY_BLOCK: a block
 * that a 16-row group cannot see (causal) is skipped for that group, and the score blocks are
 * masked only on the diagonal. Register blocks: BLOCK_GROUPS row groups x KEY_BLOCK keys (scores),
 * BLOCK_GROUPS row groups x DIM_BLOCK dimensions (outputs), 24 accumulators each.
 *
 * Layouts: query rows [num_tokens][num_heads][head_dim] bfloat16 with a row stride (the q part of
 * the fused qkv projection); key_cache / value_cache [num_blocks][block_size][num_kv_heads]
 * [head_dim] bfloat16 contiguous; out rows [num_tokens][num_heads * head_dim] with a row stride,
 * written only at the slices' rows; per slice i: query_starts[i], query_lens[i], seq_lens[i] and
 * block_table[i * block_table_stride ...] int64. Query token j of slice i sits at position
 * seq_lens[i] - query_lens[i] + j and sees keys 0 .. that position. Query head h reads KV head
 * h / (num_heads / num_kv_heads).
 *
 * Built only where the compiler targets AVX512_BF16 and AVX512F; elsewhere paged_prefill_bf16
 * returns PREFILL_UNSUPPORTED (and paged_prefill_available 0) and the caller keeps PyTorch's SDPA.
 * Shapes, lengths and block ids are checked before any work: a bad call returns a status, never
 * reads out of bounds.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFILL_OK 0
#define PREFILL_UNSUPPORTED 1   /* no AVX512_BF16 build */
#define PREFILL_BAD_HEADS 2     /* num_kv_heads does not divide num_heads */
#define PREFILL_BAD_HEAD_DIM 3  /* not a multiple of 32 up to 256 */
#define PREFILL_BAD_GROUP 4     /* more than MAX_GROUP query heads per KV head */
#define PREFILL_BAD_SLICE 5     /* lengths, rows or block ids out of range */
#define PREFILL_NO_MEMORY 6

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define LANES 16
#define ROW_GROUPS 6   /* 16-row vectors per work item: 3 ran 3-5% slower, 8 slower on short prompts */
#define BLOCK_GROUPS 3 /* 16-row vectors per register block */
#define ROWS_PER_ITEM (ROW_GROUPS * LANES)
#define KV_TILE 64   /* keys per pass (16 ran 25% slower, 32 5%) */
#define KEY_BLOCK 8  /* keys per register block of the score pass */
#define NUM_KEY_BLOCKS (KV_TILE / KEY_BLOCK)
#define DIM_BLOCK 8  /* output dimensions per register block of the value pass */

int paged_prefill_available(void) { return 1; }

typedef struct {
  const uint16_t *query;
  int64_t query_row_stride;
  const uint16_t *key_cache, *value_cache;
  int block_size, num_kv_heads, group;
  const int64_t *query_starts, *query_lens, *seq_lens, *block_table;
  int64_t block_table_stride;
  uint16_t *out;
  int64_t out_row_stride;
  float log2_scale; /* scale * log2(e): the softmax runs in base 2 */
} prefill_args;

typedef struct {
  int64_t group_cost, cost, slice; /* group_cost: of all the items of this slice and KV head */
  int32_t kv_head, first_row;
} work_item;

typedef struct {
  __m512i *q_pairs;      /* [ROW_GROUPS][head_dim / 2] */
  __m512 *acc;           /* [ROW_GROUPS][head_dim]: output sums */
  __m512 *scores;        /* [ROW_GROUPS][KV_TILE] */
  __m512i *prob_pairs;   /* [ROW_GROUPS][KV_TILE / 2] */
  uint16_t *keys;        /* [KV_TILE][head_dim] */
  uint32_t *value_pairs; /* [KV_TILE / 2][head_dim] */
  uint32_t *key_pairs;   /* the AMX path's keys as B tiles (paged_prefill_amx.h) */
} scratch;

/* One buffer per thread, kept between calls (OpenMP reuses its threads): no allocation per layer. */
static __thread char *tls_buffer;
static __thread size_t tls_capacity;

static int thread_scratch(int head_dim, scratch *s) {
  const size_t vec = sizeof(__m512);
  const size_t sizes[7] = {ROW_GROUPS * (size_t)head_dim / 2 * vec, ROW_GROUPS * (size_t)head_dim * vec,
                           ROW_GROUPS * (size_t)KV_TILE * vec, ROW_GROUPS * (size_t)KV_TILE / 2 * vec,
                           (size_t)KV_TILE * head_dim * sizeof(uint16_t),
                           (size_t)KV_TILE / 2 * head_dim * sizeof(uint32_t),
                           (size_t)KV_TILE / 2 * head_dim * sizeof(uint32_t)};
  size_t total = 0;
  for (int i = 0; i < 7; i++) total += sizes[i];
  if (total > tls_capacity) {
    free(tls_buffer);
    tls_buffer = aligned_alloc(64, total);
    tls_capacity = tls_buffer ? total : 0;
    if (!tls_buffer) return 0;
  }
  char *p = tls_buffer;
  void **slots[7] = {(void **)&s->q_pairs, (void **)&s->acc, (void **)&s->scores, (void **)&s->prob_pairs,
                     (void **)&s->keys, (void **)&s->value_pairs, (void **)&s->key_pairs};
  for (int i = 0; i < 7; i++) *slots[i] = p, p += sizes[i];
  return 1;
}

/* 2^x for x <= 0: x = n + f with n an integer and |f| <= 1/2, 2^f by its Taylor series to degree
 * 5 (relative error under 2.5e-6, far below the bfloat16 rounding of the probabilities), 2^n by
 * VSCALEFPS. Below -126 (masked keys are -inf) the result is 0, never a denormal, which some CPUs
 * compute slowly; 2^-126 no longer changes a sum that holds a 1. */
static inline __m512 exp2_nonpositive16(__m512 x) {
  const __mmask16 is_normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(is_normal, p, n);
}

/* r[i] lane j -> r[j] lane i (a 16 x 16 matrix of 32-bit values): four rounds of 16 shuffles. */
static inline void transpose16(__m512 r[LANES]) {
  __m512 t[LANES], u[LANES];
  for (int i = 0; i < LANES; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < LANES; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));     /* columns 0, 4, 8, 12 of rows i .. i + 3 */
    u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c)); /* 1, 5, 9, 13 */
    u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d)); /* 2, 6, 10, 14 */
    u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d)); /* 3, 7, 11, 15 */
  }
  for (int k = 0; k < 4; k++) {
    const __m512 v02 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), v13 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xdd);
    const __m512 w02 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    const __m512 w13 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xdd);
    r[k] = _mm512_shuffle_f32x4(v02, w02, 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(v02, w02, 0xdd);
    r[k + 4] = _mm512_shuffle_f32x4(v13, w13, 0x88);
    r[k + 12] = _mm512_shuffle_f32x4(v13, w13, 0xdd);
  }
}

static const uint16_t zeros[MAX_HEAD_DIM]; /* a padding row of queries or values */

static inline __m512i broadcast_pair(const void *p) {
  int32_t pair;
  memcpy(&pair, p, sizeof pair);
  return _mm512_set1_epi32(pair);
}

/* Scores of `ng` row groups against KEY_BLOCK keys (rows [KEY_BLOCK][head_dim]), times log2_scale,
 * with keys past a row's position at -inf when `masked`. */
static inline __attribute__((always_inline)) void score_block(
    const __m512i *q_pairs, const uint16_t *keys, __m512 *scores, const __m512i *row_pos, int first_key,
    int masked, __m512 log2_scale, __m512 *tile_max, const int ng, const int head_dim) {
  __m512 acc[BLOCK_GROUPS][KEY_BLOCK];
  for (int g = 0; g < ng; g++)
    for (int j = 0; j < KEY_BLOCK; j++) acc[g][j] = _mm512_setzero_ps();
  for (int p = 0; p < head_dim / 2; p++) {
    __m512bh q[BLOCK_GROUPS];
    for (int g = 0; g < ng; g++) q[g] = (__m512bh)q_pairs[g * (head_dim / 2) + p];
    for (int j = 0; j < KEY_BLOCK; j++) {
      const __m512bh k = (__m512bh)broadcast_pair(keys + j * head_dim + 2 * p);
      for (int g = 0; g < ng; g++) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], q[g], k);
    }
  }
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  for (int g = 0; g < ng; g++)
    for (int j = 0; j < KEY_BLOCK; j++) {
      __m512 s = _mm512_mul_ps(acc[g][j], log2_scale);
      if (masked) s = _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(_mm512_set1_epi32(first_key + j), row_pos[g]),
                                           neg_inf, s);
      scores[g * KV_TILE + j] = s;
      tile_max[g] = _mm512_max_ps(tile_max[g], s);
    }
}

/* acc[g][d0 .. d0 + DIM_BLOCK) (times alpha[g] first when `rescale`) += the probabilities of key
 * pairs [kp0, kp1) times their values, for `ng` row groups. */
static inline __attribute__((always_inline)) void value_block(
    __m512 *acc, const __m512i *prob_pairs, const uint32_t *value_pairs, const __m512 *alpha, int rescale,
    int d0, int kp0, int kp1, const int ng, const int head_dim) {
  __m512 a[BLOCK_GROUPS][DIM_BLOCK];
  for (int g = 0; g < ng; g++)
    for (int i = 0; i < DIM_BLOCK; i++) {
      a[g][i] = acc[g * head_dim + d0 + i];
      if (rescale) a[g][i] = _mm512_mul_ps(a[g][i], alpha[g]);
    }
  for (int kp = kp0; kp < kp1; kp++) {
    __m512bh w[BLOCK_GROUPS];
    for (int g = 0; g < ng; g++) w[g] = (__m512bh)prob_pairs[g * (KV_TILE / 2) + kp];
    for (int i = 0; i < DIM_BLOCK; i++) {
      const __m512bh v = (__m512bh)_mm512_set1_epi32((int)value_pairs[kp * head_dim + d0 + i]);
      for (int g = 0; g < ng; g++) a[g][i] = _mm512_dpbf16_ps(a[g][i], w[g], v);
    }
  }
  for (int g = 0; g < ng; g++)
    for (int i = 0; i < DIM_BLOCK; i++) acc[g * head_dim + d0 + i] = a[g][i];
}

/* The tile's keys k0 .. k0 + num_keys as rows [KV_TILE][head_dim] and its values as key pairs
 * interleaved per dimension [KV_TILE / 2][head_dim][2], both zero past num_keys up to a whole
 * key block; num_next_keys of the next tile are prefetched. */
static inline __attribute__((always_inline)) void load_tile(
    const prefill_args *a, const int64_t *blocks, int64_t head_offset, int64_t k0, int num_keys,
    int num_next_keys, scratch *s, const int head_dim) {
  const int64_t row = (int64_t)a->num_kv_heads * head_dim;
  const uint16_t *values[KV_TILE];
  int64_t block = k0 / a->block_size, offset = k0 % a->block_size;
  for (int j = 0; j < num_keys; j++) {
    const int64_t slot = (blocks[block] * a->block_size + offset) * row + head_offset;
    memcpy(s->keys + j * head_dim, a->key_cache + slot, sizeof(uint16_t) * head_dim);
    values[j] = a->value_cache + slot;
    if (++offset == a->block_size) offset = 0, block++;
  }
  const int padded = (num_keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK; /* the key blocks attended */
  for (int j = num_keys; j < padded; j++) {
    memset(s->keys + j * head_dim, 0, sizeof(uint16_t) * head_dim);
    values[j] = zeros;
  }
  /* The next tile's rows, fetched while this one is computed: they lie in scattered blocks, a row
   * apart by all the KV heads, where the hardware prefetchers lose track. */
  for (int j = 0; j < num_next_keys; j++) {
    const int64_t slot = (blocks[block] * a->block_size + offset) * row + head_offset;
    for (int b = 0; b < head_dim * (int)sizeof(uint16_t); b += 64) {
      __builtin_prefetch((const char *)(a->key_cache + slot) + b);
      __builtin_prefetch((const char *)(a->value_cache + slot) + b);
    }
    if (++offset == a->block_size) offset = 0, block++;
  }
  uint16_t low_index[32], high_index[32];
  for (int i = 0; i < 32; i++) {
    low_index[i] = (uint16_t)(i / 2 + (i % 2 ? 32 : 0));
    high_index[i] = (uint16_t)(low_index[i] + 16);
  }
  const __m512i low = _mm512_loadu_si512(low_index), high = _mm512_loadu_si512(high_index);
  for (int kp = 0; kp < padded / 2; kp++)
    for (int c = 0; c < head_dim / 32; c++) {
      const __m512i x = _mm512_loadu_si512(values[2 * kp] + 32 * c);
      const __m512i y = _mm512_loadu_si512(values[2 * kp + 1] + 32 * c);
      _mm512_store_si512(s->value_pairs + kp * head_dim + 32 * c, _mm512_permutex2var_epi16(x, low, y));
      _mm512_store_si512(s->value_pairs + kp * head_dim + 32 * c + 16, _mm512_permutex2var_epi16(x, high, y));
    }
}

/* Where an item's rows lie: its slice's first query token and context, how many rows it holds
 * (up to ROWS_PER_ITEM) in how many 16-row groups, and the slice's blocks. Both work items (the
 * vector one below, the tile one in paged_prefill_amx.h) take their rows from here. */
typedef struct {
  int64_t query_start, context_len;
  int num_rows, ng;
  const int64_t *blocks;
} item_rows;

static inline item_rows rows_of(const prefill_args *a, const work_item *item) {
  const int64_t slice = item->slice;
  const int64_t remaining = a->query_lens[slice] * a->group - item->first_row;
  const int num_rows = remaining < ROWS_PER_ITEM ? (int)remaining : ROWS_PER_ITEM;
  return (item_rows){a->query_starts[slice], a->seq_lens[slice] - a->query_lens[slice], num_rows,
                     (num_rows + LANES - 1) / LANES, a->block_table + slice * a->block_table_stride};
}

#include "paged_prefill_amx.h" /* the work item on AMX tiles, head_dim 64 */

#define DISPATCH_GROUPS(NG, CALL) \
  switch (NG) {                   \
    case 3: CALL(3); break;       \
    case 2: CALL(2); break;       \
    case 1: CALL(1); break;       \
    default: break;               \
  }

static inline __attribute__((always_inline)) void attend_item(const prefill_args *a, const work_item *item,
                                                              scratch *s, const int head_dim) {
  const item_rows span = rows_of(a, item);
  const int64_t query_start = span.query_start, context_len = span.context_len;
  const int group = a->group, first_row = item->first_row, num_rows = span.num_rows, ng = span.ng;
  const int64_t *blocks = span.blocks;
  const int64_t head_offset = (int64_t)item->kv_head * head_dim;

  /* Each row's position; padding lanes repeat the last row, so they see key 0 and stay finite. */
  int32_t pos[ROWS_PER_ITEM];
  for (int r = 0; r < ROWS_PER_ITEM; r++)
    pos[r] = (int32_t)(context_len + (first_row + (r < num_rows ? r : num_rows - 1)) / group);
  __m512i row_pos[ROW_GROUPS];
  for (int g = 0; g < ROW_GROUPS; g++) row_pos[g] = _mm512_loadu_si512(pos + g * LANES);

  /* The rows' query heads and output rows; padding rows read zeros and are not written. */
  const uint16_t *q_rows[ROWS_PER_ITEM];
  uint16_t *out_rows[ROWS_PER_ITEM];
  for (int r = 0; r < ng * LANES; r++) {
    const int64_t token = query_start + (first_row + r) / group;
    const int64_t head = (int64_t)item->kv_head * group + (first_row + r) % group;
    q_rows[r] = r < num_rows ? a->query + token * a->query_row_stride + head * head_dim : zeros;
    out_rows[r] = r < num_rows ? a->out + token * a->out_row_stride + head * head_dim : NULL;
  }
  /* Pack the queries as pairs [head_dim / 2][16 rows]: 16 pairs of 16 rows per transpose. */
  for (int g = 0; g < ng; g++)
    for (int c = 0; c < head_dim / 32; c++) {
      __m512 m[LANES];
      for (int lane = 0; lane < LANES; lane++) m[lane] = _mm512_loadu_ps(q_rows[g * LANES + lane] + 32 * c);
      transpose16(m);
      for (int j = 0; j < LANES; j++) s->q_pairs[g * (head_dim / 2) + 16 * c + j] = _mm512_castps_si512(m[j]);
    }
  __m512 max_score[ROW_GROUPS], sum[ROW_GROUPS], alpha[ROW_GROUPS];
  for (int g = 0; g < ng; g++) {
    max_score[g] = _mm512_set1_ps(-__builtin_inff());
    sum[g] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d++) s->acc[g * head_dim + d] = _mm512_setzero_ps();
  }
  uint16_t interleave[32];
  for (int i = 0; i < 32; i++) interleave[i] = (uint16_t)(i / 2 + (i % 2 ? 16 : 0));
  const __m512i interleave_index = _mm512_loadu_si512(interleave);
  const __m512 log2_scale = _mm512_set1_ps(a->log2_scale);

  const int64_t num_keys = (int64_t)pos[num_rows - 1] + 1;
  for (int64_t k0 = 0; k0 < num_keys; k0 += KV_TILE) {
    const int tile_keys = num_keys - k0 < KV_TILE ? (int)(num_keys - k0) : KV_TILE;
    const int64_t after = num_keys - k0 - tile_keys;
    load_tile(a, blocks, head_offset, k0, tile_keys, after < KV_TILE ? (int)after : KV_TILE, s, head_dim);
    /* The first row group that sees a key of each block (row groups ascend in position). */
    int first_group[NUM_KEY_BLOCKS], num_visible_blocks[ROW_GROUPS] = {0};
    for (int kb = 0; kb < NUM_KEY_BLOCKS; kb++) {
      int g = 0;
      while (g < ng && pos[g * LANES + LANES - 1] < k0 + kb * KEY_BLOCK) g++;
      first_group[kb] = g;
      for (int h = g; h < ng; h++) num_visible_blocks[h] = kb + 1;
    }
    __m512 tile_max[ROW_GROUPS];
    for (int g = 0; g < ROW_GROUPS; g++) tile_max[g] = _mm512_set1_ps(-__builtin_inff());
    for (int kb = 0; kb < NUM_KEY_BLOCKS && first_group[kb] < ng; kb++) {
      const int first_key = (int)(k0 + kb * KEY_BLOCK);
      for (int g0 = first_group[kb]; g0 < ng; g0 += BLOCK_GROUPS) {
        const int masked = first_key + KEY_BLOCK - 1 > pos[g0 * LANES];
#define SCORE(NG)                                                                                        \
  score_block(s->q_pairs + g0 * (head_dim / 2), s->keys + kb * KEY_BLOCK * head_dim,                     \
              s->scores + g0 * KV_TILE + kb * KEY_BLOCK, row_pos + g0, first_key, masked, log2_scale,     \
              tile_max + g0, NG, head_dim)
        DISPATCH_GROUPS(ng - g0 < BLOCK_GROUPS ? ng - g0 : BLOCK_GROUPS, SCORE)
#undef SCORE
      }
    }
    /* Online softmax per row group over the keys it sees. */
    const int g_begin = first_group[0];
    for (int g = g_begin; g < ng; g++) {
      const int n = num_visible_blocks[g] * KEY_BLOCK;
      const __m512 *sc = s->scores + g * KV_TILE;
      const __m512 new_max = _mm512_max_ps(max_score[g], tile_max[g]);
      alpha[g] = exp2_nonpositive16(_mm512_sub_ps(max_score[g], new_max));
      max_score[g] = new_max;
      __m512 tile_sum = _mm512_setzero_ps();
      for (int j = 0; j < n; j += 2) {
        const __m512 p0 = exp2_nonpositive16(_mm512_sub_ps(sc[j], new_max));
        const __m512 p1 = exp2_nonpositive16(_mm512_sub_ps(sc[j + 1], new_max));
        tile_sum = _mm512_add_ps(tile_sum, _mm512_add_ps(p0, p1));
        s->prob_pairs[g * (KV_TILE / 2) + j / 2] =
            _mm512_permutexvar_epi16(interleave_index, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      }
      sum[g] = _mm512_fmadd_ps(sum[g], alpha[g], tile_sum);
    }
    /* Output sums, in runs of key blocks seen by the same row groups. */
    for (int d0 = 0; d0 < head_dim; d0 += DIM_BLOCK) {
      for (int kb = 0; kb < NUM_KEY_BLOCKS && first_group[kb] < ng;) {
        int kb_end = kb + 1;
        while (kb_end < NUM_KEY_BLOCKS && first_group[kb_end] == first_group[kb]) kb_end++;
        for (int g0 = first_group[kb]; g0 < ng; g0 += BLOCK_GROUPS) {
#define VALUES(NG)                                                                                     \
  value_block(s->acc + g0 * head_dim, s->prob_pairs + g0 * (KV_TILE / 2), s->value_pairs, alpha + g0, \
              kb == 0, d0, kb * KEY_BLOCK / 2, kb_end * KEY_BLOCK / 2, NG, head_dim)
          DISPATCH_GROUPS(ng - g0 < BLOCK_GROUPS ? ng - g0 : BLOCK_GROUPS, VALUES)
#undef VALUES
        }
        kb = kb_end;
      }
    }
  }
  /* Normalise, and write each row's outputs as bfloat16: 16 dimensions of 16 rows per transpose. */
  for (int g = 0; g < ng; g++) {
    const __m512 inv_sum = _mm512_div_ps(_mm512_set1_ps(1.f), sum[g]);
    for (int d = 0; d < head_dim; d += LANES) {
      __m512 m[LANES];
      for (int i = 0; i < LANES; i++) m[i] = _mm512_mul_ps(s->acc[g * head_dim + d + i], inv_sum);
      transpose16(m);
      for (int lane = 0; lane < LANES; lane++)
        if (out_rows[g * LANES + lane])
          _mm256_storeu_si256((__m256i *)(out_rows[g * LANES + lane] + d), (__m256i)_mm512_cvtneps_pbh(m[lane]));
    }
  }
}

static int by_cost_descending(const void *x, const void *y) {
  const work_item *a = x, *b = y;
  if (a->group_cost != b->group_cost) return (a->group_cost < b->group_cost) - (a->group_cost > b->group_cost);
  if (a->slice != b->slice) return (a->slice > b->slice) - (a->slice < b->slice);
  if (a->kv_head != b->kv_head) return (a->kv_head > b->kv_head) - (a->kv_head < b->kv_head);
  return (a->cost < b->cost) - (a->cost > b->cost);
}

static int attend_slices(const prefill_args *a, int64_t num_slices, int head_dim, int num_threads) {
  int64_t num_items = 0;
  for (int64_t i = 0; i < num_slices; i++)
    num_items += (a->query_lens[i] * a->group + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM * a->num_kv_heads;
  if (num_items == 0) return PREFILL_OK;
  work_item *items = malloc(sizeof(work_item) * num_items);
  if (!items) return PREFILL_NO_MEMORY;
  int64_t n = 0;
  for (int64_t i = 0; i < num_slices; i++) {
    const int64_t num_rows = a->query_lens[i] * a->group, context_len = a->seq_lens[i] - a->query_lens[i];
    const int64_t group_cost = num_rows * (context_len + (a->query_lens[i] + 1) / 2);
    for (int64_t r = 0; r < num_rows; r += ROWS_PER_ITEM) {
      const int64_t last = r + ROWS_PER_ITEM < num_rows ? r + ROWS_PER_ITEM - 1 : num_rows - 1;
      const int64_t cost = (last - r + 1) * (context_len + last / a->group + 1);
      for (int h = 0; h < a->num_kv_heads; h++) items[n++] = (work_item){group_cost, cost, i, h, (int32_t)r};
    }
  }
  qsort(items, num_items, sizeof(work_item), by_cost_descending);
  if (num_threads > num_items) num_threads = (int)num_items;
  if (num_threads < 1) num_threads = 1;
  int failed = 0;
  const int on_tiles = PREFILL_AMX && head_dim == 64 && attention_amx_enabled();
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1)
  for (int64_t i = 0; i < num_items; i++) {
    scratch s;
    if (!thread_scratch(head_dim, &s)) {
      failed = 1;
      continue;
    }
    if (on_tiles)
      attend_item_amx(a, items + i, &s);
    else if (head_dim == 64)
      attend_item(a, items + i, &s, 64);
    else if (head_dim == 128)
      attend_item(a, items + i, &s, 128);
    else
      attend_item(a, items + i, &s, head_dim);
  }
  free(items);
  return failed ? PREFILL_NO_MEMORY : PREFILL_OK;
}
#else
int paged_prefill_available(void) { return 0; }
#endif

static int check_slices(const int64_t *query_starts, const int64_t *query_lens, const int64_t *seq_lens,
                        const int64_t *block_table, int64_t block_table_stride, int64_t num_slices,
                        int64_t num_tokens, int64_t num_blocks, int block_size) {
  if (num_slices < 0 || block_size <= 0) return 0;
  for (int64_t i = 0; i < num_slices; i++) {
    const int64_t start = query_starts[i], n = query_lens[i], seq_len = seq_lens[i];
    if (start < 0 || n < 0 || start + n > num_tokens || seq_len < n || seq_len > INT32_MAX / MAX_GROUP) return 0;
    const int64_t used = (seq_len + block_size - 1) / block_size;
    if (used > block_table_stride) return 0;
    for (int64_t b = 0; b < used; b++) {
      const int64_t id = block_table[i * block_table_stride + b];
      if (id < 0 || id >= num_blocks) return 0;
    }
  }
  return 1;
}

int paged_prefill_bf16(const uint16_t *query, int64_t query_row_stride, const uint16_t *key_cache,
                       const uint16_t *value_cache, int64_t num_blocks, int block_size, const int64_t *query_starts,
                       const int64_t *query_lens, const int64_t *seq_lens, const int64_t *block_table,
                       int64_t block_table_stride, int64_t num_slices, uint16_t *out, int64_t out_row_stride,
                       int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim, float scale,
                       int num_threads) {
  if (!paged_prefill_available()) return PREFILL_UNSUPPORTED;
  if (num_kv_heads <= 0 || num_heads <= 0 || num_heads % num_kv_heads) return PREFILL_BAD_HEADS;
  if (head_dim <= 0 || head_dim % 32 || head_dim > MAX_HEAD_DIM) return PREFILL_BAD_HEAD_DIM;
  if (num_heads / num_kv_heads > MAX_GROUP) return PREFILL_BAD_GROUP;
  if (query_row_stride < (int64_t)num_heads * head_dim || out_row_stride < (int64_t)num_heads * head_dim)
    return PREFILL_BAD_SLICE;
  if (!check_slices(query_starts, query_lens, seq_lens, block_table, block_table_stride, num_slices, num_tokens,
                    num_blocks, block_size))
    return PREFILL_BAD_SLICE;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const prefill_args a = {query, query_row_stride, key_cache, value_cache, block_size, num_kv_heads,
                          num_heads / num_kv_heads, query_starts, query_lens, seq_lens, block_table,
                          block_table_stride, out, out_row_stride, scale * 1.4426950408889634f};
  return attend_slices(&a, num_slices, head_dim, num_threads);
#else
  (void)query, (void)key_cache, (void)value_cache, (void)out, (void)scale, (void)num_threads;
  return PREFILL_UNSUPPORTED;
#endif
}
