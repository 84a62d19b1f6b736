/* The int8 row quantizers: W8A8's activations (w8a8.c, gemm_int8_tiles.c), symmetric, matching
 * the PyTorch reference `quantize_int8_rows`, and the int8 KV cache's rows (kv_int8.c), about each
 * row's midpoint (below). The symmetric rule: in
 * float32, q = rint(x * (127 / amax)) (nearest even), clamped to [-127, 127], a NaN to 0;
 * scale = amax / 127, and a row of zeros gets scale 0. */
#ifndef SPINDLE_INT8_QUANT_H
#define SPINDLE_INT8_QUANT_H

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vec.h"

#define INT8_QUANT_LOAD_F32(x) (x)
#define INT8_QUANT_LOAD_BF16(x) bf16_to_f32(x)

/* quantize_row_int8_f32 / _bf16(x, k, q, scale): one row of k values. */
#define DEFINE_QUANTIZE_ROW(SUFFIX, T, LOAD)                                                      \
  static inline void quantize_row_int8_##SUFFIX(const T *x, int64_t k, int8_t *q, float *scale) { \
    float amax = 0.f;                                                                           \
    _Pragma("omp simd reduction(max : amax)")                                                   \
    for (int64_t i = 0; i < k; i++) {                                                           \
      const float a = fabsf(LOAD(x[i]));                                                        \
      amax = a > amax ? a : amax;                                                               \
    }                                                                                           \
    const float inv = amax > 0.f ? 127.f / amax : 0.f;                                          \
    _Pragma("omp simd")                                                                         \
    for (int64_t i = 0; i < k; i++) {                                                           \
      float v = rintf(LOAD(x[i]) * inv);                                                        \
      v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;                                          \
      q[i] = v == v ? (int8_t)v : 0; /* a NaN input must not reach the cast */                  \
    }                                                                                           \
    *scale = amax / 127.f;                                                                      \
  }

DEFINE_QUANTIZE_ROW(f32, float, INT8_QUANT_LOAD_F32)
DEFINE_QUANTIZE_ROW(bf16, uint16_t, INT8_QUANT_LOAD_BF16)

/* x as PyTorch's nan_to_num leaves it: NaN 0, an infinity the largest finite value of its sign. */
static inline float int8_quant_finite(float x) {
  return x != x ? 0.f : x > FLT_MAX ? FLT_MAX : x < -FLT_MAX ? -FLT_MAX : x;
}

/* quantize_row_centered_f32 / _bf16(x, k, q, scale, mid): the KV cache's row rule (kv_int8.c),
 * int8 about the row's midpoint, which spends all 255 levels on [min, max] where a symmetric
 * rule wastes up to half of them on a one-sided row. In float32, after int8_quant_finite: half =
 * max * 0.5 - min * 0.5 (no overflow), mid = min + half, q = rint((x - mid) * (127 / half))
 * clamped to [-127, 127], scale = half / 127; a constant row gets q 0, scale 0, mid its value.
 * x = mid + q * scale, to within scale / 2. The PyTorch reference (`quantize_kv_rows`) takes the
 * same steps. */
#define DEFINE_QUANTIZE_CENTERED(SUFFIX, T, LOAD)                                                           \
  static inline void quantize_row_centered_scalar_##SUFFIX(const T *x, int64_t k, int8_t *q, float *scale,  \
                                                           float *mid) {                                    \
    float lo = FLT_MAX, hi = -FLT_MAX;                                                                      \
    for (int64_t i = 0; i < k; i++) {                                                                       \
      const float v = int8_quant_finite(LOAD(x[i]));                                                        \
      lo = v < lo ? v : lo;                                                                                 \
      hi = v > hi ? v : hi;                                                                                 \
    }                                                                                                       \
    if (k <= 0) lo = hi = 0.f;                                                                              \
    const float half = hi * 0.5f - lo * 0.5f, center = lo + half;                                           \
    const float inv = half > 0.f ? 127.f / half : 0.f;                                                      \
    for (int64_t i = 0; i < k; i++) {                                                                       \
      float v = rintf((int8_quant_finite(LOAD(x[i])) - center) * inv);                                      \
      v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;                                                      \
      q[i] = (int8_t)v;                                                                                     \
    }                                                                                                       \
    *scale = half / 127.f;                                                                                  \
    *mid = center;                                                                                          \
  }


