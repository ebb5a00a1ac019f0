#include "ops/dispatch.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace mtprobe::ops::dispatch {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_draft_tree(const at::Tensor& logits,
                                                                             const at::Tensor& root_token,
                                                                             int64_t budget, int64_t width,
                                                                             bool prune) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mtprobe::expand_draft_tree", "")
                             .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool)>();
  return op.call(logits, root_token, budget, width, prune);
}

void compact_kv_(at::TensorList caches, const at::Tensor& src, int64_t dst_start) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mtprobe::compact_kv_", "")
                             .typed<void(at::TensorList, const at::Tensor&, int64_t)>();
  op.call(caches, src, dst_start);
}

std::tuple<at::Tensor, at::Tensor> verify_rejection(const at::Tensor& tokens, const at::Tensor& parents,
                                                    const at::Tensor& p, const at::Tensor& q,
                                                    const at::Tensor& uniforms) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mtprobe::verify_rejection", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&)>();
  return op.call(tokens, parents, p, q, uniforms);
}

}  // namespace mtprobe::ops::dispatch
