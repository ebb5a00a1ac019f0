// Attention mask and position ids of one draft block, built incrementally (seed 001, App. E).
//
// For a block of T inputs after a prefix of P cached positions the mask is [1, 1, T, P + T]:
// all-zero prefix columns followed by the block's own [T, T] tree pattern. Between two steps with
// the same tree shape only P changes, so the builder keeps one buffer [T, capacity + T] whose
// last T columns hold the tree pattern and whose other columns are zero, and returns the view of
// its last P + T columns: "prepending" P columns costs nothing on the CPU (on a GPU the view is
// copied once per step, since attention kernels there need an aligned mask). Position ids are the cached
// depths plus P: one add. The builder keeps the patterns of the last few shapes it met (EntMTP's
// bank switches among a handful of static trees: switching back to one is a lookup, not a rebuild);
// a new shape rewrites the least recently used pattern (O(T^2) on the host), and only a new block
// size T refills a whole buffer.
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

  static constexpr size_t kMaxPatterns = 8;  // shapes kept at once

 private:
  struct Pattern {
    std::vector<int64_t> parents;  // the shape
    at::Tensor buffer;             // [T, capacity + T], or the ancestor bits [1, 1, T, ceil(T / 64)]
    at::Tensor depths;             // [1, T] int64 on device
    int64_t last_used = 0;
  };
  // The pattern of this shape: the cached one, or the least recently used one rebuilt for it.
  Pattern& pattern(const std::vector<int64_t>& parents);
  void rebuild(Pattern& p, const std::vector<int64_t>& parents);

  int64_t capacity_;
  at::ScalarType dtype_;
  at::Device device_;
  bool incremental_;
  bool ancestor_bits_;
  std::vector<Pattern> patterns_;  // at most kMaxPatterns
  int64_t clock_ = 0;
  int64_t rebuilds_ = 0;
};

}  // namespace mtprobe
