/* Matmuls of a few dozen to a few hundred rows on the AMX tile unit (AMX-BF16): y [M, N] = x [M, K]
 * W^T (+ b), x, y and b bfloat16, sums in float32, y rounded to nearest even.
 *
 * The weight is packed once (`gemm_amx_pack`) into panels of 32 output columns; a panel is K/32
 * steps of two B tiles, each [16 pairs of K][16 columns][2] (1 KB, the VNNI layout TDPBF16PS
 * reads). x is read in place as A tiles (16 rows x 32 values, the row stride K), so K must be a
 * multiple of 32; rows past M are read from a zero-padded copy of the last block. A thread takes a
 * panel, streams it from memory once for the first 32 rows and from L2 for the others, and holds
 * a 32 x 32 block of sums in four C tiles.
 *
 * Why not oneDNN's AMX GEMM at these sizes: on a 2-core Sapphire Rapids VM its prepacked bfloat16
 * GEMM took 16.1 ms for SmolLM2-135M's 30 layers' matmuls at 48 rows (212 MB of weights, 13 GB/s),
 * against 11.4 ms here; 13.4 against 8.8 at 16 rows, 27.0 against 18.8 at 128 (docs/benchmarks.md,
 * "AMX"). The L2 prefetch ahead of the first row block took 48 rows from 12.3 to 11.4 ms; into L1
 * it was slower.
 *
 * Weight-only int8 (`gemm_amx_int8w`): the same panels in int8 (half the bytes to stream; with the
 * byte table of int8_bf16.h each line's bytes reordered for it), widened to bfloat16 (exact) a step
 * ahead of their products, and scaled per output column on the float32
 * sums; past 32 rows the widened panel stays in L2 for the other row blocks.
 *
 * Built only where the compiler targets AMX-BF16; elsewhere `gemm_amx_available` returns 0 and
 * nothing here is called. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>

#include <omp.h>
#include <unistd.h>

#include "amx_tiles.h"
#include "int8_bf16.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE 16     /* rows of an A or C tile, columns of a B or C tile */
#define PANEL 32    /* output columns per panel: two B tiles */
#define KSTEP 32    /* input positions per tile step: 16 pairs */
#define MBLOCK 32   /* x rows per block: two A tiles */
#define MCHUNK 256  /* x rows every panel meets before the next rows: they stay in L2 (2,048 rows read
                     * from the last-level cache for every panel took 2.8x the time of 1,024) */
#define STEP_ELEMS (2 * 16 * 32) /* bfloat16 values of a panel's step: two B tiles, 2 KB */
#define MIN_PARALLEL_PANELS 4
#define PREFETCH_STEPS 16 /* panel steps (2 KB each) prefetched into L2 ahead of the first row block */

/* Asks the kernel for the tile state (Linux 5.16+); 1 where AMX may be used in this process. */
int gemm_amx_available(void) {
  static int state = -1;
  if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return state;
}

int64_t gemm_amx_numel(int64_t n_size, int64_t k_size) {
  return (n_size + PANEL - 1) / PANEL * PANEL * ((k_size + KSTEP - 1) / KSTEP * KSTEP);
}

/* w [n_size, k_size] row-major -> [panels][K/32 steps][2 tiles][16 pairs][16 columns][2]; zeros
 * past N and K. A thread's panels lie one after another in memory. */
#define DEFINE_PACK(NAME, T)                                                                         \
  void NAME(const T *w, T *out, int64_t n_size, int64_t k_size) {                                    \
    const int64_t num_panels = (n_size + PANEL - 1) / PANEL, num_steps = (k_size + KSTEP - 1) / KSTEP; \
    _Pragma("omp parallel for schedule(static)")                                                     \
    for (int64_t p = 0; p < num_panels; p++)                                                         \
      for (int64_t s = 0; s < num_steps; s++)                                                        \
        for (int t = 0; t < 2; t++)                                                                  \
          for (int r = 0; r < 16; r++)                                                               \
            for (int c = 0; c < 16; c++)                                                             \
              for (int h = 0; h < 2; h++) {                                                          \
                const int64_t n = p * PANEL + 16 * t + c, k = s * KSTEP + 2 * r + h;                 \
                out[(((p * num_steps + s) * 2 + t) * 16 + r) * 16 * 2 + c * 2 + h] =                 \
                    n < n_size && k < k_size ? w[n * k_size + k] : 0;                                \
              }                                                                                      \
  }

