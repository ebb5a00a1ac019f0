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
  py::class_<AutoDrafter, Drafter, std::shared_ptr<AutoDrafter>>(
      m, "AutoDrafter",
      "Several drafters propose; each step verifies the block and cut with the most expected tokens per "
      "second "
      "under the measured forward cost, or plain decoding.")
      .def(py::init([](std::vector<std::shared_ptr<Drafter>> children, core::CostTable cost, double decay,
                       int64_t explore_every, std::vector<int64_t> budgets, std::vector<bool> own_forwards,
                       std::vector<core::AcceptanceStats> carried_stats, std::vector<double> carried_costs,
                       std::shared_ptr<SharedSeconds> batch_overhead) {
             return std::make_shared<AutoDrafter>(
                 std::move(children), std::move(cost),
                 AutoOptions{decay, explore_every, std::move(budgets), std::move(own_forwards),
                             std::move(carried_stats), std::move(carried_costs), std::move(batch_overhead)});
           }),
           py::arg("drafters"), py::arg("cost"), py::kw_only(), py::arg("decay") = 0.95,
           py::arg("explore_every") = 16, py::arg("budgets") = std::vector<int64_t>{},
           py::arg("own_forwards") = std::vector<bool>{},
           py::arg("carried_stats") = std::vector<core::AcceptanceStats>{},
           py::arg("carried_costs") = std::vector<double>{}, py::arg("batch_overhead") = nullptr,
           py::keep_alive<1, 2>())
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
