// Tensor-core tree attention (fp16/bf16 inputs, fp32 accumulation) for sm_80+: FlashAttention-2 structure on
// mma.sync.m16n8k16, ldmatrix and cp.async (tree_attn_mma_ptx.cuh). Device code only; the launchers in
// tree_attn_kernels.cu pick these kernels over the SIMT ones (tree_attn_kernels.cuh) for fp16/bf16 on sm_80+.
// The CPU emulation test (tests/kernels/cuda_emu.cpp) runs this exact source with emulated primitives.
//
// Mask as in tree_attn_kernels.cuh: key j visible to query i <=> j <= i < sub_end[j]. Block bounds (min/max of
// sub_end) are per 32 keys; a 64-key tile combines two. Classification is per warp (16 rows), so a warp whose rows
// see nothing in a tile skips its matrix products and a warp whose rows see every key runs unmasked.
//
// Forward: grid (ceil(T / BQ), N), 4 warps x 32 queries at H <= 64 (two m-tiles of 16 rows per warp, so every K and V
// fragment read from shared memory feeds two products) or 16 at H = 128 (FwdTile). Per live 64-key tile: S = Q K^T
// (while V is in flight), online softmax in base 2, O += P V with P converted in registers from the S accumulator
// layout to the A-operand layout; K of the next live tile is loaded while P V runs.
// Backward: grid (ceil(T / 64), K), 4 warps x 16 keys; loops over the query heads of the GQA group and over the
// query tiles [k_lo, max sub_end) that can see the block. Per tile: S^T = K Q^T, P^T, dP^T = V dO^T,
// dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q, then dS goes through shared memory and all warps compute
// dQ += dS K for the tile, added with fp32 atomics into a zeroed [T, N, H] buffer (dq_convert_kernel scales and
// casts it). Five matrix products per tile, like FlashAttention-2; dQ's summation order is not deterministic.
// Shared-memory rows are padded by 8 elements (16 bytes), which makes ldmatrix conflict-free.
// Legend: T tokens, N query heads, K kv heads, H head dim; g = lane / 4, t = lane % 4 (fragment layouts in _ptx.cuh).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "tree_attn_kernels.cuh"
#include "tree_attn_mma_ptx.cuh"

namespace forge::tree_attn_detail {

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaBlock = 64;  // keys per backward block (forward tiles: FwdTile)

// Queries per backward tile: 64, or 32 for H = 128 so that dK, dV, S^T and dP^T fit in registers.
template <int H>
__host__ __device__ constexpr int mma_bwd_q_tile() { return H <= 64 ? 64 : 32; }

template <typename scalar_t>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const scalar_t v[2] = {from_float<scalar_t>(lo), from_float<scalar_t>(hi)};
  uint32_t r;
  memcpy(&r, v, sizeof(r));
  return r;
}

// Rows [t0, t0 + R) of one head ([T, heads, H] in global memory) into shared [R][H + 8]; rows past T are zeros.
template <typename scalar_t, int H, int R>
__device__ __forceinline__ void cp_async_rows(scalar_t* dst, const scalar_t* src, int t0, int T, int heads, int head) {
  constexpr int kChunks = H / 8;  // 16-byte chunks per row
  for (int idx = threadIdx.x; idx < R * kChunks; idx += kMmaThreads) {
    const int r = idx / kChunks, c = idx % kChunks, t = t0 + r;
    const bool valid = t < T;
    cp_async_16(dst + r * (H + 8) + c * 8, src + (static_cast<long>(valid ? t : 0) * heads + head) * H + c * 8, valid);
  }
}

// min / max of sub_end over the keys [k_lo, k_lo + len) (len a multiple of kTile), from the per-32 block bounds.
__device__ __forceinline__ void key_bounds(const TreeAttnParams& p, int k_lo, int len, int& lo, int& hi) {
  lo = INT_MAX;
  hi = 0;
  for (int b = k_lo / kTile; b * kTile < min(k_lo + len, p.T); ++b) {
    lo = min(lo, p.kmin[b]);
    hi = max(hi, p.kmax[b]);
  }
}

