/* Matmuls of 1 to a few hundred rows on a bfloat16 weight repacked into column tiles, for CPUs
 * with AVX512_BF16: y [M, N] = x [M, K] W^T (+ b), x, y and b bfloat16, sums in float32.
 *
 * The weight is packed once (`gemm_tiles_pack`) into tiles of 16 output columns, each tile
 * [ceil(K/2)][16][2]: for every pair of input positions, the 16 columns' two weights side by side,
 * which is the operand layout of VDPBF16PS. A step multiplies a broadcast pair of x against a tile
 * vector, so there are no horizontal sums (the row-wise GEMV in gemv.c ends every output with one).
 * The register block is MR rows of x by TN tiles (24 accumulators of the 32 zmm); a thread takes
 * TN tiles at a time (a panel: K x 48 weights, 55 KB at K = 576) and runs every MR-row block of x
 * over it, so the panel streams from memory once and is re-read from L2 after that.
 *
 * Measured on a 2-core Zen 4 (SmolLM2-135M's four layer matmuls over 30 layers, weights from
 * memory, medians of 7; docs/benchmarks.md, "Column tiles"): 1 row 8-9 ms as the GEMV, 16 rows 12.7
 * ms against 17.2 on the GEMV and 21.9 on oneDNN's prepacked bfloat16 GEMM, 32 rows 20.0 against
 * 28.1 on oneDNN, 256 rows 151 against 166.
 *
 * Weight-only int8 (`--quantization int8`) uses the same tiles holding int8 (`gemm_tiles_pack_int8`,
 * half the bytes): each thread widens a panel to bfloat16 (exact: |q| <= 127 has 7 significant bits)
 * into its own buffer, which then stays in L1/L2 for every row block, and each column's scale
 * multiplies the float32 sums in the store (one rounding to bfloat16). Without AMX the alternatives
 * above the int8 GEMV's rows were PyTorch's int8pack_mm and a GEMM on a widened copy, which ran a
 * c=64 workload slower than bfloat16 weights. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_bf16.h"

#define TILE 16                   /* output columns per tile: one zmm of float32 sums */
#define MR 8                      /* x rows per register block */
#define TN 3                      /* tiles per register block and per thread's panel */
#define PREFETCH_PAIRS 32         /* pairs (64-byte lines of a tile) prefetched ahead, into L2 */
#define MIN_PARALLEL_WEIGHTS 65536 /* below this a thread team costs more than it saves */

static inline int64_t num_pairs(int64_t k_size) { return (k_size + 1) / 2; }

/* bfloat16 elements of the packed form of a [n_size, k_size] weight. */
int64_t gemm_tiles_numel(int64_t n_size, int64_t k_size) {
  return (n_size + TILE - 1) / TILE * num_pairs(k_size) * TILE * 2;
}

/* w [n_size, k_size] row-major -> out [tiles][pairs][16][2]; zeros past N and K. */
#define DEFINE_TILE_PACK(NAME, T)                                                                    \
  void NAME(const T *w, T *out, int64_t n_size, int64_t k_size) {                                    \
    const int64_t kp = num_pairs(k_size), tiles = (n_size + TILE - 1) / TILE;                        \
    _Pragma("omp parallel for schedule(static)")                                                     \
    for (int64_t t = 0; t < tiles; t++)                                                              \
      for (int64_t p = 0; p < kp; p++)                                                               \
        for (int c = 0; c < TILE; c++)                                                               \
          for (int h = 0; h < 2; h++) {                                                              \
            const int64_t n = t * TILE + c, k = 2 * p + h;                                           \
            out[((t * kp + p) * TILE + c) * 2 + h] = n < n_size && k < k_size ? w[n * k_size + k] : 0;   \
          }                                                                                          \
  }

DEFINE_TILE_PACK(gemm_tiles_pack, uint16_t)
DEFINE_TILE_PACK(pack_int8_tile_order, int8_t)

/* Whether int8 tiles are stored for the byte table (int8_bf16.h): where the library has it and a
 * tile is whole lines (an even number of pairs), so every panel starts on a line. */
static inline int table_ordered(int64_t k_size) { return HAS_INT8_BF16_TABLE && num_pairs(k_size) % 2 == 0; }

/* The same layout for int8 q [n_size, k_size], each line's bytes in the byte table's order where
 * `table_ordered`. */
