// Prompt lookup decoding (PLD): a chain drafted from an earlier occurrence of the last n-gram
// (csrc/core/ngram.h). Needs only tokens; one chain of up to num_tokens drafts per step, so a
// step feeds 1 + num_tokens inputs.
#pragma once

#include <cstdint>
#include <vector>

#include "drafters/drafter.h"

namespace mtprobe {

struct PromptLookupOptions {
  int64_t num_tokens = 10;     // chain depth (transformers' prompt_lookup_num_tokens)
  int64_t max_ngram_size = 2;  // longest n-gram matched (transformers' max_matching_ngram_size)
};

class PromptLookupDrafter : public Drafter {
 public:
  explicit PromptLookupDrafter(PromptLookupOptions options);

  std::string name() const override { return "prompt_lookup"; }
  void begin(const at::Tensor& prompt) override;
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override;
  void observe(const StepOutcome& outcome) override;
  bool learns_from_text() const override { return true; }

 private:
  PromptLookupOptions options_;
  std::vector<int64_t> history_;  // prompt + every generated token
};

}  // namespace mtprobe
