// Several linear layers of one input (q, k and v; gate and up) as one range of output columns, so that one
// parallel region splits them across the threads: a step pays one fork and join for them, and a small
// layer (k, v) leaves no thread idle. Used by TargetForward and QuantizedDecoder.
#pragma once

#include <algorithm>
#include <cstdint>

namespace mtprobe {

// Layer i's columns are [first[i], first[i + 1]) of the range [0, total()); at most kMax layers.
struct LayerColumns {
  static constexpr int64_t kMax = 4;
  int64_t count = 0;
  int64_t first[kMax + 1] = {0};

  // The next layer, of `width` output columns (at most kMax layers).
  void add(int64_t width) {
    first[count + 1] = first[count] + width;
    ++count;
  }
  int64_t total() const { return first[count]; }
  // fn(i, from, to) for each layer i whose columns [from, to) (its own numbering) meet [begin, end).
  template <typename Fn>
  void each(int64_t begin, int64_t end, Fn&& fn) const {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t from = std::max(begin, first[i]) - first[i], to = std::min(end, first[i + 1]) - first[i];
      if (from < to) fn(i, from, to);
    }
  }
};

}  // namespace mtprobe
