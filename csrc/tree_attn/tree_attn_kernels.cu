// Launchers of the tree attention kernels (tree_attn_kernels.cuh): dtype / head-dim dispatch, shared-memory sizing.
// Raw pointers only (tree_attn.h), so nvcc compiles this file without torch headers.

#include "tree_attn_kernels.cuh"

namespace forge {
namespace {

using namespace tree_attn_detail;

int num_tiles(int T) { return (T + kTile - 1) / kTile; }

template <typename Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, size_t smem_bytes, cudaStream_t stream, const TreeAttnParams& p) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
  if (err != cudaSuccess) return err;
  kernel<<<grid, kThreads, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename scalar_t, int H>
cudaError_t fwd_typed(const TreeAttnParams& p, cudaStream_t stream) {
  return launch(fwd_kernel<scalar_t, H>, dim3(num_tiles(p.T), p.N), fwd_smem_bytes<H>(), stream, p);
}

template <typename scalar_t, int H>
cudaError_t bwd_typed(const TreeAttnParams& p, cudaStream_t stream) {
  cudaError_t err = launch(bwd_dq_kernel<scalar_t, H>, dim3(num_tiles(p.T), p.N), dq_smem_bytes<H>(), stream, p);
  if (err != cudaSuccess) return err;
  return launch(bwd_dkdv_kernel<scalar_t, H>, dim3(num_tiles(p.T), p.K), dkdv_smem_bytes<H>(), stream, p);
}

template <typename scalar_t, int H>
cudaError_t run_typed(const TreeAttnParams& p, bool backward, cudaStream_t stream) {
  return backward ? bwd_typed<scalar_t, H>(p, stream) : fwd_typed<scalar_t, H>(p, stream);
}

template <typename scalar_t>
cudaError_t run_head_dim(const TreeAttnParams& p, bool backward, cudaStream_t stream) {
  switch (p.H) {
    case 32: return run_typed<scalar_t, 32>(p, backward, stream);
    case 64: return run_typed<scalar_t, 64>(p, backward, stream);
    case 128: return run_typed<scalar_t, 128>(p, backward, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t run(const TreeAttnParams& p, TreeAttnDType dtype, bool backward, cudaStream_t stream) {
  if (p.T == 0) return cudaSuccess;
  switch (dtype) {
    case TreeAttnDType::kFloat32: return run_head_dim<float>(p, backward, stream);
    case TreeAttnDType::kFloat16: return run_head_dim<__half>(p, backward, stream);
    case TreeAttnDType::kBFloat16: return run_head_dim<__nv_bfloat16>(p, backward, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool tree_attn_head_dim_supported(int H) { return H == 32 || H == 64 || H == 128; }

cudaError_t tree_attn_block_bounds(const int* sub_end, int* kmin, int* kmax, int T, cudaStream_t stream) {
  const int blocks = num_tiles(T);
  if (blocks == 0) return cudaSuccess;
  block_bounds_kernel<<<(blocks + 127) / 128, 128, 0, stream>>>(sub_end, kmin, kmax, T);
  return cudaGetLastError();
}

cudaError_t tree_attn_fwd(const TreeAttnParams& p, TreeAttnDType dtype, cudaStream_t stream) {
  return run(p, dtype, /*backward=*/false, stream);
}

cudaError_t tree_attn_bwd(const TreeAttnParams& p, TreeAttnDType dtype, cudaStream_t stream) {
  return run(p, dtype, /*backward=*/true, stream);
}

}  // namespace forge
