/* Fused element-wise layers for the CPU model: each replaces several PyTorch operations, and so
 * several passes over the activations and several dispatches per layer.
 *
 * - add_rms_norm: residual += x, then x = rms_norm(residual) * weight (both in place);
 * - rms_norm: out = rms_norm(x) * weight;
 * - silu_and_mul: out[t] = silu(x[t, :n]) * x[t, n:];
 * - rope_cache: rotates q and k inside the fused qkv projection output (rotate-half RoPE) and
 *   writes k and v into the paged KV cache at each token's slot.
 * Rows are [num_tokens, hidden] and contiguous; float32 or bfloat16 (raw uint16) storage, float32
 * arithmetic, and bfloat16 results rounded to nearest even where PyTorch rounds, so the bfloat16
 * results equal PyTorch's op for op (where the build has AVX512_BF16, bfloat16 norm and SiLU rows
 * round with VCVTNEPS2BF16, which also flushes denormal floats to zero). Rows are split over
 * OpenMP threads when there are enough.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* The rotation must round each product as PyTorch (and Hugging Face's Llama) does: no fused
 * multiply-add, which GCC would otherwise form under its default -ffp-contract=fast. */
#if defined(__clang__)
#define EXACT_PRODUCTS _Pragma("clang fp contract(off)")
#define EXACT_PRODUCTS_ATTR
#else
#define EXACT_PRODUCTS
#define EXACT_PRODUCTS_ATTR __attribute__((optimize("fp-contract=off")))
#endif

/* Below this many elements a thread team costs more than it saves. 8,192 puts a decode step's
 * residual + RMS norm on both threads from 15 rows of 576; with the int8 writer's threshold
 * lowered too (kv_int8.c), decode steps of 16-40 rows ran 2-5% faster on a 2-core Sapphire
 * Rapids VM. */
#define MIN_PARALLEL_ELEMENTS 8192

#define LOAD_F32(p) (p)
#define STORE_F32(x) (x)
#define ROUND_F32(x) (x)
#define LOAD_BF16(p) bf16_to_f32(p)
#define STORE_BF16(x) f32_to_bf16(x)
#define ROUND_BF16(x) bf16_to_f32(f32_to_bf16(x))

/* PyTorch's order: normed = (x * rsqrt(mean(x^2) + eps)) rounded to the storage type, then
 * weight * normed rounded again. */
#define DEFINE_NORM(SUFFIX, T, LOAD, STORE, ROUND)                                               \
  void add_rms_norm_##SUFFIX(T *x, T *residual, const T *weight, int64_t num_tokens,             \
                             int64_t hidden, float eps) {                                        \
    _Pragma("omp parallel for schedule(static) if(num_tokens * hidden >= MIN_PARALLEL_ELEMENTS)")\
    for (int64_t t = 0; t < num_tokens; t++) {                                                   \
      T *xr = x + t * hidden, *rr = residual + t * hidden;                                       \
      float sum_sq = 0.f;                                                                        \
      _Pragma("omp simd reduction(+:sum_sq)")                                                    \
      for (int64_t i = 0; i < hidden; i++) {                                                     \
        const float r = ROUND(LOAD(xr[i]) + LOAD(rr[i]));                                        \
        rr[i] = STORE(r);                                                                        \
        sum_sq += r * r;                                                                         \
      }                                                                                          \
      const float inv_rms = 1.f / sqrtf(sum_sq / (float)hidden + eps);                          \
      _Pragma("omp simd")                                                                        \
      for (int64_t i = 0; i < hidden; i++)                                                       \
        xr[i] = STORE(LOAD(weight[i]) * ROUND(LOAD(rr[i]) * inv_rms));                           \
    }                                                                                            \
  }                                                                                              \
                                                                                                 \
  void rms_norm_##SUFFIX(const T *x, T *out, const T *weight, int64_t num_tokens, int64_t hidden,\
                         float eps) {                                                            \
    _Pragma("omp parallel for schedule(static) if(num_tokens * hidden >= MIN_PARALLEL_ELEMENTS)")\
    for (int64_t t = 0; t < num_tokens; t++) {                                                   \
      const T *xr = x + t * hidden;                                                              \
      T *o = out + t * hidden;                                                                   \
      float sum_sq = 0.f;                                                                        \
      _Pragma("omp simd reduction(+:sum_sq)")                                                    \
      for (int64_t i = 0; i < hidden; i++) sum_sq += LOAD(xr[i]) * LOAD(xr[i]);                  \
      const float inv_rms = 1.f / sqrtf(sum_sq / (float)hidden + eps);                           \
      _Pragma("omp simd")                                                                        \
      for (int64_t i = 0; i < hidden; i++) o[i] = STORE(LOAD(weight[i]) * ROUND(LOAD(xr[i]) * inv_rms)); \
    }                                                                                            \
  }

