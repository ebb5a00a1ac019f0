#include "drafters/auto.h"

#include <algorithm>
#include <utility>

namespace mtprobe {

namespace {
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

DraftBlock plain_block(const at::Tensor& committed) { return token_block(committed, {}, {}); }
}  // namespace

AutoDrafter::AutoDrafter(std::vector<std::shared_ptr<Drafter>> children, core::CostTable cost,
                         AutoOptions options)
    : children_(std::move(children)), cost_(std::move(cost)), options_(options) {
  TORCH_CHECK_VALUE(!children_.empty(), "the scheduling drafter needs at least one drafter to choose from");
  for (size_t i = 0; i < children_.size(); ++i)
    TORCH_CHECK_VALUE(children_[i] != nullptr, "drafter ", i, " of the scheduling drafter is None");
  TORCH_CHECK_VALUE(!cost_.empty(), "the scheduling drafter needs a forward-cost table");
  TORCH_CHECK_VALUE(options_.explore_every >= 1, "explore_every must be >= 1, got ", options_.explore_every);
  TORCH_CHECK_VALUE(options_.budgets.empty() || options_.budgets.size() == children_.size(), "budgets has ",
                    options_.budgets.size(), " entries for ", children_.size(),
                    " drafters; give one block complexity per drafter, or none");
  for (size_t i = 0; i < options_.budgets.size(); ++i)
    TORCH_CHECK_VALUE(options_.budgets[i] >= 1, "budgets[", i, "] = ", options_.budgets[i],
                      "; a block complexity is at least 1");
  stats_.assign(children_.size(), core::AcceptanceStats(options_.decay));  // validates decay
}

bool AutoDrafter::wants_hidden_states() const {
  return std::any_of(children_.begin(), children_.end(),
                     [](const auto& c) { return c->wants_hidden_states(); });
}

void AutoDrafter::begin(const at::Tensor& prompt) {
  for (auto& child : children_) child->begin(prompt);
  stats_.assign(children_.size(), core::AcceptanceStats(options_.decay));
  idle_.assign(children_.size(), 0);
  walks_.assign(children_.size(), {});
  history_.clear();
  choices_.clear();
  prefill_ = true;
  draft_seconds_ = schedule_seconds_ = 0.0;
}

DraftBlock AutoDrafter::propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) {
  auto t0 = Clock::now();
  proposals_.assign(children_.size(), Proposal{});
  for (size_t i = 0; i < children_.size(); ++i) {
    StepLimits own = limits;
    if (!options_.budgets.empty()) own.budget = std::min(limits.budget, options_.budgets[i]);
    proposals_[i].block = children_[i]->propose(committed, prefix_len, own);
  }
  draft_seconds_ += seconds_since(t0);

  t0 = Clock::now();
  const int64_t c = committed.size(0);
  current_ = ScheduleChoice{-1, c, 0};
  whole_ = false;
  if (prefill_) {  // the prompt runs alone; every child sees a replaced block
    schedule_seconds_ += seconds_since(t0);
    return plain_block(committed);
  }
  core::Cut best;
  best.inputs = c;
  best.score = 1.0 / cost_.relative(static_cast<double>(c), static_cast<double>(prefix_len));
  int64_t explore = -1;
  for (size_t i = 0; i < children_.size(); ++i) {
    Proposal& p = proposals_[i];
    const DraftBlock& b = p.block;
    const int64_t n = b.num_nodes, T = b.num_inputs();
    const std::string who = "drafter " + children_[i]->name() + " (in the scheduling drafter): ";
    TORCH_CHECK_VALUE(b.num_committed == c && n >= c && n <= T && b.tokens.defined() && b.tokens.dim() == 1 &&
                          b.tokens.size(0) >= n && b.tokens.scalar_type() == at::kLong,
                      who, "malformed block (num_committed ", b.num_committed, ", num_nodes ", n, ", inputs ",
                      T, ")");
    // Host copies of the draft tree: the cut is made and the counterfactual walked on the host. After
    // the prefill the committed token is history_'s last, and a child that built its drafts on the
    // host hands them over (DraftBlock::host_drafts): no read then.
    const bool on_host = c == 1 && !history_.empty() && b.drafts_on_host(committed);
    if (on_host) {
      p.tokens.assign(1, history_.back());
      p.tokens.insert(p.tokens.end(), b.host_drafts.begin(), b.host_drafts.begin() + (n - c));
    } else {
      at::Tensor tok = b.tokens.narrow(0, 0, n).to(at::kCPU).contiguous();
      p.tokens.assign(tok.data_ptr<int64_t>(), tok.data_ptr<int64_t>() + n);
    }
    p.parents.assign(static_cast<size_t>(n - c), -1);
    for (int64_t k = c; k < n; ++k) {
      const int64_t parent = b.parents[k];
      TORCH_CHECK_VALUE(parent >= c - 1 && parent < k, who, "draft node ", k, " has parent ", parent,
                        "; it must be an earlier node or the last committed input ", c - 1);
      p.parents[k - c] = parent == c - 1 ? -1 : parent - c;
    }
    const int64_t extra = T - n;
    if (extra > 0 && idle_[i] >= options_.explore_every && explore < 0) explore = static_cast<int64_t>(i);
    const core::Cut cut = core::best_cut(stats_[i], cost_, c, p.parents, extra, !b.draft_probs.has_value(),
                                         static_cast<double>(prefix_len));
    if (cut.score > best.score) {
      best = cut;
      current_ = ScheduleChoice{static_cast<int64_t>(i), cut.inputs, cut.nodes};
      kept_ = cut.kept;
    }
  }
  if (explore >= 0) {  // its auxiliary inputs must run for it to draft at all
    const Proposal& p = proposals_[explore];
    current_ = ScheduleChoice{explore, p.block.num_inputs(), p.block.num_nodes - c};
  }
  for (size_t i = 0; i < children_.size(); ++i) ++idle_[i];

  DraftBlock out;
  if (current_.child < 0) {
    out = plain_block(committed);
  } else {
    Proposal& p = proposals_[current_.child];
    if (current_.nodes == p.block.num_nodes - c) {
      out = p.block;  // whole, auxiliary inputs included
      whole_ = true;
      idle_[current_.child] = 0;
    } else {
      // The cut: the kept draft nodes (a subtree), in their order, parents renumbered.
      std::vector<int64_t> tokens, parents, index(p.tokens.size(), -1);
      for (int64_t j : kept_) {
        const int64_t k = c + j, parent = p.block.parents[k];
        // best_cut keeps a subtree, so every kept node's parent was kept before it.
        TORCH_CHECK(parent == c - 1 || index[parent] >= 0, "the scheduler's cut of drafter ",
                    children_[current_.child]->name(), " kept node ", k, " without its parent ", parent);
        index[k] = static_cast<int64_t>(tokens.size());
        tokens.push_back(p.tokens[k]);
        parents.push_back(parent == c - 1 ? -1 : index[parent]);
      }
      out = token_block(committed, tokens, parents);
    }
  }
  schedule_seconds_ += seconds_since(t0);
  return out;
}

