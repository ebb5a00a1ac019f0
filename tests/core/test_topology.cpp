// Unit tests for the topology bank's trees and policies (csrc/core/topology.h).
//
// Build and run (tests/test_core_cpp.py does exactly this):
//   g++ -std=c++17 -O1 -Wall -Wextra -Werror -I csrc csrc/core/*.cpp tests/core/test_topology.cpp -o
//   test_topology
//   ./test_topology
// The same trees, fills and choices run against the Python reference in tests/test_topology.py.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/topology.h"
#include "harness.h"

namespace {

using mtprobe::core::accepted_depth;
using mtprobe::core::check_bank_policy;
using mtprobe::core::compile_topology;
using mtprobe::core::fill_topology;
using mtprobe::core::is_topology_feature;
using mtprobe::core::Topology;
using mtprobe::core::TopologyFeatures;
using mtprobe::core::TopologyPolicy;
using mtprobe::core::TopologyPolicyKind;

// The worked example of csrc/core/topology.h.
void test_worked_example() {
  const Topology t = compile_topology({{0, 0}, {1}, {0}});
  CHECK((t.parents == std::vector<int64_t>{-1, 0, 0, 1}));
  CHECK((t.depths == std::vector<int64_t>{0, 1, 1, 2}));
  CHECK((t.ranks == std::vector<int64_t>{-1, 0, 1, 0}));
  CHECK(t.max_depth == 2 && t.max_rank == 1 && t.num_nodes() == 4);
  const int64_t cand[] = {5, 9, 3, 4, 8, 6};  // [2 depths, m = 3]
  const float prob[] = {.6f, .3f, .1f, .5f, .3f, .2f};
  int64_t tokens[4];
  double probs[4];
  CHECK(fill_topology(t, 7, cand, prob, 2, 3, true, tokens, probs));
  CHECK(tokens[0] == 7 && tokens[1] == 5 && tokens[2] == 9 && tokens[3] == 4);
  const int64_t r00[] = {0, 0}, r10[] = {1, 0}, r20[] = {2, 0}, r01[] = {0, 1}, miss[] = {-1, 0};
  CHECK(accepted_depth(t, r00, 2) == 2);
  CHECK(accepted_depth(t, r10, 2) == 1);
  CHECK(accepted_depth(t, r20, 2) == 0);
  CHECK(accepted_depth(t, r01, 2) == 1);
  CHECK(accepted_depth(t, miss, 2) == 0);
}

void test_pruning_skips_parent_and_root() {
  // Depth 2's best candidate repeats its parent (5) and its second the root (7): rank 0 is 4.
  const Topology t = compile_topology({{0}, {0, 0}});
  const int64_t cand[] = {5, 1, 2, 5, 7, 4};
  const float prob[] = {.5f, .2f, .1f, .5f, .3f, .1f};
  int64_t tokens[3];
  double probs[3];
  CHECK(fill_topology(t, 7, cand, prob, 2, 3, true, tokens, probs));
  CHECK(tokens[2] == 4);
  CHECK(fill_topology(t, 7, cand, prob, 2, 3, false, tokens, probs));
  CHECK(tokens[2] == 5);
  // Rank 1 at depth 2 does not exist once both are skipped: the candidates run out.
  const Topology wide = compile_topology({{0}, {0, 0}, {0, 1}});
  int64_t t3[4];
  double p3[4];
  CHECK(!fill_topology(wide, 7, cand, prob, 2, 3, true, t3, p3));
  // Deeper than the masks: refused.
  CHECK(!fill_topology(t, 7, cand, prob, 1, 3, true, tokens, probs));
}

void test_bad_paths_throw() {
  int thrown = 0;
  auto expect_throw = [&](std::vector<std::vector<int64_t>> paths) {
    try {
      compile_topology(std::move(paths));
    } catch (const std::invalid_argument&) {
      ++thrown;
    }
  };
  expect_throw({{}});         // empty path
  expect_throw({{0}, {-1}});  // negative rank
  expect_throw({{0}, {0}});   // repeated
  expect_throw({{0, 0}});     // no parent
  CHECK(thrown == 4);
  CHECK(compile_topology({}).num_nodes() == 1);  // the root alone is a topology
}

void test_policies() {
  TopologyPolicy ladder{TopologyPolicyKind::kLadder, {0, 2, 4}, {0.2, 0.6}};
  ladder.validate(5);
  CHECK(ladder.choose(0.1, 0) == 0 && ladder.choose(0.2, 0) == 2 && ladder.choose(0.9, 0) == 4);
  TopologyPolicy hyst{TopologyPolicyKind::kHysteretic, {1, 3}, {0.3, 0.5}};
  hyst.validate(4);
  CHECK(hyst.initial() == 1);
  CHECK(hyst.choose(0.4, 1) == 1);  // between the thresholds: stay
  CHECK(hyst.choose(0.6, 1) == 3);  // above up: switch up
  CHECK(hyst.choose(0.4, 3) == 3);  // between: stay up
  CHECK(hyst.choose(0.2, 3) == 1);  // below down: switch down
  TopologyPolicy fixed{TopologyPolicyKind::kStatic, {2}, {}};
  fixed.validate(3);
  CHECK(fixed.choose(0.0, 0) == 2);

  int thrown = 0;
  auto expect_throw = [&](TopologyPolicy p, int64_t bank) {
    try {
      p.validate(bank);
    } catch (const std::invalid_argument&) {
      ++thrown;
    }
  };
  expect_throw({TopologyPolicyKind::kStatic, {0}, {}}, 0);                 // empty bank
  expect_throw({TopologyPolicyKind::kStatic, {3}, {}}, 3);                 // outside the bank
  expect_throw({TopologyPolicyKind::kHysteretic, {0, 1}, {0.6, 0.4}}, 2);  // down above up
  expect_throw({TopologyPolicyKind::kLadder, {0, 1, 2}, {0.5, 0.2}}, 3);   // unsorted
  expect_throw({TopologyPolicyKind::kLadder, {0, 1}, {}}, 2);              // a threshold short
  expect_throw({TopologyPolicyKind::kHysteretic, {0}, {0.1, 0.2}}, 2);     // one tree
  CHECK(thrown == 6);

  // The drafters' whole check: the policy, then the feature's name and the EMA weight.
  int refused = 0;
  auto expect_refused = [&](const std::string& feature, double ema, int64_t bank) {
    try {
      check_bank_policy(bank, fixed, feature, ema);
    } catch (const std::invalid_argument&) {
      ++refused;
    }
  };
  check_bank_policy(3, fixed, "path_value", 1.0);  // accepted: ema 1 keeps only the newest step
  expect_refused("path_value", 0.5, 2);            // the policy's tree 2 is outside a bank of 2
  expect_refused("depth", 0.5, 3);                 // not a feature
  expect_refused("entropy", 0.0, 3);               // ema 0 never moves
  expect_refused("entropy", 1.5, 3);
  expect_refused("entropy", std::nan(""), 3);
  CHECK(refused == 5);
}

// The EMAs start at the first step's values, then weigh the newest step by `ema`.
void test_features() {
  TopologyFeatures f;
  f.update(/*top1=*/0.8, /*path_value=*/0.4, /*entropy=*/2.0, /*accepted=*/0.0, /*ema=*/0.25);
  CHECK(f.seen && f.entropy_ema == 2.0 && f.accept_ema == 0.0);
  f.update(0.6, 0.3, 1.0, 4.0, 0.25);  // entropy .25 * 1 + .75 * 2 = 1.75; accept .25 * 4 = 1
  CHECK(f.top1 == 0.6 && f.path_value == 0.3 && f.entropy_ema == 1.75 && f.accept_ema == 1.0);
  CHECK(f.score("top1") == 0.6 && f.score("path_value") == 0.3 && f.score("accept") == 1.0);
  CHECK(std::abs(f.score("entropy") - std::exp(-1.75)) < 1e-12);
  CHECK(is_topology_feature("entropy") && !is_topology_feature("depth"));
  bool thrown = false;
  try {
    f.score("depth");
  } catch (const std::invalid_argument&) {
    thrown = true;
  }
  CHECK(thrown);
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"worked_example", test_worked_example},
      {"pruning_skips_parent_and_root", test_pruning_skips_parent_and_root},
      {"bad_paths_throw", test_bad_paths_throw},
      {"policies", test_policies},
      {"features", test_features},
  };
  return mtprobe_test::run_tests(tests);
}
