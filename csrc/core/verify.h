// Greedy verification over a draft tree. Torch-free, C++17.
//
// tokens[i] is the token of tree node i, parents[i] its parent (-1 or an earlier node) and
// target[i] the target model's greedy choice for the token after node i. Starting at `root`,
// walk to the child whose token equals the target's choice; stop when none does. Every
// accepted node is a token the target itself would have produced, so the output is exactly
// greedy decoding; the target's choice after the last accepted node is the bonus token.
#pragma once

#include <cstdint>
#include <string>

namespace mtprobe::core {

// Writes the accepted path [root, ..., last] into path_out (capacity n) and returns its length.
// Among equal-token siblings the lowest index wins (drafters should not emit duplicates).
int64_t verify_greedy(const int64_t* tokens, const int64_t* parents, const int64_t* target, int64_t n,
                      int64_t root, int64_t* path_out);

}  // namespace mtprobe::core
