// Topologies and their policies (csrc/core/topology.h): EntMTP's bank of static draft trees.
#include "core/topology.h"

#include <pybind11/stl.h>

#include "bindings/bindings.h"

namespace py = pybind11;

namespace mtprobe::bindings {

namespace {
core::TopologyPolicyKind policy_kind(const std::string& name) {
  if (name == "static") return core::TopologyPolicyKind::kStatic;
  if (name == "ladder") return core::TopologyPolicyKind::kLadder;
  if (name == "hysteretic") return core::TopologyPolicyKind::kHysteretic;
  throw std::invalid_argument("unknown topology policy '" + name + "' (static, ladder or hysteretic)");
}
}  // namespace

void bind_topology(py::module_& m) {
  py::class_<core::Topology>(m, "Topology",
                             "A static draft tree by child ranks, compiled once (csrc/core/topology.h).")
      .def(py::init(&core::compile_topology), py::arg("paths"))
      .def_readonly("paths", &core::Topology::paths)
      .def_readonly("parents", &core::Topology::parents)
      .def_readonly("depths", &core::Topology::depths)
      .def_readonly("ranks", &core::Topology::ranks)
      .def_readonly("max_depth", &core::Topology::max_depth)
      .def_readonly("max_rank", &core::Topology::max_rank)
      .def_property_readonly("num_nodes", &core::Topology::num_nodes)
      .def(
          "fill",
          [](const core::Topology& t, int64_t root_token, const at::Tensor& cand_tokens,
             const at::Tensor& cand_probs, bool prune) -> py::object {
            TORCH_CHECK_VALUE(cand_tokens.dim() == 2 && cand_tokens.sizes() == cand_probs.sizes(),
                              "cand_tokens and cand_probs must both be [depths, m]");
            at::Tensor tok = cand_tokens.to(at::kCPU, at::kLong).contiguous();
            at::Tensor prob = cand_probs.to(at::kCPU, at::kFloat).contiguous();
            std::vector<int64_t> tokens(static_cast<size_t>(t.num_nodes()));
            std::vector<double> probs(static_cast<size_t>(t.num_nodes()));
            if (!core::fill_topology(t, root_token, tok.data_ptr<int64_t>(), prob.data_ptr<float>(),
                                     tok.size(0), tok.size(1), prune, tokens.data(), probs.data())) {
              return py::none();
            }
            return py::make_tuple(tokens, probs);
          },
          py::arg("root_token"), py::arg("cand_tokens"), py::arg("cand_probs"), py::kw_only(),
          py::arg("prune") = true,
          "(tokens, cumulative probs) of the nodes for per-depth candidates [depths, m], or None when "
          "the candidates run out.")
      .def(
          "accepted_depth",
          [](const core::Topology& t, const std::vector<int64_t>& true_ranks) {
            return core::accepted_depth(t, true_ranks.data(), static_cast<int64_t>(true_ranks.size()));
          },
          py::arg("true_ranks"),
          "Depth the drafts reach along a continuation of these child ranks (-1: absent).");

  py::class_<core::TopologyPolicy>(m, "TopologyPolicy",
                                   "static, ladder or hysteretic (csrc/core/topology.h).")
      .def(py::init([](const std::string& kind, std::vector<int64_t> trees, std::vector<double> thresholds,
                       int64_t bank_size) {
             core::TopologyPolicy p;
             p.kind = policy_kind(kind);
             p.trees = std::move(trees);
             p.thresholds = std::move(thresholds);
             p.validate(bank_size);
             return p;
           }),
           py::arg("kind"), py::arg("trees"), py::arg("thresholds"), py::kw_only(), py::arg("bank_size"))
      .def_readonly("trees", &core::TopologyPolicy::trees)
      .def_readonly("thresholds", &core::TopologyPolicy::thresholds)
      .def("initial", &core::TopologyPolicy::initial)
      .def("choose", &core::TopologyPolicy::choose, py::arg("score"), py::arg("current"));
}

}  // namespace mtprobe::bindings
