/* W8A8's activation groups (gemm_int8_tiles.c), a row at a time: int8_quant.h's symmetric rule per
 * group, for 16 groups at once. Quantized one group at a time (quantize_row_int8_16_bf16), a group
 * of 32 took about 1.4 cycles a value on a Zen 4, most of it in the two horizontal reductions a
 * group needs (its |x| maximum, and the sum of its q) and the two float32 divisions between them,
 * a chain of dependent steps per group. Here each group's maximum and sum stay in a register of
 * 16 lanes until 16 groups have them, one tree of lane shuffles reduces all 16 at once (46
 * operations, about 3 a group), and the divisions run on 16 lanes.
 *
 * Bit for bit the per-group rule: |x| maxima and integer sums are exact in any order (a NaN is
 * skipped: VMAXPS returns its second operand, the maximum so far, when the first is NaN), the
 * scales and inverses are the same float32 divisions, q = rint(x * inv) with a NaN 0, clamped to
 * +-127 (only an infinite inverse, from a maximum below 127 / FLT_MAX, can take x * inv past 127.5,
 * so only then the clamp runs); q_sum adds scale_g * sum_g in group order by fmaf, as
 * gemm_int8_tiles.c's loop for the groups this does not take. */
#ifndef SPINDLE_INT8_GROUPS_H
#define SPINDLE_INT8_GROUPS_H

#include <float.h>
#include <stdint.h>

#include "int8_quant.h"

#if INT8_QUANT_HAS_16_LANES
#define INT8_GROUPS_HAS_16_LANES 1

/* Lane g of the result: the maximum (float) or the sum (int32) of v[g]'s 16 lanes. Two 512-bit
 * rows of partial results are folded into one at each level (16 -> 8 -> 4 -> 2 -> 1 rows, each
 * group's partials halving), and a last permutation puts the groups in order. */
#define DEFINE_REDUCE16(NAME, T, OP, SHUFFLE4, UNPACKLO, UNPACKHI, PERMUTE)                   \
  static inline T NAME(const T v[16]) {                                                     \
    T a[8], b[4], c[2];                                                                     \
    for (int i = 0; i < 8; i++) /* halves of two groups: [g, g, h, h] */                    \
      a[i] = OP(SHUFFLE4(v[2 * i], v[2 * i + 1], 0x44), SHUFFLE4(v[2 * i], v[2 * i + 1], 0xEE)); \
    for (int i = 0; i < 4; i++) /* a quarter of four groups: [g, h, i, j] */                \
      b[i] = OP(SHUFFLE4(a[2 * i], a[2 * i + 1], 0x88), SHUFFLE4(a[2 * i], a[2 * i + 1], 0xDD)); \
    for (int i = 0; i < 2; i++) /* 128-bit lane l: groups l, 4 + l of b[2i], b[2i + 1], twice */ \
      c[i] = OP(UNPACKLO(b[2 * i], b[2 * i + 1]), UNPACKHI(b[2 * i], b[2 * i + 1]));        \
    const T d = OP(UNPACKLO(c[0], c[1]), UNPACKHI(c[0], c[1])); /* lane 4l + j: l, 8+l, 4+l, 12+l */ \
    return PERMUTE(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15), d); \
  }

DEFINE_REDUCE16(reduce16_max_ps, __m512, _mm512_max_ps, _mm512_shuffle_f32x4, _mm512_unpacklo_ps,
                _mm512_unpackhi_ps, _mm512_permutexvar_ps)
DEFINE_REDUCE16(reduce16_add_epi32, __m512i, _mm512_add_epi32, _mm512_shuffle_i32x4, _mm512_unpacklo_epi32,
                _mm512_unpackhi_epi32, _mm512_permutexvar_epi32)

/* Groups [0, num_groups) (at most 16) of group_size values (a multiple of 16, at most 256) at x:
 * q and scales out, and each group's summed q in sums. */
