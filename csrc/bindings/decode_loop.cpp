#include "decode/decode_loop.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "decode/batched_forward.h"

namespace py = pybind11;

namespace mtprobe::bindings {

void bind_decode_loop(py::module_& m) {
  py::class_<DecodeResult>(m, "DecodeResult")
      .def_readonly("sequence", &DecodeResult::sequence)
      .def_readonly("accept_lengths", &DecodeResult::accept_lengths)
      .def_readonly("block_sizes", &DecodeResult::block_sizes)
      .def_readonly("forward_calls", &DecodeResult::forward_calls)
      .def_readonly("total_seconds", &DecodeResult::total_seconds)
      .def_readonly("forward_seconds", &DecodeResult::forward_seconds)
      .def_readonly("prefill_seconds", &DecodeResult::prefill_seconds)
      .def_readonly("mask_rebuilds", &DecodeResult::mask_rebuilds)
      .def_readonly("fallback_steps", &DecodeResult::fallback_steps)
      .def_readonly("exact_steps", &DecodeResult::exact_steps)
      .def_readonly("kv_capacity", &DecodeResult::kv_capacity)
      .def_readonly("mask_capacity", &DecodeResult::mask_capacity)
      .def_readonly("drafted_per_depth", &DecodeResult::drafted_per_depth)
      .def_readonly("accepted_per_depth", &DecodeResult::accepted_per_depth)
      .def_readonly("stop_reason", &DecodeResult::stop_reason)
      .def_readonly("host_reads", &DecodeResult::host_reads)
      .def_readonly("scores", &DecodeResult::scores)
      .def_readonly("logits", &DecodeResult::logits);

  py::class_<DecodeLoop>(m, "DecodeLoop", "Draft, verify and compact until the sequence ends.")
      .def(py::init([](std::shared_ptr<Drafter> drafter, std::optional<ForwardFn> forward,
                       KvBuffersFn kv_buffers, int64_t max_new_tokens, std::vector<int64_t> eos_token_ids,
                       int64_t max_positions, int64_t block_complexity, int64_t kv_capacity,
                       const std::string& mask_dtype, const std::string& device, bool incremental_masks,
                       bool do_sample, std::optional<ProcessFn> process, std::optional<StopFn> stop,
                       std::optional<StreamFn> stream, bool ancestor_bits, int64_t vocab_size,
                       bool keep_scores, bool keep_logits, std::optional<ForwardFn> exact_forward,
                       double margin_bound, std::shared_ptr<BatchedForward> batched, int64_t row,
                       std::optional<at::Generator> generator) {
             // The target's forward: a Python callable (an HFAdapter's), or row `row` of a batched forward.
             TORCH_CHECK_VALUE(forward.has_value() != (batched != nullptr),
                               "DecodeLoop: give either a forward or a batched forward and its row, not ",
                               forward.has_value() ? "both" : "neither");
             ForwardFn fn = batched ? batched->forward_for(row) : std::move(*forward);
             // A row's own forwards (HF's, deciding near-ties) run where the batch's do
             // (BatchedForward::run).
             if (batched && exact_forward.has_value())
               exact_forward = batched->on_runner(row, std::move(*exact_forward));
             DecodeOptions o;
             o.max_new_tokens = max_new_tokens;
             o.eos_token_ids = std::move(eos_token_ids);
             o.max_positions = max_positions;
             o.block_complexity = block_complexity;
             o.kv_capacity = kv_capacity;
             o.mask_dtype = parse_mask_dtype(mask_dtype);
             o.device = at::Device(device);
             o.incremental_masks = incremental_masks;
             o.do_sample = do_sample;
             o.ancestor_bits = ancestor_bits;
             o.vocab_size = vocab_size;
             o.keep_scores = keep_scores;
             o.keep_logits = keep_logits;
             o.margin_bound = margin_bound;
             o.generator = std::move(generator);
             return std::make_unique<DecodeLoop>(std::move(drafter), std::move(fn), std::move(kv_buffers),
                                                 std::move(o), std::move(process), std::move(stop),
                                                 std::move(stream), std::move(exact_forward));
           }),
           py::arg("drafter"), py::arg("forward"), py::arg("kv_buffers"), py::kw_only(),
           py::arg("max_new_tokens"), py::arg("eos_token_ids"), py::arg("max_positions"),
           py::arg("block_complexity"), py::arg("kv_capacity"), py::arg("mask_dtype"), py::arg("device"),
           py::arg("incremental_masks") = true, py::arg("do_sample") = false, py::arg("process") = py::none(),
           py::arg("stop") = py::none(), py::arg("stream") = py::none(), py::arg("ancestor_bits") = false,
           py::arg("vocab_size") = 0, py::arg("keep_scores") = false, py::arg("keep_logits") = false,
           py::arg("exact_forward") = py::none(), py::arg("margin_bound") = 0.0, py::arg("batched") = nullptr,
           py::arg("row") = -1, py::arg("generator") = py::none(),
           // The loop holds the drafter: a Python drafter passed as a temporary must outlive it; and its
           // batched forward (argument 23, after self and 21 others), whose row function it calls.
           py::keep_alive<1, 2>(), py::keep_alive<1, 23>())
      .def("run", &DecodeLoop::run, py::arg("prompt"));

  py::class_<BatchedForward, std::shared_ptr<BatchedForward>>(
      m, "BatchedForward",
      "One target forward per step for several sequences' decode loops (csrc/decode/batched_forward.h): "
      "each loop runs on its own thread and its forward waits for the others'.")
      .def(py::init([](std::shared_ptr<TargetForward> target, std::vector<std::vector<at::Tensor>> keys,
                       std::vector<std::vector<at::Tensor>> values, std::vector<int64_t> prefill_logits_from,
                       std::vector<at::Tensor> prefilled, std::shared_ptr<SharedSeconds> overhead,
                       bool share_prefills, std::shared_ptr<BatchDrafting> drafting,
                       std::optional<BatchForwardFn> forward) {
             TORCH_CHECK_VALUE(
                 values.size() == keys.size() && prefill_logits_from.size() == keys.size() &&
                     prefilled.size() == keys.size(),
                 "BatchedForward: keys, values, prefill_logits_from and prefilled need one entry "
                 "per row (",
                 keys.size(), ", ", values.size(), ", ", prefill_logits_from.size(), " and ",
                 prefilled.size(), ")");
             std::vector<BatchRow> rows;
             for (size_t r = 0; r < keys.size(); ++r)
               rows.push_back(
                   {std::move(keys[r]), std::move(values[r]), prefill_logits_from[r], prefilled[r]});
             return std::make_shared<BatchedForward>(std::move(target), forward.value_or(BatchForwardFn{}),
                                                     std::move(rows), std::move(overhead), share_prefills,
                                                     std::move(drafting));
           }),
           py::arg("target"), py::kw_only(), py::arg("keys"), py::arg("values"),
           py::arg("prefill_logits_from"), py::arg("prefilled"), py::arg("overhead") = nullptr,
           py::arg("share_prefills") = true, py::arg("drafting") = nullptr, py::arg("forward") = py::none(),
           "target: the C++ forward (TargetForward), or None with forward: a callable taking the step's "
           "blocks (list[TargetBlock], each naming its row) and returning (logits, hidden or None) per "
           "block")
      .def("run", &BatchedForward::run, py::arg("loops"), py::arg("prompts"), py::arg("cuda_streams") = false,
           "Runs loops[i].run(prompts[i]) on one thread each (loop i built with batched=self, row=i) until "
           "all have stopped; their DecodeResults in order. cuda_streams: the threads run on the caller's "
           "current CUDA streams (a model on a GPU; off, CUDA is not touched)",
           py::call_guard<py::gil_scoped_release>())
      .def("draft_step", &BatchedForward::draft_step, py::arg("row"), py::arg("decoder"), py::arg("token"),
           py::arg("position"), py::arg("keys"), py::arg("values"), py::kw_only(), py::arg("head_scan") = 0,
           "Row `row`'s quantized self-draft step (QuantizedDecoder.step's arguments): waits for every live "
           "row "
           "and runs with the other rows' pending draft steps in one QuantizedDecoder.step_rows; logits "
           "[vocab]. From a row's loop only, while run() runs",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rows", &BatchedForward::rows)
      .def_property_readonly("forwards", &BatchedForward::forwards, "batched forwards run so far")
      .def_property_readonly("draft_steps", &BatchedForward::draft_steps,
                             "batched draft steps (QuantizedDecoder.step_rows calls) run so far")
      .def_property_readonly("draft_rows", &BatchedForward::draft_rows, "rows those draft steps ran")
      .def_property_readonly("shared_prefills", &BatchedForward::shared_prefills,
                             "rows whose prefill another row's identical one ran for (copied)")
      .def("prefill_copied", &BatchedForward::prefill_copied, py::arg("row"),
           "whether row's prefill in the last run was a copy of another row's identical one")
      .def_property_readonly("forward_seconds", &BatchedForward::forward_seconds,
                             "wall time spent in the batched forwards")
      .def_property_readonly(
          "step_overhead", &BatchedForward::step_overhead,
          "seconds a batch step spends besides its forward and draft steps (moving average)")
      .def_property_readonly("draft_seconds", &BatchedForward::draft_seconds,
                             "wall time spent in the batched draft steps");
}

}  // namespace mtprobe::bindings
