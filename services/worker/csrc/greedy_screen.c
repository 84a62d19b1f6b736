/* Greedy tokens from a bfloat16 LM head without reading all of it: the logits are first computed
 * on an int8 copy of the head (half the bytes; the caller does that), then only the tokens whose
 * logit could still be the row's bfloat16 maximum are computed again from the bfloat16 weight.
 * The token is what the full head's argmax gives (its first maximum), up to the order of the
 * float32 sums, as between the head's kernels at different row counts.
 *
 * Why exact: write the int8 copy's row as w_v - e_v. The approximate logit A_v (the int8 product,
 * rounded to bfloat16) is within m_v = |x| * bound_v + 2^-7 |A_v| of the float32 logit F_v the full
 * head computes: |x . e_v| <= |x| |e_v| (Cauchy-Schwarz), bound_v = |e_v| plus hidden * 2^-22
 * |w_v| for both float32 sums' rounding (each at most hidden * 2^-24 |x| |w_v|; the caller
 * computes bound_v), 2^-7 |A_v| for A's bfloat16 rounding. So F_v lies in [A_v - m_v,
 * A_v + m_v]. With T the largest lower end and H the largest upper end, a token whose upper end is
 * below T - gap, gap = 2^-6 max(|T|, |H|), has F_v at least two bfloat16 steps of the winner's
 * magnitude below the winner's F, so its rounded logit is strictly smaller: it can neither win nor
 * tie. Every other token is computed again (float32 sums of the bfloat16 products, rounded to
 * bfloat16) and the first maximum among them, in token order, is the answer.
 *
 * Where the int8 logits came from x quantized too, x_q (head_int8_amx.c), the bound adds that
 * error: |x . w_v - x_q . (w_v - e_v)| <= |x - x_q| |w_v| + |x_q| |e_v|, |x_q| <= |x| + |x - x_q|.
 *
 * In SmolLM2-135M's decode steps |x| |e_v| was about 5x the actual error and a row computed 2
 * tokens again at the median (4.2 on average over the 14,853 rows of a c=32 slice), so the second
 * pass costs little next to the head's 57 MB. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define MAX_ROUNDING 0.0078125f /* 2^-7: A_v's bfloat16 rounding, relative to A_v, with room */
#define GAP 0.015625f           /* 2^-6: two bfloat16 steps of the winner's magnitude */
#define SCREEN_BLOCK 256        /* tokens per block of the first pass's upper ends */

/* |x| of a bfloat16 row in float64, rounded up into float32; inf or NaN where x is not finite. */
static float row_norm(const uint16_t *x, int64_t hidden) {
  double s = 0.0;
  for (int64_t k = 0; k < hidden; k++) {
    const double v = bf16_to_f32(x[k]);
    s += v * v;
  }
  return (float)(sqrt(s) * (1.0 + 1e-6));
}

static float dot_bf16(const uint16_t *x, const uint16_t *w, int64_t hidden) {
  v16f acc = (v16f){0};
  int64_t k = 0;
  for (; k + 16 <= hidden; k += 16) acc += load_bf1616(x + k) * load_bf1616(w + k);
  float s = hsum16(acc);
  for (; k < hidden; k++) s += bf16_to_f32(x[k]) * bf16_to_f32(w[k]);
  return s;
}

/* Token v's margin m_v (its approximate logit a): n1 b1_v + n2 b2_v + 2^-7 |a|. */
typedef struct {
  float n1, n2;
  const float *b1, *b2;
} Margins;

static inline float margin(float a, const Margins *g, int64_t v) {
  return g->n1 * g->b1[v] + g->n2 * g->b2[v] + MAX_ROUNDING * fabsf(a);
}

/* The first pass: the largest lower end T (*lo) and each block's largest upper end (block_hi),
 * where a NaN approximate logit counts as an infinite upper end (the token is computed again). */
