// Unit tests for the torch-free C++ core (csrc/core): no torch, no test framework.
//
// Build and run (tests/test_core_cpp.py does exactly this):
//   g++ -std=c++17 -O1 -Wall -Wextra -Werror -I csrc csrc/core/*.cpp tests/core/test_core.cpp -o test_core
//   ./test_core
// Every failed CHECK prints `file:line: expression`; the last line is `N passed, M failed`, counting
// test functions, and the exit status is non-zero when any test function failed.
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "core/kv_compact.h"
#include "core/tree.h"
#include "core/verify.h"
#include "harness.h"

namespace {

using mtprobe::core::ancestor_matrix;
using mtprobe::core::check_compaction;
using mtprobe::core::check_parents;
using mtprobe::core::compact_rows;
using mtprobe::core::fill_tree_mask;
using mtprobe::core::is_chain;
using mtprobe::core::sample_inverse_cdf;
using mtprobe::core::tree_depths;
using mtprobe::core::verify_greedy;
using mtprobe::core::verify_rejection;

using I64 = std::vector<int64_t>;
using U8 = std::vector<uint8_t>;

int64_t size_of(const I64& v) { return static_cast<int64_t>(v.size()); }

// Depths of `parents` as a vector.
I64 depths_of(const I64& parents) {
  I64 depth(parents.size(), -99);
  tree_depths(parents.data(), size_of(parents), depth.data());
  return depth;
}

// Ancestor matrix of `parents`, row-major [n, n]; prefilled with 7 so unwritten bytes show up.
U8 anc_of(const I64& parents) {
  U8 anc(parents.size() * parents.size(), 7);
  ancestor_matrix(parents.data(), size_of(parents), anc.data());
  return anc;
}

// The worked example of tree.h: root r, drafts a, b (children of r), mask m on a.
const I64 kExampleParents = {-1, 0, 0, 1};

// --- check_parents -----------------------------------------------------------------------------

void test_check_parents_valid() {
  const std::vector<I64> valid = {
      {},                         // empty block
      {-1},                       // a single root
      {-1, 0, 1, 2, 3},           // chain
      {-1, 0, 0, 1},              // worked example
      {-1, 0, 0, 0, 0},           // star
      {-1, 0, 0, 0, 1, 1, 2, 3},  // two-level Medusa-like tree
      {-1, -1, 1, -1},            // several inputs may follow the prefix directly
  };
  for (const I64& p : valid) CHECK(check_parents(p.data(), size_of(p)) == "");
}

void test_check_parents_parent_not_earlier() {
  const I64 self0 = {0};  // parents[0] = 0: not earlier than 0
  CHECK_CONTAINS(check_parents(self0.data(), 1), "parents[0] = 0");
  const I64 self = {-1, 0, 2};  // parents[2] = 2: its own parent
  CHECK_CONTAINS(check_parents(self.data(), 3), "parents[2] = 2");
  const I64 later = {-1, 3, 0, 1};  // parents[1] = 3: a later input
  CHECK_CONTAINS(check_parents(later.data(), 4), "parents[1] = 3");
  // Only the first bad entry is named.
  const I64 two_bad = {-1, 0, 5, 7};
  const std::string msg = check_parents(two_bad.data(), 4);
  CHECK_CONTAINS(msg, "parents[2] = 5");
  CHECK(msg.find("parents[3]") == std::string::npos);
  // n bounds the scan: a bad entry past n is not looked at.
  CHECK(check_parents(two_bad.data(), 2) == "");
}

void test_check_parents_parent_below_minus_one() {
  const I64 root = {-2};
  CHECK_CONTAINS(check_parents(root.data(), 1), "parents[0] = -2");
  const I64 inner = {-1, 0, -5, 1};
  CHECK_CONTAINS(check_parents(inner.data(), 4), "parents[2] = -5");
  const I64 first_of_two = {-1, -3, 9};  // the < -1 entry comes first
  const std::string msg = check_parents(first_of_two.data(), 3);
  CHECK_CONTAINS(msg, "parents[1] = -3");
  CHECK(msg.find("parents[2]") == std::string::npos);
}

// --- is_chain ----------------------------------------------------------------------------------

void test_is_chain() {
  const I64 chain = {-1, 0, 1, 2, 3};
  CHECK(is_chain(chain.data(), 5));
  CHECK(is_chain(chain.data(), 1));
  CHECK(is_chain(chain.data(), 0));
  const I64 single = {-1};
  CHECK(is_chain(single.data(), 1));
  CHECK(!is_chain(kExampleParents.data(), 4));
  const I64 star = {-1, 0, 0, 0};
  CHECK(!is_chain(star.data(), 4));
  const I64 two_roots = {-1, -1};
  CHECK(!is_chain(two_roots.data(), 2));
  const I64 chain_then_branch = {-1, 0, 1, 1};  // a chain up to the last entry
  CHECK(is_chain(chain_then_branch.data(), 3));
  CHECK(!is_chain(chain_then_branch.data(), 4));
}

// --- tree_depths and ancestor_matrix -----------------------------------------------------------

void test_tree_worked_example() {
  CHECK(depths_of(kExampleParents) == (I64{0, 1, 1, 2}));
  // The input-input block of the mask in tree.h (1 = attend).
  const U8 expected = {
      1, 0, 0, 0,  // r
      1, 1, 0, 0,  // a
      1, 0, 1, 0,  // b
      1, 1, 0, 1,  // m
  };
  CHECK(anc_of(kExampleParents) == expected);
}

void test_tree_chain() {
  const I64 chain = {-1, 0, 1, 2, 3};
  CHECK(depths_of(chain) == (I64{0, 1, 2, 3, 4}));
  const U8 expected = {
      1, 0, 0, 0, 0,  //
      1, 1, 0, 0, 0,  //
      1, 1, 1, 0, 0,  //
      1, 1, 1, 1, 0,  //
      1, 1, 1, 1, 1,  //
  };
  CHECK(anc_of(chain) == expected);
  // A one-node block.
  CHECK(depths_of(I64{-1}) == (I64{0}));
  CHECK(anc_of(I64{-1}) == (U8{1}));
}

void test_tree_star() {
  const I64 star = {-1, 0, 0, 0, 0};
  CHECK(depths_of(star) == (I64{0, 1, 1, 1, 1}));
  const U8 expected = {
      1, 0, 0, 0, 0,  //
      1, 1, 0, 0, 0,  //
      1, 0, 1, 0, 0,  //
      1, 0, 0, 1, 0,  //
      1, 0, 0, 0, 1,  //
  };
  CHECK(anc_of(star) == expected);
}

void test_tree_medusa_two_level() {
  // Root 0; head 1 proposes 1, 2, 3; head 2 proposes 4, 5 after 1, 6 after 2 and 7 after 3.
  const I64 medusa = {-1, 0, 0, 0, 1, 1, 2, 3};
  CHECK(depths_of(medusa) == (I64{0, 1, 1, 1, 2, 2, 2, 2}));
  const U8 expected = {
      1, 0, 0, 0, 0, 0, 0, 0,  // 0
      1, 1, 0, 0, 0, 0, 0, 0,  // 1
      1, 0, 1, 0, 0, 0, 0, 0,  // 2
      1, 0, 0, 1, 0, 0, 0, 0,  // 3
      1, 1, 0, 0, 1, 0, 0, 0,  // 4
      1, 1, 0, 0, 0, 1, 0, 0,  // 5
      1, 0, 1, 0, 0, 0, 1, 0,  // 6
      1, 0, 0, 1, 0, 0, 0, 1,  // 7
  };
  CHECK(anc_of(medusa) == expected);
}

void test_tree_several_roots() {
  // Two independent chains, both following the prefix directly.
  const I64 forest = {-1, 0, -1, 2};
  CHECK(depths_of(forest) == (I64{0, 1, 0, 1}));
  const U8 expected = {
      1, 0, 0, 0,  //
      1, 1, 0, 0,  //
      0, 0, 1, 0,  //
      0, 0, 1, 1,  //
  };
  CHECK(anc_of(forest) == expected);
}

// --- fill_tree_mask ----------------------------------------------------------------------------

// Fills a mask for the worked example with `prefix` columns and a padded row stride
// (prefix + n + 3), then checks every element: prefix and ancestors `zero`, the rest `neg`,
// padding still `sentinel`; also a guard row after the buffer.
template <typename T>
void check_fill(int64_t prefix, T zero, T neg, T sentinel) {
  const int64_t n = 4;
  const int64_t stride = prefix + n + 3;
  const U8 anc = anc_of(kExampleParents);
  std::vector<T> out(static_cast<size_t>((n + 1) * stride), sentinel);  // + one guard row
  fill_tree_mask<T>(anc.data(), n, prefix, stride, zero, neg, out.data());
  // Expected attend pattern over [prefix | r a b m], written out from tree.h.
  const int attend[4][4] = {{1, 0, 0, 0}, {1, 1, 0, 0}, {1, 0, 1, 0}, {1, 1, 0, 1}};
  for (int64_t i = 0; i < n + 1; ++i) {
    for (int64_t c = 0; c < stride; ++c) {
      const T got = out[static_cast<size_t>(i * stride + c)];
      T want = sentinel;  // padding and the guard row
      if (i < n && c < prefix) want = zero;
      if (i < n && c >= prefix && c < prefix + n) want = attend[i][c - prefix] ? zero : neg;
      if (!(got == want)) {
        std::printf("  fill_tree_mask prefix=%lld: element [%lld, %lld] is wrong\n",
                    static_cast<long long>(prefix), static_cast<long long>(i), static_cast<long long>(c));
      }
      CHECK(got == want);
    }
  }
}

void test_fill_tree_mask_float() {
  const float inf = std::numeric_limits<float>::infinity();
  check_fill<float>(0, 0.0f, -inf, 12345.0f);
  check_fill<float>(3, 0.0f, -inf, 12345.0f);
  check_fill<float>(3, 0.0f, -1e9f, 777.0f);  // a finite "neg"
  // Unpadded rows (row_stride == prefix + n) pack back to back: parents [-1, 0], prefix 1.
  const U8 anc = anc_of(I64{-1, 0});
  std::vector<float> out(7, 5.0f);
  fill_tree_mask<float>(anc.data(), 2, 1, 3, 0.0f, -inf, out.data());
  CHECK(out[0] == 0.0f && out[1] == 0.0f && out[2] == -inf);  // p0 r | a masked
  CHECK(out[3] == 0.0f && out[4] == 0.0f && out[5] == 0.0f);  // p0 r a
  CHECK(out[6] == 5.0f);                                      // nothing past the 2 rows
}

void test_fill_tree_mask_uint16_bits() {
  // Half types go through their raw bits: fp16 -inf = 0xFC00, bf16 -inf = 0xFF80.
  check_fill<uint16_t>(0, 0x0000, 0xFC00, 0xABCD);
  check_fill<uint16_t>(3, 0x0000, 0xFC00, 0xABCD);
  check_fill<uint16_t>(0, 0x0000, 0xFF80, 0x1234);
  check_fill<uint16_t>(3, 0x0000, 0xFF80, 0x1234);
}

// --- verify_greedy -----------------------------------------------------------------------------

// Runs verify_greedy with a path buffer prefilled with -7 and checks nothing is written past the path.
I64 run_verify(const I64& tokens, const I64& parents, const I64& target, int64_t root) {
  const int64_t n = size_of(tokens);
  I64 path(tokens.size(), -7);
  const int64_t len = verify_greedy(tokens.data(), parents.data(), target.data(), n, root, path.data());
  CHECK(len >= 1 && len <= n);
  if (len < 1 || len > n) return {};
  for (int64_t k = len; k < n; ++k) CHECK(path[static_cast<size_t>(k)] == -7);
  return I64(path.begin(), path.begin() + len);
}

void test_verify_branching_second_child() {
  //            0 (10)
  //          /        \.
  //      1 (20)       2 (21)
  //        |         /      \.
  //      3 (30)   4 (31)   5 (32)
  //                 |
  //               6 (40)
  const I64 parents = {-1, 0, 0, 1, 2, 2, 4};
  const I64 tokens = {10, 20, 21, 30, 31, 32, 40};
  // The target picks 21 after the root (second child), 31 after node 2, then 99: not drafted.
  const I64 target = {21, 30, 31, 0, 99, 0, 0};
  CHECK(run_verify(tokens, parents, target, 0) == (I64{0, 2, 4}));
  // Same tree, target follows the first child to the leaf.
  const I64 target_first = {20, 30, 0, 5, 0, 0, 0};
  CHECK(run_verify(tokens, parents, target_first, 0) == (I64{0, 1, 3}));
  // A full-depth acceptance ending at leaf 6.
  const I64 target_deep = {21, 0, 31, 0, 40, 0, 8};
  CHECK(run_verify(tokens, parents, target_deep, 0) == (I64{0, 2, 4, 6}));
}

void test_verify_no_match() {
  const I64 parents = {-1, 0, 0, 1};
  const I64 tokens = {10, 20, 21, 30};
  const I64 target = {77, 30, 0, 0};  // 77 is no child's token; node 3's 30 is not a child of the root
  CHECK(run_verify(tokens, parents, target, 0) == (I64{0}));
  // A one-node block accepts only the root.
  CHECK(run_verify(I64{5}, I64{-1}, I64{5}, 0) == (I64{0}));
}

void test_verify_ties_lowest_index() {
  // Children 1, 2, 3 of the root; 2 and 3 both carry the target's token 20. Only node 3 has a
  // matching child (4), but the lowest index (2) wins, so the path stops at 2.
  const I64 parents = {-1, 0, 0, 0, 3};
  const I64 tokens = {10, 5, 20, 20, 50};
  const I64 target = {20, 0, 0, 50, 0};
  CHECK(run_verify(tokens, parents, target, 0) == (I64{0, 2}));
  // Ties deeper in the tree: children 2 and 3 of node 1 share token 7.
  const I64 parents2 = {-1, 0, 1, 1};
  const I64 tokens2 = {1, 2, 7, 7};
  const I64 target2 = {2, 7, 0, 0};
  CHECK(run_verify(tokens2, parents2, target2, 0) == (I64{0, 1, 2}));
}

void test_verify_root_not_zero() {
  // Nodes 0, 1, 2 are an already-committed chain; the draft tree hangs off node 2.
  //   0 - 1 - 2 ─┬─ 3 (7)
  //              └─ 4 (8) ── 5 (9)
  // Node 6 is a child of 1 whose token matches target[1]: starting at 0 would walk 0-1-6.
  const I64 parents = {-1, 0, 1, 2, 2, 4, 1};
  const I64 tokens = {100, 101, 102, 7, 8, 9, 55};
  const I64 target = {101, 55, 8, 0, 9, 3, 0};
  CHECK(run_verify(tokens, parents, target, 2) == (I64{2, 4, 5}));
  CHECK(run_verify(tokens, parents, target, 0) == (I64{0, 1, 6}));
  // Root is the last node: nothing to walk.
  CHECK(run_verify(tokens, parents, target, 6) == (I64{6}));
}

// --- verify_rejection ---------------------------------------------------------------------------

// The worked example of verify.h: p_0 = [0.6, 0.4], node 1 drafted 1 from q_1 = [0.2, 0.8].
void test_verify_rejection_chain_example() {
  const I64 tokens = {7, 1}, parents = {-1, 0};
  const std::vector<float> p = {0.6f, 0.4f, 0.5f, 0.5f};  // [2, 2]
  const std::vector<float> q = {0.2f, 0.8f};              // [1, 2]
  std::vector<float> residual(2);
  I64 path(2);
  int64_t token = -1;
  // u_1 = 0.3 < 0.4 / 0.8: accepted; the bonus is drawn from p_1 with u = 0.9 -> token 1.
  const std::vector<double> accept = {0.0, 0.3, 0.9};
  CHECK(verify_rejection(tokens.data(), parents.data(), 2, p.data(), q.data(), 2, accept.data(),
                         residual.data(), path.data(), &token) == 2);
  CHECK(path[1] == 1 && token == 1);
  // u_1 = 0.7: rejected; residual normalise(max([0.6, 0.4] - [0.2, 0.8], 0)) = [1, 0] -> token 0 for any u.
  const std::vector<double> reject = {0.0, 0.7, 0.99};
  CHECK(verify_rejection(tokens.data(), parents.data(), 2, p.data(), q.data(), 2, reject.data(),
                         residual.data(), path.data(), &token) == 1);
  CHECK(token == 0);
  CHECK(residual[0] == 1.0f && residual[1] == 0.0f);
}

// Two siblings drawn from one q: after the first is rejected the second is tested against the residual.
void test_verify_rejection_siblings() {
  const I64 tokens = {9, 0, 1}, parents = {-1, 0, 0};
  // vocab 3; p_0 = [0.1, 0.6, 0.3], q = [0.5, 0.25, 0.25] for both children.
  const std::vector<float> p = {0.1f, 0.6f, 0.3f, 1, 0, 0, 0, 1, 0};
  const std::vector<float> q = {0.5f, 0.25f, 0.25f, 0.5f, 0.25f, 0.25f};
  std::vector<float> residual(3);
  I64 path(3);
  int64_t token = -1;
  // Child 1 (token 0): r[0] / q[0] = 0.2; u = 0.5 rejects. r = normalise([0, 0.35, 0.05]) = [0, 0.875,
  // 0.125]. Child 2 (token 1): r[1] / q[1] = 3.5 -> accepted; its bonus from p_2 = [0, 1, 0] is 1.
  const std::vector<double> u = {0, 0.5, 0.99, 0.5};
  CHECK(verify_rejection(tokens.data(), parents.data(), 3, p.data(), q.data(), 3, u.data(), residual.data(),
                         path.data(), &token) == 2);
  CHECK(path[1] == 2 && token == 1);
}

// No draft at all: the output is a plain draw from p_0.
void test_verify_rejection_root_only() {
  const I64 tokens = {3}, parents = {-1};
  const std::vector<float> p = {0.25f, 0.25f, 0.5f};
  std::vector<float> residual(3);
  I64 path(1);
  int64_t token = -1;
  const std::vector<double> u = {0, 0.6};
  CHECK(verify_rejection(tokens.data(), parents.data(), 1, p.data(), nullptr, 3, u.data(), residual.data(),
                         path.data(), &token) == 1);
  CHECK(token == 2);  // cumulative [0.25, 0.5, 1.0], 0.6 falls in the third
}

void test_sample_inverse_cdf() {
  const std::vector<float> w = {0, 2, 0, 1, 0};  // unnormalised, zeros are never drawn
  CHECK(sample_inverse_cdf(w.data(), 5, 0.0) == 1);
  CHECK(sample_inverse_cdf(w.data(), 5, 0.66) == 1);
  CHECK(sample_inverse_cdf(w.data(), 5, 0.67) == 3);
  CHECK(sample_inverse_cdf(w.data(), 5, 0.999999) == 3);
}

// --- check_compaction --------------------------------------------------------------------------

void test_check_compaction_valid() {
  CHECK(check_compaction(nullptr, 0, 0, 0) == "");  // nothing to move
  const I64 in_place = {2, 3, 4};
  CHECK(check_compaction(in_place.data(), 3, 2, 5) == "");  // already in place
  const I64 gaps = {2, 4, 7};
  CHECK(check_compaction(gaps.data(), 3, 2, 8) == "");  // root stays, 4 -> 3, 7 -> 4
  const I64 adjacent = {3, 4, 5};
  CHECK(check_compaction(adjacent.data(), 3, 2, 6) == "");  // shift down by one
  const I64 from_zero = {5, 6};
  CHECK(check_compaction(from_zero.data(), 2, 0, 7) == "");
}

void test_check_compaction_not_increasing() {
  const I64 equal = {3, 5, 5};
  const std::string m1 = check_compaction(equal.data(), 3, 2, 8);
  CHECK_CONTAINS(m1, "strictly increasing");
  CHECK_CONTAINS(m1, "src[2] = 5");
  const I64 decreasing = {3, 7, 6};
  const std::string m2 = check_compaction(decreasing.data(), 3, 2, 8);
  CHECK_CONTAINS(m2, "strictly increasing");
  CHECK_CONTAINS(m2, "src[2] = 6");
}

void test_check_compaction_below_destination() {
  const I64 first = {1, 4};  // src[0] = 1 < dst_start = 2
  const std::string m1 = check_compaction(first.data(), 2, 2, 8);
  CHECK_CONTAINS(m1, "below its destination");
  CHECK_CONTAINS(m1, "src[0] = 1");
  const I64 later = {2, 3, 3};  // src[2] = 3 < 2 + 2
  const std::string m2 = check_compaction(later.data(), 3, 2, 8);
  CHECK_CONTAINS(m2, "below its destination");
  CHECK_CONTAINS(m2, "src[2] = 3");
  const I64 negative = {-1};
  CHECK_CONTAINS(check_compaction(negative.data(), 1, 0, 8), "src[0] = -1");
}

void test_check_compaction_past_seq_len() {
  const I64 past = {2, 3, 8};
  const std::string m1 = check_compaction(past.data(), 3, 2, 8);  // row 8 of an 8-row cache
  CHECK_CONTAINS(m1, "past the cache length 8");
  CHECK_CONTAINS(m1, "src[2] = 8");
  CHECK(check_compaction(past.data(), 3, 2, 9) == "");  // one more row and it is fine
}

void test_check_compaction_negative_dst_start() {
  const I64 src = {0, 1};
  CHECK_CONTAINS(check_compaction(src.data(), 2, -1, 8), "dst_start = -1");
  CHECK_CONTAINS(check_compaction(nullptr, 0, -3, 8), "dst_start = -3");
}

// --- compact_rows ------------------------------------------------------------------------------

constexpr int64_t kOuter = 2, kRows = 8, kWidth = 3;

// [outer = 2, rows = 8, 3 ints]; element (b, r, k) = 1000 * b + 10 * r + k.
std::vector<int32_t> make_cache() {
  std::vector<int32_t> cache(static_cast<size_t>(kOuter * kRows * kWidth));
  for (int64_t b = 0; b < kOuter; ++b)
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t k = 0; k < kWidth; ++k)
        cache[static_cast<size_t>((b * kRows + r) * kWidth + k)] =
            static_cast<int32_t>(1000 * b + 10 * r + k);
  return cache;
}

