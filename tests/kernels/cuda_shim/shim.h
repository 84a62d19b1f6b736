// CUDA C on a CPU: just enough of CUDA for g++ to compile Spindle's unmodified .cu files and run
// them, one CUDA thread at a time (fibers) or one OS thread each (threads, for ThreadSanitizer).
//
// - threadIdx/blockIdx/blockDim/gridDim are thread-locals that the scheduler sets before it
//   resumes a CUDA thread; blocks run one after another, so `__shared__` can be `static` storage.
// - __syncthreads is a block barrier; a warp shuffle writes the lane's value to its warp's slot
//   array, waits at a warp barrier, reads the partner's slot and waits again (so no slot is
//   overwritten before every lane has read it).
// - Fiber mode detects barrier divergence (some threads at __syncthreads, others at a warp
//   barrier or finished) and reports it instead of hanging; in shuffled mode fibers run in a
//   random order, so a missing barrier shows up as a read of stale shared memory, and a warp
//   released from a warp barrier runs ahead of the others until it waits at __syncthreads (see
//   runtime.cpp), so a missing __syncthreads between two warps' phases shows up even when the
//   phases are made of warp-level operations.
// - Tensor cores through nvcuda::wmma (m16n16k16, half/bf16 in, float accumulator) are emulated
//   per warp in wmma.h, with the same warp-collective rules.
// Not emulated: inline PTX, other tensor-core shapes and fragment types, async copies, dynamic
// shared memory, the memory model's weaker orderings (fibers are sequentially consistent).
#pragma once

// Kernel headers test this to leave the device-only definitions (services/worker/kernels/wmma.cuh)
// to the shim.
#define SPINDLE_CUDA_SHIM 1

#include <pthread.h>
#include <ucontext.h>

#include <math.h>  // expf, logf, fmaxf, rintf in the global namespace, as CUDA has them
#include <cstdint>
#include <cstring>

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};
struct uint4 {
  unsigned int x, y, z, w;
};
struct float4 {
  float x, y, z, w;
};

namespace spindle_shim {
extern thread_local dim3 tl_thread_idx;
extern thread_local dim3 tl_block_idx;
extern dim3 g_block_dim;
extern dim3 g_grid_dim;
void block_barrier();
void warp_barrier();
void* warp_slot(int lane);  // this thread's warp, slot of `lane` (8 bytes)
int current_lane();
}  // namespace spindle_shim

#define threadIdx (spindle_shim::tl_thread_idx)
#define blockIdx (spindle_shim::tl_block_idx)
#define blockDim (spindle_shim::g_block_dim)
#define gridDim (spindle_shim::g_grid_dim)

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

inline void __syncthreads() { spindle_shim::block_barrier(); }
inline void __syncwarp(unsigned = 0xffffffffu) { spindle_shim::warp_barrier(); }

inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return (unsigned int)(((unsigned long long)a * b) >> 32);
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

// ---- warp shuffles: exchange through the warp's slots between two warp barriers --------------
template <typename T>
inline T shim_shuffle_from(T value, int src_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  std::memcpy(spindle_shim::warp_slot(spindle_shim::current_lane()), &value, sizeof(T));
  spindle_shim::warp_barrier();
  T out;
  std::memcpy(&out, spindle_shim::warp_slot(src_lane), sizeof(T));
  spindle_shim::warp_barrier();
  return out;
}

template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
  int lane = spindle_shim::current_lane();
  return shim_shuffle_from(v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  int lane = spindle_shim::current_lane();
  int src = lane ^ mask;
  return shim_shuffle_from(v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
  int lane = spindle_shim::current_lane();
  int src = lane + (int)delta;
  return shim_shuffle_from(v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
  int lane = spindle_shim::current_lane();
  int src = lane - (int)delta;
  return shim_shuffle_from(v, src >= (lane & ~(width - 1)) ? src : lane);
}

// ---- atomics (real ones: threads mode runs CUDA threads concurrently) -------------------------
inline float atomicAdd(float* address, float value) {
  float old, desired;
  __atomic_load(address, &old, __ATOMIC_RELAXED);
  do {
    desired = old + value;
  } while (!__atomic_compare_exchange(address, &old, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
  return old;
}
inline int atomicAdd(int* address, int value) { return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}

// ---- the launch table: name expression -> kernel, called with cuLaunchKernel's void** args -----
#include <type_traits>
#include <utility>

namespace spindle_shim {
struct KernelEntry {
  const char* name;  // the NVRTC name expression, e.g. "spindle::reshape_and_cache<float>"
  void* fn;
  void (*invoke)(void* fn, void** args);
};

template <typename... Args>
struct Invoker {
  template <std::size_t... I>
  static void call(void (*f)(Args...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<Args>>*>(args[I])...);
  }
  static void invoke(void* fn, void** args) {
    call(reinterpret_cast<void (*)(Args...)>(fn), args, std::index_sequence_for<Args...>{});
  }
};

template <typename... Args>
KernelEntry make_entry(const char* name, void (*f)(Args...)) {
  return KernelEntry{name, reinterpret_cast<void*>(f), &Invoker<Args...>::invoke};
}
}  // namespace spindle_shim

#include "wmma.h"
