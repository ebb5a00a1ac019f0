#include "drafters/stand.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace mtprobe {

StandDrafter::StandDrafter(StandOptions options)
    : options_(options),
      store_(std::max<int64_t>(options.max_ngram, 1), std::max<int64_t>(options.table_size, 1)) {
  TORCH_CHECK_VALUE(options_.max_depth >= 1, "max_depth must be >= 1, got ", options_.max_depth);
  TORCH_CHECK_VALUE(options_.max_ngram >= 1, "max_ngram must be >= 1, got ", options_.max_ngram);
  TORCH_CHECK_VALUE(options_.table_size >= 1, "table_size must be >= 1, got ", options_.table_size);
  TORCH_CHECK_VALUE(options_.logits_top_k >= 1, "logits_top_k must be >= 1, got ", options_.logits_top_k);
  TORCH_CHECK_VALUE(!options_.prompt_logits || *options_.prompt_logits >= 0,
                    "prompt_logits must be None (every prompt position) or >= 0, got ",
                    options_.prompt_logits.value_or(0));
}

void StandDrafter::begin(const at::Tensor& prompt) {
  at::Tensor p = prompt.to(at::kCPU, at::kLong).contiguous();
  history_.assign(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
  store_ = core::NgramStore(options_.max_ngram, options_.table_size);  // a fresh store per sequence
  prefill_ = true;
}

DraftBlock StandDrafter::propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) {
  (void)prefix_len;
  const int64_t c = committed.size(0);
  // Drafts past the tokens still wanted, the budget or the context are wasted work.
  const int64_t depth = std::min({options_.max_depth, limits.tokens_left - 1, limits.max_depth});
  const int64_t budget = c == 1 ? limits.budget - 1 : options_.max_depth;
  int64_t n = 0;
  std::vector<int64_t> tokens(static_cast<size_t>(std::max<int64_t>(budget, 0)));
  std::vector<int64_t> parents(tokens.size());
  if (depth >= 1 && budget >= 1) {
    n = core::build_stand_tree(store_, history_.data(), static_cast<int64_t>(history_.size()), budget, depth,
                               tokens.data(), parents.data(), nullptr, options_.memory.get());
  }
  tokens.resize(static_cast<size_t>(n));
  parents.resize(static_cast<size_t>(n));
  return token_block(committed, tokens, parents);  // the store's parent -1 is the root
}

std::vector<core::DraftNode> StandDrafter::tree_nodes(int64_t root_token, int64_t budget, int64_t depth,
                                                      const std::vector<core::DraftNode>* seed) const {
  std::vector<core::DraftNode> nodes{{root_token, -1, 0, 1.0}};
  if (budget < 1 || depth < 1) return nodes;
  std::vector<int64_t> tokens(static_cast<size_t>(budget)), parents(tokens.size());
  std::vector<double> scores(tokens.size());
  std::vector<int64_t> seed_tokens, seed_parents;
  std::vector<double> seed_scores;
  core::SeedTree grow;
  if (seed != nullptr && !seed->empty()) {
    for (const auto& n : *seed) {
      seed_tokens.push_back(n.token);
      seed_parents.push_back(n.parent);
      seed_scores.push_back(n.prob);
    }
    grow = {seed_tokens.data(), seed_parents.data(), seed_scores.data(), static_cast<int64_t>(seed->size())};
  }
  const int64_t n =
      core::build_stand_tree(store_, history_.data(), static_cast<int64_t>(history_.size()), budget, depth,
                             tokens.data(), parents.data(), scores.data(), options_.memory.get(), grow);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t parent = parents[j] + 1;  // the store's -1 is the root, node 0 here
    nodes.push_back({tokens[j], parent, nodes[static_cast<size_t>(parent)].depth + 1, scores[j]});
  }
  return nodes;
}

namespace {
// Top-k ids and probabilities ([n, k] each) on the host in one read: the ids ride as float64 (exact
// below 2^53) beside the probabilities.
std::pair<std::vector<int64_t>, std::vector<float>> read_top(const at::Tensor& probs, const at::Tensor& ids) {
  at::Tensor both = read_as_double({ids, probs});
  const int64_t n = ids.numel();
  const double* d = both.data_ptr<double>();  // [n ids | n probs]
  std::vector<int64_t> ic(static_cast<size_t>(n));
  std::vector<float> pc(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    ic[i] = static_cast<int64_t>(d[i]);
    pc[i] = static_cast<float>(d[n + i]);
  }
  return {std::move(ic), std::move(pc)};
}
}  // namespace

void StandDrafter::observe(const StepOutcome& outcome) {
  // A step verified outside the loop (a serving engine's: mtprobe.vllm) comes without logits: the store
  // then learns the committed text alone, every new token one-hot, as it learns the prompt's.
  const bool text_only = !outcome.logits.defined();
  const int64_t k = text_only ? 0 : std::min<int64_t>(options_.logits_top_k, outcome.logits.size(-1));
  size_t appended = 0;  // new tokens already in history_
  if (prefill_) {
    // Every prompt position's next token; the logits at input i are the distribution after
    // history_[0 : i + 1], read from the first of the last `prompt_logits` positions on.
    const int64_t L = static_cast<int64_t>(history_.size());
    for (int64_t i = 1; i < L; ++i) store_.add_token(history_.data(), i, history_[i]);
    const int64_t first = options_.prompt_logits ? std::max<int64_t>(0, L - *options_.prompt_logits) : 0;
    if (!text_only && first < L) {
      auto [probs, ids] = outcome.logits.narrow(0, first, L - first)
                              .to(at::kFloat)
                              .softmax(-1)
                              .topk(k, -1);  // [L - first, k]
      auto [ic, pc] = read_top(probs, ids);
      for (int64_t i = first; i < L; ++i)
        store_.add(history_.data(), i + 1, ic.data() + (i - first) * k, pc.data() + (i - first) * k, k);
    }
    prefill_ = false;
  } else if (!text_only) {
    // The accepted path: input path[j] is followed by new_tokens[j]; its logits are the
    // distribution after history_ + new_tokens[0 : j].
    const int64_t m = std::min<int64_t>(static_cast<int64_t>(outcome.path.size()),
                                        static_cast<int64_t>(outcome.new_tokens.size()));
    at::Tensor rows =
        at::tensor(std::vector<int64_t>(outcome.path.begin(), outcome.path.begin() + m), at::kLong)
            .to(outcome.logits.device());
    auto [probs, ids] =
        outcome.logits.index_select(0, rows).to(at::kFloat).softmax(-1).topk(k, -1);  // [m, k]
    auto [ic, pc] = read_top(probs, ids);
    // history_ grows token by token, so each add() sees exactly the context of its row.
    for (int64_t j = 0; j < m; ++j) {
      store_.add(history_.data(), static_cast<int64_t>(history_.size()), ic.data() + j * k, pc.data() + j * k,
                 k);
      history_.push_back(outcome.new_tokens[j]);
    }
    appended = static_cast<size_t>(m);
  }
  for (size_t j = appended; j < outcome.new_tokens.size(); ++j) {
    if (text_only)
      store_.add_token(history_.data(), static_cast<int64_t>(history_.size()), outcome.new_tokens[j]);
    history_.push_back(outcome.new_tokens[j]);
  }
  // The generation is over: history_ is its committed text (new_tokens stop at EOS or the limit).
  if (outcome.finished && options_.memory && options_.fold_memory) {
    options_.memory->fold(history_.data(), static_cast<int64_t>(history_.size()));
  }
}

}  // namespace mtprobe
