// y = x W^T + b through oneDNN's float32 matmul (torch's mkldnn::_linear_pointwise), for the C++ forward's
// prefill blocks.
//
// Why: torch's CPU wheel sends a float32 at::mm to MKL, which on AMD CPUs takes an AVX2 kernel ("zen"):
// on a 2-core AMD EPYC Zen 5 it ran SmolLM2's linears at about 210 GFLOP/s for a 700-token prefill, where
// oneDNN's JIT kernels, chosen by the instruction set and not the vendor, ran them at 450-470 (float32
// throughout: 8e-7 of the largest output from float64, MKL 4e-7). From about 32 rows on it also beats the
// small-batch kernel (benchmarks/results/native_forward/).
//
// Header-only: one dispatcher lookup, kept. onednn_linear returns an undefined tensor where torch has no
// oneDNN (a build without it, or torch.backends.mkldnn disabled): the caller takes at::mm then.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace mtprobe {

// x [rows, in] float32 contiguous, weight [out, in] float32 contiguous, bias [out] or undefined:
// [rows, out] float32, or undefined where oneDNN is not there.
inline at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  using Fn =
      at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                 c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);
  static const std::optional<c10::TypedOperatorHandle<Fn>> op =
      []() -> std::optional<c10::TypedOperatorHandle<Fn>> {
    auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!handle.has_value()) return std::nullopt;
    return handle->typed<Fn>();
  }();
  if (!op.has_value() || !at::globalContext().userEnabledMkldnn()) return at::Tensor();
  return op->call(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, "none",
                  c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

}  // namespace mtprobe
