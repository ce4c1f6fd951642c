// Tree attention forward and backward kernels (FlashAttention-2 style) with tile skipping, plain CUDA C++.
// Device code only; launchers are in tree_attn_kernels.cu. Also compiled by the CPU emulation test
// (tests/kernels/cuda_emu.cpp), which supplies threads, barriers and shuffles for these kernels.
//
// Mask: key j visible to query i  <=>  j <= i < sub_end[j]. For a tile of queries [q_lo, q_hi) and keys
// [k_lo, k_hi): empty if k_lo >= q_hi or max(sub_end[k_lo:k_hi]) <= q_lo (skipped); full if k_hi - 1 <= q_lo and
// min(sub_end[k_lo:k_hi]) >= q_hi (no mask); partial otherwise (mask per element). Tiles are 32 x 32 and the
// classification is uniform across a thread block, so skipping costs no divergence.
//
// Forward: online softmax in base 2 (s = scale * log2(e) * q.k), fp32 accumulation; lse = (m + log2 l) * ln 2.
// Backward: P = 2^(s - lse * log2 e), dV = P^T dO, dS = P * (dO V^T - delta), dQ = scale dS K, dK = scale dS^T Q,
// with delta = rowsum(dO * O) precomputed. dQ and dK/dV are separate kernels (no atomics); the dK/dV kernel loops
// over the N/K query heads of its key/value head (GQA).
//
// Thread mapping (4 warps, 8 rows per warp): a lane owns one partner token of the current 32-wide tile for the
// dot products (q_i . k_lane) and H/32 columns of the accumulators; probabilities are broadcast with shuffles.
// Shared-memory rows read per lane are padded to H + 1 floats to avoid bank conflicts.
// Suffix queries (Tq < T): the Tq query rows are tree tokens [q0, T), q0 = T - Tq; query tiles are laid from q0,
// the mask and the tile tests use tree positions, rows of q/o/dq/dO/lse/delta are positions minus q0.
// Tensor names: T tokens (keys), Tq queries, N query heads, K kv heads, H head dim (see tree_attn.h for layouts).

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <climits>
#include <cstddef>

#include "tree_attn.h"

namespace forge::tree_attn_detail {


constexpr int kTile = kTreeAttnTile;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = kTile / kWarps;  // rows (fwd/dq: queries, dk/dv: keys) owned by each warp
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename scalar_t>
__device__ __forceinline__ scalar_t from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_max(float x) {
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// Copy rows [t0, t0 + kTile) of one head into shared memory as fp32 with row stride `ld`; rows past T are zero.
template <typename scalar_t, int H>
__device__ void load_tile(float* dst, int ld, const scalar_t* src, int t0, int T, int heads, int head) {
  for (int idx = threadIdx.x; idx < kTile * H; idx += kThreads) {
    const int r = idx / H, h = idx % H, t = t0 + r;
    dst[r * ld + h] = t < T ? to_float(src[(static_cast<long>(t) * heads + head) * H + h]) : 0.f;
  }
}

// Copy 32 fp32/int per-token values starting at t0; past T they read as `fill`.
template <typename T_>
__device__ void load_vec(T_* dst, const T_* src, int t0, int T, T_ fill) {
  if (threadIdx.x < kTile) {
    const int t = t0 + threadIdx.x;
    dst[threadIdx.x] = t < T ? src[t] : fill;
  }
}

template <int H>
__device__ __forceinline__ float dot_rows(const float* a, const float* b) {
  float s = 0.f;
#pragma unroll 16
  for (int h = 0; h < H; ++h) s += a[h] * b[h];
  return s;
}

// acc[c] += sum_jj coef(lane jj) * tile[jj * ld + c * 32 + lane]: the warp's 32 coefficients times a shared tile.
template <int H>
__device__ __forceinline__ void accumulate_broadcast(float (&acc)[H / 32], float coef, const float* tile, int ld) {
  const int lane = threadIdx.x % 32;
#pragma unroll 4
  for (int jj = 0; jj < 32; ++jj) {
    const float w = __shfl_sync(kFullMask, coef, jj);
#pragma unroll
    for (int c = 0; c < H / 32; ++c) acc[c] += w * tile[jj * ld + c * 32 + lane];
  }
}

__device__ __forceinline__ bool tile_is_full(int q_lo, int q_hi, int k_lo, int kmin) {
  return k_lo + kTile - 1 <= q_lo && kmin >= q_hi;
}

__device__ __forceinline__ bool visible(int i, int j, int sub_end_j) { return j <= i && i < sub_end_j; }

__global__ void block_bounds_kernel(const int* sub_end, int* kmin, int* kmax, int T) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b * kTile >= T) return;
  int lo = INT_MAX, hi = 0;
  for (int t = b * kTile; t < min(T, (b + 1) * kTile); ++t) {
    lo = min(lo, sub_end[t]);
    hi = max(hi, sub_end[t]);
  }
  kmin[b] = lo;
  kmax[b] = hi;
}

