// STAND (Song et al. 2025; seed 001, App. F): a draft tree grown best-first by cumulative
// probability from an n-gram store of the distributions the target produced so far
// (csrc/core/ngram_store.h). Needs only tokens: every input is a draft node.
//
// What the store learns, and when:
//   - at prefill, for every prompt position i: the prompt's actual next token (one-hot, so that
//     text in the prompt is copied as prompt lookup copies it) and, for the last `prompt_logits`
//     positions (all by default), the target's top-k distribution after prompt[0 : i + 1] (its
//     logits at input i);
//   - after every decode step, the target's top-k distribution after each accepted node (the
//     logits at the root and at every accepted draft).
//
// With a cross-request memory (StandOptions::memory, core::NgramMemory, shared by any number of
// drafters): the tree reads the memory where the per-request store has no key of the length
// looked up, and the step that ends a generation (StepOutcome::finished) folds its committed text,
// prompt + output, into the memory. A generation that never reaches its last step (an exception)
// is not folded.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "core/draft_tree.h"
#include "core/ngram_store.h"
#include "drafters/drafter.h"

namespace mtprobe {

struct StandOptions {
  int64_t max_depth = 10;    // deepest draft (the paper's STAND: depth 10)
  int64_t max_ngram = 3;     // longest n-gram key
  int64_t table_size = 8;    // next tokens kept per key
  int64_t logits_top_k = 8;  // tokens of each stored distribution

  // The cross-request memory (shared with other drafters), or none.
  std::shared_ptr<core::NgramMemory> memory;
  // Whether this drafter folds its finished generation into `memory`. False for all but one of the
  // drafters that share a memory within one generation (an AutoConfig's), or each would fold the same
  // text again and double its counts.
  bool fold_memory = true;
  // The prompt's last positions whose distributions seed the store (none: every one). The others'
  // logits are not read, so the prefill need not compute them; their tokens go in regardless.
  std::optional<int64_t> prompt_logits;
};

class StandDrafter : public Drafter {
 public:
  explicit StandDrafter(StandOptions options);

  std::string name() const override { return "stand"; }
  void begin(const at::Tensor& prompt) override;
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override;
  void observe(const StepOutcome& outcome) override;
  bool learns_from_text() const override { return true; }

  // The tree propose() drafts after the history, as [root, ...] nodes with cumulative scores
  // (the hybrid drafter merges it with probing's tree): at most `budget` drafts, depth <= depth.
  // With a `seed` tree over the same root ([root, ...], as returned here), one best-first tree over
  // the seed's nodes and the store's, the store drafting below seed nodes too (core::SeedTree).
  std::vector<core::DraftNode> tree_nodes(int64_t root_token, int64_t budget, int64_t depth,
                                          const std::vector<core::DraftNode>* seed = nullptr) const;

 private:
  StandOptions options_;
  core::NgramStore store_;
  std::vector<int64_t> history_;  // prompt + every generated token
  bool prefill_ = true;
};

}  // namespace mtprobe
