// Python binding of the CUDA tree attention kernels (forge_megatron._C_tree_attn).
//
// The one place that checks inputs: device, dtype, contiguity, shapes, supported head dim, GQA divisibility.
// Every failed check raises with a message naming the offending argument. Kernels take raw pointers (tree_attn.h).
//   fwd(q [Tq,N,H], k [T,K,H], v [T,K,H], sub_end int32 [T], scale, stream, impl) -> [o [Tq,N,H], lse fp32 [N,Tq]]
//   bwd(dO, q, k, v, o, lse, sub_end, scale, stream, impl) -> [dq, dk, dv]
// Tq <= T: the queries are tree tokens [T - Tq, T) (suffix queries, SIMT kernels only; Tq = T: every token).
//   mma_unsupported(q, k, v) -> "" when the tensor-core kernels can run these inputs, else the reason
// impl: "auto" (tensor cores for fp16/bf16 on sm_80+, else SIMT), "simt", or "mma" (an error where unsupported).
// `stream` is the caller's torch.cuda.current_stream().cuda_stream, and the caller makes q's device current: this
// keeps the file free of c10/cuda headers, which the CPU torch wheel ships incomplete, so it compiles on every CI
// machine (tests/kernels/test_cuda_compile.py).
// Legend: T tokens, N query heads, K key/value heads, H head dim.

#include <torch/extension.h>

#include <string>
#include <vector>

#include "tree_attn.h"

namespace {

using forge::TreeAttnDType;
using forge::TreeAttnParams;

void check_cuda_contiguous(const at::Tensor& x, const char* name, const at::Tensor& like) {
  TORCH_CHECK(x.is_cuda(), "tree_attn: ", name, " must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.device() == like.device(), "tree_attn: ", name, " is on ", x.device(), " but q is on ", like.device());
  TORCH_CHECK(x.is_contiguous(), "tree_attn: ", name, " must be contiguous");
}

TreeAttnDType kernel_dtype(const at::Tensor& q) {
  switch (q.scalar_type()) {
    case at::kFloat: return TreeAttnDType::kFloat32;
    case at::kHalf: return TreeAttnDType::kFloat16;
    case at::kBFloat16: return TreeAttnDType::kBFloat16;
    default: TORCH_CHECK(false, "tree_attn: q has dtype ", q.scalar_type(), "; supported: float32, float16, bfloat16");
  }
}

// Checks q/k/v/sub_end and fills the shape fields of the kernel parameters.
TreeAttnParams check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& sub_end,
                         double scale) {
  for (auto [x, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    check_cuda_contiguous(*x, name, q);
    TORCH_CHECK(x->dim() == 3, "tree_attn: ", name, " must be 3-D [T, heads, head_dim], got ", x->sizes());
    TORCH_CHECK(x->scalar_type() == q.scalar_type(), "tree_attn: ", name, " has dtype ", x->scalar_type(),
                " but q has ", q.scalar_type());
  }
  kernel_dtype(q);
  const int64_t Tq = q.size(0), N = q.size(1), H = q.size(2), K = k.size(1), T = k.size(0);
  TORCH_CHECK(k.sizes() == v.sizes(), "tree_attn: k and v shapes differ: ", k.sizes(), " vs ", v.sizes());
  TORCH_CHECK(T >= Tq && k.size(2) == H, "tree_attn: k/v shape ", k.sizes(), " does not match q shape ", q.sizes(),
              ": k/v need q's head_dim and at least as many tokens");
  TORCH_CHECK(K > 0 && N % K == 0, "tree_attn: query heads (", N, ") must be a multiple of key/value heads (", K, ")");
  TORCH_CHECK(forge::tree_attn_head_dim_supported(static_cast<int>(H)), "tree_attn: head_dim ", H,
              " is not supported by the CUDA kernel (supported: 32, 64, 128)");
  TORCH_CHECK(T < (int64_t{1} << 31) / std::max<int64_t>(N, 1), "tree_attn: T * N too large for int32 indexing");
  check_cuda_contiguous(sub_end, "sub_end", q);
  TORCH_CHECK(sub_end.scalar_type() == at::kInt, "tree_attn: sub_end must be int32, got ", sub_end.scalar_type());
  TORCH_CHECK(sub_end.dim() == 1 && sub_end.size(0) == T, "tree_attn: sub_end must have shape [", T, "], got ",
              sub_end.sizes());
  TORCH_CHECK(scale > 0, "tree_attn: softmax scale must be positive, got ", scale);
  TreeAttnParams p;
  p.T = static_cast<int>(T);
  p.Tq = static_cast<int>(Tq);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.H = static_cast<int>(H);
  p.scale = static_cast<float>(scale);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.sub_end = sub_end.data_ptr<int>();
  return p;
}

forge::TreeAttnImpl parse_impl(const std::string& impl) {
  if (impl == "auto") return forge::TreeAttnImpl::kAuto;
  if (impl == "simt") return forge::TreeAttnImpl::kSimt;
  if (impl == "mma") return forge::TreeAttnImpl::kMma;
  TORCH_CHECK(false, "tree_attn: impl must be \"auto\", \"simt\" or \"mma\", got \"", impl, "\"");
}

void set_impl(TreeAttnParams& p, const at::Tensor& q, const std::string& impl) {
  p.impl = parse_impl(impl);
  if (p.impl == forge::TreeAttnImpl::kMma) {
    const char* why = forge::tree_attn_mma_unsupported(p, kernel_dtype(q));
    TORCH_CHECK(why == nullptr, "tree_attn: impl=\"mma\" (tensor cores) cannot run here: ", why ? why : "");
  }
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "tree_attn: ", what, " launch failed: ", cudaGetErrorString(err));
}

// Per key block min/max of sub_end; the tensors must outlive the kernels that read them (same stream).
std::pair<at::Tensor, at::Tensor> block_bounds(const at::Tensor& sub_end, TreeAttnParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.T + forge::kTreeAttnTile - 1) / forge::kTreeAttnTile;
  auto kmin = at::empty({blocks}, sub_end.options());
  auto kmax = at::empty({blocks}, sub_end.options());
  check_launch(forge::tree_attn_block_bounds(p.sub_end, kmin.data_ptr<int>(), kmax.data_ptr<int>(), p.T, stream),
               "block bounds");
  p.kmin = kmin.data_ptr<int>();
  p.kmax = kmax.data_ptr<int>();
  return {kmin, kmax};
}

