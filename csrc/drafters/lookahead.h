// Lookahead decoding (LADE, Fu et al. 2024; seed 001 App. F): each forward runs one Jacobi
// iteration of a window of future tokens and, in the same forward, verifies the n-grams the
// window produced earlier that start with the root (csrc/core/lookahead.h).
//
// Block of a decode step (T <= (L - 1)(W + G), LADE's block complexity):
//     [ root | guess tree: draft nodes | window cells: auxiliary inputs ]
// The guesses hang from the root; the window is a comb from the root as well, so the two branches
// never see each other and one tree mask covers both. The prefill feeds the prompt alone.
//
// Under greedy decoding the guesses are verified by exact match; under sampling by sample matching
// (the guesses are deterministic, q is one-hot), so both are exact. The window always advances with
// the target's argmax, as in LADE.
#pragma once

#include <cstdint>
#include <vector>

#include "core/lookahead.h"
#include "drafters/drafter.h"

namespace mtprobe {

struct LookaheadOptions {
  int64_t ngram_size = 4;         // L, the n-gram size (levels of the window + 1)
  int64_t window = 5;             // W, future positions per level
  int64_t guess_set_size = 5;     // G, n-grams kept (and verified) per key token
  bool pool_from_prompt = false;  // also pool the n-grams of the prompt and of the output text
};

class LookaheadDrafter : public Drafter {
 public:
  explicit LookaheadDrafter(LookaheadOptions options);

  std::string name() const override { return "lookahead"; }
  void begin(const at::Tensor& prompt) override;
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override;
  void observe(const StepOutcome& outcome) override;

  // (L - 1)(W + G): the most inputs one decode step takes.
  int64_t block_complexity() const {
    return (options_.ngram_size - 1) * (options_.window + options_.guess_set_size);
  }
  const core::LookaheadPool& pool() const { return pool_; }
  const core::LookaheadWindow& window() const { return window_; }

 private:
  void pool_text_ngram();  // the n-gram ending at history_'s last token

  LookaheadOptions options_;
  core::LookaheadPool pool_;
  core::LookaheadWindow window_;
  std::vector<int64_t> history_;  // prompt + output, kept only with pool_from_prompt
  int64_t root_ = -1;             // the root token of the step in flight
  int64_t window_offset_ = -1;    // block index of the first window cell; -1: no window this step
  bool prefill_ = true;
};

}  // namespace mtprobe
