// ATen launcher of csrc/core/quantized_linear.h: format, shape and dtype checks, then the output
// columns split across torch's CPU threads.
#include "core/quantized_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops/ops.h"

namespace mtprobe::ops {

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const std::optional<at::Tensor>& min, const std::optional<at::Tensor>& bias) {
  return quantized_linear_at_level(x, codes, scale, min, bias,
                                   static_cast<int64_t>(core::SimdLevel::kDefault));
}

at::Tensor quantized_linear_at_level(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                     const std::optional<at::Tensor>& min,
                                     const std::optional<at::Tensor>& bias, int64_t level) {
  constexpr const char* op = "quantized_linear";
  TORCH_CHECK_VALUE(level >= 0 && level <= static_cast<int64_t>(core::SimdLevel::kDefault), op,
                    ": level must be 0 (portable), 1 (AVX2), 2 (AVX-512) or 3 (the default kernel), got ",
                    level);
  constexpr int64_t G = core::kQuantGroup;
  TORCH_CHECK_VALUE(
      codes.dim() == 2 && (codes.scalar_type() == at::kByte || codes.scalar_type() == at::kChar), op,
      ": codes must be uint8 [out_features, in_features / 2] (Q4_1: two 4-bit codes a byte) or int8 "
      "[out_features, in_features] (Q8_0), got ",
      codes.scalar_type(), " ", codes.sizes());
  const bool q4 = codes.scalar_type() == at::kByte;
  const bool has_min = min.has_value() && min->defined();
  TORCH_CHECK_VALUE(q4 == has_min, op,
                    q4 ? ": uint8 codes are Q4_1, which needs min [out_features, in_features / 32]"
                       : ": int8 codes are Q8_0, which has no min; pass None");
  const int64_t out = codes.size(0), in = q4 ? codes.size(1) * 2 : codes.size(1);
  TORCH_CHECK_VALUE(in % G == 0, op, ": in_features = ", in, " must be a multiple of ", G,
                    " (the group size)");
  TORCH_CHECK_VALUE(
      x.dim() >= 1 && x.size(-1) == in, op, ": x must be [..., in_features] with in_features = ", in,
      q4 ? " (twice codes' second dimension)" : " (codes' second dimension)", ", got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.is_cpu() && codes.is_cpu() && codes.is_contiguous(), op,
                    ": x and codes must be CPU tensors, codes contiguous; got ", x.device(), " and ",
                    codes.device());
  auto check_groups = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK_VALUE(
        t.dim() == 2 && t.size(0) == out && t.size(1) == in / G && t.scalar_type() == at::kFloat, op, ": ",
        name, " must be float32 [out_features, in_features / ", G, "] = [", out, ", ", in / G, "], got ",
        t.scalar_type(), " ", t.sizes());
    TORCH_CHECK_VALUE(t.is_cpu() && t.is_contiguous(), op, ": ", name, " must be a contiguous CPU tensor");
  };
  check_groups("scale", scale);
  if (has_min) check_groups("min", *min);
  LinearRows io = linear_rows(op, x, bias, in, out);
  const float* b = io.bias.defined() ? io.bias.const_data_ptr<float>() : nullptr;
  const int64_t rows = io.rows;
  if (rows == 0 || out == 0) return io.y.reshape(io.out_shape);
  const float* xp = io.x.const_data_ptr<float>();
  at::Tensor xsum;  // [rows, in / 32], Q4_1's per-group sums of x
  const float* sp = nullptr;
  if (q4) {
    xsum = at::empty({rows, in / G}, x.options());
    core::quantized_group_sums(xp, rows, in, xsum.mutable_data_ptr<float>());
    sp = xsum.const_data_ptr<float>();
  }
  const void* cp = codes.const_data_ptr();
  const auto format = q4 ? core::QuantFormat::kQ4_1 : core::QuantFormat::kQ8_0;
  const float* scp = scale.const_data_ptr<float>();
  const float* mp = has_min ? min->const_data_ptr<float>() : nullptr;
  float* yp = io.y.mutable_data_ptr<float>();
  // A grain of 64 columns, as small_batch_linear.
  at::parallel_for(0, out, 64, [&](int64_t begin, int64_t end) {
    core::quantized_linear(xp, sp, rows, in, cp, format, scp, mp, b, yp, out, begin, end,
                           static_cast<core::SimdLevel>(level));
  });
  return io.y.reshape(io.out_shape);
}

std::string quantized_linear_isa() { return core::quantized_linear_isa(); }

}  // namespace mtprobe::ops
