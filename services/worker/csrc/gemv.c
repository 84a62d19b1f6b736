/* Decode matmuls of a few rows on a plain bfloat16 weight: y [M, N] = x [M, K] W^T (+ b) with
 * W [N, K] row-major bfloat16 (the checkpoint layout), x and y float32 or bfloat16, bias bfloat16
 * or NULL, sums in float32.
 *
 * At one to eight rows (linear.py's MAX_GEMV_ROWS) a matmul is bound by reading W, and a
 * general GEMM's blocking only adds work, so each thread streams its own contiguous share of
 * W's rows exactly once: a block of ROW_BLOCK rows is read 64 bytes at a time per row and
 * multiplied against every x row (x stays in L1). More x rows than one group holds re-read the
 * block from L1, not from memory.
 *
 * Two inner loops: AVX512_BF16 dot products (bfloat16 pairs into float32 lanes) for bfloat16 x
 * where the compiler targets it, else bfloat16 widened to float32 by a shift and multiplied with
 * fused multiply-adds in 8-lane vectors (vec.h: AVX2 + FMA on x86), which also serves float32 x
 * (its values are not rounded to bfloat16). A K that is not a multiple of the vector width ends
 * with a masked load (AVX512) or a scalar loop. */
#include <stdint.h>
#include <string.h>

#include "vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define ROW_BLOCK 4 /* weight rows per block: 4 streams of W per thread */
/* Software prefetch of the rows PREFETCH_ROWS ahead into L2 (prefetcht2): 30 layers' matmuls at
 * one row 14.5 -> 8.5 ms on a 2-core Zen 4 (into L1, prefetcht0, it gained about nothing). */
#define PREFETCH_ROWS 16
#define PREFETCH_LOCALITY 1
/* x rows per pass over a block: the accumulators (group x ROW_BLOCK vectors) plus a block of W
 * and one x vector must fit the register file (32 zmm with AVX512, 16 ymm with AVX2). */
#define BF16_DOT_GROUP 4
#define WIDEN_GROUP 2
/* Below this many weight elements a thread team costs more than it saves (a 576 x 576 weight is
 * 331,776). */
#define MIN_PARALLEL_WEIGHTS 65536


/* sums[m * ROW_BLOCK + j] = x[m] . w[j] for m < num_x, j < num_w; widened W, float32 FMAs.
 * Inlined into callers with constant num_x and num_w so the accumulators stay in registers. */
#define DEFINE_WIDEN_DOT(name, xtype, LOAD_X8, X_SCALAR)                                          \
  static inline __attribute__((always_inline)) void name(const xtype *x, const uint16_t *w,       \
                                                         int64_t k_size, int num_x, int num_w,     \
                                                         float *sums) {                            \
    v8f acc[WIDEN_GROUP][ROW_BLOCK];                                                               \
    for (int m = 0; m < num_x; ++m)                                                                \
      for (int j = 0; j < num_w; ++j) acc[m][j] = (v8f){0};                                       \
    int64_t k = 0;                                                                                 \
    for (; k + 8 <= k_size; k += 8) {                                                              \
      v8f wv[ROW_BLOCK];                                                                           \
      for (int j = 0; j < num_w; ++j) wv[j] = load_bf16(w + j * k_size + k);                       \
      if ((k & 31) == 0) /* once per 64-byte line */                                               \
        for (int j = 0; j < num_w; ++j)                                                            \
          __builtin_prefetch(w + (j + PREFETCH_ROWS) * k_size + k, 0, PREFETCH_LOCALITY);          \
      for (int m = 0; m < num_x; ++m) {                                                            \
        const v8f xv = LOAD_X8(x + m * k_size + k);                                                \
        for (int j = 0; j < num_w; ++j) acc[m][j] += xv * wv[j];                                   \
      }                                                                                            \
    }                                                                                              \
    for (int m = 0; m < num_x; ++m)                                                                \
      for (int j = 0; j < num_w; ++j) {                                                            \
        float s = hsum(acc[m][j]);                                                                 \
        for (int64_t t = k; t < k_size; ++t)                                                       \
          s += X_SCALAR(x[m * k_size + t]) * bf16_to_f32(w[j * k_size + t]);                       \
        sums[m * ROW_BLOCK + j] = s;                                                               \
      }                                                                                            \
  }

#define IDENTITY_SCALAR(v) (v)
DEFINE_WIDEN_DOT(dot_widen_f32, float, load_f32, IDENTITY_SCALAR)
DEFINE_WIDEN_DOT(dot_widen_bf16, uint16_t, load_bf16, bf16_to_f32)