// The first `BC`-key tile at or after `kb` that some query in [q_lo, q_hi) can see, or -1.
template <int BC>
__device__ __forceinline__ int next_live_tile(const TreeAttnParams& p, int kb, int q_lo, int q_hi) {
  for (; kb * BC < q_hi; ++kb) {
    int lo, hi;
    key_bounds(p, kb * BC, BC, lo, hi);
    if (hi > q_lo) return kb;
  }
  return -1;
}

// Four A-operand registers from two adjacent 16x8 fp32 accumulators (columns 0-7 and 8-15 of a 16x16 block).
template <typename scalar_t>
__device__ __forceinline__ void accum_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack2<scalar_t>(lo[0], lo[1]);
  a[1] = pack2<scalar_t>(lo[2], lo[3]);
  a[2] = pack2<scalar_t>(hi[0], hi[1]);
  a[3] = pack2<scalar_t>(hi[2], hi[3]);
}

// An accumulator or fragment array seen as MT = 1 of the m-tile-generic helpers below.
template <int N>
__device__ __forceinline__ auto& one_m(float (&x)[N][4]) { return reinterpret_cast<float (&)[1][N][4]>(x); }
__device__ __forceinline__ auto& one_m(uint32_t (&a)[4]) { return reinterpret_cast<uint32_t (&)[1][4]>(a); }

// acc[mt][0..NT) (MT m-tiles of 16 x 8*NT) += a[mt] (16x16 A fragments: columns [16 kc, 16 kc + 16)) * B, where
// B^T is rows [0, 8*NT) x the same columns of shared `b_s` (row stride ld): one k-step of the "x . y^T" product
// S = Q K^T. Each B fragment read from shared memory serves all MT m-tiles.
template <typename scalar_t, int MT, int NT>
__device__ __forceinline__ void mma_kstep_bt(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][4], const scalar_t* b_s,
                                             int ld, int kc) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < NT; j += 2) {
    uint32_t b[4];
    ldmatrix_x4(b, b_s + (j * 8 + (lane / 16) * 8 + lane % 8) * ld + kc * 16 + ((lane / 8) % 2) * 8);
    const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma_16816<scalar_t>(acc[mt][j], a[mt], b0);
      mma_16816<scalar_t>(acc[mt][j + 1], a[mt], b1);
    }
  }
}

// A fragment of rows [row0, row0 + 16) x columns [16 kc, 16 kc + 16) of shared `a_s` (row stride ld).
template <typename scalar_t>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const scalar_t* a_s, int ld, int row0, int kc) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, a_s + (row0 + ((lane / 8) % 2) * 8 + lane % 8) * ld + kc * 16 + (lane / 16) * 8);
}

// acc (16 x 8*NT) += A B^T over 16*KC columns, A read from shared memory one k-step at a time (rows
// [a_row0, a_row0 + 16) of `a_s`), B^T rows in shared memory.
template <typename scalar_t, int KC, int NT>
__device__ __forceinline__ void mma_abt_s(float (&acc)[NT][4], const scalar_t* a_s, int a_row0, const scalar_t* b_s,
                                          int ld) {
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    uint32_t a[4];
    load_a<scalar_t>(a, a_s, ld, a_row0, kc);
    mma_kstep_bt<scalar_t, 1, NT>(one_m(acc), one_m(a), b_s, ld, kc);
  }
}

// acc[mt][0..NT) (16 x 8*NT each) += A_mt (16 x 16*KC from the fp32 accumulator x[mt], 2*KC tiles) * B where B's
// rows (k) are rows [0, 16*KC) of shared `b_s` and its columns (n) are [col0, col0 + 8*NT): the "P V" product.
template <typename scalar_t, int MT, int KC, int NT>
__device__ __forceinline__ void mma_ab(float (&acc)[MT][NT][4], const float (&x)[MT][2 * KC][4], const scalar_t* b_s,
                                       int ld, int col0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) accum_to_a<scalar_t>(a[mt], x[mt][2 * kc], x[mt][2 * kc + 1]);
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, b_s + (kc * 16 + ((lane / 8) % 2) * 8 + lane % 8) * ld + col0 + (j + lane / 16) * 8);
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<scalar_t>(acc[mt][j], a[mt], b0);
        mma_16816<scalar_t>(acc[mt][j + 1], a[mt], b1);
      }
    }
  }
}