DEFINE_QUANTIZE_CENTERED(f32, float, INT8_QUANT_LOAD_F32)
DEFINE_QUANTIZE_CENTERED(bf16, uint16_t, INT8_QUANT_LOAD_BF16)

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* The same rule on 16 lanes, for rows of a multiple of 16 up to 256 values: the KV writer's rows
 * (a 2,048-token prefill writes 12,288 rows a layer for SmolLM2-135M, which the scalar loops
 * took 0.7 ms for on two threads). Every operation is the scalar one's in float32: min and max
 * are exact in any order, then (x - mid) * inv, nearest-even rounding and the clamp per lane, so
 * the rows agree bit for bit (a zero minimum or maximum, whose sign the scalar loop takes from the
 * first zero it meets, goes to the scalar loop). */
#define DEFINE_QUANTIZE_CENTERED16(SUFFIX, T, LOAD16)                                                       \
  static inline void quantize_row_centered16_##SUFFIX(const T *x, int64_t k, int8_t *q, float *scale,       \
                                                      float *mid) {                                         \
    __m512 v[16];                                                                                           \
    __m512 lo16 = _mm512_set1_ps(FLT_MAX), hi16 = _mm512_set1_ps(-FLT_MAX);                                 \
    const __m512 top = _mm512_set1_ps(FLT_MAX), bottom = _mm512_set1_ps(-FLT_MAX);                          \
    const int n = (int)(k / 16);                                                                            \
    for (int c = 0; c < n; c++) {                                                                           \
      __m512 a = LOAD16(x + 16 * c);                                                                        \
      a = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), a); /* NaN -> 0 */                     \
      a = _mm512_min_ps(_mm512_max_ps(a, bottom), top);                 /* +-inf -> +-FLT_MAX */            \
      v[c] = a;                                                                                             \
      lo16 = _mm512_min_ps(lo16, a);                                                                        \
      hi16 = _mm512_max_ps(hi16, a);                                                                        \
    }                                                                                                       \
    const float lo = _mm512_reduce_min_ps(lo16), hi = _mm512_reduce_max_ps(hi16);                           \
    if (lo == 0.f || hi == 0.f) { /* a zero bound: its sign, and the scale's, follow the loop order */   \
      quantize_row_centered_scalar_##SUFFIX(x, k, q, scale, mid);                                           \
      return;                                                                                               \
    }                                                                                                       \
    const float half = hi * 0.5f - lo * 0.5f, center = lo + half;                                           \
    const float inv = half > 0.f ? 127.f / half : 0.f;                                                      \
    const __m512 center16 = _mm512_set1_ps(center), inv16 = _mm512_set1_ps(inv);                            \
    const __m512 limit = _mm512_set1_ps(127.f), neg_limit = _mm512_set1_ps(-127.f);                         \
    for (int c = 0; c < n; c++) {                                                                           \
      __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v[c], center16), inv16),                  \
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                        \
      r = _mm512_min_ps(_mm512_max_ps(r, neg_limit), limit);                                                \
      _mm_storeu_si128((__m128i *)(q + 16 * c), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));               \
    }                                                                                                       \
    *scale = half / 127.f;                                                                                  \
    *mid = center;                                                                                          \
  }

#define INT8_QUANT_LOAD16_F32(x) ((__m512)load_f3216(x))
#define INT8_QUANT_LOAD16_BF16(x) ((__m512)load_bf1616(x))
DEFINE_QUANTIZE_CENTERED16(f32, float, INT8_QUANT_LOAD16_F32)
DEFINE_QUANTIZE_CENTERED16(bf16, uint16_t, INT8_QUANT_LOAD16_BF16)
#define INT8_QUANT_HAS_16_LANES 1

/* The symmetric rule on 16 lanes for rows of a multiple of 16 up to 256 values (W8A8's activation
 * groups of 32), returning the sum of q as well. quantize_row_int8_bf16 left a group of 32 to the
 * auto-vectorizer and summed q in a second pass: about 4 cycles a value, 11% of a W8A8 c=32 replay.
 * Bit for bit the scalar rule: |x| maxima are exact in any order and skip a NaN as the scalar
 * comparison does (VMAXPS returns its second operand when the first is NaN), inv is the same
 * float32 division, then x * inv, nearest-even rounding, NaN -> 0 and the clamp per lane. */
