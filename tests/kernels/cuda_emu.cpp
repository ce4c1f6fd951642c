// CPU emulation of the CUDA tree attention kernels (csrc/tree_attn/tree_attn_kernels.cuh), for tests without a GPU.
//
// The real kernel source is compiled by the host compiler with a small shim: each CUDA thread of a block is a fiber
// (ucontext) on one OS thread; __syncthreads waits for the whole block and a warp shuffle writes its value, waits for
// its warp and reads its partner's value; a scheduler resumes fibers until all wait, then releases every
// group whose live members all wait at the same kind of barrier (a divergent barrier aborts as a deadlock).
// Dynamic shared memory is one static array (blocks run one after another); the part past what the real launcher
// allocates is poisoned with NaN and checked after every block.
// fp32, fp16 and bf16 instantiations, head dims 32 and 64. Exposed through a C ABI for ctypes; every entry point
// returns 0 on success, 1 on an unsupported head dim or dtype code, 2 if a kernel wrote shared memory past what its
// launcher allocates.
// Layouts as in tree_attn.h: q/o/dq/dO [T, N, H], k/v/dk/dv [T, K, H], sub_end [T], lse/delta [N, T].

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__

struct EmuDim {
  int x = 0, y = 0, z = 0;
};
EmuDim emu_thread_idx, emu_block_idx, emu_block_dim;
#define threadIdx emu_thread_idx
#define blockIdx emu_block_idx
#define blockDim emu_block_dim

// One block at a time; its threads are fibers (ucontext) switched by a scheduler at every barrier.
namespace emu {
enum Wait { kRunnable, kWarp, kBlock, kDone };
constexpr int kStackBytes = 1 << 18;

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  Wait wait = kRunnable;
};

std::vector<Fiber> fibers;
ucontext_t scheduler;
int current = 0;
float exchange[2][1024];  // double-buffered: shuffle g uses buffer g % 2, so one wait per shuffle suffices
int shuffle_parity[1024];
const std::function<void()>* body = nullptr;

void wait_at(Wait kind) {
  fibers[current].wait = kind;
  swapcontext(&fibers[current].ctx, &scheduler);
}

void sync_block() { wait_at(kBlock); }

// A lane cannot start shuffle g + 2 (overwriting buffer g % 2) before every lane of its warp has passed the wait
// of shuffle g + 1, i.e. has finished reading shuffle g.
float shuffle(float v, int src_lane) {
  const int tid = emu_thread_idx.x, warp = tid / 32;
  float* slots = exchange[shuffle_parity[tid]];
  shuffle_parity[tid] ^= 1;
  slots[tid] = v;
  wait_at(kWarp);
  return slots[warp * 32 + src_lane];
}

void fiber_main() {
  (*body)();
  fibers[current].wait = kDone;
}  // returns to the scheduler through uc_link

// Release a group whose live members all wait at the same barrier kind; false if none can be released.
bool release(int lo, int hi, Wait kind) {
  bool any = false;
  for (int t = lo; t < hi; ++t) {
    if (fibers[t].wait == kDone) continue;
    if (fibers[t].wait != kind) return false;
    any = true;
  }
  for (int t = lo; t < hi; ++t)
    if (fibers[t].wait == kind) fibers[t].wait = kRunnable;
  return any;
}

void run_block(int threads, const std::function<void()>& kernel) {
  fibers.assign(threads, Fiber{});
  std::fill(shuffle_parity, shuffle_parity + threads, 0);
  body = &kernel;
  for (int t = 0; t < threads; ++t) {
    Fiber& f = fibers[t];
    f.stack.resize(kStackBytes);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &scheduler;
    makecontext(&f.ctx, fiber_main, 0);
  }
  for (;;) {
    bool ran = false;
    for (int t = 0; t < threads; ++t) {
      if (fibers[t].wait != kRunnable) continue;
      current = t;
      emu_thread_idx = {t, 0, 0};
      swapcontext(&scheduler, &fibers[t].ctx);
      ran = true;
    }
    bool released = release(0, threads, kBlock);
    for (int w = 0; w * 32 < threads; ++w) released |= release(w * 32, std::min(threads, w * 32 + 32), kWarp);
    const bool all_done = std::all_of(fibers.begin(), fibers.end(), [](const Fiber& f) { return f.wait == kDone; });
    if (all_done) return;
    if (!ran && !released) {
      std::fprintf(stderr, "cuda_emu: deadlock (divergent barrier or shuffle)\n");
      std::abort();
    }
  }
}
}  // namespace emu

#define __syncthreads() emu::sync_block()
#define __shfl_sync(mask, v, src) emu::shuffle((v), (src))
#define __shfl_xor_sync(mask, v, off) emu::shuffle((v), (emu_thread_idx.x % 32) ^ (off))

namespace forge::tree_attn_detail {
alignas(16) float smem[1 << 16];
using std::max;
using std::min;
}  // namespace forge::tree_attn_detail

#include "tree_attn_kernels.cuh"

