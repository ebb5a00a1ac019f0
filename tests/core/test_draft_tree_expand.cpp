// csrc/core/draft_tree_expand.h: the dynamic tree run by several host threads sharing one
// workspace (as the threads of a CUDA block do) gives exactly the serial result, and never needs
// more candidates than dynamic_tree_capacity. tests/test_draft_tree.py checks the serial result
// against the Python reference.
#include <cstdint>
#include <random>
#include <vector>

#include "core/draft_tree.h"
#include "core/draft_tree_expand.h"
#include "harness.h"
#include "thread_exec.h"

using namespace mtprobe::core;

namespace {

struct Tree {
  std::vector<int64_t> tokens, parents;
  std::vector<double> probs;
  int64_t num_nodes = 0, candidates = 0;
};

Tree expand(int threads, int64_t root, const std::vector<int64_t>& tok, const std::vector<float>& prob,
            int64_t depths, int64_t m, int64_t budget, bool prune) {
  const int64_t cap = dynamic_tree_capacity(depths, m, budget);
  std::vector<double> scratch(dynamic_tree_workspace_bytes(cap, budget) / sizeof(double) + 1);
  const DynamicTreeWorkspace w = carve_dynamic_tree_workspace(scratch.data(), cap, budget);
  Tree t;
  t.tokens.assign(budget, 99), t.parents.assign(budget, 99), t.probs.assign(budget, 99.0);
  if (threads == 0) {
    t.num_nodes = expand_dynamic_tree(SerialExec{}, root, tok.data(), prob.data(), depths, m, budget, prune,
                                      w, t.tokens.data(), t.parents.data(), t.probs.data());
  } else {
    std::vector<int64_t> results(threads, -1);
    mtprobe_test::run_threads(threads, [&](const mtprobe_test::ThreadExec& ex) {
      results[ex.tid] = expand_dynamic_tree(ex, root, tok.data(), prob.data(), depths, m, budget, prune, w,
                                            t.tokens.data(), t.parents.data(), t.probs.data());
    });
    t.num_nodes = results[0];
    for (int64_t r : results) CHECK(r == t.num_nodes);  // every thread returns the count
  }
  t.candidates = w.counts[0];
  CHECK(t.candidates <= cap);
  return t;
}

void test_header_example() {
  // draft_tree.h: root 7, depth 1: 5 (.6), 9 (.3), 3 (.1); depth 2: 4 (.5), 6 (.3), 8 (.2); budget 4.
  const std::vector<int64_t> tok{5, 9, 3, 4, 6, 8};
  const std::vector<float> prob{0.6f, 0.3f, 0.1f, 0.5f, 0.3f, 0.2f};
  for (int threads : {0, 1, 3}) {
    Tree t = expand(threads, 7, tok, prob, 2, 3, 4, false);
    CHECK(t.num_nodes == 4);
    CHECK((t.tokens == std::vector<int64_t>{7, 5, 9, 4}));
    CHECK((t.parents == std::vector<int64_t>{-1, 0, 0, 1}));
  }
  // A larger budget pads the outputs after the tree.
  Tree t = expand(0, 7, tok, prob, 1, 3, 6, false);
  CHECK(t.num_nodes == 4);
  CHECK((t.tokens == std::vector<int64_t>{7, 5, 9, 3, -1, -1}));
  CHECK((t.parents == std::vector<int64_t>{-1, 0, 0, 0, -1, -1}));
  CHECK(t.probs[4] == 0.0 && t.probs[5] == 0.0);
}

void test_threads_match_serial() {
  std::mt19937 gen(7);
  int cases = 0;
  for (int64_t depths = 1; depths <= 4; ++depths) {
    for (int64_t budget : {1, 2, 3, 5, 8, 12, 20, 30}) {
      for (int rep = 0; rep < 6; ++rep) {
        const int64_t m = 1 + static_cast<int64_t>(gen() % static_cast<uint32_t>(budget + 2));
        const bool prune = rep % 2 == 0;
        // Few distinct tokens and probabilities: the pruner fires and ranks tie often.
        std::vector<int64_t> tok(depths * m);
        std::vector<float> prob(depths * m);
        for (int64_t d = 0; d < depths; ++d) {
          float p = 1.0f;
          for (int64_t r = 0; r < m; ++r) {
            tok[d * m + r] = gen() % 6;
            p *= (gen() % 3 == 0) ? 1.0f : 0.5f;  // non-increasing, with exact ties
            prob[d * m + r] = p;
          }
        }
        const int64_t root = gen() % 6;
        const Tree serial = expand(0, root, tok, prob, depths, m, budget, prune);
        CHECK(serial.num_nodes >= 1 && serial.num_nodes <= budget);
        CHECK(serial.tokens[0] == root && serial.parents[0] == -1);
        for (int threads : {2, 3, 8, 32}) {
          const Tree par = expand(threads, root, tok, prob, depths, m, budget, prune);
          CHECK(par.num_nodes == serial.num_nodes);
          CHECK(par.tokens == serial.tokens);
          CHECK(par.parents == serial.parents);
          CHECK(par.probs == serial.probs);
          CHECK(par.candidates == serial.candidates);
        }
        // The vector API is the same algorithm.
        const auto nodes = build_dynamic_tree(root, tok.data(), prob.data(), depths, m, budget, prune);
        CHECK(static_cast<int64_t>(nodes.size()) == serial.num_nodes);
        for (size_t i = 0; i < nodes.size(); ++i) {
          CHECK(nodes[i].token == serial.tokens[i] && nodes[i].parent == serial.parents[i]);
        }
        ++cases;
      }
    }
  }
  CHECK(cases == 4 * 8 * 6);
}

void test_capacity_is_reached() {
  // Uniform candidates, no pruning: every frontier node gets min(m, budget - d) children, so the
  // bound is tight at depth 1 and 2.
  const int64_t budget = 6, m = 10, depths = 2;
  std::vector<int64_t> tok(depths * m);
  std::vector<float> prob(depths * m, 0.1f);
  for (int64_t i = 0; i < depths * m; ++i) tok[i] = 100 + i;
  const Tree t = expand(0, 1, tok, prob, depths, m, budget, false);
  // depth 1: 5 children; next frontier: the best 5 (all depth 1); depth 2: 5 x 4.
  CHECK(dynamic_tree_capacity(depths, m, budget) == 1 + 5 + 5 * 4);
  CHECK(t.candidates == 1 + 5 + 5 * 4);
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"header_example", test_header_example},
      {"threads_match_serial", test_threads_match_serial},
      {"capacity_is_reached", test_capacity_is_reached},
  };
  return mtprobe_test::run_tests(tests);
}
