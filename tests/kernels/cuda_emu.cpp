// CPU emulation of the CUDA tree attention kernels (csrc/tree_attn/tree_attn_kernels.cuh: SIMT;
// tree_attn_mma.cuh: tensor cores), for tests without a GPU.
//
// The real kernel source is compiled by the host compiler with a small shim: each CUDA thread of a block is a fiber
// on one OS thread; __syncthreads waits for the whole block and a warp-collective operation (shuffle, mma, ldmatrix)
// writes its operands, waits for its warp and reads what it needs from the other lanes; a scheduler
// resumes fibers until all wait, then releases every group whose live members all wait at the same kind of barrier
// (a divergent barrier aborts as a deadlock).
// Tensor-core primitives (FORGE_TREE_ATTN_EMU replaces tree_attn_mma_ptx.cuh): mma.m16n8k16 and ldmatrix x4 (plain
// and .trans) follow the PTX ISA fragment layouts lane by lane, so a kernel that builds a fragment wrongly computes
// wrong numbers here too; ldmatrix rows and cp.async destinations must be 16-byte aligned and inside shared memory
// (else abort). cp.async copies are deferred until the thread's cp_async_wait releases their commit group, so reading
// shared memory before waiting reads poison.
// Dynamic shared memory is one static array (blocks run one after another), filled with NaN bytes (0xff: NaN as
// fp32, fp16 and bf16) before every block; the part past what the real launcher allocates must still be NaN after it.
// fp32, fp16 and bf16 instantiations, head dims 32 and 64 (SIMT) and 32, 64, 128 (tensor cores, fp16/bf16).
// Exposed through a C ABI for ctypes; every entry point returns 0 on success, 1 on an unsupported head dim, dtype or
// implementation code, 2 if a kernel wrote shared memory past what its launcher allocates.
// Layouts as in tree_attn.h: q/o/dq/dO [T, N, H], k/v/dk/dv [T, K, H], sub_end [T], lse/delta [N, T].

// Fibers switch with _setjmp / _longjmp between stacks, which glibc's fortified longjmp (__longjmp_chk) would abort
// on: fortification off for this file (before any header reads it; it also holds where the compiler defines it).
#undef _FORTIFY_SOURCE

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#undef __host__
#define __host__
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
EmuDim emu_thread_idx, emu_block_idx, emu_block_dim, emu_grid_dim;
#define threadIdx emu_thread_idx
#define blockIdx emu_block_idx
#define blockDim emu_block_dim
#define gridDim emu_grid_dim

