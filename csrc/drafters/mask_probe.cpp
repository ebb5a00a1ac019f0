#include "drafters/mask_probe.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>

#include "core/draft_tree.h"
#include "ops/dispatch.h"

namespace mtprobe {

MaskProbeDrafter::MaskProbeDrafter(at::Tensor embedding, MaskProbeOptions options)
    : embedding_(std::move(embedding)), options_(std::move(options)) {
  const auto& o = options_;
  TORCH_CHECK_VALUE(embedding_.dim() == 2, "embedding must be [vocab, hidden], got ", embedding_.sizes());
  TORCH_CHECK_VALUE(o.num_masks >= 1 && o.num_masks <= 4, "num_masks must be in [1, 4], got ", o.num_masks);
  TORCH_CHECK_VALUE(budget_nodes() >= 2, "block_complexity ", o.block_complexity, " leaves no draft for ",
                    o.num_masks, " mask tokens");
  TORCH_CHECK_VALUE(o.mask_lambda >= 0.0 && o.mask_lambda <= 1.0, "mask_lambda must be in [0, 1], got ",
                    o.mask_lambda);
  TORCH_CHECK_VALUE(o.mask_init == "prompt_mean" || o.mask_init == "prompt_last" ||
                        o.mask_init == "gaussian" || o.mask_init == "calibrated",
                    "unknown mask_init '", o.mask_init,
                    "' (prompt_mean, prompt_last, gaussian or calibrated)");
  if (o.mask_init == "calibrated") {
    const at::Tensor& m = o.initial_masks;
    TORCH_CHECK_VALUE(m.defined(), "mask_init 'calibrated' needs initial_masks [num_masks, hidden]");
    TORCH_CHECK_VALUE(m.dim() == 2 && m.size(0) >= o.num_masks && m.size(1) == embedding_.size(1),
                      "initial_masks must be [>= ", o.num_masks, ", ", embedding_.size(1),
                      "] (num_masks rows of the embedding's hidden size), got ", m.sizes());
    TORCH_CHECK_VALUE(m.is_floating_point() && at::isfinite(m).all().item<bool>(),
                      "initial_masks must hold finite floating-point values");
  } else {
    TORCH_CHECK_VALUE(!o.initial_masks.defined(), "initial_masks are for mask_init 'calibrated', not '",
                      o.mask_init, "'");
  }
  if (!o.bank.empty()) {
    TORCH_CHECK_VALUE(!o.dynamic_tree,
                      "a topology bank holds static trees: it cannot drive the dynamic tree");
    for (size_t i = 0; i < o.bank.size(); ++i) {
      const core::Topology& t = o.bank[i];
      TORCH_CHECK_VALUE(t.max_depth <= o.num_masks, "bank topology ", i, " reaches depth ", t.max_depth,
                        " but ", o.num_masks, " mask token(s) draft depths 1..", o.num_masks, " only");
      TORCH_CHECK_VALUE((o.num_masks + 1) * t.num_nodes() <= o.block_complexity, "bank topology ", i, " has ",
                        t.num_nodes(), " nodes: (k + 1) * nodes = ", (o.num_masks + 1) * t.num_nodes(),
                        " exceeds block_complexity ", o.block_complexity);
    }
    try {
      core::check_bank_policy(static_cast<int64_t>(o.bank.size()), o.policy, o.feature, o.ema);
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK_VALUE(false, e.what());
    }
  } else if (!o.dynamic_tree) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(o.branches.size()) == o.num_masks,
                      "a static tree needs one branch "
                      "count per mask token: got ",
                      o.branches.size(), " for num_masks = ", o.num_masks);
    int64_t nodes = 1;
    for (int64_t k : o.branches) {
      TORCH_CHECK_VALUE(k >= 1, "every branch count must be >= 1");
      nodes += k;
    }
    TORCH_CHECK_VALUE((o.num_masks + 1) * nodes <= o.block_complexity, "branches sum to ", nodes - 1,
                      " drafts: (k + 1)(1 + sum K) = ", (o.num_masks + 1) * nodes,
                      " exceeds block_complexity ", o.block_complexity);
  }
  if (o.mask_value >= 0.0) {
    TORCH_CHECK_VALUE(std::isfinite(o.mask_value), "mask_value must be finite, got ", o.mask_value);
    TORCH_CHECK_VALUE(o.dynamic_tree, "mask_value plans the dynamic tree's masks: it needs dynamic_tree");
    // Planned masks leave room for up to BC - k nodes (only the root masked).
    if (o.tree_nodes == 0) options_.tree_nodes = o.block_complexity - o.num_masks;
  }
  TORCH_CHECK_VALUE(o.tree_nodes == 0 || (o.dynamic_tree && o.tree_nodes >= 2 &&
                                          o.tree_nodes + o.num_masks <= o.block_complexity),
                    "tree_nodes ", o.tree_nodes, " must be 0 (B) or, for the dynamic tree, in [2, ",
                    o.block_complexity - o.num_masks, "] (the root's masks must fit)");
  int64_t widest = 1;
  if (o.dynamic_tree) {
    widest = tree_nodes() - 1;
  } else if (!o.bank.empty()) {
    for (const auto& t : o.bank) widest = std::max(widest, t.max_rank + 1);
  } else {
    widest = *std::max_element(o.branches.begin(), o.branches.end());
  }
  // Room for the pruner to skip the parent and the root.
  cand_width_ = std::min<int64_t>(widest + 2, embedding_.size(0));
  generator_ = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(o.seed));
}

