// Unit tests for the STAND drafter's core (csrc/core/ngram_store.h): the n-gram store and the tree.
//
// Build and run (tests/test_core_cpp.py does exactly this):
//   g++ -std=c++17 -O1 -Wall -Wextra -Werror -I csrc csrc/core/*.cpp tests/core/test_stand.cpp -o test_stand
//   ./test_stand
// The same cases run against the Python reference in tests/test_stand_reference.py.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "core/ngram.h"
#include "core/ngram_store.h"
#include "harness.h"

namespace {

using mtprobe::core::build_stand_tree;
using mtprobe::core::NgramStore;
using mtprobe::core::prompt_lookup;

using I64 = std::vector<int64_t>;
using F64 = std::vector<double>;

int64_t size_of(const I64& v) { return static_cast<int64_t>(v.size()); }

bool near(double a, double b) { return std::fabs(a - b) < 1e-6; }

void add(NgramStore& store, const I64& context, const I64& tokens, const std::vector<float>& probs) {
  store.add(context.data(), size_of(context), tokens.data(), probs.data(), size_of(tokens));
}

// lookup() with capacity `cap` (default: the store's top_k), in double precision.
struct Lookup {
  I64 tokens;
  F64 probs;
};
Lookup lookup(const NgramStore& store, const I64& context, int64_t cap = -1) {
  if (cap < 0) cap = store.top_k();
  Lookup out{I64(cap, -7), F64(cap, -7.0)};
  const int64_t n = store.lookup(context.data(), size_of(context), out.tokens.data(), out.probs.data(), cap);
  out.tokens.resize(n);
  out.probs.resize(n);
  return out;
}

bool probs_are(const F64& got, const F64& want) {
  if (got.size() != want.size()) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!near(got[i], want[i])) return false;
  }
  return true;
}

struct Tree {
  I64 tokens;
  I64 parents;
};
Tree tree(const NgramStore& store, const I64& context, int64_t budget, int64_t max_depth) {
  Tree out{I64(budget > 0 ? budget : 0, -7), I64(budget > 0 ? budget : 0, -7)};
  const int64_t n = build_stand_tree(store, context.data(), size_of(context), budget, max_depth,
                                     out.tokens.data(), out.parents.data());
  out.tokens.resize(n);
  out.parents.resize(n);
  return out;
}

// The worked example of ngram_store.h.
NgramStore example_store() {
  NgramStore store(2, 3);
  add(store, {5, 6}, {7, 8}, {0.6f, 0.2f});
  add(store, {6, 7}, {9}, {1.0f});
  add(store, {6, 8}, {9, 7}, {0.5f, 0.5f});
  return store;
}

// One-hot store of a history: every position's next token after the tokens before it.
NgramStore history_store(const I64& seq, int64_t max_ngram, int64_t top_k) {
  NgramStore store(max_ngram, top_k);
  for (int64_t i = 1; i < size_of(seq); ++i) store.add_token(seq.data(), i, seq[i]);
  return store;
}

// --- NgramStore --------------------------------------------------------------------------------

void test_add_lookup_by_hand() {
  NgramStore store(2, 4);
  add(store, {1, 2}, {5, 6}, {0.5f, 0.25f});  // [2], [1 2] += {5: .5, 6: .25}
  add(store, {3, 2}, {6, 7}, {0.5f, 0.25f});  // [2], [3 2] += {6: .5, 7: .25}
  CHECK(store.num_keys() == 3);
  Lookup l = lookup(store, {9, 2});  // [9 2] unknown: [2] = {6: .75, 5: .5, 7: .25} / 1.5
  CHECK((l.tokens == I64{6, 5, 7}));
  CHECK(probs_are(l.probs, {0.5, 1.0 / 3, 1.0 / 6}));
  l = lookup(store, {1, 2});
  CHECK((l.tokens == I64{5, 6}));
  CHECK(probs_are(l.probs, {2.0 / 3, 1.0 / 3}));
  l = lookup(store, {3, 2});
  CHECK((l.tokens == I64{6, 7}));
  CHECK(probs_are(l.probs, {2.0 / 3, 1.0 / 3}));
  CHECK(lookup(store, {4}).tokens.empty());
  CHECK(lookup(store, {}).tokens.empty());
}

