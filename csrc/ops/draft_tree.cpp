// expand_draft_tree on the CPU: top-m candidates per mask row, then the dynamic tree
// (csrc/core/draft_tree_expand.h, the same code the CUDA kernel runs).
#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "core/draft_tree_expand.h"
#include "ops/ops.h"

namespace mtprobe::ops {

namespace {

// The most memory one expand_draft_tree may need: the tree's workspace (37 bytes per candidate,
// about depths * budget * min(width, budget) of them), the top candidates and the outputs. A budget
// of 2000 over 4 depths needs 423 MiB; 3000 over 4 depths, 952 MiB.
constexpr int64_t kMaxExpandDraftTreeBytes = int64_t{1} << 30;

}  // namespace

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
  // Bound the work up front: the tree scores up to dynamic_tree_capacity candidates, O(C log C).
  const int64_t depths = logits.size(0), m = core::dynamic_tree_width(width, budget);
  TORCH_CHECK_VALUE(budget <= core::kMaxDynamicTreeCandidates, "expand_draft_tree: budget ", budget,
                    " is more nodes than the tree's int32 indices address; it must be at most ",
                    core::kMaxDynamicTreeCandidates);
  const int64_t capacity = core::dynamic_tree_capacity(depths, m, budget);
  TORCH_CHECK_VALUE(capacity <= core::kMaxDynamicTreeCandidates, "expand_draft_tree: budget ", budget,
                    " over ", depths, " depths with width ", width, " can create more than ",
                    core::kMaxDynamicTreeCandidates,
                    " candidates (about depths * budget * min(width, budget)), more than the tree's "
                    "int32 indices address; use a smaller budget or width");
  const int64_t bytes = static_cast<int64_t>(core::dynamic_tree_workspace_bytes(capacity, budget)) +
                        depths * m * static_cast<int64_t>(sizeof(int64_t) + sizeof(float)) +
                        budget * static_cast<int64_t>(2 * sizeof(int64_t) + sizeof(double));
  TORCH_CHECK_VALUE(bytes <= kMaxExpandDraftTreeBytes, "expand_draft_tree: budget ", budget, " over ", depths,
                    " depths with width ", width, " needs ", (bytes + (1 << 20) - 1) >> 20,
                    " MiB of workspace and output (up to ", capacity,
                    " candidates, about depths * budget * min(width, budget)), above the limit of ",
                    kMaxExpandDraftTreeBytes >> 20,
                    " MiB; use a smaller budget (2000 over 4 depths needs 423 MiB)");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_draft_tree(const at::Tensor& logits,
                                                                             const at::Tensor& root_token,
                                                                             int64_t budget, int64_t width,
                                                                             bool prune) {
  check_expand_draft_tree_args(logits, root_token, budget, width);
  // Ranks past budget + 1 never make the tree: leave them out (the same tree, less work).
  const int64_t depths = logits.size(0), vocab = logits.size(1), m = core::dynamic_tree_width(width, budget);
  at::Tensor x = logits.to(at::kFloat).contiguous();  // [depths, vocab]
  // (The CUDA op leaves this out: checking would read back from the device.)
  TORCH_CHECK(!x.isnan().any().item<bool>(),
              "expand_draft_tree: logits contain NaN; candidates are ranked by logit");
  // The softmax with its normaliser summed in double (the CUDA kernel's too): in float the sum over
  // a 151936-token vocabulary drifts by ~1e-5 relative with the order of its terms.
  at::Tensor e = (x - std::get<0>(x.max(-1, /*keepdim=*/true))).exp().contiguous();  // [depths, vocab]
  at::Tensor denom = e.sum(-1, /*keepdim=*/false, at::kDouble).contiguous();         // [depths]
  const float* xs = x.data_ptr<float>();
  const float* es = e.data_ptr<float>();
  const double* ds = denom.data_ptr<double>();
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
      cand_probs[d * m + r] = static_cast<float>(static_cast<double>(es[d * vocab + idx[r]]) / ds[d]);
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
