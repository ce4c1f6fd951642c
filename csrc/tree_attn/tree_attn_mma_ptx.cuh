// Warp-level tensor-core and async-copy primitives used by the tensor-core tree attention kernels
// (tree_attn_mma.cuh), as inline PTX for sm_80+ (sm_90 included). The CPU emulation test
// (tests/kernels/cuda_emu.cpp) defines FORGE_TREE_ATTN_EMU and supplies its own versions of exactly these functions
// with the semantics documented here (PTX ISA: "Matrix fragments for mma.m16n8k16", "ldmatrix", "cp.async").
//
// Fragments (g = lane / 4, t = lane % 4; each 32-bit register packs two 16-bit values, low half first):
//   A 16x16 (row-major, M x K): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   B 16x8  (K x N):            b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   C 16x8  (fp32, M x N):      c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
// ldmatrix x4: lanes 8i..8i+7 give the row addresses (16 bytes each) of 8x8 matrix i; register i of lane L receives
// row L/4, columns 2(L%4)..+1 of matrix i, or with .trans rows 2(L%4)..+1 of column L/4.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace forge::tree_attn_detail {

template <typename scalar_t>
struct MmaType;  // which mma instruction multiplies two scalar_t fragments
template <>
struct MmaType<__half> {
  static constexpr bool kBF16 = false;
};
template <>
struct MmaType<__nv_bfloat16> {
  static constexpr bool kBF16 = true;
};

#ifndef FORGE_TREE_ATTN_EMU

// d += a * b with a 16x16, b 16x8 (scalar_t), d 16x8 (fp32).
template <typename scalar_t>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (MmaType<scalar_t>::kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

// Asynchronous 16-byte global -> shared copy; `valid` false writes 16 zero bytes (the source is not read).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem_src), "r"(valid ? 16 : 0));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most `kPending` committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

__device__ __forceinline__ void atomic_add_f32(float* addr, float v) { atomicAdd(addr, v); }

#endif  // FORGE_TREE_ATTN_EMU

}  // namespace forge::tree_attn_detail
