#include "decode/decode_loop.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "core/tree.h"
#include "core/verify.h"
#include "ops/dispatch.h"
#include "ops/ops.h"
#include "runtime/sampling_generator.h"

namespace mtprobe {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
at::Tensor long_tensor(const std::vector<int64_t>& v) { return at::tensor(v, at::kLong); }
// NaN or +inf: a score no choice can be made from. (-inf is a legitimate score: processors use it to
// ban tokens.)
bool unusable(double x) { return std::isnan(x) || x == std::numeric_limits<double>::infinity(); }

// Adds the block's draft nodes to counts[depth - 1], depth counted from the last committed node
// (input c - 1). check_block has made sure every parent precedes its child.
void count_drafts(const DraftBlock& block, std::vector<int64_t>& counts) {
  const int64_t c = block.num_committed;
  std::vector<int64_t> depth(static_cast<size_t>(block.num_nodes), 0);  // [num_nodes]
  for (int64_t i = c; i < block.num_nodes; ++i) {
    const int64_t d = depth[block.parents[i]] + 1;  // committed inputs sit at depth 0
    depth[i] = d;
    if (static_cast<int64_t>(counts.size()) < d) counts.resize(d, 0);
    ++counts[d - 1];
  }
}
}  // namespace

DecodeLoop::DecodeLoop(std::shared_ptr<Drafter> drafter, ForwardFn forward, KvBuffersFn kv_buffers,
                       DecodeOptions options, std::optional<ProcessFn> process, std::optional<StopFn> stop,
                       std::optional<StreamFn> stream, std::optional<ForwardFn> exact_forward)
    : drafter_(std::move(drafter)),
      forward_(std::move(forward)),
      kv_buffers_fn_(std::move(kv_buffers)),
      options_(std::move(options)),
      process_(std::move(process)),
      stop_(std::move(stop)),
      stream_(std::move(stream)),
      exact_forward_(std::move(exact_forward)) {
  TORCH_CHECK(drafter_, "DecodeLoop needs a drafter");
  TORCH_CHECK(options_.max_new_tokens >= 1, "max_new_tokens must be >= 1, got ", options_.max_new_tokens);
  TORCH_CHECK(options_.block_complexity >= 1, "block_complexity must be >= 1, got ",
              options_.block_complexity);
  TORCH_CHECK_VALUE(options_.margin_bound >= 0, "margin_bound must be >= 0, got ", options_.margin_bound);
  TORCH_CHECK_VALUE(options_.margin_bound == 0 || exact_forward_.has_value(),
                    "margin_bound > 0 needs an exact_forward to decide the steps below it");
}

