// CUDA launchers of tree_attention_mask, tree_position_ids and tree_ancestor_bits (kernels:
// csrc/kernels/tree_mask.cuh). Built only when torch has CUDA (CMakeLists.txt); CI compiles this file with
// nvcc, compile-only. The parents are checked on the host (one copy of T <= BC indices), as the CPU ops check
// them.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "kernels/tree_mask.cuh"
#include "ops/ops.h"

namespace mtprobe::ops {

namespace {
at::Tensor checked_parents(const at::Tensor& parents) {
  check_parents_or_throw(to_int64_vector(parents, "parents"));
  return parents.to(at::kLong).contiguous();  // [T] on the device
}
}  // namespace

at::Tensor tree_attention_mask_cuda(const at::Tensor& parents, int64_t prefix_len, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(prefix_len >= 0, "prefix_len must be >= 0, got ", prefix_len);
  at::Tensor par = checked_parents(parents);
  const int64_t T = par.numel();
  c10::cuda::CUDAGuard guard(par.device());
  at::Tensor mask = at::empty({1, 1, T, prefix_len + T}, par.options().dtype(dtype));  // [1, 1, T, P + T]
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "tree_attention_mask_cuda", [&] {
    const cudaError_t err = kernels::tree_attention_mask<scalar_t>(
        par.data_ptr<int64_t>(), T, prefix_len, scalar_t(0), std::numeric_limits<scalar_t>::lowest(),
        mask.data_ptr<scalar_t>(), stream);
    TORCH_CHECK(err == cudaSuccess, "tree_attention_mask kernel: ", cudaGetErrorString(err));
  });
  return mask;
}

at::Tensor tree_position_ids_cuda(const at::Tensor& parents, int64_t prefix_len) {
  TORCH_CHECK_VALUE(prefix_len >= 0, "prefix_len must be >= 0, got ", prefix_len);
  at::Tensor par = checked_parents(parents);
  const int64_t T = par.numel();
  c10::cuda::CUDAGuard guard(par.device());
  at::Tensor out = at::empty({1, T}, par.options());  // [1, T] int64
  const cudaError_t err = kernels::tree_position_ids(
      par.data_ptr<int64_t>(), T, prefix_len, out.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "tree_position_ids kernel: ", cudaGetErrorString(err));
  return out;
}

at::Tensor tree_ancestor_bits_cuda(const at::Tensor& parents) {
  at::Tensor par = checked_parents(parents);
  const int64_t T = par.numel();
  c10::cuda::CUDAGuard guard(par.device());
  at::Tensor bits = at::empty({T, (T + 63) / 64}, par.options());  // [T, W] int64
  const cudaError_t err = kernels::tree_ancestor_bits(par.data_ptr<int64_t>(), T,
                                                      reinterpret_cast<uint64_t*>(bits.data_ptr<int64_t>()),
                                                      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "tree_ancestor_bits kernel: ", cudaGetErrorString(err));
  return bits;
}

}  // namespace mtprobe::ops

TORCH_LIBRARY_IMPL(mtprobe, CUDA, m) {
  m.impl("tree_ancestor_bits", &mtprobe::ops::tree_ancestor_bits_cuda);
  m.impl("tree_attention_mask", &mtprobe::ops::tree_attention_mask_cuda);
  m.impl("tree_position_ids", &mtprobe::ops::tree_position_ids_cuda);
}
