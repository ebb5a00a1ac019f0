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

// (path [len], bonus token []) on the arguments' device: csrc/ops/ops.h's verify_rejection.
std::tuple<at::Tensor, at::Tensor> verify_rejection(const at::Tensor& tokens, const at::Tensor& parents,
                                                    const at::Tensor& p, const at::Tensor& q,
                                                    const at::Tensor& uniforms);

}  // namespace mtprobe::ops::dispatch
