// csrc/core/draft_tree_expand.h: the dynamic tree run by several host threads sharing one
// workspace (as the threads of a CUDA block do) gives exactly the serial result, and never needs
// more candidates than dynamic_tree_capacity. tests/test_draft_tree.py checks the serial result
// against the Python reference; here a C++ transliteration of that reference checks it too, up to
// budgets of 2000 (millions of candidates: the ranking must be O(C log C), not O(C^2)). exec.h's
// sorts: the parallel merge sort (what a CUDA block runs) equals std::sort.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
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

// python/mtprobe/reference/draft_tree.py's dynamic_tree, line by line (a full sort per ranking),
// padded to the budget like the workspace version.
Tree reference_tree(int64_t root, const std::vector<int64_t>& tok, const std::vector<float>& prob,
                    int64_t depths, int64_t m, int64_t budget, bool prune) {
  struct Cand {
    int64_t token, parent, depth;
    double prob;
  };
  std::vector<Cand> cand{{root, -1, 0, 1.0}};
  std::vector<char> used{1};  // picked for expansion once (Alg. 1: C <- C \ N)
  auto ranked = [&](bool skip_used) {
    std::vector<int64_t> idx;
    for (int64_t i = 1; i < static_cast<int64_t>(cand.size()); ++i) {
      if (!(skip_used && used[i])) idx.push_back(i);
    }
    std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) {  // key (-prob, depth, index)
      if (cand[a].prob != cand[b].prob) return cand[a].prob > cand[b].prob;
      if (cand[a].depth != cand[b].depth) return cand[a].depth < cand[b].depth;
      return a < b;
    });
    return idx;
  };
  std::vector<int64_t> frontier{0};
  for (int64_t d = 1; d <= depths && budget - d > 0; ++d) {
    for (int64_t n : frontier) {
      int64_t taken = 0;
      for (int64_t r = 0; r < m && taken < budget - d; ++r) {
        const int64_t t = tok[(d - 1) * m + r];
        if (prune && (t == cand[n].token || t == root)) continue;
        cand.push_back({t, n, d, cand[n].prob * static_cast<double>(prob[(d - 1) * m + r])});
        used.push_back(0);
        ++taken;
      }
    }
    if (d < depths) {
      std::vector<int64_t> picked = ranked(true);
      picked.resize(std::min<size_t>(picked.size(), budget - d));
      frontier.clear();
      for (int64_t i : picked) {
        used[i] = 1;
        if (cand[i].depth == d) frontier.push_back(i);
      }
    }
  }
  std::vector<int64_t> kept;
  std::vector<char> is_kept(cand.size(), 0);
  is_kept[0] = 1;
  for (int64_t i : ranked(false)) {
    if (static_cast<int64_t>(kept.size()) >= budget - 1) break;
    if (is_kept[cand[i].parent]) kept.push_back(i), is_kept[i] = 1;
  }
  std::stable_sort(kept.begin(), kept.end(),
                   [&](int64_t a, int64_t b) { return cand[a].depth < cand[b].depth; });
  std::vector<int64_t> new_index(cand.size(), -1);
  new_index[0] = 0;
  Tree t;
  t.tokens.assign(budget, -1), t.parents.assign(budget, -1), t.probs.assign(budget, 0.0);
  t.tokens[0] = root, t.probs[0] = 1.0;
  for (size_t k = 0; k < kept.size(); ++k) {
    const Cand& c = cand[kept[k]];
    new_index[kept[k]] = static_cast<int64_t>(k) + 1;
    t.tokens[k + 1] = c.token, t.parents[k + 1] = new_index[c.parent], t.probs[k + 1] = c.prob;
  }
  t.num_nodes = 1 + static_cast<int64_t>(kept.size());
  t.candidates = static_cast<int64_t>(cand.size());
  return t;
}

bool same_tree(const Tree& a, const Tree& b) {
  return a.num_nodes == b.num_nodes && a.tokens == b.tokens && a.parents == b.parents && a.probs == b.probs &&
         a.candidates == b.candidates;
}

// Candidates as the op makes them: each depth's tokens distinct (drawn from `vocab`), probabilities
// non-increasing, on a grid of 1/`levels` so that cumulative probabilities tie often.
void op_like_candidates(std::mt19937& gen, int64_t depths, int64_t m, int64_t vocab, int levels,
                        std::vector<int64_t>* tok, std::vector<float>* prob) {
  tok->assign(depths * m, 0), prob->assign(depths * m, 0.0f);
  std::vector<int64_t> ids(vocab);
  for (int64_t d = 0; d < depths; ++d) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int64_t r = 0; r < m; ++r) {  // a partial Fisher-Yates shuffle: m distinct tokens
      std::swap(ids[r], ids[r + static_cast<int64_t>(gen() % static_cast<uint32_t>(vocab - r))]);
    }
    std::vector<int> grid(m);
    for (int& g : grid) g = 1 + static_cast<int>(gen() % static_cast<uint32_t>(levels));
    std::sort(grid.begin(), grid.end(), std::greater<int>());
    for (int64_t r = 0; r < m; ++r) {
      (*tok)[d * m + r] = ids[r];
      (*prob)[d * m + r] = static_cast<float>(grid[r]) / static_cast<float>(levels);
    }
  }
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
        CHECK(same_tree(serial, reference_tree(root, tok, prob, depths, m, budget, prune)));
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

