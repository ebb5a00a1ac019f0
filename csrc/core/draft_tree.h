// Draft-tree construction from per-depth candidate lists (seed 001, section 3.4 and Alg. 1).
// Torch-free, C++17.
//
// With k mask tokens, the masks on the last accepted node give k next-token distributions: depth
// d of the next tree draws from the d-th. The caller passes, for every depth, the top-m tokens of
// that distribution in descending probability (cand_tokens / cand_probs, each [depths * m]).
//
// Static trees [K_1, ..., K_k] use Top-1 expansion (App. D): the root gets K_1 children, and only
// the most probable node at each depth gets the next depth's children. The dynamic tree scores
// every candidate path by its cumulative probability, expands the best ones depth by depth and
// keeps the best `budget - 1` nodes (Alg. 1). The pruner (section 3.5) skips a candidate equal to
// its parent's token or to the root (the last generated token) and takes the next best instead.
//
// Example, k = 2, static [2, 1], root token 7, no pruning:
//   depth 1 candidates 5 (0.6), 9 (0.3), ...;  depth 2 candidates 4 (0.5), ...
//   nodes = [7 (root), 5, 9, 4 (child of 5)], parents = [-1, 0, 0, 1]
#pragma once

#include <cstdint>
#include <vector>

namespace mtprobe::core {

struct DraftNode {
  int64_t token;
  int64_t parent;  // index into the node list; -1 for the root
  int64_t depth;   // 0 for the root
  double prob;     // cumulative probability of the path (1 for the root)
};

// Returns [root, ...] with every parent before its children.
std::vector<DraftNode> build_static_tree(int64_t root_token, const int64_t* cand_tokens,
                                         const float* cand_probs, int64_t depths, int64_t m,
                                         const int64_t* branches, bool prune);

// budget: the most nodes of the tree, root included (B = BC / (k + 1)).
std::vector<DraftNode> build_dynamic_tree(int64_t root_token, const int64_t* cand_tokens,
                                          const float* cand_probs, int64_t depths, int64_t m, int64_t budget,
                                          bool prune);

}  // namespace mtprobe::core
