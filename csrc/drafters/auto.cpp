#include "drafters/auto.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace mtprobe {

namespace {
using Clock = AutoDrafter::Clock;

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
  TORCH_CHECK_VALUE(options_.own_forwards.empty() || options_.own_forwards.size() == children_.size(),
                    "own_forwards has ", options_.own_forwards.size(), " entries for ", children_.size(),
                    " drafters; give one flag per drafter, or none");
  TORCH_CHECK_VALUE(options_.carried_stats.empty() || options_.carried_stats.size() == children_.size(),
                    "carried_stats has ", options_.carried_stats.size(), " entries for ", children_.size(),
                    " drafters; give one per drafter, or none");
  TORCH_CHECK_VALUE(options_.carried_costs.empty() || options_.carried_costs.size() == children_.size(),
                    "carried_costs has ", options_.carried_costs.size(), " entries for ", children_.size(),
                    " drafters; give one per drafter, or none");
  for (size_t i = 0; i < options_.carried_costs.size(); ++i)
    TORCH_CHECK_VALUE(std::isfinite(options_.carried_costs[i]) && options_.carried_costs[i] >= 0,
                      "carried_costs[", i, "] = ", options_.carried_costs[i],
                      "; seconds per draft are finite and >= 0 (0: none)");
  begin_stats();
}

void AutoDrafter::begin_stats() {
  stats_.assign(children_.size(), core::AcceptanceStats(options_.decay));  // validates decay
  draft_costs_.assign(children_.size(), 0.0);
  for (size_t i = 0; i < children_.size(); ++i) {
    if (!own_forwards(i)) continue;
    if (!options_.carried_stats.empty()) stats_[i] = options_.carried_stats[i];
    if (!options_.carried_costs.empty()) draft_costs_[i] = options_.carried_costs[i];
  }
}

bool AutoDrafter::wants_hidden_states() const {
  return std::any_of(children_.begin(), children_.end(),
                     [](const auto& c) { return c->wants_hidden_states(); });
}

void AutoDrafter::begin(const at::Tensor& prompt) {
  for (auto& child : children_) child->begin(prompt);
  begin_stats();
  idle_.assign(children_.size(), 0);
  walks_.assign(children_.size(), {});
  history_.clear();
  choices_.clear();
  prefill_ = true;
  held_ = false;
  draft_seconds_ = schedule_seconds_ = 0.0;
  timing_ = false;
  overhead_ = 0.0;
  overhead_samples_ = 0;
}

void AutoDrafter::take(size_t i, const at::Tensor& committed) {
  Proposal& p = proposals_[i];
  const DraftBlock& b = p.block;
  const int64_t c = committed.size(0), n = b.num_nodes, T = b.num_inputs();
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
}

std::pair<int64_t, int64_t> AutoDrafter::forecast(const at::Tensor& committed, int64_t prefix_len,
                                                  const StepLimits& limits, double best_score) const {
  if (committed.size(0) != 1) return {-1, 0};  // a chain hangs from one committed token
  int64_t chosen = -1, drafts = 0;
  double score = best_score;
  for (size_t i = 0; i < children_.size(); ++i) {
    if (!own_forwards(i)) continue;
    const int64_t budget =
        options_.budgets.empty() ? limits.budget : std::min(limits.budget, options_.budgets[i]);
    const int64_t most = std::min({budget - 1, limits.tokens_left - 1, limits.max_depth});
    if (most < 1) continue;
    if (draft_costs_[i] <= 0) return {static_cast<int64_t>(i), most};  // unmeasured: explore, every draft
    const core::ChainForecast f = core::forecast_chain(stats_[i], cost_, draft_costs_[i], most,
                                                       static_cast<double>(prefix_len), step_overhead());
    if (idle_[i] >= options_.explore_every) return {static_cast<int64_t>(i), std::max<int64_t>(1, f.drafts)};
    if (f.drafts > 0 && f.score > score) {
      chosen = static_cast<int64_t>(i);
      drafts = f.drafts;
      score = f.score;
    }
  }
  return {chosen, drafts};
}

