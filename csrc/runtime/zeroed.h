// A float32 CPU tensor of zeros whose pages the OS zeroes when first touched. Torch-free but for ATen.
//
// Why: a prompt's logits [T, vocab] are zeros before the rows anyone reads (a 700-token prompt of SmolLM2's
// 49,152-token vocabulary: 137 MB), which at::empty + zero_() wrote in full at every prefill and which, in a
// batch decoded together, every row holds at once. calloc of a block that large maps fresh pages, already
// zero: the rows nobody writes cost neither the writes nor the memory.
#pragma once

#include <ATen/ATen.h>

#include <cstdlib>

namespace mtprobe {

inline at::Tensor zeroed_floats(int64_t rows, int64_t cols) {
  TORCH_CHECK_VALUE(rows >= 0 && cols >= 0, "zeroed_floats: negative shape [", rows, ", ", cols, "]");
  const size_t count = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  void* data = std::calloc(count == 0 ? 1 : count, sizeof(float));
  TORCH_CHECK(data != nullptr, "out of memory: ", rows, " x ", cols, " float32 logits");
  return at::from_blob(
      data, {rows, cols}, [](void* p) { std::free(p); }, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace mtprobe