void MaskProbeDrafter::begin(const at::Tensor& prompt) {
  TORCH_CHECK_VALUE(prompt.dim() == 1 && prompt.numel() > 0, "prompt must be a non-empty 1-D token tensor");
  const int64_t k = options_.num_masks;
  const int64_t L = prompt.size(0);
  next_root_ = -1;
  at::Tensor e = embedding_.index_select(0, prompt.to(embedding_.device())).to(at::kFloat);  // [L, hidden]
  if (options_.mask_init == "prompt_mean") {
    // Soft: every mask is the mean of the prompt's embeddings.
    masks_ = e.mean(0).unsqueeze(0).repeat({k, 1});  // [k, hidden]
  } else if (options_.mask_init == "prompt_last") {
    // Hard: the last k prompt embeddings (the first repeated if the prompt is shorter).
    at::Tensor idx = at::arange(L - k, L, at::kLong).clamp_min(0).to(e.device());
    masks_ = e.index_select(0, idx);
  } else if (options_.mask_init == "calibrated") {
    // Learned once per model; the same start for every prompt.
    masks_ = options_.initial_masks.narrow(0, 0, k).to(e.device(), at::kFloat).clone();  // [k, hidden]
  } else {
    // N(mu + shift sigma, sigma^2 I) fitted to the table. sigma is the per-coordinate RMS
    // deviation, so samples sit at the typical distance of real embeddings from their mean.
    at::Tensor table = embedding_.to(at::kFloat);
    at::Tensor mu = table.mean(0);  // [hidden]
    const double sigma = std::sqrt((table - mu).pow(2).mean().item<double>());
    at::Tensor noise = at::empty({k, table.size(1)}, at::kFloat).normal_(0.0, 1.0, generator_);
    masks_ = mu.cpu().unsqueeze(0) + (noise + options_.gaussian_shift) * sigma;
    masks_ = masks_.to(embedding_.device());
  }
  have_candidates_ = false;
  mask_input_of_node_.clear();
  if (uses_bank()) current_tree_ = options_.policy.initial();
  features_ = core::TopologyFeatures{};
  tree_choices_.clear();
  log_positions_.clear();
  log_tokens_.clear();
  log_features_.clear();
  log_trees_.clear();
}

std::vector<core::DraftNode> MaskProbeDrafter::candidate_tree(int64_t root_token,
                                                              const StepLimits& limits) const {
  // The draft tree below the root, from the masks on the last accepted node.
  if (!have_candidates_ || limits.tokens_left < 2) return {};
  if (options_.dynamic_tree) {
    // Expanded in observe() (on the logits' device); the one read back of the step's drafting.
    if (root_token != tree_root_) return {};
    at::Tensor t = tree_.to(at::kCPU).contiguous();  // [3, budget]: tokens, parents, probs
    const double* tok = t.data_ptr<double>();
    const double* par = tok + t.size(1);
    const double* prob = par + t.size(1);
    std::vector<core::DraftNode> nodes;
    for (int64_t i = 0; i < t.size(1) && tok[i] >= 0; ++i) {
      const auto parent = static_cast<int64_t>(par[i]);
      nodes.push_back(
          {static_cast<int64_t>(tok[i]), parent, parent < 0 ? 0 : nodes[parent].depth + 1, prob[i]});
    }
    return nodes;
  }
  if (uses_bank()) {
    // The policy's topology, filled with this step's candidates: same shape every time it is chosen.
    const core::Topology& t = options_.bank[static_cast<size_t>(current_tree_)];
    const int64_t n = t.num_nodes();
    std::vector<int64_t> tokens(static_cast<size_t>(n));
    std::vector<double> probs(static_cast<size_t>(n));
    if (!core::fill_topology(t, root_token, cand_tokens_.data(), cand_probs_.data(), options_.num_masks,
                             cand_width_, options_.prune, tokens.data(), probs.data())) {
      return {};
    }
    std::vector<core::DraftNode> nodes(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) nodes[i] = {tokens[i], t.parents[i], t.depths[i], probs[i]};
    return nodes;
  }
  return core::build_static_tree(root_token, cand_tokens_.data(), cand_probs_.data(), options_.num_masks,
                                 cand_width_, options_.branches.data(), options_.prune);
}

