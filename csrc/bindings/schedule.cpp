// The scheduler (csrc/core/schedule.h) and the scheduling drafter (csrc/drafters/auto.h).
#include "core/schedule.h"

#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "drafters/auto.h"

namespace py = pybind11;

namespace mtprobe::bindings {

void bind_schedule(py::module_& m) {
  py::class_<core::CostTable>(
      m, "CostTable",
      "Forward seconds on a grid of block sizes x contexts (mtprobe.target_model.profile.ForwardProfile).")
      .def(py::init<std::vector<int64_t>, std::vector<int64_t>, std::vector<double>>(),
           py::arg("block_sizes"), py::arg("contexts"), py::arg("seconds"))
      .def("time", &core::CostTable::time, py::arg("block_size"), py::arg("context"))
      .def("relative", &core::CostTable::relative, py::arg("block_size"), py::arg("context"),
           py::arg("overhead") = 0.0);

  py::class_<core::AcceptanceStats>(m, "AcceptanceStats",
                                    "Decayed acceptance counts of one drafter per (depth, sibling rank).")
      .def(py::init<double>(), py::arg("decay") = 0.95)
      .def(py::init<double, std::vector<std::vector<double>>, std::vector<std::vector<double>>>(),
           py::arg("decay"), py::arg("trials"), py::arg("accepts"))
      .def_property_readonly_static("ranks", [](py::object) { return core::AcceptanceStats::kRanks; })
      .def("step", &core::AcceptanceStats::step)
      .def("record", &core::AcceptanceStats::record, py::arg("depth"), py::arg("rank"), py::arg("accepted"))
      .def("rate", &core::AcceptanceStats::rate, py::arg("depth"), py::arg("rank") = 0)
      .def_property_readonly("trials", &core::AcceptanceStats::trials)
      .def_property_readonly("accepts", &core::AcceptanceStats::accepts);

  py::class_<SharedSeconds, std::shared_ptr<SharedSeconds>>(
      m, "SharedSeconds",
      "A duration several objects share (csrc/runtime/shared_seconds.h): a batch's step overhead, written by "
      "BatchedForward and read by each row's AutoDrafter.")
      .def(py::init<>())
      .def_property("seconds", &SharedSeconds::get, &SharedSeconds::set);

  py::class_<BatchDrafting, std::shared_ptr<BatchDrafting>>(
      m, "BatchDrafting",
      "Whether a batch's rows draft, chosen by the tokens per second measured both ways in phases of decode "
      "steps (csrc/runtime/batch_drafting.h): BatchedForward ends each step, every row's AutoDrafter reads "
      "it.")
      .def(py::init<int64_t, int64_t>(), py::arg("phase_steps") = 8, py::arg("exploit_phases") = 4)
      .def_property_readonly("allowed", &BatchDrafting::allowed, "whether the rows may draft this step")
      .def("add_tokens", &BatchDrafting::add_tokens, py::arg("n"),
           "a row's tokens committed by a decode step")
      .def("end_step", &BatchDrafting::end_step, py::arg("seconds"),
           "one decode step of the batch ended this many seconds after the one before")
      .def("rate", &BatchDrafting::rate, py::arg("drafting"),
           "tokens per second of the phases with drafting (True) or plain decoding (False); 0 before one "
           "ended")
      .def("steps", &BatchDrafting::steps, py::arg("drafting"),
           "decode steps run with drafting allowed (True) or plainly (False)")
      .def_property_readonly("phase_steps", &BatchDrafting::phase_steps)
      .def_property_readonly("exploit_phases", &BatchDrafting::exploit_phases);
  py::class_<AutoDrafter, Drafter, std::shared_ptr<AutoDrafter>>(
      m, "AutoDrafter",
      "Several drafters propose; each step verifies the block and cut with the most expected tokens per "
      "second "
      "under the measured forward cost, or plain decoding.")
      .def(py::init([](std::vector<std::shared_ptr<Drafter>> children, core::CostTable cost, double decay,
                       int64_t explore_every, std::vector<int64_t> budgets, std::vector<bool> own_forwards,
                       std::vector<core::AcceptanceStats> carried_stats, std::vector<double> carried_costs,
                       std::shared_ptr<SharedSeconds> batch_overhead,
                       std::shared_ptr<BatchDrafting> batch_drafting) {
             return std::make_shared<AutoDrafter>(
                 std::move(children), std::move(cost),
                 AutoOptions{decay, explore_every, std::move(budgets), std::move(own_forwards),
                             std::move(carried_stats), std::move(carried_costs), std::move(batch_overhead),
                             std::move(batch_drafting)});
           }),
           py::arg("drafters"), py::arg("cost"), py::kw_only(), py::arg("decay") = 0.95,
           py::arg("explore_every") = 16, py::arg("budgets") = std::vector<int64_t>{},
           py::arg("own_forwards") = std::vector<bool>{},
           py::arg("carried_stats") = std::vector<core::AcceptanceStats>{},
           py::arg("carried_costs") = std::vector<double>{}, py::arg("batch_overhead") = nullptr,
           py::arg("batch_drafting") = nullptr, py::keep_alive<1, 2>())
      .def(
          "choices",
          [](const AutoDrafter& d) {
            std::vector<py::tuple> out;
            for (const ScheduleChoice& c : d.choices())
              out.push_back(py::make_tuple(c.child, c.inputs, c.nodes));
            return out;
          },
          "(drafter index or -1 for plain decoding, block size T, draft nodes verified) of every decode step")
      .def_property_readonly("stats", &AutoDrafter::stats)
      .def_property_readonly(
          "draft_costs", &AutoDrafter::draft_costs,
          "[drafters]: measured seconds per draft of the drafters with own forwards (0: not "
          "measured)")
      .def_property_readonly("step_overhead", &AutoDrafter::step_overhead,
                             "seconds a decode step spends besides its forward's profiled time (measured)")
      .def_property_readonly("draft_seconds", &AutoDrafter::draft_seconds)
      .def_property_readonly("schedule_seconds", &AutoDrafter::schedule_seconds);
}

}  // namespace mtprobe::bindings