// Forward tile shape per head dim. H <= 64: MT = 2 m-tiles of 16 rows per warp, 128 queries per block, as
// FlashAttention-2 does (each K/V fragment read from shared memory feeds two products), 64 keys per tile.
// H = 128: MT = 1 (64 queries per block): with MT = 2 and 32-key tiles (FlashAttention-2's A100/H100 choice) this
// code needs 255 registers and spills 120 bytes at sm_90, against 182 registers and no spill for MT = 1; which is
// faster is for the GPU benchmark to say (benchmarks/gpu_check.sh), both are correct (tested in emulation).
// Q stays in registers while its fragments take at most 32 of them, else it is read from shared memory per k-step.
template <int H>
struct FwdTile {
  static constexpr int MT = H >= 128 ? 1 : 2;
  static constexpr int BC = 64;
  static constexpr int BQ = kMmaWarps * 16 * MT;
  static constexpr bool kQInRegs = MT * (H / 16) * 4 <= 32;
};

template <typename scalar_t, int H>
constexpr size_t fwd_mma_smem_bytes() {
  return sizeof(scalar_t) * (FwdTile<H>::BQ + 2 * FwdTile<H>::BC) * (H + 8) + sizeof(int) * FwdTile<H>::BC;
}

template <typename scalar_t, int H>
constexpr size_t bwd_mma_smem_bytes() {
  constexpr int BQ = mma_bwd_q_tile<H>();
  return sizeof(scalar_t) * ((2 * kMmaBlock + 2 * BQ) * (H + 8) + kMmaBlock * (BQ + 8)) + sizeof(float) * 2 * BQ +
         sizeof(int) * (kMmaBlock + kMmaWarps);
}

// grid (ceil(T / BQ), N). Shared: q [BQ][H + 8], k, v [BC][H + 8] (scalar_t), sub_end [BC].
template <typename scalar_t, int H>
__global__ void __launch_bounds__(kMmaThreads) fwd_mma_kernel(TreeAttnParams p) {
  using Tile = FwdTile<H>;
  constexpr int MT = Tile::MT, BC = Tile::BC, BQ = Tile::BQ;
  constexpr int LD = H + 8, KC = H / 16, NT = BC / 8, HT = H / 8;
  constexpr int QR = Tile::kQInRegs ? MT : 1, QK = Tile::kQInRegs ? KC : 1;  // Q fragments kept in registers
  extern __shared__ float smem[];
  auto* q_s = reinterpret_cast<scalar_t*>(smem);
  scalar_t* k_s = q_s + BQ * LD;
  scalar_t* v_s = k_s + BC * LD;
  int* se_s = reinterpret_cast<int*>(v_s + BC * LD);

  const int n = blockIdx.y, kv = n / (p.N / p.K);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int q_lo = blockIdx.x * BQ, q_hi = min(q_lo + BQ, p.T);
  const int w_row0 = warp * 16 * MT;                               // this warp's first row in the block
  const int w_lo = q_lo + w_row0, w_hi = w_lo + 16 * MT;           // its query rows (w_hi may pass T)
  const float qk_scale = p.scale * kLog2e;
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);

  int kb = next_live_tile<BC>(p, 0, q_lo, q_hi);
  cp_async_rows<scalar_t, H, BQ>(q_s, q, q_lo, p.T, p.N, n);
  if (kb >= 0) {
    cp_async_rows<scalar_t, H, BC>(k_s, k, kb * BC, p.T, p.K, kv);
    if (threadIdx.x < BC) se_s[threadIdx.x] = kb * BC + threadIdx.x < p.T ? p.sub_end[kb * BC + threadIdx.x] : 0;
  }
  cp_async_commit();

  uint32_t qf[QR][QK][4];
  float o[MT][HT][4], m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
    for (int j = 0; j < HT; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
  }
  bool q_loaded = !Tile::kQInRegs;

  while (kb >= 0) {
    const int k_lo = kb * BC;
    int kmin, kmax;
    key_bounds(p, k_lo, BC, kmin, kmax);
    cp_async_rows<scalar_t, H, BC>(v_s, v, k_lo, p.T, p.K, kv);
    cp_async_commit();
    cp_async_wait<1>();  // Q, K and sub_end of this tile have landed (V may still be in flight)
    __syncthreads();
    if (!q_loaded) {
#pragma unroll
      for (int mt = 0; mt < QR; ++mt)
#pragma unroll
        for (int kc = 0; kc < QK; ++kc) load_a<scalar_t>(qf[mt][kc], q_s, LD, w_row0 + 16 * mt, kc);
      q_loaded = true;
    }
    const bool live = k_lo < w_hi && kmax > w_lo;                  // some row may see some key
    const bool full = k_lo + BC - 1 <= w_lo && kmin >= w_hi;       // every row sees every key
    float s[MT][NT][4];
    if (live) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (Tile::kQInRegs) {
#pragma unroll
            for (int r = 0; r < 4; ++r) a[mt][r] = qf[mt][kc][r];
          } else {
            load_a<scalar_t>(a[mt], q_s, LD, w_row0 + 16 * mt, kc);
          }
        }
        mma_kstep_bt<scalar_t, MT, NT>(s, a, k_s, LD, kc);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = j * 8 + 2 * t4 + (e & 1), i = w_lo + 16 * mt + g + 8 * (e / 2);
            float x = s[mt][j][e] * qk_scale;
            if (!full && !visible(i, k_lo + key, se_s[key])) x = -INFINITY;
            s[mt][j][e] = x;
            mx[e / 2] = fmaxf(mx[e / 2], x);
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 2));
          const float m_new = fmaxf(m[mt][r], mx[r]);
          const float base = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet keeps p = 0
          const float alpha = exp2f(m[mt][r] - base);
          m[mt][r] = m_new;
          l[mt][r] *= alpha;  // per-lane partial row sums; the 4 lanes of a row are added at the end