/* bfloat16 rows on 16 lanes (the generic loops above convert a value at a time): the same
 * roundings in the same order, the sum of squares in 16 partial sums. */
static inline float add_residual_bf16(const uint16_t *x, uint16_t *residual, int64_t hidden) {
  v16f sum16 = {0};
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16) {
    const v16f r = round_bf16_ftz16(load_bf1616(x + i) + load_bf1616(residual + i));
    store_bf16_ftz16(residual + i, r);
    sum16 += r * r;
  }
  float sum_sq = hsum16(sum16);
  for (; i < hidden; i++) {
    const float r = ROUND_BF16(LOAD_BF16(x[i]) + LOAD_BF16(residual[i]));
    residual[i] = STORE_BF16(r);
    sum_sq += r * r;
  }
  return sum_sq;
}

static inline float sum_squares_bf16(const uint16_t *x, int64_t hidden) {
  v16f sum16 = {0};
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16) {
    const v16f v = load_bf1616(x + i);
    sum16 += v * v;
  }
  float sum_sq = hsum16(sum16);
  for (; i < hidden; i++) sum_sq += LOAD_BF16(x[i]) * LOAD_BF16(x[i]);
  return sum_sq;
}

static inline void scale_row_bf16(const uint16_t *x, uint16_t *out, const uint16_t *weight, int64_t hidden,
                                  float inv_rms) {
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16)
    store_bf16_ftz16(out + i, load_bf1616(weight + i) * round_bf16_ftz16(load_bf1616(x + i) * inv_rms));
  for (; i < hidden; i++) out[i] = STORE_BF16(LOAD_BF16(weight[i]) * ROUND_BF16(LOAD_BF16(x[i]) * inv_rms));
}

void add_rms_norm_bf16(uint16_t *x, uint16_t *residual, const uint16_t *weight, int64_t num_tokens, int64_t hidden,
                       float eps) {
#pragma omp parallel for schedule(static) if (num_tokens * hidden >= MIN_PARALLEL_ELEMENTS)
  for (int64_t t = 0; t < num_tokens; t++) {
    uint16_t *xr = x + t * hidden, *rr = residual + t * hidden;
    const float sum_sq = add_residual_bf16(xr, rr, hidden);
    scale_row_bf16(rr, xr, weight, hidden, 1.f / sqrtf(sum_sq / (float)hidden + eps));
  }
}

void rms_norm_bf16(const uint16_t *x, uint16_t *out, const uint16_t *weight, int64_t num_tokens, int64_t hidden,
                   float eps) {
#pragma omp parallel for schedule(static) if (num_tokens * hidden >= MIN_PARALLEL_ELEMENTS)
  for (int64_t t = 0; t < num_tokens; t++) {
    const float sum_sq = sum_squares_bf16(x + t * hidden, hidden);
    scale_row_bf16(x + t * hidden, out + t * hidden, weight, hidden, 1.f / sqrtf(sum_sq / (float)hidden + eps));
  }
}

