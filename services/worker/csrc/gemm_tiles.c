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
 * 28.1 on oneDNN, 256 rows 151 against 166. */
#include <stdint.h>
#include <string.h>

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

/* w [n_size, k_size] row-major bfloat16 -> out [tiles][pairs][16][2]; zeros past N and K. */
void gemm_tiles_pack(const uint16_t *w, uint16_t *out, int64_t n_size, int64_t k_size) {
  const int64_t kp = num_pairs(k_size), tiles = (n_size + TILE - 1) / TILE;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; t++)
    for (int64_t p = 0; p < kp; p++)
      for (int c = 0; c < TILE; c++)
        for (int h = 0; h < 2; h++) {
          const int64_t n = t * TILE + c, k = 2 * p + h;
          out[((t * kp + p) * TILE + c) * 2 + h] = (n < n_size && k < k_size) ? w[n * k_size + k] : 0;
        }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

/* x's pair p of row m as one 32-bit lane; an odd K's last pair is (x[K-1], 0). */
static inline int32_t x_pair(const uint16_t *row, int64_t p, int64_t k_size) {
  uint32_t pair = row[2 * p];
  if (2 * p + 1 < k_size) pair |= (uint32_t)row[2 * p + 1] << 16;
  return (int32_t)pair;
}

/* sums [num_m][TN][16] of x rows [num_m, K] against tiles [num_t] starting at wt. Inlined with
 * constant num_m and num_t so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block(const uint16_t *x, const uint16_t *wt, int64_t k_size,
                                                        int64_t tile_stride, int num_m, int num_t, float *sums) {
  __m512 acc[MR][TN];
  for (int m = 0; m < num_m; m++)
    for (int t = 0; t < num_t; t++) acc[m][t] = _mm512_setzero_ps();
  const int64_t kp = num_pairs(k_size), full = k_size / 2;
  for (int64_t p = 0; p < kp; p++) {
    __m512bh w[TN];
    for (int t = 0; t < num_t; t++) {
      w[t] = (__m512bh)_mm512_loadu_si512(wt + t * tile_stride + p * 32);
      __builtin_prefetch(wt + t * tile_stride + (p + PREFETCH_PAIRS) * 32, 0, 1);
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

#define BLOCK_CASES(NT)                                                    \
  switch (num_m) {                                                         \
    case 1: block(xm, w, k_size, tile_stride, 1, NT, sums); break;         \
    case 2: block(xm, w, k_size, tile_stride, 2, NT, sums); break;         \
    case 3: block(xm, w, k_size, tile_stride, 3, NT, sums); break;         \
    case 4: block(xm, w, k_size, tile_stride, 4, NT, sums); break;         \
    case 5: block(xm, w, k_size, tile_stride, 5, NT, sums); break;         \
    case 6: block(xm, w, k_size, tile_stride, 6, NT, sums); break;         \
    case 7: block(xm, w, k_size, tile_stride, 7, NT, sums); break;         \
    default: block(xm, w, k_size, tile_stride, MR, NT, sums); break;       \
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
    for (int64_t m0 = 0; m0 < m_size; m0 += MR) {
      const int num_m = m_size - m0 < MR ? (int)(m_size - m0) : MR;
      const uint16_t *xm = x + m0 * k_size;
      if (num_t == 3) BLOCK_CASES(3) else if (num_t == 2) BLOCK_CASES(2) else BLOCK_CASES(1)
      for (int m = 0; m < num_m; m++)
        for (int t = 0; t < num_t; t++) {
          const int64_t n0 = (t0 + t) * TILE;
          const int cols = n_size - n0 < TILE ? (int)(n_size - n0) : TILE;
          const __mmask16 mask = (__mmask16)((1u << cols) - 1);
          __m512 v = _mm512_loadu_ps(sums + (m * TN + t) * TILE);
          if (bias) v = _mm512_add_ps(v, _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, bias + n0)));
          _mm256_mask_storeu_epi16(y + (m0 + m) * n_size + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
  }
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

int gemm_tiles_available(void) { return 0; }
#endif
