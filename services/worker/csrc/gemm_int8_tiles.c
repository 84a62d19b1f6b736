/* W8A8 matmuls on VNNI (`--quantization w8a8`): y [M, N] = dequantize(quantize(x) W^T) for
 * bfloat16 x and a uint8 weight u with a zero point z_n and a float32 scale s_n per output channel,
 * W = s_n (u - z_n): symmetric int8 as u = w + 128, z = 128, or asymmetric (the channel's range
 * over [0, 255], as OpenVINO compresses int8 weights).
 *
 * oneDNN's int8 GEMM (w8a8.py) ran a 40-row decode step of SmolLM2-135M slower than the bfloat16
 * column tiles (gemm_tiles.c), which read twice the bytes: these are the same column tiles for
 * VPDPBUSD. The weight is packed once into tiles of 16 output columns, each [ceil(K/4)][16][4]
 * (every 4 input positions of the 16 columns side by side: one zmm) of u, which VPDPBUSD
 * multiplies by the int8 activations (broadcast from memory, four at a time), followed by the
 * int32 zero points; sum_k u_k q_k less z_n times the sum of the row's q is sum_k (u_k - z_n) q_k,
 * for symmetric weights the int32 sum oneDNN returns.
 *
 * x's rows are quantized in groups of `group_size` values (int8_quant.h's symmetric rule per
 * group; 16 groups at a time where whole groups of 16-64 values fit, int8_groups.h), a group never
 * smaller than 4 or split inside a quad:
 * - One group per row (group_size 0 or >= K) is w8a8.c's per-row rule: the row's int32 sums are
 *   exact and are scaled back by w8a8.c's own row pass, so with symmetric weights the output
 *   equals the oneDNN path's bit for bit.
 * - Smaller groups (OpenVINO's CPU plugin quantizes activations in groups of 32) move greedy output
 *   less, as one outlier no longer coarsens the whole row: each group's int32 sums are converted
 *   and added in float32 times that group's scale, and the zero points are taken off once per row
 *   and column (z_n sum_g scale_g sum(q in g), the sum a float32 per row).
 * MR rows by TN tiles of accumulators, a thread's panel of TN tiles streamed once, as in
 * gemm_tiles.c; groups keep float32 sums beside the int32 ones, so take fewer rows and tiles, and
 * panels of TN_G tiles (in panels of TN, every third tile ran in blocks of one tile: 3-7% slower).
 * A panel is read from memory by its first block of rows; the second block, reading it from cache,
 * prefetches the next panel into L2, so that more than one block of rows keeps memory busy
 * (30 layers' matmuls in groups of 32 at 12 / 20 / 40 / 64 rows 1.41 / 1.22 / 1.10 / 1.07x). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "int8_groups.h"
#include "int8_quant.h"

#define TILE 16
#define MR 8   /* rows per block, one group per row */
/* With groups, float32 sums beside the int32 ones: MR_G rows by TN_G tiles of each, within the
 * panel. At 40-2,048 rows 6 x 2 ran 1.0-1.2x faster than 4 x 3, 5 x 2, 7 x 2, 8 x 1 and 8 x 2. */
#define MR_G 6
#define TN_G 2
#define TN 3
#define PREFETCH_QUADS 16          /* 64-byte lines of a tile prefetched ahead, into L2 */
#define MIN_PARALLEL_WEIGHTS 65536 /* below this a thread team costs more than it saves */
/* Activation elements from which the rows are quantized by the thread team: a decode step's 20-40
 * rows of 576 took the calling thread alone while the other waited (30 layers' matmuls at 20 rows
 * 11.3 -> 10.5 ms, 64 rows level, with 32768 here before). */
#define MIN_PARALLEL_ELEMENTS 4096

static inline int64_t num_quads(int64_t k_size) { return (k_size + 3) / 4; }
static inline int64_t num_tiles(int64_t n_size) { return (n_size + TILE - 1) / TILE; }
static inline int64_t tile_bytes(int64_t k_size) { return num_quads(k_size) * TILE * 4; }

/* The tiles, then an int32 zero point per column (16 per tile). */
int64_t int8_tiles_nbytes(int64_t n_size, int64_t k_size) {
  return num_tiles(n_size) * (tile_bytes(k_size) + TILE * (int64_t)sizeof(int32_t));
}

static inline const int32_t *zero_points_of(const uint8_t *wt, int64_t n_size, int64_t k_size) {
  return (const int32_t *)(wt + num_tiles(n_size) * tile_bytes(k_size));
}

/* u [n_size, k_size] uint8 row-major, zero_points [n_size] -> out: per tile [quads][16][4] of u,
 * then the zero points; past N and K zeros (the activations are 0 past K, columns past N unread). */
