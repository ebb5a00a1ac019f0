// The drafter interface: one contract for every way of proposing tokens.
//
// Each decode step the loop hands the drafter the committed tokens that are not yet in the KV
// cache (the prompt at prefill; the last generated token, "the root", afterwards) and asks for a
// DraftBlock: the exact inputs of the next target forward. The block is laid out as
//
//     [ committed chain | draft nodes | auxiliary inputs ]
//       tokens[0 : num_committed]        verified? no, they are already decided
//       tokens[num_committed : num_nodes] the draft tree; verification may accept a root path
//       the rest                          inputs only the drafter reads (never accepted)
//
// Token-valued inputs come first (`tokens`), then embedding-only inputs (`embeds`), so the
// model sees inputs_embeds = cat(E[tokens], embeds). `parents` spans all T inputs and defines
// attention and positions (csrc/core/tree.h): input i attends to the prefix, its ancestors and
// itself, at position prefix_len + depth(i). Auxiliary inputs are tree nodes too: lookahead's
// Jacobi window is a comb hanging from the root (csrc/core/lookahead.h).
//
// How the drafters of the roadmap fit:
//   - mask-token probing: drafts from the last step's mask logits, one embedding-only mask input
//     per node (aux), reads their logits in observe();
//   - prompt lookup / n-gram / STAND: only draft nodes, built from the token history;
//   - lookahead: n-gram guesses as draft nodes, the Jacobi window as aux token inputs; reads the
//     window's logits in observe();
//   - draft model: runs its own model and KV cache inside propose(), rolls it back in observe();
//   - Medusa-style or probabilistic-circuit heads: wants_hidden_states() = true, reads the
//     target's last hidden state of the accepted node in observe().
// Under sampling, a drafter that samples its drafts sets `draft_probs` (q of every draft node) and
// verification is rejection sampling (csrc/core/verify.h); without it, sample matching.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace mtprobe {

struct DraftBlock {
  at::Tensor tokens;                 // [num_token_inputs] int64, on the model's device
  std::optional<at::Tensor> embeds;  // [num_embed_inputs, hidden] in the model dtype, or none
  std::vector<int64_t> parents;      // [T] over all inputs, tokens first then embeds
  int64_t num_committed = 1;         // committed chain length (prompt length at prefill, 1 after)
  int64_t num_nodes = 1;             // committed + draft nodes; inputs past this are auxiliary
  // [num_nodes - num_committed, vocab] float32: row j is the distribution draft node num_committed + j
  // was drawn from (siblings: independent draws from one distribution). Read only under sampling.
  std::optional<at::Tensor> draft_probs;
  // The token inputs past the committed chain, on the host, when the drafter built them there
  // (token_block does): the loop then walks them without reading `tokens` back from the device.
  // They count only while `tokens` is still host_of (the tensor they were made with, whose first
  // inputs are committed_of, the committed tensor the loop handed over); else the loop reads `tokens`
  // (one device->host copy), so a block edited afterwards is checked as it is.
  std::vector<int64_t> host_drafts;
  at::Tensor host_of;
  at::Tensor committed_of;

  int64_t num_inputs() const { return static_cast<int64_t>(parents.size()); }
  // tokens = [committed | drafts], the drafts also kept on the host.
  void set_tokens(const at::Tensor& committed, std::vector<int64_t> drafts) {
    tokens = drafts.empty() ? committed
                            : at::cat({committed, at::tensor(drafts, at::kLong).to(committed.device())});
    host_drafts = std::move(drafts);
    host_of = tokens;
    committed_of = committed;
  }
  // Whether the token inputs past `committed` are known on the host without a read: tokens is
  // committed itself, or still the tensor host_drafts were made with, starting with committed.
  bool drafts_on_host(const at::Tensor& committed) const {
    if (tokens.is_same(committed)) return true;
    return host_of.defined() && tokens.is_same(host_of) && committed_of.is_same(committed) &&
           static_cast<int64_t>(host_drafts.size()) == tokens.size(0) - committed.size(0);
  }
};

