// CUDA launchers of verify_greedy and verify_rejection (kernels: csrc/kernels/verify.cuh). The walks
// run on the device; the ops' results have the path's length, so returning them reads one integer
// back (the decode loop needs the length then anyway), after the argument checks have read back the
// tree. Built only when torch has CUDA; CI compiles them, compile-only. Run on an H100 once
// (benchmarks/results/gpu/): they match the CPU ops.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/verify.cuh"
#include "ops/ops.h"

namespace mtprobe::ops {

at::Tensor verify_greedy_cuda(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target,
                              int64_t root) {
  const int64_t n = tokens.numel();
  TORCH_CHECK(tokens.dim() == 1 && parents.dim() == 1 && target.dim() == 1 && parents.numel() == n &&
                  target.numel() == n,
              "tokens, parents and target must be 1-D of the same length, got ", tokens.sizes(), ", ",
              parents.sizes(), " and ", target.sizes());
  TORCH_CHECK(root >= 0 && root < n, "root = ", root, " is not a node index in [0, ", n, ")");
  check_parents_or_throw(to_int64_vector(parents, "parents"));
  c10::cuda::CUDAGuard guard(tokens.device());
  const auto opts = tokens.options().dtype(at::kLong);
  at::Tensor tok = tokens.to(opts).contiguous(), par = parents.to(opts).contiguous();
  at::Tensor tgt = target.to(opts).contiguous();
  at::Tensor path = at::empty({n}, opts), length = at::empty({1}, opts);
  const cudaError_t err = kernels::verify_greedy(
      tok.data_ptr<int64_t>(), par.data_ptr<int64_t>(), tgt.data_ptr<int64_t>(), n, root,
      path.data_ptr<int64_t>(), length.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "verify_greedy kernel: ", cudaGetErrorString(err));
  return path.narrow(0, 0, length.item<int64_t>());
}

std::tuple<at::Tensor, at::Tensor> verify_rejection_cuda(const at::Tensor& tokens, const at::Tensor& parents,
                                                         const at::Tensor& p, const at::Tensor& q,
                                                         const at::Tensor& uniforms) {
  check_verify_rejection_args(to_int64_vector(tokens, "tokens"), to_int64_vector(parents, "parents"), p, q,
                              uniforms);
  TORCH_CHECK(tokens.is_cuda() && parents.device() == tokens.device() && p.device() == tokens.device() &&
                  q.device() == tokens.device() && uniforms.device() == tokens.device(),
              "verify_rejection: tokens, parents, p, q and uniforms must be on one CUDA device");
  c10::cuda::CUDAGuard guard(tokens.device());
  const int64_t n = tokens.numel(), vocab = p.size(1);
  const auto opts = tokens.options().dtype(at::kLong);
  at::Tensor tok = tokens.to(opts).contiguous(), par = parents.to(opts).contiguous();
  at::Tensor pf = p.to(at::kFloat).contiguous(), qf = q.to(at::kFloat).contiguous();
  at::Tensor u = uniforms.to(at::kDouble).contiguous();
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(core::rejection_workspace_bytes(vocab, kernels::kRejectionThreads))},
                opts.dtype(at::kByte));
  at::Tensor path = at::empty({n}, opts), length = at::empty({1}, opts), token = at::empty({}, opts);
  const cudaError_t err = kernels::verify_rejection(
      tok.data_ptr<int64_t>(), par.data_ptr<int64_t>(), n, pf.data_ptr<float>(), qf.data_ptr<float>(), vocab,
      u.data_ptr<double>(), workspace.data_ptr(), path.data_ptr<int64_t>(), length.data_ptr<int64_t>(),
      token.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "verify_rejection kernel: ", cudaGetErrorString(err));
  return {path.narrow(0, 0, length.item<int64_t>()), token};
}

}  // namespace mtprobe::ops

TORCH_LIBRARY_IMPL(mtprobe, CUDA, m) {
  m.impl("verify_greedy", &mtprobe::ops::verify_greedy_cuda);
  m.impl("verify_rejection", &mtprobe::ops::verify_rejection_cuda);
}