void test_add_token_one_hot() {
  NgramStore store(2, 4);
  store.add_token(I64{1, 2}.data(), 2, 3);
  store.add_token(I64{1, 2}.data(), 2, 3);
  store.add_token(I64{1, 2}.data(), 2, 4);
  const Lookup l = lookup(store, {1, 2});
  CHECK((l.tokens == I64{3, 4}));
  CHECK(probs_are(l.probs, {2.0 / 3, 1.0 / 3}));
}

void test_longest_match() {
  NgramStore store(3, 4);
  store.add_token(I64{1, 2, 3}.data(), 3, 4);  // [3], [2 3], [1 2 3] -> 4
  store.add_token(I64{9, 3}.data(), 2, 5);     // [3], [9 3] -> 5
  CHECK((lookup(store, {1, 2, 3}).tokens == I64{4}));
  CHECK((lookup(store, {7, 2, 3}).tokens == I64{4}));  // falls back to [2 3]
  CHECK((lookup(store, {9, 3}).tokens == I64{5}));
  Lookup l = lookup(store, {8, 3});  // falls back to [3] = {4: 1, 5: 1}
  CHECK((l.tokens == I64{4, 5}));
  CHECK(probs_are(l.probs, {0.5, 0.5}));
  CHECK((lookup(store, {3}).tokens == I64{4, 5}));  // context shorter than max_ngram
}

void test_top_k_eviction() {
  NgramStore store(1, 2);
  add(store, {0}, {1, 2, 3}, {0.5f, 0.3f, 0.2f});  // 3 is evicted, its mass dropped
  Lookup l = lookup(store, {0});
  CHECK((l.tokens == I64{1, 2}));
  CHECK(probs_are(l.probs, {0.625, 0.375}));
  add(store, {0}, {3}, {0.4f});  // 3 comes back with .4 only and evicts 2 (.3)
  l = lookup(store, {0});
  CHECK((l.tokens == I64{1, 3}));
  CHECK(probs_are(l.probs, {0.5 / 0.9, 0.4 / 0.9}));
  add(store, {5}, {8, 9, 7}, {0.5f, 0.5f, 0.5f});  // a tie: the lower token ids stay
  CHECK((lookup(store, {5}).tokens == I64{7, 8}));
}

void test_normalisation_and_cap() {
  NgramStore store(1, 8);
  add(store, {0}, {4, 3, 2}, {0.2f, 0.1f, 0.1f});
  Lookup l = lookup(store, {0});
  CHECK((l.tokens == I64{4, 2, 3}));  // 2 and 3 tie: lower id first
  double sum = 0;
  for (double p : l.probs) sum += p;
  CHECK(near(sum, 1.0));
  l = lookup(store, {0}, 1);  // normalised over the whole table, not over what is written
  CHECK((l.tokens == I64{4}));
  CHECK(probs_are(l.probs, {0.5}));
  CHECK(lookup(store, {0}, 0).tokens.empty());
  // The float overload writes the same.
  I64 tokens(3);
  std::vector<float> probs(3);
  CHECK(store.lookup(I64{0}.data(), 1, tokens.data(), probs.data(), 3) == 3);
  CHECK((tokens == I64{4, 2, 3}));
  CHECK(near(probs[0], 0.5) && near(probs[1], 0.25) && near(probs[2], 0.25));
}

void test_ignores_non_positive_probs() {
  NgramStore store(2, 4);
  add(store, {1}, {2, 3}, {0.0f, -1.0f});  // no mass: no key
  CHECK(store.num_keys() == 0);
  CHECK(lookup(store, {1}).tokens.empty());
  add(store, {1}, {2, 3}, {0.0f, 0.5f});
  CHECK((lookup(store, {1}).tokens == I64{3}));
}