int64_t MaskProbeDrafter::root_of(const at::Tensor& committed) const {
  // After a step the loop hands over its last new token alone, which observe() has seen.
  if (next_root_ >= 0) return next_root_;
  return committed.to(at::kCPU).data_ptr<int64_t>()[committed.size(0) - 1];
}

DraftBlock MaskProbeDrafter::propose(const at::Tensor& committed, int64_t prefix_len,
                                     const StepLimits& limits) {
  std::vector<core::DraftNode> tree;
  if (committed.size(0) == 1 && have_candidates_) tree = candidate_tree(root_of(committed), limits);
  if (uses_bank() && prefix_len > 0) tree_choices_.push_back(tree.empty() ? -1 : current_tree_);
  if (options_.mask_value >= 0.0 && tree.size() > 1) {
    core::MaskPlan plan =
        core::plan_mask_carriers(tree, options_.block_complexity, options_.num_masks, options_.mask_value);
    return block_with_masks(committed, std::move(plan.nodes), limits, &plan.carries);
  }
  return block_with_masks(committed, std::move(tree), limits);
}

DraftBlock MaskProbeDrafter::block_with_masks(const at::Tensor& committed, std::vector<core::DraftNode> tree,
                                              const StepLimits& limits, const std::vector<bool>* carries) {
  const int64_t k = options_.num_masks;
  const int64_t c = committed.size(0);
  const int64_t root = c - 1;
  DraftBlock b;
  b.num_committed = c;
  int64_t tree_depth = 0;
  for (const auto& n : tree) tree_depth = std::max(tree_depth, n.depth);
  // Positions must fit the model: a node at depth d carries masks down to depth d + k.
  if (tree_depth + k > limits.max_depth) tree.clear(), tree_depth = 0;
  const bool masks = limits.tokens_left >= 2 && k <= limits.max_depth;
  const int64_t num_drafts = tree.empty() ? 0 : static_cast<int64_t>(tree.size()) - 1;

  b.num_nodes = c + num_drafts;
  b.parents.resize(static_cast<size_t>(c + num_drafts));
  for (int64_t i = 0; i < c; ++i) b.parents[i] = i - 1;  // the committed chain
  if (num_drafts > 0) {
    std::vector<int64_t> drafts(static_cast<size_t>(num_drafts));
    for (int64_t i = 1; i <= num_drafts; ++i) {
      drafts[i - 1] = tree[i].token;
      b.parents[root + i] = root + tree[i].parent;  // tree index 0 is the root
    }
    b.set_tokens(committed, std::move(drafts));
  } else {
    b.set_tokens(committed, {});
  }

  // k chained masks on the root and on every draft node (or on those `carries` names).
  if (tree.empty()) carries = nullptr;  // no drafts (or cleared above): the root's masks
  TORCH_CHECK(carries == nullptr || carries->size() == tree.size(), "carries names ", carries->size(),
              " nodes for a tree of ", tree.size());
  mask_input_of_node_.assign(static_cast<size_t>(b.num_nodes), -1);
  int64_t carriers = 0;
  if (masks) {
    for (int64_t node = root; node < b.num_nodes; ++node) {
      if (carries != nullptr && !(*carries)[static_cast<size_t>(node - root)]) continue;
      mask_input_of_node_[node] = static_cast<int64_t>(b.parents.size());
      for (int64_t j = 0; j < k; ++j)
        b.parents.push_back(j == 0 ? node : static_cast<int64_t>(b.parents.size()) - 1);
      ++carriers;
    }
    // Every node's masks share the same k embeddings; position and context make them differ.
    if (carriers > 0)
      b.embeds = masks_.to(embedding_.scalar_type()).repeat({carriers, 1});  // [carriers * k, hidden]
  }
  return b;
}

