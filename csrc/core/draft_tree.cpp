#include "core/draft_tree.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <string>

#include "core/draft_tree_expand.h"

namespace mtprobe::core {

namespace {

// The best `count` candidates of depth `depth` (1-based) for a child of `parent_token`.
template <typename F>
void for_each_child(const int64_t* cand_tokens, const float* cand_probs, int64_t m, int64_t depth,
                    int64_t parent_token, int64_t root_token, bool prune, int64_t count, F&& emit) {
  const int64_t* tok = cand_tokens + (depth - 1) * m;
  const float* prob = cand_probs + (depth - 1) * m;
  int64_t taken = 0;
  for (int64_t r = 0; r < m && taken < count; ++r) {
    if (prune && (tok[r] == parent_token || tok[r] == root_token)) continue;
    emit(tok[r], static_cast<double>(prob[r]));
    ++taken;
  }
}

}  // namespace

std::vector<DraftNode> build_static_tree(int64_t root_token, const int64_t* cand_tokens,
                                         const float* cand_probs, int64_t depths, int64_t m,
                                         const int64_t* branches, bool prune) {
  std::vector<DraftNode> nodes{{root_token, -1, 0, 1.0}};
  int64_t expand = 0;  // the node that gets the next depth's children: Top-1 expansion
  for (int64_t d = 1; d <= depths; ++d) {
    const int64_t first_child = static_cast<int64_t>(nodes.size());
    const DraftNode parent = nodes[expand];
    for_each_child(cand_tokens, cand_probs, m, d, parent.token, root_token, prune, branches[d - 1],
                   [&](int64_t t, double p) { nodes.push_back({t, expand, d, parent.prob * p}); });
    if (static_cast<int64_t>(nodes.size()) == first_child) break;  // no candidates left
    expand = first_child;  // candidates are sorted: the first child is the most probable
  }
  return nodes;
}

std::vector<DraftNode> build_dynamic_tree(int64_t root_token, const int64_t* cand_tokens,
                                          const float* cand_probs, int64_t depths, int64_t m, int64_t budget,
                                          bool prune) {
  // One implementation for host and device: draft_tree_expand.h.
  if (budget < 1) budget = 1;
  const int64_t capacity = dynamic_tree_capacity(depths, m, budget);
  if (capacity > kMaxDynamicTreeCandidates) {
    throw std::invalid_argument("build_dynamic_tree: budget " + std::to_string(budget) + " with " +
                                std::to_string(m) + " candidates per depth over " + std::to_string(depths) +
                                " depths can create more than " + std::to_string(kMaxDynamicTreeCandidates) +
                                " candidates (the most a tree's workspace indexes); use a smaller budget");
  }
  std::vector<double> scratch((dynamic_tree_workspace_bytes(capacity, budget) + sizeof(double) - 1) /
                              sizeof(double));  // doubles keep it 8-byte aligned
  const DynamicTreeWorkspace w = carve_dynamic_tree_workspace(scratch.data(), capacity, budget);
  std::vector<int64_t> tokens(static_cast<size_t>(budget)), parents(static_cast<size_t>(budget));
  std::vector<double> probs(static_cast<size_t>(budget));
  const int64_t n = expand_dynamic_tree(SerialExec{}, root_token, cand_tokens, cand_probs, depths, m, budget,
                                        prune, w, tokens.data(), parents.data(), probs.data());
  std::vector<DraftNode> nodes;
  nodes.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t parent = parents[i];
    nodes.push_back({tokens[i], parent, parent < 0 ? 0 : nodes[parent].depth + 1, probs[i]});
  }
  return nodes;
}

}  // namespace mtprobe::core

namespace mtprobe::core {

std::vector<DraftNode> merge_draft_trees(const std::vector<DraftNode>& a, const std::vector<DraftNode>& b,
                                         int64_t budget) {
  if (a.empty() && b.empty()) return {};
  const DraftNode& root = a.empty() ? b[0] : a[0];
  std::vector<DraftNode> all{{root.token, -1, 0, 1.0}};  // the union, in the order nodes are met
  for (const auto* tree : {&a, &b}) {
    std::vector<int64_t> to_union(tree->size(), 0);  // tree index -> union index (root -> 0)
    for (size_t i = 1; i < tree->size(); ++i) {
      const DraftNode& n = (*tree)[i];
      const int64_t parent = to_union[static_cast<size_t>(n.parent)];
      int64_t found = -1;
      for (size_t u = 1; u < all.size() && found < 0; ++u) {  // trees hold at most BC nodes
        if (all[u].parent == parent && all[u].token == n.token) found = static_cast<int64_t>(u);
      }
      if (found < 0) {
        found = static_cast<int64_t>(all.size());
        all.push_back({n.token, parent, all[static_cast<size_t>(parent)].depth + 1, n.prob});
      } else {
        all[static_cast<size_t>(found)].prob = std::max(all[static_cast<size_t>(found)].prob, n.prob);
      }
      to_union[i] = found;
    }
  }
  // The best budget - 1 by score, ties to the earlier union index (parents come first).
  std::vector<int64_t> order(all.size() - 1);
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i) + 1;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return all[x].prob > all[y].prob; });
  const size_t keep =
      static_cast<size_t>(std::clamp<int64_t>(budget - 1, 0, static_cast<int64_t>(order.size())));
  std::vector<bool> kept(all.size(), false);
  kept[0] = true;
  for (size_t i = 0; i < keep; ++i) kept[static_cast<size_t>(order[i])] = true;
  std::vector<int64_t> new_index(all.size(), -1);
  std::vector<DraftNode> out;
  for (size_t u = 0; u < all.size(); ++u) {
    // (a parent always outscores or ties and precedes its children; the check only guards that)
    if (!kept[u] || (u != 0 && new_index[static_cast<size_t>(all[u].parent)] < 0)) continue;
    DraftNode n = all[u];
    n.parent = u == 0 ? -1 : new_index[static_cast<size_t>(n.parent)];
    new_index[u] = static_cast<int64_t>(out.size());
    out.push_back(n);
  }
  return out;
}

