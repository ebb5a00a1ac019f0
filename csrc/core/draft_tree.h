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

// budget: the most nodes of the tree, root included (B = BC / (k + 1)). O(C log C) for the
// C <= 1 + depths * B * min(m, B) candidates it scores (draft_tree_expand.h); throws
// std::invalid_argument when C could exceed kMaxDynamicTreeCandidates (2^31 - 1).
std::vector<DraftNode> build_dynamic_tree(int64_t root_token, const int64_t* cand_tokens,
                                          const float* cand_probs, int64_t depths, int64_t m, int64_t budget,
                                          bool prune);

// The hybrid drafter's merge (seed 001, App. C: "fuse token trajectories ... then select top
// candidates from the combined pool"). a and b are trees of the same root ([root, ...], parents
// first, prob = cumulative score, at most 1 and never above the parent's). Their union identifies
// nodes with the same token path and scores each by the higher of its scores; the result keeps the
// best `budget - 1` nodes (ties: the node met first, a's nodes before b's), in union order. A
// node's union score never exceeds its parent's, so the kept nodes always form a tree.
//
// Example, root 7: a = 7 -> 5 (.6), 7 -> 9 (.3); b = 7 -> 5 (1) -> 4 (1), 7 -> 2 (.2):
//   union = 5 (1), 9 (.3), 4 (1, child of 5), 2 (.2); budget 4 keeps 5, 4, 9:
//   nodes = [7, 5, 9, 4], parents = [-1, 0, 0, 1], probs = [1, 1, .3, 1]
std::vector<DraftNode> merge_draft_trees(const std::vector<DraftNode>& a, const std::vector<DraftNode>& b,
                                         int64_t budget);

// Which nodes of a tree carry the k mask tokens when masks and drafts share one budget (the
// hybrid drafter with HybridConfig.mask_value). A node's masks only matter if the step ends there:
// they hold the next step's probing candidates. So the plan takes the best N nodes by score (a
// prefix of the score order is a tree) and masks on the M of them most likely to be the last
// accepted, maximising
//   sum_{drafts i} p_i + mask_value * sum_{carriers i} (p_i - sum_{children c of i} p_c)
// subject to 1 + N + k M <= inputs: p_i estimates P(i accepted), p_i - sum p_c P(the step ends at i),
// and mask_value is the tokens probing adds to the next step. Over all nodes the second sum is
// sum p_i - sum_{non-root} p_i = p_root = 1: masks everywhere (seed 001's rule, B - 1 = inputs /
// (k + 1) - 1 drafts) is one plan among those compared. Ties keep the smaller N.
//
// nodes: [root, ...], parents first, root prob 1, each prob at most its parent's.
// Returns the plan's nodes (parents first, root first) and carries[i] for each of them.
//
// Example, k = 1, inputs 5, mask_value 0.3; root 7 -> 5 (.9) -> 4 (.8), 7 -> 9 (.01):
//   N = 2 (5, 4) with masks on 7 (ends there: .1) and 4 (.8): .9 + .8 + .3 * .9 = 1.97, the best
//   (every node masked fits only N = 1: .9 + .3 = 1.2; N = 3 leaves one mask: 1.71 + .3 * .8 = 1.95)
//   nodes = [7, 5, 4], carries = [1, 0, 1]
struct MaskPlan {
  std::vector<DraftNode> nodes;
  std::vector<bool> carries;
};
MaskPlan plan_mask_carriers(const std::vector<DraftNode>& nodes, int64_t inputs, int64_t k,
                            double mask_value);

// The masks the next step's tree reads after a step accepted `path` (block indices, root first, the
// last accepted node last): the last node's own (shift 0), else, where planned masks left it none,
// its nearest masked ancestor's, `shift` nodes up. Ancestor u holds m_j at position p_u + j, so the
// next root (right after the last node) is followed by what its m_{shift+1}, ..., m_k predicted: rows
// first + shift .. first + k - 1 of the step's logits, depths 1..k - shift. first = -1 (no masks within
// k - 1 nodes up, or none at all): no candidates. mask_input[i]: input index of node i's m_1, or -1.
//
// Example, k = 2: path [3, 5, 6] (root 3), masks on 3 at inputs 9-10 and on nothing else:
//   6 has none, 5 has none, 3 is two up but shift 2 = k leaves nothing: first = -1.
//   path [3, 5]: 3 is one up, shift 1: rows 10 .. 10 (its m_2), one depth: first = 9, shift = 1.
struct MaskSource {
  int64_t first = -1;  // input index of the chosen node's m_1, -1: none
  int64_t shift = 0;   // nodes from the last accepted node up to the chosen one
};
MaskSource mask_source(const std::vector<int64_t>& path, const std::vector<int64_t>& mask_input, int64_t k);

}  // namespace mtprobe::core
