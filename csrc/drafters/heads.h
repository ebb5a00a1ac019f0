// Probabilistic-circuit heads as a self-speculative drafter (seed 003, MTPC, App. D): one backbone
// call per step; the drafts come from a circuit over the next n tokens whose parameters a small head
// computes from the target's own last hidden state, so drafting reuses the verifier's forward.
//
// The window and the bonus token. After a step the loop knows, for the last accepted node at
// position t, its hidden state h_t and the token x_{t+1} sampled from the target there (the "bonus",
// the next step's root). The head maps h_t to q(x_{t+1} .. x_{t+n} | h_t); the drafter conditions it
// on the observed root, q(x_{t+2} .. | x_{t+1}) = q(x_{t+1} ..) / q(x_{t+1}), and drafts from that:
// up to n - 1 tokens deep. A mixture's posterior over its latent states thus already knows the root
// (the paper's Alg. 2 instead drops the target's token after a rejection; conditioning keeps it).
//
// Draft trees, within the block-complexity budget:
//   - greedy: best first by the conditional probability of the whole path (the dynamic draft tree
//     of seed 001, scored by the circuit): pop the best candidate, add it, push its best children by
//     their exact conditionals (csrc/core/circuit.h, candidate_log_probs). Children come from a
//     shortlist per window position, the union over latent states of each state's budget-many most
//     likely tokens (computed once per step), so an expansion costs O(r * shortlist), not O(r V);
//   - sampling: `top_branches` independent windows, each drawn token by token from the circuit's
//     conditionals, as chains below the root. The first tokens are i.i.d. draws of one distribution
//     (SpecInfer's multi-draft rule keeps the rejection sampling exact, csrc/core/verify.h) and every
//     draft node carries the exact q it was drawn from (DraftBlock::draft_probs);
//   - EntMTP (seed 002), greedy and sampling alike: a bank of static trees by child rank
//     (core/topology.h), one chosen per step by the policy. Node (r_1, .., r_d) drafts the r_d-th
//     most probable token of q(. | root, the tokens of node (r_1, .., r_{d-1})'s path), ranked over
//     the shortlist of width HeadsDrafter::bank_width(). The shape is fixed, the tokens change, and
//     the drafts are deterministic (under sampling the loop verifies them by sample matching).
//     With `record`, every step logs the true continuation's child ranks, computed once its tokens
//     are known (at most window - 1 steps later): what mtprobe.offline.topology.build_bank reads.
//
// The head itself is a callback (Python: mtprobe.heads.CircuitHead), so a trained torch module is
// used as is; everything after its parameters — conditioning, the tree, the draws — is here.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/circuit.h"
#include "core/topology.h"
#include "drafters/drafter.h"

namespace mtprobe {

// head(hidden [a, hidden], logits [vocab], prefix_len) -> {weights, transitions, emissions}: the
// circuit's parameters as log-probabilities in the layouts of csrc/core/circuit.h (FF: weights and
// transitions empty, emissions [n, V]; CP: [r], empty, [r, n, V]; HMM and BTree: [r], [L - 1, r, r],
// [n, r, V]). hidden: with HeadsOptions::committed_rows, the rows of every token the step committed,
// in order (the block's committed chain, then the accepted drafts; positions prefix_len ..), so a
// head with draft layers of its own (LoRA, mtprobe/heads/lora.py) can run them over each committed token
// once; otherwise only the last of them ([1, hidden], a view: no gather). The last row is the
// context the window starts after. logits: the target's raw logits at that last node (the head may
// build on them).
// A head restricted to part of the vocabulary may return a fourth tensor, columns [N] (ascending
// token ids in [0, V)): its emissions then hold only those N columns (V above reads N) and every
// other token has probability 0. The drafter runs the circuit over the N columns and maps its drafts
// back to token ids: the same trees as with -inf over the rest of V, for O(N) instead of O(V) a step.
using HeadFn = std::function<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t)>;

struct HeadsOptions {
  std::string circuit = "cp";   // "ff", "cp", "hmm" or "btree"
  int64_t window = 4;           // n: tokens the circuit covers, the root included (drafts <= n - 1 deep)
  int64_t rank = 1;             // r: latent states (1 for FF)
  int64_t vocab = 0;            // V
  bool do_sample = false;       // sampled chains with draft_probs (else the greedy best-first tree)
  int64_t top_branches = 1;     // chains under sampling
  bool committed_rows = false;  // hand the head every committed row (draft layers), not just the last
  // Greedy tree: drafts whose path probability q(path | root) under the circuit is below this are
  // left out, so a confident step verifies fewer inputs (0: the tree fills the budget).
  double min_path_prob = 0.0;
  // EntMTP: a non-empty bank replaces the best-first tree and the sampled chains.
  std::vector<core::Topology> bank;
  core::TopologyPolicy policy;
  std::string feature = "path_value";  // path_value | top1 | entropy | accept (core::TopologyFeatures)
  double ema = 0.5;                    // weight of the newest step in the entropy and accept EMAs
  bool record = false;                 // log every step's true child ranks and features
};

