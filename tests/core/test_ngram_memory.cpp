// Unit tests for the cross-request n-gram memory (csrc/core/ngram_store.h, NgramMemory): folding,
// the LRU bound, lookups, and build_stand_tree reading it beside a per-request store.
//
// Build and run (tests/test_core_cpp.py does exactly this):
//   g++ -std=c++17 -O1 -Wall -Wextra -Werror -I csrc csrc/core/*.cpp tests/core/test_ngram_memory.cpp -o t
//   ./t
// The Python reference (mtprobe.reference.stand.NgramMemory) is compared with it in tests/test_stand.py.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/ngram_store.h"
#include "harness.h"

namespace {

using mtprobe::core::build_stand_tree;
using mtprobe::core::NgramMemory;
using mtprobe::core::NgramStore;

using I64 = std::vector<int64_t>;
using F64 = std::vector<double>;
using Keys = std::vector<I64>;

int64_t size_of(const I64& v) { return static_cast<int64_t>(v.size()); }

void fold(NgramMemory& memory, const I64& text) { memory.fold(text.data(), size_of(text)); }

struct Lookup {
  I64 tokens;
  F64 probs;
};
Lookup lookup(NgramMemory& memory, const I64& context, int64_t cap = 8) {
  Lookup out{I64(cap, -7), F64(cap, -7.0)};
  const int64_t n = memory.lookup(context.data(), size_of(context), out.tokens.data(), out.probs.data(), cap);
  out.tokens.resize(n);
  out.probs.resize(n);
  return out;
}

bool probs_are(const F64& got, const F64& want) {
  if (got.size() != want.size()) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::fabs(got[i] - want[i]) > 1e-12) return false;
  }
  return true;
}

struct Tree {
  I64 tokens;
  I64 parents;
};
Tree tree(const NgramStore& store, NgramMemory* memory, const I64& context, int64_t budget, int64_t depth) {
  Tree out{I64(budget, -7), I64(budget, -7)};
  const int64_t n = build_stand_tree(store, context.data(), size_of(context), budget, depth,
                                     out.tokens.data(), out.parents.data(), nullptr, memory);
  out.tokens.resize(n);
  out.parents.resize(n);
  return out;
}

// The worked example of ngram_store.h, step by step.
void test_worked_example_eviction_order() {
  NgramMemory memory(3, 1, 8);
  fold(memory, {1, 2, 3, 1, 4});
  CHECK((memory.keys() == Keys{{2}, {3}, {1}}));
  const Lookup one = lookup(memory, {1});
  CHECK((one.tokens == I64{2, 4}));               // equal counts: the lower token id first
  CHECK(probs_are(one.probs, {0.25, 0.25}));      // c / (total + distinct): 1 / (2 + 2)
  CHECK((memory.keys() == Keys{{2}, {3}, {1}}));  // [1] was already the most recent
  fold(memory, {5, 2});
  CHECK((memory.keys() == Keys{{3}, {1}, {5}}));  // [2] evicted
  CHECK(lookup(memory, {2}).tokens.empty());
  const Lookup three = lookup(memory, {3});
  CHECK((three.tokens == I64{1}));
  CHECK(probs_are(three.probs, {0.5}));           // seen once: 1 / (1 + 1), a guess, not a certainty
  CHECK((memory.keys() == Keys{{1}, {5}, {3}}));  // the lookup made [3] the most recent
  fold(memory, {6, 1});
  CHECK((memory.keys() == Keys{{5}, {3}, {6}}));  // [1] evicted
  CHECK(memory.size() == 3);
}

void test_capacity_bound() {
  for (int64_t capacity : {1, 2, 7, 50}) {
    NgramMemory memory(capacity, 3, 4);
    I64 text;
    uint64_t x = 12345;
    for (int i = 0; i < 400; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      text.push_back(static_cast<int64_t>((x >> 33) % 11));
    }
    fold(memory, text);
    CHECK(memory.size() == capacity);
    CHECK(static_cast<int64_t>(memory.keys().size()) == capacity);
    // The last key written is the most recent: the 3-gram before the last token.
    CHECK((memory.keys().back() == I64(text.end() - 4, text.end() - 1)));
  }
  // Folding the same text again adds counts, not keys.
  NgramMemory memory(100, 2, 8);
  fold(memory, {1, 2, 3});
  const int64_t keys = memory.size();  // [1] [2] [1 2]
  CHECK(keys == 3);
  fold(memory, {1, 2, 3});
  CHECK(memory.size() == keys);
  const Lookup l = lookup(memory, {1, 2});
  CHECK((l.tokens == I64{3}));
}

