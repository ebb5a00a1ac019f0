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
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/schedule.h"
#include "drafters/drafter.h"

namespace mtprobe {

struct AutoOptions {
  double decay = 0.95;         // per-step decay of the acceptance counts
  int64_t explore_every = 16;  // steps after which a child with auxiliary inputs runs once anyway
  // [children] or empty: the most inputs each child may propose (its own block complexity). The
  // loop's budget is the largest of them; without this every child would draft up to it.
  std::vector<int64_t> budgets;
};

// One decode step's choice.
struct ScheduleChoice {
  int64_t child = -1;  // index of the child whose block ran; -1: plain decoding
  int64_t inputs = 1;  // T of the forward
  int64_t nodes = 0;   // draft nodes verified (the cut keeps the most probable ones)
};

class AutoDrafter : public Drafter {
 public:
  AutoDrafter(std::vector<std::shared_ptr<Drafter>> children, core::CostTable cost, AutoOptions options);

  std::string name() const override { return "auto"; }
  void begin(const at::Tensor& prompt) override;
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override;
  void observe(const StepOutcome& outcome) override;
  bool wants_hidden_states() const override;

  const std::vector<ScheduleChoice>& choices() const { return choices_; }
  const std::vector<core::AcceptanceStats>& stats() const { return stats_; }
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
  // Walks `walk` as far as history_ goes, recording each verdict; false once it can go no further.
  bool advance(Walk& walk, core::AcceptanceStats& stats) const;

  std::vector<std::shared_ptr<Drafter>> children_;
  core::CostTable cost_;
  AutoOptions options_;
  std::vector<core::AcceptanceStats> stats_;  // [children]
  std::vector<int64_t> idle_;                 // [children]: steps since the child's block last ran whole
  std::vector<Proposal> proposals_;           // [children]: this step's
  std::vector<std::vector<Walk>> walks_;      // [children][walks still waiting for tokens]
  std::vector<int64_t> history_;              // every token decoded so far (prefill's included)
  std::vector<ScheduleChoice> choices_;       // one per decode step
  ScheduleChoice current_;
  std::vector<int64_t> kept_;  // [current_.nodes]: the chosen child's kept draft nodes, ascending
  bool whole_ = false;         // the chosen child's block ran uncut
  bool prefill_ = true;
  double draft_seconds_ = 0.0, schedule_seconds_ = 0.0;
};

}  // namespace mtprobe
