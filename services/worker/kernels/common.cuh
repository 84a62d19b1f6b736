// Shared device code for Spindle's kernels.
//
// No CUDA toolkit header is included anywhere, on purpose: NVRTC alone compiles these sources
// (no cuda_fp16.h / cuda_bf16.h on the include path), and g++ compiles the very same text on a CPU
// through the test shim (tests/kernels/cuda_shim/shim.h). So 16-bit floats are plain uint16
// storage with conversions written as bit manipulation, and only intrinsics the shim also
// provides are used (no inline PTX, no async copies; tensor cores only through nvcuda::wmma,
// which wmma.cuh defines for NVRTC and the shim emulates).
#pragma once

namespace spindle {

// ---- 16-bit float storage --------------------------------------------------------------------
struct bf16 {
  unsigned short bits;
};
struct f16 {
  unsigned short bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(bf16 x) {
  // bfloat16 is the top half of a float32.
  return __uint_as_float(((unsigned int)x.bits) << 16);
}

__device__ __forceinline__ float to_float(f16 x) {
  unsigned int h = x.bits;
  unsigned int sign = (h & 0x8000u) << 16;
  unsigned int exponent = (h >> 10) & 0x1fu;
  unsigned int mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    float magnitude = (float)mantissa * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));  // inf, nan
  return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

template <typename T>
__device__ __forceinline__ T from_float(float x);

template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) {
  unsigned int u = __float_as_uint(x);
  bf16 out;
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // nan stays a (quiet) nan
    out.bits = (unsigned short)((u >> 16) | 0x40u);
    return out;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  out.bits = (unsigned short)(u >> 16);
  return out;
}

template <>
__device__ __forceinline__ f16 from_float<f16>(float x) {
  unsigned int u = __float_as_uint(x);
  unsigned int sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  f16 out;
  if (u >= 0x7f800000u) {
    out.bits = (unsigned short)(sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u));
  } else if (u >= 0x477ff000u) {  // rounds past the largest half (65504): infinity
    out.bits = (unsigned short)(sign | 0x7c00u);
  } else if (u < 0x38800000u) {  // below 2^-14: a subnormal half, round(x * 2^24) exactly
    out.bits = (unsigned short)(sign | (unsigned int)rintf(__uint_as_float(u) * 16777216.0f));
  } else {  // rebias the exponent (127 -> 15), then round the 13 dropped bits to nearest even
    unsigned int v = u - 0x38000000u;
    out.bits = (unsigned short)(sign | ((v + 0xfffu + ((v >> 13) & 1u)) >> 13));
  }
  return out;
}

// ---- vector loads: 8 elements as floats -------------------------------------------------------
// Rows are 16-byte aligned (the wrappers check it), so 16-bit types load 8 elements in one
// 16-byte transaction and float32 in two.
template <typename T>
struct Vec8;

template <>
struct Vec8<float> {
  __device__ __forceinline__ static void load(const float* p, float* out) {
    float4 a = reinterpret_cast<const float4*>(p)[0];
    float4 b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  }
};

template <typename T16>
struct Vec8Half {
  __device__ __forceinline__ static void load(const T16* p, float* out) {
    uint4 raw = reinterpret_cast<const uint4*>(p)[0];
    unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      T16 lo, hi;
      lo.bits = (unsigned short)(words[i] & 0xffffu);
      hi.bits = (unsigned short)(words[i] >> 16);
      out[2 * i] = to_float(lo);
      out[2 * i + 1] = to_float(hi);
    }
  }
};

template <>
struct Vec8<bf16> : Vec8Half<bf16> {};
template <>
struct Vec8<f16> : Vec8Half<f16> {};

// ---- warp and block reductions ----------------------------------------------------------------
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

// (value, index) pairs: the larger value wins, ties go to the lower index (torch.argmax's rule).
__device__ __forceinline__ bool beats(float v, int i, float best_v, int best_i) {
  return v > best_v || (v == best_v && i < best_i);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, v, mask);
    int oi = __shfl_xor_sync(0xffffffffu, i, mask);
    if (beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// ---- counter-based random numbers -------------------------------------------------------------
// Philox4x32-10 (Salmon et al., SC'11): the output depends only on (key, counter), so a request's
// noise for vocabulary entry i at step s is the same wherever the request sits in the batch.
struct Philox {
  unsigned int v[4];
};

__device__ __forceinline__ Philox philox4x32_10(unsigned int c0, unsigned int c1, unsigned int c2,
                                                unsigned int c3, unsigned int k0, unsigned int k1) {
  const unsigned int M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    unsigned int hi0 = __umulhi(M0, c0), lo0 = M0 * c0;
    unsigned int hi1 = __umulhi(M1, c2), lo1 = M1 * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += W0;
    k1 += W1;
  }
  Philox out;
  out.v[0] = c0; out.v[1] = c1; out.v[2] = c2; out.v[3] = c3;
  return out;
}

// Gumbel noise from 24 random bits: u in (0, 1) strictly, so -log(-log(u)) is finite.
__device__ __forceinline__ float gumbel_from_bits(unsigned int r) {
  float u = ((float)(r >> 8) + 0.5f) * 5.9604644775390625e-8f;
  return -logf(-logf(u));
}

}  // namespace spindle