#pragma unroll
          for (int j = 0; j < HT; ++j) {
            o[mt][j][2 * r] *= alpha;
            o[mt][j][2 * r + 1] *= alpha;
          }
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            s[mt][j][2 * r] = exp2f(s[mt][j][2 * r] - base);
            s[mt][j][2 * r + 1] = exp2f(s[mt][j][2 * r + 1] - base);
            l[mt][r] += s[mt][j][2 * r] + s[mt][j][2 * r + 1];
          }
        }
      }
    }
    __syncthreads();  // every warp is done with k_s and se_s
    const int next = next_live_tile<BC>(p, kb + 1, q_lo, q_hi);
    if (next >= 0) {
      cp_async_rows<scalar_t, H, BC>(k_s, k, next * BC, p.T, p.K, kv);
      if (threadIdx.x < BC) se_s[threadIdx.x] = next * BC + threadIdx.x < p.T ? p.sub_end[next * BC + threadIdx.x] : 0;
    }
    cp_async_commit();
    cp_async_wait<1>();  // V of this tile has landed
    __syncthreads();
    if (live) mma_ab<scalar_t, MT, NT / 2, HT>(o, s, v_s, LD, 0);
    __syncthreads();  // every warp is done with v_s
    kb = next;
  }
  cp_async_wait<0>();

  auto* out = static_cast<scalar_t*>(p.o);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[mt][r] += __shfl_xor_sync(kFullMask, l[mt][r], 1);
      l[mt][r] += __shfl_xor_sync(kFullMask, l[mt][r], 2);
      const int i = w_lo + 16 * mt + g + 8 * r;
      if (i >= p.T) continue;
      const float inv = l[mt][r] > 0.f ? 1.f / l[mt][r] : 0.f;
#pragma unroll
      for (int j = 0; j < HT; ++j) {
        const uint32_t packed = pack2<scalar_t>(o[mt][j][2 * r] * inv, o[mt][j][2 * r + 1] * inv);
        memcpy(out + (static_cast<long>(i) * p.N + n) * H + j * 8 + 2 * t4, &packed, sizeof(packed));
      }
      if (t4 == 0)
        p.lse[static_cast<long>(n) * p.T + i] = l[mt][r] > 0.f ? (m[mt][r] + log2f(l[mt][r])) * kLn2 : -INFINITY;
    }
  }
}

