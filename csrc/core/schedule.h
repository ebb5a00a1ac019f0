// The per-step scheduler's arithmetic (torch-free, C++17): a measured forward-cost table, online
// acceptance statistics per draft depth and sibling rank, and the choice of how much of a draft tree
// to verify.
//
// A draft node v is accepted with P(v) = P(parent) a(depth, rank): the acceptance of a node given its
// parent was accepted, by its depth and its place among its siblings (on a chain, a_1 a_2 ... a_d).
// Verifying the k nodes of highest P (a subtree: no child outranks its parent) gains, in expectation,
//     E[k] = 1 + sum of their P                                       (the bonus token + drafts)
// tokens, and costs one forward over T_k = committed + k inputs after P cached positions, t(T_k, P).
// Plain decoding gains 1 token for t(1, P). Per step the scheduler takes the block and cut with the
// most expected tokens per second, E[k] / t(T_k, P), so it verifies nothing extra when no draft pays
// for itself. Each a is estimated from exponentially decayed counts (recent steps weigh more, like
// EntMTP's EMA of accept lengths) with a Beta prior:
//     a = (accepts + 1) / (trials + 2)   for a first child (rank 0).
//
// Worked example: a_1 = 0.6, a_2 = 0.5, a chain with one node per depth, cost ratios
// t(2)/t(1) = 1.1 and t(3)/t(1) = 1.3:
//     k = 0: 1 / 1 = 1      k = 1: (1 + 0.6) / 1.1 = 1.455      k = 2: (1 + 0.6 + 0.3) / 1.3 = 1.462
// so the whole chain is verified; with t(3)/t(1) = 1.4 instead, k = 2 scores 1.357 and the cut keeps
// only the first node.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace mtprobe::core {

// Median seconds of one forward over T inputs after `context` cached positions, measured on a grid
// (python/mtprobe/target_model/profile.py measures it; ForwardProfile.time is the reference of time()).
class CostTable {
 public:
  CostTable() = default;
  // block_sizes: [B] ascending from 1; contexts: [C] ascending; seconds: [C * B] row-major, > 0.
  // Throws std::invalid_argument naming the first violation.
  CostTable(std::vector<int64_t> block_sizes, std::vector<int64_t> contexts, std::vector<double> seconds);

  // Linear between grid points in both coordinates; past the last block size the last segment's
  // slope continues; contexts outside the grid are clamped to its ends.
  double time(double block_size, double context) const;
  // (t(block_size, context) + overhead) / (t(1, context) + overhead): a step's cost in plain steps,
  // `overhead` the seconds a decode step spends besides its forward (see best_cut).
  double relative(double block_size, double context, double overhead = 0.0) const;
  bool empty() const { return block_sizes_.empty(); }

 private:
  double row(std::size_t i, double block_size) const;

  std::vector<int64_t> block_sizes_;  // [B]
  std::vector<int64_t> contexts_;     // [C]
  std::vector<double> seconds_;       // [C * B]
};

// Decayed acceptance counts of one drafter per (depth, sibling rank). A node's rank is its place
// among its parent's children in the order the drafter proposed them (0: the first, its best guess);
// ranks from kRanks - 1 on share one count. Trees of varying width are then priced node by node: a
// tenth sibling is not credited with the first one's acceptance.
class AcceptanceStats {
 public:
  static constexpr int64_t kRanks = 4;

  explicit AcceptanceStats(double decay = 0.95);
  // Counts carried over from an earlier run (trials()/accepts() of one): [depth][kRanks] each, every
  // count >= 0 and no accepts above its trials; throws std::invalid_argument naming the first violation.
  AcceptanceStats(double decay, std::vector<std::vector<double>> trials,
                  std::vector<std::vector<double>> accepts);

  // One decode step passed: every count decays by `decay`.
  void step();
  // One verdict: a node at `depth` (>= 1) of sibling rank `rank` (>= 0), whose parent the real
  // continuation reached, was (not) the continuation's next token.
  void record(int64_t depth, int64_t rank, bool accepted);
  // a(depth, rank) = P(the node is accepted | its parent was): (accepts + 2 m) / (trials + 2), a
  // prior of weight 2 with mean m = 0.5 for rank 0 and m = a(depth, rank - 1) / 2 for later ranks.
  // Depths never recorded give the prior; throws std::invalid_argument for depth < 1 or rank < 0.
  double rate(int64_t depth, int64_t rank) const;
  // [depth][rank]: decayed verdicts and acceptances.
  const std::vector<std::vector<double>>& trials() const { return trials_; }
  const std::vector<std::vector<double>>& accepts() const { return accepts_; }

 private:
  double decay_;
  std::vector<std::vector<double>> trials_;   // [depth][kRanks]
  std::vector<std::vector<double>> accepts_;  // [depth][kRanks]
};

// The best cut of one proposed tree: the draft nodes it keeps.
struct Cut {
  int64_t nodes = 0;          // draft nodes kept (0: plain decoding)
  int64_t inputs = 1;         // T of the forward after the cut
  double expected = 1.0;      // E[tokens gained]
  double score = 1.0;         // expected / relative cost: tokens per plain-decoding forward time
  std::vector<int64_t> kept;  // [nodes]: indices of the kept draft nodes, ascending
};