void DecodeLoop::check_block(const DraftBlock& block, const at::Tensor& committed,
                             const std::vector<int64_t>& tokens, bool prefill) const {
  const std::string who = "drafter " + drafter_->name() + ": ";
  TORCH_CHECK_VALUE(
      block.tokens.defined() && block.tokens.dim() == 1 && block.tokens.scalar_type() == at::kLong, who,
      "block.tokens must be a 1-D int64 tensor, got ",
      block.tokens.defined() ? block.tokens.toString() + " of shape " + c10::str(block.tokens.sizes())
                             : std::string("an undefined tensor"));
  TORCH_CHECK_VALUE(block.tokens.device() == options_.device, who, "block.tokens is on ",
                    block.tokens.device(), " but the model runs on ", options_.device);
  const int64_t n_tok = block.tokens.size(0), T = block.num_inputs(), c = block.num_committed;
  int64_t n_emb = 0;
  if (block.embeds) {
    const at::Tensor& e = *block.embeds;
    TORCH_CHECK_VALUE(
        e.defined() && e.dim() == 2 && at::isFloatingType(e.scalar_type()), who,
        "block.embeds must be a 2-D floating tensor [num_embed_inputs, hidden], got ",
        e.defined() ? c10::str(e.scalar_type(), " of shape ", e.sizes()) : "an undefined tensor");
    TORCH_CHECK_VALUE(e.device() == options_.device, who, "block.embeds is on ", e.device(),
                      " but the model runs on ", options_.device);
    n_emb = e.size(0);
  }
  TORCH_CHECK_VALUE(n_tok + n_emb == T, who, "block has ", n_tok, " tokens and ", n_emb,
                    " embeddings but parents lists ", T, " inputs; parents needs one entry per input");
  TORCH_CHECK_VALUE(c == committed.size(0), who, "block.num_committed is ", c, " but ", committed.size(0),
                    " committed tokens were handed to propose()");
  TORCH_CHECK_VALUE(block.num_nodes >= c && block.num_nodes <= n_tok, who, "block.num_nodes is ",
                    block.num_nodes, "; it must lie in [num_committed, number of tokens] = [", c, ", ", n_tok,
                    "] (tree nodes are token inputs)");
  TORCH_CHECK_VALUE(prefill || T <= options_.block_complexity, who, "proposed ", T,
                    " inputs, over the block complexity ", options_.block_complexity);
  const std::string tree_error = core::check_parents(block.parents.data(), T);
  TORCH_CHECK_VALUE(tree_error.empty(), who, "invalid draft tree: ", tree_error);
  for (int64_t i = 0; i < c; ++i) {
    TORCH_CHECK_VALUE(block.parents[i] == i - 1, who, "committed input ", i, " must hang from input ", i - 1,
                      " (the committed chain), got parent ", block.parents[i]);
    TORCH_CHECK_VALUE(tokens[i] == sequence_[sequence_.size() - c + i], who, "committed input ", i,
                      " carries token ", tokens[i], " but the sequence has ",
                      sequence_[sequence_.size() - c + i],
                      "; the block must start with the committed tokens it was handed");
  }
  for (int64_t i = c; i < block.num_nodes; ++i) {
    TORCH_CHECK_VALUE(block.parents[i] >= c - 1 && block.parents[i] < block.num_nodes, who, "draft node ", i,
                      " hangs from input ", block.parents[i],
                      ", but draft nodes must descend from the last committed input ", c - 1,
                      " through draft nodes");
  }
  for (int64_t i = 0; i < n_tok; ++i) {
    TORCH_CHECK_VALUE(tokens[i] >= 0 && (options_.vocab_size <= 0 || tokens[i] < options_.vocab_size), who,
                      "input ", i, " carries token id ", tokens[i], ", outside the vocabulary [0, ",
                      options_.vocab_size, ")");
  }
  if (block.draft_probs) {
    const at::Tensor& q = *block.draft_probs;
    TORCH_CHECK_VALUE(
        q.defined() && q.dim() == 2 && q.size(0) == block.num_nodes - c &&
            at::isFloatingType(q.scalar_type()),
        who, "block.draft_probs must be a floating [num_nodes - num_committed, vocab] = [",
        block.num_nodes - c, ", vocab] tensor, got ",
        q.defined() ? c10::str(q.scalar_type(), " of shape ", q.sizes()) : "an undefined tensor");
  }
}

at::Tensor DecodeLoop::read(const at::Tensor& t) {
  ++host_reads_;
  return t.to(at::kCPU).contiguous();
}

at::Tensor DecodeLoop::target_scores(const at::Tensor& logits, const DraftBlock& block,
                                     const std::vector<int64_t>& tokens, int64_t root) {
  // Only the root (the last committed input) and the draft nodes below it need a choice.
  const int64_t n = block.num_nodes - root;
  // A copy when processors run: they write in place, and the drafter reads the raw logits.
  at::Tensor scores = logits.narrow(0, root, n)
                          .to(at::kFloat, /*non_blocking=*/false,
                              /*copy=*/process_.has_value());  // [n, vocab]
  if (process_) {
    // HF processors see (input_ids, scores) for a batch of rows. Nodes of equal depth have
    // prefixes of equal length (sequence + path below the root), so each depth is one call.
    const int64_t* tok = tokens.data();
    std::vector<int64_t> depth(static_cast<size_t>(n), 0);
    std::vector<std::vector<int64_t>> suffix(static_cast<size_t>(n));
    int64_t max_depth = 0;
    for (int64_t r = 1; r < n; ++r) {
      const int64_t p = block.parents[root + r] - root;
      depth[r] = depth[p] + 1;
      suffix[r] = suffix[p];
      suffix[r].push_back(tok[root + r]);
      max_depth = std::max(max_depth, depth[r]);
    }
    for (int64_t d = 0; d <= max_depth; ++d) {
      std::vector<int64_t> rows;
      for (int64_t r = 0; r < n; ++r) {
        if (depth[r] == d) rows.push_back(r);
      }
      if (rows.empty()) continue;
      const int64_t L = static_cast<int64_t>(sequence_.size()) + d;
      at::Tensor ids = at::empty({static_cast<int64_t>(rows.size()), L}, at::kLong);  // [n_d, L]
      for (size_t i = 0; i < rows.size(); ++i) {
        int64_t* out = ids[static_cast<int64_t>(i)].data_ptr<int64_t>();
        std::copy(sequence_.begin(), sequence_.end(), out);
        std::copy(suffix[rows[i]].begin(), suffix[rows[i]].end(), out + sequence_.size());
      }
      at::Tensor idx = long_tensor(rows).to(scores.device());
      at::Tensor out = (*process_)(ids.to(scores.device()), scores.index_select(0, idx));  // [n_d, vocab]
      scores.index_copy_(0, idx, out.to(at::kFloat));
    }
  }
  return scores;
}

