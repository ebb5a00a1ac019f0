// The drafters and the types they exchange with the decode loop (csrc/drafters/), and the
// cross-request n-gram memory they share. Bindings that exist for tests live in testing.cpp.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "bindings/bindings.h"
#include "core/ngram_store.h"
#include "core/topology.h"
#include "drafters/draft_model.h"
#include "drafters/drafter.h"
#include "drafters/heads.h"
#include "drafters/hybrid.h"
#include "drafters/lookahead.h"
#include "drafters/mask_probe.h"
#include "drafters/plain.h"
#include "drafters/prompt_lookup.h"
#include "drafters/stand.h"

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
    // Written out rather than PYBIND11_OVERRIDE_PURE: a wrong return value gets an error that
    // names the drafter and the expected type, not a bare cast failure.
    py::gil_scoped_acquire gil;
    py::function override = py::get_override(static_cast<const Drafter*>(this), "propose");
    if (!override) {
      throw py::type_error(
          "a mtprobe._C.Drafter subclass must implement propose(committed, prefix_len, limits)");
    }
    py::object out = override(committed, prefix_len, limits);
    if (!py::isinstance<DraftBlock>(out)) {
      const std::string who = py::str(override.attr("__self__").get_type().attr("__qualname__"));
      throw py::type_error(
          who + ".propose() returned " +
          (out.is_none() ? std::string("None") : std::string(py::str(out.get_type().attr("__name__")))) +
          "; it must return a mtprobe._C.DraftBlock (the committed tokens alone make a valid "
          "block: mtprobe._C.token_block(committed, [], []))");
    }
    return out.cast<DraftBlock>();
  }
  void observe(const StepOutcome& outcome) override {
    PYBIND11_OVERRIDE_PURE(void, Drafter, observe, outcome);
  }
  bool wants_hidden_states() const override { PYBIND11_OVERRIDE(bool, Drafter, wants_hidden_states); }
};

// The probing options MaskProbeDrafter and HybridDrafter take from Python.
MaskProbeOptions mask_options(int64_t num_masks, int64_t block_complexity, bool prune, std::string mask_init,
                              double gaussian_shift, double mask_lambda, int64_t seed,
                              const std::optional<at::Tensor>& initial_masks) {
  MaskProbeOptions o;
  o.num_masks = num_masks;
  o.block_complexity = block_complexity;
  o.prune = prune;
  o.mask_init = std::move(mask_init);
  o.gaussian_shift = gaussian_shift;
  o.mask_lambda = mask_lambda;
  o.seed = seed;
  if (initial_masks) o.initial_masks = *initial_masks;
  return o;
}

// EntMTP's bank arguments into the options of a drafter with a bank mode (MaskProbeOptions, HeadsOptions).
template <typename Options>
void set_bank(Options& o, std::vector<core::Topology> bank, const std::optional<core::TopologyPolicy>& policy,
              std::string feature, double ema, bool record) {
  TORCH_CHECK_VALUE(bank.empty() == !policy.has_value(),
                    "a topology bank and its policy come together (bank=[...], policy=TopologyPolicy(...))");
  o.bank = std::move(bank);
  if (policy) o.policy = *policy;
  o.feature = std::move(feature);
  o.ema = ema;
  o.record = record;
}
}  // namespace