DEFINE_PACK(gemm_amx_pack, uint16_t)
#if HAS_INT8_BF16_TABLE
/* The int8 panels are widened by the byte table (int8_bf16.h), whose interleave works within
 * 128-bit lanes, so each line is stored in its order (`order_lines_for_table`). */
DEFINE_PACK(pack_int8_panel_order, int8_t)
void gemm_amx_int8w_pack(const int8_t *w, int8_t *out, int64_t n_size, int64_t k_size) {
  pack_int8_panel_order(w, out, n_size, k_size);
  order_lines_for_table(out, gemm_amx_numel(n_size, k_size));
}
#else
DEFINE_PACK(gemm_amx_int8w_pack, int8_t)
#endif

/* Sums [rows][32] float32 (times the column's scale where scales is not NULL) -> y rows (+ bias),
 * only the columns below n_size. */
static inline void store_block(const float *sums, int rows, uint16_t *y, int64_t n_size, int64_t col0,
                               const uint16_t *bias, const float *scales) {
  const int cols = n_size - col0 < PANEL ? (int)(n_size - col0) : PANEL;
  const __mmask16 low = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
  const __mmask16 high = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias) {
    b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(low, bias + col0)), 16));
    b1 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(high, bias + col0 + 16)), 16));
  }
  __m512 c0 = _mm512_set1_ps(1.0f), c1 = c0;
  if (scales) {
    c0 = _mm512_maskz_loadu_ps(low, scales + col0);
    c1 = _mm512_maskz_loadu_ps(high, scales + col0 + 16);
  }
  for (int r = 0; r < rows; r++) {
    const __m512 s0 = _mm512_fmadd_ps(_mm512_loadu_ps(sums + r * PANEL), c0, b0);
    const __m512 s1 = _mm512_fmadd_ps(_mm512_loadu_ps(sums + r * PANEL + 16), c1, b1);
    uint16_t *dst = y + r * n_size + col0;
    _mm256_mask_storeu_epi16(dst, low, (__m256i)_mm512_cvtneps_pbh(s0));
    _mm256_mask_storeu_epi16(dst + 16, high, (__m256i)_mm512_cvtneps_pbh(s1));
  }
}

/* One panel step's int8 B tiles (1 KB) widened to bfloat16 in the same layout (2 KB): exact, as
 * every int8 value is a bfloat16. With the byte table: 6 instructions a line of 64 values where
 * the float32 route takes 14. SmolLM2-135M's 30 layers' int8 panels from memory
 * (benchmarks.amx_gemm_bench, two alternations): 16 rows 7.64 / 7.71 -> 6.88 / 7.11 ms, 32 rows
 * 8.56 / 8.67 -> 8.63 / 7.86, 48 rows 12.25 / 13.28 -> 11.99 / 11.61, 64 rows 13.70 / 14.40 ->
 * 13.25 / 13.95. */
static inline void widen_step(const int8_t *q, uint16_t *out) {
#if HAS_INT8_BF16_TABLE
  const Bf16Tables t = load_bf16_tables();
  for (int i = 0; i < 16; i++) {
    __m512bh lo, hi;
    int8_line_to_bf16(&t, _mm512_loadu_si512(q + 64 * i), &lo, &hi);
    _mm512_store_si512((__m512i *)(out + 64 * i), (__m512i)lo);
    _mm512_store_si512((__m512i *)(out + 64 * i + 32), (__m512i)hi);
  }
#else
  for (int i = 0; i < 32; i++) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * i))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * i + 16))));
    _mm512_store_si512((__m512i *)(out + 32 * i), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
#endif
}