double DecodeLoop::path_margin(const Verdict& verdict, int64_t root) const {
  double least = std::numeric_limits<double>::infinity();
  for (int64_t node : verdict.path) least = std::min(least, verdict.margins[node - root]);
  return least;
}

DecodeLoop::Verdict DecodeLoop::verify(const at::Tensor& logits, const DraftBlock& block,
                                       const std::vector<int64_t>& tokens, int64_t root) {
  Verdict v;
  v.scores = target_scores(logits, block, tokens, root);  // [n, vocab], row r = node root + r
  const at::Tensor& scores = v.scores;
  const int64_t n = block.num_nodes - root;
  std::vector<int64_t> parents(static_cast<size_t>(n));  // the subtree below the root, re-indexed
  for (int64_t r = 0; r < n; ++r) parents[r] = r == 0 ? -1 : block.parents[root + r] - root;
  std::vector<int64_t> path(static_cast<size_t>(n));
  int64_t len = 0;
  if (!options_.do_sample) {
    // Greedy: the target's argmax after every node. Its value comes back with it (one read), and
    // a NaN or +inf there means the row cannot be trusted: under an additive mask one non-finite
    // key or value of a draft makes every row of the block NaN, and argmax(NaN) is no token.
    // With a margin bound, each row's top-2 margin comes back in the same read.
    const bool margins = options_.margin_bound > 0;
    auto [best, target] = scores.max(-1);  // [n], [n]: argmax, as HF's greedy breaks ties
    std::vector<at::Tensor> parts{target.to(at::kDouble), best.to(at::kDouble)};
    if (margins) {
      at::Tensor top = std::get<0>(scores.topk(2, -1));  // [n, 2]
      parts.push_back((top.select(1, 0) - top.select(1, 1)).to(at::kDouble));
    }
    at::Tensor both = read(at::stack(parts));
    const double* t = both.data_ptr<double>();  // [2 or 3, n]: token ids (exact below 2^53), values, margins
    for (int64_t r = 0; r < n; ++r) {
      if (unusable(t[n + r])) return Verdict{false, {}, -1, {}, {}};
    }
    if (margins) v.margins.assign(t + 2 * n, t + 3 * n);
    std::vector<int64_t> tgt(t, t + n);
    len = core::verify_greedy(tokens.data() + root, parents.data(), tgt.data(), n, 0, path.data());
    v.bonus = tgt[path[len - 1]];
  } else {
    at::Tensor best = std::get<0>(scores.max(-1)).to(at::kDouble);  // [n] on the device
    at::Tensor p = scores.softmax(-1);                              // [n, vocab]
    auto usable = [&](const double* b) {
      for (int64_t r = 0; r < n; ++r) {
        if (unusable(b[r])) return false;
      }
      return true;
    };
    if (block.draft_probs && n > 1) {
      if (!usable(read(best).data_ptr<double>())) return Verdict{false, {}, -1, {}, {}};
      // Rejection sampling against the drafter's q: the output is distributed as the target's
      // sampling, and a draft is accepted with probability min(1, p/q) instead of p(x) alone.
      // The op runs where p is (the CUDA kernel on a GPU, with the device's generator), so p and q
      // stay there; the path and the bonus come back in one read. It checks q's shape and that every
      // draft has q > 0.
      const at::Device dev = p.device();
      at::Tensor u = at::rand({n + 1}, sampling_generator(dev),
                              at::TensorOptions().dtype(at::kDouble).device(dev));  // [n + 1]
      auto [path_t, token_t] = ops::dispatch::verify_rejection(
          long_tensor(std::vector<int64_t>(tokens.begin() + root, tokens.end())).to(dev),
          long_tensor(parents).to(dev), p, block.draft_probs->to(dev), u);
      at::Tensor both = read(at::cat({path_t, token_t.reshape({1})}));  // [len + 1]: the path, the bonus
      len = both.size(0) - 1;
      std::copy(both.data_ptr<int64_t>(), both.data_ptr<int64_t>() + len, path.begin());
      v.bonus = both.data_ptr<int64_t>()[len];
    } else {
      // Sampling without q ("sample matching"): one sample of the processed distribution per
      // node, as HF samples one position; each output token is a sample of the target's own
      // conditional whatever the drafts were, so the output distribution is exactly the
      // target's; the drafts only decide how far one forward gets.
      // The samples and the row maxima in one read. A NaN row samples garbage (or fails: torch's
      // multinomial checks on the CPU), so the draw waits for nothing and the maxima decide after; a
      // block found unusable puts the generator back, so that the re-run draws what plain sampling
      // would have drawn (the drafts change nothing, not even the random stream).
      at::Generator gen = sampling_generator_or_default(p.device());  // the row's, in a batch
      at::Tensor rng_state = gen.get_state();
      at::Tensor bad = at::isnan(best).logical_or(best == std::numeric_limits<double>::infinity());  // [n]
      at::Tensor safe = at::where(bad.unsqueeze(-1), at::ones_like(p), p);  // [n, vocab]
      at::Tensor both = read(
          at::stack({at::multinomial(safe, 1, false, gen).squeeze(-1).to(at::kDouble), best}));  // [2, n]
      const double* b = both.data_ptr<double>();
      if (!usable(b + n)) {
        gen.set_state(rng_state);
        return Verdict{false, {}, -1, {}, {}};
      }
      std::vector<int64_t> t(b, b + n);  // token ids, exact below 2^53
      len = core::verify_greedy(tokens.data() + root, parents.data(), t.data(), n, 0, path.data());
      v.bonus = t[path[len - 1]];
    }
  }
  path.resize(static_cast<size_t>(len));
  for (auto& node : path) node += root;
  v.path = std::move(path);
  return v;
}

