// ATen launcher of csrc/core/quantized_linear.h: format, shape and dtype checks, then the output
// columns split across torch's CPU threads.
#include "core/quantized_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <tuple>
#include <utility>
#include <vector>

#include "ops/ops.h"

namespace mtprobe::ops {

namespace {

// Both ops: the same checks; `int8`: x quantized to int8 per group (core::quantize_activations) and the
// integer kernel, else the float one.
at::Tensor run_quantized_linear(const char* op, const at::Tensor& x, const at::Tensor& codes,
                                const at::Tensor& scale, const std::optional<at::Tensor>& min,
                                const std::optional<at::Tensor>& bias, int64_t level, bool int8) {
  TORCH_CHECK_VALUE(level >= 0 && level <= static_cast<int64_t>(core::SimdLevel::kDefault), op,
                    ": level must be 0 (portable), 1 (AVX2), 2 (", int8 ? "AVX-512 VNNI" : "AVX-512",
                    ") or 3 (the default kernel), got ", level);
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
  const auto simd = static_cast<core::SimdLevel>(level);
  if (int8) {
    at::Tensor xq = at::empty({rows, in}, x.options().dtype(at::kChar));  // [rows, in]
    at::Tensor xscale = at::empty({rows, in / G}, x.options());           // [rows, in / 32]
    core::quantize_activations(xp, rows, in, format, xq.mutable_data_ptr<int8_t>(),
                               xscale.mutable_data_ptr<float>());
    const int8_t* qp = xq.const_data_ptr<int8_t>();
    const float* dp = xscale.const_data_ptr<float>();
    at::parallel_for(0, out, 64, [&](int64_t begin, int64_t end) {
      core::quantized_linear_int8(qp, dp, sp, rows, in, cp, format, scp, mp, b, yp, out, begin, end, simd);
    });
    return io.y.reshape(io.out_shape);
  }
  // A grain of 64 columns, as small_batch_linear.
  at::parallel_for(0, out, 64, [&](int64_t begin, int64_t end) {
    core::quantized_linear(xp, sp, rows, in, cp, format, scp, mp, b, yp, out, begin, end, simd);
  });
  return io.y.reshape(io.out_shape);
}

}  // namespace

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const std::optional<at::Tensor>& min, const std::optional<at::Tensor>& bias) {
  return quantized_linear_at_level(x, codes, scale, min, bias,
                                   static_cast<int64_t>(core::SimdLevel::kDefault));
}

at::Tensor quantized_linear_at_level(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                     const std::optional<at::Tensor>& min,
                                     const std::optional<at::Tensor>& bias, int64_t level) {
  return run_quantized_linear("quantized_linear", x, codes, scale, min, bias, level, false);
}

at::Tensor quantized_linear_int8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& min,
                                 const std::optional<at::Tensor>& bias) {
  return quantized_linear_int8_at_level(x, codes, scale, min, bias,
                                        static_cast<int64_t>(core::SimdLevel::kDefault));
}

at::Tensor quantized_linear_int8_at_level(const at::Tensor& x, const at::Tensor& codes,
                                          const at::Tensor& scale, const std::optional<at::Tensor>& min,
                                          const std::optional<at::Tensor>& bias, int64_t level) {
  return run_quantized_linear("quantized_linear_int8", x, codes, scale, min, bias, level, true);
}

std::string quantized_linear_int8_isa() { return core::quantized_linear_int8_isa(); }

std::string quantized_linear_isa() { return core::quantized_linear_isa(); }

namespace {
// weight [out, in] and codes [out, in] float32, groups [out, in / 32] float32 (scale, min), error_weights
// [in] float32 non-negative: contiguous CPU tensors.
void check_search(const char* op, const at::Tensor& weight, const at::Tensor& codes,
                  const std::vector<std::pair<const char*, const at::Tensor*>>& groups,
                  const at::Tensor& error_weights) {
  constexpr int64_t G = core::kQuantGroup;
  auto check = [&](const char* name, const at::Tensor& t, at::IntArrayRef shape) {
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.sizes() == shape && t.is_cpu() && t.is_contiguous(),
                      op, ": ", name, " must be a contiguous float32 CPU tensor ", shape, ", got ",
                      t.scalar_type(), " ", t.sizes(), " on ", t.device());
  };
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) % G == 0, op,
                    ": weight must be [out_features, in_features] with in_features a multiple of ", G,
                    ", got ", weight.sizes());
  const int64_t out = weight.size(0), in = weight.size(1);
  check("weight", weight, {out, in});
  check("codes", codes, {out, in});
  for (const auto& [name, t] : groups) check(name, *t, {out, in / G});
  check("error_weights", error_weights, {in});
  TORCH_CHECK_VALUE(error_weights.ge(0).all().item<bool>(), op, ": error_weights must be non-negative");
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_search_q4_1(
    const at::Tensor& weight, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
    const at::Tensor& error_weights, at::ArrayRef<double> cuts, int64_t refines) {
  constexpr const char* op = "quantize_search_q4_1";
  check_search(op, weight, codes, {{"scale", &scale}, {"min", &min}}, error_weights);
  TORCH_CHECK_VALUE(refines >= 0, op, ": refines must be >= 0, got ", refines);
  std::vector<float> cut(cuts.begin(), cuts.end());
  for (double c : cuts)
    TORCH_CHECK_VALUE(c >= 0.0 && c < 0.5, op,
                      ": each cut must be a fraction in [0, 0.5) of a group's range, got ", c);
  at::Tensor c = codes.clone(), s = scale.clone(), m = min.clone();
  constexpr int64_t G = core::kQuantGroup;
  const int64_t in = weight.size(1), groups = weight.numel() / G;
  const float* w = weight.const_data_ptr<float>();
  const float* a = error_weights.const_data_ptr<float>();
  float *cp = c.mutable_data_ptr<float>(), *sp = s.mutable_data_ptr<float>(),
        *mp = m.mutable_data_ptr<float>();
  at::parallel_for(0, groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      core::search_q4_1_group(w + g * G, a + (g * G) % in, cut.data(), static_cast<int>(cut.size()),
                              static_cast<int>(refines), cp + g * G, sp + g, mp + g);
  });
  return {c, s, m};
}

std::tuple<at::Tensor, at::Tensor> quantize_search_q8_0(const at::Tensor& weight, const at::Tensor& codes,
                                                        const at::Tensor& scale,
                                                        const at::Tensor& error_weights, int64_t iterations) {
  constexpr const char* op = "quantize_search_q8_0";
  check_search(op, weight, codes, {{"scale", &scale}}, error_weights);
  TORCH_CHECK_VALUE(iterations >= 0, op, ": iterations must be >= 0, got ", iterations);
  at::Tensor c = codes.clone(), s = scale.clone();
  constexpr int64_t G = core::kQuantGroup;
  const int64_t in = weight.size(1), groups = weight.numel() / G;
  const float* w = weight.const_data_ptr<float>();
  const float* a = error_weights.const_data_ptr<float>();
  float *cp = c.mutable_data_ptr<float>(), *sp = s.mutable_data_ptr<float>();
  at::parallel_for(0, groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      core::search_q8_0_group(w + g * G, a + (g * G) % in, static_cast<int>(iterations), cp + g * G, sp + g);
  });
  return {c, s};
}

}  // namespace mtprobe::ops