void test_lookup_after_fold() {
  NgramMemory memory(100, 2, 2);
  fold(memory, {4, 5, 6, 4, 5, 7, 4, 5, 6, 9, 5, 8});
  // [4 5] -> 6 twice, 7 once; top_k 2 keeps both: 2 / (3 + 2), 1 / (3 + 2).
  Lookup l = lookup(memory, {0, 4, 5});
  CHECK((l.tokens == I64{6, 7}));
  CHECK(probs_are(l.probs, {0.4, 0.2}));
  // [9 5] has its own key (-> 8); the longest match wins over [5] (6, 7, 6, 8 -> top 2: 6, 7).
  l = lookup(memory, {9, 5});
  CHECK((l.tokens == I64{8}));
  l = lookup(memory, {3, 5});  // only the 1-gram [5] matches; its table was trimmed to 2 entries
  CHECK((l.tokens == I64{6, 7}));
  CHECK(probs_are(l.probs, {0.4, 0.2}));
  l = lookup(memory, {4, 5}, 1);  // cap: normalised over the whole table all the same
  CHECK((l.tokens == I64{6}));
  CHECK(probs_are(l.probs, {0.4}));
  CHECK(lookup(memory, {42}).tokens.empty());
  CHECK(lookup(memory, {}).tokens.empty());
  CHECK(memory.hits() == 4);  // four lookups returned a table
  memory.clear();
  CHECK(memory.size() == 0);
  CHECK(memory.hits() == 0);
  CHECK(lookup(memory, {4, 5}).tokens.empty());
  fold(memory, {});  // empty and one-token texts hold no transition
  fold(memory, {3});
  CHECK(memory.size() == 0);
}

void test_bad_capacity_throws() {
  for (int64_t capacity : {0, -1}) {
    bool threw = false;
    try {
      NgramMemory memory(capacity);
    } catch (const std::invalid_argument& e) {
      threw = true;
      CHECK_CONTAINS(e.what(), "capacity must be >= 1");
      CHECK_CONTAINS(e.what(), "got " + std::to_string(capacity));
    }
    CHECK(threw);
  }
  bool threw = false;
  try {
    NgramMemory memory(4, 0, 8);
  } catch (const std::invalid_argument& e) {
    threw = true;
    CHECK_CONTAINS(e.what(), "max_ngram and top_k must be >= 1");
  }
  CHECK(threw);
}

// build_stand_tree: the longest key of either store; at equal length the per-request store's.
void test_tree_reads_the_memory() {
  NgramStore store(2, 4);
  NgramMemory memory(100, 2, 4);
  fold(memory, {1, 2, 3, 4, 5});
  // The per-request store knows nothing: the whole chain comes from the memory.
  Tree t = tree(store, &memory, {9, 1, 2}, 10, 10);
  CHECK((t.tokens == I64{3, 4, 5}));
  CHECK((t.parents == I64{-1, 0, 1}));
  CHECK(tree(store, nullptr, {9, 1, 2}, 10, 10).tokens.empty());
  // A 1-gram in the store against the memory's 2-gram [1 2]: the longer key, the memory's, wins.
  const float one = 1.0f;
  const I64 ctx{2};
  const int64_t seven = 7;
  store.add(ctx.data(), 1, &seven, &one, 1);
  t = tree(store, &memory, {9, 1, 2}, 1, 1);
  CHECK((t.tokens == I64{3}));
  // The same 2-gram in both: the store's table.
  const I64 ctx2{1, 2};
  store.add(ctx2.data(), 2, &seven, &one, 1);
  t = tree(store, &memory, {9, 1, 2}, 1, 1);
  CHECK((t.tokens == I64{7}));
  // Without a memory the tree is the store's alone.
  CHECK((tree(store, nullptr, {9, 1, 2}, 1, 1).tokens == I64{7}));
}

void test_deterministic() {
  NgramMemory a(5, 2, 3), b(5, 2, 3);
  for (NgramMemory* m : {&a, &b}) {
    fold(*m, {1, 2, 3, 1, 2, 4});
    fold(*m, {7, 1, 2, 3});
  }
  CHECK(a.keys() == b.keys());
  CHECK((lookup(a, {1, 2}).tokens == lookup(b, {1, 2}).tokens));
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"worked_example_eviction_order", test_worked_example_eviction_order},
      {"capacity_bound", test_capacity_bound},
      {"lookup_after_fold", test_lookup_after_fold},
      {"bad_capacity_throws", test_bad_capacity_throws},
      {"tree_reads_the_memory", test_tree_reads_the_memory},
      {"deterministic", test_deterministic},
  };
  return mtprobe_test::run_tests(tests);
}
