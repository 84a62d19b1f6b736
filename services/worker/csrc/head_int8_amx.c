/* The greedy head screen's int8 logits on the AMX tile unit (AMX-INT8): y [M, N] = x . (W_int8 *
 * w_scales)^T, rounded to bfloat16, with x quantized per row to 15 bits held as two int8 parts
 * (x ~ s (128 hi + lo), hi in [-127, 127], lo in [-64, 64]), both parts multiplied exactly on
 * TDPBSSD. Also each row's |x - s (128 hi + lo)|, which the screen's bound adds (greedy_screen.c).
 *
 * Why: the weight-only int8 AMX kernel widens each int8 panel to bfloat16 before its products, and
 * at 20-64 rows that widening, not reading the head's 28 MB, set its time. Here the int8 panel is
 * a B tile as it lies. One int8 part per row made the bound useless (SmolLM2's final hidden rows
 * hold outliers: 209 tokens a row in reach, against 2 for the weight-only copy); with 15 bits the
 * activations' error is about 1/128 of that.
 *
 * The weight is packed once (`head_int8_amx_pack`) into panels of 32 output columns; a panel is
 * K/64 steps of two B tiles, each [16 fours of K][16 columns][4] (1 KB, the layout TDPBSSD reads).
 * Rows go in blocks of 16: the block's high parts are one A tile, its low parts another, and four C
 * tiles hold both parts' sums for the panel's 32 columns; the panel (K * 32 bytes) stays in L1 for
 * the next block. 128 * hi_sum + lo_sum fits int32 while K <= 1024 (K * 127 * (127 * 128 + 64)).
 *
 * Built only where the compiler targets AMX-INT8; elsewhere `head_int8_amx_available` returns 0. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx_tiles.h"
#include "vec.h"

#define TILE 16
#define PANEL 32        /* output columns per panel: two B tiles */
#define KSTEP 64        /* input positions per tile step: 16 fours */
#define STEP_BYTES 2048 /* a panel's step: two B tiles */
#define MAX_K 1024      /* the combined sums' int32 bound */
#define PREFETCH_STEPS 16 /* as gemm_amx_bf16.c's: panel steps prefetched into L2 ahead */
#define MIN_PARALLEL_PANELS 4

int head_int8_amx_available(void) { return gemm_amx_available(); }

int64_t head_int8_amx_bytes(int64_t n_size, int64_t k_size) {
  return (n_size + PANEL - 1) / PANEL * PANEL * ((k_size + KSTEP - 1) / KSTEP * KSTEP);
}

/* w [n_size, k_size] -> [panels][K/64 steps][2 tiles][16 fours][16 columns][4]; zeros past N and K. */
void head_int8_amx_pack(const int8_t *w, int8_t *out, int64_t n_size, int64_t k_size) {
  const int64_t num_panels = (n_size + PANEL - 1) / PANEL, num_steps = (k_size + KSTEP - 1) / KSTEP;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < num_panels; p++)
    for (int64_t s = 0; s < num_steps; s++)
      for (int t = 0; t < 2; t++)
        for (int r = 0; r < 16; r++)
          for (int c = 0; c < 16; c++)
            for (int h = 0; h < 4; h++) {
              const int64_t n = p * PANEL + 16 * t + c, k = s * KSTEP + 4 * r + h;
              out[(((p * num_steps + s) * 2 + t) * 16 + r) * 64 + c * 4 + h] =
                  n < n_size && k < k_size ? w[n * k_size + k] : 0;
            }
}

/* Row x (bfloat16) -> its parts hi, lo, the step s and |x - s (128 hi + lo)| (float64, rounded up;
 * inf and zero parts where x is not finite). */
static void quantize_row(const uint16_t *x, int64_t k_size, int8_t *hi, int8_t *lo, float *step, float *error) {
  float amax = 0.f;
  int finite = 1;
  for (int64_t k = 0; k < k_size; k++) {
    const float v = bf16_to_f32(x[k]);
    if (!isfinite(v)) finite = 0;
    amax = fabsf(v) > amax ? fabsf(v) : amax;
  }
  if (!finite) {
    memset(hi, 0, (size_t)k_size);
    memset(lo, 0, (size_t)k_size);
    *step = 0.f, *error = INFINITY;
    return;
  }
  const float s = amax > 0.f ? amax / 16256.f : 1.f; /* 16256 = 127 * 128: |r| <= 16256 */
  double e = 0.0;
  for (int64_t k = 0; k < k_size; k++) {
    const float v = bf16_to_f32(x[k]);
    float r = nearbyintf(v / s);
    r = r > 16256.f ? 16256.f : r < -16256.f ? -16256.f : r;
    const float h = nearbyintf(r / 128.f);
    hi[k] = (int8_t)h;
    lo[k] = (int8_t)(r - 128.f * h);
    const double d = (double)v - (double)s * (double)r;
    e += d * d;
  }
  *step = s;
  *error = (float)(sqrt(e) * (1.0 + 1e-6));
}

