// Bindings that exist for tests and inspection, not for generation: the torch-free core's
// algorithms (draft trees, prompt lookup, STAND's n-gram store, lookahead's pool and window, the
// scheduler's best cut), the decode loop's mask builder and the small-batch linear op's kernels, exposed so
// that tests/test_*.py can compare each with its Python reference (mtprobe.reference) or pin its output.
// Nothing in python/mtprobe calls them; the drafters and the decode loop reach the same C++ directly. They
// keep flat names on mtprobe._C (mtprobe._C.build_draft_tree, ...), registered after the API bindings whose
// types they take (NgramMemory, AcceptanceStats, CostTable).
#include <ATen/Parallel.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "bindings/bindings.h"
#include "core/draft_tree.h"
#include "core/lookahead.h"
#include "core/ngram.h"
#include "core/ngram_store.h"
#include "core/schedule.h"
#include "decode/tree_mask_builder.h"
#include "ops/ops.h"

namespace py = pybind11;

namespace mtprobe::bindings {

namespace {
// A draft tree as Python lists (tokens, parents, probs).
py::tuple tree_lists(const std::vector<core::DraftNode>& nodes) {
  std::vector<int64_t> tokens, parents;
  std::vector<double> probs;
  for (const auto& n : nodes) {
    tokens.push_back(n.token);
    parents.push_back(n.parent);
    probs.push_back(n.prob);
  }
  return py::make_tuple(tokens, parents, probs);
}

// A draft tree from Python lists (tokens, parents, probs), checked: root first, parents before children.
std::vector<core::DraftNode> tree_nodes(const std::vector<int64_t>& t, const std::vector<int64_t>& p,
                                        const std::vector<double>& s) {
  TORCH_CHECK_VALUE(t.size() == p.size() && t.size() == s.size(),
                    "tokens, parents and probs of a tree must have one entry per node");
  std::vector<core::DraftNode> out;
  for (size_t i = 0; i < t.size(); ++i) {
    TORCH_CHECK_VALUE(i == 0 ? p[i] == -1 : p[i] >= 0 && p[i] < static_cast<int64_t>(i), "node ", i,
                      " has parent ", p[i], "; the root comes first and parents before children");
    out.push_back({t[i], p[i], i == 0 ? 0 : out[static_cast<size_t>(p[i])].depth + 1, s[i]});
  }
  return out;
}
}  // namespace

void bind_testing(py::module_& m) {
  // The small-batch linear op with its kernel named (csrc/ops/ops.h): tests check each kernel against
  // mtprobe.reference.small_batch_linear, benchmarks time the kernels side by side.
  // How many threads at::parallel_for runs a range of n on (each chunk of one item notes its thread):
  // torch's thread count where the extension is built with OpenMP as torch is; 1 where it is not, and
  // then every at::parallel_for of mtprobe's ops runs serially.
  m.def(
      "parallel_for_threads",
      [](int64_t n) {
        std::mutex mu;
        std::set<std::thread::id> ids;
        at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
          std::lock_guard<std::mutex> lock(mu);
          ids.insert(std::this_thread::get_id());
        });
        return static_cast<int64_t>(ids.size());
      },
      py::arg("n"));
  m.def(
      "small_batch_linear_at_level", &ops::small_batch_linear_at_level, py::arg("x"), py::arg("weight"),
      py::arg("bias"), py::arg("level"),
      "torch.ops.mtprobe.small_batch_linear with the kernel named: 0 portable, 1 AVX2/FMA, 2 AVX-512, 3 the "
      "default (a level the CPU does not run falls back to the default).");
  m.def(
      "panel_linear_at_level", &ops::panel_linear_at_level, py::arg("x"), py::arg("panels"), py::arg("bias"),
      py::arg("out_features"), py::arg("level"),
      "torch.ops.mtprobe.panel_linear with the kernel named: 0 portable, 1 AVX2/FMA, 2 AVX-512, 3 the widest "
      "this CPU runs (a level the CPU does not run falls back to that).");
  m.def("quantized_linear_at_level", &ops::quantized_linear_at_level, py::arg("x"), py::arg("codes"),
        py::arg("scale"), py::arg("min"), py::arg("bias"), py::arg("level"),
        "torch.ops.mtprobe.quantized_linear with the kernel named: 0 portable, 1 AVX2/FMA, 2 AVX-512, 3 the "
        "default (a level the CPU does not run falls back to the default).");
  m.def(
      "quantized_linear_int8_at_level", &ops::quantized_linear_int8_at_level, py::arg("x"), py::arg("codes"),
      py::arg("scale"), py::arg("min"), py::arg("bias"), py::arg("level"),
      "torch.ops.mtprobe.quantized_linear_int8 with the kernel named: 0 portable, 1 AVX2, 2 AVX-512 VNNI, 3 "
      "the default (a level the CPU does not run falls back to the default).");
  // Draft trees from candidates, merged, and their mask carriers (csrc/core/draft_tree.h; tests compare
  // them with mtprobe.reference.draft_tree).
  m.def(
      "build_draft_tree",
      [](int64_t root_token, const at::Tensor& cand_tokens, const at::Tensor& cand_probs, bool dynamic,
         std::vector<int64_t> branches, int64_t budget, bool prune) {
        TORCH_CHECK_VALUE(cand_tokens.dim() == 2 && cand_tokens.sizes() == cand_probs.sizes(),
                          "cand_tokens and cand_probs must both be [depths, m]");
        at::Tensor t = cand_tokens.to(at::kCPU, at::kLong).contiguous();
        at::Tensor p = cand_probs.to(at::kCPU, at::kFloat).contiguous();
        const int64_t depths = t.size(0), width = t.size(1);
        if (!dynamic) {
          TORCH_CHECK_VALUE(static_cast<int64_t>(branches.size()) == depths,
                            "need one branch count per depth");
        }
        std::vector<core::DraftNode> nodes =
            dynamic ? core::build_dynamic_tree(root_token, t.data_ptr<int64_t>(), p.data_ptr<float>(), depths,
                                               width, budget, prune)
                    : core::build_static_tree(root_token, t.data_ptr<int64_t>(), p.data_ptr<float>(), depths,
                                              width, branches.data(), prune);
        return tree_lists(nodes);
      },
      py::arg("root_token"), py::arg("cand_tokens"), py::arg("cand_probs"), py::kw_only(), py::arg("dynamic"),
      py::arg("branches") = std::vector<int64_t>{}, py::arg("budget") = 0, py::arg("prune") = true,
      "Draft tree from per-depth candidates [depths, m] (csrc/core/draft_tree.h): (tokens, parents, probs).");

  m.def(
      "merge_draft_trees",
      [](const std::vector<int64_t>& a_tokens, const std::vector<int64_t>& a_parents,
         const std::vector<double>& a_probs, const std::vector<int64_t>& b_tokens,
         const std::vector<int64_t>& b_parents, const std::vector<double>& b_probs, int64_t budget) {
        return tree_lists(core::merge_draft_trees(tree_nodes(a_tokens, a_parents, a_probs),
                                                  tree_nodes(b_tokens, b_parents, b_probs), budget));
      },
      py::arg("a_tokens"), py::arg("a_parents"), py::arg("a_probs"), py::arg("b_tokens"),
      py::arg("b_parents"), py::arg("b_probs"), py::arg("budget"),
      "Two draft trees of one root merged, the best budget - 1 nodes kept (csrc/core/draft_tree.h).");

  m.def(
      "plan_mask_carriers",
      [](const std::vector<int64_t>& tokens, const std::vector<int64_t>& parents,
         const std::vector<double>& probs, int64_t inputs, int64_t k, double mask_value) {
        TORCH_CHECK_VALUE(inputs >= 1 && k >= 1, "inputs and k must be >= 1, got ", inputs, " and ", k);
        TORCH_CHECK_VALUE(std::isfinite(mask_value) && mask_value >= 0.0,
                          "mask_value must be a finite number >= 0, got ", mask_value);
        core::MaskPlan plan =
            core::plan_mask_carriers(tree_nodes(tokens, parents, probs), inputs, k, mask_value);
        py::tuple t = tree_lists(plan.nodes);
        return py::make_tuple(t[0], t[1], t[2], std::vector<bool>(plan.carries.begin(), plan.carries.end()));
      },
      py::arg("tokens"), py::arg("parents"), py::arg("probs"), py::arg("inputs"), py::arg("k"),
      py::arg("mask_value"),
      "Which nodes of a draft tree carry k masks when masks and drafts share `inputs` inputs "
      "(csrc/core/draft_tree.h): (tokens, parents, probs, carries).");

  m.def(
      "mask_source",
      [](const std::vector<int64_t>& path, const std::vector<int64_t>& mask_input, int64_t k) {
        TORCH_CHECK_VALUE(k >= 1, "k must be >= 1, got ", k);
        core::MaskSource s = core::mask_source(path, mask_input, k);
        return py::make_tuple(s.first, s.shift);
      },
      py::arg("path"), py::arg("mask_input"), py::arg("k"),
      "The masks the next tree reads after a step accepted `path` (csrc/core/draft_tree.h): (first, shift).");

  // The prompt-lookup match (csrc/core/ngram.h; tests compare it with mtprobe.reference.prompt_lookup).
  m.def(
      "prompt_lookup",
      [](const std::vector<int64_t>& seq, int64_t max_ngram_size, int64_t max_tokens) {
        TORCH_CHECK_VALUE(max_ngram_size >= 1 && max_tokens >= 1,
                          "max_ngram_size and max_tokens must be >= 1");
        std::vector<int64_t> out(static_cast<size_t>(max_tokens));
        out.resize(static_cast<size_t>(core::prompt_lookup(seq.data(), static_cast<int64_t>(seq.size()),
                                                           max_ngram_size, max_tokens, out.data())));
        return out;
      },
      py::arg("seq"), py::arg("max_ngram_size"), py::arg("max_tokens"),
      "The prompt-lookup draft for a token history (csrc/core/ngram.h).");

  // The STAND n-gram store as a host object, mirroring csrc/core/ngram_store.h (tests compare it
  // with mtprobe.reference.stand).
  py::class_<core::NgramStore>(m, "NgramStore", "n-gram keys -> accumulated next-token mass (STAND).")
      .def(py::init([](int64_t max_ngram, int64_t top_k) {
             TORCH_CHECK_VALUE(max_ngram >= 1 && top_k >= 1, "max_ngram and top_k must be >= 1, got ",
                               max_ngram, " and ", top_k);
             return core::NgramStore(max_ngram, top_k);
           }),
           py::arg("max_ngram") = 3, py::arg("top_k") = 8)
      .def(
          "add",
          [](core::NgramStore& s, const std::vector<int64_t>& context, const std::vector<int64_t>& tokens,
             const std::vector<float>& probs) {
            TORCH_CHECK_VALUE(tokens.size() == probs.size(),
                              "tokens and probs differ in length: ", tokens.size(), " and ", probs.size());
            s.add(context.data(), static_cast<int64_t>(context.size()), tokens.data(), probs.data(),
                  static_cast<int64_t>(tokens.size()));
          },
          py::arg("context"), py::arg("tokens"), py::arg("probs"))
      .def(
          "add_token",
          [](core::NgramStore& s, const std::vector<int64_t>& context, int64_t next) {
            s.add_token(context.data(), static_cast<int64_t>(context.size()), next);
          },
          py::arg("context"), py::arg("next_token"))
      .def(
          "lookup",
          [](const core::NgramStore& s, const std::vector<int64_t>& context, int64_t cap) {
            std::vector<int64_t> tokens(static_cast<size_t>(std::max<int64_t>(cap, 0)));
            std::vector<double> probs(tokens.size());
            const int64_t n = s.lookup(context.data(), static_cast<int64_t>(context.size()), tokens.data(),
                                       probs.data(), cap);
            tokens.resize(static_cast<size_t>(n));
            probs.resize(static_cast<size_t>(n));
            return py::make_tuple(tokens, probs);
          },
          py::arg("context"), py::arg("cap") = 64)
      .def_property_readonly("num_keys", &core::NgramStore::num_keys);

  m.def(
      "build_stand_tree",
      [](const core::NgramStore& store, const std::vector<int64_t>& context, int64_t budget,
         int64_t max_depth, std::shared_ptr<core::NgramMemory> memory,
         std::optional<std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<double>>> seed)
          -> py::tuple {
        std::vector<int64_t> tokens(static_cast<size_t>(std::max<int64_t>(budget, 0)));
        std::vector<int64_t> parents(tokens.size());
        std::vector<double> scores(tokens.size());
        core::SeedTree grow;
        if (seed) {
          const auto& [st, sp, ss] = *seed;
          TORCH_CHECK_VALUE(st.size() == sp.size() && sp.size() == ss.size(),
                            "seed tokens, parents and scores must have one entry per node, got ", st.size(),
                            ", ", sp.size(), " and ", ss.size());
          for (size_t i = 0; i < sp.size(); ++i)
            TORCH_CHECK_VALUE(i == 0 ? sp[i] == -1 : (sp[i] >= 0 && sp[i] < static_cast<int64_t>(i)),
                              "seed node ", i, " has parent ", sp[i],
                              ": node 0 is the root (parent -1), every "
                              "other node's parent an earlier node");
          for (size_t i = 1; i < sp.size(); ++i) {
            for (size_t j = 1; j < i; ++j)
              TORCH_CHECK_VALUE(sp[j] != sp[i] || st[j] != st[i], "seed nodes ", j, " and ", i,
                                " share parent ", sp[i], " and token ", st[i], ": siblings must differ");
          }
          grow = {st.data(), sp.data(), ss.data(), static_cast<int64_t>(st.size())};
        }
        const int64_t n = core::build_stand_tree(store, context.data(), static_cast<int64_t>(context.size()),
                                                 budget, max_depth, tokens.data(), parents.data(),
                                                 scores.data(), memory.get(), grow);
        tokens.resize(static_cast<size_t>(n));
        parents.resize(static_cast<size_t>(n));
        scores.resize(static_cast<size_t>(n));
        if (seed) return py::make_tuple(tokens, parents, scores);
        return py::make_tuple(tokens, parents);
      },
      py::arg("store"), py::arg("context"), py::arg("budget"), py::arg("max_depth"),
      py::arg("memory") = py::none(), py::arg("seed") = py::none(),
      "The STAND draft tree (csrc/core/ngram_store.h): (tokens, parents), parent -1 = the root; with a "
      "memory, lookups fall back to it where the store has no key of that length. With a seed (tokens, "
      "parents, scores; node 0 the root), the tree grown from it too, returned as (tokens, parents, "
      "scores).");

  // Lookahead's n-gram pool and Jacobi window as host objects, mirroring csrc/core/lookahead.h
  // (tests compare them with mtprobe.reference.lookahead).
  py::class_<core::LookaheadPool>(m, "LookaheadPool", "key token -> at most G continuations (lookahead).")
      .def(py::init<int64_t, int64_t>(), py::arg("ngram_size"), py::arg("guess_set_size"))
      .def(
          "add",
          [](core::LookaheadPool& pool, const std::vector<int64_t>& ngram) {
            TORCH_CHECK_VALUE(static_cast<int64_t>(ngram.size()) == pool.ngram_size(), "an n-gram of ",
                              pool.ngram_size(), " tokens is needed, got ", ngram.size());
            pool.add(ngram.data());
          },
          py::arg("ngram"))
      .def(
          "lookup",
          [](const core::LookaheadPool& pool, int64_t key) {
            const int64_t len = pool.ngram_size() - 1;
            std::vector<int64_t> flat(static_cast<size_t>(pool.guess_set_size() * len));
            const int64_t count = pool.lookup(key, flat.data());
            std::vector<std::vector<int64_t>> out;
            for (int64_t g = 0; g < count; ++g)
              out.emplace_back(flat.begin() + g * len, flat.begin() + (g + 1) * len);
            return out;
          },
          py::arg("key"), "The continuations after key, oldest first.")
      .def_property_readonly("num_keys", &core::LookaheadPool::num_keys);

  m.def(
      "build_guess_tree",
      [](const std::vector<std::vector<int64_t>>& guesses, int64_t max_depth) {
        const int64_t count = static_cast<int64_t>(guesses.size());
        const int64_t len = count > 0 ? static_cast<int64_t>(guesses[0].size()) : 0;
        std::vector<int64_t> flat;
        for (const auto& g : guesses) {
          TORCH_CHECK_VALUE(static_cast<int64_t>(g.size()) == len, "guesses must all have ", len,
                            " tokens, got one of ", g.size());
          flat.insert(flat.end(), g.begin(), g.end());
        }
        std::vector<int64_t> tokens(flat.size()), parents(flat.size());
        const int64_t n =
            core::build_guess_tree(flat.data(), count, len, max_depth, tokens.data(), parents.data());
        tokens.resize(static_cast<size_t>(n));
        parents.resize(static_cast<size_t>(n));
        return py::make_tuple(tokens, parents);
      },
      py::arg("guesses"), py::arg("max_depth"),
      "Lookahead's guesses merged into one tree (csrc/core/lookahead.h): (tokens, parents), -1 = the root.");

  py::class_<core::LookaheadWindow>(m, "LookaheadWindow", "Lookahead's Jacobi window: (L - 1) levels x W.")
      .def(py::init<int64_t, int64_t>(), py::arg("ngram_size"), py::arg("window"))
      .def(
          "reset",
          [](core::LookaheadWindow& w, const std::vector<int64_t>& prompt) {
            w.reset(prompt.data(), static_cast<int64_t>(prompt.size()));
          },
          py::arg("prompt"))
      .def("layout",
           [](const core::LookaheadWindow& w) {
             std::vector<int64_t> tokens(static_cast<size_t>(w.num_cells())), parents(tokens.size());
             w.layout(tokens.data(), parents.data());
             return py::make_tuple(tokens, parents);
           })
      .def(
          "update",
          [](core::LookaheadWindow& w, int64_t root, const std::vector<int64_t>& next,
             core::LookaheadPool& pool) {
            TORCH_CHECK_VALUE(static_cast<int64_t>(next.size()) == w.window(), "next needs ", w.window(),
                              " tokens (one per column), got ", next.size());
            w.update(root, next.data(), pool);
          },
          py::arg("root"), py::arg("next"), py::arg("pool"))
      .def("cell_index", &core::LookaheadWindow::cell_index, py::arg("level"), py::arg("column"))
      .def_property_readonly("updates", &core::LookaheadWindow::updates)
      .def_property_readonly("num_cells", &core::LookaheadWindow::num_cells)
      .def_property_readonly("max_depth", &core::LookaheadWindow::max_depth);

  // The scheduler's cut of one draft tree (csrc/core/schedule.h; tests compare it with
  // mtprobe.reference.schedule).
  m.def(
      "best_cut",
      [](const core::AcceptanceStats& stats, const core::CostTable& cost, int64_t committed,
         const std::vector<int64_t>& parents, int64_t extra, bool cuttable, double context, double overhead) {
        const core::Cut c =
            core::best_cut(stats, cost, committed, parents, extra, cuttable, context, overhead);
        return py::make_tuple(c.kept, c.inputs, c.expected, c.score);
      },
      py::arg("stats"), py::arg("cost"), py::arg("committed"), py::arg("parents"), py::arg("extra"),
      py::arg("cuttable"), py::arg("context"), py::arg("overhead") = 0.0,
      "(kept draft nodes, inputs, expected tokens, score) of the best cut of one draft tree "
      "(csrc/core/schedule.h).");
  m.def(
      "forecast_chain",
      [](const core::AcceptanceStats& stats, const core::CostTable& cost, double draft_seconds,
         int64_t max_drafts, double context, double overhead) {
        const core::ChainForecast f =
            core::forecast_chain(stats, cost, draft_seconds, max_drafts, context, overhead);
        return py::make_tuple(f.drafts, f.rate, f.expected, f.score);
      },
      py::arg("stats"), py::arg("cost"), py::arg("draft_seconds"), py::arg("max_drafts"), py::arg("context"),
      py::arg("overhead") = 0.0,
      "(drafts, rate, expected tokens, score) of the best chain of a drafter with own forwards "
      "(csrc/core/schedule.h).");

  // The decode loop's mask builder (csrc/decode/tree_mask_builder.h; tests compare its masks with
  // mtprobe.reference.tree_mask).
  py::class_<TreeMaskBuilder>(m, "TreeMaskBuilder",
                              "The decode loop's attention mask and position ids of one draft block "
                              "(csrc/decode/tree_mask_builder.h), for inspection and tests.")
      .def(py::init([](int64_t capacity, const std::string& mask_dtype, const std::string& device,
                       bool incremental, bool ancestor_bits) {
             return std::make_unique<TreeMaskBuilder>(capacity, parse_mask_dtype(mask_dtype),
                                                      at::Device(device), incremental, ancestor_bits);
           }),
           py::arg("capacity"), py::arg("mask_dtype") = "float32", py::arg("device") = "cpu",
           py::arg("incremental") = true, py::arg("ancestor_bits") = false)
      .def(
          "build",
          [](TreeMaskBuilder& b, const std::vector<int64_t>& parents, int64_t prefix_len) {
            BlockInputs in = b.build(parents, prefix_len);
            return py::make_tuple(in.position_ids, in.mask ? py::cast(*in.mask) : py::none());
          },
          py::arg("parents"), py::arg("prefix_len"),
          "(position_ids [1, T], mask [1, 1, T, P + T] additive, [1, 1, T, ceil(T / 64)] ancestor bits, "
          "or None for a chain)")
      .def_property_readonly("rebuilds", &TreeMaskBuilder::rebuilds)
      .def_property_readonly("capacity", &TreeMaskBuilder::capacity);
}

}  // namespace mtprobe::bindings
