// Unit tests for the scheduler's arithmetic (csrc/core/schedule.h).
//
// Build and run (tests/test_core_cpp.py does exactly this):
//   g++ -std=c++17 -O1 -Wall -Wextra -Werror -I csrc csrc/core/*.cpp tests/core/test_schedule.cpp -o
//   test_schedule
//   ./test_schedule
// The same cost table, statistics and cuts run against the Python reference in tests/test_schedule.py.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

#include "core/schedule.h"
#include "harness.h"

namespace {

using mtprobe::core::AcceptanceStats;
using mtprobe::core::best_cut;
using mtprobe::core::ChainForecast;
using mtprobe::core::CostTable;
using mtprobe::core::Cut;
using mtprobe::core::forecast_chain;

bool near(double a, double b) { return std::fabs(a - b) < 1e-9; }

// The docstring example of python/mtprobe/target_model/profile.py.
CostTable example_table() {
  return CostTable({1, 8, 32}, {64, 512}, {0.020, 0.030, 0.046, 0.024, 0.036, 0.056});
}

void test_cost_table_interpolates() {
  const CostTable t = example_table();
  CHECK(near(t.time(8, 64), 0.030));
  CHECK(near(t.time(20, 64), 0.038));               // linear between block sizes
  CHECK(near(t.time(1, 288), 0.022));               // halfway between contexts
  CHECK(near(t.relative(32, 288), 0.051 / 0.022));  // the worked example's 2.318
  CHECK(near(t.time(8, 0), 0.030));                 // below the grid: clamped to the first context
  CHECK(near(t.time(8, 4096), 0.036));              // above: the last
  CHECK(near(t.time(56, 64), 0.046 + 0.016));       // past the last size: the last slope goes on
  CHECK(near(t.relative(1, 300), 1.0));
}

// Counts the calls that throw std::invalid_argument.
template <typename F>
void expect_throw(int& thrown, F call) {
  try {
    call();
  } catch (const std::invalid_argument&) {
    ++thrown;
  }
}

void test_cost_table_rejects_bad_grids() {
  int thrown = 0;
  expect_throw(thrown, [] { CostTable({2, 4}, {0}, {1.0, 2.0}); });           // does not start at 1
  expect_throw(thrown, [] { CostTable({1, 1}, {0}, {1.0, 2.0}); });           // not ascending
  expect_throw(thrown, [] { CostTable({1, 2}, {0, 0}, {1, 2, 3, 4}); });      // contexts not ascending
  expect_throw(thrown, [] { CostTable({1, 2}, {0}, {1.0}); });                // wrong size
  expect_throw(thrown, [] { CostTable({1, 2}, {0}, {1.0, 0.0}); });           // a free forward
  expect_throw(thrown, [] { CostTable({1, 2}, {0}, {1.0, -2.0}); });          // negative
  expect_throw(thrown, [] { CostTable({1, 2}, {0}, {1.0, std::nan("")}); });  // NaN
  CHECK(thrown == 7);
}

void test_stats_count_verdicts() {
  AcceptanceStats s(1.0);                                      // no decay: plain counts
  CHECK(near(s.rate(1, 0), 0.5) && near(s.rate(1, 1), 0.25));  // the priors: a later sibling gets half
  s.record(1, 0, true);
  s.record(2, 0, false);  // a chain: depth 1 accepted, depth 2 rejected
  CHECK(s.trials().size() == 2 && near(s.trials()[0][0], 1) && near(s.trials()[1][0], 1));
  CHECK(near(s.accepts()[0][0], 1) && near(s.accepts()[1][0], 0));
  CHECK(near(s.rate(1, 0), 2.0 / 3) && near(s.rate(2, 0), 1.0 / 3));
  // Siblings: the second child of a reached node accepted, the first rejected.
  s.record(1, 0, false);
  s.record(1, 1, true);
  CHECK(near(s.rate(1, 0), 0.5) && near(s.rate(1, 1), (1 + 2 * 0.25) / 3));
  // Ranks from kRanks - 1 on share one count.
  s.record(1, AcceptanceStats::kRanks - 1, false);
  s.record(1, AcceptanceStats::kRanks + 5, false);
  CHECK(near(s.trials()[0][AcceptanceStats::kRanks - 1], 2));
  CHECK(near(s.rate(1, AcceptanceStats::kRanks + 5), s.rate(1, AcceptanceStats::kRanks - 1)));
  int thrown = 0;
  for (auto [depth, rank] : {std::pair<int64_t, int64_t>{0, 0}, {1, -1}}) {
    try {
      s.record(depth, rank, true);
    } catch (const std::invalid_argument&) {
      ++thrown;
    }
  }
  CHECK(thrown == 2);
}

void test_stats_decay() {
  AcceptanceStats s(0.5);
  s.record(1, 0, true);
  s.step();  // the older acceptance now counts half
  s.record(1, 0, false);
  CHECK(near(s.trials()[0][0], 1.5) && near(s.accepts()[0][0], 0.5));
  int thrown = 0;
  for (double bad : {0.0, -0.1, 1.5}) {
    try {
      AcceptanceStats x(bad);
    } catch (const std::invalid_argument&) {
      ++thrown;
    }
  }
  CHECK(thrown == 3);
}

// The worked example of csrc/core/schedule.h: a_1 = 0.6, a_2 = 0.5 on a chain.
AcceptanceStats example_stats() {
  AcceptanceStats s(1.0);
  // a_1 = (a + 1) / (t + 2) = 0.6 with t = 8, a = 5; a_2 = 0.5 with t = 4 trials, 2 accepted.
  for (int i = 0; i < 8; ++i) s.record(1, 0, i < 5);
  for (int i = 0; i < 4; ++i) s.record(2, 0, i < 2);
  return s;
}

// Parents of a tree with nodes_per_depth[d] nodes at depth d + 1, all below the first node of the
// depth above.
std::vector<int64_t> layered(const std::vector<int64_t>& nodes_per_depth) {
  std::vector<int64_t> parents;
  int64_t first = -1;
  for (int64_t n : nodes_per_depth) {
    const int64_t here = static_cast<int64_t>(parents.size());
    for (int64_t i = 0; i < n; ++i) parents.push_back(first);
    first = here;
  }
  return parents;
}

void test_best_cut_worked_example() {
  const AcceptanceStats s = example_stats();
  CHECK(near(s.rate(1, 0), 0.6) && near(s.rate(2, 0), 0.5));
  const CostTable steep({1, 2, 3}, {0}, {1.0, 1.1, 1.3});
  Cut c = best_cut(s, steep, 1, {-1, 0}, 0, true, 0);
  CHECK(c.nodes == 2 && c.inputs == 3 && near(c.expected, 1.9) && near(c.score, 1.9 / 1.3));
  CHECK((c.kept == std::vector<int64_t>{0, 1}));
  const CostTable steeper({1, 2, 3}, {0}, {1.0, 1.1, 1.4});
  c = best_cut(s, steeper, 1, {-1, 0}, 0, true, 0);
  CHECK(c.nodes == 1 && c.inputs == 2 && near(c.score, 1.6 / 1.1));
  // Whole or nothing: with an auxiliary input the cut at depth 1 is not allowed.
  // The whole block (T = 6, extrapolated: 1.4 + 3 x 0.3 = 2.3) scores 1.9 / 2.3 < 1: plain decoding,
  // although the cut at depth 1 alone would have paid.
  c = best_cut(s, steeper, 1, {-1, 0}, 3, true, 0);
  CHECK(c.nodes == 0 && c.inputs == 1 && c.kept.empty() && near(c.score, 1.0));
  // Not cuttable (draft_probs): whole at 1.9 / 1.4, though the cut at depth 1 would score 1.6 / 1.1.
  c = best_cut(s, steeper, 1, {-1, 0}, 0, false, 0);
  CHECK(c.nodes == 2 && c.inputs == 3 && near(c.score, 1.9 / 1.4));
  // A second child at depth 1 adds its own rank's rate, P = 0.3 (prior: half of 0.6): 1 + 0.6 + 0.3
  // + 0.3 (depth 2 below the first child) = 2.2 for T = 4.
  const CostTable flat({1, 64}, {0}, {1.0, 1.0});
  c = best_cut(s, flat, 1, {-1, -1, 0}, 0, true, 0);
  CHECK(c.nodes == 3 && c.inputs == 4 && near(c.expected, 2.2));
  // The cut keeps the most probable nodes, ties to the earlier: P = 0.6, 0.3, 0.3; with costs 1.1,
  // 1.25, 2 for T = 2..4 the first two score 1.9 / 1.25 = 1.52, above 1.6 / 1.1 and 2.2 / 2.
  const CostTable rising({1, 2, 3, 4}, {0}, {1.0, 1.1, 1.25, 2.0});
  c = best_cut(s, rising, 1, {-1, -1, 0}, 0, true, 0);
  CHECK(c.nodes == 2 && c.inputs == 3 && (c.kept == std::vector<int64_t>{0, 1}) && near(c.score, 1.52));
  // A free forward (a GPU-like profile) verifies everything.
  c = best_cut(s, flat, 1, layered({3, 5}), 4, true, 0);
  CHECK(c.nodes == 8 && c.inputs == 1 + 8 + 4);
  // A tree verified whole (an auxiliary input) and too expensive for its expected gain: plain decoding.
  const CostTable cpu({1, 64}, {0}, {1.0, 4.0});
  c = best_cut(s, cpu, 1, layered({30, 30}), 1, true, 0);
  CHECK(c.nodes == 0 && c.inputs == 1);
  // No draft at all.
  c = best_cut(s, flat, 1, {}, 0, true, 0);
  CHECK(c.nodes == 0 && c.inputs == 1 && near(c.expected, 1.0));
  // A parent that is no earlier node.
  int thrown = 0;
  try {
    best_cut(s, flat, 1, {-1, 1}, 0, true, 0);
  } catch (const std::invalid_argument&) {
    ++thrown;
  }
  CHECK(thrown == 1);
}

void test_forecast_chain_worked_example() {
  // p = 0.9: 17 of 18 first-child verdicts accepted ((17 + 1) / (18 + 2)), pooled over depths.
  AcceptanceStats s(1.0);
  for (int i = 0; i < 18; ++i) s.record(1 + i % 3, 0, i != 5);
  s.record(1, 1, false);  // a later sibling: not a chain's verdict, not pooled
  // t(1 + k) / t(1) = 1 + 0.1 k (t(1) = 2 s: the forecast works in seconds), a draft costs t(1) / 2.
  const CostTable cost({1, 2}, {0}, {2.0, 2.2});
  ChainForecast f = forecast_chain(s, cost, 1.0, 12, 0);
  CHECK(f.drafts == 2 && near(f.rate, 0.9) && near(f.expected, 2.71) && near(f.score, 2.71 / 2.2));
  // An overhead of one plain forward per step (2 s) makes longer chains pay: k = 5 scores
  // 4.686 / (10 / 4) = 1.874, above k = 4 (1.861) and k = 6 (1.863).
  f = forecast_chain(s, cost, 1.0, 12, 0, 2.0);
  CHECK(f.drafts == 5 && near(f.score, f.expected / 2.5));
  f = forecast_chain(s, cost, 1.0, 1, 0);  // at most one draft
  CHECK(f.drafts == 1 && near(f.score, 1.9 / 1.6));
  const CostTable flat({1, 64}, {0}, {2.0, 2.0});
  f = forecast_chain(s, flat, 0.0, 40, 0);  // free drafts and free width: the longest chain allowed
  CHECK(f.drafts == 40);
  f = forecast_chain(s, cost, 1.0, 0, 0);  // no room for a draft
  CHECK(f.drafts == 0 && f.score == 0.0);
  f = forecast_chain(AcceptanceStats(1.0), cost, 1.0, 12, 0);  // no verdicts: the prior, p = 1 / 2
  CHECK(near(f.rate, 0.5) && f.drafts == 1 && near(f.score, 1.5 / 1.6));
  int thrown = 0;
  expect_throw(thrown, [&] { forecast_chain(s, cost, -1.0, 4, 0); });
  expect_throw(thrown, [&] { forecast_chain(s, cost, std::nan(""), 4, 0); });
  expect_throw(thrown, [&] { forecast_chain(s, cost, 1.0, 4, -1.0); });
  CHECK(thrown == 3);
}

void test_bad_input_throws() {
  const CostTable flat({1, 64}, {0}, {1.0, 1.0});
  AcceptanceStats s(1.0);
  int thrown = 0;
  expect_throw(thrown, [&] { best_cut(s, flat, 0, {-1}, 0, true, 0); });             // no committed token
  expect_throw(thrown, [&] { best_cut(s, flat, 1, {-1}, -1, true, 0); });            // negative extra
  expect_throw(thrown, [&] { best_cut(s, flat, 1, {-1}, 0, true, std::nan("")); });  // NaN context
  expect_throw(thrown, [&] { best_cut(s, flat, 1, {-1}, 0, true, -1.0); });          // negative context
  expect_throw(thrown, [&] { s.rate(0, 0); });
  expect_throw(thrown, [&] { s.rate(1, -1); });
  CHECK(thrown == 6);
  CHECK(std::abs(s.rate(9, 0) - 0.5) < 1e-12);  // a depth never recorded: the prior
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"cost_table_interpolates", test_cost_table_interpolates},
      {"cost_table_rejects_bad_grids", test_cost_table_rejects_bad_grids},
      {"stats_count_verdicts", test_stats_count_verdicts},
      {"stats_decay", test_stats_decay},
      {"best_cut_worked_example", test_best_cut_worked_example},
      {"forecast_chain_worked_example", test_forecast_chain_worked_example},
      {"bad_input_throws", test_bad_input_throws},
  };
  return mtprobe_test::run_tests(tests);
}