int64_t DecodeLoop::append(const std::vector<int64_t>& tokens, const at::Tensor& scores,
                           const std::vector<int64_t>& rows, DecodeResult& result) {
  int64_t kept = 0;
  for (size_t j = 0; j < tokens.size(); ++j) {
    const int64_t tok = tokens[j];
    sequence_.push_back(tok);
    ++kept;
    const int64_t generated = static_cast<int64_t>(sequence_.size()) - prompt_len_;
    // The same order of checks as HF greedy: the token is emitted, then the criteria look at it.
    if (std::find(options_.eos_token_ids.begin(), options_.eos_token_ids.end(), tok) !=
        options_.eos_token_ids.end()) {
      result.stop_reason = "eos";
    } else if (generated >= options_.max_new_tokens) {
      result.stop_reason = "max_new_tokens";
    } else if (stop_ && (*stop_)(long_tensor(sequence_).view({1, -1}), scores.narrow(0, rows[j], 1))) {
      result.stop_reason = "stopping_criteria";
    }
    if (!result.stop_reason.empty()) {
      finished_ = true;
      break;
    }
  }
  if (stream_ && kept > 0) {
    (*stream_)(long_tensor(std::vector<int64_t>(sequence_.end() - kept, sequence_.end())));
  }
  return kept;
}

