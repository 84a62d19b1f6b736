/* W8A8 matmuls of a few dozen to a few hundred rows on VNNI (`--quantization w8a8`): y [M, N] =
 * dequantize(quantize(x) W^T) for bfloat16 x, int8 W with a float32 scale per output channel.
 *
 * oneDNN's int8 GEMM (w8a8.py) ran a 40-row decode step of SmolLM2-135M slower than the bfloat16
 * column tiles (gemm_tiles.c), which read twice the bytes: these are the same column tiles for
 * VPDPBUSD. The weight is packed once into tiles of 16 output columns, each [ceil(K/4)][16][4]
 * (every 4 input positions of the 16 columns side by side: one zmm), after the tile's int32
 * column sums. x's rows are quantized as w8a8.c quantizes them (int8_quant.h: per row, symmetric)
 * and offset by 128 into uint8, which VPDPBUSD multiplies by int8; sum_k (q_k + 128) w_k less 128
 * times the column sum is then exactly the int32 sum oneDNN returns, and the rows are scaled back
 * by w8a8.c's own row pass, so the output equals the oneDNN path's bit for bit. MR rows by TN tiles
 * of int32 accumulators, a thread's panel of TN tiles streamed once, as in gemm_tiles.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_quant.h"

#define TILE 16
#define MR 8
#define TN 3
#define PREFETCH_QUADS 16          /* 64-byte lines of a tile prefetched ahead, into L2 */
#define MIN_PARALLEL_WEIGHTS 65536 /* below this a thread team costs more than it saves */
#define MIN_PARALLEL_ELEMENTS 32768

static inline int64_t num_quads(int64_t k_size) { return (k_size + 3) / 4; }
static inline int64_t num_tiles(int64_t n_size) { return (n_size + TILE - 1) / TILE; }
/* Bytes of one tile: its 16 int32 column sums, then its quads. */
static inline int64_t tile_bytes(int64_t k_size) { return TILE * 4 + num_quads(k_size) * TILE * 4; }

int64_t int8_tiles_nbytes(int64_t n_size, int64_t k_size) { return num_tiles(n_size) * tile_bytes(k_size); }

/* w [n_size, k_size] int8 row-major -> out: per tile, int32 sums [16] of its columns, then
 * [quads][16][4]; zeros past N and K. */
void int8_tiles_pack(const int8_t *w, int8_t *out, int64_t n_size, int64_t k_size) {
  const int64_t kq = num_quads(k_size), tiles = num_tiles(n_size), stride = tile_bytes(k_size);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; t++) {
    int8_t *tile = out + t * stride;
    int32_t sums[TILE];
    for (int c = 0; c < TILE; c++) {
      const int64_t n = t * TILE + c;
      int32_t s = 0;
      for (int64_t k = 0; n < n_size && k < k_size; k++) s += w[n * k_size + k];
      sums[c] = s;
    }
    memcpy(tile, sums, sizeof sums);
    for (int64_t q = 0; q < kq; q++)
      for (int c = 0; c < TILE; c++)
        for (int h = 0; h < 4; h++) {
          const int64_t n = t * TILE + c, k = 4 * q + h;
          tile[TILE * 4 + (q * TILE + c) * 4 + h] = (n < n_size && k < k_size) ? w[n * k_size + k] : 0;
        }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>

/* acc + VPDPBUSD(u, s) (as _mm512_dpbusd_epi32), as an asm statement: around the intrinsic GCC 12
 * copied each accumulator to another register and back for every product of the loop, and the
 * tiles ran 1.4x slower (40 rows: 13.9 against 9.7 ms for 30 layers' matmuls). */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

/* int32 sums [num_m][TN][16] of uint8 rows xq [num_m, 4 kq] against tiles [num_t] at wt, less 128
 * times each column's sum. Inlined with constant num_m and num_t (accumulators in registers). */
static inline __attribute__((always_inline)) void block(const uint8_t *xq, int64_t x_stride, const int8_t *wt,
                                                        int64_t kq, int64_t stride, int num_m, int num_t,
                                                        int32_t *sums) {
  __m512i acc[MR][TN];
  for (int m = 0; m < num_m; m++)
    for (int t = 0; t < num_t; t++) acc[m][t] = _mm512_setzero_si512();
  for (int64_t q = 0; q < kq; q++) {
    __m512i w[TN];
    for (int t = 0; t < num_t; t++) {
      const int8_t *quad = wt + t * stride + TILE * 4 + q * TILE * 4;
      w[t] = _mm512_loadu_si512(quad);
      __builtin_prefetch(quad + PREFETCH_QUADS * TILE * 4, 0, 1);
    }
    for (int m = 0; m < num_m; m++) {
      int32_t four;
      memcpy(&four, xq + m * x_stride + 4 * q, sizeof four);
      const __m512i xb = _mm512_set1_epi32(four);
      for (int t = 0; t < num_t; t++) acc[m][t] = dpbusd(acc[m][t], xb, w[t]);
    }
  }
  for (int t = 0; t < num_t; t++) {
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(wt + t * stride), 7); /* 128 x column sums */
    for (int m = 0; m < num_m; m++)
      _mm512_storeu_si512(sums + (m * TN + t) * TILE, _mm512_sub_epi32(acc[m][t], offset));
  }
}

