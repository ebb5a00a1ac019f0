#include "drafters/hybrid.h"

#include <algorithm>

namespace mtprobe {

namespace {
MaskProbeOptions dynamic(MaskProbeOptions o, double mask_value) {
  o.dynamic_tree = true;  // the union is selected by score, as probing's dynamic tree
  o.branches.clear();
  // Planned masks leave room for up to BC - k nodes (only the root masked).
  if (mask_value >= 0.0) o.tree_nodes = o.block_complexity - o.num_masks;
  return o;
}
// Nodes of `tree` (root excluded) whose path from the root is not one of `seed`'s.
int64_t count_outside(const std::vector<core::DraftNode>& tree, const std::vector<core::DraftNode>& seed) {
  std::vector<int64_t> in_seed(tree.size(), -1);  // tree index -> seed index, -1: none
  if (!tree.empty() && !seed.empty()) in_seed[0] = 0;
  int64_t outside = 0;
  for (size_t i = 1; i < tree.size(); ++i) {
    const int64_t sp = in_seed[static_cast<size_t>(tree[i].parent)];
    for (size_t j = 1; sp >= 0 && j < seed.size() && in_seed[i] < 0; ++j)
      if (seed[j].parent == sp && seed[j].token == tree[i].token) in_seed[i] = static_cast<int64_t>(j);
    outside += in_seed[i] < 0;
  }
  return outside;
}
}  // namespace

HybridDrafter::HybridDrafter(at::Tensor embedding, MaskProbeOptions probe, StandOptions stand,
                             double mask_value, bool grow_probed)
    : probe_(std::move(embedding), dynamic(std::move(probe), mask_value)),
      stand_(stand),
      stand_depth_(stand.max_depth),
      mask_value_(mask_value),
      grow_probed_(grow_probed) {}

void HybridDrafter::begin(const at::Tensor& prompt) {
  probe_.begin(prompt);
  stand_.begin(prompt);
}

DraftBlock HybridDrafter::propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) {
  probe_nodes_ = ngram_nodes_ = 0;
  if (committed.size(0) != 1) return probe_.propose(committed, prefix_len, limits);  // prefill
  const int64_t k = probe_.options().num_masks;
  // Nodes the block can hold, root included: B when every node carries masks, else up to BC - k.
  const int64_t inputs = probe_.options().block_complexity;
  const int64_t budget = mask_value_ < 0.0 ? probe_.budget_nodes() : inputs - k;
  const int64_t root_token = probe_.root_of(committed);  // from the host: observe() saw it
  std::vector<core::DraftNode> probed = probe_.candidate_tree(root_token, limits);
  // The store's tree: no deeper than the tokens still wanted, and room for the masks below it.
  const int64_t depth = std::min({stand_depth_, limits.tokens_left - 1, limits.max_depth - k});
  probe_nodes_ = std::max<int64_t>(0, static_cast<int64_t>(probed.size()) - 1);
  std::vector<core::DraftNode> merged;
  if (grow_probed_) {
    // One best-first tree: probed nodes compete with the store's, which drafts below them too.
    merged = stand_.tree_nodes(root_token, budget - 1, depth, &probed);
  } else {
    std::vector<core::DraftNode> copied = stand_.tree_nodes(root_token, budget - 1, depth);
    ngram_nodes_ = static_cast<int64_t>(copied.size()) - 1;
    merged = core::merge_draft_trees(probed, copied, budget);
  }
  core::MaskPlan plan;
  const bool planned = mask_value_ >= 0.0;  // masks only where a step is likely to end
  if (planned) {
    plan = core::plan_mask_carriers(merged, inputs, k, mask_value_);
    merged = std::move(plan.nodes);
  }
  // Counted once, on the tree the block verifies (the plan may have cut nodes).
  if (grow_probed_) ngram_nodes_ = count_outside(merged, probed);
  return probe_.block_with_masks(committed, std::move(merged), limits, planned ? &plan.carries : nullptr);
}

void HybridDrafter::observe(const StepOutcome& outcome) {
  probe_.observe(outcome);
  stand_.observe(outcome);
}

}  // namespace mtprobe