DecodeResult DecodeLoop::run(const at::Tensor& prompt_in) {
  TORCH_CHECK(prompt_in.dim() == 1 && prompt_in.numel() >= 1, "prompt must be a non-empty 1-D token tensor");
  const auto t_start = Clock::now();
  DecodeResult result;
  at::Tensor prompt = prompt_in.to(at::kCPU, at::kLong).contiguous();
  sequence_.assign(prompt.data_ptr<int64_t>(), prompt.data_ptr<int64_t>() + prompt.numel());
  prompt_len_ = static_cast<int64_t>(sequence_.size());
  finished_ = false;
  host_reads_ = 0;
  const SamplingGeneratorScope sampling(options_.generator);  // this thread's draws, drafters' included
  TreeMaskBuilder masks(options_.kv_capacity, options_.mask_dtype, options_.device,
                        options_.incremental_masks, options_.ancestor_bits);
  std::vector<at::Tensor> kv;  // the cache's KV tensors, fetched after the first forward
  std::vector<at::Tensor> kept_scores, kept_logits;  // [kept, vocab] per step, with keep_scores / keep_logits

  drafter_->begin(prompt.to(options_.device));
  at::Tensor committed = prompt.to(options_.device);  // [c] tokens not yet in the KV cache
  int64_t prefix_len = 0;                             // P: KV entries that are final
  bool prefill = true;

  while (!finished_) {
    const int64_t tokens_left =
        options_.max_new_tokens - (static_cast<int64_t>(sequence_.size()) - prompt_len_);
    StepLimits limits{options_.block_complexity, options_.max_positions - 1 - prefix_len, tokens_left};
    // 1. The drafter lays out this forward: committed chain, draft tree, auxiliary inputs.
    DraftBlock block = drafter_->propose(committed, prefix_len, limits);
    // The block's tokens on the host: checked now, walked by verification later. The committed
    // chain is the sequence's tail; the drafts come from the drafter's host copy, else one read.
    std::vector<int64_t> tokens;
    const int64_t n_committed = committed.size(0);
    if (block.tokens.defined() && block.tokens.dim() == 1 && block.tokens.scalar_type() == at::kLong &&
        block.num_committed == n_committed && block.drafts_on_host(committed)) {
      tokens.assign(sequence_.end() - n_committed, sequence_.end());
      tokens.insert(tokens.end(), block.host_drafts.begin(), block.host_drafts.end());
    } else if (block.tokens.defined()) {
      at::Tensor tok_cpu = read(block.tokens);
      if (tok_cpu.scalar_type() == at::kLong)
        tokens.assign(tok_cpu.data_ptr<int64_t>(), tok_cpu.data_ptr<int64_t>() + tok_cpu.numel());
    }
    check_block(block, committed, tokens, prefill);
    const int64_t c = block.num_committed;
    if (!prefill) {
      count_drafts(block, result.drafted_per_depth);
      result.block_sizes.push_back(block.num_inputs());
    }

    // 2. Mask and position ids: prefix columns + tree pattern, positions = P + depth.
    // 3. One forward of the target over all T inputs. The forward may grow the KV cache; the
    //    buffers are fetched again when they no longer hold the block.
    // An exact re-run (a near-tie, below) is counted in exact_steps, not forward_calls: forward_calls stays
    // the prefill and one forward per decode step.
    auto run_forward = [&](const DraftBlock& b, const ForwardFn& forward, bool exact = false) {
      BlockInputs in = masks.build(b.parents, prefix_len);
      const auto t_fwd = Clock::now();
      auto out = forward(b.tokens, b.embeds, in.position_ids, in.mask, prefix_len,
                         drafter_->wants_hidden_states());  // logits: [T, vocab]
      const double fwd = seconds_since(t_fwd);
      result.forward_seconds += fwd;
      if (prefill) result.prefill_seconds += fwd;
      ++(exact ? result.exact_steps : result.forward_calls);
      if (kv.empty() || kv.front().size(2) < prefix_len + b.num_inputs()) kv = kv_buffers_fn_();
      return out;
    };
    auto [logits, hidden] = run_forward(block, forward_);

    // 4. Verification: walk the tree from the last committed node while a child is accepted
    //    (equals the target's argmax or sample, or passes rejection sampling against q); the
    //    token after the last accepted node is the bonus.
    Verdict verdict = verify(logits, block, tokens, c - 1);
    bool replaced = false;
    if (!verdict.finite && block.num_inputs() > c) {
      // Non-finite logits with drafts in the block: a NaN/inf that a draft or an auxiliary input
      // carried reaches every row through the additive mask (0 * NaN is NaN). The verified tokens
      // must not depend on drafts, so the committed chain runs again alone, as plain decoding
      // would run it; its KV entries overwrite the block's.
      // The block's KV entries (and any a padded forward wrote after them) may hold the NaN too. The
      // mask hides them from every later query, but an attention that reads the whole buffer (the
      // static plan's CUDA graphs) would still take 0 * NaN: clear everything past the prefix.
      for (auto& t : kv) t.narrow(2, prefix_len, t.size(2) - prefix_len).zero_();
      DraftBlock plain;
      plain.tokens = block.tokens.narrow(0, 0, c);
      plain.num_committed = plain.num_nodes = c;
      plain.parents.resize(static_cast<size_t>(c));
      for (int64_t i = 0; i < c; ++i) plain.parents[i] = i - 1;
      std::tie(logits, hidden) = run_forward(plain, forward_);
      verdict = verify(logits, plain, tokens, c - 1);
      block = std::move(plain);
      replaced = true;
      ++result.fallback_steps;
    }
    if (verdict.finite && options_.margin_bound > 0 && !options_.do_sample &&
        path_margin(verdict, c - 1) < options_.margin_bound) {
      // A near-tie on the verified path (at the prefill, the first token's row): the exact forward decides
      // the step (its KV entries overwrite the block's).
      std::tie(logits, hidden) = run_forward(block, *exact_forward_, true);
      verdict = verify(logits, block, tokens, c - 1);
    }
    TORCH_CHECK(
        verdict.finite, "the target model's logits are NaN or +inf after the ", sequence_.size(),
        " tokens of the sequence, with no draft in the forward: greedy decoding (and sampling) has no "
        "token to choose. HF generate would emit an arbitrary token here; mtprobe stops instead. Check "
        "the model's weights and dtype (float16 overflow?)");
    const std::vector<int64_t>& path = verdict.path;
    const int64_t path_len = static_cast<int64_t>(path.size());
    if (!prefill) {
      auto& accepted = result.accepted_per_depth;  // path[j] sits at depth j
      if (static_cast<int64_t>(accepted.size()) < path_len - 1) accepted.resize(path_len - 1, 0);
      for (int64_t j = 1; j < path_len; ++j) ++accepted[j - 1];
    }
    std::vector<int64_t> new_tokens, rows;  // rows: the score row each new token was chosen from
    for (int64_t j = 1; j < path_len; ++j) {
      new_tokens.push_back(tokens[path[j]]);
      rows.push_back(path[j - 1] - (c - 1));
    }
    new_tokens.push_back(verdict.bonus);
    rows.push_back(path.back() - (c - 1));

    // 5. Append with EOS / length / stopping checks (they may cut the block short).
    const int64_t kept = append(new_tokens, verdict.scores, rows, result);
    if (!prefill) result.accept_lengths.push_back(kept);
    if ((options_.keep_scores || options_.keep_logits) && kept > 0) {
      // Copies, taken now: the logits may live in a buffer the next forward overwrites (a graph's).
      at::Tensor idx = long_tensor(std::vector<int64_t>(rows.begin(), rows.begin() + kept))
                           .to(verdict.scores.device());  // [kept], rows below the root
      if (options_.keep_scores) kept_scores.push_back(verdict.scores.index_select(0, idx));
      if (options_.keep_logits) kept_logits.push_back(logits.index_select(0, idx + (c - 1)).to(at::kFloat));
    }
    new_tokens.resize(static_cast<size_t>(kept));

    StepOutcome outcome{prefix_len, path, new_tokens, logits, hidden, finished_, replaced};
    if (!finished_) {
      // 6. KV compaction: the committed chain is in place; move the accepted drafts right after
      //    it. O(accepted) rows per layer; the rest of the block is dropped by the new length.
      std::vector<int64_t> src;
      for (int64_t j = 1; j < path_len; ++j) src.push_back(prefix_len + path[j]);
      if (!src.empty()) ops::dispatch::compact_kv_(kv, long_tensor(src), prefix_len + c);
      prefix_len += c + path_len - 1;
      committed =
          at::full({1}, new_tokens.back(), at::TensorOptions().dtype(at::kLong).device(options_.device));
    }
    // 7. The drafter learns the verdict (and reads its auxiliary logits).
    drafter_->observe(outcome);
    prefill = false;
  }
  result.sequence = sequence_;
  if (!kept_scores.empty()) result.scores = at::cat(kept_scores);  // [new, vocab]
  if (!kept_logits.empty()) result.logits = at::cat(kept_logits);  // [new, vocab]
  result.mask_rebuilds = masks.rebuilds();
  result.mask_capacity = masks.capacity();
  result.kv_capacity = kv.empty() ? 0 : kv.front().size(2);
  result.host_reads = host_reads_;
  result.total_seconds = seconds_since(t_start);
  return result;
}

}  // namespace mtprobe
