#include "decode/tree_mask_builder.h"

#include <algorithm>

#include "core/tree.h"
#include "ops/ops.h"

namespace mtprobe {

TreeMaskBuilder::TreeMaskBuilder(int64_t capacity, at::ScalarType dtype, at::Device device, bool incremental,
                                 bool ancestor_bits)
    : capacity_(capacity),
      dtype_(dtype),
      device_(device),
      incremental_(incremental),
      ancestor_bits_(ancestor_bits) {}

void TreeMaskBuilder::rebuild(Pattern& p, const std::vector<int64_t>& parents) {
  const int64_t T = static_cast<int64_t>(parents.size());
  std::vector<int64_t> dep(static_cast<size_t>(T));
  core::tree_depths(parents.data(), T, dep.data());
  // Host buffer filled by the torch-free core, then moved to the model's device once per shape.
  if (ancestor_bits_) {
    at::Tensor bits = at::empty({1, 1, T, core::ancestor_words(T)}, at::TensorOptions().dtype(at::kLong));
    core::ancestor_bits(parents.data(), T, reinterpret_cast<uint64_t*>(bits.data_ptr<int64_t>()));
    p.buffer = bits.to(device_);  // [1, 1, T, ceil(T / 64)]
  } else {
    std::vector<uint8_t> anc(static_cast<size_t>(T * T));  // [T, T] row attends column
    core::ancestor_matrix(parents.data(), T, anc.data());
    if (p.buffer.defined() && p.buffer.size(0) == T) {
      // Same block size: the prefix columns are zeros already; rewrite only the [T, T] pattern.
      at::Tensor host = at::empty({T, T}, at::TensorOptions().dtype(dtype_));  // [T, T]
      ops::fill_mask_rows(anc, T, 0, host);
      p.buffer.narrow(1, capacity_, T).copy_(host);
    } else {
      at::Tensor host =
          at::empty({T, capacity_ + T}, at::TensorOptions().dtype(dtype_));  // [T, capacity + T]
      ops::fill_mask_rows(anc, T, capacity_, host);
      p.buffer = host.to(device_);
    }
  }
  p.depths = at::tensor(dep, at::kLong).view({1, T}).to(device_);
  p.parents = parents;
  ++rebuilds_;
}

TreeMaskBuilder::Pattern& TreeMaskBuilder::pattern(const std::vector<int64_t>& parents) {
  ++clock_;
  for (Pattern& p : patterns_) {
    if (p.parents == parents) {
      p.last_used = clock_;
      return p;
    }
  }
  if (patterns_.size() < kMaxPatterns) {
    patterns_.emplace_back();
  } else {
    // Evict the least recently used shape, preferring one of the same block size: its buffer is
    // reused and only the [T, T] pattern is rewritten (dynamic trees change shape every step).
    const auto T = static_cast<int64_t>(parents.size());
    auto older = [](const Pattern& a, const Pattern& b) { return a.last_used < b.last_used; };
    auto victim = std::min_element(patterns_.begin(), patterns_.end(), older);
    auto same_size = patterns_.end();
    for (auto it = patterns_.begin(); it != patterns_.end(); ++it) {
      if (static_cast<int64_t>(it->parents.size()) == T &&
          (same_size == patterns_.end() || older(*it, *same_size)))
        same_size = it;
    }
    if (same_size != patterns_.end()) victim = same_size;
    std::iter_swap(victim, patterns_.end() - 1);
  }
  Pattern& p = patterns_.back();
  rebuild(p, parents);
  p.last_used = clock_;
  return p;
}

BlockInputs TreeMaskBuilder::build(const std::vector<int64_t>& parents, int64_t prefix_len) {
  const int64_t T = static_cast<int64_t>(parents.size());
  TORCH_CHECK(prefix_len >= 0, "prefix_len must be >= 0, got ", prefix_len);
  if (prefix_len > capacity_) {
    // Memory follows the sequence: double the prefix columns (amortised O(1) per token); the
    // next tree block refills its buffer at the new width.
    capacity_ = std::max(prefix_len, 2 * capacity_);
    if (!ancestor_bits_) patterns_.clear();  // ancestor bits do not depend on the prefix
  }
  if (core::is_chain(parents.data(), T)) {
    // A chain is plain causal attention: let the model build its own (cheaper) causal mask.
    return {at::arange(prefix_len, prefix_len + T, at::TensorOptions().dtype(at::kLong).device(device_))
                .view({1, T}),
            std::nullopt};
  }
  if (!ancestor_bits_ && !incremental_) {
    at::Tensor par = at::tensor(parents, at::kLong);
    return {ops::tree_position_ids(par, prefix_len).to(device_),
            ops::tree_attention_mask(par, prefix_len, dtype_).to(device_)};
  }
  const Pattern& p = pattern(parents);
  if (ancestor_bits_) return {p.depths + prefix_len, p.buffer};  // the compact pattern does not depend on P
  // The last prefix_len + T columns of the buffer: zeros for the prefix, then the tree pattern.
  const int64_t width = capacity_ + T;
  at::Tensor mask = p.buffer.as_strided({1, 1, T, prefix_len + T}, {T * width, T * width, width, 1},
                                        p.buffer.storage_offset() + capacity_ - prefix_len);
  // The view starts capacity - P elements into its buffer: any address. CUDA's memory-efficient
  // SDPA reads the mask in 16-byte words and fails on such a view ("misaligned address", seen on
  // an H100); a fresh copy is aligned, and T * (P + T) elements cost a device copy per step.
  if (!device_.is_cpu()) mask = mask.contiguous();
  return {p.depths + prefix_len, mask};
}

}  // namespace mtprobe
