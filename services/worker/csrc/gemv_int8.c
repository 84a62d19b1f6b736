/* Decode matmuls of a few rows on a weight-only int8 weight: y [M, N] = (x [M, K] Q^T) * s (+ b)
 * with Q [N, K] row-major int8 in [-127, 127], s [N] float32 (a scale per output channel), x, y
 * and the bias in float32 or bfloat16 (x's dtype), sums in float32.
 *
 * As in gemv.c, a few rows only stream the weight, so each thread reads its own contiguous share
 * of Q's rows once: a block of rows, one 64-byte line per row at a time, is multiplied against
 * every x row of a pass (up to MAX_GROUP rows; x stays in L1), with the rows PREFETCH_ROWS ahead
 * prefetched into L2. The block is as tall as the registers allow for the pass's x rows (8 rows
 * at one or two x rows, 2 at eight). int8 halves the bytes of a bfloat16 weight, so the widening
 * must stay cheap enough not to become the bound:
 *  - bfloat16 x where the compiler targets AVX512_BF16: each line of 64 int8 becomes two vectors
 *    of 32 bfloat16 by table lookup (with AVX512_VBMI; int8 values are exact in bfloat16) and
 *    multiplies on VDPBF16PS, 32 products per instruction;
 *  - otherwise (float32 x, or a CPU without AVX512_BF16): int8 sign-extended and converted to
 *    float32 in vectors of 16 (AVX512) or 8 (AVX2) lanes and multiplied with fused multiply-adds
 *    on float32 x; bfloat16 x is widened to float32 once per call (M x K values), not per use.
 * Both are exact up to float32 summation: a product of an int8 and a bfloat16 is exact, one with
 * a float32 rounded once, as a float32 matmul on the dequantized weight rounds it. The scale and
 * the bias apply to each finished sum, and a bfloat16 output is rounded once, to nearest even. A
 * K that is not a multiple of the vector width ends with masked loads (AVX512_BF16) or a scalar
 * loop. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_bf16.h"
#include "vec.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAS_BF16_DOT 1
#else
#define HAS_BF16_DOT 0
#endif
/* The byte-table widening (int8_bf16.h) needs AVX512_VBMI (VPERMI2B): Zen 4 and Sapphire Rapids
 * have it, Cooper Lake (AVX512_BF16 without it) widens through float32 instead. */
#define HAS_BYTE_TABLE HAS_INT8_BF16_TABLE

#define LINE_BYTES 64
/* Loops over x rows and weight rows unrolled early, so that the accumulator arrays become
 * registers (left to GCC's size limits, eight rows of pairs kept a copy of them in memory). */
#if defined(__clang__)
#define UNROLL _Pragma("unroll")
#else
#define UNROLL _Pragma("GCC unroll 8")
#endif
#define MAX_GROUP 8 /* x rows per pass over the weight */
#define MAX_BLOCK_ROWS 8
/* Weight rows per block for a pass of `num_x` x rows: the accumulators (num_x x rows vectors),
 * a block's widened line and an x vector fit the register file (32 zmm, or 16 ymm with AVX2). */
#define PAIRS_BLOCK_ROWS(num_x) ((num_x) <= 2 ? 8 : (num_x) <= 4 ? 4 : 2)
#if defined(__AVX512F__)
#define WIDEN_LANES 16
#define WIDEN_BLOCK_ROWS(num_x) ((num_x) <= 2 ? 8 : (num_x) <= 4 ? 4 : 2)
#else
#define WIDEN_LANES 8
#define WIDEN_BLOCK_ROWS(num_x) ((num_x) <= 2 ? 4 : (num_x) <= 4 ? 2 : 1)
#endif
/* Software prefetch of the rows this far ahead into L2 (prefetcht2), as in gemv.c (4 or 32 rows
 * ahead: 30 layers' matmuls at one row slower by 10-80%). */
#define PREFETCH_ROWS 16
#define PREFETCH_LOCALITY 1
/* Below this many weight bytes a thread team costs more than it saves. */
#define MIN_PARALLEL_BYTES 65536