void MaskProbeDrafter::observe(const StepOutcome& outcome) {
  const int64_t k = options_.num_masks;
  if (!outcome.new_tokens.empty()) next_root_ = outcome.new_tokens.back();
  const int64_t last = outcome.path.back();
  // The masks the next tree reads: the last accepted node's, else (planned masks) those of its
  // nearest masked ancestor, `shift` nodes up, from m_{shift+1} on. A replaced block ran without its
  // masks: no candidates this time.
  core::MaskSource source;
  if (!outcome.block_replaced) source = core::mask_source(outcome.path, mask_input_of_node_, k);
  const int64_t first = source.first, shift = source.shift;
  have_candidates_ = false;
  if (first >= 0 && !outcome.finished && options_.dynamic_tree && !outcome.new_tokens.empty()) {
    // The masks predicted depths 1..k - shift after the bonus token, the next root. The tree is
    // expanded where the logits are, without reading anything back (a GPU kernel there); token ids
    // below 2^53 survive the float64 packing exactly.
    tree_root_ = outcome.new_tokens.back();
    at::Tensor root = at::scalar_tensor(tree_root_, at::kLong).to(outcome.logits.device());
    auto [tokens, parents, probs, num_nodes] = ops::dispatch::expand_draft_tree(
        outcome.logits.narrow(0, first + shift, k - shift), root, tree_nodes(), cand_width_, options_.prune);
    tree_ = at::stack({tokens.to(at::kDouble), parents.to(at::kDouble), probs});  // [3, budget]
    have_candidates_ = true;
  } else if (first >= 0 && shift == 0 && !outcome.finished) {
    // The accepted node's masks predicted depths 1..k after the bonus token.
    at::Tensor probs = outcome.logits.narrow(0, first, k).to(at::kFloat).softmax(-1);  // [k, vocab]
    auto top = probs.topk(cand_width_, -1);
    at::Tensor p = std::get<0>(top).reshape({-1});  // [k * m]
    if (uses_bank()) {
      // The target's distribution at the accepted node (the one the next root came from): its
      // top-1 probability and entropy ride along with the candidates in the same read.
      at::Tensor base = outcome.logits[last].to(at::kFloat).softmax(-1);                     // [vocab]
      p = at::cat({p, base.max().unsqueeze(0), at::special_entr(base).sum().unsqueeze(0)});  // [k * m + 2]
    }
    // One read: the candidates' ids (exact in float64 below 2^53), then their probabilities (and features).
    const int64_t km = std::get<1>(top).numel();
    at::Tensor both = read_as_double({std::get<1>(top), p});
    const double* d = both.data_ptr<double>();  // [km ids | km probs (| top1, entropy)]
    cand_tokens_.resize(static_cast<size_t>(km));
    cand_probs_.resize(static_cast<size_t>(km));
    for (int64_t i = 0; i < km; ++i) {
      cand_tokens_[i] = static_cast<int64_t>(d[i]);
      cand_probs_[i] = static_cast<float>(d[km + i]);
    }
    have_candidates_ = true;
    if (uses_bank()) update_features(outcome, d[2 * km], d[2 * km + 1]);
  }
  // m <- m + lambda (E[t] - m), once per generated token, in generation order.
  const float lam = static_cast<float>(options_.mask_lambda);
  if (lam > 0.0f && !outcome.new_tokens.empty()) {
    at::Tensor ids = at::tensor(outcome.new_tokens, at::kLong).to(embedding_.device());
    at::Tensor e = embedding_.index_select(0, ids).to(at::kFloat);  // [n_new, hidden]
    for (int64_t i = 0; i < e.size(0); ++i) masks_.add_(e[i].unsqueeze(0) - masks_, lam);
  }
}

void MaskProbeDrafter::update_features(const StepOutcome& outcome, double top1, double entropy) {
  const int64_t k = options_.num_masks;
  // EAGLE-2's path value down the drafter's greedy chain: p_target(top-1) * prod_d q_d(top-1).
  double path_value = top1;
  for (int64_t d = 0; d < k; ++d) path_value *= static_cast<double>(cand_probs_[d * cand_width_]);
  const double accepted = static_cast<double>(outcome.path.size()) - 1.0;
  features_.update(top1, path_value, entropy, accepted, options_.ema);
  current_tree_ = options_.policy.choose(features_.score(options_.feature), current_tree_);
  if (options_.record) {
    // The next root sits right after the accepted path: prefix + committed chain + accepted drafts.
    log_positions_.push_back(outcome.prefix_len + outcome.path.front() +
                             static_cast<int64_t>(outcome.path.size()));
    log_tokens_.insert(log_tokens_.end(), cand_tokens_.begin(), cand_tokens_.end());
    log_features_.push_back(features_);
    log_trees_.push_back(current_tree_);
  }
}

}  // namespace mtprobe