void gemm_tiles_pack_int8(const int8_t *q, int8_t *out, int64_t n_size, int64_t k_size) {
  pack_int8_tile_order(q, out, n_size, k_size);
#if HAS_INT8_BF16_TABLE
  if (table_ordered(k_size)) order_lines_for_table(out, gemm_tiles_numel(n_size, k_size));
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

/* x's pair p of row m as one 32-bit lane; an odd K's last pair is (x[K-1], 0). */
static inline int32_t x_pair(const uint16_t *row, int64_t p, int64_t k_size) {
  uint32_t pair = row[2 * p];
  if (2 * p + 1 < k_size) pair |= (uint32_t)row[2 * p + 1] << 16;
  return (int32_t)pair;
}

/* sums [num_m][TN][16] of x rows [num_m, K] against tiles [num_t] starting at wt. Inlined with
 * constant num_m and num_t so the accumulators stay in registers. Each tile's line pf_ahead
 * elements on is prefetched into L2. `next` (or NULL): an int8 panel of TN tiles brought into L2
 * meanwhile, 96 bytes a pair. */
static inline __attribute__((always_inline)) void block(const uint16_t *x, const uint16_t *wt, int64_t k_size,
                                                        int64_t tile_stride, int64_t pf_ahead, int num_m, int num_t,
                                                        float *sums, const int8_t *next) {
  __m512 acc[MR][TN];
  for (int m = 0; m < num_m; m++)
    for (int t = 0; t < num_t; t++) acc[m][t] = _mm512_setzero_ps();
  const int64_t kp = num_pairs(k_size), full = k_size / 2;
  for (int64_t p = 0; p < kp; p++) {
    __m512bh w[TN];
    for (int t = 0; t < num_t; t++) {
      w[t] = (__m512bh)_mm512_loadu_si512(wt + t * tile_stride + p * 32);
      __builtin_prefetch(wt + t * tile_stride + p * 32 + pf_ahead, 0, 1);
    }
    if (next) {
      __builtin_prefetch(next + 96 * p, 0, 2);
      __builtin_prefetch(next + 96 * p + 64, 0, 2);
    }
    for (int m = 0; m < num_m; m++) {
      int32_t pair;
      if (p < full) memcpy(&pair, x + m * k_size + 2 * p, sizeof pair);
      else pair = x_pair(x + m * k_size, p, k_size);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < num_t; t++) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xb, w[t]);
    }
  }
  for (int m = 0; m < num_m; m++)
    for (int t = 0; t < num_t; t++) _mm512_storeu_ps(sums + (m * TN + t) * TILE, acc[m][t]);
}

/* A block's sums [num_m][TN][16] (times each column's scale where scales is not NULL, + bias) into
 * rows y [num_m, n_size] from column n0, rounded once to bfloat16; only the columns below n_size. */