#define BLOCK_CASES(NT)                                                            \
  switch (num_m) {                                                                 \
    case 1: block(xm, x_stride, w, kq, stride, 1, NT, sums); break;                \
    case 2: block(xm, x_stride, w, kq, stride, 2, NT, sums); break;                \
    case 3: block(xm, x_stride, w, kq, stride, 3, NT, sums); break;                \
    case 4: block(xm, x_stride, w, kq, stride, 4, NT, sums); break;                \
    case 5: block(xm, x_stride, w, kq, stride, 5, NT, sums); break;                \
    case 6: block(xm, x_stride, w, kq, stride, 6, NT, sums); break;                \
    case 7: block(xm, x_stride, w, kq, stride, 7, NT, sums); break;                \
    default: block(xm, x_stride, w, kq, stride, MR, NT, sums); break;              \
  }

/* x [m_size, k_size] bfloat16, wt from int8_tiles_pack, w_scales [n_size], bias [n_size] bfloat16
 * or NULL -> y [m_size, n_size] bfloat16. Returns 0, or -1 where memory ran out. */
int int8_tiles_bf16(const uint16_t *x, const int8_t *wt, const float *w_scales, const uint16_t *bias, uint16_t *y,
                    int64_t m_size, int64_t n_size, int64_t k_size) {
  const int64_t kq = num_quads(k_size), x_stride = 4 * kq, stride = tile_bytes(k_size);
  const int64_t num_panels = (num_tiles(n_size) + TN - 1) / TN;
  uint8_t *xq = calloc((size_t)(m_size * x_stride), 1);
  float *x_scales = malloc(sizeof(float) * (size_t)(m_size > 0 ? m_size : 1));
  if (!xq || !x_scales) {
    free(xq), free(x_scales);
    return -1;
  }
#pragma omp parallel for schedule(static) if (m_size * k_size >= MIN_PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < m_size; r++) {
    int8_t *row = (int8_t *)(xq + r * x_stride);
    quantize_row_int8_bf16(x + r * k_size, k_size, row, &x_scales[r]);
    for (int64_t i = 0; i < k_size; i++) row[i] = (int8_t)((uint8_t)row[i] ^ 0x80); /* + 128 as uint8 */
  }
#pragma omp parallel for schedule(static) if (n_size * k_size >= MIN_PARALLEL_WEIGHTS)
  for (int64_t g = 0; g < num_panels; g++) {
    int32_t sums[MR * TN * TILE];
    const int64_t t0 = g * TN;
    const int num_t = num_tiles(n_size) - t0 < TN ? (int)(num_tiles(n_size) - t0) : TN;
    const int8_t *w = wt + t0 * stride;
    for (int64_t m0 = 0; m0 < m_size; m0 += MR) {
      const int num_m = m_size - m0 < MR ? (int)(m_size - m0) : MR;
      const uint8_t *xm = xq + m0 * x_stride;
      if (num_t == 3) BLOCK_CASES(3) else if (num_t == 2) BLOCK_CASES(2) else BLOCK_CASES(1)
      const int64_t n0 = t0 * TILE;
      const int64_t cols = n_size - n0 < num_t * TILE ? n_size - n0 : num_t * TILE;
      for (int m = 0; m < num_m; m++) {
        int32_t row[TN * TILE];
        for (int t = 0; t < num_t; t++) memcpy(row + t * TILE, sums + (m * TN + t) * TILE, TILE * sizeof(int32_t));
        dequantize_row_int32_bf16(row, x_scales[m0 + m], w_scales + n0, bias ? bias + n0 : NULL,
                                  y + (m0 + m) * n_size + n0, cols);
      }
    }
  }
  free(xq), free(x_scales);
  return 0;
}

int int8_tiles_available(void) { return 1; }
#else
/* Built without AVX512_VNNI: W8A8 stays on oneDNN's int8 GEMM. */
int int8_tiles_bf16(const uint16_t *x, const int8_t *wt, const float *w_scales, const uint16_t *bias, uint16_t *y,
                    int64_t m_size, int64_t n_size, int64_t k_size) {
  (void)x, (void)wt, (void)w_scales, (void)bias, (void)y, (void)m_size, (void)n_size, (void)k_size;
  return -1;
}

int int8_tiles_available(void) { return 0; }
#endif