bool AutoDrafter::advance(Walk& walk, core::AcceptanceStats& stats) const {
  const int64_t n = static_cast<int64_t>(walk.tokens.size());
  while (walk.start + walk.depth < static_cast<int64_t>(history_.size())) {
    // The reached node's children, in the drafter's order, each judged against the next token.
    const int64_t truth = history_[walk.start + walk.depth];
    int64_t next = -1, rank = 0;
    for (int64_t k = walk.node + 1; k < n; ++k) {
      if (walk.parents[k] != walk.node) continue;
      const bool hit = next < 0 && walk.tokens[k] == truth;
      stats.record(walk.depth + 1, rank++, hit);
      if (hit) next = k;
    }
    if (next < 0) return false;  // a miss, or a leaf
    walk.node = next;
    ++walk.depth;
  }
  return true;
}

void AutoDrafter::observe(const StepOutcome& outcome) {
  auto t0 = Clock::now();
  const int64_t start = static_cast<int64_t>(history_.size());  // where this step's tokens go
  history_.insert(history_.end(), outcome.new_tokens.begin(), outcome.new_tokens.end());
  if (!prefill_) {
    for (size_t i = 0; i < children_.size(); ++i) {
      stats_[i].step();
      const Proposal& p = proposals_[i];
      const int64_t c = p.block.num_committed;
      std::vector<Walk>& walks = walks_[i];
      // A sampled draft (draft_probs) is accepted with min(1, p/q), which matching another block's
      // continuation (probability p) would under-rate: its tree is judged only when it ran, where
      // rejection sampling makes "matched the continuation" and "accepted" the same event.
      const bool ran = whole_ && current_.child == static_cast<int64_t>(i);
      if (!p.parents.empty() && (ran || !p.block.draft_probs.has_value()))
        walks.push_back(Walk{std::vector<int64_t>(p.tokens.begin() + c, p.tokens.end()), p.parents, start});
      walks.erase(std::remove_if(walks.begin(), walks.end(), [&](Walk& w) { return !advance(w, stats_[i]); }),
                  walks.end());
    }
    choices_.push_back(current_);
  }
  schedule_seconds_ += seconds_since(t0);

  t0 = Clock::now();
  for (size_t i = 0; i < children_.size(); ++i) {
    StepOutcome o = outcome;
    o.block_replaced = outcome.block_replaced || !(whole_ && current_.child == static_cast<int64_t>(i));
    children_[i]->observe(o);
  }
  draft_seconds_ += seconds_since(t0);
  prefill_ = false;
}

}  // namespace mtprobe
