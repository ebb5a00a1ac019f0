// pybind11 bindings, one file per concept of the core (drafters, decode loop); the bindings that
// exist only for tests apart, in testing.cpp.
#pragma once

#include <torch/extension.h>

#include <string>

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

void bind_drafters(pybind11::module_& m);
void bind_decode_loop(pybind11::module_& m);
void bind_schedule(pybind11::module_& m);
void bind_topology(pybind11::module_& m);
void bind_quantized_decoder(pybind11::module_& m);
void bind_target_forward(pybind11::module_& m);
void bind_testing(pybind11::module_& m);  // test-only bindings (testing.cpp)
}  // namespace mtprobe::bindings
