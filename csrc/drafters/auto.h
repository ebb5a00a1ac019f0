// The scheduling drafter: several drafters propose every step, and the step verifies the block
// (and the cut of it) with the most expected tokens per second under the measured forward cost,
// or nothing beyond the committed token when no draft pays for itself (csrc/core/schedule.h).
//
// Every child proposes from its own state; one block runs; then every child observes the step.
// A child whose block did not run whole sees outcome.block_replaced = true: the path, new tokens
// and the logits of the path's rows belong to the block that ran, and its own auxiliary inputs did
// not run (every drafter already handles this for the loop's non-finite fallback).
//
// The statistics behind the choice are counterfactual: each child's proposed tree is walked along
// the real continuation, whether it ran or not, and its acceptance counts learn from every step.
// A walk that outlives its step (a plain step tells one token of the continuation) waits for the
// later steps' tokens: deep nodes are judged even while the scheduler verifies little. Sampled
// drafts (a block with draft_probs) are the exception: they are judged only on steps they ran.
//
// Between drafters whose best cuts score the same, the earlier drafter wins.
//
// A child whose block carries auxiliary inputs (probing's mask tokens, lookahead's window) drafts
// only after its inputs ran; one that has not run for `explore_every` steps runs whole once.
//
// A child that runs forwards of its own to propose (a draft model; AutoOptions::own_forwards) is not
// asked every step: its chain is forecast (core::forecast_chain) from its pooled acceptance and the
// measured seconds of its drafts, and it proposes only when the forecast beats the best block in hand
// (or to explore: at its first step, with every draft it may make, and after `explore_every` idle
// steps). Its block then runs whole, its chain as long as the forecast's k (no siblings). Its drafts
// are timed as it makes them; the first measurement sets the cost, later ones move it halfway. Its
// counts decay only on steps it ran (its chain's verdicts come from those alone), and a generation
// can start from what an earlier one measured (AutoOptions::carried_stats, carried_costs): how well a
// draft model agrees with the target, and what it costs here, do not change with the text much.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/schedule.h"
#include "drafters/drafter.h"
#include "runtime/batch_drafting.h"
#include "runtime/shared_seconds.h"

namespace mtprobe {

struct AutoOptions {
  double decay = 0.95;         // per-step decay of the acceptance counts
  int64_t explore_every = 16;  // steps after which a child with auxiliary inputs runs once anyway
  // [children] or empty: the most inputs each child may propose (its own block complexity). The
  // loop's budget is the largest of them; without this every child would draft up to it.
  std::vector<int64_t> budgets;
  // [children] or empty: which children run forwards of their own to propose (see above).
  std::vector<bool> own_forwards;
  // [children] or empty: what an earlier generation measured of each child with own forwards, its
  // acceptance counts and seconds per draft (0: none), where each generation starts from.
  std::vector<core::AcceptanceStats> carried_stats;
  std::vector<double> carried_costs;
  // For a row of a batch decoded together: the batch step's overhead as BatchedForward measures it, priced
  // instead of a measurement of the row's own (or null: measured here). A row's wall time between steps
  // includes its waits on the other rows' drafts and blocks; priced as its own overhead that made every row
  // draft because the others did (a batch of 8 then drafted whole chains, 3.4 s against 2.4 s plainly).
  std::shared_ptr<SharedSeconds> batch_overhead;
  // For a row of a batch decoded together: whether the batch lets its rows draft this phase (or null:
  // always). A step it does not is plain, no child asked; every step's tokens are reported to it
  // (runtime/batch_drafting.h).
  std::shared_ptr<BatchDrafting> batch_drafting;
};

// One decode step's choice.
struct ScheduleChoice {
  int64_t child = -1;  // index of the child whose block ran; -1: plain decoding
  int64_t inputs = 1;  // T of the forward
  int64_t nodes = 0;   // draft nodes verified (the cut keeps the most probable ones)
};

class AutoDrafter : public Drafter {
 public:
  using Clock = std::chrono::steady_clock;