// One block at a time; its threads are fibers switched by a scheduler at every barrier. A fiber is entered once
// through its ucontext (makecontext / setcontext) and from then on switched with _setjmp / _longjmp, which leave the
// signal mask alone: swapcontext's sigprocmask system call on every switch (two per lane per shuffle) was most of the
// SIMT kernels' emulation time. Stacks are allocated once and reused by every block.
namespace emu {
enum Wait { kRunnable, kWarp, kBlock, kDone };
constexpr int kStackBytes = 1 << 18;

struct Fiber {
  ucontext_t ctx;
  jmp_buf resume;  // where the fiber waits (valid once started)
  bool started = false;
  Wait wait = kRunnable;
};

std::vector<Fiber> fibers;
std::vector<std::unique_ptr<char[]>> stacks;  // stacks[t]: thread t's, kept across blocks (not zeroed)
jmp_buf scheduler;
int current = 0;
constexpr int kWords = 8;
// Double-buffered: the c-th warp-collective operation of a lane uses buffer c % 2, so one wait per operation suffices.
uint64_t exchange[2][1024][kWords];
int exchange_parity[1024];
const std::function<void()>* body = nullptr;

void wait_at(Wait kind) {
  fibers[current].wait = kind;
  if (_setjmp(fibers[current].resume) == 0) _longjmp(scheduler, 1);
}

void sync_block() { wait_at(kBlock); }

// Publish up to kWords words of this lane, wait for the warp, and return the warp's 32 rows of words. A lane cannot
// start operation c + 2 (overwriting buffer c % 2) before every lane of its warp has passed the wait of operation
// c + 1, i.e. has finished reading operation c; the returned rows stay valid until this lane's next operation.
const uint64_t (*warp_exchange(const uint64_t* words, int n))[kWords] {
  const int tid = emu_thread_idx.x, warp = tid / 32;
  auto* slots = exchange[exchange_parity[tid]];
  exchange_parity[tid] ^= 1;
  std::copy(words, words + n, slots[tid]);
  wait_at(kWarp);
  return slots + warp * 32;
}

float shuffle(float v, int src_lane) {
  uint64_t w = 0;
  std::memcpy(&w, &v, sizeof(v));
  const uint64_t bits = warp_exchange(&w, 1)[src_lane][0];
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

void fiber_main() {
  (*body)();
  fibers[current].wait = kDone;
  _longjmp(scheduler, 1);  // never returns (the context has no uc_link)
}

// Run fiber t until it waits or ends. Its own frame holds the _setjmp, so no caller's locals live across the jump.
__attribute__((noinline)) void resume(int t) {
  if (_setjmp(scheduler) != 0) return;
  Fiber& f = fibers[t];
  if (!f.started) {
    f.started = true;
    setcontext(&f.ctx);
  }
  _longjmp(f.resume, 1);
}

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

void reset_async_copies();

void run_block(int threads, const std::function<void()>& kernel) {
  fibers.assign(threads, Fiber{});
  std::fill(exchange_parity, exchange_parity + threads, 0);
  reset_async_copies();
  body = &kernel;
  while (static_cast<int>(stacks.size()) < threads) stacks.emplace_back(new char[kStackBytes]);
  for (int t = 0; t < threads; ++t) {
    Fiber& f = fibers[t];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks[t].get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
  }
  for (;;) {
    bool ran = false;
    for (int t = 0; t < threads; ++t) {
      if (fibers[t].wait != kRunnable) continue;
      current = t;
      emu_thread_idx = {t, 0, 0};
      resume(t);
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

// ---------------------------------------------------------------- tensor-core primitives (tree_attn_mma_ptx.cuh)
#define FORGE_TREE_ATTN_EMU 1
#include "tree_attn_mma_ptx.cuh"

namespace emu {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "cuda_emu: %s\n", what);
  std::abort();
}

void check_shared(const void* ptr, const char* what) {
  const auto* lo = reinterpret_cast<const char*>(forge::tree_attn_detail::smem);
  const auto* p = reinterpret_cast<const char*>(ptr);
  if (p < lo || p + 16 > lo + sizeof(forge::tree_attn_detail::smem)) fail(what);
  if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) fail(what);
}

struct AsyncCopy {
  void* dst;
  const void* src;
  bool valid;
};
std::vector<AsyncCopy> open_copies[1024];                  // issued, not yet committed, per thread
std::vector<std::vector<AsyncCopy>> committed_copies[1024];  // commit groups in order, per thread

void reset_async_copies() {
  for (int t = 0; t < 1024; ++t) {
    open_copies[t].clear();
    committed_copies[t].clear();
  }
}

template <typename scalar_t>
float bits_to_float(uint32_t bits16) {
  const uint16_t b = static_cast<uint16_t>(bits16);
  scalar_t x;
  std::memcpy(&x, &b, sizeof(b));
  return forge::tree_attn_detail::to_float(x);
}

}  // namespace emu

namespace forge::tree_attn_detail {

// d += A B per the m16n8k16 fragment layouts: lane (g, t) holds A[g + 8 (r % 2)][2t + 8 (r / 2) + h] in register r
// (half h), B[2t + 8 r + h][g] in register r, and d[e] = C[g + 8 (e / 2)][2t + e % 2].
template <typename scalar_t>
void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const uint64_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const auto* all = emu::warp_exchange(mine, 6);
  const int lane = emu_thread_idx.x % 32, g = lane / 4, t = lane % 4;
  auto A = [&](int r, int k) {
    const uint64_t w = all[(r % 8) * 4 + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)];
    return emu::bits_to_float<scalar_t>(static_cast<uint32_t>(w >> (16 * (k % 2))));
  };
  auto B = [&](int k, int n) {
    const uint64_t w = all[n * 4 + (k % 8) / 2][4 + (k >= 8)];
    return emu::bits_to_float<scalar_t>(static_cast<uint32_t>(w >> (16 * (k % 2))));
  };
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    d[e] += acc;
  }
}

