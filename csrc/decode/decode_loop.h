// The decode loop: draft -> mask and positions -> one target forward -> verify -> compact KV.
//
// The loop owns the token sequence, the KV length and the step bookkeeping; the target model
// is reached through one callback (the HF adapter), which is the only Python in a step unless
// the user supplied logits processors, stopping criteria or a streamer.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "decode/tree_mask_builder.h"
#include "drafters/drafter.h"
#include "runtime/callbacks.h"

namespace mtprobe {

struct DecodeOptions {
  int64_t max_new_tokens = 0;
  std::vector<int64_t> eos_token_ids;
  int64_t max_positions = 0;     // positions must stay below this (the model's context)
  int64_t block_complexity = 0;  // most inputs of one decode forward
  int64_t kv_capacity = 0;       // first width of the mask buffer; it doubles when the prefix outgrows it
  int64_t vocab_size = 0;        // token ids a block may carry: [0, vocab_size); 0 = not checked
  at::ScalarType mask_dtype = at::kFloat;
  at::Device device = at::kCPU;
  bool incremental_masks = true;
  bool do_sample = false;  // sample matching instead of greedy matching
  // Pass a tree block's pattern as ancestor bits [1, 1, T, ceil(T / 64)] int64 instead of a dense
  // additive mask: for models running the "mtprobe_tree" attention (python/mtprobe/tree_attention.py).
  bool ancestor_bits = false;
  // Keep the row every new token was chosen from (HF's output_scores / output_logits): the scores after
  // the logits processors, and the raw logits, each as float32 on the device.
  bool keep_scores = false;
  bool keep_logits = false;
  // Greedy only: a step (the prefill included) whose verified rows (the accepted path's nodes: each decided
  // the token after it) include one with a top-2 score margin below this is run again through the exact
  // forward (the loop's exact_forward), which then decides it. 0: never. For a forward that differs from the
  // reference one by rounding (the target's C++ forward against HF's): a bound above that rounding makes
  // every token the reference forward's.
  double margin_bound = 0;
  // Sampling: the generator the loop's draws and its drafters' take (runtime/sampling_generator.h), e.g. a
  // row's own in a batch decoded together; none: torch's default generator for the device.
  std::optional<at::Generator> generator;
};

struct DecodeResult {
  std::vector<int64_t> sequence;        // prompt + generated
  std::vector<int64_t> accept_lengths;  // tokens gained per decode forward (prefill excluded)
  std::vector<int64_t> block_sizes;     // inputs T of each decode step's block (prefill excluded)
  int64_t forward_calls = 0;            // prefill included
  double total_seconds = 0, forward_seconds = 0, prefill_seconds = 0;
  int64_t mask_rebuilds = 0;
  // Steps whose drafts made the target's logits non-finite and were re-run without them.
  int64_t fallback_steps = 0;
  // Steps (the prefill included) whose verified rows had a top-2 margin below DecodeOptions::margin_bound and
  // that the exact forward decided: one more forward each, not counted in forward_calls (their time is in
  // forward_seconds, their verdict's read in host_reads).
  int64_t exact_steps = 0;
  int64_t kv_capacity = 0;    // KV entries per layer the cache held at the end (it grows on demand)
  int64_t mask_capacity = 0;  // prefix columns the mask buffer held at the end
  // Decode steps only (prefill excluded), depth d at index d - 1, depth counted from the last
  // committed node: draft nodes the drafters put at depth d, and steps whose verified path
  // reached depth d (the bonus token is not a draft and is not counted).
  std::vector<int64_t> drafted_per_depth;
  std::vector<int64_t> accepted_per_depth;
  std::string stop_reason;  // "eos", "max_new_tokens" or "stopping_criteria"
  // Device->host reads the loop itself made (prefill included), counted on every device, the CPU
  // too: greedy decoding and sample matching read once per forward (the targets and their scores),
  // when the drafter hands its drafts over on the host (DraftBlock::host_drafts). Drafters' own
  // reads and user callbacks (processors, criteria, streamers) are not counted.
  int64_t host_reads = 0;
  // With DecodeOptions::keep_scores / keep_logits: [new tokens, vocab] float32 on the device, row j what
  // new token j was chosen from (its node's processed scores / raw logits); undefined otherwise.
  at::Tensor scores;
  at::Tensor logits;
};

class DecodeLoop {
 public:
  DecodeLoop(std::shared_ptr<Drafter> drafter, ForwardFn forward, KvBuffersFn kv_buffers,
             DecodeOptions options, std::optional<ProcessFn> process = std::nullopt,
             std::optional<StopFn> stop = std::nullopt, std::optional<StreamFn> stream = std::nullopt,
             std::optional<ForwardFn> exact_forward = std::nullopt);

  // prompt: [L] int64. Runs prefill and decode steps until EOS, max_new_tokens or a stop.
  DecodeResult run(const at::Tensor& prompt);

 private:
  // What verification decided: the accepted path [root, ...], the token after it (the bonus) and
  // the scores every choice was made from. finite = false: some row of the block's logits was NaN
  // or +inf, and nothing else is set.
  struct Verdict {
    bool finite = true;
    std::vector<int64_t> path;
    int64_t bonus = -1;
    at::Tensor scores;  // [num_nodes - root, vocab] float32, row r = node root + r
    // Greedy with DecodeOptions::margin_bound: each row's top-2 score margin, row r = node root + r.
    std::vector<double> margins;
  };
  // Every block the drafter returns is checked before the forward: shapes, dtypes, devices,
  // token ranges and the tree; a drafter (Python ones included) cannot break the loop's invariants.
  void check_block(const DraftBlock& block, const at::Tensor& committed, const std::vector<int64_t>& tokens,
                   bool prefill) const;
  // The target's processed scores [num_nodes - root, vocab] (float32) after every node in
  // [root, num_nodes), each node's logits processors applied on that node's own prefix
  // (sequence + its path below the root).
  // tokens: the block's node tokens on the host.
  at::Tensor target_scores(const at::Tensor& logits, const DraftBlock& block,
                           const std::vector<int64_t>& tokens, int64_t root);
  Verdict verify(const at::Tensor& logits, const DraftBlock& block, const std::vector<int64_t>& tokens,
                 int64_t root);
  // The smallest top-2 margin of the verdict's score rows that decided a token (its path's nodes).
  double path_margin(const Verdict& verdict, int64_t root) const;
  // t on the host, counted in host_reads_ (a device->host copy on a GPU).
  at::Tensor read(const at::Tensor& t);
  // Appends tokens one by one with EOS / length / stopping checks; returns how many were kept.
  // scores: the verdict's scores; rows[j] is the row tokens[j] was chosen from.
  int64_t append(const std::vector<int64_t>& tokens, const at::Tensor& scores,
                 const std::vector<int64_t>& rows, DecodeResult& result);

  std::shared_ptr<Drafter> drafter_;
  ForwardFn forward_;
  KvBuffersFn kv_buffers_fn_;
  DecodeOptions options_;
  std::optional<ProcessFn> process_;
  std::optional<StopFn> stop_;
  std::optional<StreamFn> stream_;
  std::optional<ForwardFn> exact_forward_;
  std::vector<int64_t> sequence_;
  int64_t prompt_len_ = 0;
  bool finished_ = false;
  int64_t host_reads_ = 0;
};

}  // namespace mtprobe
