// Unit tests for lookahead decoding's core (csrc/core/lookahead.h): the n-gram pool, the guess
// tree and the Jacobi window, on hand-computed cases (the same cases run against the Python
// reference in tests/test_lookahead.py).
//
// Build and run (tests/test_core_cpp.py does exactly this):
//   g++ -std=c++17 -O1 -Wall -Wextra -Werror -I csrc csrc/core/*.cpp tests/core/test_lookahead.cpp -o t
//   ./t
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "core/lookahead.h"
#include "harness.h"

namespace {

using mtprobe::core::build_guess_tree;
using mtprobe::core::LookaheadPool;
using mtprobe::core::LookaheadWindow;

using I64 = std::vector<int64_t>;

I64 lookup(const LookaheadPool& pool, int64_t key) {
  I64 out(static_cast<size_t>(pool.guess_set_size() * (pool.ngram_size() - 1)), -7);
  out.resize(static_cast<size_t>(pool.lookup(key, out.data()) * (pool.ngram_size() - 1)));
  return out;
}

void add(LookaheadPool& pool, const I64& ngram) { pool.add(ngram.data()); }

void test_pool_order_and_eviction() {
  LookaheadPool pool(3, 2);
  CHECK(lookup(pool, 5).empty());
  add(pool, {5, 1, 2});
  add(pool, {5, 1, 3});
  CHECK((lookup(pool, 5) == I64{1, 2, 1, 3}));  // oldest first
  add(pool, {5, 1, 2});                         // a repeat moves to the newest place
  CHECK((lookup(pool, 5) == I64{1, 3, 1, 2}));
  add(pool, {5, 4, 4});  // full: the oldest, [1 3], goes
  CHECK((lookup(pool, 5) == I64{1, 2, 4, 4}));
  add(pool, {6, 5, 1});
  CHECK((lookup(pool, 6) == I64{5, 1}));
  CHECK(pool.num_keys() == 2);
}

void test_pool_bad_arguments_throw() {
  bool threw = false;
  try {
    LookaheadPool(1, 2);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  threw = false;
  try {
    LookaheadPool(3, 0);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

struct Tree {
  I64 tokens;
  I64 parents;
};
Tree guess_tree(const I64& flat, int64_t count, int64_t length, int64_t max_depth) {
  Tree t{I64(flat.size(), -7), I64(flat.size(), -7)};
  const int64_t n =
      build_guess_tree(flat.data(), count, length, max_depth, t.tokens.data(), t.parents.data());
  t.tokens.resize(static_cast<size_t>(n));
  t.parents.resize(static_cast<size_t>(n));
  return t;
}

void test_guess_tree_merges_prefixes() {
  // [1 2], [1 3], [4 4]: the two guesses starting with 1 share it.
  const Tree t = guess_tree({1, 2, 1, 3, 4, 4}, 3, 2, 2);
  CHECK((t.tokens == I64{1, 2, 3, 4, 4}));
  CHECK((t.parents == I64{-1, 0, 0, -1, 3}));
  // A duplicate adds nothing; depth 1 keeps the distinct first tokens.
  CHECK((guess_tree({1, 2, 1, 2}, 2, 2, 2).tokens == I64{1, 2}));
  const Tree cut = guess_tree({1, 2, 1, 3, 4, 4}, 3, 2, 1);
  CHECK((cut.tokens == I64{1, 4}));
  CHECK((cut.parents == I64{-1, -1}));
  CHECK(guess_tree({1, 2}, 1, 2, 0).tokens.empty());
  CHECK(guess_tree({}, 0, 2, 2).tokens.empty());
}

void test_window_reset_and_layout() {
  // L = 3, W = 3, prompt [7 8 9 10]: cell k = l W + j gets prompt[k mod 4].
  LookaheadWindow w(3, 3);
  const I64 prompt{7, 8, 9, 10};
  w.reset(prompt.data(), 4);
  CHECK(w.num_cells() == 5);
  CHECK(w.max_depth() == 3);
  I64 tokens(5), parents(5);
  w.layout(tokens.data(), parents.data());
  // cells (0,1) (0,2) (1,0) (1,1) (1,2); (1,0) hangs from the root, (1,j) from (0,j).
  CHECK((tokens == I64{8, 9, 10, 7, 8}));
  CHECK((parents == I64{-1, 0, -1, 0, 1}));
  CHECK(w.cell_index(0, 0) == -1);
  CHECK(w.cell_index(1, 2) == 4);
}

void test_window_update_shifts_and_pools_once_warm() {
  // The example of lookahead.h: L = 3, W = 3.
  LookaheadWindow w(3, 3);
  LookaheadPool pool(3, 4);
  const I64 prompt{7, 8, 9, 10};
  w.reset(prompt.data(), 4);
  const I64 n1{1, 2, 3}, n2{4, 5, 6}, n3{11, 12, 13};
  w.update(6, n1.data(), pool);  // cold: level 0 <- level 1 (columns 1, 2), level 1 <- next
  CHECK(w.cell(0, 1) == 7 && w.cell(0, 2) == 8);
  CHECK(w.cell(1, 0) == 1 && w.cell(1, 1) == 2 && w.cell(1, 2) == 3);
  CHECK(pool.num_keys() == 0);
  w.update(1, n2.data(), pool);  // still cold (level 0 held prompt tokens)
  CHECK(pool.num_keys() == 0);
  CHECK(w.cell(0, 1) == 2 && w.cell(0, 2) == 3);
  w.update(4, n3.data(), pool);  // warm: columns (4 4 11), (2 5 12), (3 6 13)
  CHECK(w.updates() == 3);
  CHECK((lookup(pool, 4) == I64{4, 11}));
  CHECK((lookup(pool, 2) == I64{5, 12}));
  CHECK((lookup(pool, 3) == I64{6, 13}));
  CHECK(w.cell(0, 1) == 5 && w.cell(0, 2) == 6);
  CHECK(w.cell(1, 0) == 11 && w.cell(1, 2) == 13);
}

void test_window_two_levels_is_jacobi() {
  // L = 2: one level, the root and W - 1 guesses; next[j] moves to column j (one position on).
  LookaheadWindow w(2, 3);
  LookaheadPool pool(2, 2);
  const I64 prompt{7, 8};
  w.reset(prompt.data(), 2);
  I64 tokens(2), parents(2);
  w.layout(tokens.data(), parents.data());
  CHECK((tokens == I64{8, 7}));
  CHECK((parents == I64{-1, 0}));  // a chain: plain Jacobi decoding's window
  const I64 n1{1, 2, 3}, n2{4, 5, 6};
  w.update(9, n1.data(), pool);
  CHECK(w.cell(0, 1) == 2 && w.cell(0, 2) == 3);
  w.update(1, n2.data(), pool);  // warm: (1 4), (2 5), (3 6)
  CHECK((lookup(pool, 1) == I64{4}));
  CHECK((lookup(pool, 2) == I64{5}));
  CHECK((lookup(pool, 3) == I64{6}));
}

void test_window_bad_arguments_throw() {
  bool threw = false;
  try {
    LookaheadWindow(1, 3);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  threw = false;
  try {
    LookaheadWindow(3, 0);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  threw = false;
  LookaheadWindow w(3, 2);
  try {
    w.reset(nullptr, 0);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"pool_order_and_eviction", test_pool_order_and_eviction},
      {"pool_bad_arguments_throw", test_pool_bad_arguments_throw},
      {"guess_tree_merges_prefixes", test_guess_tree_merges_prefixes},
      {"window_reset_and_layout", test_window_reset_and_layout},
      {"window_update_shifts_and_pools_once_warm", test_window_update_shifts_and_pools_once_warm},
      {"window_two_levels_is_jacobi", test_window_two_levels_is_jacobi},
      {"window_bad_arguments_throw", test_window_bad_arguments_throw},
  };
  return mtprobe_test::run_tests(tests);
}