static inline void store_rows(const float *sums, int num_m, int num_t, int64_t n0, const float *scales,
                              const uint16_t *bias, uint16_t *y, int64_t n_size) {
  for (int m = 0; m < num_m; m++)
    for (int t = 0; t < num_t; t++) {
      const int64_t n = n0 + t * TILE;
      const int cols = n_size - n < TILE ? (int)(n_size - n) : TILE;
      const __mmask16 mask = (__mmask16)((1u << cols) - 1);
      __m512 v = _mm512_loadu_ps(sums + (m * TN + t) * TILE);
      if (scales) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, scales + n));
      if (bias) v = _mm512_add_ps(v, _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, bias + n)));
      _mm256_mask_storeu_epi16(y + m * n_size + n, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

#define BLOCK_CASES(NT)                                                                   \
  switch (num_m) {                                                                        \
    case 1: block(xm, w, k_size, tile_stride, pf_ahead, 1, NT, sums, next); break;        \
    case 2: block(xm, w, k_size, tile_stride, pf_ahead, 2, NT, sums, next); break;        \
    case 3: block(xm, w, k_size, tile_stride, pf_ahead, 3, NT, sums, next); break;        \
    case 4: block(xm, w, k_size, tile_stride, pf_ahead, 4, NT, sums, next); break;        \
    case 5: block(xm, w, k_size, tile_stride, pf_ahead, 5, NT, sums, next); break;        \
    case 6: block(xm, w, k_size, tile_stride, pf_ahead, 6, NT, sums, next); break;        \
    case 7: block(xm, w, k_size, tile_stride, pf_ahead, 7, NT, sums, next); break;        \
    default: block(xm, w, k_size, tile_stride, pf_ahead, MR, NT, sums, next); break;      \
  }

/* wt from gemm_tiles_pack; returns 0. */
int gemm_tiles_bf16(const uint16_t *x, const uint16_t *wt, const uint16_t *bias, uint16_t *y, int64_t m_size,
                    int64_t n_size, int64_t k_size) {
  const int64_t tiles = (n_size + TILE - 1) / TILE, tile_stride = num_pairs(k_size) * TILE * 2;
  const int64_t num_panels = (tiles + TN - 1) / TN;
#pragma omp parallel for schedule(static) if (n_size * k_size >= MIN_PARALLEL_WEIGHTS)
  for (int64_t g = 0; g < num_panels; g++) {
    float sums[MR * TN * TILE];
    const int64_t t0 = g * TN;
    const int num_t = tiles - t0 < TN ? (int)(tiles - t0) : TN;
    const uint16_t *w = wt + t0 * tile_stride;
    const int8_t *next = NULL;
    for (int64_t m0 = 0; m0 < m_size; m0 += MR) {
      const int num_m = m_size - m0 < MR ? (int)(m_size - m0) : MR;
      const uint16_t *xm = x + m0 * k_size;
      /* The first block reads the panel from memory; the second, from L2, prefetches the next one
       * (past the last panel: a prefetch never faults), so that memory stays busy under the later
       * blocks (30 layers' matmuls at 12 / 20 / 40 / 64 rows 1.08 / 1.12 / 1.07 / 1.03x on a Zen 4). */
      const int64_t pf_ahead = m0 == MR ? TN * tile_stride : PREFETCH_PAIRS * 32;
      if (num_t == 3) BLOCK_CASES(3) else if (num_t == 2) BLOCK_CASES(2) else BLOCK_CASES(1)
      store_rows(sums, num_m, num_t, t0 * TILE, NULL, bias, y + m0 * n_size, n_size);
    }
  }
  return 0;
}

/* n int8 values (a multiple of 32, as a tile is; of 64 where `ordered`) -> bfloat16, exactly: by
 * the byte table, 6 instructions a line where the float32 route takes 14 (both measured alike at
 * 20 rows, 16.3 / 16.5 ms for SmolLM2-135M's 30 layers). Widening is what the int8 tiles pay over
 * the bfloat16 ones: about 3 ms of 15 at 20 rows on a Zen 4, where skipping it ran 11.3 ms. */
static void widen_int8(const int8_t *src, uint16_t *dst, int64_t n, int ordered) {
#if HAS_INT8_BF16_TABLE
  if (ordered) {
    const Bf16Tables t = load_bf16_tables();
    for (int64_t i = 0; i < n; i += 64) {
      __m512bh lo, hi;
      int8_line_to_bf16(&t, _mm512_loadu_si512(src + i), &lo, &hi);
      _mm512_storeu_si512(dst + i, (__m512i)lo);
      _mm512_storeu_si512(dst + i + 32, (__m512i)hi);
    }
    return;
  }
#else
  (void)ordered;
#endif
  for (int64_t i = 0; i < n; i += 32) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(src + i));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
    _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

/* y [M, N] = x [M, K] (scales_n q_n)^T (+ b), x, y, b bfloat16, wt from gemm_tiles_pack_int8.
 * Returns 0, or -1 where memory for the widened panels ran out. */
int gemm_tiles_int8w_bf16(const uint16_t *x, const int8_t *wt, const float *scales, const uint16_t *bias,
                          uint16_t *y, int64_t m_size, int64_t n_size, int64_t k_size) {
  const int64_t tiles = (n_size + TILE - 1) / TILE, tile_stride = num_pairs(k_size) * TILE * 2;
  const int64_t num_panels = (tiles + TN - 1) / TN;
  const int parallel = n_size * k_size >= MIN_PARALLEL_WEIGHTS, ordered = table_ordered(k_size);
  uint16_t *panels = malloc(sizeof(uint16_t) * (size_t)(TN * tile_stride) * (size_t)omp_get_max_threads());
  if (!panels) return -1;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t g = 0; g < num_panels; g++) {
    float sums[MR * TN * TILE];
    uint16_t *w = panels + (int64_t)omp_get_thread_num() * TN * tile_stride;
    const int64_t t0 = g * TN;
    const int num_t = tiles - t0 < TN ? (int)(tiles - t0) : TN;
    widen_int8(wt + t0 * tile_stride, w, num_t * tile_stride, ordered);
    for (int64_t m0 = 0; m0 < m_size; m0 += MR) {
      const int num_m = m_size - m0 < MR ? (int)(m_size - m0) : MR;
      const uint16_t *xm = x + m0 * k_size;
      const int64_t pf_ahead = PREFETCH_PAIRS * 32; /* the widened panel is in L1 / L2 */
      /* The first row block brings the next panel (this thread's, under the static schedule) into
       * L2, so that widening it reads no memory (a prefetch past the weight cannot fault). */
      const int8_t *next = m0 == 0 && g + 1 < num_panels ? wt + (t0 + TN) * tile_stride : NULL;
      if (num_t == 3) BLOCK_CASES(3) else if (num_t == 2) BLOCK_CASES(2) else BLOCK_CASES(1)
      store_rows(sums, num_m, num_t, t0 * TILE, scales, bias, y + m0 * n_size, n_size);
    }
  }
  free(panels);
  return 0;
}

int gemm_tiles_available(void) { return 1; }
#else
/* Built without AVX512_BF16: the tiles are not used (gemv.c's widening GEMV serves instead). */
int gemm_tiles_bf16(const uint16_t *x, const uint16_t *wt, const uint16_t *bias, uint16_t *y, int64_t m_size,
                    int64_t n_size, int64_t k_size) {
  (void)x, (void)wt, (void)bias, (void)y, (void)m_size, (void)n_size, (void)k_size;
  return -1;
}

int gemm_tiles_int8w_bf16(const uint16_t *x, const int8_t *wt, const float *scales, const uint16_t *bias,
                          uint16_t *y, int64_t m_size, int64_t n_size, int64_t k_size) {
  (void)x, (void)wt, (void)scales, (void)bias, (void)y, (void)m_size, (void)n_size, (void)k_size;
  return -1;
}

int gemm_tiles_available(void) { return 0; }
#endif