inline void ldmatrix_x4_impl(uint32_t (&r)[4], const void* row, bool trans) {
  emu::check_shared(row, "ldmatrix row address not 16-byte aligned or outside shared memory");
  const uint64_t mine[1] = {reinterpret_cast<std::uintptr_t>(row)};
  const auto* all = emu::warp_exchange(mine, 1);
  const int lane = emu_thread_idx.x % 32;
  auto row_of = [&](int lane_src) { return reinterpret_cast<const uint16_t*>(all[lane_src][0]); };
  for (int i = 0; i < 4; ++i) {
    uint32_t lo, hi;
    if (!trans) {
      const uint16_t* rp = row_of(8 * i + lane / 4);
      lo = rp[2 * (lane % 4)];
      hi = rp[2 * (lane % 4) + 1];
    } else {
      lo = row_of(8 * i + 2 * (lane % 4))[lane / 4];
      hi = row_of(8 * i + 2 * (lane % 4) + 1)[lane / 4];
    }
    r[i] = lo | (hi << 16);
  }
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) { ldmatrix_x4_impl(r, row, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { ldmatrix_x4_impl(r, row, true); }

inline void cp_async_16(void* dst, const void* src, bool valid) {
  emu::check_shared(dst, "cp.async destination not 16-byte aligned or outside shared memory");
  if (valid && reinterpret_cast<std::uintptr_t>(src) % 16 != 0) emu::fail("cp.async source not 16-byte aligned");
  emu::open_copies[emu_thread_idx.x].push_back({dst, src, valid});
}

inline void cp_async_commit() {
  const int tid = emu_thread_idx.x;
  emu::committed_copies[tid].push_back(std::move(emu::open_copies[tid]));
  emu::open_copies[tid].clear();
}

template <int kPending>
void cp_async_wait() {
  auto& groups = emu::committed_copies[emu_thread_idx.x];
  while (static_cast<int>(groups.size()) > kPending) {
    for (const auto& c : groups.front()) {
      if (c.valid) std::memcpy(c.dst, c.src, 16);
      else std::memset(c.dst, 0, 16);
    }
    groups.erase(groups.begin());
  }
}

inline void atomic_add_f32(float* addr, float v) { *addr += v; }  // fibers of one OS thread: already atomic

}  // namespace forge::tree_attn_detail

#include "tree_attn_mma.cuh"

namespace {

using forge::TreeAttnParams;
namespace detail = forge::tree_attn_detail;

bool smem_overflow = false;  // set when a kernel wrote shared memory past its launcher's allocation

// Run `kernel` over a (gx, gy) grid of blocks of `threads` threads, one block at a time. Shared memory starts as NaN
// (reads before writes poison the outputs); past the `smem_bytes` the real launcher allocates it must stay NaN.
void launch(int gx, int gy, int threads, size_t smem_bytes, const std::function<void()>& kernel) {
  constexpr size_t capacity = sizeof(detail::smem) / sizeof(float);
  const size_t used = (smem_bytes + sizeof(float) - 1) / sizeof(float);
  emu_block_dim = {threads, 1, 1};
  emu_grid_dim = {gx, gy, 1};
  for (int by = 0; by < gy; ++by) {
    for (int bx = 0; bx < gx; ++bx) {
      std::memset(detail::smem, 0xff, sizeof(detail::smem));  // NaN in fp32, fp16 and bf16
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
void run_simt(TreeAttnParams p, bool backward) {
  std::vector<int> kmin, kmax;
  block_bounds(p, kmin, kmax);
  if (!backward) {
    launch(tiles(p.Tq), p.N, detail::kThreads, detail::fwd_smem_bytes<H>(), [&] { detail::fwd_kernel<scalar_t, H>(p); });
    return;
  }
  launch(tiles(p.Tq), p.N, detail::kThreads, detail::dq_smem_bytes<H>(), [&] { detail::bwd_dq_kernel<scalar_t, H>(p); });
  launch(tiles(p.T), p.K, detail::kThreads, detail::dkdv_smem_bytes<H>(),
         [&] { detail::bwd_dkdv_kernel<scalar_t, H>(p); });
}

// The tensor-core kernels, launched as tree_attn_kernels.cu does (dq_accum zeroed, then dq_convert_kernel).
template <typename scalar_t, int H>
void run_mma(TreeAttnParams p, bool backward) {
  std::vector<int> kmin, kmax;
  block_bounds(p, kmin, kmax);
  const int blocks = (p.T + detail::kMmaBlock - 1) / detail::kMmaBlock;
  if (!backward) {
    constexpr int BQ = detail::FwdTile<H>::BQ;
    launch((p.T + BQ - 1) / BQ, p.N, detail::kMmaThreads, detail::fwd_mma_smem_bytes<scalar_t, H>(),
           [&] { detail::fwd_mma_kernel<scalar_t, H>(p); });
    return;
  }
  const long count = static_cast<long>(p.T) * p.N * H;
  std::vector<float> dq_accum(count, 0.f);
  p.dq_accum = dq_accum.data();
  launch(blocks, p.K, detail::kMmaThreads, detail::bwd_mma_smem_bytes<scalar_t, H>(),
         [&] { detail::bwd_mma_kernel<scalar_t, H>(p); });
  launch(static_cast<int>(std::min<long>((count + 255) / 256, 4)), 1, 256, 0,
         [&] { detail::dq_convert_kernel<scalar_t>(p.dq_accum, static_cast<scalar_t*>(p.dq), count, p.scale); });
}

// impl: 0 SIMT (fp32, fp16, bf16; head dims 32, 64), 1 tensor cores (fp16, bf16; head dims 32, 64, 128; Tq = T,
// as tree_attn_mma_unsupported requires).
template <typename scalar_t>
int run_head_dim(const TreeAttnParams& p, bool backward, int impl) {
  if (impl == 1 && p.Tq != p.T) return 1;
  if (impl == 0) {
    switch (p.H) {
      case 32: run_simt<scalar_t, 32>(p, backward); return 0;
      case 64: run_simt<scalar_t, 64>(p, backward); return 0;
      default: return 1;
    }
  }
  if constexpr (std::is_same_v<scalar_t, float>) {
    return 1;
  } else {
    switch (p.H) {
      case 32: run_mma<scalar_t, 32>(p, backward); return 0;
      case 64: run_mma<scalar_t, 64>(p, backward); return 0;
      case 128: run_mma<scalar_t, 128>(p, backward); return 0;
      default: return 1;
    }
  }
}

// dtype: 0 fp32, 1 fp16, 2 bf16 (tensors in that dtype; lse/delta always fp32).
int run_dtype(const TreeAttnParams& p, int dtype, bool backward, int impl) {
  if (impl != 0 && impl != 1) return 1;
  switch (dtype) {
    case 0: return run_head_dim<float>(p, backward, impl);
    case 1: return run_head_dim<__half>(p, backward, impl);
    case 2: return run_head_dim<__nv_bfloat16>(p, backward, impl);
    default: return 1;
  }
}

int run(const TreeAttnParams& p, int dtype, bool backward, int impl) {
  smem_overflow = false;
  const int rc = run_dtype(p, dtype, backward, impl);
  return rc != 0 ? rc : (smem_overflow ? 2 : 0);
}

TreeAttnParams params(const void* q, const void* k, const void* v, const int* sub_end, int T, int Tq, int N, int K,
                      int H, float scale) {
  TreeAttnParams p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.sub_end = sub_end;
  p.T = T;
  p.Tq = Tq;
  p.N = N;
  p.K = K;
  p.H = H;
  p.scale = scale;
  return p;
}

}  // namespace

extern "C" int emu_block_bounds(const int* sub_end, int T, int* kmin, int* kmax) {
  TreeAttnParams p = params(nullptr, nullptr, nullptr, sub_end, T, T, 1, 1, 32, 1.f);
  std::vector<int> lo, hi;
  block_bounds(p, lo, hi);
  std::copy(lo.begin(), lo.end(), kmin);
  std::copy(hi.begin(), hi.end(), kmax);
  return 0;
}

// T keys, Tq queries (tokens [T - Tq, T)).
extern "C" int emu_fwd(const void* q, const void* k, const void* v, const int* sub_end, void* o, float* lse, int T,
                       int Tq, int N, int K, int H, float scale, int dtype, int impl) {
  TreeAttnParams p = params(q, k, v, sub_end, T, Tq, N, K, H, scale);
  p.o = o;
  p.lse = lse;
  return run(p, dtype, /*backward=*/false, impl);
}

extern "C" int emu_bwd(const void* d_o, const void* q, const void* k, const void* v, const float* lse,
                       const float* delta, const int* sub_end, void* dq, void* dk, void* dv, int T, int Tq, int N,
                       int K, int H, float scale, int dtype, int impl) {
  TreeAttnParams p = params(q, k, v, sub_end, T, Tq, N, K, H, scale);
  p.d_o = d_o;
  p.lse = const_cast<float*>(lse);
  p.delta = delta;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  return run(p, dtype, /*backward=*/true, impl);
}