/* One panel (two B tiles a step) against x rows in A tiles a0 and, where two_row_tiles, a1 (each
 * read with the row stride of x): four C tiles of sums, every B tile meeting both A tiles. The
 * panel is bfloat16 at b, or int8 at q: then each step is widened into `wide` one step ahead of its
 * product, so the tile unit multiplies step s while step s + 1 converts; `wide` is a ring of four
 * steps in L1 (wide_mask 3) or the whole panel (wide_mask -1), kept for the next row blocks. */
static inline void panel_block(const uint16_t *a0, const uint16_t *a1, int64_t a_stride, const uint16_t *b,
                               const int8_t *q, uint16_t *wide, int64_t wide_mask, int64_t num_steps, float *sums,
                               int two_row_tiles, int prefetch) {
  _tile_zero(0);
  _tile_zero(1);
  if (two_row_tiles) { _tile_zero(2); _tile_zero(3); }
  if (q) widen_step(q, wide);
  for (int64_t s = 0; s < num_steps; s++) {
    const uint16_t *bs = b + s * STEP_ELEMS;
    if (q) {
      if (prefetch)
        for (int l = 0; l < 16; l++) _mm_prefetch((const char *)(q + (s + PREFETCH_STEPS) * STEP_ELEMS) + 64 * l, _MM_HINT_T1);
      if (s + 1 < num_steps) widen_step(q + (s + 1) * STEP_ELEMS, wide + ((s + 1) & wide_mask) * STEP_ELEMS);
      bs = wide + (s & wide_mask) * STEP_ELEMS;
    } else if (prefetch) {
      for (int l = 0; l < 32; l++) _mm_prefetch((const char *)(bs + PREFETCH_STEPS * STEP_ELEMS) + 64 * l, _MM_HINT_T1);
    }
    _tile_loadd(6, bs, 64);
    _tile_loadd(7, bs + 16 * 32, 64);
    _tile_loadd(4, a0 + s * KSTEP, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two_row_tiles) {
      _tile_loadd(5, a1 + s * KSTEP, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, PANEL * 4);
  _tile_stored(1, sums + 16, PANEL * 4);
  if (two_row_tiles) {
    _tile_stored(2, sums + 16 * PANEL, PANEL * 4);
    _tile_stored(3, sums + 16 * PANEL + 16, PANEL * 4);
  }
}

/* The body of both GEMMs: bfloat16 panels (`packed`), or int8 panels (`packed_int8`) widened step by
 * step, the per-column `scales` applied to the sums. */
static int gemm_panels(const uint16_t *x, const uint16_t *packed, const int8_t *packed_int8, const float *scales,
                       const uint16_t *bias, uint16_t *y, int64_t m_size, int64_t n_size, int64_t k_size) {
  if (!gemm_amx_available() || k_size % KSTEP || m_size <= 0) return 1;
  const int64_t num_panels = (n_size + PANEL - 1) / PANEL, num_steps = k_size / KSTEP;
  const int64_t full_rows = m_size / TILE * TILE, tail = m_size - full_rows;
  /* The last partial row tile, zero-padded (tiles always read 16 rows). */
  uint16_t *pad = NULL, *panels = NULL;
  if (tail) {
    pad = aligned_alloc(64, (size_t)TILE * k_size * 2);
    if (!pad) return 1;
    memset(pad, 0, (size_t)TILE * k_size * 2);
    memcpy(pad, x + full_rows * k_size, (size_t)tail * k_size * 2);
  }
  /* int8 over several row blocks: each thread keeps its widened panel (K * 64 bytes, in L2). */
  const int keep = packed_int8 && m_size > MBLOCK;
  if (keep && !(panels = aligned_alloc(64, (size_t)omp_get_max_threads() * num_steps * STEP_ELEMS * 2))) {
    free(pad);
    return 1;
  }
  const int64_t stride = k_size * 2;
#pragma omp parallel if (num_panels >= MIN_PARALLEL_PANELS)
  {
    load_uniform_tiles();
    float sums[MBLOCK * PANEL] __attribute__((aligned(64)));
    uint16_t ring[4 * STEP_ELEMS] __attribute__((aligned(64)));
    uint16_t *wide = keep ? panels + omp_get_thread_num() * num_steps * STEP_ELEMS : ring;
    for (int64_t c0 = 0; c0 < m_size; c0 += MCHUNK) {
      const int64_t c1 = m_size - c0 < MCHUNK ? m_size : c0 + MCHUNK;
#pragma omp for schedule(static)
      for (int64_t p = 0; p < num_panels; p++) {
        for (int64_t m0 = c0; m0 < c1; m0 += MBLOCK) {
          const int64_t rows = c1 - m0 < MBLOCK ? c1 - m0 : MBLOCK;
          const uint16_t *a0 = m0 < full_rows ? x + m0 * k_size : pad;
          const uint16_t *a1 = m0 + TILE < full_rows ? x + (m0 + TILE) * k_size : pad;
          if (packed_int8 && m0 == c0) /* the first row block widens the int8 panel */
            panel_block(a0, a1, stride, NULL, packed_int8 + p * num_steps * STEP_ELEMS, wide, keep ? -1 : 3,
                        num_steps, sums, rows > TILE, 1);
          else if (packed_int8)
            panel_block(a0, a1, stride, wide, NULL, NULL, 0, num_steps, sums, rows > TILE, 0);
          else
            panel_block(a0, a1, stride, packed + p * num_steps * STEP_ELEMS, NULL, NULL, 0, num_steps, sums,
                        rows > TILE, m0 == c0);
          store_block(sums, (int)rows, y + m0 * n_size, n_size, p * PANEL, bias, scales);
        }
      }
    }
    _tile_release();
  }
  free(pad);
  free(panels);
  return 0;
}

/* y [m_size, n_size] = x [m_size, k_size] W^T (+ bias); k_size a multiple of 32. Returns 0, or
 * 1 where the tile unit is not granted, K does not fit or memory ran out. */
int gemm_amx_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m_size,
                  int64_t n_size, int64_t k_size) {
  return gemm_panels(x, packed, NULL, NULL, bias, y, m_size, n_size, k_size);
}

/* The same for an int8 weight (packed by gemm_amx_int8w_pack) with a float32 scale per output
 * column (scales [n_size]): y = (x W_int8^T) * scale (+ bias), the scale applied to the float32 sums. */
int gemm_amx_int8w(const uint16_t *x, const int8_t *packed, const float *scales, const uint16_t *bias, uint16_t *y,
                   int64_t m_size, int64_t n_size, int64_t k_size) {
  return gemm_panels(x, NULL, packed, scales, bias, y, m_size, n_size, k_size);
}

#else
int gemm_amx_available(void) { return 0; }
int64_t gemm_amx_numel(int64_t n_size, int64_t k_size) { (void)n_size; (void)k_size; return 0; }
void gemm_amx_pack(const uint16_t *w, uint16_t *out, int64_t n_size, int64_t k_size) {
  (void)w; (void)out; (void)n_size; (void)k_size;
}
int gemm_amx_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t m_size,
                  int64_t n_size, int64_t k_size) {
  (void)x; (void)packed; (void)bias; (void)y; (void)m_size; (void)n_size; (void)k_size;
  return 1;
}
void gemm_amx_int8w_pack(const int8_t *w, int8_t *out, int64_t n_size, int64_t k_size) {
  (void)w; (void)out; (void)n_size; (void)k_size;
}
int gemm_amx_int8w(const uint16_t *x, const int8_t *packed, const float *scales, const uint16_t *bias, uint16_t *y,
                   int64_t m_size, int64_t n_size, int64_t k_size) {
  (void)x; (void)packed; (void)scales; (void)bias; (void)y; (void)m_size; (void)n_size; (void)k_size;
  return 1;
}
#endif
