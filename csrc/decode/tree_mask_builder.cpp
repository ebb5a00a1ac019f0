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

void TreeMaskBuilder::rebuild(const std::vector<int64_t>& parents) {
  const int64_t T = static_cast<int64_t>(parents.size());
  std::vector<int64_t> dep(static_cast<size_t>(T));
  core::tree_depths(parents.data(), T, dep.data());
  // Host buffer filled by the torch-free core, then moved to the model's device once per shape.
  if (ancestor_bits_) {
    at::Tensor bits = at::empty({1, 1, T, core::ancestor_words(T)}, at::TensorOptions().dtype(at::kLong));
    core::ancestor_bits(parents.data(), T, reinterpret_cast<uint64_t*>(bits.data_ptr<int64_t>()));
    buffer_ = bits.to(device_);  // [1, 1, T, ceil(T / 64)]
  } else {
    std::vector<uint8_t> anc(static_cast<size_t>(T * T));  // [T, T] row attends column
    core::ancestor_matrix(parents.data(), T, anc.data());
    if (buffer_.defined() && buffer_.size(0) == T) {
      // Same block size: the prefix columns are zeros already; rewrite only the [T, T] pattern.
      at::Tensor host = at::empty({T, T}, at::TensorOptions().dtype(dtype_));  // [T, T]
      ops::fill_mask_rows(anc, T, 0, host);
      buffer_.narrow(1, capacity_, T).copy_(host);
    } else {
      at::Tensor host =
          at::empty({T, capacity_ + T}, at::TensorOptions().dtype(dtype_));  // [T, capacity + T]
      ops::fill_mask_rows(anc, T, capacity_, host);
      buffer_ = host.to(device_);
    }
  }
  depths_ = at::tensor(dep, at::kLong).view({1, T}).to(device_);
  parents_ = parents;
  ++rebuilds_;
}

BlockInputs TreeMaskBuilder::build(const std::vector<int64_t>& parents, int64_t prefix_len) {
  const int64_t T = static_cast<int64_t>(parents.size());
  TORCH_CHECK(prefix_len >= 0, "prefix_len must be >= 0, got ", prefix_len);
  if (prefix_len > capacity_) {
    // Memory follows the sequence: double the prefix columns (amortised O(1) per token); the
    // next tree block refills the buffer at the new width.
    capacity_ = std::max(prefix_len, 2 * capacity_);
    buffer_ = at::Tensor();
    parents_.clear();
  }
  if (core::is_chain(parents.data(), T)) {
    // A chain is plain causal attention: let the model build its own (cheaper) causal mask.
    return {at::arange(prefix_len, prefix_len + T, at::TensorOptions().dtype(at::kLong).device(device_))
                .view({1, T}),
            std::nullopt};
  }
  if (ancestor_bits_) {  // the compact pattern does not depend on P: only a new shape rebuilds it
    if (parents != parents_) rebuild(parents);
    return {depths_ + prefix_len, buffer_};
  }
  if (!incremental_) {
    at::Tensor par = at::tensor(parents, at::kLong);
    return {ops::tree_position_ids(par, prefix_len).to(device_),
            ops::tree_attention_mask(par, prefix_len, dtype_).to(device_)};
  }
  if (parents != parents_) rebuild(parents);
  // The last prefix_len + T columns of the buffer: zeros for the prefix, then the tree pattern.
  const int64_t width = capacity_ + T;
  at::Tensor mask = buffer_.as_strided({1, 1, T, prefix_len + T}, {T * width, T * width, width, 1},
                                       buffer_.storage_offset() + capacity_ - prefix_len);
  return {depths_ + prefix_len, mask};
}

}  // namespace mtprobe