typedef float vf __attribute__((vector_size(4 * WIDEN_LANES)));


static inline vf load_vf(const float *p) {
  vf v;
  memcpy(&v, p, sizeof v); /* no alignment assumed */
  return v;
}

static inline vf widen_int8(const int8_t *p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else /* GCC lowers a vector int8 -> float conversion to scalar code anyway */
  vf v;
  for (int i = 0; i < WIDEN_LANES; ++i) v[i] = (float)p[i];
  return v;
#endif
}

static inline float hsum_vf(vf v) {
  float s = 0.0f;
  for (int i = 0; i < WIDEN_LANES; ++i) s += v[i];
  return s;
}

/* sums[i] = the lane sum of acc[i] for i < count (at most 16). With AVX512, one transpose tree
 * of 45 instructions for all of them (16 separate reductions take about 300, as much as the
 * block's whole dot product at eight x rows and K = 576). */
static inline __attribute__((always_inline)) void lane_sums(const vf *acc, int count, float *sums) {
#if defined(__AVX512F__)
  __m512 v[16], w[8], t[4];
  UNROLL for (int i = 0; i < 16; ++i) v[i] = i < count ? (__m512)acc[i] : _mm512_setzero_ps();
  UNROLL for (int i = 0; i < 8; ++i) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  UNROLL for (int i = 0; i < 4; ++i) /* per 128-bit lane: one partial sum of each of 4 accumulators */
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x44), _mm512_shuffle_f32x4(t[0], t[1], 0xEE));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x44), _mm512_shuffle_f32x4(t[2], t[3], 0xEE));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
  _mm512_mask_storeu_ps(sums, (__mmask16)((1u << count) - 1), r);
#else
  for (int i = 0; i < count; ++i) sums[i] = hsum_vf(acc[i]);
#endif
}

/* sums[m * num_w + j] = x[m] . q[j] for m < num_x, j < num_w (x rows x_stride apart):
 * widened Q, float32 FMAs. Inlined with constant num_x and num_w so the accumulators stay in
 * registers. */
static inline __attribute__((always_inline)) void dot_widen(const float *x, int64_t x_stride, const int8_t *q,
                                                            int64_t k_size, int num_x, int num_w, float *sums) {
  vf acc[MAX_GROUP][MAX_BLOCK_ROWS];
  UNROLL for (int m = 0; m < num_x; ++m)
    UNROLL for (int j = 0; j < num_w; ++j) acc[m][j] = (vf){0};
  int64_t k = 0;
  for (; k + LINE_BYTES <= k_size; k += LINE_BYTES) {
    UNROLL for (int j = 0; j < num_w; ++j)
      __builtin_prefetch(q + (j + PREFETCH_ROWS) * k_size + k, 0, PREFETCH_LOCALITY);
    UNROLL for (int v = 0; v < LINE_BYTES; v += WIDEN_LANES) {
      vf wv[MAX_BLOCK_ROWS];
      UNROLL for (int j = 0; j < num_w; ++j) wv[j] = widen_int8(q + j * k_size + k + v);
      UNROLL for (int m = 0; m < num_x; ++m) {
        const vf xv = load_vf(x + m * x_stride + k + v);
        UNROLL for (int j = 0; j < num_w; ++j) acc[m][j] += xv * wv[j];
      }
    }
  }
  for (; k + WIDEN_LANES <= k_size; k += WIDEN_LANES) {
    vf wv[MAX_BLOCK_ROWS];
    UNROLL for (int j = 0; j < num_w; ++j) wv[j] = widen_int8(q + j * k_size + k);
    UNROLL for (int m = 0; m < num_x; ++m) {
      const vf xv = load_vf(x + m * x_stride + k);
      UNROLL for (int j = 0; j < num_w; ++j) acc[m][j] += xv * wv[j];
    }
  }
  vf flat[MAX_GROUP * MAX_BLOCK_ROWS];
  UNROLL for (int m = 0; m < num_x; ++m)
    UNROLL for (int j = 0; j < num_w; ++j) flat[m * num_w + j] = acc[m][j];
  lane_sums(flat, num_x * num_w, sums);
  if (k < k_size)
    for (int m = 0; m < num_x; ++m)
      for (int j = 0; j < num_w; ++j)
        for (int64_t t = k; t < k_size; ++t) sums[m * num_w + j] += x[m * x_stride + t] * (float)q[j * k_size + t];
}

