// expand_draft_tree on the CPU: top-m candidates per mask row, then the dynamic tree
// (csrc/core/draft_tree_expand.h, the same code the CUDA kernel runs).
#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "core/draft_tree_expand.h"
#include "ops/ops.h"

namespace mtprobe::ops {

void check_expand_draft_tree_args(const at::Tensor& logits, const at::Tensor& root_token, int64_t budget,
                                  int64_t width) {
  TORCH_CHECK(
      logits.dim() == 2 && logits.size(0) >= 1 && logits.size(1) >= 1,
      "expand_draft_tree: logits must be [depths, vocab] with depths >= 1 (one row per mask token), got ",
      logits.sizes());
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()),
              "expand_draft_tree: logits must be floating point, got ", logits.scalar_type());
  TORCH_CHECK(root_token.numel() == 1 && root_token.dim() <= 1 &&
                  (root_token.scalar_type() == at::kLong || root_token.scalar_type() == at::kInt),
              "expand_draft_tree: root_token must be one int32/int64 token ([] or [1]), got shape ",
              root_token.sizes(), " of ", root_token.scalar_type());
  TORCH_CHECK(root_token.device() == logits.device(), "expand_draft_tree: root_token is on ",
              root_token.device(), " but logits are on ", logits.device());
  TORCH_CHECK(budget >= 1, "expand_draft_tree: budget counts the root, so it must be >= 1, got ", budget);
  TORCH_CHECK(width >= 1 && width <= logits.size(1),
              "expand_draft_tree: width (candidates per depth) must be in [1, ", logits.size(1),
              "] (the vocabulary), got ", width);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_draft_tree(const at::Tensor& logits,
                                                                             const at::Tensor& root_token,
                                                                             int64_t budget, int64_t width,
                                                                             bool prune) {
  check_expand_draft_tree_args(logits, root_token, budget, width);
  const int64_t depths = logits.size(0), vocab = logits.size(1), m = width;
  at::Tensor x = logits.to(at::kFloat).contiguous();  // [depths, vocab]
  // (The CUDA op leaves this out: checking would read back from the device.)
  TORCH_CHECK(!x.isnan().any().item<bool>(),
              "expand_draft_tree: logits contain NaN; candidates are ranked by logit");
  at::Tensor p = x.softmax(-1);  // [depths, vocab]
  const float* xs = x.data_ptr<float>();
  const float* ps = p.data_ptr<float>();
  // Top-m of each row by logit, ties to the lower token id (the kernel's order, so both pick alike).
  std::vector<int64_t> cand_tokens(static_cast<size_t>(depths * m));  // [depths, m]
  std::vector<float> cand_probs(static_cast<size_t>(depths * m));     // [depths, m]
  std::vector<int64_t> idx(static_cast<size_t>(vocab));
  for (int64_t d = 0; d < depths; ++d) {
    const float* row = xs + d * vocab;
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + m, idx.end(),
                      [row](int64_t a, int64_t b) { return row[a] != row[b] ? row[a] > row[b] : a < b; });
    for (int64_t r = 0; r < m; ++r) {
      cand_tokens[d * m + r] = idx[r];
      cand_probs[d * m + r] = ps[d * vocab + idx[r]];
    }
  }
  const int64_t root = root_token.to(at::kCPU, at::kLong).reshape({}).item<int64_t>();
  const int64_t capacity = core::dynamic_tree_capacity(depths, m, budget);
  std::vector<double> scratch(core::dynamic_tree_workspace_bytes(capacity, budget) / sizeof(double) + 1);
  const core::DynamicTreeWorkspace w = core::carve_dynamic_tree_workspace(scratch.data(), capacity, budget);
  at::Tensor tokens = at::empty({budget}, at::kLong), parents = at::empty({budget}, at::kLong);
  at::Tensor probs = at::empty({budget}, at::kDouble);
  const int64_t n = core::expand_dynamic_tree(core::SerialExec{}, root, cand_tokens.data(), cand_probs.data(),
                                              depths, m, budget, prune, w, tokens.data_ptr<int64_t>(),
                                              parents.data_ptr<int64_t>(), probs.data_ptr<double>());
  return {tokens, parents, probs, at::scalar_tensor(n, at::kLong)};
}

}  // namespace mtprobe::ops
