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
  static inline void quantize_row_centered_##SUFFIX(const T *x, int64_t k, int8_t *q, float *scale,         \
                                                    float *mid) {                                           \
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