#if !HAS_BYTE_TABLE && HAS_BF16_DOT
typedef int Bf16Tables; /* none: widened through float32 */

static inline Bf16Tables load_bf16_tables(void) { return 0; }

/* 64 int8 as elements [0, 32) (`lo`) and [32, 64) (`hi`) in order, through float32. */
static inline __attribute__((always_inline)) void int8_line_to_bf16(const Bf16Tables *t, __m512i raw,
                                                                   __m512bh *lo, __m512bh *hi) {
  (void)t;
  const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, 0)));
  const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, 1)));
  const __m512 f2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, 2)));
  const __m512 f3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, 3)));
  *lo = _mm512_cvtne2ps_pbh(f1, f0); /* exact: an int8 has at most 8 significant bits */
  *hi = _mm512_cvtne2ps_pbh(f3, f2);
}
#define X_LINE_LO(x0, x1) (x0) /* x in order */
#define X_LINE_HI(x0, x1) (x1)
#endif

#if HAS_BF16_DOT
/* x [M, K] into [M, k_pad] in the element order of int8_line_to_bf16, zero past K. */
static void permute_x(const uint16_t *x, uint16_t *xp, int64_t m_size, int64_t k_size, int64_t k_pad) {
  for (int64_t m = 0; m < m_size; ++m)
    for (int64_t k = 0; k < k_pad; k += LINE_BYTES) {
      const int64_t left = k_size - k;
      const __mmask32 mask0 = left >= 32 ? ~(__mmask32)0 : (__mmask32)(((uint64_t)1 << left) - 1);
      const __mmask32 mask1 = left >= 64 ? ~(__mmask32)0 : left <= 32 ? 0 : (__mmask32)(((uint64_t)1 << (left - 32)) - 1);
      const __m512i x0 = _mm512_maskz_loadu_epi16(mask0, x + m * k_size + k);
      const __m512i x1 = _mm512_maskz_loadu_epi16(mask1, x + m * k_size + k + 32);
      _mm512_storeu_si512(xp + m * k_pad + k, X_LINE_LO(x0, x1));
      _mm512_storeu_si512(xp + m * k_pad + k + 32, X_LINE_HI(x0, x1));
    }
}

/* As dot_widen for permuted bfloat16 x (rows k_pad apart): 32 products per VDPBF16PS, one line
 * of each weight row per step, the last line's weights masked (zeros past the end add nothing; x
 * is zero-padded). */
static inline __attribute__((always_inline)) void dot_bf16_pairs(const uint16_t *xp, int64_t k_pad, const int8_t *q,
                                                                 int64_t k_size, int num_x, int num_w, float *sums) {
  const Bf16Tables t = load_bf16_tables();
  const __mmask64 tail_mask = k_size % LINE_BYTES ? ((__mmask64)1 << (k_size % LINE_BYTES)) - 1 : ~(__mmask64)0;
  __m512 acc[MAX_GROUP][MAX_BLOCK_ROWS];
  UNROLL for (int m = 0; m < num_x; ++m)
    UNROLL for (int j = 0; j < num_w; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; k += LINE_BYTES) {
    const __mmask64 wmask = k + LINE_BYTES <= k_size ? ~(__mmask64)0 : tail_mask;
    __m512bh lo[MAX_BLOCK_ROWS], hi[MAX_BLOCK_ROWS];
    UNROLL for (int j = 0; j < num_w; ++j) {
      __builtin_prefetch(q + (j + PREFETCH_ROWS) * k_size + k, 0, PREFETCH_LOCALITY);
      int8_line_to_bf16(&t, _mm512_maskz_loadu_epi8(wmask, q + j * k_size + k), &lo[j], &hi[j]);
    }
    UNROLL for (int m = 0; m < num_x; ++m) {
      const __m512bh xlo = (__m512bh)_mm512_loadu_si512(xp + m * k_pad + k);
      const __m512bh xhi = (__m512bh)_mm512_loadu_si512(xp + m * k_pad + k + 32);
      UNROLL for (int j = 0; j < num_w; ++j) {
        acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xlo, lo[j]);
        acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xhi, hi[j]);
      }
    }
  }
  vf flat[MAX_GROUP * MAX_BLOCK_ROWS];
  UNROLL for (int m = 0; m < num_x; ++m)
    UNROLL for (int j = 0; j < num_w; ++j) flat[m * num_w + j] = (vf)acc[m][j];
  lane_sums(flat, num_x * num_w, sums);
}
#endif