void bind_drafters(py::module_& m) {
  m.def(
      "token_block",
      [](const at::Tensor& committed, const std::vector<int64_t>& tokens, const std::vector<int64_t>& parents,
         int64_t num_drafts) {
        TORCH_CHECK_VALUE(
            committed.dim() == 1 && committed.scalar_type() == at::kLong && committed.numel() >= 1,
            "committed must be a non-empty 1-D int64 tensor, got ", committed.sizes());
        TORCH_CHECK_VALUE(tokens.size() == parents.size(),
                          "tokens and parents need one entry per draft, got ", tokens.size(), " and ",
                          parents.size());
        for (size_t j = 0; j < parents.size(); ++j) {
          TORCH_CHECK_VALUE(parents[j] >= -1 && parents[j] < static_cast<int64_t>(j), "draft ", j,
                            " has parent ", parents[j],
                            "; a parent is -1 (the last committed token) or an "
                            "earlier draft");
        }
        return token_block(committed, tokens, parents, num_drafts);
      },
      py::arg("committed"), py::arg("tokens"), py::arg("parents"), py::arg("num_drafts") = -1,
      "The block [committed | draft tokens] of a token drafter (csrc/drafters/drafter.h): parents[j] is the "
      "index of draft j's parent among the drafts, -1 for the last committed token.");

  py::class_<DraftBlock>(m, "DraftBlock", "The inputs of one target forward (see csrc/drafters/drafter.h).")
      .def(py::init<>())
      .def_readwrite("tokens", &DraftBlock::tokens)
      .def_readwrite("embeds", &DraftBlock::embeds)
      .def_readwrite("parents", &DraftBlock::parents)
      .def_readwrite("num_committed", &DraftBlock::num_committed)
      .def_readwrite("num_nodes", &DraftBlock::num_nodes)
      .def_readwrite("draft_probs", &DraftBlock::draft_probs)
      .def_property_readonly("num_inputs", &DraftBlock::num_inputs);

  py::class_<StepOutcome>(m, "StepOutcome", "What one step decided.")
      .def(py::init([](int64_t prefix_len, std::vector<int64_t> path, std::vector<int64_t> new_tokens,
                       bool finished, bool block_replaced) {
             TORCH_CHECK_VALUE(!path.empty(), "path starts with the block's last committed input; got []");
             TORCH_CHECK_VALUE(!new_tokens.empty() || finished,
                               "a step appends at least one token (the bonus), got new_tokens=[]");
             StepOutcome o;
             o.prefix_len = prefix_len;
             o.path = std::move(path);
             o.new_tokens = std::move(new_tokens);
             o.finished = finished;
             o.block_replaced = block_replaced;
             return o;
           }),
           py::arg("prefix_len"), py::arg("path"), py::arg("new_tokens"), py::kw_only(),
           py::arg("finished") = false, py::arg("block_replaced") = false,
           "A step verified outside the decode loop (a serving engine's: mtprobe.vllm): tokens only, no "
           "logits (StepOutcome.logits is None).")
      .def_readonly("prefix_len", &StepOutcome::prefix_len)
      .def_readonly("path", &StepOutcome::path)
      .def_readonly("new_tokens", &StepOutcome::new_tokens)
      .def_property_readonly("logits",
                             [](const StepOutcome& o) -> std::optional<at::Tensor> {
                               if (!o.logits.defined()) return std::nullopt;
                               return o.logits;
                             })
      .def_readonly("hidden", &StepOutcome::hidden)
      .def_readonly("finished", &StepOutcome::finished)
      .def_readonly("block_replaced", &StepOutcome::block_replaced);

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
      m, "MaskProbeDrafter", "Mask-token probing: k chained mask tokens per node (seed 001).")
      .def(py::init([](at::Tensor embedding, int64_t num_masks, int64_t block_complexity, bool dynamic_tree,
                       std::vector<int64_t> branches, bool prune, std::string mask_init,
                       double gaussian_shift, double mask_lambda, int64_t seed,
                       std::vector<core::Topology> bank, std::optional<core::TopologyPolicy> policy,
                       std::string feature, double ema, bool record, std::optional<at::Tensor> initial_masks,
                       std::optional<double> mask_value) {
             TORCH_CHECK_VALUE(!mask_value || (std::isfinite(*mask_value) && *mask_value >= 0.0),
                               "mask_value must be None (masks on every node) or a finite number >= 0, got ",
                               mask_value.value_or(0.0));
             MaskProbeOptions o = mask_options(num_masks, block_complexity, prune, std::move(mask_init),
                                               gaussian_shift, mask_lambda, seed, initial_masks);
             o.dynamic_tree = dynamic_tree;
             o.mask_value = mask_value.value_or(-1.0);
             o.branches = std::move(branches);
             set_bank(o, std::move(bank), policy, std::move(feature), ema, record);
             return std::make_shared<MaskProbeDrafter>(std::move(embedding), std::move(o));
           }),
           py::arg("embedding"), py::kw_only(), py::arg("num_masks"), py::arg("block_complexity"),
           py::arg("dynamic_tree"), py::arg("branches"), py::arg("prune"), py::arg("mask_init"),
           py::arg("gaussian_shift"), py::arg("mask_lambda"), py::arg("seed") = 0,
           py::arg("bank") = std::vector<core::Topology>{}, py::arg("policy") = std::nullopt,
           py::arg("feature") = "path_value", py::arg("ema") = 0.5, py::arg("record") = false,
           py::arg("initial_masks") = std::nullopt, py::arg("mask_value") = std::nullopt)
      .def_property_readonly("mask_embeddings", &MaskProbeDrafter::mask_embeddings)
      .def_property_readonly("candidate_width", &MaskProbeDrafter::candidate_width)
      .def("tree_choices", &MaskProbeDrafter::tree_choices,
           "EntMTP: the bank tree each decode step drafted (-1: none).")
      .def(
          "step_log",
          [](const MaskProbeDrafter& d) {
            const auto& f = d.log_features();
            std::vector<std::vector<double>> features;
            for (const auto& x : f) features.push_back({x.top1, x.path_value, x.entropy_ema, x.accept_ema});
            const auto n = static_cast<int64_t>(d.log_positions().size());
            at::Tensor tokens = at::tensor(d.log_tokens(), at::kLong)
                                    .view({n, d.options().num_masks, d.candidate_width()});  // [n, k, m]
            py::dict out;
            out["positions"] = d.log_positions();
            out["candidates"] = tokens;
            out["features"] = features;  // [n, 4]: top1, path_value, entropy_ema, accept_ema
            out["trees"] = d.log_trees();
            return out;
          },
          "EntMTP with record=True: per step with candidates, the next root's position, the candidates "
          "[n, k, m], the features [top1, path_value, entropy_ema, accept_ema] and the tree chosen next.");

  py::class_<PlainDrafter, Drafter, std::shared_ptr<PlainDrafter>>(
      m, "PlainDrafter", "Plain decoding: no drafts, the last committed token alone each step.")
      .def(py::init([] { return std::make_shared<PlainDrafter>(); }));

  py::class_<PromptLookupDrafter, Drafter, std::shared_ptr<PromptLookupDrafter>>(
      m, "PromptLookupDrafter",
      "Prompt lookup: a chain copied from an earlier occurrence of the last n-gram.")
      .def(py::init([](int64_t num_tokens, int64_t max_ngram_size) {
             return std::make_shared<PromptLookupDrafter>(PromptLookupOptions{num_tokens, max_ngram_size});
           }),
           py::kw_only(), py::arg("num_tokens"), py::arg("max_ngram_size"));

  py::class_<core::MarginStats, std::shared_ptr<core::MarginStats>>(
      m, "MarginStats",
      "A draft model's confidence by class of its top-2 logit margin (csrc/core/schedule.h): a greedy draft "
      "in a "
      "class that has matched the target less than stop_below of the time ends its chain.")
      .def(py::init<double>(), py::arg("stop_below") = 0.9)
      .def_property_readonly_static("edges",
                                    [](py::object) {
                                      return std::vector<double>(core::MarginStats::kEdges.begin(),
                                                                 core::MarginStats::kEdges.end());
                                    })
      .def_static("class_of", &core::MarginStats::class_of, py::arg("margin"))
      .def("rate", &core::MarginStats::rate, py::arg("margin"))
      .def("record", &core::MarginStats::record, py::arg("margin"), py::arg("matched"))
      .def("stops", &core::MarginStats::stops, py::arg("margin"))
      .def_property_readonly("stop_below", &core::MarginStats::stop_below)
      .def_property_readonly("trials", &core::MarginStats::trials)
      .def_property_readonly("matches", &core::MarginStats::matches);

  py::class_<DraftModelDrafter, Drafter, std::shared_ptr<DraftModelDrafter>>(
      m, "DraftModelDrafter",
      "Draft-model speculative decoding: a chain of num_tokens drafts from a smaller model with its own KV "
      "cache.")
      .def(
          py::init([](ForwardFn forward, int64_t num_tokens, bool do_sample, std::optional<ProcessFn> process,
                      int64_t top_branches, bool skip_prefill,
                      std::shared_ptr<core::MarginStats> margin_stats) {
            return std::make_shared<DraftModelDrafter>(
                std::move(forward),
                DraftModelOptions{num_tokens, do_sample, top_branches, skip_prefill, std::move(margin_stats)},
                std::move(process));
          }),
          py::arg("forward"), py::kw_only(), py::arg("num_tokens"), py::arg("do_sample") = false,
          py::arg("process") = py::none(), py::arg("top_branches") = 1, py::arg("skip_prefill") = false,
          py::arg("margin_stats") = nullptr)
      .def_property_readonly("draft_forwards", &DraftModelDrafter::draft_forwards);

  py::class_<HeadsDrafter, Drafter, std::shared_ptr<HeadsDrafter>>(
      m, "HeadsDrafter",
      "Probabilistic-circuit heads (MTPC): drafts from a circuit over the next `window` tokens that `head` "
      "computes from the target's hidden states, conditioned on the root token. head(hidden [rows, d], "
      "logits [V], prefix_len): with committed_rows=True (draft layers) every row the step committed, "
      "else only the last.")
      .def(py::init([](HeadFn head, std::string circuit, int64_t window, int64_t rank, int64_t vocab,
                       bool do_sample, int64_t top_branches, bool committed_rows, double min_path_prob,
                       std::vector<core::Topology> bank, std::optional<core::TopologyPolicy> policy,
                       std::string feature, double ema, bool record) {
             HeadsOptions o{std::move(circuit), window,       rank,           vocab,
                            do_sample,          top_branches, committed_rows, min_path_prob};
             set_bank(o, std::move(bank), policy, std::move(feature), ema, record);
             return std::make_shared<HeadsDrafter>(std::move(head), std::move(o));
           }),
           py::arg("head"), py::kw_only(), py::arg("circuit"), py::arg("window"), py::arg("rank"),
           py::arg("vocab"), py::arg("do_sample") = false, py::arg("top_branches") = 1,
           py::arg("committed_rows") = false, py::arg("min_path_prob") = 0.0,
           py::arg("bank") = std::vector<core::Topology>{}, py::arg("policy") = std::nullopt,
           py::arg("feature") = "path_value", py::arg("ema") = 0.5, py::arg("record") = false)
      .def_property_readonly("bank_width", &HeadsDrafter::bank_width)
      .def("tree_choices", &HeadsDrafter::tree_choices,
           "EntMTP: the bank tree each decode step drafted (-1: none).")
      .def(
          "step_log",
          [](const HeadsDrafter& d) {
            std::vector<int64_t> positions, trees;
            std::vector<std::vector<int64_t>> ranks;
            std::vector<std::vector<double>> features;
            for (const auto& r : d.step_log()) {
              positions.push_back(r.position);
              ranks.push_back(r.ranks);
              const auto& x = r.features;
              features.push_back({x.top1, x.path_value, x.entropy_ema, x.accept_ema});
              trees.push_back(r.tree);
            }
            py::dict out;
            out["positions"] = positions;
            out["ranks"] = ranks;        // [n, window - 1]
            out["features"] = features;  // [n, 4]: top1, path_value, entropy_ema, accept_ema
            out["trees"] = trees;
            return out;
          },
          "EntMTP with record=True: per step with a head window, the next root's position, the true "
          "continuation's child ranks [n, window - 1] (-1: none), the features [top1, path_value, "
          "entropy_ema, accept_ema] and the tree chosen for it.")
      .def_property_readonly("head_calls", &HeadsDrafter::head_calls);

  // The cross-request memory of STAND and the hybrid (csrc/core/ngram_store.h): held by shared_ptr,
  // so any number of drafters share one.
  py::class_<core::NgramMemory, std::shared_ptr<core::NgramMemory>>(
      m, "NgramMemory",
      "A bounded n-gram memory shared across generations (least recently used keys evicted): STAND and "
      "the hybrid draft from it where their per-request store has no key, and fold every finished "
      "generation's text (prompt + output) into it.")
      .def(py::init([](int64_t capacity, int64_t max_ngram, int64_t top_k) {
             return std::make_shared<core::NgramMemory>(capacity, max_ngram, top_k);
           }),
           py::arg("capacity"), py::arg("max_ngram") = 3, py::arg("top_k") = 8)
      .def(
          "fold",
          [](core::NgramMemory& mem, const std::vector<int64_t>& text) {
            mem.fold(text.data(), static_cast<int64_t>(text.size()));
          },
          py::arg("text"), "Fold one generation's committed text (prompt + output) in.")
      .def(
          "lookup",
          [](core::NgramMemory& mem, const std::vector<int64_t>& context, int64_t cap) {
            std::vector<int64_t> tokens(static_cast<size_t>(std::max<int64_t>(cap, 0)));
            std::vector<double> probs(tokens.size());
            const int64_t n = mem.lookup(context.data(), static_cast<int64_t>(context.size()), tokens.data(),
                                         probs.data(), cap);
            tokens.resize(static_cast<size_t>(n));
            probs.resize(static_cast<size_t>(n));
            return py::make_tuple(tokens, probs);
          },
          py::arg("context"), py::arg("cap") = 64,
          "The longest matching key's table (tokens, probs); marks the key used.")
      .def("keys", &core::NgramMemory::keys, "Every key, least recently used first.")
      .def("clear", &core::NgramMemory::clear)
      .def("__len__", &core::NgramMemory::size)
      .def_property_readonly("size", &core::NgramMemory::size)
      .def_property_readonly("capacity", &core::NgramMemory::capacity)
      .def_property_readonly("max_ngram", &core::NgramMemory::max_ngram)
      .def_property_readonly("top_k", &core::NgramMemory::top_k)
      .def_property_readonly("hits", &core::NgramMemory::hits,
                             "Lookups that returned a table since the last clear().")
      .def("__repr__", [](const core::NgramMemory& mem) {
        return "NgramMemory(capacity=" + std::to_string(mem.capacity()) +
               ", max_ngram=" + std::to_string(mem.max_ngram()) + ", top_k=" + std::to_string(mem.top_k()) +
               "; " + std::to_string(mem.size()) + " keys)";
      });

  py::class_<StandDrafter, Drafter, std::shared_ptr<StandDrafter>>(
      m, "StandDrafter", "STAND: a draft tree from an n-gram store of the target's own distributions.")
      .def(py::init([](int64_t max_depth, int64_t max_ngram, int64_t table_size, int64_t logits_top_k,
                       std::shared_ptr<core::NgramMemory> memory, bool fold_memory,
                       std::optional<int64_t> prompt_logits) {
             return std::make_shared<StandDrafter>(StandOptions{max_depth, max_ngram, table_size,
                                                                logits_top_k, std::move(memory), fold_memory,
                                                                prompt_logits});
           }),
           py::kw_only(), py::arg("max_depth"), py::arg("max_ngram"), py::arg("table_size"),
           py::arg("logits_top_k"), py::arg("memory") = py::none(), py::arg("fold_memory") = true,
           py::arg("prompt_logits") = py::none());

  py::class_<HybridDrafter, Drafter, std::shared_ptr<HybridDrafter>>(
      m, "HybridDrafter", "Mask-token probing and STAND's n-gram store drafting one tree under one budget.")
      .def(py::init([](at::Tensor embedding, int64_t num_masks, int64_t block_complexity, bool prune,
                       std::string mask_init, double gaussian_shift, double mask_lambda, int64_t seed,
                       int64_t max_depth, int64_t max_ngram, int64_t table_size, int64_t logits_top_k,
                       std::shared_ptr<core::NgramMemory> memory, std::optional<at::Tensor> initial_masks,
                       std::optional<double> mask_value, bool fold_memory, bool grow_probed,
                       std::optional<int64_t> prompt_logits) {
             TORCH_CHECK_VALUE(!mask_value || (std::isfinite(*mask_value) && *mask_value >= 0.0),
                               "mask_value must be None (masks on every node) or a finite number >= 0, got ",
                               mask_value.value_or(0.0));
             return std::make_shared<HybridDrafter>(
                 std::move(embedding),
                 mask_options(num_masks, block_complexity, prune, std::move(mask_init), gaussian_shift,
                              mask_lambda, seed, initial_masks),
                 StandOptions{max_depth, max_ngram, table_size, logits_top_k, std::move(memory), fold_memory,
                              prompt_logits},
                 mask_value.value_or(-1.0), grow_probed);
           }),
           py::arg("embedding"), py::kw_only(), py::arg("num_masks"), py::arg("block_complexity"),
           py::arg("prune"), py::arg("mask_init"), py::arg("gaussian_shift"), py::arg("mask_lambda"),
           py::arg("seed"), py::arg("max_depth"), py::arg("max_ngram"), py::arg("table_size"),
           py::arg("logits_top_k"), py::arg("memory") = py::none(), py::arg("initial_masks") = std::nullopt,
           py::arg("mask_value") = std::nullopt, py::arg("fold_memory") = true,
           py::arg("grow_probed") = false, py::arg("prompt_logits") = std::nullopt)
      .def_property_readonly("probe_nodes", &HybridDrafter::probe_nodes)
      .def_property_readonly("ngram_nodes", &HybridDrafter::ngram_nodes);

  py::class_<LookaheadDrafter, Drafter, std::shared_ptr<LookaheadDrafter>>(
      m, "LookaheadDrafter",
      "Lookahead decoding: a Jacobi window and the verification of its n-grams in one forward.")
      .def(py::init([](int64_t ngram_size, int64_t window, int64_t guess_set_size, bool pool_from_prompt) {
             return std::make_shared<LookaheadDrafter>(
                 LookaheadOptions{ngram_size, window, guess_set_size, pool_from_prompt});
           }),
           py::kw_only(), py::arg("ngram_size"), py::arg("window"), py::arg("guess_set_size"),
           py::arg("pool_from_prompt") = false)
      .def_property_readonly("block_complexity", &LookaheadDrafter::block_complexity);
}

}  // namespace mtprobe::bindings
