// CUDA launcher of tree_attention (kernel: csrc/kernels/tree_attention.cuh). Built only when torch
// has CUDA; CI compiles it, compile-only. Run on an H100 once: it matches SDPA.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/tree_attention.cuh"
#include "ops/ops.h"

namespace mtprobe::ops {

at::Tensor tree_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& bits, double scale) {
  check_tree_attention_args(q, k, v, bits);
  TORCH_CHECK(
      q.is_cuda() && k.device() == q.device() && v.device() == q.device() && bits.device() == q.device(),
      "tree_attention: q, k, v and ancestor_bits must be on one CUDA device");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "tree_attention: q, k and v must share a dtype");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(D <= 256, "tree_attention: the CUDA kernel takes head dims up to 256, got ", D);
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), bc = bits.contiguous();
  at::Tensor out = at::empty_like(qc);  // [B, H, T, D]
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(kernels::tree_attention_workspace_floats(B, H, T, S, D))},
                q.options().dtype(at::kFloat));  // partial softmax per (row, key chunk)
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "tree_attention_cuda", [&] {
    const cudaError_t err = kernels::tree_attention<scalar_t>(
        qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
        reinterpret_cast<const uint64_t*>(bc.data_ptr<int64_t>()), B, H, Hkv, T, S, D,
        static_cast<float>(scale), workspace.data_ptr<float>(), out.data_ptr<scalar_t>(), stream);
    TORCH_CHECK(err == cudaSuccess, "tree_attention kernel: ", cudaGetErrorString(err));
  });
  return out;
}

}  // namespace mtprobe::ops

TORCH_LIBRARY_IMPL(mtprobe, CUDA, m) { m.impl("tree_attention", &mtprobe::ops::tree_attention_cuda); }