#if defined(__AVX512F__)
#include <immintrin.h>
static void bound_pass(const uint16_t *approx, const Margins *g, int64_t vocab, float *lo, float *block_hi) {
  const __m512 n1 = _mm512_set1_ps(g->n1), n2 = _mm512_set1_ps(g->n2), r = _mm512_set1_ps(MAX_ROUNDING);
  const __m512 inf = _mm512_set1_ps(INFINITY);
  __m512 lo_max = _mm512_set1_ps(-INFINITY);
  float lo_tail = -INFINITY;
  for (int64_t b0 = 0, b = 0; b0 < vocab; b0 += SCREEN_BLOCK, b++) {
    const int64_t end = b0 + SCREEN_BLOCK < vocab ? b0 + SCREEN_BLOCK : vocab;
    __m512 hi_max = _mm512_set1_ps(-INFINITY);
    int64_t v = b0;
    for (; v + 16 <= end; v += 16) {
      const __m512 a = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(approx + v))), 16));
      const __m512 rounding = _mm512_mul_ps(r, _mm512_abs_ps(a));
      const __m512 m = _mm512_fmadd_ps(n1, _mm512_loadu_ps(g->b1 + v),
                                       _mm512_fmadd_ps(n2, _mm512_loadu_ps(g->b2 + v), rounding));
      const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
      lo_max = _mm512_max_ps(lo_max, _mm512_sub_ps(a, m)); /* a NaN lane keeps lo_max's */
      hi_max = _mm512_max_ps(hi_max, _mm512_mask_mov_ps(_mm512_add_ps(a, m), nan, inf));
    }
    float hi = _mm512_reduce_max_ps(hi_max);
    for (; v < end; v++) {
      const float a = bf16_to_f32(approx[v]), m = margin(a, g, v);
      if (a != a) hi = INFINITY;
      lo_tail = a - m > lo_tail ? a - m : lo_tail;
      hi = a + m > hi ? a + m : hi;
    }
    block_hi[b] = hi;
  }
  const float lo_vec = _mm512_reduce_max_ps(lo_max);
  *lo = lo_vec > lo_tail ? lo_vec : lo_tail;
}
#else
static void bound_pass(const uint16_t *approx, const Margins *g, int64_t vocab, float *lo, float *block_hi) {
  float lo_max = -INFINITY;
  for (int64_t b0 = 0, b = 0; b0 < vocab; b0 += SCREEN_BLOCK, b++) {
    const int64_t end = b0 + SCREEN_BLOCK < vocab ? b0 + SCREEN_BLOCK : vocab;
    float hi = -INFINITY;
    for (int64_t v = b0; v < end; v++) {
      const float a = bf16_to_f32(approx[v]), m = margin(a, g, v);
      if (a != a) hi = INFINITY;
      lo_max = a - m > lo_max ? a - m : lo_max;
      hi = a + m > hi ? a + m : hi;
    }
    block_hi[b] = hi;
  }
  *lo = lo_max;
}
#endif

/* One row: returns the token, or -1 where x is not finite (the full head then decides: its
 * logits are NaN there). *num_candidates: the tokens computed again. */
static int64_t screen_row(const uint16_t *approx, const uint16_t *x, const uint16_t *weight, const float *bounds,
                          const float *weight_norms, float x_error, int64_t vocab, int64_t hidden,
                          int32_t *num_candidates) {
  const float norm = row_norm(x, hidden);
  *num_candidates = 0;
  if (!isfinite(norm) || !isfinite(x_error)) return -1;
  /* With x quantized too (xq): |x.w - xq.wq| <= |x - xq| |w| + |xq| |w - wq|, |xq| <= |x| + |x - xq|. */
  const Margins g = {(norm + x_error) * (1.f + 1e-6f), x_error, bounds, weight_norms ? weight_norms : bounds};
  const int64_t num_blocks = (vocab + SCREEN_BLOCK - 1) / SCREEN_BLOCK;
  float block_hi[num_blocks], t, h = -INFINITY;
  bound_pass(approx, &g, vocab, &t, block_hi);
  for (int64_t b = 0; b < num_blocks; b++) h = block_hi[b] > h ? block_hi[b] : h;
  /* An approximate logit overflowed (or all are NaN): let the full head decide. */
  if (!isfinite(t)) return -1;
  const float threshold = t - GAP * (fabsf(t) > fabsf(h) ? fabsf(t) : fabsf(h)); /* h may be inf: -inf */
  float best = -INFINITY;
  int64_t best_token = -1;
  int32_t count = 0;
  for (int64_t b = 0; b < num_blocks; b++) {
    if (block_hi[b] < threshold) continue; /* the whole block is out of reach */
    const int64_t end = (b + 1) * SCREEN_BLOCK < vocab ? (b + 1) * SCREEN_BLOCK : vocab;
    for (int64_t v = b * SCREEN_BLOCK; v < end; v++) {
      const float a = bf16_to_f32(approx[v]);
      if (a + margin(a, &g, v) < threshold) continue; /* NaN compares false: computed again */
      const float logit = bf16_to_f32(f32_to_bf16(dot_bf16(x, weight + v * hidden, hidden)));
      count++;
      if (best_token < 0 || logit > best) best = logit, best_token = v;
    }
  }
  *num_candidates = count;
  return best_token;
}

/* out[r]: row r's greedy token (-1: the full head must decide); num_candidates[r]: how many tokens
 * it computed again. approx [num_rows, vocab] bfloat16 (row stride approx_stride), x [num_rows,
 * hidden] bfloat16 (x_stride), weight [vocab, hidden] bfloat16, bounds [vocab] float32. Where the
 * approximate logits came from x quantized too (head_int8_amx.c): x_errors [num_rows], each row's
 * |x - its quantized x|, and weight_norms [vocab], each |w_v| rounded up; else both NULL. */
void greedy_screen_bf16(const uint16_t *approx, int64_t approx_stride, const uint16_t *x, int64_t x_stride,
                        const uint16_t *weight, const float *bounds, const float *x_errors, const float *weight_norms,
                        int64_t num_rows, int64_t vocab, int64_t hidden, int64_t *out, int32_t *num_candidates) {
#pragma omp parallel for schedule(static) if (num_rows > 1)
  for (int64_t r = 0; r < num_rows; r++)
    out[r] = screen_row(approx + r * approx_stride, x + r * x_stride, weight, bounds, weight_norms,
                        x_errors ? x_errors[r] : 0.f, vocab, hidden, &num_candidates[r]);
}
