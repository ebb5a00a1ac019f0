#include "drafters/draft_model.h"

#include <algorithm>

namespace mtprobe {

DraftModelDrafter::DraftModelDrafter(ForwardFn forward, DraftModelOptions options,
                                     std::optional<ProcessFn> process)
    : forward_(std::move(forward)), options_(options), process_(std::move(process)) {
  TORCH_CHECK_VALUE(forward_, "DraftModelDrafter needs the draft model's forward callback");
  TORCH_CHECK_VALUE(options_.num_tokens >= 1, "num_tokens (drafts per step) must be >= 1, got ",
                    options_.num_tokens);
}

void DraftModelDrafter::begin(const at::Tensor& prompt) {
  at::Tensor p = prompt.to(at::kCPU, at::kLong).contiguous();
  history_.assign(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
  cached_ = 0;
  draft_forwards_ = 0;
}

DraftBlock DraftModelDrafter::propose(const at::Tensor& committed, int64_t prefix_len,
                                      const StepLimits& limits) {
  (void)prefix_len;
  const int64_t c = committed.size(0);
  const auto device = committed.device();
  // Drafts past the tokens still wanted, the budget or the context are wasted work.
  const int64_t k =
      std::max<int64_t>(0, std::min({options_.num_tokens, limits.tokens_left - 1, limits.max_depth,
                                     c == 1 ? limits.budget - 1 : options_.num_tokens}));
  std::vector<int64_t> drafts;
  std::vector<at::Tensor> q_rows;                                         // [vocab] each, under sampling
  std::vector<int64_t> feed(history_.begin() + cached_, history_.end());  // not yet in the draft cache
  for (int64_t i = 0; i < k; ++i) {
    const int64_t n = static_cast<int64_t>(feed.size());
    at::Tensor positions =
        at::arange(cached_, cached_ + n, at::TensorOptions().dtype(at::kLong).device(device));
    auto [logits, hidden] =
        forward_(at::tensor(feed, at::kLong).to(device), std::nullopt, positions.view({1, n}), std::nullopt,
                 cached_, false);  // logits: [n, vocab]
    (void)hidden;
    ++draft_forwards_;
    cached_ += n;
    at::Tensor scores = logits[n - 1].to(at::kFloat).unsqueeze(0);  // [1, vocab]
    if (process_) {
      std::vector<int64_t> ids(history_);
      ids.insert(ids.end(), drafts.begin(), drafts.end());
      scores =
          (*process_)(at::tensor(ids, at::kLong).view({1, -1}).to(device), scores.clone()).to(at::kFloat);
    }
    int64_t token;
    if (options_.do_sample) {
      at::Tensor q = scores.softmax(-1);  // [1, vocab]
      token = at::multinomial(q, 1).item<int64_t>();
      q_rows.push_back(q[0]);
    } else {
      token = scores.argmax(-1).item<int64_t>();
    }
    drafts.push_back(token);
    feed.assign(1, token);
  }
  DraftBlock b;
  b.num_committed = c;
  b.num_nodes = c + k;
  b.tokens = k > 0 ? at::cat({committed, at::tensor(drafts, at::kLong).to(device)}) : committed;
  b.parents.resize(static_cast<size_t>(c + k));
  for (int64_t i = 0; i < c + k; ++i) b.parents[i] = i - 1;  // one chain through the committed tokens
  if (options_.do_sample && k > 0) b.draft_probs = at::stack(q_rows);  // [k, vocab]
  return b;
}

void DraftModelDrafter::observe(const StepOutcome& outcome) {
  // The cache holds history + drafts[0 : K - 1]; what the target accepted is still valid.
  const int64_t accepted = static_cast<int64_t>(outcome.path.size()) - 1;
  cached_ = std::min(cached_, static_cast<int64_t>(history_.size()) + accepted);
  history_.insert(history_.end(), outcome.new_tokens.begin(), outcome.new_tokens.end());
}

}  // namespace mtprobe