// Dynamic shared memory of each kernel, matching the layouts written at the top of the kernels.
template <int H>
constexpr size_t fwd_smem_bytes() { return sizeof(float) * kTile * (3 * H + 1) + sizeof(int) * kTile; }
template <int H>
constexpr size_t dq_smem_bytes() { return sizeof(float) * kTile * (4 * H + 2) + sizeof(int) * kTile; }
template <int H>
constexpr size_t dkdv_smem_bytes() { return sizeof(float) * kTile * (4 * H + 4) + sizeof(int) * kTile; }

// grid (ceil(Tq / 32), N). Shared: q [32][H], k [32][H+1], v [32][H], sub_end [32].
template <typename scalar_t, int H>
__global__ void __launch_bounds__(kThreads) fwd_kernel(TreeAttnParams p) {
  constexpr int C = H / 32;
  extern __shared__ float smem[];
  float* q_s = smem;
  float* k_s = q_s + kTile * H;
  float* v_s = k_s + kTile * (H + 1);
  int* se_s = reinterpret_cast<int*>(v_s + kTile * H);

  const int n = blockIdx.y, kv = n / (p.N / p.K);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = p.T - p.Tq;
  const int q_lo = q0 + blockIdx.x * kTile, q_hi = min(q_lo + kTile, p.T);
  const float qk_scale = p.scale * kLog2e;
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);

  load_tile<scalar_t, H>(q_s, H, q, q_lo - q0, p.Tq, p.N, n);
  float m[kRows], l[kRows], acc[kRows][C];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -FLT_MAX;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) acc[r][c] = 0.f;
  }

  for (int kb = 0; kb * kTile < q_hi; ++kb) {
    if (p.kmax[kb] <= q_lo) continue;  // empty tile
    const int k_lo = kb * kTile;
    const bool full = tile_is_full(q_lo, q_hi, k_lo, p.kmin[kb]);
    __syncthreads();  // previous tile fully consumed
    load_tile<scalar_t, H>(k_s, H + 1, k, k_lo, p.T, p.K, kv);
    load_tile<scalar_t, H>(v_s, H, v, k_lo, p.T, p.K, kv);
    load_vec<int>(se_s, p.sub_end, k_lo, p.T, 0);
    __syncthreads();
    const int j = k_lo + lane, se_j = se_s[lane];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = warp * kRows + r, i = q_lo + row;
      const float s = dot_rows<H>(q_s + row * H, k_s + lane * (H + 1)) * qk_scale;
      const bool vis = full || visible(i, j, se_j);
      const float tile_max = warp_max(vis ? s : -FLT_MAX);
      if (tile_max == -FLT_MAX) continue;  // warp-uniform: this row sees nothing in the tile
      const float m_new = fmaxf(m[r], tile_max);
      const float alpha = exp2f(m[r] - m_new);
      const float pj = vis ? exp2f(s - m_new) : 0.f;
      l[r] = l[r] * alpha + warp_sum(pj);
#pragma unroll
      for (int c = 0; c < C; ++c) acc[r][c] *= alpha;
      accumulate_broadcast<H>(acc[r], pj, v_s, H);
      m[r] = m_new;
    }
  }

  auto* o = static_cast<scalar_t*>(p.o);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = q_lo + warp * kRows + r - q0;  // query row
    if (i >= p.Tq) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) o[(static_cast<long>(i) * p.N + n) * H + c * 32 + lane] = from_float<scalar_t>(acc[r][c] * inv);
    if (lane == 0) p.lse[static_cast<long>(n) * p.Tq + i] = (m[r] + log2f(l[r])) * kLn2;
  }
}

