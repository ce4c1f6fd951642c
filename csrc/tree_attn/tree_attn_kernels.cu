// Launchers of the tree attention kernels: SIMT (tree_attn_kernels.cuh) and tensor-core (tree_attn_mma.cuh);
// implementation choice, dtype / head-dim dispatch, shared-memory sizing.
// Raw pointers only (tree_attn.h), so nvcc compiles this file without torch headers.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "tree_attn_kernels.cuh"
#include "tree_attn_mma.cuh"

namespace forge {
namespace {

using namespace tree_attn_detail;

int num_tiles(int T) { return (T + kTile - 1) / kTile; }

template <typename Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, size_t smem_bytes, cudaStream_t stream, const TreeAttnParams& p,
                   int threads = kThreads) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
  if (err != cudaSuccess) return err;
  kernel<<<grid, threads, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

bool aligned16(const void* ptr) { return ptr == nullptr || reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

// True when this build holds sm_80+ machine code for the tensor-core kernels (an sm_7x build, or PTX JIT-compiled
// from a compute_7x target, compiles their primitives out).
bool mma_built_for_sm80() {
  static const bool built = [] {
    cudaFuncAttributes attr{};
    return cudaFuncGetAttributes(&attr, fwd_mma_kernel<__half, 64>) == cudaSuccess && attr.binaryVersion >= 80 &&
           attr.ptxVersion >= 80;
  }();
  return built;
}

template <typename scalar_t, int H>
cudaError_t fwd_typed(const TreeAttnParams& p, cudaStream_t stream) {
  return launch(fwd_kernel<scalar_t, H>, dim3(num_tiles(p.Tq), p.N), fwd_smem_bytes<H>(), stream, p);
}

template <typename scalar_t, int H>
cudaError_t bwd_typed(const TreeAttnParams& p, cudaStream_t stream) {
  cudaError_t err = launch(bwd_dq_kernel<scalar_t, H>, dim3(num_tiles(p.Tq), p.N), dq_smem_bytes<H>(), stream, p);
  if (err != cudaSuccess) return err;
  return launch(bwd_dkdv_kernel<scalar_t, H>, dim3(num_tiles(p.T), p.K), dkdv_smem_bytes<H>(), stream, p);
}

template <typename scalar_t, int H>
cudaError_t fwd_mma_typed(const TreeAttnParams& p, cudaStream_t stream) {
  constexpr int BQ = FwdTile<H>::BQ;
  return launch(fwd_mma_kernel<scalar_t, H>, dim3((p.T + BQ - 1) / BQ, p.N), fwd_mma_smem_bytes<scalar_t, H>(), stream,
                p, kMmaThreads);
}

template <typename scalar_t, int H>
cudaError_t bwd_mma_typed(const TreeAttnParams& p, cudaStream_t stream) {
  if (p.dq_accum == nullptr) return cudaErrorInvalidValue;
  cudaError_t err = launch(bwd_mma_kernel<scalar_t, H>, dim3((p.T + kMmaBlock - 1) / kMmaBlock, p.K),
                           bwd_mma_smem_bytes<scalar_t, H>(), stream, p, kMmaThreads);
  if (err != cudaSuccess) return err;
  const long count = static_cast<long>(p.T) * p.N * H;
  const int blocks = static_cast<int>(std::min<long>((count + 255) / 256, 65535));
  dq_convert_kernel<scalar_t><<<blocks, 256, 0, stream>>>(p.dq_accum, static_cast<scalar_t*>(p.dq), count, p.scale);
  return cudaGetLastError();
}

template <typename scalar_t, int H>
cudaError_t run_typed(const TreeAttnParams& p, bool backward, bool mma, cudaStream_t stream) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return backward ? bwd_typed<scalar_t, H>(p, stream) : fwd_typed<scalar_t, H>(p, stream);
  } else {
    if (mma) return backward ? bwd_mma_typed<scalar_t, H>(p, stream) : fwd_mma_typed<scalar_t, H>(p, stream);
    return backward ? bwd_typed<scalar_t, H>(p, stream) : fwd_typed<scalar_t, H>(p, stream);
  }
}

template <typename scalar_t>
cudaError_t run_head_dim(const TreeAttnParams& p, bool backward, bool mma, cudaStream_t stream) {
  switch (p.H) {
    case 32: return run_typed<scalar_t, 32>(p, backward, mma, stream);
    case 64: return run_typed<scalar_t, 64>(p, backward, mma, stream);
    case 128: return run_typed<scalar_t, 128>(p, backward, mma, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t run(const TreeAttnParams& p, TreeAttnDType dtype, bool backward, cudaStream_t stream) {
  if (p.Tq == 0) return cudaSuccess;
  if (p.Tq < 0 || p.Tq > p.T) return cudaErrorInvalidValue;
  if (p.impl == TreeAttnImpl::kMma && tree_attn_mma_unsupported(p, dtype) != nullptr) return cudaErrorInvalidValue;
  const bool mma = tree_attn_uses_mma(p, dtype);
  switch (dtype) {
    case TreeAttnDType::kFloat32: return run_head_dim<float>(p, backward, false, stream);
    case TreeAttnDType::kFloat16: return run_head_dim<__half>(p, backward, mma, stream);
    case TreeAttnDType::kBFloat16: return run_head_dim<__nv_bfloat16>(p, backward, mma, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

const char* tree_attn_mma_unsupported(const TreeAttnParams& p, TreeAttnDType dtype) {
  if (dtype == TreeAttnDType::kFloat32) return "the tensor-core kernels take float16 or bfloat16 inputs, not float32";
  if (!tree_attn_head_dim_supported(p.H)) return "head_dim is not 32, 64 or 128";
  if (p.Tq != p.T) return "suffix queries (fewer queries than keys) run on the SIMT kernels";
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.d_o))
    return "q, k, v and dO must start at 16-byte aligned addresses";
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major < 8)
    return "the GPU is older than sm_80 (Ampere)";
  if (!mma_built_for_sm80()) return "the extension was not built for sm_80 or newer (set FORGE_CUDA_ARCH_LIST)";
  return nullptr;
}

bool tree_attn_uses_mma(const TreeAttnParams& p, TreeAttnDType dtype) {
  return p.impl != TreeAttnImpl::kSimt && tree_attn_mma_unsupported(p, dtype) == nullptr;
}

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
