#include "drafters/prompt_lookup.h"

#include <algorithm>

#include "core/ngram.h"

namespace mtprobe {

PromptLookupDrafter::PromptLookupDrafter(PromptLookupOptions options) : options_(options) {
  TORCH_CHECK_VALUE(options_.num_tokens >= 1, "num_tokens must be >= 1, got ", options_.num_tokens);
  TORCH_CHECK_VALUE(options_.max_ngram_size >= 1, "max_ngram_size must be >= 1, got ",
                    options_.max_ngram_size);
}

void PromptLookupDrafter::begin(const at::Tensor& prompt) {
  at::Tensor p = prompt.to(at::kCPU, at::kLong).contiguous();
  history_.assign(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
}

DraftBlock PromptLookupDrafter::propose(const at::Tensor& committed, int64_t prefix_len,
                                        const StepLimits& limits) {
  const int64_t c = committed.size(0);
  // Drafts past the tokens still wanted, the budget or the context are wasted work.
  const int64_t depth = std::min({options_.num_tokens, limits.tokens_left - 1, limits.max_depth,
                                  c == 1 ? limits.budget - 1 : options_.num_tokens});
  std::vector<int64_t> chain(static_cast<size_t>(std::max<int64_t>(depth, 0)));
  const int64_t n = depth > 0 ? core::prompt_lookup(history_.data(), static_cast<int64_t>(history_.size()),
                                                    options_.max_ngram_size, depth, chain.data())
                              : 0;
  chain.resize(static_cast<size_t>(n));
  std::vector<int64_t> parents(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) parents[j] = j - 1;  // one chain below the last committed token
  (void)prefix_len;
  return token_block(committed, chain, parents);
}

void PromptLookupDrafter::observe(const StepOutcome& outcome) {
  history_.insert(history_.end(), outcome.new_tokens.begin(), outcome.new_tokens.end());
}

}  // namespace mtprobe
