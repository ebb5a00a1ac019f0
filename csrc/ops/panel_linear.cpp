// ATen launchers of csrc/core/panel_linear.h: a weight packed in panels, and the linear layer over them
// with the panels split across torch's CPU threads. Shape and dtype checks only.
#include "core/panel_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <string>

#include "ops/ops.h"

namespace mtprobe::ops {
namespace {

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

const uint16_t* bf16_bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::BFloat16>());
}

}  // namespace

at::Tensor pack_panels(const at::Tensor& weight) {
  constexpr const char* op = "pack_panels";
  TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight must be [out_features, in_features], got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(float_or_bf16(weight) && weight.is_cpu(), op,
                    ": weight must be a float32 or bfloat16 CPU tensor, got ", weight.scalar_type(), " on ",
                    weight.device());
  const int64_t out = weight.size(0), in = weight.size(1);
  const at::Tensor w = weight.contiguous();
  at::Tensor panels = at::empty({core::panel_count(out), in, core::kPanelWidth}, w.options());
  if (w.scalar_type() == at::kBFloat16) {
    core::pack_panels(bf16_bits(w), out, in,
                      reinterpret_cast<uint16_t*>(panels.mutable_data_ptr<at::BFloat16>()));
  } else {
    core::pack_panels(w.const_data_ptr<float>(), out, in, panels.mutable_data_ptr<float>());
  }
  return panels;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features) {
  return panel_linear_at_level(x, panels, bias, out_features,
                               static_cast<int64_t>(core::SimdLevel::kDefault));
}

at::Tensor panel_linear_at_level(const at::Tensor& x, const at::Tensor& panels,
                                 const std::optional<at::Tensor>& bias, int64_t out_features, int64_t level) {
  constexpr const char* op = "panel_linear";
  TORCH_CHECK_VALUE(
      level >= 0 && level <= static_cast<int64_t>(core::SimdLevel::kDefault), op,
      ": level must be 0 (portable), 1 (AVX2), 2 (AVX-512) or 3 (the widest this CPU runs), got ", level);
  TORCH_CHECK_VALUE(out_features >= 0, op, ": out_features must be >= 0, got ", out_features);
  const int64_t count = core::panel_count(out_features);
  TORCH_CHECK_VALUE(panels.dim() == 3 && panels.size(0) == count && panels.size(2) == core::kPanelWidth, op,
                    ": panels must be [ceil(out_features / ", core::kPanelWidth, "), in_features, ",
                    core::kPanelWidth, "] = [", count, ", in_features, ", core::kPanelWidth,
                    "] (pack_panels of the [out_features, in_features] weight), got shape ", panels.sizes());
  const int64_t in = panels.size(1);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == in, op,
                    ": x must be [..., in_features] with in_features = ", in,
                    " (the panels' second dimension), got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && float_or_bf16(panels), op,
                    ": x must be float32 and panels float32 or bfloat16, got ", x.scalar_type(), " and ",
                    panels.scalar_type());
  TORCH_CHECK_VALUE(x.is_cpu() && panels.is_cpu(), op, ": x and panels must be CPU tensors, got ", x.device(),
                    " and ", panels.device());
  TORCH_CHECK_VALUE(
      panels.is_contiguous(), op,
      ": panels must be contiguous (as pack_panels returns them); pack the weight once and keep "
      "the result");
  LinearRows io = linear_rows(op, x, bias, in, out_features);
  const float* b = io.bias.defined() ? io.bias.const_data_ptr<float>() : nullptr;
  if (io.rows == 0 || out_features == 0) return io.y.reshape(io.out_shape);
  const float* xp = io.x.const_data_ptr<float>();
  float* yp = io.y.mutable_data_ptr<float>();
  const auto simd = static_cast<core::SimdLevel>(level);
  // A grain of 2 panels (64 columns), as small_batch_linear's 64 columns.
  at::parallel_for(0, count, 2, [&](int64_t begin, int64_t end) {
    if (panels.scalar_type() == at::kBFloat16) {
      core::panel_linear(xp, io.rows, in, bf16_bits(panels), b, yp, out_features, begin, end, simd);
    } else {
      core::panel_linear(xp, io.rows, in, panels.const_data_ptr<float>(), b, yp, out_features, begin, end,
                         simd);
    }
  });
  return io.y.reshape(io.out_shape);
}

std::string panel_linear_isa() {
  if (core::panel_linear_supported(core::SimdLevel::kAvx512)) return "avx512";
  return core::panel_linear_supported(core::SimdLevel::kAvx2) ? "avx2" : "scalar";
}

}  // namespace mtprobe::ops
