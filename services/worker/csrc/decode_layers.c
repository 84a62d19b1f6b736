/* A decode step's decoder layers in one call (layers/decode_stack.py): for a few rows the per-layer
 * work is small (SmolLM2-135M at one row: about 0.3 ms of kernels a layer) and calling each kernel
 * from Python (norm, q/k/v, RoPE + cache write, attention, o, norm, gate/up, SiLU, down: 9 calls,
 * their tensors and checks) costs a visible share of it. This runs the same kernels in the same
 * order on the same buffers, so its results are those of the layer-by-layer path bit for bit.
 *
 * Llama-family layers only (pre-norm, fused q/k/v and gate/up, rotate-half RoPE, SiLU), with every
 * matmul on a GEMV: bfloat16 weights (gemv.c, or their column tiles: gemm_tiles.c, and above the
 * tiles' rows their AMX GEMM panels: gemm_amx_bf16.c) for bfloat16
 * activations, or int8 weights with float32 per-channel scales (gemv_int8.c) for float32 or
 * bfloat16 activations; the KV cache in the activations' dtype, or int8 (attention/int8_kv_cache.py:
 * rows written by kv_int8.c's writer, read by paged_decode_int8.c). The caller checks that a model
 * and a step qualify. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

/* The kernels this drives, from the other sources of the same library. */
void add_rms_norm_f32(float *x, float *residual, const float *weight, int64_t n, int64_t hidden, float eps);
void add_rms_norm_bf16(uint16_t *x, uint16_t *residual, const uint16_t *weight, int64_t n, int64_t hidden, float eps);
void rms_norm_f32(const float *x, float *out, const float *weight, int64_t n, int64_t hidden, float eps);
void rms_norm_bf16(const uint16_t *x, uint16_t *out, const uint16_t *weight, int64_t n, int64_t hidden, float eps);
void silu_and_mul_f32(const float *x, float *out, int64_t num_tokens, int64_t n);
void silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t num_tokens, int64_t n);
void rope_cache_f32(float *qkv, const float *cos, const float *sin, const int64_t *slots, float *key_cache,
                    float *value_cache, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim);
void rope_cache_bf16(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                     uint16_t *key_cache, uint16_t *value_cache, int64_t num_tokens, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim);
void gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
               int64_t k);
int gemm_tiles_bf16(const uint16_t *x, const uint16_t *wt, const uint16_t *bias, uint16_t *y, int64_t m_size,
                    int64_t n_size, int64_t k_size);
int gemm_amx_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m_size,
                  int64_t n_size, int64_t k_size);
int gemm_amx_int8w(const uint16_t *x, const int8_t *packed, const float *scales, const uint16_t *bias, uint16_t *y,
                   int64_t m_size, int64_t n_size, int64_t k_size);
int gemm_tiles_int8w_bf16(const uint16_t *x, const int8_t *wt, const float *scales, const uint16_t *bias,
                          uint16_t *y, int64_t m_size, int64_t n_size, int64_t k_size);
int int8_tiles_bf16(const uint16_t *x, const uint8_t *wt, const float *w_scales, const uint16_t *bias, uint16_t *y,
                    int64_t m_size, int64_t n_size, int64_t k_size, int64_t group_size);
int gemv_int8_f32(const float *x, const int8_t *q, const float *scales, const float *bias, float *y, int64_t m,
                  int64_t n, int64_t k);
int gemv_int8_bf16(const uint16_t *x, const int8_t *q, const float *scales, const uint16_t *bias, uint16_t *y,
                   int64_t m, int64_t n, int64_t k);
int64_t scratch_floats_per_thread(int64_t max_seq_len, int group, int head_dim);
int paged_decode_f32(const float *query, const float *key_cache, const float *value_cache,
                     const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens, float *out,
                     int64_t num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                     int64_t max_seq_len, float *scratch, int num_threads);
