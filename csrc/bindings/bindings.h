// pybind11 bindings, one file per concept of the core (drafters, decode loop); the bindings that
// exist only for tests apart, in testing.cpp.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

#include "core/decoder_step.h"

namespace mtprobe::bindings {
// Dtypes cross the bindings as their torch names ("float32", ...): no caster dependency.
inline at::ScalarType parse_mask_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float64") return at::kDouble;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  TORCH_CHECK_VALUE(false, "mask dtype must be float32, float64, float16 or bfloat16, got '", name, "'");
}

// A gated MLP's activation by its name ("silu", "gelu_tanh"); `who` names the caller in the error.
inline core::Activation parse_activation(const std::string& name, const char* who) {
  TORCH_CHECK_VALUE(name == "silu" || name == "gelu_tanh", who,
                    ": activation must be 'silu' or 'gelu_tanh', got '", name, "'");
  return name == "gelu_tanh" ? core::Activation::kGeluTanh : core::Activation::kSilu;
}

// The shape both C++ decoders take from their bindings' keyword arguments; `who` names the caller in errors.
inline void set_shape(core::DecoderShape& shape, int64_t heads, int64_t kv_heads, double eps, double scale,
                      double rope_scaling, double embed_scale, const std::string& activation,
                      const char* who) {
  shape.heads = heads;
  shape.kv_heads = kv_heads;
  shape.eps = static_cast<float>(eps);
  shape.scale = static_cast<float>(scale);
  shape.rope_scaling = static_cast<float>(rope_scaling);
  shape.embed_scale = static_cast<float>(embed_scale);
  shape.activation = parse_activation(activation, who);
}

// `windows` holds one sliding window per layer, or none.
inline void check_windows(const std::vector<int64_t>& windows, size_t layers, const char* who) {
  TORCH_CHECK_VALUE(windows.empty() || windows.size() == layers, who,
                    ": windows holds one window per layer (", layers, ") or none, got ", windows.size());
}

void bind_drafters(pybind11::module_& m);
void bind_decode_loop(pybind11::module_& m);
void bind_schedule(pybind11::module_& m);
void bind_topology(pybind11::module_& m);
void bind_quantized_decoder(pybind11::module_& m);
void bind_target_forward(pybind11::module_& m);
void bind_testing(pybind11::module_& m);  // test-only bindings (testing.cpp)
}  // namespace mtprobe::bindings
