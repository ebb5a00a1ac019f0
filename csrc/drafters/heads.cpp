#include "drafters/heads.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <stdexcept>

namespace mtprobe {

namespace {

core::CircuitStructure make_structure(const HeadsOptions& o) {
  if (o.circuit == "ff") {
    TORCH_CHECK_VALUE(o.rank == 1, "an FF circuit has no latent states: rank must be 1, got ", o.rank);
    return core::CircuitStructure::ff(o.window, o.vocab);
  }
  if (o.circuit == "cp") return core::CircuitStructure::cp(o.window, o.rank, o.vocab);
  if (o.circuit == "hmm") return core::CircuitStructure::hmm(o.window, o.rank, o.vocab);
  if (o.circuit == "btree") return core::CircuitStructure::btree(o.window, o.rank, o.vocab);
  TORCH_CHECK_VALUE(false, "unknown circuit '", o.circuit, "': expected 'ff', 'cp', 'hmm' or 'btree'");
}

const float* data_or_null(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

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
  structure_ = make_structure(options_);
}

void HeadsDrafter::begin(const at::Tensor& prompt) {
  (void)prompt;
  params_.clear();
  bonus_ = -1;
  head_calls_ = 0;
}

void HeadsDrafter::greedy_tree(const core::Circuit<float>& circuit, int64_t max_nodes, int64_t depth,
                               std::vector<int64_t>& tokens, std::vector<int64_t>& parents) const {
  const int64_t V = options_.vocab, n = options_.window;
  // The shortlist of window position i: the union over latent states z of the max_nodes most likely
  // tokens of q(x_i | z). Exact for FF (one state); for a mixture a token outside every state's
  // shortlist can in principle outrank one inside, so the tree may miss it (never a wrong draft:
  // every candidate's conditional is exact, and the target verifies everything).
  at::Tensor e = params_[2];  // FF [n, V]; CP [r, n, V]; HMM, BTree [n, r, V]
  e = options_.circuit == "ff" ? e.unsqueeze(1) : options_.circuit == "cp" ? e.transpose(0, 1) : e;
  const int64_t k = std::min(max_nodes, V);
  at::Tensor top = std::get<1>(e.topk(k, -1)).reshape({n, -1});  // [n, r k] token ids
  std::vector<std::vector<int64_t>> shortlist(static_cast<size_t>(n));
  for (int64_t i = 1; i < n; ++i) {
    at::Tensor ids = std::get<0>(at::_unique(top[i].contiguous(), /*sorted=*/true));
    shortlist[i].assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  }
  struct Candidate {
    double score;    // log q(path | root): the conditional probability of the whole path
    int64_t parent;  // draft index, -1 for the root
    int64_t token;
    bool operator<(const Candidate& o) const { return score < o.score; }  // max-heap on score
  };
  std::priority_queue<Candidate> frontier;
  std::vector<std::vector<int64_t>> prefixes;  // [window position 0 (the root), drafts...] per draft
  std::vector<float> next;                     // log q(v | prefix) of the shortlist
  std::vector<int64_t> order;
  // Push the best children of a prefix: never more than the nodes still to place.
  auto expand = [&](const std::vector<int64_t>& prefix, int64_t parent, double score) {
    const std::vector<int64_t>& cand = shortlist[prefix.size()];
    const int64_t m = static_cast<int64_t>(cand.size());
    const int64_t want = std::min<int64_t>(max_nodes - static_cast<int64_t>(tokens.size()), m);
    if (want <= 0) return;
    next.resize(static_cast<size_t>(m));
    circuit.candidate_log_probs(prefix.data(), static_cast<int64_t>(prefix.size()), cand.data(), m,
                                next.data());
    order.resize(static_cast<size_t>(m));
    std::iota(order.begin(), order.end(), 0);
    auto better = [&](int64_t a, int64_t b) { return next[a] > next[b] || (next[a] == next[b] && a < b); };
    std::partial_sort(order.begin(), order.begin() + want, order.end(), better);
    for (int64_t j = 0; j < want; ++j) {
      const float lp = next[order[j]];
      if (!std::isfinite(lp)) break;  // probability 0 (or a prefix of probability 0)
      frontier.push({score + lp, parent, cand[order[j]]});
    }
  };
  expand({bonus_}, -1, 0.0);
  // log 0 = -inf keeps every candidate; the frontier pops best first, so the first one below the
  // floor ends the tree (a child's path is never more probable than its parent's).
  const double floor = std::log(options_.min_path_prob);
  while (!frontier.empty() && static_cast<int64_t>(tokens.size()) < max_nodes) {
    const Candidate c = frontier.top();
    frontier.pop();
    if (c.score < floor) break;
    std::vector<int64_t> prefix = c.parent < 0 ? std::vector<int64_t>{bonus_} : prefixes[c.parent];
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

DraftBlock HeadsDrafter::propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) {
  (void)prefix_len;
  const int64_t c = committed.size(0);
  // Drafts need the head's window for this root: none at prefill (no hidden state yet).
  const int64_t depth = std::min({options_.window - 1, limits.max_depth, limits.tokens_left - 1});
  const int64_t max_nodes = limits.budget - 1;
  if (params_.empty() || c != 1 || depth < 1 || max_nodes < 1) return token_block(committed, {}, {});
  const core::Circuit<float> circuit(structure_, data_or_null(params_[0]), params_[0].numel(),
                                     data_or_null(params_[1]), params_[1].numel(),
                                     params_[2].data_ptr<float>(), params_[2].numel());
  std::vector<int64_t> tokens, parents;
  if (!options_.do_sample) {
    greedy_tree(circuit, max_nodes, depth, tokens, parents);
    return token_block(committed, tokens, parents);
  }
  // Sampling: m chains of `depth` tokens, each token drawn from q(. | root, the chain so far).
  const int64_t V = options_.vocab;
  const int64_t m = std::max<int64_t>(1, std::min(options_.top_branches, max_nodes / depth));
  const int64_t d = std::min(depth, max_nodes);                 // one chain always fits
  auto conditional = [&](const std::vector<int64_t>& prefix) {  // [V] q(. | prefix), float32
    at::Tensor logq = at::empty({V}, at::kFloat);
    circuit.next_token_log_probs(prefix.data(), static_cast<int64_t>(prefix.size()), logq.data_ptr<float>());
    return logq.exp_();
  };
  at::Tensor q_root = conditional({bonus_});  // [V]
  // A root the circuit gives probability 0 (an emission underflowed) leaves its conditionals undefined:
  // no drafts this step, rather than an error.
  if (!(q_root.sum().item<float>() > 0.5f)) return token_block(committed, {}, {});
  at::Tensor firsts = at::multinomial(q_root, m, /*replacement=*/true);  // [m]
  std::vector<at::Tensor> rows;  // [V] the q each draft was drawn from
  for (int64_t chain = 0; chain < m; ++chain) {
    std::vector<int64_t> prefix{bonus_, firsts[chain].item<int64_t>()};
    tokens.push_back(prefix.back());
    parents.push_back(-1);
    rows.push_back(q_root);
    for (int64_t k = 1; k < d; ++k) {
      at::Tensor q = conditional(prefix);
      if (!(q.sum().item<float>() > 0.5f)) break;  // the chain reached probability 0: stop it
      prefix.push_back(at::multinomial(q, 1, /*replacement=*/true).item<int64_t>());
      tokens.push_back(prefix.back());
      parents.push_back(static_cast<int64_t>(tokens.size()) - 2);
      rows.push_back(q);
    }
  }
  DraftBlock b = token_block(committed, tokens, parents);
  b.draft_probs = at::stack(rows).to(committed.device());  // [drafts, V]
  return b;
}

void HeadsDrafter::observe(const StepOutcome& outcome) {
  params_.clear();
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
  TORCH_CHECK_VALUE(out.size() == 3, "the head must return [weights, transitions, emissions], got ",
                    out.size(), " tensors");
  for (at::Tensor& t : out) t = t.detach().to(at::kCPU, at::kFloat).contiguous();
  // The circuit checks every size against its structure (std::invalid_argument -> ValueError).
  core::Circuit<float>(structure_, data_or_null(out[0]), out[0].numel(), data_or_null(out[1]), out[1].numel(),
                       data_or_null(out[2]), out[2].numel());
  params_ = std::move(out);
  bonus_ = outcome.new_tokens.back();
}

}  // namespace mtprobe
