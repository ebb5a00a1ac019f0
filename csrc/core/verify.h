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

// Rejection sampling over a draft tree rooted at node 0 (Leviathan et al. / Chen et al. for a chain,
// SpecInfer's multi-draft rule for siblings). Node j >= 1 carries a token drawn from the drafter's
// distribution q_j (siblings must be independent draws from one distribution); p_i is the target's
// distribution after node i.
//
// At node i with residual r = p_i, the children c are tried in index order: accept c with
// probability min(1, r[x_c] / q_c[x_c]) (u_c < r[x_c] / q_c[x_c]); on rejection
// r <- normalise(max(r - q_c, 0)) and the next child is tried. When a child is accepted the walk
// moves to it with r = p_c; when none is, the output token is drawn from r (the residual after
// the rejections, or p_i itself at a leaf). Each step's output is then exactly distributed as p_i,
// so the whole output is distributed as the target's own sampling.
//
// Example (a chain, vocab {0, 1}): p_0 = [0.6, 0.4], node 1 drafted x = 1 from q_1 = [0.2, 0.8].
// Accept with probability 0.4 / 0.8 = 0.5; on rejection r = normalise([0.4, 0]) = [1, 0], so the
// token is 0. Overall P(1) = 0.8 * 0.5 = 0.4 and P(0) = 0.6, exactly p_0.
//
//   tokens [n], parents [n]: the tree, parents[0] = -1, parents[j] in [0, j) for j >= 1.
//   p [n, vocab]: target probabilities after each node (rows sum to 1).
//   q [n - 1, vocab]: row j - 1 is the distribution node j's token was drawn from; q[x_j] > 0.
//   uniforms [n + 1] in [0, 1): uniforms[j] decides node j's acceptance, uniforms[n] the last draw.
//   residual [vocab]: scratch.
// Writes the accepted path [0, ...] into path_out (capacity n), the output token after its last
// node into *token_out, and returns the path length.
int64_t verify_rejection(const int64_t* tokens, const int64_t* parents, int64_t n, const float* p,
                         const float* q, int64_t vocab, const double* uniforms, float* residual,
                         int64_t* path_out, int64_t* token_out);

// The token of a draw from the distribution w (non-negative, not necessarily normalised) by
// inverse CDF with u in [0, 1); the last token of positive weight when rounding runs past the end.
int64_t sample_inverse_cdf(const float* w, int64_t vocab, double u);

}  // namespace mtprobe::core