#if defined(__AVX512BF16__)
/* As above for bfloat16 x: 32 bfloat16 pairs per dot-product instruction, the tail masked. */
static inline __attribute__((always_inline)) void dot_bf16_pairs(const uint16_t *x, const uint16_t *w,
                                                                 int64_t k_size, int num_x, int num_w,
                                                                 float *sums) {
  __m512 acc[BF16_DOT_GROUP][ROW_BLOCK];
  for (int m = 0; m < num_x; ++m)
    for (int j = 0; j < num_w; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= k_size; k += 32) {
    __m512bh wv[ROW_BLOCK];
    for (int j = 0; j < num_w; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * k_size + k);
    for (int j = 0; j < num_w; ++j)
      __builtin_prefetch(w + (j + PREFETCH_ROWS) * k_size + k, 0, PREFETCH_LOCALITY);
    for (int m = 0; m < num_x; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * k_size + k);
      for (int j = 0; j < num_w; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  if (k < k_size) { /* zeros past the end add nothing */
    const __mmask32 mask = (__mmask32)((1ull << (k_size - k)) - 1);
    __m512bh wv[ROW_BLOCK];
    for (int j = 0; j < num_w; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * k_size + k);
    for (int m = 0; m < num_x; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * k_size + k);
      for (int j = 0; j < num_w; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int m = 0; m < num_x; ++m)
    for (int j = 0; j < num_w; ++j) sums[m * ROW_BLOCK + j] = _mm512_reduce_add_ps(acc[m][j]);
}
#define BF16_DOT dot_bf16_pairs
#define BF16_GROUP BF16_DOT_GROUP
#else
#define BF16_DOT dot_widen_bf16
#define BF16_GROUP WIDEN_GROUP
#endif

/* One block of weight rows [n, n + num_w) against x rows [m0, m0 + num_x), written to y with the
 * bias. The switch hands the dot product constant sizes. */
#define DEFINE_BLOCK(name, xtype, DOT, GROUP, STORE)                                               \
  static void name(const xtype *x, const uint16_t *w, const uint16_t *bias, xtype *y, int64_t m0,  \
                   int64_t num_x, int64_t n, int64_t num_w, int64_t n_size, int64_t k_size) {      \
    float sums[GROUP * ROW_BLOCK];                                                                 \
    const xtype *xm = x + m0 * k_size;                                                             \
    const uint16_t *wn = w + n * k_size;                                                           \
    if (num_w == ROW_BLOCK) {                                                                      \
      switch (num_x) {                                                                             \
        case 1: DOT(xm, wn, k_size, 1, ROW_BLOCK, sums); break;                                    \
        case 2: DOT(xm, wn, k_size, 2, ROW_BLOCK, sums); break;                                    \
        case 3: DOT(xm, wn, k_size, 3 < GROUP ? 3 : GROUP, ROW_BLOCK, sums); break;                \
        default: DOT(xm, wn, k_size, GROUP, ROW_BLOCK, sums); break;                               \
      }                                                                                            \
    } else {                                                                                       \
      for (int j = 0; j < num_w; ++j) /* the last rows of W, one at a time */                     \
        DOT(xm, wn + j * k_size, k_size, (int)num_x, 1, sums + j);                                 \
    }                                                                                              \
    for (int64_t m = 0; m < num_x; ++m)                                                            \
      for (int64_t j = 0; j < num_w; ++j) {                                                        \
        const float b = bias ? bf16_to_f32(bias[n + j]) : 0.0f;                                    \
        y[(m0 + m) * n_size + n + j] = STORE(sums[m * ROW_BLOCK + j] + b);                         \
      }                                                                                            \
  }

DEFINE_BLOCK(block_f32, float, dot_widen_f32, WIDEN_GROUP, IDENTITY_SCALAR)
DEFINE_BLOCK(block_bf16, uint16_t, BF16_DOT, BF16_GROUP, f32_to_bf16)

/* Threads split W's row blocks statically (contiguous shares); every thread covers all x rows. */
#define DEFINE_GEMV(name, xtype, BLOCK, GROUP)                                                     \
  void name(const xtype *x, const uint16_t *w, const uint16_t *bias, xtype *y, int64_t m_size,     \
            int64_t n_size, int64_t k_size) {                                                      \
    const int64_t num_blocks = (n_size + ROW_BLOCK - 1) / ROW_BLOCK;                               \
    _Pragma("omp parallel for schedule(static) if(n_size * k_size >= MIN_PARALLEL_WEIGHTS)")       \
    for (int64_t b = 0; b < num_blocks; ++b) {                                                     \
      const int64_t n = b * ROW_BLOCK;                                                             \
      const int64_t num_w = n_size - n < ROW_BLOCK ? n_size - n : ROW_BLOCK;                       \
      for (int64_t m0 = 0; m0 < m_size; m0 += GROUP) {                                             \
        const int64_t num_x = m_size - m0 < GROUP ? m_size - m0 : GROUP;                           \
        BLOCK(x, w, bias, y, m0, num_x, n, num_w, n_size, k_size);                                 \
      }                                                                                            \
    }                                                                                              \
  }

DEFINE_GEMV(gemv_f32, float, block_f32, WIDEN_GROUP)
DEFINE_GEMV(gemv_bf16, uint16_t, block_bf16, BF16_GROUP)

/* 1 where bfloat16 x uses the AVX512_BF16 dot products, 0 where it is widened. */
int gemv_has_bf16_dot(void) {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}
