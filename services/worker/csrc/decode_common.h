/* What the paged decode-attention kernels share (paged_decode.c for float32 and bfloat16 caches,
 * paged_decode_int8.c for the int8 cache): limits, the chunk of keys a pass of the inner loops
 * takes, the lane reductions and the exact float32 softmax. */
#ifndef SPINDLE_DECODE_COMMON_H
#define SPINDLE_DECODE_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"
#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#else
#define THREAD_NUM() 0
#endif

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16 /* query heads per KV head */
#define CHUNK 8      /* keys or values per pass of the inner loops */

/* Floats of scratch one thread needs: the group's scores, 8 widened rows, the group's outputs. */
static inline int64_t decode_scratch_floats(int64_t max_seq_len, int group, int head_dim) {
  const int64_t padded = (max_seq_len + CHUNK - 1) / CHUNK * CHUNK;
  return (int64_t)group * padded + CHUNK * head_dim + (int64_t)group * head_dim;
}

/* Lane j of the result is the sum of d[j]'s 8 lanes. */
static inline v8f sum_lanes8(const v8f d[CHUNK]) {
  v8f a[4];
  for (int i = 0; i < 4; i++)
    a[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  const v8f b0 = __builtin_shufflevector(a[0], a[1], 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(a[0], a[1], 2, 3, 10, 11, 6, 7, 14, 15);
  const v8f b1 = __builtin_shufflevector(a[2], a[3], 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(a[2], a[3], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* Lane j of the result is the sum of d[j]'s 16 lanes: a tree of in-lane unpacks, then across the
 * 128-bit lanes (24 instructions for 8 dot products, where halving each to 8 lanes and then
 * sum_lanes8 took 37). */
static inline __attribute__((always_inline)) v8f sum_lanes16x8(const __m512 d[CHUNK]) {
  __m512 a[4];
  for (int i = 0; i < 4; i++) /* per 128-bit lane: d[2i] 0+2, d[2i+1] 0+2, d[2i] 1+3, d[2i+1] 1+3 */
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]), _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  /* per 128-bit lane: the lane's partial sums of d[0..3] (b0) and d[4..7] (b1) */
  const __m512 b0 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[0]), _mm512_castps_pd(a[1]))),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[0]), _mm512_castps_pd(a[1]))));
  const __m512 b1 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[2]), _mm512_castps_pd(a[3]))),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[2]), _mm512_castps_pd(a[3]))));
  /* c: b0 lanes 0+1, b0 lanes 2+3, b1 lanes 0+1, b1 lanes 2+3 */
  const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b0, b1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(b0, b1, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(c, c, _MM_SHUFFLE(3, 1, 2, 0)),
                                 _mm512_shuffle_f32x4(c, c, _MM_SHUFFLE(2, 0, 3, 1)));
  return (v8f)_mm512_castps512_ps256(e);
}
#endif

static inline v8f vmax(v8f a, v8f b) {
  const v8i a_wins = a > b;
  v8i ai, bi;
  memcpy(&ai, &a, sizeof a);
  memcpy(&bi, &b, sizeof b);
  const v8i m = (ai & a_wins) | (bi & ~a_wins);
  v8f r;
  memcpy(&r, &m, sizeof r);
  return r;
}

static inline float hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
  return m;
}

/* Scores s[0..n) -> exp(s - max), returned with their sum. */
static inline float softmax_numerators(float *s, int64_t n, float max_score) {
  v8f sum8 = {0};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const v8f e = exp_nonpositive(load_f32(s + t) - max_score);
    store_f32(s + t, e);
    sum8 += e;
  }
  float sum = hsum(sum8);
  for (; t < n; t++) {
    s[t] = expf(s[t] - max_score);
    sum += s[t];
  }
  return sum;
}

#endif