void int8_tiles_pack(const uint8_t *u, const int32_t *zero_points, uint8_t *out, int64_t n_size, int64_t k_size) {
  const int64_t kq = num_quads(k_size), tiles = num_tiles(n_size), stride = tile_bytes(k_size);
  int32_t *zeros = (int32_t *)(out + tiles * stride);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; t++) {
    uint8_t *tile = out + t * stride;
    for (int64_t q = 0; q < kq; q++)
      for (int c = 0; c < TILE; c++)
        for (int h = 0; h < 4; h++) {
          const int64_t n = t * TILE + c, k = 4 * q + h;
          tile[(q * TILE + c) * 4 + h] = n < n_size && k < k_size ? u[n * k_size + k] : 0;
        }
    for (int c = 0; c < TILE; c++) zeros[t * TILE + c] = t * TILE + c < n_size ? zero_points[t * TILE + c] : 0;
  }
}

/* The group size the kernel takes: whole quads, one group per row for 0 or >= k_size. */
static inline int64_t quads_per_group(int64_t group_size, int64_t k_size) {
  const int64_t kq = num_quads(k_size);
  if (group_size <= 0 || group_size >= k_size) return kq;
  return group_size < 4 ? 1 : group_size / 4;
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>

/* acc + VPDPBUSD(w, four int8 at x broadcast): as an asm statement, with the broadcast folded into
 * the instruction. Around the intrinsic GCC 12 copied each accumulator to another register and
 * back for every product of the loop, and the tiles ran 1.4x slower. */
static inline __attribute__((always_inline)) __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t *x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
  return acc;
}

/* int32 sums of quads [q0, q1) of int8 rows xq [num_m] against num_t uint8 tiles at wt, added to acc;
 * each tile's line pf_ahead bytes on is prefetched. */
#define DOT_QUADS(ROWS)                                                       \
  for (int64_t q = q0; q < q1; q++) {                                         \
    __m512i w[TN];                                                            \
    for (int t = 0; t < num_t; t++) {                                         \
      const uint8_t *quad = wt + t * stride + q * TILE * 4;                   \
      w[t] = _mm512_loadu_si512(quad);                                        \
      __builtin_prefetch(quad + pf_ahead, 0, 1);                              \
    }                                                                         \
    for (int m = 0; m < (ROWS); m++)                                          \
      for (int t = 0; t < num_t; t++)                                         \
        acc[m][t] = dpbusd_bcast(acc[m][t], w[t], xq + m * x_stride + 4 * q); \
  }

/* One group per row: exact int32 sums [num_m][TN][16], less each column's zero point (zeros) times
 * each row's sum of q. Inlined with constant num_m and num_t (accumulators in registers). */
static inline __attribute__((always_inline)) void block_rows(const int8_t *xq, int64_t x_stride,
                                                             const int32_t *x_sums, const uint8_t *wt,
                                                             const int32_t *zeros, int64_t kq, int64_t stride,
                                                             int64_t pf_ahead, int num_m, int num_t, int32_t *sums) {
  __m512i acc[MR][TN];
  for (int m = 0; m < num_m; m++)
    for (int t = 0; t < num_t; t++) acc[m][t] = _mm512_setzero_si512();
  const int64_t q0 = 0, q1 = kq;
  DOT_QUADS(num_m)
  __m512i z[TN];
  for (int t = 0; t < num_t; t++) z[t] = _mm512_loadu_si512(zeros + t * TILE);
  for (int m = 0; m < num_m; m++) {
    const __m512i x_sum = _mm512_set1_epi32(x_sums[m]);
    for (int t = 0; t < num_t; t++)
      _mm512_storeu_si512(sums + (m * TN + t) * TILE, _mm512_sub_epi32(acc[m][t], _mm512_mullo_epi32(x_sum, z[t])));
  }
}

/* Groups of gq quads: float32 sums [num_m][num_t][16] (rows TN tiles apart) of each group's int32
 * sums times its scale (x_scales [num_m][num_groups]), the zero points still in them. */
static inline __attribute__((always_inline)) void block_groups(const int8_t *xq, int64_t x_stride,
                                                               const float *x_scales, int64_t num_groups,
                                                               const uint8_t *wt, int64_t kq, int64_t gq,
                                                               int64_t stride, int64_t pf_ahead, int num_m, int num_t,
                                                               float *sums) {
  __m512 f[MR_G][TN_G];
  for (int m = 0; m < num_m; m++)
    for (int t = 0; t < num_t; t++) f[m][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; g++) {
    const int64_t q0 = g * gq, q1 = q0 + gq < kq ? q0 + gq : kq;
    __m512i acc[MR_G][TN_G];
    for (int m = 0; m < num_m; m++)
      for (int t = 0; t < num_t; t++) acc[m][t] = _mm512_setzero_si512();
    DOT_QUADS(num_m)
    for (int m = 0; m < num_m; m++) {
      const __m512 scale = _mm512_set1_ps(x_scales[m * num_groups + g]);
      for (int t = 0; t < num_t; t++) f[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][t]), scale, f[m][t]);
    }
  }
  for (int m = 0; m < num_m; m++)
    for (int t = 0; t < num_t; t++) _mm512_storeu_ps(sums + (m * TN + t) * TILE, f[m][t]);
}