// Every tensor of `parts` flattened, as float64, on the host in one read: a drafter's candidates
// (token ids, exact below 2^53) and their probabilities come back together.
inline at::Tensor read_as_double(const std::vector<at::Tensor>& parts) {
  std::vector<at::Tensor> flat;
  for (const auto& t : parts) flat.push_back(t.reshape({-1}).to(at::kDouble));
  return at::cat(flat).cpu().contiguous();
}

// The block [committed chain | drafts | auxiliary inputs] of a drafter whose inputs are all
// tokens: tokens[i] hangs from input parents[i] of this list, -1 meaning the last committed input;
// the first num_drafts are draft nodes, the rest auxiliary (-1: all of them are drafts).
inline DraftBlock token_block(const at::Tensor& committed, const std::vector<int64_t>& tokens,
                              const std::vector<int64_t>& parents, int64_t num_drafts = -1) {
  const int64_t c = committed.size(0), n = static_cast<int64_t>(tokens.size());
  DraftBlock b;
  b.num_committed = c;
  b.num_nodes = c + (num_drafts < 0 ? n : num_drafts);
  b.set_tokens(committed, tokens);
  b.parents.resize(static_cast<size_t>(c + n));
  for (int64_t i = 0; i < c; ++i) b.parents[i] = i - 1;  // the committed chain
  for (int64_t j = 0; j < n; ++j) b.parents[c + j] = parents[j] < 0 ? c - 1 : c + parents[j];
  return b;
}

// What one step decided, handed back to the drafter.
struct StepOutcome {
  int64_t prefix_len = 0;           // KV length before the step's forward
  std::vector<int64_t> path;        // accepted input indices: [last committed, accepted drafts...]
  std::vector<int64_t> new_tokens;  // tokens appended this step (accepted drafts + bonus), in order
  // [T, vocab] raw target logits of every input of the block. Undefined for a step verified outside
  // the loop (a serving engine's: mtprobe.vllm), which hands back tokens only: drafters that learn from
  // the target's distributions (STAND) then learn the text; those that need them (probing) are not hosted.
  at::Tensor logits;
  std::optional<at::Tensor> hidden;  // [T, hidden] last hidden states, when wants_hidden_states()
  bool finished = false;             // the sequence ended inside this step
  // The drafter's block is not what ran. Either its drafts or auxiliary inputs made the target's
  // logits non-finite and the loop re-ran the committed chain alone (logits then hold only those c
  // rows, path is [c - 1]), or a scheduling drafter (drafters/auto.h) ran another drafter's block,
  // a cut of this one, or the committed chain alone. Either way path, new_tokens and the logits
  // rows the path names belong to the block that ran; this drafter's own inputs past the
  // committed chain may not have run and must not be read.
  bool block_replaced = false;
};

// Limits the loop imposes on a step's block.
struct StepLimits {
  int64_t budget = 0;       // most inputs one decode forward may take (the block complexity)
  int64_t max_depth = 0;    // deepest allowed depth below prefix_len (positions must fit the model)
  int64_t tokens_left = 0;  // new tokens still wanted, including this step's
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::string name() const = 0;
  // A new sequence starts: reset all state. prompt: [L] int64.
  virtual void begin(const at::Tensor& prompt) = 0;
  // The next forward's inputs. committed: [c] int64, the chain not yet in the KV cache.
  virtual DraftBlock propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) = 0;
  // The step's verdict. Called after every forward, prefill included.
  virtual void observe(const StepOutcome& outcome) = 0;
  virtual bool wants_hidden_states() const { return false; }
  // Whether observe() can learn a step from its tokens alone (StepOutcome::logits undefined), as from a step
  // verified elsewhere: the scheduling drafter then spares it the logits of steps it had no block in.
  virtual bool learns_from_text() const { return false; }
};

}  // namespace mtprobe
