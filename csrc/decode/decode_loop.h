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

namespace mtprobe {

// forward(tokens [n_tok], embeds [n_emb, hidden]?, position_ids [1, T], mask [1, 1, T, P + T]?,
//         prefix_len P, want_hidden) -> (logits [T, vocab], hidden [T, hidden]?)
// The callee must set its KV cache length to P before the forward, append the T new entries,
// and keep them until the next call (the loop compacts them in place through kv_buffers).
using ForwardFn = std::function<std::tuple<at::Tensor, std::optional<at::Tensor>>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const std::optional<at::Tensor>&,
    int64_t, bool)>;
// Every KV tensor [batch, heads, capacity, head_dim] of the cache, valid after the first forward.
using KvBuffersFn = std::function<std::vector<at::Tensor>()>;
// process(ids [n, L], scores [n, vocab] float32) -> processed scores: HF logits processors.
using ProcessFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;
// stop(ids [1, L]) -> true when user stopping criteria end the sequence.
using StopFn = std::function<bool(const at::Tensor&)>;
// stream(new_tokens [n]) after every step.
using StreamFn = std::function<void(const at::Tensor&)>;

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
  // The target's own choice after every node in [root, num_nodes), each node's processors
  // applied on that node's own prefix (sequence + its path): the argmax under greedy decoding, a
  // sample of the processed distribution under sampling.
  std::vector<int64_t> target_choices(const at::Tensor& logits, const DraftBlock& block, int64_t root);
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