#define IDENTITY_SCALAR(v) (v)

/* The dot product of num_x (1..MAX_GROUP) x rows against `rows` weight rows, with both sizes
 * constant in each case. */
#define DOT_BY_NUM_X(DOT, x, x_stride, q, k_size, num_x, rows, sums)                                  \
  switch (num_x) {                                                                                  \
    case 1: DOT(x, x_stride, q, k_size, 1, rows(1), sums); break;                                   \
    case 2: DOT(x, x_stride, q, k_size, 2, rows(2), sums); break;                                   \
    case 3: DOT(x, x_stride, q, k_size, 3, rows(3), sums); break;                                   \
    case 4: DOT(x, x_stride, q, k_size, 4, rows(4), sums); break;                                   \
    case 5: DOT(x, x_stride, q, k_size, 5, rows(5), sums); break;                                   \
    case 6: DOT(x, x_stride, q, k_size, 6, rows(6), sums); break;                                   \
    case 7: DOT(x, x_stride, q, k_size, 7, rows(7), sums); break;                                   \
    default: DOT(x, x_stride, q, k_size, 8, rows(8), sums); break;                                  \
  }
#define ONE_ROW(num_x) 1

/* One block of weight rows [n, n + num_w) against x rows [m0, m0 + num_x), written to y scaled,
 * with the bias. `x` is what the dot product reads (float32, or permuted bfloat16 for the pairs),
 * its rows x_stride apart. */
#define DEFINE_BLOCK(name, xtype, ytype, DOT, BLOCK_ROWS, BIAS_SCALAR, STORE)                          \
  static void name(const xtype *x, int64_t x_stride, const int8_t *q, const float *scales,             \
                   const ytype *bias, ytype *y, int64_t m0, int num_x, int64_t n, int num_w,           \
                   int64_t n_size, int64_t k_size) {                                                   \
    float sums[MAX_GROUP * MAX_BLOCK_ROWS];                                                            \
    const xtype *xm = x + m0 * x_stride;                                                               \
    const int8_t *qn = q + n * k_size;                                                                 \
    if (num_w == BLOCK_ROWS(num_x)) {                                                                  \
      DOT_BY_NUM_X(DOT, xm, x_stride, qn, k_size, num_x, BLOCK_ROWS, sums)                             \
    } else {                                                                                           \
      for (int j = 0; j < num_w; ++j) { /* the last rows of Q, one at a time */                       \
        float one_row[MAX_GROUP];                                                                      \
        DOT_BY_NUM_X(DOT, xm, x_stride, qn + j * k_size, k_size, num_x, ONE_ROW, one_row)              \
        for (int m = 0; m < num_x; ++m) sums[m * num_w + j] = one_row[m];                              \
      }                                                                                                \
    }                                                                                                  \
    for (int m = 0; m < num_x; ++m)                                                                    \
      for (int j = 0; j < num_w; ++j) {                                                                \
        const float b = bias ? BIAS_SCALAR(bias[n + j]) : 0.0f;                                        \
        y[(m0 + m) * n_size + n + j] = STORE(sums[m * num_w + j] * scales[n + j] + b);                 \
      }                                                                                                \
  }

