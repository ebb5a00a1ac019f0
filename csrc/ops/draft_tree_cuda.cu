// CUDA launcher of expand_draft_tree (kernels: csrc/kernels/draft_tree.cuh). Built only when
// torch has CUDA; CI compiles it, compile-only. Run on an H100 once: it matches the CPU op. No host
// synchronisation: the outputs (and the tree's size) stay on the device.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/draft_tree.cuh"
#include "ops/ops.h"

namespace mtprobe::ops {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_draft_tree_cuda(
    const at::Tensor& logits, const at::Tensor& root_token, int64_t budget, int64_t width, bool prune) {
  check_expand_draft_tree_args(logits, root_token, budget, width);
  c10::cuda::CUDAGuard guard(logits.device());
  // Ranks past budget + 1 never make the tree: leave them out (the same tree, fewer top-m rounds).
  const int64_t depths = logits.size(0), vocab = logits.size(1), m = core::dynamic_tree_width(width, budget);
  at::Tensor x = logits.contiguous();
  at::Tensor root = root_token.to(at::kLong).reshape({1}).contiguous();
  const auto opts = logits.options();
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(kernels::expand_draft_tree_workspace_bytes(depths, m, budget))},
                opts.dtype(at::kByte));  // the caching allocator aligns blocks to 512 bytes
  at::Tensor tokens = at::empty({budget}, opts.dtype(at::kLong));
  at::Tensor parents = at::empty({budget}, opts.dtype(at::kLong));
  at::Tensor probs = at::empty({budget}, opts.dtype(at::kDouble));
  at::Tensor num_nodes = at::empty({}, opts.dtype(at::kLong));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "expand_draft_tree_cuda", [&] {
    const cudaError_t err = kernels::expand_draft_tree<scalar_t>(
        x.data_ptr<scalar_t>(), depths, vocab, m, root.data_ptr<int64_t>(), budget, prune,
        workspace.data_ptr(), tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(),
        probs.data_ptr<double>(), num_nodes.data_ptr<int64_t>(), stream);
    TORCH_CHECK(err == cudaSuccess, "expand_draft_tree kernels: ", cudaGetErrorString(err));
  });
  return {tokens, parents, probs, num_nodes};
}

}  // namespace mtprobe::ops

TORCH_LIBRARY_IMPL(mtprobe, CUDA, m) { m.impl("expand_draft_tree", &mtprobe::ops::expand_draft_tree_cuda); }
