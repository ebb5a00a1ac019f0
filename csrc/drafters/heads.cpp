#include "drafters/heads.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <stdexcept>

#include "runtime/sampling_generator.h"

namespace mtprobe {

namespace {

// The options' circuit over `vocab` emission columns.
core::CircuitStructure make_structure(const HeadsOptions& o, int64_t vocab) {
  if (o.circuit == "ff") {
    TORCH_CHECK_VALUE(o.rank == 1, "an FF circuit has no latent states: rank must be 1, got ", o.rank);
    return core::CircuitStructure::ff(o.window, vocab);
  }
  if (o.circuit == "cp") return core::CircuitStructure::cp(o.window, o.rank, vocab);
  if (o.circuit == "hmm") return core::CircuitStructure::hmm(o.window, o.rank, vocab);
  if (o.circuit == "btree") return core::CircuitStructure::btree(o.window, o.rank, vocab);
  TORCH_CHECK_VALUE(false, "unknown circuit '", o.circuit, "': expected 'ff', 'cp', 'hmm' or 'btree'");
}

const float* data_or_null(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

// The column of `token` among ascending `columns` (empty: the whole vocabulary), -1 when absent.
int64_t column_in(const std::vector<int64_t>& columns, int64_t token) {
  if (columns.empty()) return token;
  const auto it = std::lower_bound(columns.begin(), columns.end(), token);
  return it != columns.end() && *it == token ? static_cast<int64_t>(it - columns.begin()) : -1;
}

// The shortlist width of a bank: its deepest rank + 1, but never below this.
constexpr int64_t kMinBankWidth = 16;

}  // namespace

HeadsDrafter::HeadsDrafter(HeadFn head, HeadsOptions options) : head_(std::move(head)), options_(options) {
  TORCH_CHECK_VALUE(head_, "HeadsDrafter needs the head callback");
  TORCH_CHECK_VALUE(options_.window >= 2, "window must be >= 2 (the root and at least one draft), got ",
                    options_.window);
  TORCH_CHECK_VALUE(options_.rank >= 1, "rank (latent states) must be >= 1, got ", options_.rank);
  TORCH_CHECK_VALUE(options_.vocab >= 1, "vocab must be >= 1, got ", options_.vocab);
  TORCH_CHECK_VALUE(options_.top_branches >= 1, "top_branches must be >= 1, got ", options_.top_branches);
  TORCH_CHECK_VALUE(options_.min_path_prob >= 0.0 && options_.min_path_prob < 1.0,
                    "min_path_prob must be in [0, 1), got ", options_.min_path_prob);
  structure_ = make_structure(options_, options_.vocab);
  if (!options_.bank.empty()) {
    for (size_t i = 0; i < options_.bank.size(); ++i) {
      const core::Topology& t = options_.bank[i];
      TORCH_CHECK_VALUE(t.max_depth <= options_.window - 1, "bank topology ", i, " reaches depth ",
                        t.max_depth, " but a window of ", options_.window, " tokens drafts depths 1..",
                        options_.window - 1, " only");
      bank_width_ = std::max(bank_width_, t.max_rank + 1);
    }
    // At least kMinBankWidth, so that ranks recorded with one bank mean the same with another.
    bank_width_ = std::min(std::max(bank_width_, kMinBankWidth), options_.vocab);
    try {
      core::check_bank_policy(static_cast<int64_t>(options_.bank.size()), options_.policy, options_.feature,
                              options_.ema);
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK_VALUE(false, e.what());
    }
  } else {
    TORCH_CHECK_VALUE(!options_.record, "record needs a topology bank (the records are its trees' ranks)");
  }
}

void HeadsDrafter::begin(const at::Tensor& prompt) {
  (void)prompt;
  params_.clear();
  columns_.clear();
  columns_tensor_ = at::Tensor();
  bonus_ = -1;
  root_ = -1;
  head_calls_ = 0;
  shortlist_.clear();
  current_tree_ = uses_bank() ? options_.policy.initial() : 0;
  features_ = core::TopologyFeatures{};
  tree_choices_.clear();
  records_.clear();
  pending_.clear();
}

core::Circuit<float> HeadsDrafter::circuit(const std::vector<at::Tensor>& p, int64_t columns) const {
  auto make = [&](const core::CircuitStructure& s) {
    return core::Circuit<float>(s, data_or_null(p[0]), p[0].numel(), data_or_null(p[1]), p[1].numel(),
                                data_or_null(p[2]), p[2].numel());
  };
  // A restricted head returns the same column count step after step: its structure is made once, in
  // observe, not per call; a pending record's older count is the rare miss.
  if (columns == options_.vocab) return make(structure_);
  if (columns == columns_structure_.vocab) return make(columns_structure_);
  return make(make_structure(options_, columns));
}

int64_t HeadsDrafter::num_columns() const {
  return columns_.empty() ? options_.vocab : static_cast<int64_t>(columns_.size());
}

std::vector<std::vector<int64_t>> HeadsDrafter::make_shortlist(int64_t width) const {
  // Exact for FF (one state); for a mixture a token outside every state's shortlist can in principle
  // outrank one inside, so a tree may miss it (never a wrong draft: every candidate's conditional is
  // exact, and the target verifies everything).
  const int64_t V = num_columns(), n = options_.window;
  at::Tensor e = params_[2];  // FF [n, V]; CP [r, n, V]; HMM, BTree [n, r, V] (V: the emission columns)
  e = options_.circuit == "ff" ? e.unsqueeze(1) : options_.circuit == "cp" ? e.transpose(0, 1) : e;
  at::Tensor top = std::get<1>(e.topk(std::min(width, V), -1)).reshape({n, -1});  // [n, r * width] token ids
  std::vector<std::vector<int64_t>> shortlist(static_cast<size_t>(n));
  for (int64_t i = 1; i < n; ++i) {
    at::Tensor ids = std::get<0>(at::_unique(top[i].contiguous(), /*sorted=*/true));
    shortlist[i].assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  }
  return shortlist;
}

void HeadsDrafter::ranked_children(const core::Circuit<float>& circuit, const std::vector<int64_t>& prefix,
                                   const std::vector<int64_t>& cand, int64_t want,
                                   std::vector<int64_t>& tokens, std::vector<float>& log_probs) {
  const auto m = static_cast<int64_t>(cand.size());
  want = std::min(want, m);
  tokens.clear();
  log_probs.clear();
  if (want <= 0) return;
  std::vector<float> next(static_cast<size_t>(m));  // log q(v | prefix) of the candidates
  circuit.candidate_log_probs(prefix.data(), static_cast<int64_t>(prefix.size()), cand.data(), m,
                              next.data());
  std::vector<int64_t> order(static_cast<size_t>(m));
  std::iota(order.begin(), order.end(), 0);
  auto better = [&](int64_t a, int64_t b) { return next[a] > next[b] || (next[a] == next[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + want, order.end(), better);
  for (int64_t j = 0; j < want; ++j) {
    const float lp = next[order[j]];
    if (!std::isfinite(lp)) break;  // probability 0 (or a prefix of probability 0)
    tokens.push_back(cand[order[j]]);
    log_probs.push_back(lp);
  }
}

void HeadsDrafter::greedy_tree(const core::Circuit<float>& circuit, int64_t max_nodes, int64_t depth,
                               std::vector<int64_t>& tokens, std::vector<int64_t>& parents) const {
  // The shortlist of window position i: the union over latent states z of the max_nodes most likely
  // tokens of q(x_i | z), so an expansion costs O(r * shortlist), not O(r V).
  const std::vector<std::vector<int64_t>> shortlist = make_shortlist(max_nodes);
  struct Candidate {
    double score;    // log q(path | root): the conditional probability of the whole path
    int64_t parent;  // draft index, -1 for the root
    int64_t token;
    bool operator<(const Candidate& o) const { return score < o.score; }  // max-heap on score
  };
  std::priority_queue<Candidate> frontier;
  std::vector<std::vector<int64_t>> prefixes;  // [window position 0 (the root), drafts...] per draft
  std::vector<int64_t> kids;
  std::vector<float> log_probs;
  // Push the best children of a prefix: never more than the nodes still to place.
  auto expand = [&](const std::vector<int64_t>& prefix, int64_t parent, double score) {
    ranked_children(circuit, prefix, shortlist[prefix.size()],
                    max_nodes - static_cast<int64_t>(tokens.size()), kids, log_probs);
    for (size_t j = 0; j < kids.size(); ++j) frontier.push({score + log_probs[j], parent, kids[j]});
  };
  expand({root_}, -1, 0.0);
  // log 0 = -inf keeps every candidate; the frontier pops best first, so the first one below the
  // floor ends the tree (a child's path is never more probable than its parent's).
  const double floor = std::log(options_.min_path_prob);
  while (!frontier.empty() && static_cast<int64_t>(tokens.size()) < max_nodes) {
    const Candidate c = frontier.top();
    frontier.pop();
    if (c.score < floor) break;
    std::vector<int64_t> prefix = c.parent < 0 ? std::vector<int64_t>{root_} : prefixes[c.parent];
    prefix.push_back(c.token);
    tokens.push_back(c.token);
    parents.push_back(c.parent);
    prefixes.push_back(prefix);
    // prefix holds the root and the node's depth d drafts: children exist while d < depth.
    if (static_cast<int64_t>(prefix.size()) - 1 < depth) {
      expand(prefix, static_cast<int64_t>(tokens.size()) - 1, c.score);
    }
  }
}

std::vector<int64_t> HeadsDrafter::fill_bank_tree(const core::Topology& t) const {
  const core::Circuit<float> c = circuit(params_, num_columns());
  const int64_t N = t.num_nodes();
  std::vector<int64_t> tokens(static_cast<size_t>(N));              // columns
  std::vector<std::vector<int64_t>> paths(static_cast<size_t>(N));  // [root, drafts down to the node]
  tokens[0] = root_;
  paths[0] = {root_};
  std::vector<int64_t> kids;
  std::vector<float> log_probs;
  // Nodes come by depth, so a parent's path is known before its children's.
  for (int64_t node = 0; node < N; ++node) {
    const std::vector<int64_t>& children = t.children[node];  // ascending rank
    if (children.empty()) continue;
    ranked_children(c, paths[node], shortlist_[paths[node].size()], t.ranks[children.back()] + 1, kids,
                    log_probs);
    for (int64_t child : children) {
      const int64_t r = t.ranks[child];
      if (r >= static_cast<int64_t>(kids.size())) return {};  // fewer candidates than the shape needs
      tokens[child] = kids[r];
      paths[child] = paths[node];
      paths[child].push_back(kids[r]);
    }
  }
  return tokens;
}

DraftBlock HeadsDrafter::propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) {
  const int64_t c = committed.size(0);
  // Drafts need the head's window for this root: none at prefill (no hidden state yet).
  const int64_t depth = std::min({options_.window - 1, limits.max_depth, limits.tokens_left - 1});
  const int64_t max_nodes = limits.budget - 1;
  const bool drafts = !params_.empty() && root_ >= 0 && c == 1 && depth >= 1 && max_nodes >= 1;
  std::vector<int64_t> tokens, parents;
  if (uses_bank()) {
    // The policy's tree, filled with this step's ranked children: the same shape every time it runs.
    const core::Topology& t = options_.bank[static_cast<size_t>(current_tree_)];
    const std::vector<int64_t> filled = drafts ? fill_bank_tree(t) : std::vector<int64_t>{};
    // The loop's limits (the budget, the sequence's end) cut it: nodes come by depth, so the first
    // ones form a tree.
    for (int64_t i = 1; i < static_cast<int64_t>(filled.size()) && t.depths[i] <= depth &&
                        static_cast<int64_t>(tokens.size()) < max_nodes;
         ++i) {
      tokens.push_back(token_of(filled[i]));
      parents.push_back(t.parents[i] - 1);  // node 0 is the root: draft index parent - 1
    }
    if (prefix_len > 0) tree_choices_.push_back(filled.empty() ? -1 : current_tree_);
    return token_block(committed, tokens, parents);
  }
  if (!drafts) return token_block(committed, {}, {});
  const core::Circuit<float> circuit = this->circuit(params_, num_columns());
  auto to_tokens = [&](std::vector<int64_t>& columns) {
    for (int64_t& x : columns) x = token_of(x);
  };
  if (!options_.do_sample) {
    greedy_tree(circuit, max_nodes, depth, tokens, parents);
    to_tokens(tokens);
    return token_block(committed, tokens, parents);
  }
  // Sampling: m chains of `depth` tokens, each token drawn from q(. | root, the chain so far); the
  // draws are columns, mapped to token ids at the end.
  const int64_t N = num_columns();
  const int64_t m = std::max<int64_t>(1, std::min(options_.top_branches, max_nodes / depth));
  const int64_t d = std::min(depth, max_nodes);                 // one chain always fits
  auto conditional = [&](const std::vector<int64_t>& prefix) {  // [N] q(. | prefix), float32
    at::Tensor logq = at::empty({N}, at::kFloat);
    circuit.next_token_log_probs(prefix.data(), static_cast<int64_t>(prefix.size()), logq.data_ptr<float>());
    return logq.exp_();
  };
  at::Tensor q_root = conditional({root_});  // [N]
  // A root the circuit gives probability 0 (an emission underflowed) leaves its conditionals undefined:
  // no drafts this step, rather than an error.
  if (!(q_root.sum().item<float>() > 0.5f)) return token_block(committed, {}, {});
  const std::optional<at::Generator> gen = sampling_generator(q_root.device());
  at::Tensor firsts = at::multinomial(q_root, m, /*replacement=*/true, gen);  // [m]
  std::vector<at::Tensor> rows;  // [N] the q each draft was drawn from
  for (int64_t chain = 0; chain < m; ++chain) {
    std::vector<int64_t> prefix{root_, firsts[chain].item<int64_t>()};
    tokens.push_back(prefix.back());
    parents.push_back(-1);
    rows.push_back(q_root);
    for (int64_t k = 1; k < d; ++k) {
      at::Tensor q = conditional(prefix);
      if (!(q.sum().item<float>() > 0.5f)) break;  // the chain reached probability 0: stop it
      prefix.push_back(at::multinomial(q, 1, /*replacement=*/true, gen).item<int64_t>());
      tokens.push_back(prefix.back());
      parents.push_back(static_cast<int64_t>(tokens.size()) - 2);
      rows.push_back(q);
    }
  }
  to_tokens(tokens);
  at::Tensor probs = at::stack(rows);  // [drafts, N]
  if (!columns_.empty()) {             // back to [drafts, V], probability 0 outside the columns
    probs = at::zeros({probs.size(0), options_.vocab}, at::kFloat).index_copy_(1, columns_tensor_, probs);
  }
  DraftBlock b = token_block(committed, tokens, parents);
  b.draft_probs = probs.to(committed.device());  // [drafts, V]
  return b;
}

void HeadsDrafter::observe(const StepOutcome& outcome) {
  params_.clear();
  if (options_.record) advance_records(outcome);
  if (outcome.finished || outcome.new_tokens.empty()) return;
  TORCH_CHECK(outcome.hidden.has_value(),
              "HeadsDrafter needs the target's hidden states (the loop passes them "
              "when wants_hidden_states() is true)");
  const at::Tensor& hidden = *outcome.hidden;  // [T, hidden]
  const std::vector<int64_t>& path = outcome.path;
  const int64_t node = path.back();             // the last accepted node: h_t predicts x_{t+1} ..
  at::Tensor rows = hidden.narrow(0, node, 1);  // [1, hidden]
  if (options_.committed_rows) {
    // The committed rows: the block's committed chain (rows 0 .. path[0]), then the accepted drafts.
    std::vector<int64_t> index(static_cast<size_t>(path.front() + 1));
    std::iota(index.begin(), index.end(), 0);
    index.insert(index.end(), path.begin() + 1, path.end());
    rows =
        hidden.index_select(0, at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(hidden.device()));
  }
  std::vector<at::Tensor> out = head_(rows, outcome.logits[node], outcome.prefix_len);
  ++head_calls_;
  TORCH_CHECK_VALUE(out.size() == 3 || out.size() == 4,
                    "the head must return [weights, transitions, emissions] or [weights, transitions, "
                    "emissions, columns], got ",
                    out.size(), " tensors");
  columns_.clear();
  columns_tensor_ = at::Tensor();
  if (out.size() == 4) {
    columns_tensor_ = out[3].detach().to(at::kCPU, at::kLong).contiguous();  // [N]
    out.pop_back();
    TORCH_CHECK_VALUE(columns_tensor_.dim() == 1 && columns_tensor_.numel() >= 1,
                      "the head's columns must be a non-empty 1-D tensor of token ids, got shape ",
                      columns_tensor_.sizes());
    const int64_t* ids = columns_tensor_.data_ptr<int64_t>();
    columns_.assign(ids, ids + columns_tensor_.numel());
    if (columns_structure_.vocab != columns_tensor_.numel())
      columns_structure_ = make_structure(options_, columns_tensor_.numel());
    for (size_t i = 0; i < columns_.size(); ++i) {
      TORCH_CHECK_VALUE(
          columns_[i] >= 0 && columns_[i] < options_.vocab && (i == 0 || columns_[i - 1] < columns_[i]),
          "the head's columns must be ascending distinct token ids in [0, ", options_.vocab, "), got ",
          columns_[i], " at ", i, i ? " after " : "", i ? std::to_string(columns_[i - 1]) : "");
    }
  }
  for (at::Tensor& t : out) t = t.detach().to(at::kCPU, at::kFloat).contiguous();
  // The circuit checks every size against its structure (std::invalid_argument -> ValueError) before
  // the parameters are kept. It points into the tensors' storage, which the move below keeps.
  const core::Circuit<float> c = circuit(out, num_columns());
  params_ = std::move(out);
  bonus_ = outcome.new_tokens.back();
  root_ = column_in(columns_, bonus_);
  if (uses_bank()) bank_observe(outcome, c);
}

void HeadsDrafter::bank_observe(const StepOutcome& outcome, const core::Circuit<float>& c) {
  shortlist_ = make_shortlist(bank_width_);
  // The target's distribution at the accepted node, the one the root came from: its top-1
  // probability and entropy.
  at::Tensor p = outcome.logits[outcome.path.back()].to(at::kFloat).softmax(-1);  // [V]
  at::Tensor stats = at::stack({p.max(), at::special_entr(p).sum()}).to(at::kDouble).cpu();
  const double top1 = stats[0].item<double>(), entropy = stats[1].item<double>();
  // EAGLE-2's path value down the head's greedy chain: p_target(top-1) * prod_d q(best | chain so far).
  double path_value = root_ < 0 ? 0.0 : top1;  // a root the head cannot emit: no drafts
  std::vector<int64_t> chain{root_}, kids;
  std::vector<float> log_probs;
  for (int64_t d = 1; d < options_.window && root_ >= 0; ++d) {
    ranked_children(c, chain, shortlist_[d], 1, kids, log_probs);
    if (kids.empty()) {
      path_value = 0.0;
      break;
    }
    path_value *= std::exp(static_cast<double>(log_probs[0]));
    chain.push_back(kids[0]);
  }
  const double accepted = static_cast<double>(outcome.path.size()) - 1.0;
  features_.update(top1, path_value, entropy, accepted, options_.ema);
  current_tree_ = options_.policy.choose(features_.score(options_.feature), current_tree_);
  if (options_.record) {
    // The next root sits right after the accepted path: prefix + committed chain + accepted drafts.
    const int64_t position =
        outcome.prefix_len + outcome.path.front() + static_cast<int64_t>(outcome.path.size());
    pending_.push_back(
        {StepRecord{position, {}, features_, current_tree_}, params_, columns_, shortlist_, root_, {}});
  }
}

std::vector<int64_t> HeadsDrafter::true_ranks(const Pending& p) const {
  const int64_t D = options_.window - 1;
  std::vector<int64_t> ranks(static_cast<size_t>(D), -1);
  if (p.root < 0) return ranks;  // the head could not emit the root: it drafted nothing
  const core::Circuit<float> c =
      circuit(p.params, p.columns.empty() ? options_.vocab : static_cast<int64_t>(p.columns.size()));
  std::vector<int64_t> prefix{p.root};
  std::vector<float> next;
  for (int64_t d = 1; d <= D && d <= static_cast<int64_t>(p.continuation.size()); ++d) {
    const std::vector<int64_t>& cand = p.shortlist[d];  // ascending columns
    const int64_t want = column_in(p.columns, p.continuation[d - 1]);
    if (want < 0) break;  // a token the head cannot emit
    const auto it = std::lower_bound(cand.begin(), cand.end(), want);
    if (it == cand.end() || *it != want) break;  // not a candidate: no tree reaches it or below
    const auto idx = static_cast<int64_t>(it - cand.begin());
    next.resize(cand.size());
    c.candidate_log_probs(prefix.data(), static_cast<int64_t>(prefix.size()), cand.data(),
                          static_cast<int64_t>(cand.size()), next.data());
    if (!std::isfinite(next[idx])) break;
    // Its rank in ranked_children's order: more probable candidates, then equal ones of lower index.
    int64_t rank = 0;
    for (int64_t j = 0; j < static_cast<int64_t>(cand.size()); ++j)
      rank += next[j] > next[idx] || (next[j] == next[idx] && j < idx);
    ranks[d - 1] = rank;
    prefix.push_back(want);
  }
  return ranks;
}

void HeadsDrafter::advance_records(const StepOutcome& outcome) {
  const auto D = static_cast<size_t>(options_.window - 1);
  std::vector<Pending> still;
  for (Pending& p : pending_) {
    p.continuation.insert(p.continuation.end(), outcome.new_tokens.begin(), outcome.new_tokens.end());
    if (p.continuation.size() >= D || outcome.finished) {
      p.record.ranks = true_ranks(p);
      records_.push_back(std::move(p.record));
    } else {
      still.push_back(std::move(p));
    }
  }
  pending_ = std::move(still);
}

std::vector<HeadsDrafter::StepRecord> HeadsDrafter::step_log() const {
  std::vector<StepRecord> out = records_;
  for (const Pending& p : pending_) {
    out.push_back(p.record);
    out.back().ranks = true_ranks(p);
  }
  return out;
}

}  // namespace mtprobe
