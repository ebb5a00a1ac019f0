#include "drafters/mask_probe.h"

namespace mtprobe {

MaskProbeDrafter::MaskProbeDrafter(at::Tensor embedding, MaskProbeOptions options)
    : embedding_(std::move(embedding)), options_(options) {
  TORCH_CHECK(embedding_.dim() == 2, "embedding must be [vocab, hidden], got ", embedding_.sizes());
  TORCH_CHECK(options_.num_branches >= 1, "num_branches must be >= 1, got ", options_.num_branches);
  TORCH_CHECK(options_.mask_lambda >= 0.0 && options_.mask_lambda <= 1.0, "mask_lambda must be in [0, 1], got ",
              options_.mask_lambda);
}

void MaskProbeDrafter::begin(const at::Tensor& prompt) {
  TORCH_CHECK(prompt.dim() == 1 && prompt.numel() > 0, "prompt must be a non-empty 1-D token tensor");
  // Soft initialisation: the mean of the prompt's input embeddings, kept in float32 so the
  // running update does not drift in low precision.
  mask_ = embedding_.index_select(0, prompt.to(embedding_.device())).to(at::kFloat).mean(0);  // [hidden]
  pending_ = at::empty({0}, at::TensorOptions().dtype(at::kLong).device(embedding_.device()));
  mask_input_of_node_.clear();
}

DraftBlock MaskProbeDrafter::propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) {
  const int64_t c = committed.size(0);
  DraftBlock b;
  b.num_committed = c;
  // Drafts only after prefill, only if a later token is still wanted, within the budget:
  // inputs = c + K drafts + (1 + K) masks <= budget.
  int64_t k = 0;
  if (c == 1 && limits.tokens_left >= 2 && limits.max_depth >= 1) {
    k = std::min<int64_t>(pending_.size(0), std::max<int64_t>(0, (limits.budget - 2) / 2));
  }
  // A node's mask sits one position below it; a mask is useful only if a token after the next
  // is still wanted.
  const bool masks = limits.tokens_left >= 2;
  const int64_t node_depth_max = k > 0 ? 1 : 0;
  const bool mask_on_drafts = masks && limits.max_depth >= node_depth_max + 1;
  const bool mask_on_root = masks && limits.max_depth >= 1;

  b.num_nodes = c + k;
  b.tokens = k > 0 ? at::cat({committed, pending_.narrow(0, 0, k)}) : committed;
  b.parents.resize(static_cast<size_t>(c + k));
  for (int64_t i = 0; i < c; ++i) b.parents[i] = i - 1;  // the committed chain
  for (int64_t i = c; i < c + k; ++i) b.parents[i] = c - 1;  // drafts: children of the root

  mask_input_of_node_.assign(static_cast<size_t>(c + k), -1);
  int64_t num_masks = 0;
  auto add_mask = [&](int64_t node) {
    mask_input_of_node_[node] = static_cast<int64_t>(b.parents.size());
    b.parents.push_back(node);
    ++num_masks;
  };
  if (mask_on_root) add_mask(c - 1);
  if (mask_on_drafts) {
    for (int64_t i = c; i < c + k; ++i) add_mask(i);
  }
  if (num_masks > 0) {
    // Every mask input shares one embedding; position and context make them differ.
    b.embeds = mask_.to(embedding_.scalar_type()).unsqueeze(0).expand({num_masks, mask_.size(0)});
  }
  (void)prefix_len;
  return b;
}

void MaskProbeDrafter::observe(const StepOutcome& outcome) {
  const int64_t last = outcome.path.back();
  const int64_t row = last < static_cast<int64_t>(mask_input_of_node_.size()) ? mask_input_of_node_[last] : -1;
  if (row >= 0 && !outcome.finished) {
    // The accepted node's mask predicted the token after the bonus: its top-K are the drafts.
    pending_ = std::get<1>(outcome.logits[row].topk(options_.num_branches));  // [K]
  } else {
    pending_ = pending_.narrow(0, 0, 0);
  }
  // m <- m + lambda (E[t] - m), once per generated token, in generation order.
  const float lam = static_cast<float>(options_.mask_lambda);
  if (lam > 0.0f && !outcome.new_tokens.empty()) {
    at::Tensor ids = at::tensor(outcome.new_tokens, at::kLong).to(embedding_.device());
    at::Tensor e = embedding_.index_select(0, ids).to(at::kFloat);  // [n_new, hidden]
    for (int64_t i = 0; i < e.size(0); ++i) mask_.add_(e[i] - mask_, lam);
  }
}

}  // namespace mtprobe