static inline int32_t quantize_row_int8_16_bf16(const uint16_t *x, int64_t k, int8_t *q, float *scale) {
  __m512 v[16];
  __m512 amax16 = _mm512_setzero_ps();
  const int n = (int)(k / 16);
  for (int c = 0; c < n; c++) {
    v[c] = (__m512)load_bf1616(x + 16 * c);
    amax16 = _mm512_max_ps(_mm512_abs_ps(v[c]), amax16);
  }
  const float amax = _mm512_reduce_max_ps(amax16);
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 inv16 = _mm512_set1_ps(inv), limit = _mm512_set1_ps(127.f), neg_limit = _mm512_set1_ps(-127.f);
  __m512i sum16 = _mm512_setzero_si512();
  for (int c = 0; c < n; c++) {
    __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[c], inv16), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), r); /* NaN -> 0 */
    r = _mm512_min_ps(_mm512_max_ps(r, neg_limit), limit);
    const __m512i qi = _mm512_cvtps_epi32(r);
    sum16 = _mm512_add_epi32(sum16, qi);
    _mm_storeu_si128((__m128i *)(q + 16 * c), _mm512_cvtepi32_epi8(qi));
  }
  *scale = amax / 127.f;
  return _mm512_reduce_add_epi32(sum16);
}
#else
#define INT8_QUANT_HAS_16_LANES 0
#endif

/* Whether the 16-lane rules take a row of k values: they hold it in 16 registers. */
static inline int int8_quant_fits_16_lanes(int64_t k) { return k > 0 && k % 16 == 0 && k <= 256; }

/* quantize_row_int8_bf16 returning the sum of q: the 16-lane rule where the row fits it. */
static inline int32_t quantize_row_int8_sum_bf16(const uint16_t *x, int64_t k, int8_t *q, float *scale) {
#if INT8_QUANT_HAS_16_LANES
  if (int8_quant_fits_16_lanes(k)) return quantize_row_int8_16_bf16(x, k, q, scale);
#endif
  quantize_row_int8_bf16(x, k, q, scale);
  int32_t sum = 0;
  for (int64_t i = 0; i < k; i++) sum += q[i];
  return sum;
}

/* quantize_row_centered_f32 / _bf16: the 16-lane rule where the row fits it, else the scalar one. */
static inline void quantize_row_centered_f32(const float *x, int64_t k, int8_t *q, float *scale, float *mid) {
#if INT8_QUANT_HAS_16_LANES
  if (int8_quant_fits_16_lanes(k)) {
    quantize_row_centered16_f32(x, k, q, scale, mid);
    return;
  }
#endif
  quantize_row_centered_scalar_f32(x, k, q, scale, mid);
}
static inline void quantize_row_centered_bf16(const uint16_t *x, int64_t k, int8_t *q, float *scale, float *mid) {
#if INT8_QUANT_HAS_16_LANES
  if (int8_quant_fits_16_lanes(k)) {
    quantize_row_centered16_bf16(x, k, q, scale, mid);
    return;
  }
#endif
  quantize_row_centered_scalar_bf16(x, k, q, scale, mid);
}

#define INT8_QUANT_STORE_F32(x) (x)
#define INT8_QUANT_STORE_BF16(x) f32_to_bf16(x)

/* dequantize_row_int32_f32 / _bf16(acc, x_scale, w_scales, bias, y, n): one row of a W8A8 matmul's
 * int32 sums, y[c] = acc[c] * (x_scale * w_scales[c]) (+ bias[c]) in float32, rounded once to y's
 * dtype; shared by w8a8.c's pass after oneDNN and gemm_int8_tiles.c's, so both round alike. */
#define DEFINE_DEQUANTIZE_ROW(SUFFIX, T, LOAD, STORE)                                                  \
  static inline void dequantize_row_int32_##SUFFIX(const int32_t *acc, float xs, const float *w_scales, \
                                                   const T *bias, T *y, int64_t n) {                   \
    if (bias == NULL) {                                                                               \
      _Pragma("omp simd")                                                                             \
      for (int64_t c = 0; c < n; c++) y[c] = STORE((float)acc[c] * (xs * w_scales[c]));               \
    } else {                                                                                          \
      _Pragma("omp simd")                                                                             \
      for (int64_t c = 0; c < n; c++) y[c] = STORE((float)acc[c] * (xs * w_scales[c]) + LOAD(bias[c])); \
    }                                                                                                 \
  }

DEFINE_DEQUANTIZE_ROW(f32, float, INT8_QUANT_LOAD_F32, INT8_QUANT_STORE_F32)
DEFINE_DEQUANTIZE_ROW(bf16, uint16_t, INT8_QUANT_LOAD_BF16, INT8_QUANT_STORE_BF16)

#endif
