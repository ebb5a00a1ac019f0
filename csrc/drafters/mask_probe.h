// Mask-token probing (seed 001, sections 2-3), one mask token per node.
//
// The mask token m is an embedding, not a vocabulary entry. Placed right after a node, at the
// position the node's next token will take, the model's output at m predicts the token after
// that one. Every input node carries one mask, so whichever node verification accepts, its mask
// already holds the next step's draft: the top-K tokens of its logits become the children of
// the next root. With k = 1 mask, block complexity BC = (1 + 1)(1 + K) (Eq. 6): K = BC/2 - 1.
//
// m starts as the mean of the prompt's input embeddings and follows the generated tokens:
// m <- m + lambda (E[t] - m) after every new token t (Eq. 4).
#pragma once

#include "drafters/drafter.h"

namespace mtprobe {

struct MaskProbeOptions {
  int64_t num_branches = 14;  // K: draft children of the root per step
  double mask_lambda = 0.1;   // lambda of the running update, in [0, 1]
};

class MaskProbeDrafter : public Drafter {
 public:
  // embedding: [vocab, hidden], the target's input embedding table (not copied).
  MaskProbeDrafter(at::Tensor embedding, MaskProbeOptions options);

  std::string name() const override { return "mask_probe"; }
  void begin(const at::Tensor& prompt) override;
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override;
  void observe(const StepOutcome& outcome) override;

  const at::Tensor& mask_embedding() const { return mask_; }
  const MaskProbeOptions& options() const { return options_; }

 private:
  at::Tensor embedding_;  // [vocab, hidden]
  MaskProbeOptions options_;
  at::Tensor mask_;       // [hidden] float32 running mask embedding
  at::Tensor pending_;    // [K'] int64 drafts for the next root (from the accepted node's mask)
  std::vector<int64_t> mask_input_of_node_;  // node index -> input index of its mask, or -1
};

}  // namespace mtprobe
