/* 8-lane float vectors for the CPU kernels (GCC vector extensions: the compiler lowers them to
 * AVX2, AVX-512 or NEON; nothing here names an instruction set). */
#ifndef SPINDLE_VEC_H
#define SPINDLE_VEC_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
/* 16 lanes, for the element-wise kernels: one AVX-512 register, two AVX2 ones. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v8f load_f32(const float *p) {
  v8f v;
  memcpy(&v, p, sizeof v); /* no alignment assumed */
  return v;
}

static inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* e^x for x <= 0, a vector at a time, as Cephes' expf does it:
 * x = n ln2 + r with n = round(x / ln2), e^r by a degree-7 polynomial (about 1 ulp),
 * 2^n written into the exponent bits. x is clamped at -87, where e^x (1.6e-38) no longer
 * changes a sum that holds a 1. Defined for 8 and 16 lanes (VF, VI: the float and int32 types). */
#define DEFINE_EXP_NONPOSITIVE(NAME, VF, VI)                                                     \
  static inline VF NAME(VF x) {                                                                  \
    const VI clamp = x < -87.0f;                                                                 \
    const VF low = (VF){0} - 87.0f;                                                              \
    VI xi, li;                                                                                   \
    memcpy(&xi, &x, sizeof x);                                                                   \
    memcpy(&li, &low, sizeof low);                                                               \
    xi = (xi & ~clamp) | (li & clamp);                                                           \
    memcpy(&x, &xi, sizeof x);                                                                   \
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer in the low bits */ \
    const VF t = x * 1.44269504088896341f + shifter;                                             \
    const VF n = t - shifter;                                                                    \
    const VF r = (x - n * 0.693359375f) - n * -2.12194440e-4f;                                   \
    VF p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                              \
    p = p * r + 8.3334519073e-3f;                                                                \
    p = p * r + 4.1665795894e-2f;                                                                \
    p = p * r + 1.6666665459e-1f;                                                                \
    p = p * r + 5.0000001201e-1f;                                                                \
    p = p * (r * r) + r + 1.0f;                                                                  \
    VI ti;                                                                                       \
    memcpy(&ti, &t, sizeof t);                                                                   \
    const VI shifter_bits = (VI){0} + 0x4B400000; /* the bits of `shifter` */                    \
    const VI scale_bits = (ti - shifter_bits + 127) << 23;                                       \
    VF scale;                                                                                    \
    memcpy(&scale, &scale_bits, sizeof scale);                                                   \
    return p * scale;                                                                            \
  }

DEFINE_EXP_NONPOSITIVE(exp_nonpositive, v8f, v8i)
DEFINE_EXP_NONPOSITIVE(exp_nonpositive16, v16f, v16i)

static inline void store_f32(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* One bfloat16 value as float32, and a float32 rounded to bfloat16 bits (nearest even; NaN stays a
 * NaN), for the scalar tails of the kernels. */
static inline float bf16_to_f32(uint16_t x) {
  const uint32_t bits = (uint32_t)x << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* float32 -> bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN), as PyTorch rounds;
 * for 8 and 16 lanes (VF, VI, VU, VH: float, int32, uint32 and uint16 vectors). */
#define DEFINE_BF16_VECTORS(W, VF, VI, VU, VH)                                                   \
  static inline VF load_bf16##W(const uint16_t *p) {                                             \
    VH h;                                                                                        \
    memcpy(&h, p, sizeof h);                                                                     \
    const VU bits = __builtin_convertvector(h, VU) << 16; /* bfloat16 = a float32's top half */  \
    VF v;                                                                                        \
    memcpy(&v, &bits, sizeof v);                                                                 \
    return v;                                                                                    \
  }                                                                                              \
  static inline VU bf16_bits##W(VF v) {                                                          \
    VU bits;                                                                                     \
    memcpy(&bits, &v, sizeof bits);                                                              \
    const VI is_nan = v != v;                                                                    \
    VU rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;                           \
    const VU nan = (VU){0} + 0x7fc00000u;                                                        \
    return (rounded & ~(VU)is_nan) | (nan & (VU)is_nan);                                         \
  }                                                                                              \
  static inline VF round_bf16##W(VF v) {                                                         \
    const VU bits = bf16_bits##W(v);                                                             \
    VF r;                                                                                        \
    memcpy(&r, &bits, sizeof r);                                                                 \
    return r;                                                                                    \
  }                                                                                              \
  static inline void store_bf16##W(uint16_t *p, VF v) {                                         \
    const VH h = __builtin_convertvector(bf16_bits##W(v) >> 16, VH);                             \
    memcpy(p, &h, sizeof h);                                                                     \
  }

DEFINE_BF16_VECTORS(, v8f, v8i, v8u, v8h)
DEFINE_BF16_VECTORS(16, v16f, v16i, v16u, v16h)

/* bfloat16 rounding of 16 lanes for the element-wise kernels: one VCVTNEPS2BF16 where the build has
 * AVX512_BF16 (nearest even, as PyTorch rounds, but denormal floats flush to zero: an activation
 * does not reach them in practice), else the exact integer rounding above. */
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VL__)
#include <immintrin.h>
#define BF16_ROUND_NATIVE 1
static inline v16f round_bf16_ftz16(v16f v) {
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)v)), 16);
  return (v16f)_mm512_castsi512_ps(bits);
}
static inline void store_bf16_ftz16(uint16_t *p, v16f v) {
  _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)v));
}
#else
#define BF16_ROUND_NATIVE 0
#define round_bf16_ftz16 round_bf1616
#define store_bf16_ftz16 store_bf1616
#endif

static inline float hsum16(v16f v) {
  float s = 0.f;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}

static inline v16f load_f3216(const float *p) {
  v16f v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void store_f3216(float *p, v16f v) { memcpy(p, &v, sizeof v); }

/* 8 int8 as float32: one widening where the build has AVX2 (GCC turns a vector int8 -> float
 * conversion into scalar code). */
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8f load_int8(const int8_t *p) {
  return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline v8f load_int8(const int8_t *p) {
  v8f v;
  for (int i = 0; i < 8; i++) v[i] = (float)p[i];
  return v;
}
#endif

static inline v8f identity(v8f v) { return v; }
static inline v16f identity16(v16f v) { return v; }

#endif