void test_any_input_matches_reference() {
  // Inputs the op never makes: probabilities in any order, above 1 (a child can outrank its parent:
  // the parent check of step 3 fires), zero or negative (signed zeros tie), repeated tokens. Larger
  // budgets than above, with ties everywhere.
  std::mt19937 gen(11);
  const float values[] = {0.5f, 1.0f, 2.0f, 0.25f, 0.0f, -0.0f, -0.5f};
  for (int64_t depths = 1; depths <= 5; ++depths) {
    for (int64_t budget : {2, 4, 9, 17, 40, 75}) {
      for (int rep = 0; rep < 3; ++rep) {
        const int64_t m = 1 + static_cast<int64_t>(gen() % static_cast<uint32_t>(budget + 3));
        const bool prune = rep != 1;
        std::vector<int64_t> tok(depths * m);
        std::vector<float> prob(depths * m);
        for (int64_t i = 0; i < depths * m; ++i) {
          tok[i] = gen() % 5;
          prob[i] = values[gen() % (rep == 2 ? 7 : 4)];
        }
        const int64_t root = gen() % 5;
        const Tree serial = expand(0, root, tok, prob, depths, m, budget, prune);
        CHECK(same_tree(serial, reference_tree(root, tok, prob, depths, m, budget, prune)));
        for (int threads : {2, 3, 8})
          CHECK(same_tree(expand(threads, root, tok, prob, depths, m, budget, prune), serial));
      }
    }
  }
}

void test_nan_ranks_last() {
  // Broken inputs (NaN, inf: inf * 0 is NaN too) still give one well-formed tree, the same on every
  // executor: the rank order puts NaN last, so it stays a strict total order for the sorts.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float values[] = {0.5f, nan, inf, 0.0f, 1.0f, 0.25f};
  std::mt19937 gen(13);
  for (int64_t budget : {3, 8, 20, 60}) {
    for (int rep = 0; rep < 4; ++rep) {
      const int64_t depths = 1 + rep, m = budget + 1;
      std::vector<int64_t> tok(depths * m);
      std::vector<float> prob(depths * m);
      for (int64_t i = 0; i < depths * m; ++i) tok[i] = gen() % 9, prob[i] = values[gen() % 6];
      const Tree serial = expand(0, 3, tok, prob, depths, m, budget, true);
      CHECK(serial.num_nodes >= 1 && serial.num_nodes <= budget && serial.tokens[0] == 3);
      for (int64_t i = 1; i < serial.num_nodes; ++i) CHECK(serial.parents[i] >= 0 && serial.parents[i] < i);
      for (int threads : {2, 5}) {
        const Tree par = expand(threads, 3, tok, prob, depths, m, budget, true);
        CHECK(par.num_nodes == serial.num_nodes && par.tokens == serial.tokens &&
              par.parents == serial.parents);
        for (int64_t i = 0; i < budget; ++i) {  // NaN != NaN: compare bits
          CHECK(std::memcmp(&par.probs[i], &serial.probs[i], sizeof(double)) == 0);
        }
      }
    }
  }
}

void test_large_budgets() {
  // Budgets of 1000 and 2000, every node as wide as the budget allows: up to 12 million candidates.
  // Ranking them pairwise (O(C^2)) would not finish; sorting takes about a second. The tree is the
  // reference's, exactly; threads check the parallel sort on the smaller ones.
  struct Case {
    int64_t budget, depths;
    bool reference;
    int threads;
  };
  const Case cases[] = {{1000, 2, true, 2}, {1000, 3, true, 0},  {1000, 4, false, 0},
                        {2000, 2, true, 0}, {2000, 3, false, 0}, {2000, 4, false, 0}};
  std::mt19937 gen(5);
  for (const Case& c : cases) {
    const int64_t m = c.budget + 1, vocab = 4 * c.budget;
    std::vector<int64_t> tok;
    std::vector<float> prob;
    op_like_candidates(gen, c.depths, m, vocab, 64, &tok, &prob);
    const int64_t root = tok[0];  // a pruned candidate at every depth it appears in
    const Tree t = expand(0, root, tok, prob, c.depths, m, c.budget, true);
    CHECK(t.num_nodes == c.budget);
    CHECK(t.candidates > c.budget * c.budget / 2);
    CHECK(t.tokens[0] == root && t.parents[0] == -1);
    for (int64_t i = 1; i < t.num_nodes; ++i) {  // parents first, no path gains probability
      CHECK(t.parents[i] >= 0 && t.parents[i] < i && t.probs[i] <= t.probs[t.parents[i]]);
    }
    if (c.reference) CHECK(same_tree(t, reference_tree(root, tok, prob, c.depths, m, c.budget, true)));
    if (c.threads > 0) CHECK(same_tree(expand(c.threads, root, tok, prob, c.depths, m, c.budget, true), t));
  }
}