class HeadsDrafter : public Drafter {
 public:
  HeadsDrafter(HeadFn head, HeadsOptions options);

  std::string name() const override { return "heads"; }
  void begin(const at::Tensor& prompt) override;
  DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) override;
  void observe(const StepOutcome& outcome) override;
  bool wants_hidden_states() const override { return true; }

  int64_t head_calls() const { return head_calls_; }

  // EntMTP mode: the bank tree each decode step drafted (-1: none), and with `record`, per step with a
  // head window: the next root's position in the sequence, the true continuation's child ranks
  // [window - 1] (-1: not among the shortlist, past the sequence's end, or below a miss), the
  // features, and the tree the policy chose from them.
  bool uses_bank() const { return !options_.bank.empty(); }
  // Candidates per window position the bank trees are filled from (and ranks are counted among).
  int64_t bank_width() const { return bank_width_; }
  const std::vector<int64_t>& tree_choices() const { return tree_choices_; }
  struct StepRecord {
    int64_t position = 0;
    std::vector<int64_t> ranks;  // [window - 1]
    core::TopologyFeatures features;
    int64_t tree = 0;
  };
  // The records so far; the steps whose continuation is still incomplete are ranked over the tokens known.
  std::vector<StepRecord> step_log() const;

 private:
  // The greedy tree below the root: tokens (emission columns) and parents (-1: the root) of at most
  // `max_nodes` drafts.
  void greedy_tree(const core::Circuit<float>& circuit, int64_t max_nodes, int64_t depth,
                   std::vector<int64_t>& tokens, std::vector<int64_t>& parents) const;

  // A step of the bank's record whose continuation is still being generated.
  struct Pending {
    StepRecord record;
    std::vector<at::Tensor> params;               // the step's circuit parameters
    std::vector<int64_t> columns;                 // their emission columns' token ids (empty: all V)
    std::vector<std::vector<int64_t>> shortlist;  // its shortlist (columns)
    int64_t root = -1;                            // the root's column, -1 when the head cannot emit it
    std::vector<int64_t> continuation;            // the tokens after the root, so far (token ids)
  };

  // The circuit of a head output over `columns` emission columns (each size checked; std::invalid_argument).
  core::Circuit<float> circuit(const std::vector<at::Tensor>& params, int64_t columns) const;
  // Emission columns <-> token ids of the last head output (columns_ empty: the whole vocabulary).
  int64_t num_columns() const;
  int64_t token_of(int64_t column) const { return columns_.empty() ? column : columns_[column]; }
  // Per window position i >= 1: the union over latent states of each state's `width` most likely
  // tokens, ascending token ids (position 0, the root, is left empty).
  std::vector<std::vector<int64_t>> make_shortlist(int64_t width) const;
  // The `want` most probable next tokens after `prefix` among `cand`, best first (ties: lower index),
  // with their log-probabilities; tokens of probability 0 are left out.
  static void ranked_children(const core::Circuit<float>& circuit, const std::vector<int64_t>& prefix,
                              const std::vector<int64_t>& cand, int64_t want, std::vector<int64_t>& tokens,
                              std::vector<float>& log_probs);
  // The bank tree's tokens as emission columns ([nodes], the root first) for this step, or empty when
  // a node has no candidate.
  std::vector<int64_t> fill_bank_tree(const core::Topology& t) const;
  // EntMTP after a head call: features, the next tree, and the record.
  void bank_observe(const StepOutcome& outcome, const core::Circuit<float>& circuit);
  // The child ranks of a pending step's continuation (the tokens known so far).
  std::vector<int64_t> true_ranks(const Pending& p) const;
  // The step's new tokens into the pending records; the complete ones (or all, at the end) logged.
  void advance_records(const StepOutcome& outcome);

  HeadFn head_;
  HeadsOptions options_;
  core::CircuitStructure structure_;  // over the whole vocabulary
  // Over the column count the last restricted head output had (remade when the count changes).
  core::CircuitStructure columns_structure_;
  std::vector<at::Tensor> params_;  // the last head output (CPU float32, contiguous), or empty
  std::vector<int64_t> columns_;    // its emission columns' token ids, ascending (empty: all V)
  at::Tensor columns_tensor_;       // the same [N] (int64), for scattering a sampled q back to [V]
  int64_t bonus_ = -1;              // the token the params' window starts with (the next root)
  int64_t root_ = -1;               // its column, -1 when the head gives it probability 0 (no drafts)
  int64_t head_calls_ = 0;
  // EntMTP state.
  int64_t bank_width_ = 0;
  std::vector<std::vector<int64_t>> shortlist_;  // of params_, in bank mode
  int64_t current_tree_ = 0;
  core::TopologyFeatures features_;
  std::vector<int64_t> tree_choices_;
  std::vector<StepRecord> records_;
  std::vector<Pending> pending_;
};

}  // namespace mtprobe
