// ATen launcher of csrc/core/small_batch_linear.h: shape and dtype checks, then the columns split
// across torch's CPU threads.
#include "core/small_batch_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops/ops.h"

namespace mtprobe::ops {

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  return small_batch_linear_at_level(x, weight, bias, static_cast<int64_t>(core::SimdLevel::kDefault));
}

at::Tensor small_batch_linear_at_level(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, int64_t level) {
  constexpr const char* op = "small_batch_linear";
  TORCH_CHECK_VALUE(level >= 0 && level <= static_cast<int64_t>(core::SimdLevel::kDefault), op,
                    ": level must be 0 (portable), 1 (AVX2), 2 (AVX-512) or 3 (the default kernel), got ",
                    level);
  TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight must be [out_features, in_features], got shape ",
                    weight.sizes());
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == in, op,
                    ": x must be [..., in_features] with in_features = ", in,
                    " (the weight's second dimension), got shape ", x.sizes());
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(
      x.scalar_type() == at::kFloat && (weight.scalar_type() == at::kFloat || bf16), op,
      ": x must be float32 and weight float32 or bfloat16 (other dtypes keep torch's own linear), "
      "got ",
      x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK_VALUE(x.is_cpu() && weight.is_cpu(), op, ": x and weight must be CPU tensors, got ", x.device(),
                    " and ", weight.device());
  // Copying a weight would cost more than the pass it saves: the caller keeps weights contiguous.
  TORCH_CHECK_VALUE(weight.is_contiguous(), op,
                    ": weight must be contiguous (row-major [out_features, in_features]); call .contiguous() "
                    "once on the module's weight");
  LinearRows io = linear_rows(op, x, bias, in, out);
  const float* b = io.bias.defined() ? io.bias.const_data_ptr<float>() : nullptr;
  const int64_t rows = io.rows;
  if (rows == 0 || out == 0) return io.y.reshape(io.out_shape);
  const float* xp = io.x.const_data_ptr<float>();
  float* yp = io.y.mutable_data_ptr<float>();
  const auto simd = static_cast<core::SimdLevel>(level);
  // A grain of 64 columns: a thread's share is then at least 64 weight rows (the tiny k/v
  // projections of a GQA model are not worth splitting further).
  at::parallel_for(0, out, 64, [&](int64_t begin, int64_t end) {
    if (bf16) {
      const auto* wp = reinterpret_cast<const uint16_t*>(weight.const_data_ptr<at::BFloat16>());
      core::small_batch_linear(xp, rows, in, wp, b, yp, out, begin, end, simd);
    } else {
      core::small_batch_linear(xp, rows, in, weight.const_data_ptr<float>(), b, yp, out, begin, end, simd);
    }
  });
  return io.y.reshape(io.out_shape);
}

LinearRows linear_rows(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                       int64_t in_features, int64_t out_features) {
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_features, op,
                      ": bias must be [out_features] = [", out_features, "], got shape ", bias->sizes());
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->is_cpu(), op,
                      ": bias must be a float32 CPU tensor, got ", bias->scalar_type(), " on ",
                      bias->device());
    b = bias->contiguous();
  }
  at::Tensor x2 = x.reshape({-1, in_features}).contiguous();  // [rows, in]
  const int64_t rows = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor y = at::empty({rows, out_features}, x.options());  // [rows, out]
  return {std::move(x2), std::move(y), std::move(b), std::move(out_shape), rows};
}

bool small_batch_linear_simd() { return core::small_batch_linear_simd(); }

std::string small_batch_linear_isa() {
  switch (core::small_batch_linear_default()) {
    case core::SimdLevel::kAvx512:
      return "avx512";
    case core::SimdLevel::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

}  // namespace mtprobe::ops