/* silu(g) = g * sigmoid(g), with e^-|g| from exp_nonpositive so no exponent can overflow;
 * rounded to the storage type before the product, as PyTorch does. 8 and 16 lanes: the 16-lane
 * loop takes the rows (half the instructions on AVX-512), the 8-lane one a row's tail. */
#define DEFINE_SILU_VECTOR(NAME, VF, VI, EXP)                                                    \
  static inline VF NAME(VF g) {                                                                  \
    const VI negative = g < 0.0f;                                                                \
    VF minus_abs = g;                                                                            \
    VI bits;                                                                                     \
    memcpy(&bits, &minus_abs, sizeof bits);                                                      \
    bits |= (VI){0} + (int32_t)0x80000000; /* -|g| */                                            \
    memcpy(&minus_abs, &bits, sizeof bits);                                                      \
    const VF e = EXP(minus_abs);                                                                 \
    const VF positive_sigmoid = 1.0f / (1.0f + e), negative_sigmoid = e * positive_sigmoid; /* one division */ \
    VI ps, ns;                                                                                   \
    memcpy(&ps, &positive_sigmoid, sizeof ps);                                                   \
    memcpy(&ns, &negative_sigmoid, sizeof ns);                                                   \
    const VI far = g < -87.0f; /* e clamped at e^-87: g e would not underflow; PyTorch gives -0 */ \
    const VI si = ((ps & ~negative) | (ns & negative)) & ~far;                                   \
    VF sigmoid;                                                                                  \
    memcpy(&sigmoid, &si, sizeof sigmoid);                                                       \
    return g * sigmoid;                                                                          \
  }

DEFINE_SILU_VECTOR(silu8, v8f, v8i, exp_nonpositive)
DEFINE_SILU_VECTOR(silu16, v16f, v16i, exp_nonpositive16)

/* 1 where this build rounds bfloat16 SiLU rows with VCVTNEPS2BF16 (1.3-1.5x PyTorch's op on a Zen 4),
 * 0 where it takes the integer rounding (level with PyTorch there). */
int silu_and_mul_bf16_native(void) { return BF16_ROUND_NATIVE; }

/* SILU16(gate) is the 16 gates' SiLU rounded to the storage type. */
#define DEFINE_SILU(SUFFIX, T, LOAD, STORE, ROUND, LOAD8, STORE8, ROUND8, LOAD16, STORE16, SILU16)   \
  void silu_and_mul_##SUFFIX(const T *x, T *out, int64_t num_tokens, int64_t n) {                \
    _Pragma("omp parallel for schedule(static) if(num_tokens * n >= MIN_PARALLEL_ELEMENTS)")     \
    for (int64_t t = 0; t < num_tokens; t++) {                                                   \
      const T *gate = x + t * 2 * n, *up = gate + n;                                             \
      T *o = out + t * n;                                                                        \
      int64_t i = 0;                                                                             \
      for (; i + 16 <= n; i += 16)                                                               \
        STORE16(o + i, SILU16(gate + i) * LOAD16(up + i)); /* the store rounds */                \
      for (; i + 8 <= n; i += 8)                                                                 \
        STORE8(o + i, ROUND8(silu8(LOAD8(gate + i))) * LOAD8(up + i));                             \
      for (; i < n; i++) {                                                                       \
        const float g = LOAD(gate[i]);                                                           \
        o[i] = STORE(ROUND(g / (1.f + expf(-g))) * LOAD(up[i]));                                 \
      }                                                                                          \
    }                                                                                            \
  }

#define SILU16_F32(p) silu16(load_f3216(p))

static inline v16f silu_rounded_bf1616(const uint16_t *gates) { return round_bf16_ftz16(silu16(load_bf1616(gates))); }

/* A bfloat16 gate takes one of 65,536 values, so where the build has AVX-512 gathers the 16-lane
 * loop looks each gate's rounded SiLU up in a table (128 KB, filled once by the same vector code
 * when the library loads) instead of computing it: the same bits, 2.3-2.7x faster (2,048 rows x
 * 1,536: 874 -> 383 us; 29 rows: 13.8 -> 5.8 us; a 2-core Xeon with AMX). The exponential and
 * the division cost more than the reads. */
