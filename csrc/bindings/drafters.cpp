#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "drafters/drafter.h"
#include "drafters/mask_probe.h"

namespace py = pybind11;

namespace mtprobe::bindings {

namespace {
// Lets Python classes implement the drafter interface (prototypes, tests, oracle drafters).
class PyDrafter : public Drafter {
 public:
  using Drafter::Drafter;
  std::string name() const override { PYBIND11_OVERRIDE_PURE(std::string, Drafter, name); }
  void begin(const at::Tensor& prompt) override { PYBIND11_OVERRIDE_PURE(void, Drafter, begin, prompt); }
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override {
    PYBIND11_OVERRIDE_PURE(DraftBlock, Drafter, propose, committed, prefix_len, limits);
  }
  void observe(const StepOutcome& outcome) override { PYBIND11_OVERRIDE_PURE(void, Drafter, observe, outcome); }
  bool wants_hidden_states() const override { PYBIND11_OVERRIDE(bool, Drafter, wants_hidden_states); }
};
}  // namespace

void bind_drafters(py::module_& m) {
  py::class_<DraftBlock>(m, "DraftBlock", "The inputs of one target forward (see csrc/drafters/drafter.h).")
      .def(py::init<>())
      .def_readwrite("tokens", &DraftBlock::tokens)
      .def_readwrite("embeds", &DraftBlock::embeds)
      .def_readwrite("parents", &DraftBlock::parents)
      .def_readwrite("num_committed", &DraftBlock::num_committed)
      .def_readwrite("num_nodes", &DraftBlock::num_nodes)
      .def_readwrite("block_mask", &DraftBlock::block_mask)
      .def_readwrite("depths", &DraftBlock::depths)
      .def_readwrite("draft_probs", &DraftBlock::draft_probs)
      .def_property_readonly("num_inputs", &DraftBlock::num_inputs);

  py::class_<StepOutcome>(m, "StepOutcome", "What one step decided.")
      .def_readonly("prefix_len", &StepOutcome::prefix_len)
      .def_readonly("path", &StepOutcome::path)
      .def_readonly("new_tokens", &StepOutcome::new_tokens)
      .def_readonly("logits", &StepOutcome::logits)
      .def_readonly("hidden", &StepOutcome::hidden)
      .def_readonly("finished", &StepOutcome::finished);

  py::class_<StepLimits>(m, "StepLimits", "Limits the loop imposes on one block.")
      .def(py::init<>())
      .def_readwrite("budget", &StepLimits::budget)
      .def_readwrite("max_depth", &StepLimits::max_depth)
      .def_readwrite("tokens_left", &StepLimits::tokens_left);

  py::class_<Drafter, PyDrafter, std::shared_ptr<Drafter>>(m, "Drafter", "Base class of every drafter.")
      .def(py::init<>())
      .def("name", &Drafter::name)
      .def("begin", &Drafter::begin, py::arg("prompt"))
      .def("propose", &Drafter::propose, py::arg("committed"), py::arg("prefix_len"), py::arg("limits"))
      .def("observe", &Drafter::observe, py::arg("outcome"))
      .def("wants_hidden_states", &Drafter::wants_hidden_states);

  py::class_<MaskProbeDrafter, Drafter, std::shared_ptr<MaskProbeDrafter>>(
      m, "MaskProbeDrafter", "Mask-token probing with one mask token per node (seed 001).")
      .def(py::init([](at::Tensor embedding, int64_t num_branches, double mask_lambda) {
             return std::make_shared<MaskProbeDrafter>(std::move(embedding),
                                                       MaskProbeOptions{num_branches, mask_lambda});
           }),
           py::arg("embedding"), py::arg("num_branches"), py::arg("mask_lambda"))
      .def_property_readonly("mask_embedding", &MaskProbeDrafter::mask_embedding);
}

}  // namespace mtprobe::bindings
