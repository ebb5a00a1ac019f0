// The ops through torch's dispatcher, for C++ callers (the decode loop, the drafters): the kernel
// of the arguments' device runs, the CUDA one for tensors on a GPU. Calling ops::* directly
// always runs the CPU launcher.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace mtprobe::ops::dispatch {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_draft_tree(const at::Tensor& logits,
                                                                             const at::Tensor& root_token,
                                                                             int64_t budget, int64_t width,
                                                                             bool prune);

void compact_kv_(at::TensorList caches, const at::Tensor& src, int64_t dst_start);

}  // namespace mtprobe::ops::dispatch