void test_sorts_match_std_sort() {
  // Keys with few distinct values, ties broken by the key: a strict total order, one right answer.
  std::mt19937 gen(3);
  for (int64_t n : {0, 1, 2, 3, 5, 8, 31, 64, 100, 1000, 4097}) {
    std::vector<int32_t> value(n);
    for (auto& v : value) v = static_cast<int32_t>(gen() % 7);
    auto less = [&value](int64_t a, int64_t b) { return value[a] != value[b] ? value[a] > value[b] : a < b; };
    std::vector<int32_t> keys(n);
    std::iota(keys.begin(), keys.end(), 0);
    std::shuffle(keys.begin(), keys.end(), gen);
    std::vector<int32_t> expected = keys;
    std::sort(expected.begin(), expected.end(), less);
    for (int threads : {0, 1, 2, 3, 8}) {
      std::vector<int32_t> got = keys, tmp(n);
      if (threads == 0) {
        exec_parallel_sort(SerialExec{}, got.data(), tmp.data(), n, less);
        CHECK(got == expected);
        got = keys;
        exec_sort(SerialExec{}, got.data(), tmp.data(), n, less);  // std::sort
      } else {
        mtprobe_test::run_threads(threads, [&](const mtprobe_test::ThreadExec& ex) {
          exec_sort(ex, got.data(), tmp.data(), n, less);
        });
      }
      CHECK(got == expected);
      // Merge the sorted halves of `expected` split by parity: the whole of it.
      std::vector<int32_t> a, b, out(n);
      for (int32_t k : expected) (k % 2 ? a : b).push_back(k);
      const int64_t na = static_cast<int64_t>(a.size()), nb = static_cast<int64_t>(b.size());
      if (threads == 0) {
        exec_merge(SerialExec{}, a.data(), na, b.data(), nb, out.data(), less);  // std::merge
        CHECK(out == expected);
        std::fill(out.begin(), out.end(), -1);
        exec_parallel_merge(SerialExec{}, a.data(), na, b.data(), nb, out.data(), less);
      } else {
        mtprobe_test::run_threads(threads, [&](const mtprobe_test::ThreadExec& ex) {
          exec_merge(ex, a.data(), na, b.data(), nb, out.data(), less);
        });
      }
      CHECK(out == expected);
    }
  }
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
  // Sizes past the int32 indices saturate, and the vector API refuses them.
  CHECK(dynamic_tree_capacity(3, 1 << 20, 1 << 20) == kMaxDynamicTreeCandidates + 1);
  CHECK(dynamic_tree_capacity(4, 2, int64_t{1} << 62) == kMaxDynamicTreeCandidates + 1);
  CHECK(dynamic_tree_capacity(2, 50000, 40000) == 1 + 39999 + 39999 * 39998);
  bool threw = false;
  try {
    build_dynamic_tree(0, tok.data(), prob.data(), 3, 1 << 20, 1 << 20, false);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  // Width past budget + 1 never changes the op's tree (distinct tokens: the pruner skips two at most).
  CHECK(dynamic_tree_width(5, 10) == 5 && dynamic_tree_width(11, 10) == 11 &&
        dynamic_tree_width(50, 10) == 11);
  std::mt19937 gen(9);
  for (int64_t budget : {1, 2, 5, 9}) {
    const int64_t wide = 20, narrow = dynamic_tree_width(wide, budget), d = 3;
    std::vector<int64_t> wt;
    std::vector<float> wp;
    op_like_candidates(gen, d, wide, 30, 4, &wt, &wp);
    std::vector<int64_t> nt;
    std::vector<float> np;
    for (int64_t k = 0; k < d; ++k) {
      nt.insert(nt.end(), wt.begin() + k * wide, wt.begin() + k * wide + narrow);
      np.insert(np.end(), wp.begin() + k * wide, wp.begin() + k * wide + narrow);
    }
    for (int64_t root : {wt[0], wt[1], int64_t{29}}) {
      const Tree a = expand(0, root, wt, wp, d, wide, budget, true),
                 b = expand(0, root, nt, np, d, narrow, budget, true);
      CHECK(a.num_nodes == b.num_nodes && a.tokens == b.tokens && a.parents == b.parents &&
            a.probs == b.probs);
    }
  }
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"header_example", test_header_example},
      {"threads_match_serial", test_threads_match_serial},
      {"capacity_is_reached", test_capacity_is_reached},
      {"any_input_matches_reference", test_any_input_matches_reference},
      {"nan_ranks_last", test_nan_ranks_last},
      {"large_budgets", test_large_budgets},
      {"sorts_match_std_sort", test_sorts_match_std_sort},
  };
  return mtprobe_test::run_tests(tests);
}
