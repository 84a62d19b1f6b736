// nvcuda::wmma on a CPU (included by shim.h): the m16n16k16 fragments Spindle's kernels use,
// emulated per warp.
//
// As on the GPU, a fragment is owned collectively by the 32 lanes of a warp and each lane holds
// `num_elements` of its elements (half A/B: 16, each matrix element held twice as sm_70+ does;
// __nv_bfloat16 A/B: 8; float accumulator: 8). Which element a lane holds is unspecified by CUDA,
// so the shim deliberately uses its own scrambled mapping, different for A, B and the
// accumulator: a kernel that assumes the hardware layout gets wrong answers here. What CUDA does
// guarantee holds: fragments of one type share one mapping, so element-wise work between them
// (and on a loaded matrix of row indices) is meaningful.
//
// load/store/mma are warp-collective: load_matrix_sync and store_matrix_sync first wait at the
// warp barrier (every lane arrives, as "waits until all lanes have arrived"), then each lane
// moves its own elements; mma_sync writes each lane's A, B and C elements to the warp's scratch,
// waits, computes the lane's D elements (float sums over k in order), and waits again before the
// scratch can be reused. Stores are not followed by a barrier: reading what another lane stored
// needs a __syncwarp, as on the GPU.
#pragma once

#include <type_traits>

// 16-bit storage types with CUDA's names (no arithmetic: kernels convert through their own code).
struct __half {
  unsigned short x;
};
typedef __half half;
struct __nv_bfloat16 {
  unsigned short x;
};

namespace spindle_shim {
void warp_barrier();
int current_lane();
float* warp_wmma_scratch();  // this warp's 3 x 256 floats: A, B, C of the mma in flight

inline float wmma_to_float(float v) { return v; }
inline float wmma_to_float(__nv_bfloat16 v) {
  unsigned int u = ((unsigned int)v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float wmma_to_float(__half v) {
  const unsigned int h = v.x, sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  unsigned int u;
  if (exponent == 0) {
    const float magnitude = (float)mantissa * 5.9604644775390625e-8f;  // subnormal: mantissa * 2^-24
    return sign ? -magnitude : magnitude;
  }
  u = exponent == 31 ? (sign | 0x7f800000u | (mantissa << 13)) : (sign | ((exponent + 112u) << 23) | (mantissa << 13));
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Matrix cell (row * 16 + col) of element i of lane `lane`. Elements 0..7 of the 32 lanes cover
// the 256 cells once (odd multipliers are bijections mod 256); half A/B elements 8..15 are a
// second, differently ordered copy.
enum WmmaSalt { kSaltA = 11, kSaltB = 29, kSaltAccumulator = 53 };
inline int wmma_cell(int salt, int lane, int i) {
  const int index = lane * 8 + i % 8;
  return i < 8 ? (index * 37 + salt) & 255 : (index * 101 + 3 * salt + 17) & 255;
}
}  // namespace spindle_shim

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename T, int N>
struct fragment_base {
  static constexpr int num_elements = N;
  T x[N];
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment;

template <typename T>
constexpr int input_elements() {
  static_assert(std::is_same<T, half>::value || std::is_same<T, __nv_bfloat16>::value,
                "the shim emulates half and __nv_bfloat16 inputs");
  return std::is_same<T, half>::value ? 16 : 8;
}

template <typename T, typename Layout>
class fragment<matrix_a, 16, 16, 16, T, Layout> : public fragment_base<T, input_elements<T>()> {
  static_assert(std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value, "layout");
};
template <typename T, typename Layout>
class fragment<matrix_b, 16, 16, 16, T, Layout> : public fragment_base<T, input_elements<T>()> {
  static_assert(std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value, "layout");
};
template <>
class fragment<accumulator, 16, 16, 16, float> : public fragment_base<float, 8> {};

template <typename Use, typename T, typename Layout>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const T& value) {
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = value;
}

// (row, col) of the logical matrix read at p with leading dimension ldm.
inline long long wmma_offset(int cell, unsigned ldm, bool is_col_major) {
  const int row = cell / 16, col = cell % 16;
  return is_col_major ? (long long)col * ldm + row : (long long)row * ldm + col;
}

template <typename Use, typename T, typename Layout>
inline void shim_load(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm, int salt,
                      bool is_col_major) {
  spindle_shim::warp_barrier();
  const int lane = spindle_shim::current_lane();
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = p[wmma_offset(spindle_shim::wmma_cell(salt, lane, i), ldm, is_col_major)];
}

template <typename T, typename Layout>
inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  shim_load(f, p, ldm, spindle_shim::kSaltA, std::is_same<Layout, col_major>::value);
}
template <typename T, typename Layout>
inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  shim_load(f, p, ldm, spindle_shim::kSaltB, std::is_same<Layout, col_major>::value);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm,
                             layout_t layout) {
  shim_load(f, p, ldm, spindle_shim::kSaltAccumulator, layout == mem_col_major);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout) {
  spindle_shim::warp_barrier();
  const int lane = spindle_shim::current_lane();
  for (int i = 0; i < f.num_elements; ++i)
    p[wmma_offset(spindle_shim::wmma_cell(spindle_shim::kSaltAccumulator, lane, i), ldm, layout == mem_col_major)] =
        f.x[i];
}

template <typename T, typename LayoutA, typename LayoutB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LayoutA>& a,
                     const fragment<matrix_b, 16, 16, 16, T, LayoutB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c, bool = false) {
  using spindle_shim::wmma_cell;
  float* scratch = spindle_shim::warp_wmma_scratch();
  float *sa = scratch, *sb = scratch + 256, *sc = scratch + 512;
  const int lane = spindle_shim::current_lane();
  // Elements 0..7 cover every cell exactly once across the warp: each cell has one writer.
  for (int i = 0; i < 8; ++i) {
    sa[wmma_cell(spindle_shim::kSaltA, lane, i)] = spindle_shim::wmma_to_float(a.x[i]);
    sb[wmma_cell(spindle_shim::kSaltB, lane, i)] = spindle_shim::wmma_to_float(b.x[i]);
    sc[wmma_cell(spindle_shim::kSaltAccumulator, lane, i)] = c.x[i];
  }
  spindle_shim::warp_barrier();
  float out[8];
  for (int i = 0; i < 8; ++i) {
    const int cell = wmma_cell(spindle_shim::kSaltAccumulator, lane, i), row = cell / 16, col = cell % 16;
    float sum = sc[cell];
    for (int k = 0; k < 16; ++k) sum += sa[row * 16 + k] * sb[k * 16 + col];
    out[i] = sum;
  }
  spindle_shim::warp_barrier();  // every lane has read the scratch before the next mma_sync writes it
  for (int i = 0; i < 8; ++i) d.x[i] = out[i];
}
}  // namespace wmma
}  // namespace nvcuda
