// Mask-token probing (seed 001, sections 2-3).
//
// A mask token is an embedding, not a vocabulary entry. Every input node of a step carries k
// chained mask tokens: m_j sits at position p + j of its node p, attends to the node's path and
// to m_1..m_{j-1}, and its logits predict the token j + 1 places after the node. Whichever node
// verification accepts, its masks already hold the next step's k next-token distributions: depth
// d of the next draft tree draws from m_d. Block complexity BC = (k + 1)(1 + sum K_i) (Eq. 6).
//
// Masks start from the prompt (mean of its embeddings, or its last k embeddings), from a Gaussian
// fitted to the embedding table, optionally shifted out of distribution, or from masks learned once
// per model (calibrated, python/mtprobe/offline/calibrate.py: the first k rows), and follow the generated
// tokens: m <- m + lambda (E[t] - m) after every new token t (Eq. 4).
//
// With a mask value (beyond seed 001) only the nodes a step is likely to end at carry masks
// (core::plan_mask_carriers) and the inputs that frees take more drafts. A step that ends at a node
// without masks reads its nearest masked ancestor's deeper masks instead: ancestor u, s nodes above
// the end, has m_j at position p_u + j, so its m_{s+1..k} predict depths 1..k - s of the next tree.
// Example, k = 2: root r carries masks, r -> a accepted, a carries none, bonus b: the next tree hangs
// from b with one depth, from r's m_2 (which predicted the token after b).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/draft_tree.h"
#include "core/topology.h"
#include "drafters/drafter.h"

namespace mtprobe {

struct MaskProbeOptions {
  int64_t num_masks = 1;                  // k, 1..4
  int64_t block_complexity = 30;          // BC
  bool dynamic_tree = false;              // Alg. 1 instead of static branches
  std::vector<int64_t> branches;          // static [K_1..K_k], Top-1 expansion
  bool prune = true;                      // skip children equal to their parent or the root (section 3.5)
  std::string mask_init = "prompt_mean";  // prompt_mean | prompt_last | gaussian | calibrated
  double gaussian_shift = 0.0;            // gaussian mean = mu + shift * sigma (OOD stress: 5, 10)
  at::Tensor initial_masks;  // calibrated: [>= k, hidden] learned masks (mtprobe.offline.calibrate)
  double mask_lambda = 0.1;  // in [0, 1]; 0 keeps the initial masks
  int64_t seed = 0;          // for gaussian masks
  int64_t tree_nodes = 0;    // dynamic tree's most nodes, root included (0: B); the hybrid plans more
  // >= 0: masks only where a step is likely to end, valued at this many next-step tokens
  // (core::plan_mask_carriers; needs the dynamic tree, whose nodes default to BC - k); < 0: on every node.
  double mask_value = -1.0;
  // EntMTP (seed 002): static trees by child rank (core/topology.h), one chosen per step by the
  // policy from a confidence score. A non-empty bank replaces `branches`.
  std::vector<core::Topology> bank;
  core::TopologyPolicy policy;
  std::string feature = "path_value";  // path_value | top1 | entropy | accept (core::TopologyFeatures)
  double ema = 0.5;                    // weight of the newest step in the entropy and accept EMAs
  bool record = false;                 // keep every step's candidates and features (frontier building)
};

class MaskProbeDrafter : public Drafter {
 public:
  // embedding: [vocab, hidden], the target's input embedding table (not copied).
  MaskProbeDrafter(at::Tensor embedding, MaskProbeOptions options);

  std::string name() const override { return "mask_probe"; }
  void begin(const at::Tensor& prompt) override;
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override;
  void observe(const StepOutcome& outcome) override;

  // The two halves of propose(), for drafters that add nodes of their own (the hybrid drafter):
  // the tree drafted from the last accepted node's masks ([root, ...], empty without candidates),
  // and the block for a tree ([root, ...] over the last committed token, parents first): its
  // drafts, then k chained masks on the root and on every draft. observe() reads the masks of
  // whichever node the step accepted.
  std::vector<core::DraftNode> candidate_tree(int64_t root_token, const StepLimits& limits) const;
  // carries: which tree nodes get masks (core::plan_mask_carriers); none given: every node.
  DraftBlock block_with_masks(const at::Tensor& committed, std::vector<core::DraftNode> tree,
                              const StepLimits& limits, const std::vector<bool>* carries = nullptr);

  // The token the next propose() hangs its tree from: the last token the last observe() saw
  // appended (known on the host, so no read of `committed`), or -1 before any.
  int64_t next_root() const { return next_root_; }
  // The root of a one-token committed chain, from the host when observe() saw it (no device read).
  int64_t root_of(const at::Tensor& committed) const;

  const at::Tensor& mask_embeddings() const { return masks_; }
  const MaskProbeOptions& options() const { return options_; }
  // B = BC / (k + 1): the most tree nodes, root included, when every node carries k masks.
  int64_t budget_nodes() const { return options_.block_complexity / (options_.num_masks + 1); }
  // The dynamic tree's most nodes, root included: tree_nodes, else B.
  int64_t tree_nodes() const { return options_.tree_nodes > 0 ? options_.tree_nodes : budget_nodes(); }

  // EntMTP mode: the bank tree each decode step drafted (-1: none, e.g. no candidates yet), and with
  // `record`, per step that produced candidates: the next root's position in the sequence, the
  // candidates [k * m], the features, and the tree the policy chose from them.
  bool uses_bank() const { return !options_.bank.empty(); }
  const std::vector<int64_t>& tree_choices() const { return tree_choices_; }
  int64_t candidate_width() const { return cand_width_; }
  const std::vector<int64_t>& log_positions() const { return log_positions_; }
  const std::vector<int64_t>& log_tokens() const { return log_tokens_; }
  const std::vector<core::TopologyFeatures>& log_features() const { return log_features_; }
  const std::vector<int64_t>& log_trees() const { return log_trees_; }

 private:
  at::Tensor embedding_;  // [vocab, hidden]
  MaskProbeOptions options_;
  at::Generator generator_;
  at::Tensor masks_;                  // [k, hidden] float32 running mask embeddings
  int64_t cand_width_ = 0;            // m: candidates kept per depth
  std::vector<int64_t> cand_tokens_;  // static trees: [k * m] candidates per depth, best first
  std::vector<float> cand_probs_;     // [k * m]
  at::Tensor tree_;                   // dynamic trees: [3, budget] tokens, parents, probs (float64)
  int64_t tree_root_ = -1;            // the root tree_ was expanded for
  int64_t next_root_ = -1;            // the last token observe() saw appended
  bool have_candidates_ = false;
  std::vector<int64_t> mask_input_of_node_;  // node -> input index of its m_1, or -1
  // EntMTP state.
  int64_t current_tree_ = 0;
  core::TopologyFeatures features_;
  std::vector<int64_t> tree_choices_;
  std::vector<int64_t> log_positions_, log_tokens_, log_trees_;
  std::vector<core::TopologyFeatures> log_features_;

  void update_features(const StepOutcome& outcome, double top1, double entropy);
};

}  // namespace mtprobe