#define ROWS_CASES(NT)                                                                          \
  switch (num_m) {                                                                              \
    case 1: block_rows(xm, x_stride, sm, w, zw, kq, stride, pf_ahead, 1, NT, isums); break;     \
    case 2: block_rows(xm, x_stride, sm, w, zw, kq, stride, pf_ahead, 2, NT, isums); break;     \
    case 3: block_rows(xm, x_stride, sm, w, zw, kq, stride, pf_ahead, 3, NT, isums); break;     \
    case 4: block_rows(xm, x_stride, sm, w, zw, kq, stride, pf_ahead, 4, NT, isums); break;     \
    case 5: block_rows(xm, x_stride, sm, w, zw, kq, stride, pf_ahead, 5, NT, isums); break;     \
    case 6: block_rows(xm, x_stride, sm, w, zw, kq, stride, pf_ahead, 6, NT, isums); break;     \
    case 7: block_rows(xm, x_stride, sm, w, zw, kq, stride, pf_ahead, 7, NT, isums); break;     \
    default: block_rows(xm, x_stride, sm, w, zw, kq, stride, pf_ahead, MR, NT, isums); break;   \
  }

#define GROUPS_CASE(M, NT) \
  block_groups(xm, x_stride, scm, num_groups, w, kq, gq, stride, pf_ahead, M, NT, fsums)
#define GROUPS_CASES(NT)                            \
  switch (num_m) {                                  \
    case 1: GROUPS_CASE(1, NT); break;              \
    case 2: GROUPS_CASE(2, NT); break;              \
    case 3: GROUPS_CASE(3, NT); break;              \
    case 4: GROUPS_CASE(4, NT); break;              \
    case 5: GROUPS_CASE(5, NT); break;              \
    default: GROUPS_CASE(MR_G, NT); break;          \
  }

/* y[c] = (f[c] - zeros[c] q_sum) * w_scales[c] (+ bias[c]) in float32, rounded once to bfloat16. */
static void dequantize_row_groups_bf16(const float *f, float q_sum, const int32_t *zeros, const float *w_scales,
                                       const uint16_t *bias, uint16_t *y, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; c++)
    y[c] = f32_to_bf16((f[c] - (float)zeros[c] * q_sum) * w_scales[c] + (bias ? bf16_to_f32(bias[c]) : 0.f));
}

/* x [m_size, k_size] bfloat16 in groups of group_size values (0: one per row), wt from
 * int8_tiles_pack, w_scales [n_size], bias [n_size] bfloat16 or NULL -> y [m_size, n_size]
 * bfloat16. Returns 0, or -1 where memory ran out. */