// Compacts a fresh cache and compares it with the expected contents, given as the original row
// each row should now hold (the same for both blocks).
void check_compact(const I64& src, int64_t dst_start, const int64_t (&row_from)[kRows]) {
  CHECK(check_compaction(src.data(), size_of(src), dst_start, kRows) == "");
  std::vector<int32_t> cache = make_cache();
  const int64_t row_bytes = kWidth * static_cast<int64_t>(sizeof(int32_t));
  compact_rows(reinterpret_cast<char*>(cache.data()), kOuter, kRows * row_bytes, row_bytes, row_bytes,
               src.data(), size_of(src), dst_start);
  for (int64_t b = 0; b < kOuter; ++b) {
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t k = 0; k < kWidth; ++k) {
        const int32_t got = cache[static_cast<size_t>((b * kRows + r) * kWidth + k)];
        const int32_t want = static_cast<int32_t>(1000 * b + 10 * row_from[r] + k);
        if (got != want) {
          std::printf("  compact_rows dst_start=%lld: [%lld, %lld, %lld] = %d, want %d\n",
                      static_cast<long long>(dst_start), static_cast<long long>(b), static_cast<long long>(r),
                      static_cast<long long>(k), got, want);
        }
        CHECK(got == want);
      }
    }
  }
}

void test_compact_rows_gaps() {
  // Prefix of 2, accepted path rows 2 (root, src == dst: no-op), 4, 7 -> rows 2, 3, 4.
  const int64_t row_from[kRows] = {0, 1, 2, 4, 7, 5, 6, 7};
  check_compact(I64{2, 4, 7}, 2, row_from);
}