/* y [m_size, n_size] bfloat16 = (x in 15 bits) W^T * w_scales[n]; x_errors [m_size] as above (a
 * row that is not finite gets inf and a zero y row). k_size a multiple of 64 up to 1024. Returns 0,
 * or 1 where the tile unit is not granted, K does not fit or memory ran out. */
int head_int8_amx(const uint16_t *x, const int8_t *packed, const float *w_scales, uint16_t *y, float *x_errors,
                  int64_t m_size, int64_t n_size, int64_t k_size) {
  if (!gemm_amx_available() || k_size % KSTEP || k_size > MAX_K || m_size <= 0) return 1;
  const int64_t num_panels = (n_size + PANEL - 1) / PANEL, num_steps = k_size / KSTEP;
  const int64_t num_blocks = (m_size + TILE - 1) / TILE, block_bytes = 2 * TILE * k_size;
  int8_t *parts = aligned_alloc(64, (size_t)(num_blocks * block_bytes)); /* [block][hi, lo][16][K] */
  float *steps = malloc(sizeof(float) * m_size);
  if (!parts || !steps) {
    free(parts);
    free(steps);
    return 1;
  }
  memset(parts, 0, (size_t)(num_blocks * block_bytes));
  for (int64_t m = 0; m < m_size; m++) {
    int8_t *hi = parts + (m / TILE) * block_bytes + (m % TILE) * k_size;
    quantize_row(x + m * k_size, k_size, hi, hi + TILE * k_size, &steps[m], &x_errors[m]);
  }
#pragma omp parallel if (num_panels >= MIN_PARALLEL_PANELS)
  {
    load_uniform_tiles();
    int32_t sums[4 * TILE * TILE] __attribute__((aligned(64))); /* hi x B0, hi x B1, lo x B0, lo x B1 */
#pragma omp for schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
      const int8_t *panel = packed + p * num_steps * STEP_BYTES;
      const int64_t col0 = p * PANEL;
      const int cols = n_size - col0 < PANEL ? (int)(n_size - col0) : PANEL;
      const __mmask16 low = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
      const __mmask16 high = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
      const __m512 c0 = _mm512_maskz_loadu_ps(low, w_scales + col0);
      const __m512 c1 = _mm512_maskz_loadu_ps(high, w_scales + col0 + 16);
      for (int64_t block = 0; block < num_blocks; block++) {
        const int8_t *a = parts + block * block_bytes;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < num_steps; s++) {
          if (block == 0) /* PREFETCH_STEPS steps ahead into L2, past this panel into the thread's next */
            for (int l = 0; l < STEP_BYTES; l += 64)
              _mm_prefetch((const char *)(panel + (s + PREFETCH_STEPS) * STEP_BYTES + l), _MM_HINT_T1);
          _tile_loadd(6, panel + s * STEP_BYTES, 64);
          _tile_loadd(7, panel + s * STEP_BYTES + 1024, 64);
          _tile_loadd(4, a + s * KSTEP, k_size);
          _tile_loadd(5, a + TILE * k_size + s * KSTEP, k_size);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbssd(1, 4, 7);
          _tile_dpbssd(2, 5, 6);
          _tile_dpbssd(3, 5, 7);
        }
        _tile_stored(0, sums, 64);
        _tile_stored(1, sums + TILE * TILE, 64);
        _tile_stored(2, sums + 2 * TILE * TILE, 64);
        _tile_stored(3, sums + 3 * TILE * TILE, 64);
        const int64_t rows = m_size - block * TILE < TILE ? m_size - block * TILE : TILE;
        for (int64_t r = 0; r < rows; r++) {
          const int64_t m = block * TILE + r;
          const __m512 sx = _mm512_set1_ps(steps[m]);
          const __m512i s0 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums + r * TILE), 7),
                                              _mm512_load_si512(sums + 2 * TILE * TILE + r * TILE));
          const __m512i s1 =
              _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums + TILE * TILE + r * TILE), 7),
                               _mm512_load_si512(sums + 3 * TILE * TILE + r * TILE));
          const __m512 y0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s0), c0), sx);
          const __m512 y1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s1), c1), sx);
          uint16_t *dst = y + m * n_size + col0;
          _mm256_mask_storeu_epi16(dst, low, (__m256i)_mm512_cvtneps_pbh(y0));
          _mm256_mask_storeu_epi16(dst + 16, high, (__m256i)_mm512_cvtneps_pbh(y1));
        }
      }
    }
    _tile_release();
  }
  free(parts);
  free(steps);
  return 0;
}

#else
int head_int8_amx_available(void) { return 0; }
int64_t head_int8_amx_bytes(int64_t n_size, int64_t k_size) { (void)n_size; (void)k_size; return 0; }
void head_int8_amx_pack(const int8_t *w, int8_t *out, int64_t n_size, int64_t k_size) {
  (void)w; (void)out; (void)n_size; (void)k_size;
}
int head_int8_amx(const uint16_t *x, const int8_t *packed, const float *w_scales, uint16_t *y, float *x_errors,
                  int64_t m_size, int64_t n_size, int64_t k_size) {
  (void)x; (void)packed; (void)w_scales; (void)y; (void)x_errors; (void)m_size; (void)n_size; (void)k_size;
  return 1;
}
#endif
