#include "decode/quantized_decoder.h"

#include <pybind11/stl.h>

#include <map>
#include <string>

#include "bindings/bindings.h"

namespace py = pybind11;

namespace mtprobe::bindings {
namespace {

using Tensors = std::map<std::string, at::Tensor>;

at::Tensor required(const Tensors& t, const std::string& key, const std::string& where) {
  auto it = t.find(key);
  TORCH_CHECK_VALUE(it != t.end(), "QuantizedDecoder: ", where, " has no '", key, "' tensor");
  return it->second;
}

at::Tensor optional(const Tensors& t, const std::string& key) {
  auto it = t.find(key);
  return it == t.end() ? at::Tensor() : it->second;
}

QuantizedWeights weights(const Tensors& t, const std::string& name, const std::string& where) {
  return {required(t, name + ".codes", where), required(t, name + ".scale", where),
          optional(t, name + ".min"), optional(t, name + ".bias")};
}

}  // namespace

void bind_quantized_decoder(py::module_& m) {
  py::class_<QuantizedDecoder, std::shared_ptr<QuantizedDecoder>>(
      m, "QuantizedDecoder",
      "The quantized self-draft's one-token decoder step in C++ (csrc/decode/quantized_decoder.h); "
      "mtprobe.target_model.self_draft.quantized_decoder builds it from a quantized twin.")
      .def(py::init([](at::Tensor embed, const std::vector<Tensors>& layers, at::Tensor final_norm,
                       const Tensors& head, at::Tensor inv_freq, int64_t heads, int64_t kv_heads, double eps,
                       double scale, double rope_scaling, const std::vector<int64_t>& windows,
                       double embed_scale, const std::string& activation, bool int8_activations) {
             check_windows(windows, layers.size(), "QuantizedDecoder");
             std::vector<QuantizedDecoderLayer> built;
             for (size_t l = 0; l < layers.size(); ++l) {
               const Tensors& t = layers[l];
               const std::string where = "layer " + std::to_string(l);
               built.push_back({required(t, "input_norm", where), required(t, "post_norm", where),
                                weights(t, "q", where), weights(t, "k", where), weights(t, "v", where),
                                weights(t, "o", where), weights(t, "gate", where), weights(t, "up", where),
                                weights(t, "down", where), optional(t, "q_norm"), optional(t, "k_norm"),
                                optional(t, "attn_out_norm"), optional(t, "mlp_out_norm"),
                                optional(t, "inv_freq"), windows.empty() ? 0 : windows[l]});
             }
             QuantizedDecoderConfig config;
             set_shape(config, heads, kv_heads, eps, scale, rope_scaling, embed_scale, activation,
                       "QuantizedDecoder");
             config.int8_activations = int8_activations;
             return std::make_shared<QuantizedDecoder>(std::move(embed), std::move(built),
                                                       std::move(final_norm), weights(head, "head", "head"),
                                                       std::move(inv_freq), config);
           }),
           py::arg("embed"), py::arg("layers"), py::arg("final_norm"), py::arg("head"), py::arg("inv_freq"),
           py::kw_only(), py::arg("heads"), py::arg("kv_heads"), py::arg("eps"), py::arg("scale"),
           py::arg("rope_scaling"), py::arg("windows") = std::vector<int64_t>{}, py::arg("embed_scale") = 1.0,
           py::arg("activation") = "silu", py::arg("int8_activations") = false)
      .def(
          "set_head_scan",
          [](QuantizedDecoder& d, const Tensors& scan) {
            d.set_head_scan(weights(scan, "scan", "the scan head"));
          },
          py::arg("scan"),
          "The head again in Q4_1 ({'scan.codes', 'scan.scale', 'scan.min'}: [vocab, hidden / 2] uint8, "
          "[vocab, "
          "hidden / 32] float32 twice), for steps with head_scan > 0; the head's bias applies to it")
      .def_property_readonly("has_head_scan", &QuantizedDecoder::has_head_scan)
      .def("step", &QuantizedDecoder::step, py::arg("token"), py::arg("position"), py::arg("keys"),
           py::arg("values"), py::kw_only(), py::arg("head_rows") = 0,
           py::arg("extra_rows") = std::vector<int64_t>{}, py::arg("head_scan") = 0,
           "Logits [vocab] float32 of `token` at `position`; its keys and values are written into row "
           "`position` of each layer's buffers [1, kv_heads, capacity, head_dim]. head_rows > 0: only the "
           "head's first head_rows rows and the ids extra_rows are computed, every other logit -inf (a "
           "draft's vocabulary). head_scan > 0: the head in 4 bits (set_head_scan), then the head_scan rows "
           "it "
           "ranks highest (and extra_rows) in 8 bits, the whole head's logits bit for bit; the others their "
           "4-bit "
           "values",
           py::call_guard<py::gil_scoped_release>())
      .def("step_rows", &QuantizedDecoder::step_rows, py::arg("tokens"), py::arg("positions"),
           py::arg("keys"), py::arg("values"), py::kw_only(), py::arg("head_rows") = 0,
           py::arg("extra_rows") = std::vector<int64_t>{}, py::arg("head_scan") = 0,
           "step() for several sequences at once: logits [B, vocab] float32, row r's keys and values written "
           "into row positions[r] of its own buffers keys[r][l], values[r][l]; the weights read once for all",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &QuantizedDecoder::num_layers)
      .def_property_readonly("int8_activations", &QuantizedDecoder::int8_activations);
}

}  // namespace mtprobe::bindings
