/* This step's keys and values written into an int8 KV cache (attention/int8_kv_cache.py has the
 * layout): each (token, KV head) row of head_dim values becomes head_dim int8 in [-127, 127] and a
 * float32 scale, amax / 127, by the row rule of int8_quant.h (shared with W8A8's activations). The
 * PyTorch reference (`quantize_int8_rows`) does the same operations in the same order, so the two
 * agree bit for bit.
 *
 * key and value [num_tokens, num_kv_heads, head_dim] rows `*_stride` elements apart (views of the
 * fused QKV projection), float32 or bfloat16 (raw uint16); slots [num_tokens] int64, -1 skips a
 * token, and a slot past the cache fails the call (status 2) before anything is written; the
 * caches are the key and value halves of the layer's int8 tensor, `block_bytes` per block: keys
 * int8 [num_kv_heads, head_dim / 4, block_size, 4] (each row's dimensions in fours, the block's
 * tokens side by side per four, for the decode kernel's key pass), values int8 [block_size,
 * num_kv_heads, head_dim]; then float32 scales [num_kv_heads, block_size] in both. head_dim is a
 * multiple of 4 (status 1 otherwise). */
#include <stdint.h>
#include <string.h>

#include "int8_quant.h"
#include "vec.h"

#define MAX_HEAD_DIM 256
#define MIN_PARALLEL_TOKENS 64 /* below this a decode step's few rows cost less than waking threads */

/* A row quantized by the shared rule, its float32 scale stored at unaligned `scale_bytes`. */
#define QUANTIZE_INTO_BLOCK(SUFFIX, x, head_dim, q, scale_bytes) \
  do {                                                          \
    float scale;                                                \
    quantize_row_int8_##SUFFIX(x, head_dim, q, &scale);         \
    memcpy(scale_bytes, &scale, sizeof scale);                  \
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
    _Pragma("omp parallel for schedule(static) if(num_tokens >= MIN_PARALLEL_TOKENS)")               \
    for (int64_t t = 0; t < num_tokens; t++) {                                                        \
      const int64_t slot = slots[t];                                                                  \
      if (slot < 0) continue;                                                                         \
      const int64_t block = slot / block_size, offset = slot % block_size;                            \
      int8_t *kb = key_cache + block * block_bytes, *vb = value_cache + block * block_bytes;          \
      for (int h = 0; h < num_kv_heads; h++) {                                                        \
        const int64_t scale_offset = data_bytes + ((int64_t)h * block_size + offset) * 4;             \
        int8_t row[MAX_HEAD_DIM];                                                                     \
        QUANTIZE_INTO_BLOCK(SUFFIX, key + t * key_stride + (int64_t)h * head_dim, head_dim, row,      \
                            kb + scale_offset);                                                       \
        int8_t *fours = kb + (int64_t)h * head_dim * block_size + 4 * offset;                         \
        for (int p = 0; p < head_dim / 4; p++) memcpy(fours + (int64_t)p * 4 * block_size, row + 4 * p, 4); \
        QUANTIZE_INTO_BLOCK(SUFFIX, value + t * value_stride + (int64_t)h * head_dim, head_dim,       \
                            vb + (offset * num_kv_heads + h) * head_dim, vb + scale_offset);          \
      }                                                                                               \
    }                                                                                                 \
    return 0;                                                                                         \
  }

DEFINE_WRITE(f32, float)
DEFINE_WRITE(bf16, uint16_t)
