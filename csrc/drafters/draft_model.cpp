#include "drafters/draft_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/sampling_generator.h"

namespace mtprobe {

namespace {
// The best token of scores [1, vocab] and its margin over the second (the first maximum, as argmax; a
// margin that is not finite, as past -inf scores, counts as the largest).
std::pair<int64_t, double> top_two(const at::Tensor& scores) {
  int64_t best = 0;
  float first = 0.0f, second = -std::numeric_limits<float>::infinity();
  if (scores.is_cpu() && scores.size(-1) >= 2) {  // one pass over the row, no copy
    at::Tensor row = scores[0].contiguous();
    const float* x = row.data_ptr<float>();
    first = x[0];
    for (int64_t i = 1, n = row.numel(); i < n; ++i) {
      if (x[i] > first) {
        second = first;
        first = x[i];
        best = i;
      } else if (x[i] > second) {
        second = x[i];
      }
    }
  } else {  // on a device: its top two, three numbers read back
    const auto [values, indices] = scores[0].topk(std::min<int64_t>(2, scores.size(-1)));
    at::Tensor v = values.to(at::kCPU);
    best = indices[0].item<int64_t>();
    first = v[0].item<float>();
    if (v.numel() > 1) second = v[1].item<float>();
  }
  const double margin = static_cast<double>(first) - static_cast<double>(second);
  return {best, std::isfinite(margin) && margin >= 0 ? margin : std::numeric_limits<double>::max()};
}
}  // namespace

DraftModelDrafter::DraftModelDrafter(ForwardFn forward, DraftModelOptions options,
                                     std::optional<ProcessFn> process)
    : forward_(std::move(forward)), options_(options), process_(std::move(process)) {
  TORCH_CHECK_VALUE(forward_, "DraftModelDrafter needs the draft model's forward callback");
  TORCH_CHECK_VALUE(options_.num_tokens >= 1, "num_tokens (drafts per step) must be >= 1, got ",
                    options_.num_tokens);
  TORCH_CHECK_VALUE(options_.top_branches >= 1, "top_branches (children of the root) must be >= 1, got ",
                    options_.top_branches);
}

void DraftModelDrafter::begin(const at::Tensor& prompt) {
  at::Tensor p = prompt.to(at::kCPU, at::kLong).contiguous();
  history_.assign(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
  cached_ = 0;
  draft_forwards_ = 0;
}

DraftBlock DraftModelDrafter::propose(const at::Tensor& committed, int64_t prefix_len,
                                      const StepLimits& limits) {
  const int64_t c = committed.size(0);
  const auto device = committed.device();
  // Drafts past the tokens still wanted, the budget or the context are wasted work.
  const int64_t k =
      options_.skip_prefill && prefix_len == 0
          ? 0
          : std::max<int64_t>(0, std::min({options_.num_tokens, limits.tokens_left - 1, limits.max_depth,
                                           c == 1 ? limits.budget - 1 : options_.num_tokens}));
  std::vector<int64_t> drafts, siblings;
  std::vector<at::Tensor> q_rows;  // [vocab] each, under sampling
  // Siblings of the chain's first token, within the budget (the prefill's block is not budgeted).
  const int64_t room = c == 1 ? limits.budget - 1 - k : options_.top_branches - 1;
  const int64_t extra = k > 0 ? std::max<int64_t>(0, std::min(options_.top_branches - 1, room)) : 0;
  std::vector<int64_t> feed(history_.begin() + cached_, history_.end());  // not yet in the draft cache
  // Greedy chains end early where the draft is less sure than its record allows.
  core::MarginStats* stats = options_.do_sample ? nullptr : options_.margin_stats.get();
  margins_.clear();
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
      // The chain's token and, at the root, the siblings: 1 + extra independent draws from q_1.
      at::Tensor draws =
          at::multinomial(q, i == 0 ? 1 + extra : 1, /*replacement=*/true, sampling_generator(q.device()))
              .to(at::kCPU);
      token = draws[0][0].item<int64_t>();
      q_rows.push_back(q[0]);
      for (int64_t s = 1; i == 0 && s <= extra; ++s) siblings.push_back(draws[0][s].item<int64_t>());
    } else if (i == 0 && extra > 0) {
      at::Tensor top =
          std::get<1>(scores.topk(std::min<int64_t>(1 + extra, scores.size(-1)), -1)).to(at::kCPU);
      token = top[0][0].item<int64_t>();
      for (int64_t s = 1; s < top.size(1); ++s) siblings.push_back(top[0][s].item<int64_t>());
    } else if (stats == nullptr) {
      token = scores.argmax(-1).item<int64_t>();
    }
    double margin = 0.0;
    if (stats != nullptr) {
      const auto [best, top_margin] = top_two(scores);
      if (i > 0 || extra == 0) token = best;  // the root's siblings' topk chose it already
      margin = top_margin;
      margins_.push_back(margin);
    }
    drafts.push_back(token);
    feed.assign(1, token);
    if (stats != nullptr && stats->stops(margin)) break;  // the drafts after it would likely be wasted
  }
  const int64_t made = static_cast<int64_t>(drafts.size());
  chain_len_ = made;
  // The chain below the last committed token, then the siblings of its first token.
  std::vector<int64_t> parents(static_cast<size_t>(made));
  for (int64_t j = 0; j < made; ++j) parents[j] = j - 1;
  drafts.insert(drafts.end(), siblings.begin(), siblings.end());
  parents.resize(drafts.size(), -1);
  DraftBlock b = token_block(committed, drafts, parents);
  if (options_.do_sample && made > 0) {
    q_rows.insert(q_rows.end(), siblings.size(), q_rows[0]);  // siblings: more draws from q_1
    b.draft_probs = at::stack(q_rows);                        // [k + siblings, vocab]
  }
  return b;
}

void DraftModelDrafter::observe(const StepOutcome& outcome) {
  // The cache holds history + chain[0 : K - 1]; the accepted part of the chain is still valid (a
  // path through a sibling keeps none of it). A replaced block's path is another block's: none of
  // the chain ran.
  int64_t accepted = 0;
  const int64_t root = outcome.path.front();
  while (!outcome.block_replaced && accepted + 1 < static_cast<int64_t>(outcome.path.size()) &&
         accepted < chain_len_ && outcome.path[accepted + 1] == root + accepted + 1) {
    ++accepted;
  }
  // The verdicts: the drafts before the first miss matched the target, the miss did not; those after it
  // were drafted from a wrong prefix and say nothing. A replaced block ran none of them.
  if (options_.margin_stats && !outcome.block_replaced) {
    const int64_t judged = std::min<int64_t>(accepted + 1, static_cast<int64_t>(margins_.size()));
    for (int64_t j = 0; j < judged; ++j) options_.margin_stats->record(margins_[j], j < accepted);
  }
  margins_.clear();
  cached_ = std::min(cached_, static_cast<int64_t>(history_.size()) + accepted);
  history_.insert(history_.end(), outcome.new_tokens.begin(), outcome.new_tokens.end());
}

}  // namespace mtprobe