// grid (ceil(Tq / 32), N). Shared: q [32][H], dO [32][H], k [32][H+1], v [32][H+1], sub_end [32].
template <typename scalar_t, int H>
__global__ void __launch_bounds__(kThreads) bwd_dq_kernel(TreeAttnParams p) {
  constexpr int C = H / 32;
  extern __shared__ float smem[];
  float* q_s = smem;
  float* do_s = q_s + kTile * H;
  float* k_s = do_s + kTile * H;
  float* v_s = k_s + kTile * (H + 1);
  int* se_s = reinterpret_cast<int*>(v_s + kTile * (H + 1));

  const int n = blockIdx.y, kv = n / (p.N / p.K);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = p.T - p.Tq;
  const int q_lo = q0 + blockIdx.x * kTile, q_hi = min(q_lo + kTile, p.T);
  const float qk_scale = p.scale * kLog2e;

  load_tile<scalar_t, H>(q_s, H, static_cast<const scalar_t*>(p.q), q_lo - q0, p.Tq, p.N, n);
  load_tile<scalar_t, H>(do_s, H, static_cast<const scalar_t*>(p.d_o), q_lo - q0, p.Tq, p.N, n);
  float lse2[kRows], delta[kRows], dq[kRows][C];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = q_lo + warp * kRows + r - q0;  // query row
    lse2[r] = i < p.Tq ? p.lse[static_cast<long>(n) * p.Tq + i] * kLog2e : 0.f;
    delta[r] = i < p.Tq ? p.delta[static_cast<long>(n) * p.Tq + i] : 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) dq[r][c] = 0.f;
  }

  for (int kb = 0; kb * kTile < q_hi; ++kb) {
    if (p.kmax[kb] <= q_lo) continue;
    const int k_lo = kb * kTile;
    const bool full = tile_is_full(q_lo, q_hi, k_lo, p.kmin[kb]);
    __syncthreads();
    load_tile<scalar_t, H>(k_s, H + 1, static_cast<const scalar_t*>(p.k), k_lo, p.T, p.K, kv);
    load_tile<scalar_t, H>(v_s, H + 1, static_cast<const scalar_t*>(p.v), k_lo, p.T, p.K, kv);
    load_vec<int>(se_s, p.sub_end, k_lo, p.T, 0);
    __syncthreads();
    const int j = k_lo + lane, se_j = se_s[lane];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = warp * kRows + r, i = q_lo + row;
      const bool vis = full || visible(i, j, se_j);
      const float s = dot_rows<H>(q_s + row * H, k_s + lane * (H + 1)) * qk_scale;
      const float pij = vis ? exp2f(s - lse2[r]) : 0.f;
      const float dp = dot_rows<H>(do_s + row * H, v_s + lane * (H + 1));
      accumulate_broadcast<H>(dq[r], pij * (dp - delta[r]), k_s, H + 1);
    }
  }

  auto* dq_out = static_cast<scalar_t*>(p.dq);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = q_lo + warp * kRows + r - q0;  // query row
    if (i >= p.Tq) continue;
#pragma unroll
    for (int c = 0; c < C; ++c)
      dq_out[(static_cast<long>(i) * p.N + n) * H + c * 32 + lane] = from_float<scalar_t>(dq[r][c] * p.scale);
  }
}

