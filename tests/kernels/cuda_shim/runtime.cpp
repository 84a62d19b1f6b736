// The shim's scheduler: runs a grid block by block, each block's CUDA threads as fibers
// (a hand-written context switch) or as OS threads (for ThreadSanitizer), and exports one C entry point for ctypes.
#include <sys/mman.h>

#include <cstdint>

#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shim.h"

// ---- context switch ----------------------------------------------------------------------------
// swapcontext() makes a sigprocmask system call per switch, and a shuffle costs two switches per
// lane: on x86-64 a hand-written switch (callee-saved registers, MXCSR and the x87 control word)
// is ~50x faster. Kernels never change the floating-point control registers (MXCSR, x87), so
// only the callee-saved integer registers travel. Elsewhere ucontext does the job.
#if defined(__x86_64__)
extern "C" void spindle_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl spindle_switch
.type spindle_switch,@function
spindle_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size spindle_switch, .-spindle_switch
.section .note.GNU-stack,"",@progbits
.text
)");

struct Context {
  void* sp = nullptr;
};
inline void switch_to(Context& save, Context& load) { spindle_switch(&save.sp, load.sp); }
inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  auto* top = reinterpret_cast<unsigned long long*>(reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t{15});
  *--top = 0;                                      // fake return address of `entry` (never returns)
  *--top = reinterpret_cast<unsigned long long>(entry);  // where the first switch's `ret` goes
  for (int i = 0; i < 6; ++i) *--top = 0;          // rbp rbx r12 r13 r14 r15
  c.sp = top;
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_to(Context& save, Context& load) { swapcontext(&save.uc, &load.uc); }
inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

namespace spindle_shim {
extern const KernelEntry kKernels[];
extern const int kNumKernels;

thread_local dim3 tl_thread_idx;
thread_local dim3 tl_block_idx;
dim3 g_block_dim;
dim3 g_grid_dim;

namespace {
enum Mode { kFibers = 0, kFibersShuffled = 1, kThreads = 2 };
enum State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
  Context ctx;
  State state;
};

struct Launch {
  Mode mode;
  const KernelEntry* kernel;
  void** args;
  int num_threads;
  std::vector<unsigned long long> slots;  // [num_warps * 32] shuffle slots
  std::vector<float> wmma_scratch;        // [num_warps * kWmmaScratch] mma_sync operands
  // fibers
  std::vector<Fiber> fibers;
  Context scheduler;
  // threads
  pthread_barrier_t block_barrier;
  std::vector<pthread_barrier_t> warp_barriers;
};

Launch* g_launch = nullptr;
thread_local int tl_linear = 0;  // linear thread index in the block
thread_local Fiber* tl_fiber = nullptr;
std::mutex g_mutex;             // one launch at a time: blocks share static __shared__ storage
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kWmmaScratch = 3 * 256;  // A, B and C of one 16x16x16 mma, as floats
char* g_stacks = nullptr;       // reused across launches, grown on demand
int g_num_stacks = 0;

void yield_with(State state) {
  tl_fiber->state = state;
  switch_to(tl_fiber->ctx, g_launch->scheduler);
}

void fiber_entry() {
  g_launch->kernel->invoke(g_launch->kernel->fn, g_launch->args);
  yield_with(kDone);  // never resumed
}

dim3 unflatten(int linear, const dim3& dims) {
  dim3 d;
  d.x = linear % dims.x;
  d.y = (linear / dims.x) % dims.y;
  d.z = linear / (dims.x * dims.y);
  return d;
}

unsigned long long next_random(unsigned long long& state) {  // xorshift64*
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return state * 2685821657736338717ull;
}

// Runs one block; returns an empty string or what went wrong. Runnable fibers wait in a queue
// (in order, or picked at random in shuffled mode); a fiber runs until it blocks. The last lane of
// a warp to reach a warp barrier releases the warp's lanes at once: into the queue in order mode;
// in shuffled mode ahead of every other thread (in a random order among themselves), so the
// released warp runs on until it waits at __syncthreads or finishes while the other warps stay
// where they are. Warps thus drift as far apart as the block barriers allow, and a __syncthreads
// missing between one warp's writes and another's reads is seen every time, not by chance. The
// block barrier opens once every thread waits there.
std::string run_block_fibers(Launch& L, unsigned long long& rng) {
  const int n = L.num_threads, num_warps = (n + 31) / 32;
  const bool shuffled = L.mode == kFibersShuffled;
  std::vector<int> ready, ahead, live(num_warps, 0), at_warp(num_warps, 0);
  for (int i = 0; i < n; ++i) {
    Fiber& f = L.fibers[i];
    make_context(f.ctx, g_stacks + (size_t)i * kStackBytes, kStackBytes, fiber_entry);
    f.state = kRunnable;
    ready.push_back(i);
    ++live[i / 32];
  }
  auto release_warp_if_complete = [&](int w) {
    if (live[w] == 0 || at_warp[w] != live[w]) return;
    for (int i = w * 32; i < n && i < (w + 1) * 32; ++i)
      if (L.fibers[i].state == kAtWarpBarrier) {
        L.fibers[i].state = kRunnable;
        (shuffled ? ahead : ready).push_back(i);
      }
    at_warp[w] = 0;
  };
  for (;;) {
    size_t head = 0;
    while (!ahead.empty() || head < ready.size()) {
      int i;
      if (!ahead.empty()) {
        std::swap(ahead[next_random(rng) % ahead.size()], ahead.back());
        i = ahead.back();
        ahead.pop_back();
      } else {
        if (shuffled) std::swap(ready[head], ready[head + next_random(rng) % (ready.size() - head)]);
        i = ready[head++];
      }
      Fiber& f = L.fibers[i];
      tl_fiber = &f;
      tl_linear = i;
      tl_thread_idx = unflatten(i, g_block_dim);
      switch_to(L.scheduler, f.ctx);
      if (f.state == kAtWarpBarrier) ++at_warp[i / 32];
      else if (f.state == kDone) --live[i / 32];
      release_warp_if_complete(i / 32);
    }
    ready.clear();
    int num_live = 0, at_block = 0, num_at_warp = 0;
    for (int i = 0; i < n; ++i) {
      num_live += L.fibers[i].state != kDone;
      at_block += L.fibers[i].state == kAtBlockBarrier;
      num_at_warp += L.fibers[i].state == kAtWarpBarrier;
    }
    if (num_live == 0) return "";
    // As on the GPU, a barrier counts arrivals, not call sites (optimised code may duplicate a
    // __syncthreads). A thread that finished while others wait is divergence: none of our
    // kernels lets part of a block leave early and then synchronise the rest.
    if (at_block == num_live && num_live == n) {
      for (int i = 0; i < n; ++i) {
        L.fibers[i].state = kRunnable;
        ready.push_back(i);
      }
      continue;
    }
    char msg[200];
    std::snprintf(msg, sizeof msg,
                  "barrier divergence in block (%u,%u,%u): %d threads at __syncthreads, %d at a warp "
                  "barrier, %d finished",
                  tl_block_idx.x, tl_block_idx.y, tl_block_idx.z, at_block, num_at_warp, n - num_live);
    return msg;
  }
}

void thread_main(Launch* L, int linear, int num_blocks) {
  tl_linear = linear;
  tl_thread_idx = unflatten(linear, g_block_dim);
  for (int b = 0; b < num_blocks; ++b) {
    tl_block_idx = unflatten(b, g_grid_dim);
    L->kernel->invoke(L->kernel->fn, L->args);
    pthread_barrier_wait(&L->block_barrier);  // the next block reuses static __shared__ storage
  }
}
}  // namespace