// committed: the committed chain's length (1 after prefill); parents: [draft nodes], each node's
// parent among the draft nodes (-1: the last committed token), parents before children, siblings in
// the drafter's order; extra: inputs that are no draft nodes (auxiliary inputs). A node is accepted
// with P(node) = P(parent) a(depth, rank), each a capped so that one node's children, who exclude
// each other, sum to at most 1. A cut keeps the k nodes of highest P (ties: the earlier node), which
// is a subtree since no child outranks its parent, and gains 1 + the sum of their P; the best k is
// taken. A block with extra > 0 (or `cuttable` false) is verified whole or not at all. Ties go to
// the smaller block. A step costs its forward and `overhead` seconds besides (verification, the
// drafters' and the loop's own work), whatever T: a block's cost is cost.relative(T, context,
// overhead) plain steps, so the overhead favours blocks that gain more per step. Throws
// std::invalid_argument for committed < 1, extra < 0, a context or overhead that is negative or not
// finite, or a parent that is not -1 or an earlier node.
Cut best_cut(const AcceptanceStats& stats, const CostTable& cost, int64_t committed,
             const std::vector<int64_t>& parents, int64_t extra, bool cuttable, double context,
             double overhead = 0.0);

// A drafter that runs forwards of its own to propose (a draft model) costs time before its block
// exists, so the scheduler forecasts its chain instead of cutting it. Every draft of the chain is
// taken to be accepted with the same p given its parent was: a draft model drafts each token the
// same way, and one rate pools the verdicts of every depth, so that a few steps measure it. p is the
// pooled first-child rate, (sum of accepts + 1) / (sum of trials + 2) over the depths. A chain of k
// drafts gains E[k] = 1 + p + p^2 + ... + p^k tokens for one target forward over 1 + k inputs plus
// k draft forwards of `draft_seconds` each (and the step's `overhead`, as in best_cut):
//     score(k) = E[k] / ((t(1 + k) + overhead + k draft_seconds) / (t(1) + overhead))
// and the forecast is the k in 1..max_drafts of the best score (ties: the shorter chain).
//
// Worked example: p = 0.9, draft_seconds = t(1) / 2, t(1 + k) / t(1) = 1 + 0.1 k:
//     k = 1: 1.9 / 1.6 = 1.188    k = 2: 2.71 / 2.2 = 1.232    k = 3: 3.439 / 2.8 = 1.228
// so two drafts, which beat plain decoding (score 1) and any block in hand scoring less than 1.232.
struct ChainForecast {
  int64_t drafts = 0;     // k (0: max_drafts < 1, nothing to forecast)
  double rate = 0.0;      // p
  double expected = 1.0;  // E[k]
  double score = 0.0;     // tokens per plain-decoding forward time
};

// Throws std::invalid_argument for draft_seconds, a context or an overhead that is negative or not
// finite.
ChainForecast forecast_chain(const AcceptanceStats& stats, const CostTable& cost, double draft_seconds,
                             int64_t max_drafts, double context, double overhead = 0.0);

// A draft model's confidence, by class of its top-2 logit margin: how often a greedy draft whose margin
// fell in the class was the target's token. A draft model drafts a chain token after token, and a near-tie
// it resolves unlike the target wastes every draft after it; where a class has been the target's token
// less than `stop_below` of the time, a draft in it ends the chain (DraftModelDrafter). Off SmolLM2's
// 4-bit grid the 8-bit self-draft matched the target at 45-79 % of its margins below 0.1 and at 98-100 %
// above; on the grid, where it is the target, at every margin: the counts tell the two apart.
// rate = (matches + 1.9) / (trials + 2): a prior of weight 2 and mean 0.95, so that no class stops a
// chain before it has missed. Shared by the drafters of one draft model (a batch's rows, the process's
// generations), so every call locks.
class MarginStats {
 public:
  static constexpr std::array<double, 7> kEdges{0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0};
  static constexpr int64_t kClasses = static_cast<int64_t>(kEdges.size()) + 1;

  // stop_below in (0, 1]; throws std::invalid_argument otherwise.
  explicit MarginStats(double stop_below = 0.9);
  // The class of a margin (>= 0, finite): the number of edges at or below it. Throws otherwise.
  static int64_t class_of(double margin);
  double rate(double margin) const;
  void record(double margin, bool matched);
  // Whether a draft of this margin ends its chain: rate(margin) < stop_below.
  bool stops(double margin) const;
  double stop_below() const { return stop_below_; }
  // [kClasses] each: the verdicts and matches so far.
  std::vector<double> trials() const;
  std::vector<double> matches() const;

 private:
  double rate_locked(int64_t c) const;
  double stop_below_;
  mutable std::mutex mutex_;
  std::array<double, kEdges.size() + 1> trials_{}, matches_{};
};

}  // namespace mtprobe::core