std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& sub_end,
                            double scale, int64_t stream_handle, const std::string& impl) {
  TreeAttnParams p = check_qkv(q, k, v, sub_end, scale);
  set_impl(p, q, impl);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  auto o = at::empty_like(q);
  auto lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  auto bounds = block_bounds(sub_end, p, stream);
  p.o = o.data_ptr();
  p.lse = lse.data_ptr<float>();
  check_launch(forge::tree_attn_fwd(p, kernel_dtype(q), stream), "forward");
  return {o, lse};
}

std::vector<at::Tensor> bwd(const at::Tensor& d_o, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& o, const at::Tensor& lse, const at::Tensor& sub_end, double scale,
                            int64_t stream_handle, const std::string& impl) {
  TreeAttnParams p = check_qkv(q, k, v, sub_end, scale);
  for (auto [x, name] : {std::pair{&d_o, "dO"}, {&o, "o"}}) {
    check_cuda_contiguous(*x, name, q);
    TORCH_CHECK(x->sizes() == q.sizes() && x->scalar_type() == q.scalar_type(), "tree_attn: ", name,
                " must match q in shape and dtype, got ", x->sizes(), " ", x->scalar_type());
  }
  check_cuda_contiguous(lse, "lse", q);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
              "tree_attn: lse must be float32 [N, T] = [", q.size(1), ", ", q.size(0), "], got ", lse.sizes(), " ",
              lse.scalar_type());
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  auto delta = (d_o.to(at::kFloat) * o.to(at::kFloat)).sum(-1).transpose(0, 1).contiguous();
  auto dq = at::empty_like(q);
  auto dk = at::empty_like(k);
  auto dv = at::empty_like(v);
  auto bounds = block_bounds(sub_end, p, stream);
  p.d_o = d_o.data_ptr();
  set_impl(p, q, impl);
  at::Tensor dq_accum;  // the tensor-core backward adds dQ into a zeroed fp32 buffer
  if (forge::tree_attn_uses_mma(p, kernel_dtype(q))) {
    dq_accum = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    p.dq_accum = dq_accum.data_ptr<float>();
  }
  p.lse = lse.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  check_launch(forge::tree_attn_bwd(p, kernel_dtype(q), stream), "backward");
  return {dq, dk, dv};
}

std::string mma_unsupported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TreeAttnParams p;
  p.H = static_cast<int>(q.size(-1));
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  const char* why = forge::tree_attn_mma_unsupported(p, kernel_dtype(q));
  return why ? why : "";
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "forge_megatron CUDA tree attention (FlashAttention-2 style, tensor cores or SIMT, tile skipping by sub_end block bounds)";
  m.def("fwd", &fwd, "tree attention forward -> [o, lse]", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("sub_end"), py::arg("scale"), py::arg("stream"), py::arg("impl") = "auto");
  m.def("bwd", &bwd, "tree attention backward -> [dq, dk, dv]", py::arg("d_o"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("sub_end"), py::arg("scale"),
        py::arg("stream"), py::arg("impl") = "auto");
  m.def("mma_unsupported", &mma_unsupported, "why the tensor-core kernels cannot run q/k/v here (\"\" if they can)",
        py::arg("q"), py::arg("k"), py::arg("v"));
}
