#include "decode/decode_loop.h"

#include <algorithm>
#include <chrono>

#include "core/tree.h"
#include "core/verify.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace mtprobe {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
at::Tensor long_tensor(const std::vector<int64_t>& v) { return at::tensor(v, at::kLong); }
}  // namespace

DecodeLoop::DecodeLoop(std::shared_ptr<Drafter> drafter, ForwardFn forward, KvBuffersFn kv_buffers,
                       DecodeOptions options, std::optional<ProcessFn> process, std::optional<StopFn> stop,
                       std::optional<StreamFn> stream)
    : drafter_(std::move(drafter)),
      forward_(std::move(forward)),
      kv_buffers_fn_(std::move(kv_buffers)),
      options_(std::move(options)),
      process_(std::move(process)),
      stop_(std::move(stop)),
      stream_(std::move(stream)) {
  TORCH_CHECK(drafter_, "DecodeLoop needs a drafter");
  TORCH_CHECK(options_.max_new_tokens >= 1, "max_new_tokens must be >= 1, got ", options_.max_new_tokens);
  TORCH_CHECK(options_.block_complexity >= 1, "block_complexity must be >= 1, got ",
              options_.block_complexity);
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

std::pair<std::vector<int64_t>, int64_t> DecodeLoop::verify(const at::Tensor& logits, const DraftBlock& block,
                                                            const std::vector<int64_t>& tokens,
                                                            int64_t root) {
  at::Tensor scores = target_scores(logits, block, tokens, root);  // [n, vocab], row r = node root + r
  const int64_t n = block.num_nodes - root;
  std::vector<int64_t> parents(static_cast<size_t>(n));  // the subtree below the root, re-indexed
  for (int64_t r = 0; r < n; ++r) parents[r] = r == 0 ? -1 : block.parents[root + r] - root;
  std::vector<int64_t> path(static_cast<size_t>(n));
  int64_t token = -1, len = 0;
  if (options_.do_sample && block.draft_probs && n > 1) {
    // Rejection sampling against the drafter's q: the output is distributed as the target's
    // sampling, and a draft is accepted with probability min(1, p/q) instead of p(x) alone.
    // ops::verify_rejection checks q's shape and that every draft has q > 0.
    at::Tensor p = scores.softmax(-1);                                         // [n, vocab]
    at::Tensor u = at::rand({n + 1}, at::TensorOptions().dtype(at::kDouble));  // the global CPU generator
    auto [path_t, token_t] =
        ops::verify_rejection(long_tensor(std::vector<int64_t>(tokens.begin() + root, tokens.end())),
                              long_tensor(parents), p, *block.draft_probs, u);
    len = path_t.size(0);
    std::copy(path_t.data_ptr<int64_t>(), path_t.data_ptr<int64_t>() + len, path.begin());
    token = token_t.item<int64_t>();
  } else {
    // Greedy: the target's argmax after every node. Sampling without q ("sample matching"): one
    // sample of the processed distribution per node, as HF samples one position; each output
    // token is a sample of the target's own conditional whatever the drafts were, so the output
    // distribution is exactly the target's; the drafts only decide how far one forward gets.
    at::Tensor target =
        options_.do_sample ? at::multinomial(scores.softmax(-1), 1).squeeze(-1) : scores.argmax(-1);  // [n]
    target = target.to(at::kCPU).contiguous();  // the host walks the tree
    const int64_t* t = target.data_ptr<int64_t>();
    len = core::verify_greedy(tokens.data() + root, parents.data(), t, n, 0, path.data());
    token = t[path[len - 1]];
  }
  path.resize(static_cast<size_t>(len));
  for (auto& node : path) node += root;
  return {path, token};
}

int64_t DecodeLoop::append(const std::vector<int64_t>& tokens, DecodeResult& result) {
  int64_t kept = 0;
  for (int64_t tok : tokens) {
    sequence_.push_back(tok);
    ++kept;
    const int64_t generated = static_cast<int64_t>(sequence_.size()) - prompt_len_;
    // The same order of checks as HF greedy: the token is emitted, then the criteria look at it.
    if (std::find(options_.eos_token_ids.begin(), options_.eos_token_ids.end(), tok) !=
        options_.eos_token_ids.end()) {
      result.stop_reason = "eos";
    } else if (generated >= options_.max_new_tokens) {
      result.stop_reason = "max_new_tokens";
    } else if (stop_ && (*stop_)(long_tensor(sequence_).view({1, -1}))) {
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
  TreeMaskBuilder masks(options_.kv_capacity, options_.mask_dtype, options_.device,
                        options_.incremental_masks, options_.ancestor_bits);
  std::vector<at::Tensor> kv;  // the cache's KV tensors, fetched after the first forward

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
    const int64_t T = block.num_inputs();
    const int64_t c = block.num_committed;
    TORCH_CHECK(c == committed.size(0) && block.num_nodes >= c && block.num_nodes <= T, "drafter ",
                drafter_->name(), " returned an inconsistent block (committed ", c, ", nodes ",
                block.num_nodes, ", inputs ", T, ")");
    TORCH_CHECK(prefill || T <= options_.block_complexity, "drafter ", drafter_->name(), " proposed ", T,
                " inputs, over the block complexity ", options_.block_complexity);
    TORCH_CHECK(prefix_len + T <= options_.kv_capacity, "the KV cache holds ", options_.kv_capacity,
                " entries but this step needs ", prefix_len + T);
    ops::check_parents_or_throw(block.parents);
    for (int64_t i = c; i < block.num_nodes; ++i) {
      TORCH_CHECK(block.parents[i] >= c - 1, "drafter ", drafter_->name(), ": draft node ", i,
                  " hangs from input ", block.parents[i],
                  ", but draft nodes must descend from the last committed input ", c - 1);
    }

    // 2. Mask and position ids: prefix columns + tree pattern, positions = P + depth.
    BlockInputs in = masks.build(block.parents, prefix_len);

    // 3. One forward of the target over all T inputs.
    const auto t_fwd = Clock::now();
    auto [logits, hidden] = forward_(block.tokens, block.embeds, in.position_ids, in.mask, prefix_len,
                                     drafter_->wants_hidden_states());  // logits: [T, vocab]
    const double fwd = seconds_since(t_fwd);
    result.forward_seconds += fwd;
    if (prefill) result.prefill_seconds = fwd;
    ++result.forward_calls;
    if (kv.empty()) kv = kv_buffers_fn_();

    // 4. Verification: walk the tree from the last committed node while a child is accepted
    //    (equals the target's argmax or sample, or passes rejection sampling against q); the
    //    token after the last accepted node is the bonus.
    at::Tensor tok_cpu = block.tokens.to(at::kCPU).contiguous();
    const int64_t* tok_ptr = tok_cpu.data_ptr<int64_t>();
    const std::vector<int64_t> tokens(tok_ptr, tok_ptr + block.num_nodes);
    auto [path, bonus] = verify(logits, block, tokens, c - 1);
    const int64_t path_len = static_cast<int64_t>(path.size());
    std::vector<int64_t> new_tokens;
    for (int64_t j = 1; j < path_len; ++j) new_tokens.push_back(tokens[path[j]]);
    new_tokens.push_back(bonus);

    // 5. Append with EOS / length / stopping checks (they may cut the block short).
    const int64_t kept = append(new_tokens, result);
    if (!prefill) result.accept_lengths.push_back(kept);
    new_tokens.resize(static_cast<size_t>(kept));

    StepOutcome outcome{prefix_len, path, new_tokens, logits, hidden, finished_};
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
  result.mask_rebuilds = masks.rebuilds();
  result.total_seconds = seconds_since(t_start);
  return result;
}

}  // namespace mtprobe