void block_barrier() {
  if (g_launch->mode == kThreads) pthread_barrier_wait(&g_launch->block_barrier);
  else yield_with(kAtBlockBarrier);
}

void warp_barrier() {
  if (g_launch->mode == kThreads) pthread_barrier_wait(&g_launch->warp_barriers[tl_linear / 32]);
  else yield_with(kAtWarpBarrier);
}

int current_lane() { return tl_linear & 31; }

void* warp_slot(int lane) { return &g_launch->slots[(tl_linear / 32) * 32 + lane]; }

float* warp_wmma_scratch() { return &g_launch->wmma_scratch[(tl_linear / 32) * kWmmaScratch]; }
}  // namespace spindle_shim

using namespace spindle_shim;

// Runs kernel `name` over the grid with cuLaunchKernel-style `args`. mode: 0 fibers in order,
// 1 fibers in a shuffled order (seeded), 2 one OS thread per CUDA thread. Returns 0 on success,
// else writes a message to `error`.
extern "C" int shim_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                           unsigned bz, void** args, int mode, unsigned long long seed, char* error, int error_len) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const KernelEntry* kernel = nullptr;
  for (int i = 0; i < kNumKernels; ++i)
    if (std::string(kKernels[i].name) == name) kernel = &kKernels[i];
  if (kernel == nullptr) {
    std::snprintf(error, error_len, "no kernel %s in this shim build", name);
    return 1;
  }
  Launch L;
  L.mode = (Mode)mode;
  L.kernel = kernel;
  L.args = args;
  L.num_threads = (int)(bx * by * bz);
  g_grid_dim = dim3{gx, gy, gz};
  g_block_dim = dim3{bx, by, bz};
  const int num_warps = (L.num_threads + 31) / 32;
  L.slots.assign((size_t)num_warps * 32, 0);
  L.wmma_scratch.assign((size_t)num_warps * kWmmaScratch, 0.0f);
  const int num_blocks = (int)(gx * gy * gz);
  g_launch = &L;
  std::string failure;
  if (L.mode == kThreads) {
    pthread_barrier_init(&L.block_barrier, nullptr, L.num_threads);
    L.warp_barriers.resize(num_warps);
    for (int w = 0; w < num_warps; ++w) {
      int lanes = L.num_threads - w * 32 < 32 ? L.num_threads - w * 32 : 32;
      pthread_barrier_init(&L.warp_barriers[w], nullptr, lanes);
    }
    std::vector<std::thread> threads;
    for (int i = 0; i < L.num_threads; ++i) threads.emplace_back(thread_main, &L, i, num_blocks);
    for (auto& t : threads) t.join();
    for (auto& b : L.warp_barriers) pthread_barrier_destroy(&b);
    pthread_barrier_destroy(&L.block_barrier);
  } else {
    if (g_num_stacks < L.num_threads) {
      if (g_stacks) munmap(g_stacks, (size_t)g_num_stacks * kStackBytes);
      g_stacks = (char*)mmap(nullptr, (size_t)L.num_threads * kStackBytes, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      g_num_stacks = L.num_threads;
    }
    L.fibers.resize(L.num_threads);
    unsigned long long rng = seed * 2 + 1;
    for (int b = 0; b < num_blocks && failure.empty(); ++b) {
      tl_block_idx = unflatten(b, g_grid_dim);
      failure = run_block_fibers(L, rng);
    }
  }
  g_launch = nullptr;
  if (!failure.empty()) {
    std::snprintf(error, error_len, "%s: %s", name, failure.c_str());
    return 2;
  }
  return 0;
}
