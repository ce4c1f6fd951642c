// Tree attention CUDA kernels: launcher interface shared by tree_attn_kernels.cu and tree_attn_binding.cpp.
//
// Raw pointers only (no torch headers), so the .cu file compiles standalone with nvcc.
// Layout (contiguous): q, o, dq, dO [Tq, N, H]; k, v, dk, dv [T, K, H]; sub_end [T] int32; lse, delta [N, Tq] fp32.
// The Tq queries are tree tokens [T - Tq, T) (Tq = T: every token; Tq < T: suffix queries, SIMT kernels only).
// Key j is visible to query i  <=>  j <= i < sub_end[j]. lse is the natural-log row log-sum-exp of scale * q.k.
#pragma once

#include <cuda_runtime.h>

namespace forge {

enum class TreeAttnDType { kFloat32, kFloat16, kBFloat16 };

// kAuto: tensor cores (tree_attn_mma.cuh) where tree_attn_mma_unsupported() is null, else SIMT
// (tree_attn_kernels.cuh). kSimt / kMma force one; kMma where unsupported is an error.
enum class TreeAttnImpl { kAuto, kSimt, kMma };

// Tokens per tile, both for query blocks and key blocks; block bounds are per kTreeAttnTile keys.
constexpr int kTreeAttnTile = 32;

struct TreeAttnParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* d_o = nullptr;     // backward only
  void* o = nullptr;             // forward output
  void* dq = nullptr;            // backward outputs
  void* dk = nullptr;
  void* dv = nullptr;
  const int* sub_end = nullptr;
  const int* kmin = nullptr;     // per key block min(sub_end), from tree_attn_block_bounds
  const int* kmax = nullptr;     // per key block max(sub_end)
  float* lse = nullptr;          // written by the forward, read by the backward
  const float* delta = nullptr;  // rowsum(dO * O), backward only
  float* dq_accum = nullptr;     // tensor-core backward only: fp32 [T, N, H], zero on entry
  int T = 0, N = 0, K = 0, H = 0;
  int Tq = 0;                    // queries: tree tokens [T - Tq, T); rows of q, o, dq, dO, lse, delta
  float scale = 1.f;
  TreeAttnImpl impl = TreeAttnImpl::kAuto;
};

// True for the head dims the kernels are instantiated for.
bool tree_attn_head_dim_supported(int H);

// Why the tensor-core kernels cannot run these parameters (dtype, head dim, 16-byte alignment, GPU or build below
// sm_80), or nullptr when they can. Pointers checked: q, k, v, and d_o when set.
const char* tree_attn_mma_unsupported(const TreeAttnParams& p, TreeAttnDType dtype);
// Whether tree_attn_fwd / tree_attn_bwd will run the tensor-core kernels (the backward then needs dq_accum).
bool tree_attn_uses_mma(const TreeAttnParams& p, TreeAttnDType dtype);

cudaError_t tree_attn_block_bounds(const int* sub_end, int* kmin, int* kmax, int T, cudaStream_t stream);
cudaError_t tree_attn_fwd(const TreeAttnParams& p, TreeAttnDType dtype, cudaStream_t stream);
cudaError_t tree_attn_bwd(const TreeAttnParams& p, TreeAttnDType dtype, cudaStream_t stream);

}  // namespace forge
