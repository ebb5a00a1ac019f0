// Draft-model speculative decoding (seed 004; Leviathan et al. 2023, Chen et al. 2023): a smaller
// model with its own KV cache drafts a chain of K tokens, one forward per token, and the target
// verifies the chain in one forward. With top_branches = b > 1 the draft is a tree: the chain plus
// b - 1 more children of the root from the first forward's distribution (its next b - 1 best tokens
// under greedy decoding; b - 1 more independent samples of q_1 under sampling, which SpecInfer's
// multi-draft rule in verify_rejection keeps exact). The siblings cost no draft forward. Greedy drafts are
// the draft model's argmax; under sampling the drafts are samples of its processed distribution q, handed to
// verification as draft_probs so that rejection sampling keeps the output distributed exactly as the
// target's.
//
// The draft model is reached through the same forward callback as the target (an HFAdapter over
// the draft model). Its cache holds a prefix of the sequence: after a step that accepted a of
// the K drafts, the first len + min(a, K - 1) entries are still right (the K-th draft was never
// fed), so the next step feeds only the tokens after them.
//
// Under greedy decoding a chain can end early: a draft whose top-2 logit margin falls in a class of margins
// that has matched the target's token less than core::MarginStats::stop_below() of the time ends it (the
// drafts after a near-tie the draft resolves unlike the target would be wasted forwards). Each verified
// chain's drafts up to its first miss are counted into those classes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "core/schedule.h"
#include "drafters/drafter.h"
#include "runtime/callbacks.h"

namespace mtprobe {

struct DraftModelOptions {
  int64_t num_tokens = 5;    // K, drafts per step (a step feeds the target 1 + K inputs)
  bool do_sample = false;    // sample drafts from q and hand q to verification
  int64_t top_branches = 1;  // b, children of the root: the chain's first token and b - 1 siblings
  // No chain in the loop's prefill block (prefix_len 0): for a draft that takes the target's KV entries
  // and has none before the target's prefill (it could only draft from nothing).
  bool skip_prefill = false;
  // Classes of the draft's top-2 margins (greedy only; none: every chain runs num_tokens), shared with the
  // draft model's other drafters.
  std::shared_ptr<core::MarginStats> margin_stats;
};

class DraftModelDrafter : public Drafter {
 public:
  // forward: the draft model's forward (see ForwardFn); process: the logits processors that shape
  // q (HF's, the same as the target's), or none for raw logits.
  DraftModelDrafter(ForwardFn forward, DraftModelOptions options,
                    std::optional<ProcessFn> process = std::nullopt);

  std::string name() const override { return "draft_model"; }
  void begin(const at::Tensor& prompt) override;
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override;
  void observe(const StepOutcome& outcome) override;

  int64_t draft_forwards() const { return draft_forwards_; }

 private:
  ForwardFn forward_;
  DraftModelOptions options_;
  std::optional<ProcessFn> process_;
  std::vector<int64_t> history_;  // prompt + every generated token (includes the committed chain)
  int64_t cached_ = 0;            // draft KV entries that match history_
  int64_t chain_len_ = 0;         // K of the step in flight (its siblings follow the chain)
  std::vector<double> margins_;   // [chain_len_]: each draft's top-2 logit margin (margin_stats only)
  int64_t draft_forwards_ = 0;
};

}  // namespace mtprobe
