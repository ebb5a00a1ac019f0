// The hybrid drafter (seed 001, App. C, future work there): mask-token probing and STAND's n-gram
// store draft one tree together, under one block-complexity budget.
//
// Each decode step both sources draft a tree from the same root: probing's from the masks of the
// last accepted node (csrc/drafters/mask_probe.h), STAND's from the store after the history
// (csrc/drafters/stand.h), each node scored by its cumulative probability. The union keeps the best
// B - 1 nodes, B = BC / (k + 1) (core::merge_draft_trees), and, as in probing, every node carries k
// mask tokens, so whichever node is accepted yields the next step's probing candidates. With a
// mask value, masks go only where the step is likely to end and the inputs they free take more
// drafts (core::plan_mask_carriers): a node inside a confident n-gram chain rarely ends the step.
// n-gram nodes reach deeper than k (copied text, up to STAND's max_depth); probing supplies the
// breadth where the store knows nothing. Both learn from every step: the masks follow the output,
// the store takes the logits of every accepted node. A cross-request memory (StandOptions::memory)
// works as in STAND: read where the store has no key, fed each finished generation's text.
// grow_probed: instead of a union of two separate trees, one best-first tree over probing's nodes
// and the store's, the store drafting below probed tokens too (core::SeedTree): a probed token the
// store did not predict gets the store's continuation after it, not a dead end.
#pragma once

#include <memory>

#include "drafters/mask_probe.h"
#include "drafters/stand.h"

namespace mtprobe {

class HybridDrafter : public Drafter {
 public:
  // probe: options of the probing half (its dynamic tree and budget BC / (k + 1) are the hybrid's);
  // stand: options of the n-gram half. mask_value < 0: every node carries masks (B - 1 drafts);
  // >= 0: drafts and masks share the BC inputs as core::plan_mask_carriers weighs them.
  // grow_probed: the store drafts below probed nodes (above); false: seed 001's union.
  HybridDrafter(at::Tensor embedding, MaskProbeOptions probe, StandOptions stand, double mask_value = -1.0,
                bool grow_probed = false);

  std::string name() const override { return "hybrid"; }
  void begin(const at::Tensor& prompt) override;
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override;
  void observe(const StepOutcome& outcome) override;

  // Drafts of the last decode step from each source: probing's tree as offered; the store's own
  // tree (union: a node both drafted counts twice) or, with grow_probed, the block's nodes outside
  // probing's tree.
  int64_t probe_nodes() const { return probe_nodes_; }
  int64_t ngram_nodes() const { return ngram_nodes_; }

 private:
  MaskProbeDrafter probe_;
  StandDrafter stand_;
  int64_t stand_depth_;
  double mask_value_;
  bool grow_probed_;
  int64_t probe_nodes_ = 0;
  int64_t ngram_nodes_ = 0;
};

}  // namespace mtprobe