void test_compact_rows_adjacent_overlap() {
  // Rows 3, 4, 5 move down by one to 2, 3, 4: each destination is the previous source.
  const int64_t row_from[kRows] = {0, 1, 3, 4, 5, 5, 6, 7};
  check_compact(I64{3, 4, 5}, 2, row_from);
}

void test_compact_rows_noop() {
  // Every src == dst: nothing moves.
  const int64_t identity[kRows] = {0, 1, 2, 3, 4, 5, 6, 7};
  check_compact(I64{0, 1, 2}, 0, identity);
  check_compact(I64{}, 3, identity);
}

void test_compact_rows_padded_stride() {
  // Rows of 3 ints in a 4-int row stride: the 4th int of each row is never copied.
  const int64_t stride_ints = 4;
  std::vector<int32_t> cache(static_cast<size_t>(kOuter * kRows * stride_ints));
  for (size_t e = 0; e < cache.size(); ++e) cache[e] = static_cast<int32_t>(e);
  const std::vector<int32_t> before = cache;
  const I64 src = {5, 6};
  const int64_t row_stride = stride_ints * static_cast<int64_t>(sizeof(int32_t));
  compact_rows(reinterpret_cast<char*>(cache.data()), kOuter, kRows * row_stride, row_stride,
               3 * static_cast<int64_t>(sizeof(int32_t)), src.data(), 2, 1);
  for (int64_t b = 0; b < kOuter; ++b) {
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t from = r == 1 ? 5 : r == 2 ? 6 : r;
      for (int64_t k = 0; k < stride_ints; ++k) {
        const size_t at = static_cast<size_t>((b * kRows + r) * stride_ints + k);
        const size_t want_at = static_cast<size_t>((b * kRows + (k < 3 ? from : r)) * stride_ints + k);
        CHECK(cache[at] == before[want_at]);
      }
    }
  }
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"check_parents_valid", test_check_parents_valid},
      {"check_parents_parent_not_earlier", test_check_parents_parent_not_earlier},
      {"check_parents_parent_below_minus_one", test_check_parents_parent_below_minus_one},
      {"is_chain", test_is_chain},
      {"tree_worked_example", test_tree_worked_example},
      {"tree_chain", test_tree_chain},
      {"tree_star", test_tree_star},
      {"tree_medusa_two_level", test_tree_medusa_two_level},
      {"tree_several_roots", test_tree_several_roots},
      {"fill_tree_mask_float", test_fill_tree_mask_float},
      {"fill_tree_mask_uint16_bits", test_fill_tree_mask_uint16_bits},
      {"verify_branching_second_child", test_verify_branching_second_child},
      {"verify_no_match", test_verify_no_match},
      {"verify_ties_lowest_index", test_verify_ties_lowest_index},
      {"verify_root_not_zero", test_verify_root_not_zero},
      {"verify_rejection_chain_example", test_verify_rejection_chain_example},
      {"verify_rejection_siblings", test_verify_rejection_siblings},
      {"verify_rejection_root_only", test_verify_rejection_root_only},
      {"sample_inverse_cdf", test_sample_inverse_cdf},
      {"check_compaction_valid", test_check_compaction_valid},
      {"check_compaction_not_increasing", test_check_compaction_not_increasing},
      {"check_compaction_below_destination", test_check_compaction_below_destination},
      {"check_compaction_past_seq_len", test_check_compaction_past_seq_len},
      {"check_compaction_negative_dst_start", test_check_compaction_negative_dst_start},
      {"compact_rows_gaps", test_compact_rows_gaps},
      {"compact_rows_adjacent_overlap", test_compact_rows_adjacent_overlap},
      {"compact_rows_noop", test_compact_rows_noop},
      {"compact_rows_padded_stride", test_compact_rows_padded_stride},
  };
  return mtprobe_test::run_tests(tests);
}
