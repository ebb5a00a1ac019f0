// The per-step scheduler's arithmetic (torch-free, C++17): a measured forward-cost table, online
// acceptance statistics per draft depth, and the choice of how much of a draft tree to verify.
//
// Verifying a draft tree cut at depth n gains, in expectation,
//     E[n] = 1 + sum_{d=1..n} P(the accepted path reaches depth d)      (the bonus token + drafts)
// tokens, and costs one forward over T_n inputs after P cached positions, t(T_n, P). Plain decoding
// gains 1 token for t(1, P). Per step the scheduler takes the block and cut with the most expected
// tokens per second, E[n] / t(T_n, P), so it verifies nothing extra when no draft pays for itself.
//
// P(reach d) = a_1 a_2 ... a_d, where a_i is the acceptance at depth i given that depth i - 1 was
// reached and the tree had a node at depth i. Each a_i is estimated from exponentially decayed
// counts (recent steps weigh more, like EntMTP's EMA of accept lengths) with a Beta(1, 1) prior:
//     a_i = (accepts_i + 1) / (trials_i + 2).
//
// Worked example: a_1 = 0.6, a_2 = 0.5, a chain with one node per depth, cost ratios
// t(2)/t(1) = 1.1 and t(3)/t(1) = 1.3:
//     n = 0: 1 / 1 = 1      n = 1: (1 + 0.6) / 1.1 = 1.455      n = 2: (1 + 0.6 + 0.3) / 1.3 = 1.462
// so the whole chain is verified; with t(3)/t(1) = 1.4 instead, n = 2 scores 1.357 and the cut is at 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mtprobe::core {

// Median seconds of one forward over T inputs after `context` cached positions, measured on a grid
// (python/mtprobe/profile.py measures it; ForwardProfile.time is the reference of time()).
class CostTable {
 public:
  CostTable() = default;
  // block_sizes: [B] ascending from 1; contexts: [C] ascending; seconds: [C * B] row-major, > 0.
  // Throws std::invalid_argument naming the first violation.
  CostTable(std::vector<int64_t> block_sizes, std::vector<int64_t> contexts, std::vector<double> seconds);

  // Linear between grid points in both coordinates; past the last block size the last segment's
  // slope continues; contexts outside the grid are clamped to its ends.
  double time(double block_size, double context) const;
  // t(block_size, context) / t(1, context).
  double relative(double block_size, double context) const;
  bool empty() const { return block_sizes_.empty(); }

 private:
  double row(std::size_t i, double block_size) const;

  std::vector<int64_t> block_sizes_;  // [B]
  std::vector<int64_t> contexts_;     // [C]
  std::vector<double> seconds_;       // [C * B]
};

// Decayed acceptance counts per depth for one drafter.
class AcceptanceStats {
 public:
  explicit AcceptanceStats(double decay = 0.95);

  // One step's evidence: the drafter's tree had nodes down to depth `tree_depth`, its path along
  // the real continuation matched `reached` tokens, and the continuation is known for `known`
  // tokens. Depths 1..reached were accepted; depth reached + 1 was rejected if it is <= tree_depth
  // and <= known (otherwise unknown: nothing is recorded for it). Decays all counts first.
  void record(int64_t tree_depth, int64_t reached, int64_t known);
  // a_d (d >= 1): the prior mean 0.5 where nothing was recorded.
  double rate(int64_t depth) const;
  // P(the path reaches depth d) for d = 1..max_depth.
  std::vector<double> reach(int64_t max_depth) const;
  const std::vector<double>& trials() const { return trials_; }
  const std::vector<double>& accepts() const { return accepts_; }

 private:
  double decay_;
  std::vector<double> trials_;   // [depth]: decayed steps that tested depth d
  std::vector<double> accepts_;  // [depth]: decayed steps that accepted depth d
};

// The best cut of one proposed tree.
struct Cut {
  int64_t depth = 0;      // keep the draft nodes at depth <= depth (0: plain decoding)
  int64_t inputs = 1;     // T of the forward after the cut
  double expected = 1.0;  // E[tokens gained]
  double score = 1.0;     // expected / relative cost: tokens per plain-decoding forward time
};

// committed: the committed chain's length (1 after prefill); nodes_per_depth[d - 1]: draft nodes at
// depth d; extra: inputs that are no draft nodes (auxiliary inputs). A block with extra > 0 (or
// `cuttable` false) is verified whole or not at all. Ties go to the smaller block.
Cut best_cut(const AcceptanceStats& stats, const CostTable& cost, int64_t committed,
             const std::vector<int64_t>& nodes_per_depth, int64_t extra, bool cuttable, double context);

}  // namespace mtprobe::core
