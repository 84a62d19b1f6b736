/* The two ends of a W8A8 matmul (`--quantization w8a8`, layers/w8a8.py): activations quantized per
 * row to int8 before PyTorch's int8 GEMM (`torch._int_mm`, oneDNN on VNNI/AMX), and its int32 sums
 * scaled back afterwards. Both are one pass over their rows; done as PyTorch ops they took about as
 * long as the int8 GEMM itself at 32-64 rows.
 *
 * quantize_rows_int8_*: x [m, k] rows `x_stride` elements apart, float32 or bfloat16 (raw uint16),
 *   -> q [m, k] int8 in [-127, 127] and scales [m] float32, by the int8 KV cache's row rule
 *   (int8_quant.h).
 * dequantize_int32_*: y [m, n] = acc [m, n] * (x_scales[m] * w_scales[n]) (+ bias [n]) in float32,
 *   rounded once to y's dtype (bfloat16 to nearest even); bias may be NULL (int8_quant.h's row). */
#include <stdint.h>

#include "int8_quant.h"
#include "vec.h"

#define MIN_PARALLEL_ELEMENTS 32768 /* below this a thread team costs more than it saves */

#define DEFINE_QUANTIZE(SUFFIX, T)                                                                    \
  int quantize_rows_int8_##SUFFIX(const T *x, int64_t x_stride, int8_t *q, float *scales, int64_t m, \
                                  int64_t k) {                                                       \
    _Pragma("omp parallel for schedule(static) if (m * k >= MIN_PARALLEL_ELEMENTS)")                \
    for (int64_t r = 0; r < m; r++)                                                                \
      quantize_row_int8_##SUFFIX(x + r * x_stride, k, q + r * k, scales + r);                      \
    return 0;                                                                                      \
  }

DEFINE_QUANTIZE(f32, float)
DEFINE_QUANTIZE(bf16, uint16_t)

#define DEFINE_DEQUANTIZE(SUFFIX, T)                                                                   \
  int dequantize_int32_##SUFFIX(const int32_t *acc, const float *x_scales, const float *w_scales,     \
                                const T *bias, T *y, int64_t m, int64_t n) {                          \
    _Pragma("omp parallel for schedule(static) if (m * n >= MIN_PARALLEL_ELEMENTS)")                  \
    for (int64_t r = 0; r < m; r++)                                                                  \
      dequantize_row_int32_##SUFFIX(acc + r * n, x_scales[r], w_scales, bias, y + r * n, n);         \
    return 0;                                                                                        \
  }

DEFINE_DEQUANTIZE(f32, float)
DEFINE_DEQUANTIZE(bf16, uint16_t)