DEFINE_BLOCK(block_f32, float, float, dot_widen, WIDEN_BLOCK_ROWS, IDENTITY_SCALAR, IDENTITY_SCALAR)
#if HAS_BF16_DOT
DEFINE_BLOCK(block_bf16, uint16_t, uint16_t, dot_bf16_pairs, PAIRS_BLOCK_ROWS, bf16_to_f32, f32_to_bf16)
#else
DEFINE_BLOCK(block_widened_bf16, float, uint16_t, dot_widen, WIDEN_BLOCK_ROWS, bf16_to_f32, f32_to_bf16)
#endif

/* Each pass of up to MAX_GROUP x rows splits Q's row blocks statically over the threads
 * (contiguous shares). */
#define RUN_PASSES(BLOCK, BLOCK_ROWS, x, x_stride, q, scales, bias, y, m_size, n_size, k_size)         \
  _Pragma("omp parallel if(n_size * k_size >= MIN_PARALLEL_BYTES)")                                    \
  for (int64_t m0 = 0; m0 < m_size; m0 += MAX_GROUP) {                                                 \
    const int num_x = (int)(m_size - m0 < MAX_GROUP ? m_size - m0 : MAX_GROUP);                        \
    const int64_t rows = BLOCK_ROWS(num_x);                                                            \
    const int64_t num_blocks = (n_size + rows - 1) / rows;                                             \
    _Pragma("omp for schedule(static) nowait")                                                         \
    for (int64_t b = 0; b < num_blocks; ++b) {                                                         \
      const int64_t n = b * rows;                                                                      \
      const int num_w = (int)(n_size - n < rows ? n_size - n : rows);                                  \
      BLOCK(x, x_stride, q, scales, bias, y, m0, num_x, n, num_w, n_size, k_size);                     \
    }                                                                                                  \
  }

#define PADDED_TO_LINES(k) (((k) + LINE_BYTES - 1) / LINE_BYTES * LINE_BYTES)

/* y = (x Q^T) * scales (+ bias), float32 x, y and bias (bias may be NULL). Returns 0. */
int gemv_int8_f32(const float *x, const int8_t *q, const float *scales, const float *bias, float *y,
                  int64_t m_size, int64_t n_size, int64_t k_size) {
  if (m_size <= 0) return 0;
  RUN_PASSES(block_f32, WIDEN_BLOCK_ROWS, x, k_size, q, scales, bias, y, m_size, n_size, k_size);
  return 0;
}

/* As gemv_int8_f32 for bfloat16 x, y and bias (raw uint16 bits). Returns 0, or -1 where the copy
 * of x it reads (permuted, or widened to float32) could not be allocated (y is then unwritten). */
int gemv_int8_bf16(const uint16_t *x, const int8_t *q, const float *scales, const uint16_t *bias, uint16_t *y,
                   int64_t m_size, int64_t n_size, int64_t k_size) {
  if (m_size <= 0) return 0; /* nothing to copy (and malloc(0) may return NULL) */
#if HAS_BF16_DOT
  const int64_t k_pad = PADDED_TO_LINES(k_size);
  uint16_t *xp = malloc((size_t)(m_size * k_pad) * sizeof *xp);
  if (xp == NULL) return -1;
  permute_x(x, xp, m_size, k_size, k_pad);
  RUN_PASSES(block_bf16, PAIRS_BLOCK_ROWS, xp, k_pad, q, scales, bias, y, m_size, n_size, k_size);
  free(xp);
#else
  float *x32 = malloc((size_t)(m_size * k_size) * sizeof *x32);
  if (x32 == NULL) return -1;
  for (int64_t i = 0; i < m_size * k_size; ++i) x32[i] = bf16_to_f32(x[i]);
  RUN_PASSES(block_widened_bf16, WIDEN_BLOCK_ROWS, x32, k_size, q, scales, bias, y, m_size, n_size, k_size);
  free(x32);
#endif
  return 0;
}

/* 1 where bfloat16 x multiplies on AVX512_BF16 dot products, 0 where x and Q are widened. */
int gemv_int8_has_bf16_dot(void) { return HAS_BF16_DOT; }
