// CUDA launcher of verify_greedy (kernel: csrc/kernels/verify.cuh). The walk runs on the device;
// the op's result has the path's length, so returning it reads one integer back (the decode loop
// needs the length then anyway). Built only when torch has CUDA; CI compiles it, compile-only.
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

}  // namespace mtprobe::ops

TORCH_LIBRARY_IMPL(mtprobe, CUDA, m) { m.impl("verify_greedy", &mtprobe::ops::verify_greedy_cuda); }