MaskPlan plan_mask_carriers(const std::vector<DraftNode>& nodes, int64_t inputs, int64_t k,
                            double mask_value) {
  if (nodes.empty()) return {};
  // Score order, parents before children on ties (a parent's score is never below a child's).
  std::vector<int64_t> order(nodes.size() - 1);
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i) + 1;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return nodes[x].prob > nodes[y].prob; });
  const int64_t most = std::clamp<int64_t>(inputs - 1, 0, static_cast<int64_t>(order.size()));
  // P(the step ends at node i) = p_i - sum_{kept children} p_c, updated as each node joins.
  std::vector<double> ends(nodes.size(), 0.0);
  ends[0] = 1.0;
  std::vector<double> top;
  double best = -1.0, drafts = 0.0;
  int64_t best_n = 0;
  for (int64_t n = 0; n <= most; ++n) {  // the best n nodes
    if (n > 0) {
      const DraftNode& d = nodes[order[n - 1]];
      drafts += d.prob;
      ends[order[n - 1]] = d.prob;
      ends[d.parent] -= d.prob;
    }
    const int64_t carriers = std::min<int64_t>(n + 1, (inputs - 1 - n) / k);
    double value = drafts;
    if (carriers > 0) {
      top.clear();
      top.push_back(ends[0]);
      for (int64_t j = 0; j < n; ++j) top.push_back(ends[order[j]]);
      std::partial_sort(top.begin(), top.begin() + carriers, top.end(), std::greater<double>());
      for (int64_t j = 0; j < carriers; ++j) value += mask_value * std::max(top[j], 0.0);
    }
    if (value > best) best = value, best_n = n;
  }
  // The plan: the best_n nodes in the input's order (parents first), masks on the most likely ends.
  std::vector<bool> kept(nodes.size(), false);
  kept[0] = true;
  for (int64_t j = 0; j < best_n; ++j) kept[order[j]] = true;
  std::vector<int64_t> new_index(nodes.size(), -1);
  MaskPlan plan;
  std::vector<double> plan_ends;
  for (size_t u = 0; u < nodes.size(); ++u) {
    if (!kept[u]) continue;
    DraftNode d = nodes[u];
    d.parent = u == 0 ? -1 : new_index[static_cast<size_t>(d.parent)];
    new_index[u] = static_cast<int64_t>(plan.nodes.size());
    plan.nodes.push_back(d);
    plan_ends.push_back(u == 0 ? 1.0 : d.prob);
    if (u != 0) plan_ends[static_cast<size_t>(d.parent)] -= d.prob;
  }
  const int64_t n = static_cast<int64_t>(plan.nodes.size());
  const int64_t carriers = std::clamp<int64_t>((inputs - n) / k, 0, n);
  std::vector<int64_t> by_end(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) by_end[i] = i;
  std::stable_sort(by_end.begin(), by_end.end(),
                   [&](int64_t x, int64_t y) { return plan_ends[x] > plan_ends[y]; });
  plan.carries.assign(static_cast<size_t>(n), false);
  // (a node the step cannot end at gets none: its inputs would buy nothing)
  for (int64_t j = 0; j < carriers && plan_ends[by_end[j]] > 0.0; ++j) plan.carries[by_end[j]] = true;
  return plan;
}

MaskSource mask_source(const std::vector<int64_t>& path, const std::vector<int64_t>& mask_input, int64_t k) {
  int64_t shift = 0;
  for (auto node = path.rbegin(); node != path.rend() && shift < k; ++node, ++shift) {
    if (*node >= 0 && *node < static_cast<int64_t>(mask_input.size()) && mask_input[*node] >= 0)
      return {mask_input[*node], shift};
  }
  return {};
}

}  // namespace mtprobe::core
