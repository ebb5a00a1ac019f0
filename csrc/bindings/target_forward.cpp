#include "decode/target_forward.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <string>

#include "bindings/bindings.h"

namespace py = pybind11;

namespace mtprobe::bindings {
namespace {

using Tensors = std::map<std::string, at::Tensor>;

at::Tensor optional(const Tensors& t, const std::string& key) {
  auto it = t.find(key);
  return it == t.end() ? at::Tensor() : it->second;
}

at::Tensor required(const Tensors& t, const std::string& key, const std::string& where) {
  auto it = t.find(key);
  TORCH_CHECK_VALUE(it != t.end(), "TargetForward: ", where, " has no '", key, "' tensor");
  return it->second;
}

// name.weight and name.bias; name.codes, name.scale and name.min: its quantized codes, where it has them.
TargetLinear linear(const Tensors& t, const std::string& name, const std::string& where) {
  TargetLinear w{required(t, name + ".weight", where), optional(t, name + ".bias")};
  w.quantized.codes = optional(t, name + ".codes");
  w.quantized.scale = optional(t, name + ".scale");
  w.quantized.min = optional(t, name + ".min");
  TORCH_CHECK_VALUE(
      w.quantized.codes.defined() || !(w.quantized.scale.defined() || w.quantized.min.defined()),
      "TargetForward: ", where, " has ", name, ".scale or ", name, ".min but no ", name, ".codes");
  return w;
}

}  // namespace

void bind_target_forward(py::module_& m) {
  py::class_<TargetBlock>(
      m, "TargetBlock",
      "One sequence's block of TargetForward.forward_batch: forward()'s arguments, its own "
      "cache's keys and values among them.")
      .def(py::init([](at::Tensor tokens, std::optional<at::Tensor> embeds, at::Tensor positions,
                       std::optional<at::Tensor> mask, int64_t prefix_len, std::vector<at::Tensor> keys,
                       std::vector<at::Tensor> values, bool want_hidden, int64_t logits_from) {
             return TargetBlock{std::move(tokens), std::move(embeds), std::move(positions),
                                std::move(mask),   prefix_len,        std::move(keys),
                                std::move(values), want_hidden,       logits_from};
           }),
           py::arg("tokens"), py::arg("embeds"), py::arg("positions"), py::arg("mask"), py::arg("prefix_len"),
           py::arg("keys"), py::arg("values"), py::arg("want_hidden") = false, py::arg("logits_from") = 0)
      .def_readonly("tokens", &TargetBlock::tokens)
      .def_readonly("embeds", &TargetBlock::embeds)
      .def_readonly("positions", &TargetBlock::positions, "[T] int64")
      .def_readonly("mask", &TargetBlock::mask)
      .def_readonly("prefix_len", &TargetBlock::prefix_len)
      .def_readonly("want_hidden", &TargetBlock::want_hidden)
      .def_readonly("logits_from", &TargetBlock::logits_from)
      .def_readonly("row", &TargetBlock::row, "its row in a BatchedForward (-1: none)");

  py::class_<TargetForward, std::shared_ptr<TargetForward>>(
      m, "TargetForward",
      "The target's own forward in C++ for Llama-family models (csrc/decode/target_forward.h); "
      "mtprobe.target_model.native_forward builds it from an HF model, sharing its weights.")
      .def(py::init([](at::Tensor embed, const std::vector<Tensors>& layers, at::Tensor final_norm,
                       const Tensors& head, at::Tensor inv_freq, int64_t heads, int64_t kv_heads, double eps,
                       double scale, double rope_scaling, int64_t small_rows, int64_t wide_rows,
                       const std::vector<int64_t>& windows, double embed_scale, const std::string& activation,
                       bool panels, int64_t quantized_rows) {
             check_windows(windows, layers.size(), "TargetForward");
             std::vector<TargetLayer> built;
             for (size_t l = 0; l < layers.size(); ++l) {
               const Tensors& t = layers[l];
               const std::string where = "layer " + std::to_string(l);
               built.push_back({required(t, "input_norm", where), required(t, "post_norm", where),
                                optional(t, "q_norm"), optional(t, "k_norm"), linear(t, "q", where),
                                linear(t, "k", where), linear(t, "v", where), linear(t, "o", where),
                                linear(t, "gate", where), linear(t, "up", where), linear(t, "down", where),
                                optional(t, "attn_out_norm"), optional(t, "mlp_out_norm"),
                                optional(t, "inv_freq"), windows.empty() ? 0 : windows[l]});
               for (const auto& [key, _] : t) {
                 static const char* known[] = {"input_norm",    "post_norm",    "q_norm",  "k_norm",
                                               "attn_out_norm", "mlp_out_norm", "inv_freq"};
                 const bool linear_key = key.find('.') != std::string::npos;
                 TORCH_CHECK_VALUE(
                     linear_key || std::find(std::begin(known), std::end(known), key) != std::end(known),
                     "TargetForward: ", where, " has an unknown tensor '", key, "'");
               }
             }
             TargetForwardConfig config;
             set_shape(config, heads, kv_heads, eps, scale, rope_scaling, embed_scale, activation,
                       "TargetForward");
             config.small_rows = small_rows;
             config.wide_rows = wide_rows;
             config.panels = panels;
             config.quantized_rows = quantized_rows;
             return std::make_shared<TargetForward>(std::move(embed), std::move(built), std::move(final_norm),
                                                    linear(head, "head", "head"), std::move(inv_freq),
                                                    config);
           }),
           py::arg("embed"), py::arg("layers"), py::arg("final_norm"), py::arg("head"), py::arg("inv_freq"),
           py::kw_only(), py::arg("heads"), py::arg("kv_heads"), py::arg("eps"), py::arg("scale"),
           py::arg("rope_scaling"), py::arg("small_rows") = 64, py::arg("wide_rows") = 6,
           py::arg("windows") = std::vector<int64_t>{}, py::arg("embed_scale") = 1.0,
           py::arg("activation") = "silu", py::arg("panels") = true, py::arg("quantized_rows") = 0)
      .def("forward", &TargetForward::forward, py::arg("tokens"), py::arg("embeds"), py::arg("positions"),
           py::arg("mask"), py::arg("prefix_len"), py::arg("keys"), py::arg("values"), py::arg("want_hidden"),
           py::arg("logits_from") = 0,
           "(logits [T, vocab] float32, hidden [T, hidden] or None) of a block of T inputs after prefix_len "
           "cached entries; its keys and values are written into rows prefix_len.. of each layer's buffers",
           py::call_guard<py::gil_scoped_release>())
      .def("forward_batch", &TargetForward::forward_batch, py::arg("blocks"),
           "forward() of several sequences' blocks (TargetBlock) in one pass: every linear layer's weights "
           "read "
           "once for all their rows, each block attending over its own cache; a list of (logits, hidden)",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &TargetForward::num_layers)
      .def_property_readonly("panel_bytes", &TargetForward::panel_bytes,
                             "bytes of the weights' copies packed in panels (0 when built with panels=False)")
      .def_property_readonly("quantized_bytes", &TargetForward::quantized_bytes,
                             "bytes of the linear layers' quantized codes, scales and minima (0 where none)")
      .def_property("quantized_rows", &TargetForward::quantized_rows, &TargetForward::set_quantized_rows,
                    "blocks of up to this many inputs run on the codes where a call's layers have them (0: "
                    "never); may change between forwards")
      .def_property_readonly("vocab_size", &TargetForward::vocab_size)
      .def_property_readonly("kv_heads", &TargetForward::kv_heads)
      .def_property_readonly("head_dim", &TargetForward::head_dim)
      .def_property_readonly(
          "dtype", [](const TargetForward& f) { return f.dtype() == at::kBFloat16 ? "bfloat16" : "float32"; },
          "the weights' and the cache's dtype, by torch's name");
}

}  // namespace mtprobe::bindings