#if defined(__AVX512F__)
#include <immintrin.h>

static uint16_t silu_bf16_table[65536 + 2]; /* + 2: a gather reads 4 bytes at 2 * gate */

__attribute__((constructor)) static void fill_silu_bf16_table(void) {
  for (int first = 0; first < 65536; first += 16) {
    uint16_t gates[16];
    for (int j = 0; j < 16; j++) gates[j] = (uint16_t)(first + j);
    store_bf16_ftz16(silu_bf16_table + first, silu_rounded_bf1616(gates)); /* already a bfloat16 value */
  }
}

static inline v16f silu_from_table16(const uint16_t *gates) {
  const __m512i index = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)gates));
  const __m512i bits = _mm512_slli_epi32(_mm512_i32gather_epi32(index, (const void *)silu_bf16_table, 2), 16);
  v16f v;
  memcpy(&v, &bits, sizeof v);
  return v;
}
#define SILU16_BF16(p) silu_from_table16(p)
#else
#define SILU16_BF16(p) silu_rounded_bf1616(p)
#endif

/* qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]: q and k heads rotated in place by
 * cos/sin [num_tokens, head_dim / 2] in PyTorch's order (x1 * cos - x2 * sin and x2 * cos + x1 * sin,
 * each product and the sum rounded to the storage type), then k and v copied into key_cache and
 * value_cache [num_slots, num_kv_heads * head_dim] at slots[t] (not when slots is NULL). */
#define DEFINE_ROPE_CACHE(SUFFIX, T, LOAD, STORE, ROUND)                                         \
  EXACT_PRODUCTS_ATTR void rope_cache_##SUFFIX(                                                 \
      T *qkv, const T *cos, const T *sin, const int64_t *slots, T *key_cache, T *value_cache,    \
      int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {           \
    EXACT_PRODUCTS                                                                               \
    const int64_t half = head_dim / 2, kv_width = num_kv_heads * head_dim;                       \
    const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;                             \
    _Pragma("omp parallel for schedule(static) if(num_tokens * width >= MIN_PARALLEL_ELEMENTS)") \
    for (int64_t t = 0; t < num_tokens; t++) {                                                   \
      T *row = qkv + t * width;                                                                  \
      const T *c = cos + t * half, *s = sin + t * half;                                          \
      for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {                                   \
        T *x = row + h * head_dim;                                                               \
        _Pragma("omp simd")                                                                      \
        for (int64_t i = 0; i < half; i++) {                                                     \
          const float x1 = LOAD(x[i]), x2 = LOAD(x[i + half]), ci = LOAD(c[i]), si = LOAD(s[i]); \
          x[i] = STORE(ROUND(x1 * ci) - ROUND(x2 * si));                                         \
          x[i + half] = STORE(ROUND(x2 * ci) + ROUND(x1 * si));                                  \
        }                                                                                        \
      }                                                                                          \
      if (!slots) continue; /* rotation only: a cache of another dtype has a writer of its own */ \
      const T *k = row + num_heads * head_dim;                                                   \
      memcpy(key_cache + slots[t] * kv_width, k, sizeof(T) * kv_width);                          \
      memcpy(value_cache + slots[t] * kv_width, k + kv_width, sizeof(T) * kv_width);             \
    }                                                                                            \
  }

DEFINE_NORM(f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_SILU(f32, float, LOAD_F32, STORE_F32, ROUND_F32, load_f32, store_f32, identity, load_f3216, store_f3216,
            SILU16_F32)
DEFINE_SILU(bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16, load_bf16, store_bf16, round_bf16, load_bf1616,
            store_bf16_ftz16, SILU16_BF16)
DEFINE_ROPE_CACHE(f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_ROPE_CACHE(bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)