static inline void quantize_groups16_bf16(const uint16_t *x, int num_groups, int64_t group_size, int8_t *q,
                                          float *scales, int32_t sums[16]) {
  const int per_group = (int)(group_size / 16);
  const __m512 zero = _mm512_setzero_ps();
  __m512 amax[16];
  for (int g = 0; g < 16; g++) {
    __m512 m = zero; /* the maximum so far, second: a NaN |x| leaves it as it is */
    for (int j = 0; g < num_groups && j < per_group; j++)
      m = _mm512_max_ps(_mm512_abs_ps((__m512)load_bf1616(x + g * group_size + 16 * j)), m);
    amax[g] = m;
  }
  const __m512 amax16 = reduce16_max_ps(amax);
  const __m512 limit = _mm512_set1_ps(127.f), neg_limit = _mm512_set1_ps(-127.f);
  const __m512 inv16 = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax16, zero, _CMP_GT_OQ), limit, amax16);
  _mm512_mask_storeu_ps(scales, (__mmask16)((1u << num_groups) - 1), _mm512_div_ps(amax16, limit));
  const int clamp = _mm512_cmp_ps_mask(inv16, _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ) != 0xFFFF;
  float inv[16];
  _mm512_storeu_ps(inv, inv16);
  __m512i group_sums[16];
  for (int g = 0; g < 16; g++) {
    __m512i sum = _mm512_setzero_si512();
    const __m512 inv_g = _mm512_set1_ps(inv[g]);
    for (int j = 0; g < num_groups && j < per_group; j++) {
      const int64_t i = g * group_size + 16 * j;
      __m512 r = _mm512_mul_ps((__m512)load_bf1616(x + i), inv_g);
      const __mmask16 ordered = _mm512_cmp_ps_mask(r, r, _CMP_ORD_Q);
      if (clamp) r = _mm512_min_ps(_mm512_max_ps(r, neg_limit), limit);
      const __m512i qi = _mm512_maskz_cvt_roundps_epi32(ordered, r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      sum = _mm512_add_epi32(sum, qi);
      _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(qi));
    }
    group_sums[g] = sum;
  }
  _mm512_storeu_si512(sums, reduce16_add_epi32(group_sums));
}

/* Rows [0, num_rows) of k values at x, contiguous, where int8_groups_fit_16_lanes(k, group_size):
 * q [num_rows][k], scales [num_rows][k / group_size], each row's summed q (row_sums) and q_sums =
 * sum_g scale_g sum(q in g), by fmaf in group order. A row's groups and the next row's are one
 * sequence, cut every 16 groups, so rows of 18 groups of 32 (SmolLM2's 576) fill whole trees. */
static inline void quantize_rows_groups16_bf16(const uint16_t *x, int64_t num_rows, int64_t k, int64_t group_size,
                                               int8_t *q, float *scales, int32_t *row_sums, float *q_sums) {
  const int64_t num_groups = k / group_size, total = num_rows * num_groups;
  int64_t r = 0, g = 0; /* the row and group of the next group taken */
  int32_t row_sum = 0;
  float q_sum = 0.f;
  for (int64_t f0 = 0; f0 < total; f0 += 16) {
    const int n = total - f0 < 16 ? (int)(total - f0) : 16;
    int32_t sums[16];
    quantize_groups16_bf16(x + f0 * group_size, n, group_size, q + f0 * group_size, scales + f0, sums);
    for (int i = 0; i < n; i++) {
      row_sum += sums[i];
      q_sum = fmaf(scales[f0 + i], (float)sums[i], q_sum);
      if (++g == num_groups) {
        row_sums[r] = row_sum, q_sums[r] = q_sum;
        row_sum = 0, q_sum = 0.f, g = 0, r++;
      }
    }
  }
}
#else
#define INT8_GROUPS_HAS_16_LANES 0
#endif

/* Whether quantize_rows_groups16_bf16 takes rows of k values in groups of group_size: whole groups
 * of a multiple of 16 values, at most 64 (larger groups amortize their own reductions: at 256 the
 * tree ran 1.4x slower than a group at a time). */
static inline int int8_groups_fit_16_lanes(int64_t k, int64_t group_size) {
  return INT8_GROUPS_HAS_16_LANES && group_size <= 64 && int8_quant_fits_16_lanes(group_size) && k % group_size == 0;
}

#endif