int paged_decode_bf16(const float *query, const uint16_t *key_cache, const uint16_t *value_cache,
                      const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens, float *out,
                      int64_t num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                      int64_t max_seq_len, float *scratch, int num_threads);
int paged_decode_int8(const float *query, const int8_t *key_cache, const int8_t *value_cache, int64_t block_bytes,
                      const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens, float *out,
                      int64_t num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                      int64_t max_seq_len, float *scratch, int num_threads);
int write_kv_int8_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                      const int64_t *slots, int64_t num_tokens, int num_kv_heads, int head_dim, int block_size,
                      int64_t block_bytes, int64_t num_blocks, int8_t *key_cache, int8_t *value_cache);
int write_kv_int8_bf16(const uint16_t *key, int64_t key_stride, const uint16_t *value, int64_t value_stride,
                       const int64_t *slots, int64_t num_tokens, int num_kv_heads, int head_dim, int block_size,
                       int64_t block_bytes, int64_t num_blocks, int8_t *key_cache, int8_t *value_cache);

enum { WEIGHTS_BF16 = 0, WEIGHTS_INT8 = 1, WEIGHTS_BF16_TILES = 2, WEIGHTS_INT8_TILES = 3, WEIGHTS_INT8_WIDENED = 4 };
enum { PROJ_QKV = 0, PROJ_O = 1, PROJ_GATE_UP = 2, PROJ_DOWN = 3, NUM_PROJ = 4 };

/* The model, filled once by decode_stack.py; the arrays hold num_layers entries each. For every
 * projection: its weight (bfloat16 or int8 [out, in], or bfloat16 column tiles), int8 scales
 * (float32 [out], NULL for bf16) and bias (the activations' dtype, or NULL); with WEIGHTS_INT8_TILES
 * (W8A8) also its int8 column tiles, which take the steps of more than max_gemv_rows rows (0 where
 * quantize_model gives W8A8 every row count on them). kv_block_bytes is 0 for a cache in the
 * activations' dtype, else the bytes of one block of the int8 cache's halves (num_blocks each). */
typedef struct {
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
  float eps, scale;
  int32_t weight_kind;
  void **input_norm, **post_norm;
  void **weight[NUM_PROJ], **scales[NUM_PROJ], **bias[NUM_PROJ];
  void **key_cache, **value_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] each */
  void *final_norm;
  void **tiles[NUM_PROJ];
  int64_t max_gemv_rows;
  int64_t kv_block_bytes, num_blocks;
  int64_t act_group_size; /* WEIGHTS_INT8_TILES: the tiles' activation groups (0: per row) */
  /* WEIGHTS_BF16_TILES: each projection's column tiles take up to tile_rows[p] rows; above them its
   * weight in the AMX GEMM's panels (amx[p]) takes up to amx_rows[p] (0 where it has none).
   * WEIGHTS_INT8 with amx_rows[p] set: the int8 GEMV takes up to tile_rows[p] rows, the int8 AMX
   * GEMM's panels above. WEIGHTS_INT8_WIDENED (weight-only int8 without AMX): the int8 GEMV up to
   * tile_rows[p] rows, the column tiles holding the weight in int8 (tiles[p]) above. */
  int64_t tile_rows[NUM_PROJ], amx_rows[NUM_PROJ];
  void **amx[NUM_PROJ];
} DecodeStack;

/* y [m, n] = x [m, k] W^T (+ b) for projection p of layer l. Returns the GEMV's status. */
static int project_f32(const DecodeStack *s, int p, int64_t l, const float *x, float *y, int64_t m, int64_t n,
                       int64_t k) {
  return gemv_int8_f32(x, s->weight[p][l], s->scales[p][l], s->bias[p][l], y, m, n, k);
}