// grid (ceil(T / 64), K). Shared: k, v [64][H + 8], q, dO [BQ][H + 8], dS^T [64][BQ + 8] (scalar_t),
// lse * log2(e), delta [BQ] (fp32), sub_end [64], live [4] (warp w's 16 keys see some query of the tile).
// dq_accum must be zero on entry. The dQ product skips the 16-key k-steps of warps that saw nothing (their dS rows
// are not even written) and the whole product, atomics included, when no warp did.
template <typename scalar_t, int H>
__global__ void __launch_bounds__(kMmaThreads) bwd_mma_kernel(TreeAttnParams p) {
  constexpr int BQ = mma_bwd_q_tile<H>(), LD = H + 8, LDS = BQ + 8, KC = H / 16, QT = BQ / 8, HT = H / 8;
  constexpr int WQ = BQ / 16, WH = kMmaWarps / WQ, HW = H / WH;  // dQ: warps along queries x along head dim
  static_assert(kMmaBlock == 16 * kMmaWarps, "dQ's k-step kc covers the keys of warp kc");
  extern __shared__ float smem[];
  auto* k_s = reinterpret_cast<scalar_t*>(smem);
  scalar_t* v_s = k_s + kMmaBlock * LD;
  scalar_t* q_s = v_s + kMmaBlock * LD;
  scalar_t* do_s = q_s + BQ * LD;
  scalar_t* ds_s = do_s + BQ * LD;
  auto* lse_s = reinterpret_cast<float*>(ds_s + kMmaBlock * LDS);
  float* delta_s = lse_s + BQ;
  int* se_s = reinterpret_cast<int*>(delta_s + BQ);
  int* live_s = se_s + kMmaBlock;

  const int kvh = blockIdx.y, group = p.N / p.K;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int k_lo = blockIdx.x * kMmaBlock, wk_lo = k_lo + warp * 16;  // this warp's keys [wk_lo, wk_lo + 16)
  int kmin, q_end;
  key_bounds(p, k_lo, kMmaBlock, kmin, q_end);  // queries that see the block lie in [k_lo, q_end)
  const int wkmin = wk_lo < p.T ? p.kmin[wk_lo / kTile] : 0, wkmax = wk_lo < p.T ? p.kmax[wk_lo / kTile] : 0;
  const float qk_scale = p.scale * kLog2e;
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* d_o = static_cast<const scalar_t*>(p.d_o);

  cp_async_rows<scalar_t, H, kMmaBlock>(k_s, static_cast<const scalar_t*>(p.k), k_lo, p.T, p.K, kvh);
  cp_async_rows<scalar_t, H, kMmaBlock>(v_s, static_cast<const scalar_t*>(p.v), k_lo, p.T, p.K, kvh);
  if (threadIdx.x < kMmaBlock) se_s[threadIdx.x] = k_lo + threadIdx.x < p.T ? p.sub_end[k_lo + threadIdx.x] : 0;
  cp_async_commit();

  float dk[HT][4], dv[HT][4];
#pragma unroll
  for (int j = 0; j < HT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;

  for (int gi = 0; gi < group; ++gi) {
    const int n = kvh * group + gi;
    for (int q_lo = k_lo; q_lo < q_end; q_lo += BQ) {
      __syncthreads();  // the previous tile's q, dO, dS^T, lse and delta are consumed
      cp_async_rows<scalar_t, H, BQ>(q_s, q, q_lo, p.T, p.N, n);
      cp_async_rows<scalar_t, H, BQ>(do_s, d_o, q_lo, p.T, p.N, n);
      cp_async_commit();
      if (threadIdx.x < BQ) {
        const int i = q_lo + threadIdx.x;
        lse_s[threadIdx.x] = i < p.T ? p.lse[static_cast<long>(n) * p.T + i] * kLog2e : 0.f;
        delta_s[threadIdx.x] = i < p.T ? p.delta[static_cast<long>(n) * p.T + i] : 0.f;
      }
      cp_async_wait<0>();
      __syncthreads();
      const bool live = wk_lo <= q_lo + BQ - 1 && wk_lo < p.T && wkmax > q_lo;
      const bool full = wk_lo + 15 <= q_lo && wkmin >= q_lo + BQ;
      if (live) {
        float st[QT][4], dpt[QT][4];
#pragma unroll
        for (int j = 0; j < QT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
        mma_abt_s<scalar_t, KC, QT>(st, k_s, warp * 16, q_s, LD);    // S^T = K Q^T
        mma_abt_s<scalar_t, KC, QT>(dpt, v_s, warp * 16, do_s, LD);  // dP^T = V dO^T
#pragma unroll
        for (int j = 0; j < QT; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = warp * 16 + g + 8 * (e / 2), qq = j * 8 + 2 * t4 + (e & 1);
            const bool vis = full || visible(q_lo + qq, k_lo + key, se_s[key]);
            const float pt = vis ? exp2f(st[j][e] * qk_scale - lse_s[qq]) : 0.f;
            st[j][e] = pt;                              // P^T
            dpt[j][e] = pt * (dpt[j][e] - delta_s[qq]);  // dS^T
          }
        }
        mma_ab<scalar_t, 1, QT / 2, HT>(one_m(dv), one_m(st), do_s, LD, 0);   // dV += P^T dO
        mma_ab<scalar_t, 1, QT / 2, HT>(one_m(dk), one_m(dpt), q_s, LD, 0);   // dK += dS^T Q
#pragma unroll
        for (int j = 0; j < QT; ++j) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const uint32_t packed = pack2<scalar_t>(dpt[j][2 * r], dpt[j][2 * r + 1]);
            memcpy(ds_s + (warp * 16 + g + 8 * r) * LDS + j * 8 + 2 * t4, &packed, sizeof(packed));
          }
        }
      }
      if (lane == 0) live_s[warp] = live;
      __syncthreads();  // dS^T of the live warps' keys and their flags are in shared memory
      if (!(live_s[0] | live_s[1] | live_s[2] | live_s[3])) continue;  // block-uniform: no query sees the block
      // dQ[q_lo + wq*16 .. +16, wh*HW .. +HW) += dS (16 x 64 keys) K (64 x HW), over the live 16-key groups
      const int wq = warp % WQ, wh = warp / WQ;
      float dq[HW / 8][4];
#pragma unroll
      for (int j = 0; j < HW / 8; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < kMmaBlock / 16; ++kc) {  // k-step kc = the 16 keys of warp kc
        if (!live_s[kc]) continue;
        uint32_t a[4];  // dS rows = queries, columns = keys, read transposed from dS^T [key][query]
        ldmatrix_x4_trans(a, ds_s + (kc * 16 + (lane / 16) * 8 + lane % 8) * LDS + wq * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int j = 0; j < HW / 8; j += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, k_s + (kc * 16 + ((lane / 8) % 2) * 8 + lane % 8) * LD + wh * HW + (j + lane / 16) * 8);
          const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_16816<scalar_t>(dq[j], a, b0);
          mma_16816<scalar_t>(dq[j + 1], a, b1);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = q_lo + wq * 16 + g + 8 * r;
        if (i >= p.T) continue;
        float* dst = p.dq_accum + (static_cast<long>(i) * p.N + n) * H + wh * HW + 2 * t4;
#pragma unroll
        for (int j = 0; j < HW / 8; ++j) {
          atomic_add_f32(dst + j * 8, dq[j][2 * r]);
          atomic_add_f32(dst + j * 8 + 1, dq[j][2 * r + 1]);
        }
      }
    }
  }

  auto* dk_out = static_cast<scalar_t*>(p.dk);
  auto* dv_out = static_cast<scalar_t*>(p.dv);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j_tok = wk_lo + g + 8 * r;
    if (j_tok >= p.T) continue;
#pragma unroll
    for (int j = 0; j < HT; ++j) {
      const long off = (static_cast<long>(j_tok) * p.K + kvh) * H + j * 8 + 2 * t4;
      const uint32_t pk = pack2<scalar_t>(dk[j][2 * r] * p.scale, dk[j][2 * r + 1] * p.scale);
      const uint32_t pv = pack2<scalar_t>(dv[j][2 * r], dv[j][2 * r + 1]);
      memcpy(dk_out + off, &pk, sizeof(pk));
      memcpy(dv_out + off, &pv, sizeof(pv));
    }
  }
}

// dq = scale * dq_accum, cast to scalar_t. Grid-stride over `count` elements.
template <typename scalar_t>
__global__ void dq_convert_kernel(const float* acc, scalar_t* dq, long count, float scale) {
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<long>(gridDim.x) * blockDim.x)
    dq[i] = from_float<scalar_t>(acc[i] * scale);
}

}  // namespace forge::tree_attn_detail
