// Test-only kernels for the WMMA layer (test_shim_wmma.py): one small matrix product per warp
// through nvcuda::wmma, in every fragment layout the shim emulates, for the CPU shim
// (tests/kernels/cuda_shim/wmma.h) and NVRTC (services/worker/kernels/wmma.cuh) alike.
#include "wmma.cuh"

namespace wmma_check {
namespace wmma = nvcuda::wmma;

template <typename Layout>
struct is_col_major {
  static constexpr bool value = false;
};
template <>
struct is_col_major<wmma::col_major> {
  static constexpr bool value = true;
};

constexpr int kLdc = 24;  // C and D rows are padded: the leading dimension is not the width

// Warp w of the block: D_w = factor * (A_w B_w + C_w), A_w 16x32 and B_w 32x16 (two k steps),
// with C either loaded (in C_COL_MAJOR's layout) or filled with c_fill, D stored in D_COL_MAJOR's
// layout. A is stored row-major [16][32] or column-major [32][16], B row-major [32][16] or
// column-major [16][32]; both have 512 elements per warp, C and D 16 * kLdc floats.
template <typename T, typename LA, typename LB, int C_COL_MAJOR, int D_COL_MAJOR, int FILL_C>
__global__ void product(float* d, const T* a, const T* b, const float* c, float c_fill, float factor) {
  const int w = threadIdx.x / 32;
  a += w * 512;
  b += w * 512;
  c += w * 16 * kLdc;
  d += w * 16 * kLdc;
  constexpr bool a_col = is_col_major<LA>::value, b_col = is_col_major<LB>::value;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  if (FILL_C) wmma::fill_fragment(acc, c_fill);
  else wmma::load_matrix_sync(acc, c, kLdc, C_COL_MAJOR ? wmma::mem_col_major : wmma::mem_row_major);
  for (int kk = 0; kk < 2; ++kk) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LA> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LB> fb;
    wmma::load_matrix_sync(fa, a_col ? a + kk * 16 * 16 : a + kk * 16, a_col ? 16 : 32);
    wmma::load_matrix_sync(fb, b_col ? b + kk * 16 : b + kk * 16 * 16, b_col ? 32 : 16);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= factor;  // element-wise work on a fragment
  wmma::store_matrix_sync(d, acc, kLdc, D_COL_MAJOR ? wmma::mem_col_major : wmma::mem_row_major);
}

// Each lane's element count per fragment type: out[0..3] = half A, half B, bf16 A, bf16 B,
// out[4] = float accumulator.
__global__ void fragment_sizes(int* out) {
  if (threadIdx.x != 0) return;
  out[0] = wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major>::num_elements;
  out[1] = wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major>::num_elements;
  out[2] = wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major>::num_elements;
  out[3] = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major>::num_elements;
  out[4] = wmma::fragment<wmma::accumulator, 16, 16, 16, float>::num_elements;
}

}  // namespace wmma_check
