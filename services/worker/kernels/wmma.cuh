// nvcuda::wmma for NVRTC without the toolkit's mma.h: the m16n16k16 fragments with half or bf16
// inputs and a float accumulator, on the compiler's WMMA intrinsics (the same ones mma.h wraps;
// NVRTC declares them itself, so no header is needed). Only what Spindle's kernels use is here:
// matrix_a / matrix_b in row_major or col_major, an accumulator loaded and stored in either memory
// layout, fill_fragment and mma_sync. Needs sm_80 or later (bf16 tensor cores).
//
// The CPU test shim (tests/kernels/cuda_shim/wmma.h) defines the same names with an emulation, so
// this file steps aside there.
#pragma once

#ifndef SPINDLE_CUDA_SHIM

// 16-bit storage types with CUDA's names, unless cuda_fp16.h / cuda_bf16.h already gave them.
#ifndef __CUDA_FP16_H__
struct __half {
  unsigned short x;
};
typedef __half half;
#endif
#ifndef __CUDA_BF16_H__
struct __nv_bfloat16 {
  unsigned short x;
};
#endif

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename T, int N>
struct __align__(16) fragment_base {  // the intrinsics read and write it as 32-bit words
  static constexpr int num_elements = N;
  T x[N];
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment;

// Registers per lane as on sm_80: half inputs 16 elements (8 registers), bf16 inputs 8 (4),
// float accumulator 8.
template <typename Layout>
class fragment<matrix_a, 16, 16, 16, half, Layout> : public fragment_base<half, 16> {};
template <typename Layout>
class fragment<matrix_b, 16, 16, 16, half, Layout> : public fragment_base<half, 16> {};
template <typename Layout>
class fragment<matrix_a, 16, 16, 16, __nv_bfloat16, Layout> : public fragment_base<__nv_bfloat16, 8> {};
template <typename Layout>
class fragment<matrix_b, 16, 16, 16, __nv_bfloat16, Layout> : public fragment_base<__nv_bfloat16, 8> {};
template <>
class fragment<accumulator, 16, 16, 16, float> : public fragment_base<float, 8> {};

template <typename L>
struct layout_code;  // the intrinsics' layout argument: 0 row major, 1 column major
template <>
struct layout_code<row_major> {
  static constexpr int value = 0;
};
template <>
struct layout_code<col_major> {
  static constexpr int value = 1;
};

template <typename Use, typename T, typename Layout>
__device__ __forceinline__ void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const T& value) {
#pragma unroll
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = value;
}

template <typename L>
__device__ __forceinline__ void load_matrix_sync(fragment<matrix_a, 16, 16, 16, half, L>& f, const half* p,
                                                 unsigned ldm) {
  __hmma_m16n16k16_ld_a((int*)&f, (const int*)p, ldm, layout_code<L>::value);
}
template <typename L>
__device__ __forceinline__ void load_matrix_sync(fragment<matrix_b, 16, 16, 16, half, L>& f, const half* p,
                                                 unsigned ldm) {
  __hmma_m16n16k16_ld_b((int*)&f, (const int*)p, ldm, layout_code<L>::value);
}
template <typename L>
__device__ __forceinline__ void load_matrix_sync(fragment<matrix_a, 16, 16, 16, __nv_bfloat16, L>& f,
                                                 const __nv_bfloat16* p, unsigned ldm) {
  __mma_bf16_m16n16k16_ld_a((int*)&f, (const int*)p, ldm, layout_code<L>::value);
}
template <typename L>
__device__ __forceinline__ void load_matrix_sync(fragment<matrix_b, 16, 16, 16, __nv_bfloat16, L>& f,
                                                 const __nv_bfloat16* p, unsigned ldm) {
  __mma_bf16_m16n16k16_ld_b((int*)&f, (const int*)p, ldm, layout_code<L>::value);
}
__device__ __forceinline__ void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                                                 unsigned ldm, layout_t layout) {
  // The intrinsics take the layout as an immediate, hence the branch.
  if (layout == mem_col_major) __hmma_m16n16k16_ld_c_f32((float*)&f, p, ldm, 1);
  else __hmma_m16n16k16_ld_c_f32((float*)&f, p, ldm, 0);
}
__device__ __forceinline__ void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                                                  unsigned ldm, layout_t layout) {
  if (layout == mem_col_major) __hmma_m16n16k16_st_c_f32(p, (const float*)&f, ldm, 1);
  else __hmma_m16n16k16_st_c_f32(p, (const float*)&f, ldm, 0);
}

// The mma intrinsics' layout argument: 2 * (A column major) + (B column major).
template <typename LA, typename LB>
struct mma_layout {
  static constexpr int value = 2 * layout_code<LA>::value + layout_code<LB>::value;
};

template <typename LA, typename LB>
__device__ __forceinline__ void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                                         const fragment<matrix_a, 16, 16, 16, half, LA>& a,
                                         const fragment<matrix_b, 16, 16, 16, half, LB>& b,
                                         const fragment<accumulator, 16, 16, 16, float>& c, bool = false) {
  __hmma_m16n16k16_mma_f32f32((float*)&d, (const int*)&a, (const int*)&b, (const float*)&c,
                              mma_layout<LA, LB>::value, 0);
}
template <typename LA, typename LB>
__device__ __forceinline__ void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                                         const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
                                         const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
                                         const fragment<accumulator, 16, 16, 16, float>& c, bool = false) {
  __mma_bf16_m16n16k16_mma_f32((float*)&d, (const int*)&a, (const int*)&b, (const float*)&c,
                               mma_layout<LA, LB>::value, 0);
}
}  // namespace wmma
}  // namespace nvcuda

#endif  // SPINDLE_CUDA_SHIM