// grid (ceil(T / 32), K). Shared: k [32][H], v [32][H], q [32][H+1], dO [32][H+1], lse, delta [32], sub_end [32].
// Queries that see any key of the block lie in [k_lo, max(sub_end)), and queries are tokens [q0, T): only the query
// tiles from max(k_lo, q0) to max(sub_end) are visited.
template <typename scalar_t, int H>
__global__ void __launch_bounds__(kThreads) bwd_dkdv_kernel(TreeAttnParams p) {
  constexpr int C = H / 32;
  extern __shared__ float smem[];
  float* k_s = smem;
  float* v_s = k_s + kTile * H;
  float* q_s = v_s + kTile * H;
  float* do_s = q_s + kTile * (H + 1);
  float* lse_s = do_s + kTile * (H + 1);
  float* delta_s = lse_s + kTile;
  int* se_s = reinterpret_cast<int*>(delta_s + kTile);

  const int kb = blockIdx.x, kv = blockIdx.y, group = p.N / p.K;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k_lo = kb * kTile, kmin = p.kmin[kb], q_end = p.kmax[kb], q0 = p.T - p.Tq;
  const float qk_scale = p.scale * kLog2e;

  load_tile<scalar_t, H>(k_s, H, static_cast<const scalar_t*>(p.k), k_lo, p.T, p.K, kv);
  load_tile<scalar_t, H>(v_s, H, static_cast<const scalar_t*>(p.v), k_lo, p.T, p.K, kv);
  load_vec<int>(se_s, p.sub_end, k_lo, p.T, 0);
  float dk[kRows][C], dv[kRows][C];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c) dk[r][c] = dv[r][c] = 0.f;

  for (int g = 0; g < group; ++g) {
    const int n = kv * group + g;
    for (int q_lo = max(k_lo, q0); q_lo < q_end; q_lo += kTile) {
      const int q_hi = min(q_lo + kTile, p.T);
      const bool full = tile_is_full(q_lo, q_hi, k_lo, kmin);
      __syncthreads();
      load_tile<scalar_t, H>(q_s, H + 1, static_cast<const scalar_t*>(p.q), q_lo - q0, p.Tq, p.N, n);
      load_tile<scalar_t, H>(do_s, H + 1, static_cast<const scalar_t*>(p.d_o), q_lo - q0, p.Tq, p.N, n);
      load_vec<float>(lse_s, p.lse + static_cast<long>(n) * p.Tq, q_lo - q0, p.Tq, 0.f);
      load_vec<float>(delta_s, p.delta + static_cast<long>(n) * p.Tq, q_lo - q0, p.Tq, 0.f);
      __syncthreads();
      const int i = q_lo + lane;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int key = warp * kRows + r;
        const bool vis = full || visible(i, k_lo + key, se_s[key]);
        const float s = dot_rows<H>(q_s + lane * (H + 1), k_s + key * H) * qk_scale;
        const float pij = vis ? exp2f(s - lse_s[lane] * kLog2e) : 0.f;
        const float dp = dot_rows<H>(do_s + lane * (H + 1), v_s + key * H);
        accumulate_broadcast<H>(dv[r], pij, do_s, H + 1);
        accumulate_broadcast<H>(dk[r], pij * (dp - delta_s[lane]), q_s, H + 1);
      }
    }
  }

  auto* dk_out = static_cast<scalar_t*>(p.dk);
  auto* dv_out = static_cast<scalar_t*>(p.dv);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int j = k_lo + warp * kRows + r;
    if (j >= p.T) continue;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const long off = (static_cast<long>(j) * p.K + kv) * H + c * 32 + lane;
      dk_out[off] = from_float<scalar_t>(dk[r][c] * p.scale);
      dv_out[off] = from_float<scalar_t>(dv[r][c]);
    }
  }
}

}  // namespace forge::tree_attn_detail
