// CUDA launcher of compact_kv_ (kernel: csrc/kernels/kv_compact.cuh): one launch per cache tensor,
// the accepted rows gathered in place. Built only when torch has CUDA; CI compiles it, compile-only.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "core/kv_compact.h"
#include "kernels/kv_compact.cuh"
#include "ops/ops.h"

namespace mtprobe::ops {

namespace {
template <typename Word>
void launch(const at::Tensor& c, const at::Tensor& src, int64_t n, int64_t dst_start, cudaStream_t stream) {
  const cudaError_t err = kernels::compact_kv<Word>(static_cast<Word*>(c.data_ptr()), c.size(0), c.size(1),
                                                    c.stride(0), c.stride(1), c.stride(2), c.size(3),
                                                    src.data_ptr<int64_t>(), n, dst_start, stream);
  TORCH_CHECK(err == cudaSuccess, "compact_kv_ kernel: ", cudaGetErrorString(err));
}
}  // namespace

void compact_kv_cuda_(at::TensorList caches, const at::Tensor& src, int64_t dst_start) {
  std::vector<int64_t> s = to_int64_vector(src, "src");  // checked on the host: n <= BC indices
  const int64_t n = static_cast<int64_t>(s.size());
  if (caches.empty() || n == 0) return;
  const int64_t seq_len = caches[0].size(2);
  const std::string err = core::check_compaction(s.data(), n, dst_start, seq_len);
  TORCH_CHECK(err.empty(), "compact_kv_: ", err);
  c10::cuda::CUDAGuard guard(caches[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor src_dev = at::tensor(s, at::kLong).to(caches[0].device(), /*non_blocking=*/true);
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.is_cuda() && c.device() == caches[0].device(), "compact_kv_: every cache must be on ",
                caches[0].device(), ", got ", c.device());
    TORCH_CHECK(c.dim() == 4 && c.size(2) == seq_len, "compact_kv_: each cache must be [batch, heads, ",
                seq_len, ", head_dim], got ", c.sizes());
    TORCH_CHECK(c.stride(3) == 1, "compact_kv_: the head dimension must be contiguous");
    switch (c.element_size()) {
      case 1:
        launch<uint8_t>(c, src_dev, n, dst_start, stream);
        break;
      case 2:
        launch<uint16_t>(c, src_dev, n, dst_start, stream);
        break;
      case 4:
        launch<uint32_t>(c, src_dev, n, dst_start, stream);
        break;
      case 8:
        launch<uint64_t>(c, src_dev, n, dst_start, stream);
        break;
      default:
        TORCH_CHECK(false, "compact_kv_: unsupported element size ", c.element_size());
    }
  }
}

}  // namespace mtprobe::ops

TORCH_LIBRARY_IMPL(mtprobe, CUDA, m) { m.impl("compact_kv_", &mtprobe::ops::compact_kv_cuda_); }
