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

#include "decode/callbacks.h"
#include "decode/tree_mask_builder.h"
#include "drafters/drafter.h"

namespace mtprobe {

struct DecodeOptions {
  int64_t max_new_tokens = 0;
  std::vector<int64_t> eos_token_ids;
  int64_t max_positions = 0;     // positions must stay below this (the model's context)
  int64_t block_complexity = 0;  // most inputs of one decode forward
  int64_t kv_capacity = 0;       // KV slots the cache holds
  at::ScalarType mask_dtype = at::kFloat;
  at::Device device = at::kCPU;
  bool incremental_masks = true;
  bool do_sample = false;  // sample matching instead of greedy matching
  // Pass a tree block's pattern as ancestor bits [1, 1, T, ceil(T / 64)] int64 instead of a dense
  // additive mask: for models running the "mtprobe_tree" attention (python/mtprobe/tree_attention.py).
  bool ancestor_bits = false;
};

struct DecodeResult {
  std::vector<int64_t> sequence;        // prompt + generated
  std::vector<int64_t> accept_lengths;  // tokens gained per decode forward (prefill excluded)
  int64_t forward_calls = 0;            // prefill included
  double total_seconds = 0, forward_seconds = 0, prefill_seconds = 0;
  int64_t mask_rebuilds = 0;
  std::string stop_reason;  // "eos", "max_new_tokens" or "stopping_criteria"
};

class DecodeLoop {
 public:
  DecodeLoop(std::shared_ptr<Drafter> drafter, ForwardFn forward, KvBuffersFn kv_buffers,
             DecodeOptions options, std::optional<ProcessFn> process = std::nullopt,
             std::optional<StopFn> stop = std::nullopt, std::optional<StreamFn> stream = std::nullopt);

  // prompt: [L] int64. Runs prefill and decode steps until EOS, max_new_tokens or a stop.
  DecodeResult run(const at::Tensor& prompt);

 private:
  // The target's processed scores [num_nodes - root, vocab] (float32) after every node in
  // [root, num_nodes), each node's logits processors applied on that node's own prefix
  // (sequence + its path below the root).
  // tokens: the block's node tokens on the host.
  at::Tensor target_scores(const at::Tensor& logits, const DraftBlock& block,
                           const std::vector<int64_t>& tokens, int64_t root);
  // Verification from the root: the accepted path [root, ...] and the token after it (the bonus).
  std::pair<std::vector<int64_t>, int64_t> verify(const at::Tensor& logits, const DraftBlock& block,
                                                  const std::vector<int64_t>& tokens, int64_t root);
  // Appends tokens one by one with EOS / length / stopping checks; returns how many were kept.
  int64_t append(const std::vector<int64_t>& tokens, DecodeResult& result);

  std::shared_ptr<Drafter> drafter_;
  ForwardFn forward_;
  KvBuffersFn kv_buffers_fn_;
  DecodeOptions options_;
  std::optional<ProcessFn> process_;
  std::optional<StopFn> stop_;
  std::optional<StreamFn> stream_;
  std::vector<int64_t> sequence_;
  int64_t prompt_len_ = 0;
  bool finished_ = false;
};

}  // namespace mtprobe
