/* int8 -> bfloat16 by a byte table, for the int8 kernels (gemv_int8.c's weights, paged_decode_int8.c's
 * cache rows), where the CPU has AVX512_BF16 and AVX512_VBMI (Zen 4, Sapphire Rapids):
 * HAS_INT8_BF16_TABLE is 1 there and 0 elsewhere, where nothing else is defined.
 *
 * The two bytes of bfloat16(|v|) for |v| <= 127 are looked up 64 at a time by VPERMI2B (7-bit
 * indices into 128 bytes), and v's sign bit put back. Widening through float32 (sign-extend,
 * convert, pack) takes 10 instructions per 64 values against these 6, and at one GEMV row the
 * conversion, not the multiply, is the cost: 2048 x 576 from L2, 45 -> 31 us. -128 is not
 * handled (its magnitude needs an eighth index bit); the quantizers clamp to [-127, 127]. Each
 * file that includes this has its own 256-byte copy of the tables. */
#ifndef SPINDLE_INT8_BF16_H
#define SPINDLE_INT8_BF16_H

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define HAS_INT8_BF16_TABLE 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static uint8_t bf16_high_bytes[128] __attribute__((aligned(64)));
static uint8_t bf16_low_bytes[128] __attribute__((aligned(64)));

__attribute__((constructor)) static void fill_bf16_byte_tables(void) {
  for (int i = 0; i < 128; ++i) {
    const float f = (float)i;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits); /* exact: i has at most 7 significant bits */
    bf16_high_bytes[i] = (uint8_t)(bits >> 24);
    bf16_low_bytes[i] = (uint8_t)(bits >> 16);
  }
}

typedef struct {
  __m512i high0, high1, low0, low1, sign;
} Bf16Tables;

static inline Bf16Tables load_bf16_tables(void) {
  return (Bf16Tables){_mm512_load_si512(bf16_high_bytes), _mm512_load_si512(bf16_high_bytes + 64),
                      _mm512_load_si512(bf16_low_bytes), _mm512_load_si512(bf16_low_bytes + 64),
                      _mm512_set1_epi8((char)0x80)};
}

/* 64 int8 (one line) as two vectors of 32 bfloat16 words, each 128-bit lane L holding elements
 * 16L..16L+7 (`lo`) and 16L+8..16L+15 (`hi`): the byte interleave works within lanes, and the
 * other operand is permuted the same way once (X_LINE_LO/HI) instead of these once per line. */
static inline __attribute__((always_inline)) void int8_line_to_bf16(const Bf16Tables *t, __m512i raw,
                                                                   __m512bh *lo, __m512bh *hi) {
  const __m512i magnitude = _mm512_abs_epi8(raw);
  __m512i high = _mm512_permutex2var_epi8(t->high0, magnitude, t->high1);
  high = _mm512_ternarylogic_epi32(high, raw, t->sign, 0xF8); /* high | (raw & 0x80) */
  const __m512i low = _mm512_permutex2var_epi8(t->low0, magnitude, t->low1);
  *lo = (__m512bh)_mm512_unpacklo_epi8(low, high);
  *hi = (__m512bh)_mm512_unpackhi_epi8(low, high);
}
/* 64 elements of x, x0 = [0, 32) and x1 = [32, 64), in the order of `lo` and `hi` above: 128-bit
 * lanes 0 and 2 of each half, then lanes 1 and 3. */
#define X_LINE_LO(x0, x1) _mm512_shuffle_i64x2(x0, x1, 0x88)
#define X_LINE_HI(x0, x1) _mm512_shuffle_i64x2(x0, x1, 0xDD)

/* A packed weight whose lines are stored so that `lo` then `hi` are its 64 values in order: output
 * word o of a line comes from byte line_source(o) (`lo` takes bytes 0-7, 16-23, 32-39, 48-55). */
static inline int line_source(int o) { return o < 32 ? 16 * (o / 8) + o % 8 : 16 * ((o - 32) / 8) + 8 + o % 8; }

/* Reorders num_bytes (a multiple of 64) of a packed int8 weight line by line for `line_source`. */
static inline void order_lines_for_table(int8_t *packed, int64_t num_bytes) {
#pragma omp parallel for schedule(static)
  for (int64_t line = 0; line < num_bytes; line += 64) {
    int8_t ordered[64];
    memcpy(ordered, packed + line, 64);
    for (int o = 0; o < 64; o++) packed[line + line_source(o)] = ordered[o];
  }
}

#else
#define HAS_INT8_BF16_TABLE 0
#endif

#endif