namespace {

using forge::TreeAttnParams;
namespace detail = forge::tree_attn_detail;

bool smem_overflow = false;  // set when a kernel wrote shared memory past its launcher's allocation

// Run `kernel` over a (gx, gy) grid of blocks of `threads` threads, one block at a time. Shared memory past the
// `smem_bytes` the real launcher allocates holds NaN (reads poison the outputs) and must stay NaN (no stray writes).
void launch(int gx, int gy, int threads, size_t smem_bytes, const std::function<void()>& kernel) {
  constexpr size_t capacity = sizeof(detail::smem) / sizeof(float);
  const size_t used = (smem_bytes + sizeof(float) - 1) / sizeof(float);
  emu_block_dim = {threads, 1, 1};
  for (int by = 0; by < gy; ++by) {
    for (int bx = 0; bx < gx; ++bx) {
      std::fill(detail::smem + used, detail::smem + capacity, NAN);
      emu_block_idx = {bx, by, 0};
      emu::run_block(threads, kernel);
      if (!std::all_of(detail::smem + used, detail::smem + capacity, [](float x) { return std::isnan(x); }))
        smem_overflow = true;
    }
  }
}

int tiles(int T) { return (T + detail::kTile - 1) / detail::kTile; }

void block_bounds(TreeAttnParams& p, std::vector<int>& kmin, std::vector<int>& kmax) {
  kmin.assign(tiles(p.T), -1);
  kmax.assign(tiles(p.T), -1);
  int* lo = kmin.data();
  int* hi = kmax.data();
  launch((tiles(p.T) + 127) / 128, 1, 128, 0, [&] { detail::block_bounds_kernel(p.sub_end, lo, hi, p.T); });
  p.kmin = kmin.data();
  p.kmax = kmax.data();
}

template <typename scalar_t, int H>
void run_typed(TreeAttnParams p, bool backward) {
  std::vector<int> kmin, kmax;
  block_bounds(p, kmin, kmax);
  if (!backward) {
    launch(tiles(p.T), p.N, detail::kThreads, detail::fwd_smem_bytes<H>(), [&] { detail::fwd_kernel<scalar_t, H>(p); });
    return;
  }
  launch(tiles(p.T), p.N, detail::kThreads, detail::dq_smem_bytes<H>(), [&] { detail::bwd_dq_kernel<scalar_t, H>(p); });
  launch(tiles(p.T), p.K, detail::kThreads, detail::dkdv_smem_bytes<H>(),
         [&] { detail::bwd_dkdv_kernel<scalar_t, H>(p); });
}

// dtype: 0 fp32, 1 fp16, 2 bf16 (tensors in that dtype; lse/delta always fp32). Head dims 32 and 64.
template <typename scalar_t>
int run_head_dim(const TreeAttnParams& p, bool backward) {
  switch (p.H) {
    case 32: run_typed<scalar_t, 32>(p, backward); return 0;
    case 64: run_typed<scalar_t, 64>(p, backward); return 0;
    default: return 1;
  }
}

int run_dtype(const TreeAttnParams& p, int dtype, bool backward) {
  switch (dtype) {
    case 0: return run_head_dim<float>(p, backward);
    case 1: return run_head_dim<__half>(p, backward);
    case 2: return run_head_dim<__nv_bfloat16>(p, backward);
    default: return 1;
  }
}

int run(const TreeAttnParams& p, int dtype, bool backward) {
  smem_overflow = false;
  const int rc = run_dtype(p, dtype, backward);
  return rc != 0 ? rc : (smem_overflow ? 2 : 0);
}

TreeAttnParams params(const void* q, const void* k, const void* v, const int* sub_end, int T, int N, int K, int H,
                      float scale) {
  TreeAttnParams p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.sub_end = sub_end;
  p.T = T;
  p.N = N;
  p.K = K;
  p.H = H;
  p.scale = scale;
  return p;
}

}  // namespace

extern "C" int emu_block_bounds(const int* sub_end, int T, int* kmin, int* kmax) {
  TreeAttnParams p = params(nullptr, nullptr, nullptr, sub_end, T, 1, 1, 32, 1.f);
  std::vector<int> lo, hi;
  block_bounds(p, lo, hi);
  std::copy(lo.begin(), lo.end(), kmin);
  std::copy(hi.begin(), hi.end(), kmax);
  return 0;
}

extern "C" int emu_fwd(const void* q, const void* k, const void* v, const int* sub_end, void* o, float* lse, int T,
                       int N, int K, int H, float scale, int dtype) {
  TreeAttnParams p = params(q, k, v, sub_end, T, N, K, H, scale);
  p.o = o;
  p.lse = lse;
  return run(p, dtype, /*backward=*/false);
}

extern "C" int emu_bwd(const void* d_o, const void* q, const void* k, const void* v, const float* lse,
                       const float* delta, const int* sub_end, void* dq, void* dk, void* dv, int T, int N, int K,
                       int H, float scale, int dtype) {
  TreeAttnParams p = params(q, k, v, sub_end, T, N, K, H, scale);
  p.d_o = d_o;
  p.lse = const_cast<float*>(lse);
  p.delta = delta;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  return run(p, dtype, /*backward=*/true);
}