void test_bad_arguments_throw() {
  bool threw = false;
  try {
    NgramStore store(0, 4);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  threw = false;
  try {
    NgramStore store(2, 0);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

// --- build_stand_tree --------------------------------------------------------------------------

void test_tree_worked_example() {
  const NgramStore store = example_store();
  const Lookup l = lookup(store, {5, 6});
  CHECK((l.tokens == I64{7, 8}));
  CHECK(probs_are(l.probs, {0.75, 0.25}));
  const Tree t = tree(store, {5, 6}, 4, 3);
  CHECK((t.tokens == I64{7, 9, 8, 7}));
  CHECK((t.parents == I64{-1, 0, -1, 2}));
}

void test_tree_budget_limit() {
  const NgramStore store = example_store();
  Tree t = tree(store, {5, 6}, 2, 3);
  CHECK((t.tokens == I64{7, 9}));
  CHECK((t.parents == I64{-1, 0}));
  t = tree(store, {5, 6}, 10, 3);  // everything: 8 -> 7 -> 9 via the 1-gram [7]
  CHECK((t.tokens == I64{7, 9, 8, 7, 9, 9}));
  CHECK((t.parents == I64{-1, 0, -1, 2, 2, 3}));
  CHECK(tree(store, {5, 6}, 0, 3).tokens.empty());
}

void test_tree_depth_limit() {
  const NgramStore store = example_store();
  Tree t = tree(store, {5, 6}, 10, 1);
  CHECK((t.tokens == I64{7, 8}));
  CHECK((t.parents == I64{-1, -1}));
  t = tree(store, {5, 6}, 10, 2);
  CHECK((t.tokens == I64{7, 9, 8, 7, 9}));
  CHECK((t.parents == I64{-1, 0, -1, 2, 2}));
  CHECK(tree(store, {5, 6}, 10, 0).tokens.empty());
}

void test_tree_no_match() {
  const NgramStore store = example_store();
  CHECK(tree(store, {1, 2}, 4, 3).tokens.empty());
  CHECK(tree(store, {}, 4, 3).tokens.empty());
  CHECK(tree(NgramStore(), {5, 6}, 4, 3).tokens.empty());
}

void test_tree_ties() {
  // History [1 2 3 1 2 4 1 2]: [1 2] -> {3: .5, 4: .5}, [2 3] -> 1, [2 4] -> 1, [3 1] -> 2.
  const NgramStore store = history_store({1, 2, 3, 1, 2, 4, 1, 2}, 2, 4);
  const Tree t = tree(store, {1, 2}, 4, 3);
  // Every score is .5: 3 before 4 (lower token id), 4 before 3 -> 1 (the root is the earlier
  // parent), 3 -> 1 before 4 -> 1 (earlier parent).
  CHECK((t.tokens == I64{3, 4, 1, 1}));
  CHECK((t.parents == I64{-1, -1, 0, 1}));
}

void test_tree_branches_at_budget_equal_depth() {
  // [0] -> {1: .6, 2: .4}, [1] -> {3: .5, 4: .5}: the sibling 2 (.4) outscores 1 -> 3 (.3).
  NgramStore store(1, 4);
  add(store, {0}, {1, 2}, {0.6f, 0.4f});
  add(store, {1}, {3, 4}, {0.5f, 0.5f});
  const Tree t = tree(store, {0}, 2, 2);
  CHECK((t.tokens == I64{1, 2}));
  CHECK((t.parents == I64{-1, -1}));
}

void test_tree_one_hot_chain_is_prompt_lookup() {
  const I64 seq = {5, 6, 7, 8, 5, 6};  // ngram.h's example: prompt lookup drafts [7 8 5]
  const NgramStore store = history_store(seq, 2, 4);
  I64 pld(3);
  CHECK(prompt_lookup(seq.data(), size_of(seq), 2, 3, pld.data()) == 3);
  const Tree t = tree(store, seq, 3, 3);
  CHECK(t.tokens == pld);
  CHECK((t.parents == I64{-1, 0, 1}));
  // Past the history's end prompt lookup stops ([7 8 5 6]); STAND goes round the cycle.
  const Tree longer = tree(store, seq, 6, 6);
  CHECK((longer.tokens == I64{7, 8, 5, 6, 7, 8}));
  CHECK((longer.parents == I64{-1, 0, 1, 2, 3, 4}));
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"add_lookup_by_hand", test_add_lookup_by_hand},
      {"add_token_one_hot", test_add_token_one_hot},
      {"longest_match", test_longest_match},
      {"top_k_eviction", test_top_k_eviction},
      {"normalisation_and_cap", test_normalisation_and_cap},
      {"ignores_non_positive_probs", test_ignores_non_positive_probs},
      {"bad_arguments_throw", test_bad_arguments_throw},
      {"tree_worked_example", test_tree_worked_example},
      {"tree_budget_limit", test_tree_budget_limit},
      {"tree_depth_limit", test_tree_depth_limit},
      {"tree_no_match", test_tree_no_match},
      {"tree_ties", test_tree_ties},
      {"tree_branches_at_budget_equal_depth", test_tree_branches_at_budget_equal_depth},
      {"tree_one_hot_chain_is_prompt_lookup", test_tree_one_hot_chain_is_prompt_lookup},
  };
  return mtprobe_test::run_tests(tests);
}