DraftBlock AutoDrafter::propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) {
  auto t0 = Clock::now();
  if (timing_ && !options_.batch_overhead) {  // the last step, less its forward's profiled seconds and drafts
    const double sample =
        std::max(0.0, std::chrono::duration<double>(t0 - step_start_).count() - step_forward_ - step_drafts_);
    overhead_ = overhead_samples_++ == 0 ? sample : 0.9 * overhead_ + 0.1 * sample;
  }
  step_start_ = t0;
  timing_ = false;
  step_drafts_ = 0.0;
  proposals_.assign(children_.size(), Proposal{});
  held_ = !prefill_ && options_.batch_drafting && !options_.batch_drafting->allowed();
  if (held_) {  // the batch decodes plainly this phase: no child is asked
    current_ = ScheduleChoice{-1, committed.size(0), 0};
    whole_ = false;
    step_forward_ = cost_.time(static_cast<double>(committed.size(0)), static_cast<double>(prefix_len));
    timing_ = true;
    schedule_seconds_ += seconds_since(t0);
    return plain_block(committed);
  }
  for (size_t i = 0; i < children_.size(); ++i) {
    if (own_forwards(i)) continue;  // asked below, if at all
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
  const double context = static_cast<double>(prefix_len);
  best.score = 1.0 / cost_.relative(static_cast<double>(c), context, step_overhead());
  int64_t explore = -1;
  for (size_t i = 0; i < children_.size(); ++i) {
    if (own_forwards(i)) continue;
    take(i, committed);
    const Proposal& p = proposals_[i];
    const int64_t extra = p.block.num_inputs() - p.block.num_nodes;
    if (extra > 0 && idle_[i] >= options_.explore_every && explore < 0) explore = static_cast<int64_t>(i);
    const core::Cut cut = core::best_cut(stats_[i], cost_, c, p.parents, extra,
                                         !p.block.draft_probs.has_value(), context, step_overhead());
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
  // A child with own forwards drafts only when its forecast beats what is in hand (or explores).
  const auto [asked, drafts] =
      explore >= 0 ? std::pair<int64_t, int64_t>{-1, 0} : forecast(committed, prefix_len, limits, best.score);
  schedule_seconds_ += seconds_since(t0);
  if (asked >= 0) {
    t0 = Clock::now();
    StepLimits own = limits;
    own.budget = 1 + drafts;  // the chain alone: its siblings are not forecast
    proposals_[asked].block = children_[asked]->propose(committed, prefix_len, own);
    const double seconds = seconds_since(t0);
    draft_seconds_ += seconds;
    step_drafts_ = seconds;
    take(static_cast<size_t>(asked), committed);
    const Proposal& p = proposals_[asked];
    const int64_t made = p.block.num_nodes - c;
    if (made > 0) {  // seconds per draft: the first measurement, then halfway to each new one
      const double per = seconds / static_cast<double>(made);
      double& cost = draft_costs_[asked];
      cost = cost <= 0 ? per : 0.5 * (cost + per);
    }
    current_ = ScheduleChoice{asked, p.block.num_inputs(), made};
  }
  t0 = Clock::now();
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
  step_forward_ = cost_.time(static_cast<double>(out.num_inputs()), context);
  timing_ = true;
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
    if (options_.batch_drafting)
      options_.batch_drafting->add_tokens(static_cast<int64_t>(outcome.new_tokens.size()));
    for (size_t i = 0; i < children_.size(); ++i) {
      const bool ran = whole_ && current_.child == static_cast<int64_t>(i);
      // A child with own forwards decays on its own steps; none while the batch holds its rows back (their
      // counts wait for the next drafting phase rather than fading without a proposal to learn from).
      if (!held_ && (ran || !own_forwards(i))) stats_[i].step();
      const Proposal& p = proposals_[i];
      const int64_t c = p.block.num_committed;
      std::vector<Walk>& walks = walks_[i];
      // A sampled draft (draft_probs) is accepted with min(1, p/q), which matching another block's
      // continuation (probability p) would under-rate: its tree is judged only when it ran, where
      // rejection sampling makes "matched the continuation" and "accepted" the same event.
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
    // While the batch holds its rows back, a child that can learns the step's text alone: STAND's store
    // would otherwise take the softmax and top-k of the vocabulary every step, on cores the batch shares.
    if (held_ && children_[i]->learns_from_text()) o.logits = at::Tensor();
    children_[i]->observe(o);
  }
  draft_seconds_ += seconds_since(t0);
  prefill_ = false;
}

}  // namespace mtprobe
