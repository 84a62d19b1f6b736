/* This step's keys and values written into an int8 KV cache (attention/int8_kv_cache.py has the
 * layout), and blocks of it read back dense for prefill attention (at the end): each (token, KV
 * head) row of head_dim values becomes head_dim int8 in [-127, 127] about the row's midpoint, a
 * float32 scale and the float32 midpoint, x = mid + q * scale, by int8_quant.h's centered rule.
 * The PyTorch reference (`quantize_kv_rows`) does the same operations in the same order, so the
 * two agree bit for bit.
 *
 * key and value [num_tokens, num_kv_heads, head_dim] rows `*_stride` elements apart (views of the
 * fused QKV projection), float32 or bfloat16 (raw uint16); slots [num_tokens] int64, -1 skips a
 * token, and a slot past the cache fails the call (status 2) before anything is written; the
 * caches are the key and value halves of the layer's int8 tensor, `block_bytes` per block: keys
 * int8 [num_kv_heads, head_dim / 4, block_size, 4] (each row's dimensions in fours, the block's
 * tokens side by side per four, for the decode kernel's key pass), values int8 [block_size,
 * num_kv_heads, head_dim]; then float32 scales [num_kv_heads, block_size] and float32 midpoints
 * [num_kv_heads, block_size] in both. head_dim is a multiple of 4 (status 1 otherwise). */
#include <stdint.h>
#include <string.h>

#include "int8_quant.h"
#include "vec.h"

#define MAX_HEAD_DIM 256
/* From this many tokens both threads write: each decode row lands in a block no longer cached
 * (40 rows: 55 -> 35 us a call on a 2-core Sapphire Rapids VM, 32 with the prefetch below). */
#define MIN_PARALLEL_TOKENS 8

/* Key row (h, token slot o) of a block: its four p lies at the returned offset + 4 * block_size * p. */
static inline int64_t key_fours_offset(int h, int64_t o, int head_dim, int block_size) {
  return (int64_t)h * head_dim * block_size + 4 * o;
}

/* The cache lines a token's rows go to, prefetched for writing: its key row is spread over
 * head_dim / 4 lines a head (the fours layout), so a decode step's rows, each in a block no
 * longer cached, would otherwise wait on one read-for-ownership after another. */
static inline void prefetch_token_lines(int8_t *key_cache, int8_t *value_cache, int64_t slot, int num_kv_heads,
                                        int head_dim, int block_size, int64_t block_bytes, int64_t data_bytes,
                                        int64_t meta_bytes) {
  const int64_t block = slot / block_size, offset = slot % block_size;
  int8_t *kb = key_cache + block * block_bytes, *vb = value_cache + block * block_bytes;
  for (int h = 0; h < num_kv_heads; h++) {
    int8_t *fours = kb + key_fours_offset(h, offset, head_dim, block_size);
    for (int p = 0; p < head_dim / 4; p++) __builtin_prefetch(fours + (int64_t)p * 4 * block_size, 1, 3);
    const int64_t scale_offset = data_bytes + ((int64_t)h * block_size + offset) * 4;
    __builtin_prefetch(kb + scale_offset, 1, 3);
    __builtin_prefetch(kb + scale_offset + meta_bytes, 1, 3);
    __builtin_prefetch(vb + scale_offset, 1, 3);
    __builtin_prefetch(vb + scale_offset + meta_bytes, 1, 3);
  }
  for (int64_t b = 0; b < (int64_t)num_kv_heads * head_dim; b += 64)
    __builtin_prefetch(vb + offset * num_kv_heads * head_dim + b, 1, 3);
}

/* A row quantized by the centered rule, its float32 scale and midpoint stored at unaligned
 * `scale_bytes` and `mid_bytes`. */
#define QUANTIZE_INTO_BLOCK(SUFFIX, x, head_dim, q, scale_bytes, mid_bytes) \
  do {                                                                     \
    float scale, mid;                                                      \
    quantize_row_centered_##SUFFIX(x, head_dim, q, &scale, &mid);          \
    memcpy(scale_bytes, &scale, sizeof scale);                             \
    memcpy(mid_bytes, &mid, sizeof mid);                                   \
  } while (0)