int int8_tiles_bf16(const uint16_t *x, const uint8_t *wt, const float *w_scales, const uint16_t *bias, uint16_t *y,
                    int64_t m_size, int64_t n_size, int64_t k_size, int64_t group_size) {
  const int64_t kq = num_quads(k_size), x_stride = 4 * kq, stride = tile_bytes(k_size);
  const int64_t gq = quads_per_group(group_size, k_size), num_groups = (kq + gq - 1) / gq;
  /* A panel's tiles and a block's rows. */
  const int64_t tn = num_groups == 1 ? TN : TN_G, mr = num_groups == 1 ? MR : MR_G;
  const int64_t num_panels = (num_tiles(n_size) + tn - 1) / tn, rows = m_size > 0 ? m_size : 1;
  /* Not calloc: on the worker's kept heap that zeroes every row serially (3 MB at 2,048 rows of
   * 1,536) while the other threads wait; only each row's padding past k_size is zeroed, below. */
  int8_t *xq = malloc((size_t)(rows * x_stride));
  float *x_scales = malloc(sizeof(float) * (size_t)(rows * num_groups));
  int32_t *x_sums = malloc(sizeof(int32_t) * (size_t)rows);
  float *q_sums = malloc(sizeof(float) * (size_t)rows); /* sum_g scale_g sum(q in g) */
  const int32_t *zero_points = zero_points_of(wt, n_size, k_size);
  if (!xq || !x_scales || !x_sums || !q_sums) {
    free(xq), free(x_scales), free(x_sums), free(q_sums);
    return -1;
  }
#if INT8_GROUPS_HAS_16_LANES
  if (num_groups > 1 && int8_groups_fit_16_lanes(k_size, 4 * gq)) { /* whole groups: rows of x_stride = k_size */
#pragma omp parallel if (m_size * k_size >= MIN_PARALLEL_ELEMENTS)
    {
      const int64_t num_threads = omp_get_num_threads(), thread = omp_get_thread_num();
      const int64_t r0 = m_size * thread / num_threads, r1 = m_size * (thread + 1) / num_threads;
      quantize_rows_groups16_bf16(x + r0 * k_size, r1 - r0, k_size, 4 * gq, xq + r0 * x_stride,
                                  x_scales + r0 * num_groups, x_sums + r0, q_sums + r0);
    }
  } else
#endif
  {
#pragma omp parallel for schedule(static) if (m_size * k_size >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < m_size; r++) {
      int8_t *row = xq + r * x_stride;
      memset(row + k_size, 0, (size_t)(x_stride - k_size));
      int32_t row_sum = 0;
      float q_sum = 0.f;
      for (int64_t g = 0; g < num_groups; g++) {
        const int64_t k0 = 4 * g * gq, k1 = k0 + 4 * gq < k_size ? k0 + 4 * gq : k_size;
        float *scale = x_scales + r * num_groups + g;
        const int32_t sum = quantize_row_int8_sum_bf16(x + r * k_size + k0, k1 - k0, row + k0, scale);
        row_sum += sum;
        q_sum = fmaf(*scale, (float)sum, q_sum); /* as quantize_rows_groups16_bf16 adds them */
      }
      x_sums[r] = row_sum, q_sums[r] = q_sum;
    }
  }
#pragma omp parallel for schedule(static) if (n_size * k_size >= MIN_PARALLEL_WEIGHTS)
  for (int64_t p = 0; p < num_panels; p++) {
    int32_t isums[MR * TN * TILE];
    float fsums[MR * TN * TILE];
    const int64_t t0 = p * tn, n0 = t0 * TILE;
    const int num_t = num_tiles(n_size) - t0 < tn ? (int)(num_tiles(n_size) - t0) : (int)tn;
    const int64_t cols = n_size - n0 < num_t * TILE ? n_size - n0 : num_t * TILE;
    const uint8_t *w = wt + t0 * stride;
    const int32_t *zw = zero_points + n0;
    for (int64_t m0 = 0; m0 < m_size; m0 += mr) {
      const int num_m = m_size - m0 < mr ? (int)(m_size - m0) : (int)mr;
      /* The next panel's tiles (past the last panel: a prefetch never faults). */
      const int64_t pf_ahead = m0 == mr ? tn * stride : PREFETCH_QUADS * TILE * 4;
      const int8_t *xm = xq + m0 * x_stride;
      const int32_t *sm = x_sums + m0;
      const float *scm = x_scales + m0 * num_groups;
      if (num_groups == 1) {
        if (num_t == 3) ROWS_CASES(3) else if (num_t == 2) ROWS_CASES(2) else ROWS_CASES(1)
      } else if (num_t == TN_G) {
        GROUPS_CASES(TN_G)
      } else {
        GROUPS_CASES(1)
      }
      for (int m = 0; m < num_m; m++) {
        const int64_t r = m0 + m;
        uint16_t *y_row = y + r * n_size + n0;
        const uint16_t *b = bias ? bias + n0 : NULL;
        if (num_groups == 1) {
          int32_t row[TN * TILE];
          for (int t = 0; t < num_t; t++) memcpy(row + t * TILE, isums + (m * TN + t) * TILE, TILE * sizeof(int32_t));
          dequantize_row_int32_bf16(row, x_scales[r], w_scales + n0, b, y_row, cols);
        } else {
          float row[TN * TILE];
          for (int t = 0; t < num_t; t++) memcpy(row + t * TILE, fsums + (m * TN + t) * TILE, TILE * sizeof(float));
          dequantize_row_groups_bf16(row, q_sums[r], zw, w_scales + n0, b, y_row, cols);
        }
      }
    }
  }
  free(xq), free(x_scales), free(x_sums), free(q_sums);
  return 0;
}

int int8_tiles_available(void) { return 1; }
#else
/* Built without AVX512_VNNI: W8A8 stays on oneDNN's int8 GEMM. */
int int8_tiles_bf16(const uint16_t *x, const uint8_t *wt, const float *w_scales, const uint16_t *bias, uint16_t *y,
                    int64_t m_size, int64_t n_size, int64_t k_size, int64_t group_size) {
  (void)x, (void)wt, (void)w_scales, (void)bias, (void)y, (void)m_size, (void)n_size, (void)k_size, (void)group_size;
  return -1;
}

int int8_tiles_available(void) { return 0; }
#endif
