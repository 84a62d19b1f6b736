/* The two ends of a W8A8 matmul (`--quantization w8a8`, layers/w8a8.py): activations quantized per
 * row to int8 before PyTorch's int8 GEMM (`torch._int_mm`, oneDNN on VNNI/AMX), and its int32 sums
 * scaled back afterwards. Both are one pass over their rows; done as PyTorch ops they took about as
 * long as the int8 GEMM itself at 32-64 rows.
 *
 * quantize_rows_int8_*: x [m, k] rows `x_stride` elements apart, float32 or bfloat16 (raw uint16),
 *   -> q [m, k] int8 in [-127, 127] and scales [m] float32, as the int8 KV cache quantizes its rows
 *   (csrc/kv_int8.c): in float32, q = rint(x * (127 / amax)) (nearest even), clamped, a NaN to 0,
 *   scale = amax / 127; a row of zeros gets scale 0.
 * dequantize_int32_*: y [m, n] = acc [m, n] * (x_scales[m] * w_scales[n]) (+ bias [n]) in float32,
 *   rounded once to y's dtype (bfloat16 to nearest even); bias may be NULL. */
#include <math.h>
#include <stdint.h>

#include "vec.h"

#define MIN_PARALLEL_ELEMENTS 32768 /* below this a thread team costs more than it saves */

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define STORE_F32(x) (x)
#define STORE_BF16(x) f32_to_bf16(x)

#define DEFINE_QUANTIZE(SUFFIX, T, LOAD)                                                              \
  int quantize_rows_int8_##SUFFIX(const T *x, int64_t x_stride, int8_t *q, float *scales, int64_t m, \
                                  int64_t k) {                                                       \
    _Pragma("omp parallel for schedule(static) if (m * k >= MIN_PARALLEL_ELEMENTS)")                \
    for (int64_t r = 0; r < m; r++) {                                                              \
      const T *xr = x + r * x_stride;                                                              \
      int8_t *qr = q + r * k;                                                                      \
      float amax = 0.f;                                                                            \
      _Pragma("omp simd reduction(max : amax)")                                                    \
      for (int64_t i = 0; i < k; i++) {                                                            \
        const float a = fabsf(LOAD(xr[i]));                                                        \
        amax = a > amax ? a : amax;                                                                \
      }                                                                                            \
      const float inv = amax > 0.f ? 127.f / amax : 0.f;                                           \
      _Pragma("omp simd")                                                                          \
      for (int64_t i = 0; i < k; i++) {                                                            \
        float v = rintf(LOAD(xr[i]) * inv);                                                        \
        v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;                                           \
        qr[i] = v == v ? (int8_t)v : 0; /* a NaN input must not reach the cast */                  \
      }                                                                                            \
      scales[r] = amax / 127.f;                                                                    \
    }                                                                                              \
    return 0;                                                                                      \
  }

DEFINE_QUANTIZE(f32, float, LOAD_F32)
DEFINE_QUANTIZE(bf16, uint16_t, LOAD_BF16)

#define DEFINE_DEQUANTIZE(SUFFIX, T, LOAD, STORE)                                                      \
  int dequantize_int32_##SUFFIX(const int32_t *acc, const float *x_scales, const float *w_scales,     \
                                const T *bias, T *y, int64_t m, int64_t n) {                          \
    _Pragma("omp parallel for schedule(static) if (m * n >= MIN_PARALLEL_ELEMENTS)")                  \
    for (int64_t r = 0; r < m; r++) {                                                                \
      const float xs = x_scales[r];                                                                  \
      const int32_t *a = acc + r * n;                                                                \
      T *yr = y + r * n;                                                                             \
      if (bias == NULL) {                                                                            \
        _Pragma("omp simd")                                                                          \
        for (int64_t c = 0; c < n; c++) yr[c] = STORE((float)a[c] * (xs * w_scales[c]));             \
      } else {                                                                                       \
        _Pragma("omp simd")                                                                          \
        for (int64_t c = 0; c < n; c++) yr[c] = STORE((float)a[c] * (xs * w_scales[c]) + LOAD(bias[c])); \
      }                                                                                              \
    }                                                                                                \
    return 0;                                                                                        \
  }

DEFINE_DEQUANTIZE(f32, float, LOAD_F32, STORE_F32)
DEFINE_DEQUANTIZE(bf16, uint16_t, LOAD_BF16, STORE_BF16)
