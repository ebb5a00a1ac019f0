// Plain decoding through mtprobe's own loop: no drafts, one input (the last committed token) per
// decode step. The baseline mtprobe's drafters are measured against on the same loop, KV cache and
// linear routes; its output is HF greedy's (or HF sampling's) by construction.
#pragma once

#include "drafters/drafter.h"

namespace mtprobe {

class PlainDrafter : public Drafter {
 public:
  std::string name() const override { return "plain"; }
  void begin(const at::Tensor& prompt) override { (void)prompt; }
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override;
  void observe(const StepOutcome& outcome) override { (void)outcome; }
};

}  // namespace mtprobe
