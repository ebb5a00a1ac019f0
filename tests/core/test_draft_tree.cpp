// csrc/core/draft_tree.h: the hybrid's tree merge and mask plan, their worked examples, and the
// plan's invariants on random trees (under the sanitizers of tests/test_core_cpp.py). The plan's
// optimum is checked against the Python reference in tests/test_hybrid.py.
#include <cstdint>
#include <random>
#include <vector>

#include "core/draft_tree.h"
#include "harness.h"

using namespace mtprobe::core;

namespace {

std::vector<DraftNode> tree_of(const std::vector<int64_t>& tokens, const std::vector<int64_t>& parents,
                               const std::vector<double>& probs) {
  std::vector<DraftNode> out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    out.push_back({tokens[i], parents[i], parents[i] < 0 ? 0 : out[static_cast<size_t>(parents[i])].depth + 1,
                   probs[i]});
  }
  return out;
}

void test_merge_header_example() {
  auto a = tree_of({7, 5, 9}, {-1, 0, 0}, {1.0, 0.6, 0.3});
  auto b = tree_of({7, 5, 4, 2}, {-1, 0, 1, 0}, {1.0, 1.0, 1.0, 0.2});
  auto m = merge_draft_trees(a, b, 4);
  CHECK(m.size() == 4);
  const int64_t tokens[] = {7, 5, 9, 4}, parents[] = {-1, 0, 0, 1};
  const double probs[] = {1.0, 1.0, 0.3, 1.0};
  for (size_t i = 0; i < m.size() && i < 4; ++i) {
    CHECK(m[i].token == tokens[i]);
    CHECK(m[i].parent == parents[i]);
    CHECK(m[i].prob == probs[i]);
  }
}

void test_plan_header_example() {
  auto t = tree_of({7, 5, 4, 9}, {-1, 0, 1, 0}, {1.0, 0.9, 0.8, 0.01});
  MaskPlan plan = plan_mask_carriers(t, 5, 1, 0.3);
  CHECK(plan.nodes.size() == 3);
  CHECK((plan.carries == std::vector<bool>{true, false, true}));
  CHECK(plan.nodes.size() == 3 && plan.nodes[2].token == 4 && plan.nodes[2].parent == 1);
  CHECK(plan_mask_carriers({}, 5, 1, 0.3).nodes.empty());
}

void test_plan_invariants_on_random_trees() {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<DraftNode> t{{9, -1, 0, 1.0}};
    const int64_t n = static_cast<int64_t>(rng() % 30);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t parent = static_cast<int64_t>(rng() % t.size());
      const double p = t[static_cast<size_t>(parent)].prob * static_cast<double>(rng() % 5) / 4.0;
      t.push_back({static_cast<int64_t>(rng() % 4), parent, t[static_cast<size_t>(parent)].depth + 1, p});
    }
    const int64_t inputs = 1 + static_cast<int64_t>(rng() % 40), k = 1 + static_cast<int64_t>(rng() % 3);
    const double value = static_cast<double>(rng() % 9) / 4.0;
    MaskPlan plan = plan_mask_carriers(t, inputs, k, value);
    int64_t carriers = 0;
    for (bool c : plan.carries) carriers += c;
    CHECK(plan.carries.size() == plan.nodes.size());
    CHECK(!plan.nodes.empty() && plan.nodes[0].parent == -1);
    CHECK(static_cast<int64_t>(plan.nodes.size()) + k * carriers <= inputs);
    for (size_t i = 1; i < plan.nodes.size(); ++i) {
      CHECK(plan.nodes[i].parent >= 0 && plan.nodes[i].parent < static_cast<int64_t>(i));
    }
  }
}

void test_mask_source_header_example() {
  // k = 2, masks on the root (block index 3, inputs 9-10) only.
  std::vector<int64_t> mask_input(7, -1);
  mask_input[3] = 9;
  MaskSource none = mask_source({3, 5, 6}, mask_input, 2);
  CHECK(none.first == -1 && none.shift == 0);
  MaskSource up = mask_source({3, 5}, mask_input, 2);
  CHECK(up.first == 9 && up.shift == 1);
  MaskSource own = mask_source({3}, mask_input, 2);
  CHECK(own.first == 9 && own.shift == 0);
  mask_input[6] = 11;  // the last node's own masks win over any ancestor's
  MaskSource last = mask_source({3, 5, 6}, mask_input, 2);
  CHECK(last.first == 11 && last.shift == 0);
  CHECK(mask_source({}, mask_input, 2).first == -1);
  CHECK(mask_source({3, 40}, mask_input, 2).first == 9);  // an index past the table: no masks there
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"merge_header_example", test_merge_header_example},
      {"plan_header_example", test_plan_header_example},
      {"plan_invariants_on_random_trees", test_plan_invariants_on_random_trees},
      {"mask_source_header_example", test_mask_source_header_example},
  };
  return mtprobe_test::run_tests(tests);
}
