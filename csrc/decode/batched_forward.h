// One target forward per step for a batch of sequences (issue 68): each sequence keeps its own decode
// loop (drafter, verification, KV compaction), and the loops meet at their forwards.
//
// Why this shape: a decode step on a CPU streams every weight of the target from memory; B sequences
// decoded one after another stream them B times, in one forward once. The loops run on one thread each;
// a loop's forward (forward_for(row)) hands its block in and waits. When every loop still running has
// handed one in, the last to arrive runs TargetForward::forward_batch over all of them (their rows packed,
// each block attending over its own cache) and hands each loop its logits. A loop that finishes leaves
// (it no longer holds the others back), and one that runs a step elsewhere (HF's forward deciding a
// near-tie) simply arrives later. Everything else a loop does stays its own: the batch changes which
// forward computes a block's logits, not what verification makes of them.
//
// Each row's cache is its HF adapter's (mtprobe.target_model.cache.TreeKVCache) allocated at its full
// capacity before the loops start, so its buffers never move while they run.
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "decode/decode_loop.h"
#include "decode/target_forward.h"
#include "runtime/callbacks.h"

namespace mtprobe {

// One sequence of the batch: its cache (one key and one value buffer per layer, the layout
// TargetForward reads), the prefill's first row whose logits anyone reads (HFAdapter.prefill_logits_from),
// and a one-element bool tensor set once its prefill has run (HFAdapter.prefilled reads it: a self-draft
// takes the target's entries from then on), or undefined.
struct BatchRow {
  std::vector<at::Tensor> keys, values;
  int64_t prefill_logits_from = 0;
  at::Tensor prefilled;
};

class BatchedForward {
 public:
  BatchedForward(std::shared_ptr<TargetForward> target, std::vector<BatchRow> rows);

  // Row `row`'s forward, the ForwardFn its decode loop calls: (logits [T, vocab] float32, final hidden
  // states [T, hidden] in the model's dtype when asked). Blocks until the batch's forward has run.
  ForwardFn forward_for(int64_t row);

  // Runs loops[i].run(prompts[i]) on one thread each, loop i calling forward_for(i), until every loop has
  // stopped; their results in order. The first exception a loop raised is rethrown once all have stopped.
  std::vector<DecodeResult> run(const std::vector<DecodeLoop*>& loops,
                                const std::vector<at::Tensor>& prompts);

  int64_t rows() const { return static_cast<int64_t>(rows_.size()); }
  int64_t forwards() const { return forwards_; }  // batched forwards run so far

 private:
  using Output = std::tuple<at::Tensor, std::optional<at::Tensor>>;
  struct Pending {
    TargetBlock block;
    bool done = false;
    Output out;
    std::exception_ptr error;
  };
  Output submit(int64_t row, TargetBlock block);
  void leave(int64_t row);
  // With the lock held: when every live row has a block in, run them all and wake the waiting rows.
  void run_if_complete();

  std::shared_ptr<TargetForward> target_;
  std::vector<BatchRow> rows_;
  at::ScalarType hidden_dtype_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> live_;
  int64_t live_count_ = 0;
  std::vector<std::optional<Pending>> pending_;  // per row: the block it handed in, until it takes its output
  int64_t submitted_ = 0;                        // live rows with a block not yet run
  int64_t forwards_ = 0;
};

}  // namespace mtprobe