static int project_bf16(const DecodeStack *s, int p, int64_t l, const uint16_t *x, uint16_t *y, int64_t m,
                        int64_t n, int64_t k) {
  if (s->weight_kind == WEIGHTS_INT8 && s->amx_rows[p] && m > s->tile_rows[p]) {
    if (m > s->amx_rows[p]) return 20;
    return gemm_amx_int8w(x, s->amx[p][l], s->scales[p][l], s->bias[p][l], y, m, n, k) ? 21 : 0;
  }
  if (s->weight_kind == WEIGHTS_INT8_WIDENED && m > s->tile_rows[p])
    return gemm_tiles_int8w_bf16(x, s->tiles[p][l], s->scales[p][l], s->bias[p][l], y, m, n, k) ? 21 : 0;
  if (s->weight_kind == WEIGHTS_INT8 || s->weight_kind == WEIGHTS_INT8_WIDENED ||
      (s->weight_kind == WEIGHTS_INT8_TILES && m <= s->max_gemv_rows))
    return gemv_int8_bf16(x, s->weight[p][l], s->scales[p][l], s->bias[p][l], y, m, n, k);
  if (s->weight_kind == WEIGHTS_INT8_TILES)
    return int8_tiles_bf16(x, s->tiles[p][l], s->scales[p][l], s->bias[p][l], y, m, n, k, s->act_group_size);
  if (s->weight_kind == WEIGHTS_BF16_TILES) {
    if (m <= s->tile_rows[p]) return gemm_tiles_bf16(x, s->weight[p][l], s->bias[p][l], y, m, n, k);
    if (m > s->amx_rows[p]) return 20; /* the caller's row limit let a step past both */
    return gemm_amx_bf16(x, s->amx[p][l], s->bias[p][l], y, m, n, k) ? 21 : 0;
  }
  gemv_bf16(x, s->weight[p][l], s->bias[p][l], y, m, n, k);
  return 0;
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define STORE_F32(x) (x)
#define STORE_BF16(x) f32_to_bf16(x)

/* Step buffers start on a cache line: tile and vector rows of them then never straddle two lines
 * (malloc gives 16 bytes). */
static void *alloc_lines(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* hidden [m, H]: the step's embeddings in, the final norm's output out; residual [m, H] scratch.
 * cos/sin [m, head_dim / 2]; slots [m]; block_table [m, *] (row stride block_table_stride), seq_lens
 * [m]. Returns 0; -1 where memory ran out, the decode kernel's status (1-4), 10 + the int8
 * writer's (11: head_dim, 12: a slot past the cache), 20 for rows past a projection's kernels, 21 where
 * the AMX GEMM failed. */
#define DEFINE_DECODE_LAYERS(SUFFIX, T, LOAD, STORE)                                                         \
  int decode_layers_##SUFFIX(const DecodeStack *s, T *hidden, T *residual, const T *cos, const T *sin,        \
                             const int64_t *slots, const int64_t *block_table, int64_t block_table_stride,    \
                             const int64_t *seq_lens, int64_t max_seq_len, int64_t m, int num_threads) {      \
    const int64_t hd = s->head_dim, q_width = s->num_heads * hd, kv_width = s->num_kv_heads * hd;             \
    const int64_t qkv_width = q_width + 2 * kv_width, inter = s->intermediate, h = s->hidden;                \
    const int group = (int)(s->num_heads / s->num_kv_heads);                                                  \
    const int64_t scratch_floats = (int64_t)num_threads * scratch_floats_per_thread(max_seq_len, group, (int)hd); \
    T *qkv = alloc_lines(sizeof(T) * m * qkv_width), *gate_up = alloc_lines(sizeof(T) * m * 2 * inter);     \
    T *act = alloc_lines(sizeof(T) * m * (inter > q_width ? inter : q_width)); /* SiLU out, or attention out */ \
    float *q32 = alloc_lines(sizeof(float) * m * q_width), *attn32 = alloc_lines(sizeof(float) * m * q_width); \
    float *scratch = alloc_lines(sizeof(float) * (scratch_floats > 0 ? scratch_floats : 1));                 \
    int status = 0;                                                                                           \
    if (!qkv || !gate_up || !act || !q32 || !attn32 || !scratch) status = -1;                                 \
    for (int64_t l = 0; l < s->num_layers && status == 0; l++) {                                              \
      if (l == 0) { /* the first layer's residual is its input */                                           \
        memcpy(residual, hidden, sizeof(T) * m * h);                                                          \
        rms_norm_##SUFFIX(residual, hidden, s->input_norm[0], m, h, s->eps);                                  \
      } else {                                                                                                \
        add_rms_norm_##SUFFIX(hidden, residual, s->input_norm[l], m, h, s->eps);                              \
      }                                                                                                       \
      if ((status = project_##SUFFIX(s, PROJ_QKV, l, hidden, qkv, m, qkv_width, h))) break;                  \
      if (s->kv_block_bytes) { /* int8 cache: rotate, then its writer quantizes k and v into it */          \
        rope_cache_##SUFFIX(qkv, cos, sin, NULL, NULL, NULL, m, s->num_heads, s->num_kv_heads, hd);           \
        status = write_kv_int8_##SUFFIX(qkv + q_width, qkv_width, qkv + q_width + kv_width, qkv_width, slots, m, \
                                        (int)s->num_kv_heads, (int)hd, (int)s->block_size, s->kv_block_bytes,  \
                                        s->num_blocks, s->key_cache[l], s->value_cache[l]);                    \
        if (status) {                                                                                         \
          status += 10;                                                                                       \
          break;                                                                                              \
        }                                                                                                     \
      } else {                                                                                                \
        rope_cache_##SUFFIX(qkv, cos, sin, slots, s->key_cache[l], s->value_cache[l], m, s->num_heads,        \
                            s->num_kv_heads, hd);                                                             \
      }                                                                                                       \
      for (int64_t t = 0; t < m; t++) /* the decode kernels read float32 queries, contiguous */              \
        for (int64_t i = 0; i < q_width; i++) q32[t * q_width + i] = LOAD(qkv[t * qkv_width + i]);            \
      if (s->kv_block_bytes)                                                                                  \
        status = paged_decode_int8(q32, s->key_cache[l], s->value_cache[l], s->kv_block_bytes, block_table,   \
                                   block_table_stride, seq_lens, attn32, m, (int)s->num_heads,                \
                                   (int)s->num_kv_heads, (int)hd, (int)s->block_size, s->scale, max_seq_len,  \
                                   scratch, num_threads);                                                     \
      else                                                                                                    \
        status = paged_decode_##SUFFIX(q32, s->key_cache[l], s->value_cache[l], block_table,                  \
                                       block_table_stride, seq_lens, attn32, m, (int)s->num_heads,            \
                                       (int)s->num_kv_heads, (int)hd, (int)s->block_size, s->scale,           \
                                       max_seq_len, scratch, num_threads);                                    \
      if (status) break;                                                                                      \
      for (int64_t i = 0; i < m * q_width; i++) act[i] = STORE(attn32[i]);                                    \
      if ((status = project_##SUFFIX(s, PROJ_O, l, act, hidden, m, h, q_width))) break;                      \
      add_rms_norm_##SUFFIX(hidden, residual, s->post_norm[l], m, h, s->eps);                                 \
      if ((status = project_##SUFFIX(s, PROJ_GATE_UP, l, hidden, gate_up, m, 2 * inter, h))) break;          \
      silu_and_mul_##SUFFIX(gate_up, act, m, inter);                                                          \
      if ((status = project_##SUFFIX(s, PROJ_DOWN, l, act, hidden, m, h, inter))) break;                     \
    }                                                                                                         \
    if (status == 0) add_rms_norm_##SUFFIX(hidden, residual, s->final_norm, m, h, s->eps);                    \
    free(qkv), free(gate_up), free(act), free(q32), free(attn32), free(scratch);                              \
    return status;                                                                                            \
  }

DEFINE_DECODE_LAYERS(f32, float, LOAD_F32, STORE_F32)
DEFINE_DECODE_LAYERS(bf16, uint16_t, LOAD_BF16, STORE_BF16)
