// Prompt lookup (n-gram matching over the token history). Torch-free, C++17.
//
// The draft is what followed an earlier occurrence of the context's last n-gram: for n from
// max_ngram down to 1, the earliest occurrence of seq[len-n:len] that is followed by at least one
// token; up to max_tokens of the tokens after it form a chain. This is the rule of transformers'
// prompt lookup (PromptLookupCandidateGenerator), so the two draft the same chains.
//
// Example: seq = [5 6 7 8 5 6], max_ngram = 2: the 2-gram [5 6] occurs at 0, followed by [7 8 5 6];
// with max_tokens = 3 the draft is [7 8 5].
#pragma once

#include <cstdint>

namespace mtprobe::core {

// Writes the draft into out (capacity max_tokens) and returns its length (0: no match).
int64_t prompt_lookup(const int64_t* seq, int64_t len, int64_t max_ngram, int64_t max_tokens, int64_t* out);

}  // namespace mtprobe::core
