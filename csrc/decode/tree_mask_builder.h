// Attention mask and position ids of one draft block, built incrementally (seed 001, App. E).
//
// For a block of T inputs after a prefix of P cached positions the mask is [1, 1, T, P + T]:
// all-zero prefix columns followed by the block's own [T, T] tree pattern. Between two steps with
// the same tree shape only P changes, so the builder keeps one buffer [T, capacity + T] whose
// last T columns hold the tree pattern and whose other columns are zero, and returns the view of
// its last P + T columns: "prepending" P columns costs nothing. Position ids are the cached
// depths plus P: one add. A new shape rewrites the pattern (O(T^2) on the host); only a new block
// size T refills the whole buffer.
// The naive mode rebuilds both from scratch every step, for comparison.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace mtprobe {

struct BlockInputs {
  at::Tensor position_ids;  // [1, T] int64
  // [1, 1, T, P + T] additive, or [1, 1, T, ceil(T / 64)] int64 ancestor bits, or none for a chain
  std::optional<at::Tensor> mask;
};

class TreeMaskBuilder {
 public:
  // capacity: the prefix length the mask buffer first holds; a longer prefix doubles it.
  // ancestor_bits: return the tree as ancestor bits [1, 1, T, ceil(T / 64)] int64 (csrc/core/tree.h)
  // instead of the dense additive mask, for the "mtprobe_tree" attention implementation.
  TreeMaskBuilder(int64_t capacity, at::ScalarType dtype, at::Device device, bool incremental,
                  bool ancestor_bits = false);

  BlockInputs build(const std::vector<int64_t>& parents, int64_t prefix_len);

  int64_t rebuilds() const { return rebuilds_; }
  int64_t capacity() const { return capacity_; }

 private:
  void rebuild(const std::vector<int64_t>& parents);

  int64_t capacity_;
  at::ScalarType dtype_;
  at::Device device_;
  bool incremental_;
  bool ancestor_bits_;
  std::vector<int64_t> parents_;  // shape of the cached pattern
  at::Tensor buffer_;             // [T, capacity + T], or the ancestor bits [1, 1, T, ceil(T / 64)]
  at::Tensor depths_;             // [1, T] int64 on device
  int64_t rebuilds_ = 0;
};

}  // namespace mtprobe
