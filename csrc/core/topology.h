// Precompiled static draft-tree topologies and the per-step policy that switches between them
// (seed 002: EntMTP's topology bank, section 4). Torch-free, C++17.
//
// A topology is a static draft tree given by child ranks, as Medusa's trees are: the node with
// path (r_1, ..., r_d) drafts, at depth d, the r_d-th candidate of depth d's list among the
// children of node (r_1, ..., r_{d-1}); with pruning (seed 001, section 3.5) a candidate equal to
// the parent's token or to the root's is skipped first. Which tokens fill the tree changes every
// step; its shape does not, so the block's parents, depths and attention pattern are planned once
// per topology and switching topology is an index change (the decode loop keeps one mask pattern
// per shape it has seen: csrc/decode/tree_mask_builder.h).
//
// Worked example: paths {(0), (1), (0, 0)}, sorted by depth then rank:
//   node 0 = root, node 1 = (0), node 2 = (1), node 3 = (0, 0)
//   parents = [-1, 0, 0, 1], depths = [0, 1, 1, 2], ranks = [-1, 0, 1, 0]
//   depth-1 candidates 5, 9, ...; depth-2 candidates 4, ...; root 7:  tokens = [7, 5, 9, 4]
//   If the true continuation's ranks are (0, 0) the accepted depth is 2; (1, 0): 1; (2, ...): 0.
//
// Policies (seed 002, section 4) map a per-step confidence score s (higher: deeper drafts are
// more likely to be accepted) to a topology:
//   static      one topology every step (EntMTP*: the task's throughput-optimal tree);
//   ladder      topologies t_0 .. t_{n-1} by cost, thresholds h_1 <= ... <= h_{n-1}:
//               t_i with i = #{j : s >= h_j};
//   hysteretic  a conservative t_0 and an aggressive t_1, thresholds (down, up) with down <= up:
//               from t_0 switch up when s > up, from t_1 switch down when s < down, else stay.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mtprobe::core {

struct Topology {
  std::vector<std::vector<int64_t>> paths;     // [N - 1] rank paths of the non-root nodes, in node order
  std::vector<int64_t> parents;                // [N] -1 for the root (node 0)
  std::vector<int64_t> depths;                 // [N]
  std::vector<int64_t> ranks;                  // [N] child rank, -1 for the root
  std::vector<std::vector<int64_t>> children;  // [N] child node indices, ascending rank
  int64_t max_depth = 0;
  int64_t max_rank = -1;  // -1: the root alone

  int64_t num_nodes() const { return static_cast<int64_t>(parents.size()); }
};

// Compiles rank paths into a topology (nodes sorted by depth, then lexicographically). Throws
// std::invalid_argument for an empty path, a negative rank, a repeated path or a path whose
// prefix is missing (a node without its parent).
Topology compile_topology(std::vector<std::vector<int64_t>> paths);

// The tokens and cumulative probabilities of a topology's nodes for one step: cand_tokens /
// cand_probs are [depths * m], depth d's top-m candidates in descending probability. Node 0 is the
// root. Returns false (outputs unspecified) when a node has no candidate left or the topology is
// deeper than `depths`.
bool fill_topology(const Topology& t, int64_t root_token, const int64_t* cand_tokens, const float* cand_probs,
                   int64_t depths, int64_t m, bool prune, int64_t* out_tokens /* [N] */,
                   double* out_probs /* [N] */);

// The depth the topology's drafts reach along a continuation whose token at depth d has child rank
// true_ranks[d - 1] (-1: not among the candidates), for d = 1..depths: 0 when no draft matches.
int64_t accepted_depth(const Topology& t, const int64_t* true_ranks, int64_t depths);

enum class TopologyPolicyKind { kStatic, kLadder, kHysteretic };

struct TopologyPolicy {
  TopologyPolicyKind kind = TopologyPolicyKind::kStatic;
  std::vector<int64_t> trees;  // static: {t}; ladder: n >= 1 by cost; hysteretic: {conservative, aggressive}
  std::vector<double> thresholds;  // static: {}; ladder: n - 1 ascending; hysteretic: {down, up}

  // Throws std::invalid_argument naming what is wrong (tree ids outside [0, bank_size), counts,
  // non-finite or unsorted thresholds, down above up).
  void validate(int64_t bank_size) const;
  // The first step's topology: the static one, the ladder's cheapest, the conservative one.
  int64_t initial() const { return trees.front(); }
  // The next step's topology from the score and the topology this step used.
  int64_t choose(double score, int64_t current) const;
};

// The per-step features a policy reads, from what the step already has: the target's logits at
// the accepted node (the distribution the next root came from) and the drafter's own candidates.
struct TopologyFeatures {
  double top1 = 0.0;         // the target's top-1 probability at the accepted node
  double path_value = 0.0;   // top1 times the drafter's top-1 probability at every depth (EAGLE-2)
  double entropy_ema = 0.0;  // EMA of the target's entropy (nats) at the accepted node
  double accept_ema = 0.0;   // EMA of the drafts accepted per step
  bool seen = false;         // the EMAs start at the first step's values

  // One step in; `ema` is the newest step's weight in the EMAs.
  void update(double top1, double path_value, double entropy, double accepted, double ema);
  // The policy's score, higher when deeper drafts are likelier to be accepted: "path_value", "top1",
  // "entropy" (exp(-entropy_ema)) or "accept" (throws std::invalid_argument for another name).
  double score(const std::string& feature) const;
};

// Whether `feature` names a TopologyFeatures score.
bool is_topology_feature(const std::string& feature);

// The checks every drafter that runs a bank makes on its policy options: the policy fits the bank,
// `feature` names a score, and `ema` (the newest step's weight) is in (0, 1]. Throws
// std::invalid_argument naming what is wrong.
void check_bank_policy(int64_t bank_size, const TopologyPolicy& policy, const std::string& feature,
                       double ema);

}  // namespace mtprobe::core