#define DEFINE_WRITE(SUFFIX, T)                                                                      \
  int write_kv_int8_##SUFFIX(const T *key, int64_t key_stride, const T *value, int64_t value_stride,   \
                             const int64_t *slots, int64_t num_tokens, int num_kv_heads, int head_dim,   \
                             int block_size, int64_t block_bytes, int64_t num_blocks,                \
                             int8_t *key_cache, int8_t *value_cache) {                                \
    if (head_dim <= 0 || head_dim > MAX_HEAD_DIM || head_dim % 4) return 1;                          \
    for (int64_t t = 0; t < num_tokens; t++) /* checked before anything is written */                \
      if (slots[t] >= num_blocks * block_size) return 2;                                             \
    const int64_t data_bytes = (int64_t)block_size * num_kv_heads * head_dim;                         \
    const int64_t meta_bytes = (int64_t)block_size * num_kv_heads * 4; /* scales, then midpoints */  \
    _Pragma("omp parallel for schedule(static) if(num_tokens >= MIN_PARALLEL_TOKENS)")               \
    for (int64_t t = 0; t < num_tokens; t++) {                                                        \
      if (t + 1 < num_tokens && slots[t + 1] >= 0)                                                    \
        prefetch_token_lines(key_cache, value_cache, slots[t + 1], num_kv_heads, head_dim, block_size,  \
                             block_bytes, data_bytes, meta_bytes);                                     \
      const int64_t slot = slots[t];                                                                  \
      if (slot < 0) continue;                                                                         \
      const int64_t block = slot / block_size, offset = slot % block_size;                            \
      int8_t *kb = key_cache + block * block_bytes, *vb = value_cache + block * block_bytes;          \
      for (int h = 0; h < num_kv_heads; h++) {                                                        \
        const int64_t scale_offset = data_bytes + ((int64_t)h * block_size + offset) * 4;             \
        const int64_t mid_offset = scale_offset + meta_bytes;                                         \
        int8_t row[MAX_HEAD_DIM];                                                                     \
        QUANTIZE_INTO_BLOCK(SUFFIX, key + t * key_stride + (int64_t)h * head_dim, head_dim, row,      \
                            kb + scale_offset, kb + mid_offset);                                      \
        int8_t *fours = kb + key_fours_offset(h, offset, head_dim, block_size);                       \
        for (int p = 0; p < head_dim / 4; p++) memcpy(fours + (int64_t)p * 4 * block_size, row + 4 * p, 4); \
        QUANTIZE_INTO_BLOCK(SUFFIX, value + t * value_stride + (int64_t)h * head_dim, head_dim,       \
                            vb + (offset * num_kv_heads + h) * head_dim, vb + scale_offset,           \
                            vb + mid_offset);                                                         \
      }                                                                                               \
    }                                                                                                 \
    return 0;                                                                                         \
  }

DEFINE_WRITE(f32, float)
DEFINE_WRITE(bf16, uint16_t)

/* q * scale rounded to float32, then + mid rounded again: the two roundings of PyTorch's
 * reference, which an FMA (the compiler contracts a * b + c) would make one. */
static inline v8f scale_then_add8(v8f q, float scale, float mid) {
  v8f p = q * scale;
#if defined(__AVX__)
  __asm__("" : "+x"(p));
#else
  __asm__("" : "+m"(p));
#endif
  return p + mid;
}

static inline float scale_then_add1(float q, float scale, float mid) {
  float p = q * scale;
  __asm__("" : "+m"(p));
  return p + mid;
}

/* Blocks block_ids[0..n) of one half of the int8 cache (half 0 keys, 1 values: their layouts
 * above) as dense rows out [n, block_size, num_kv_heads, head_dim], float32 or bfloat16 (raw
 * uint16), for prefill attention: each element q * scale + mid in float32 (two roundings), then
 * rounded to bfloat16 (nearest even), as PyTorch's `(q.float() * scale + mid).to(dtype)`
 * (`dequantize_blocks`) computes it, so the two agree bit for bit. */
#define DEFINE_DEQUANTIZE(SUFFIX, T, STORE8, STORE1)                                                   \
  int dequantize_kv_int8_##SUFFIX(const int8_t *cache, int64_t block_bytes, const int64_t *block_ids,    \
                                  int64_t n, int half, int block_size, int num_kv_heads, int head_dim,   \
                                  T *out) {                                                             \
    if (head_dim <= 0 || head_dim > MAX_HEAD_DIM || head_dim % 4) return 1;                            \
    const int64_t data_bytes = (int64_t)block_size * num_kv_heads * head_dim;                           \
    const int64_t meta_bytes = (int64_t)block_size * num_kv_heads * 4;                                  \
    const int64_t num_items = n * num_kv_heads;                                                         \
    _Pragma("omp parallel for schedule(static) if(n * block_size >= MIN_PARALLEL_TOKENS)")             \
    for (int64_t item = 0; item < num_items; item++) {                                                  \
      const int64_t i = item / num_kv_heads;                                                            \
      const int h = (int)(item % num_kv_heads);                                                         \
      const int8_t *block = cache + block_ids[i] * block_bytes;                                         \
      const int8_t *scales = block + data_bytes + 4 * (int64_t)h * block_size;                          \
      const int8_t *mids = scales + meta_bytes;                                                         \
      for (int o = 0; o < block_size; o++) {                                                            \
        int8_t row[MAX_HEAD_DIM];                                                                       \
        if (half == 0) {                                                                                \
          const int8_t *fours = block + key_fours_offset(h, o, head_dim, block_size);                   \
          for (int p = 0; p < head_dim / 4; p++) memcpy(row + 4 * p, fours + (int64_t)p * 4 * block_size, 4); \
        } else {                                                                                        \
          memcpy(row, block + ((int64_t)o * num_kv_heads + h) * head_dim, (size_t)head_dim);            \
        }                                                                                               \
        float scale, mid;                                                                               \
        memcpy(&scale, scales + 4 * o, sizeof scale);                                                   \
        memcpy(&mid, mids + 4 * o, sizeof mid);                                                         \
        T *dst = out + ((i * block_size + o) * num_kv_heads + h) * head_dim;                            \
        int d = 0;                                                                                      \
        for (; d + 8 <= head_dim; d += 8) STORE8(dst + d, scale_then_add8(load_int8(row + d), scale, mid)); \
        for (; d < head_dim; d++) dst[d] = STORE1(scale_then_add1((float)row[d], scale, mid));          \
      }                                                                                                 \
    }                                                                                                   \
    return 0;                                                                                           \
  }

static inline float identity_f32(float x) { return x; }

DEFINE_DEQUANTIZE(f32, float, store_f32, identity_f32)
DEFINE_DEQUANTIZE(bf16, uint16_t, store_bf16, f32_to_bf16)