  AutoDrafter(std::vector<std::shared_ptr<Drafter>> children, core::CostTable cost, AutoOptions options);

  std::string name() const override { return "auto"; }
  void begin(const at::Tensor& prompt) override;
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override;
  void observe(const StepOutcome& outcome) override;
  bool wants_hidden_states() const override;

  const std::vector<ScheduleChoice>& choices() const { return choices_; }
  const std::vector<core::AcceptanceStats>& stats() const { return stats_; }
  // [children]: measured seconds per draft of the children with own forwards (0: not yet measured).
  const std::vector<double>& draft_costs() const { return draft_costs_; }
  // Seconds a decode step spends besides its forward's profiled time (verification, the drafters',
  // the loop's and Python's work): measured between proposals, a moving average; each block's cost
  // includes it (core::best_cut), so blocks that gain more per step are worth more.
  double step_overhead() const {
    return options_.batch_overhead ? options_.batch_overhead->get() : overhead_;
  }
  double draft_seconds() const { return draft_seconds_; }        // children's propose and observe
  double schedule_seconds() const { return schedule_seconds_; }  // the scheduler's own work

 private:
  struct Proposal {
    DraftBlock block;
    std::vector<int64_t> tokens;   // [num_nodes] on the host
    std::vector<int64_t> parents;  // [draft nodes]: parent among the draft nodes, -1 the root
  };
  // A draft tree being walked along the continuation: its node at depth d guesses history_[start + d - 1].
  struct Walk {
    std::vector<int64_t> tokens;   // [draft nodes]
    std::vector<int64_t> parents;  // [draft nodes]
    int64_t start = 0;
    int64_t node = -1;  // the deepest node reached; -1: the root
    int64_t depth = 0;  // its depth
  };
  // Fresh counts, and for the children with own forwards the carried ones (AutoOptions).
  void begin_stats();
  // Checks child i's block and copies its draft tree to the host (proposals_[i].tokens, parents).
  void take(size_t i, const at::Tensor& committed);
  // The child with own forwards to ask this step and its chain length, or {-1, 0}.
  std::pair<int64_t, int64_t> forecast(const at::Tensor& committed, int64_t prefix_len,
                                       const StepLimits& limits, double best_score) const;
  bool own_forwards(size_t i) const { return !options_.own_forwards.empty() && options_.own_forwards[i]; }
  // Walks `walk` as far as history_ goes, recording each verdict; false once it can go no further.
  bool advance(Walk& walk, core::AcceptanceStats& stats) const;

  std::vector<std::shared_ptr<Drafter>> children_;
  core::CostTable cost_;
  AutoOptions options_;
  std::vector<core::AcceptanceStats> stats_;  // [children]
  std::vector<int64_t> idle_;                 // [children]: steps since the child's block last ran whole
  std::vector<double> draft_costs_;           // [children]: seconds per draft, own-forward children
  std::vector<Proposal> proposals_;           // [children]: this step's
  std::vector<std::vector<Walk>> walks_;      // [children][walks still waiting for tokens]
  std::vector<int64_t> history_;              // every token decoded so far (prefill's included)
  std::vector<ScheduleChoice> choices_;       // one per decode step
  ScheduleChoice current_;
  std::vector<int64_t> kept_;  // [current_.nodes]: the chosen child's kept draft nodes, ascending
  bool whole_ = false;         // the chosen child's block ran uncut
  bool held_ = false;  // the step in flight is plain because the batch held its rows back (no child asked)
  bool prefill_ = true;
  double draft_seconds_ = 0.0, schedule_seconds_ = 0.0;
  // The step in flight, timed from its propose to the next: its forward's profiled seconds and the
  // seconds its own-forward child drafted (neither is overhead).
  Clock::time_point step_start_;
  bool timing_ = false;
  double step_forward_ = 0.0, step_drafts_ = 0.0;
  double overhead_ = 0.0;
  int64_t overhead_samples_ = 0;
};

}  // namespace mtprobe
