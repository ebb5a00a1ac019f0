// Draft-block structure: which inputs of one forward attend to which.
//
// A draft block is T inputs fed to the target model in one forward, after a KV prefix of
// P cached positions. Input i has a parent parents[i] in [-1, i-1] (-1: it follows the
// prefix directly). It attends to the whole prefix, to its ancestors and to itself, and
// sits at position P + depth(i). This is "causal attention along every root-to-leaf path":
// a chain (parents = [-1, 0, 1, ...]) is ordinary causal attention.
//
// Worked example (P = 2, T = 4): root r, drafts a, b (children of r), mask m on a.
//   parents = [-1, 0, 0, 1]      depth = [0, 1, 1, 2]      positions = [2, 3, 3, 4]
//   mask (1 = attend)   p0 p1 | r a b m
//                  r     1  1 | 1 0 0 0
//                  a     1  1 | 1 1 0 0
//                  b     1  1 | 1 0 1 0
//                  m     1  1 | 1 1 0 1
//
// Torch-free: raw pointers in, raw pointers out. C++17.
#pragma once

#include <cstdint>
#include <string>

namespace mtprobe::core {

// Returns "" when parents[i] is in [-1, i-1] for every i, else a message naming the first bad entry.
std::string check_parents(const int64_t* parents, int64_t n);

// True when parents == [-1, 0, 1, ..., n-2]: the block is a chain and plain causal masking applies.
bool is_chain(const int64_t* parents, int64_t n);

// depth[i] = 0 for parents[i] == -1, else depth[parents[i]] + 1.  depth_out: [n]
void tree_depths(const int64_t* parents, int64_t n, int64_t* depth_out);

// anc[i * n + j] = 1 when input i attends to input j (j is i or an ancestor of i).  anc: [n, n]
// Row i copies its parent's row and sets its own bit: O(n^2) bytes, no per-node search.
void ancestor_matrix(const int64_t* parents, int64_t n, uint8_t* anc);

// The compact form of the same pattern: words = ceil(n / 64) 64-bit words per row; bit (j % 64) of
// bits[i * words + j / 64] is set when input i attends to input j. [n, words] instead of [n, n].
// Example, parents [-1 0 0 1]: rows 0b0001, 0b0011, 0b0101, 0b1011.
inline int64_t ancestor_words(int64_t n) { return (n + 63) / 64; }
void ancestor_bits(const int64_t* parents, int64_t n, uint64_t* bits);

// Fills an additive mask for one block: rows [n], each of `prefix + n` columns starting at
// out + i * row_stride. Prefix columns and ancestors get `zero`, the rest `neg`.
// T is the element type; for half types pass their raw bit patterns through uint16_t.
template <typename T>
void fill_tree_mask(const uint8_t* anc, int64_t n, int64_t prefix, int64_t row_stride, T zero, T neg,
                    T* out) {
  for (int64_t i = 0; i < n; ++i) {
    T* row = out + i * row_stride;
    for (int64_t j = 0; j < prefix; ++j) row[j] = zero;
    const uint8_t* a = anc + i * n;
    for (int64_t j = 0; j < n; ++j) row[prefix + j] = a[j] ? zero : neg;
  }
}

}  // namespace mtprobe::core
