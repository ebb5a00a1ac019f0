// The callbacks through which C++ reaches Python: the model forward, its KV cache, HF's logits
// processors, stopping criteria and streamers. Shared by the decode loop and the drafters that run
// a model of their own (draft-model speculative decoding).
//
// csrc/runtime/ is the layer of ATen-level types that both drafters/ and decode/ use: above core/,
// kernels/ and ops/, below drafters/ (tests/test_csrc_layers.py keeps the order).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <tuple>
#include <vector>

namespace mtprobe {

// forward(tokens [n_tok], embeds [n_emb, hidden]?, position_ids [1, T], mask [1, 1, T, P + T]?,
//         prefix_len P, want_hidden) -> (logits [T, vocab], hidden [T, hidden]?)
// The callee must set its KV cache length to P before the forward, append the T new entries,
// and keep them until the next call (the loop compacts them in place through kv_buffers). It may
// grow its cache to fit P + T entries (HFAdapter doubles it); the loop then fetches the buffers
// again, noticing the growth by their capacity.
using ForwardFn = std::function<std::tuple<at::Tensor, std::optional<at::Tensor>>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const std::optional<at::Tensor>&,
    int64_t, bool)>;
// Every KV tensor [batch, heads, capacity, head_dim] of the cache, valid after the first forward.
using KvBuffersFn = std::function<std::vector<at::Tensor>()>;
// process(ids [n, L], scores [n, vocab] float32) -> processed scores: HF logits processors.
using ProcessFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;
// stop(ids [1, L], scores [1, vocab] float32) -> true when user stopping criteria end the sequence.
// scores: the processed scores the last token of ids was chosen from, as HF greedy passes them.
using StopFn = std::function<bool(const at::Tensor&, const at::Tensor&)>;
// stream(new_tokens [n]) after every step.
using StreamFn = std::function<void(const at::Tensor&)>;

}  // namespace mtprobe
