#include "core/tree.h"

#include <cstring>

namespace mtprobe::core {

std::string check_parents(const int64_t* parents, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (parents[i] < -1 || parents[i] >= i) {
      return "parents[" + std::to_string(i) + "] = " + std::to_string(parents[i]) +
             ": every parent must be -1 or an earlier input (in [-1, " + std::to_string(i - 1) + "])";
    }
  }
  return "";
}

bool is_chain(const int64_t* parents, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (parents[i] != i - 1) return false;
  }
  return true;
}

void tree_depths(const int64_t* parents, int64_t n, int64_t* depth_out) {
  // parents[i] < i, so one forward sweep sees every parent before its children.
  for (int64_t i = 0; i < n; ++i) depth_out[i] = parents[i] < 0 ? 0 : depth_out[parents[i]] + 1;
}

void ancestor_matrix(const int64_t* parents, int64_t n, uint8_t* anc) {
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* row = anc + i * n;
    if (parents[i] < 0) {
      std::memset(row, 0, static_cast<size_t>(n));
    } else {
      std::memcpy(row, anc + parents[i] * n, static_cast<size_t>(n));
    }
    row[i] = 1;
  }
}

void ancestor_bits(const int64_t* parents, int64_t n, uint64_t* bits) {
  const int64_t words = ancestor_words(n);
  for (int64_t i = 0; i < n; ++i) {
    uint64_t* row = bits + i * words;
    if (parents[i] < 0) {
      std::memset(row, 0, static_cast<size_t>(words) * sizeof(uint64_t));
    } else {
      std::memcpy(row, bits + parents[i] * words, static_cast<size_t>(words) * sizeof(uint64_t));
    }
    row[i / 64] |= uint64_t{1} << (i % 64);
  }
}

}  // namespace mtprobe::core
