// One target forward per step for a batch of sequences (issue 68): each sequence keeps its own decode
// loop (drafter, verification, KV compaction), and the loops meet at their forwards.
//
// Why this shape: a decode step on a CPU streams every weight of the target from memory; B sequences
// decoded one after another stream them B times, in one forward once. The loops run on one thread each;
// a loop's forward (forward_for(row)) hands its block in and waits. When every loop still running has
// handed one in, run()'s thread runs TargetForward::forward_batch over all of them (their rows packed,
// each block attending over its own cache), or where the C++ forward does not run a BatchForwardFn (HF's
// modules on a KV buffer with a row axis, the rows padded to one block), and hands each loop its logits. A
// loop that finishes leaves (it no longer holds the others back), and one that runs a step elsewhere (HF's
// forward deciding a near-tie) simply arrives later. Everything else a loop does stays its own: the batch
// changes which forward computes a block's logits, not what verification makes of them.
//
// Each row's cache is its HF adapter's (mtprobe.target_model.cache.TreeKVCache) allocated at its full
// capacity before the loops start (with a BatchForwardFn, views of the batch plan's buffers), so its
// buffers never move while they run.
//
// The quantized self-draft's one-token forwards meet the same way (draft_step): a row whose drafter runs
// one hands in its token and its draft cache and waits; once every live row waits (on a draft step or on
// the target), the draft steps run first, one QuantizedDecoder::step_rows per decoder for all of them, so
// B rows drafting read the 4-bit weights once per depth instead of B times. The target's forward runs
// once no row is drafting any more: rows at the same depth of their chains draft together.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "decode/decode_loop.h"
#include "decode/quantized_decoder.h"
#include "decode/target_forward.h"
#include "runtime/batch_drafting.h"
#include "runtime/callbacks.h"
#include "runtime/shared_seconds.h"

namespace mtprobe {

// The batch's forward through another forward than TargetForward (HF's modules on a batched KV plan:
// python/mtprobe/target_model/batch_plan.py): the blocks handed in, each naming its row, and their
// (logits [T, vocab], hidden [T, hidden]?) in the same order. Its blocks' masks are as the rows' loops
// made them ([1, 1, T, P + T] additive in the model's dtype, undefined for a chain), their positions [T].
using BatchForwardFn = std::function<std::vector<std::tuple<at::Tensor, std::optional<at::Tensor>>>(
    const std::vector<TargetBlock>&)>;

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
  // overhead (or null): where to publish the batch step's overhead as measured here (step_overhead()).
  // share_prefills: rows handing in the same prefill block (the sequences of one prompt) run it once, the
  // others taking copies of its cache entries and outputs (shared_prefills() counts them).
  // drafting (or null): told each decode step's wall time (BatchDrafting::end_step), so that it can choose
  // whether the rows draft.
  // target or forward: what runs the batch's blocks (exactly one of them; see BatchForwardFn).
  BatchedForward(std::shared_ptr<TargetForward> target, BatchForwardFn forward, std::vector<BatchRow> rows,
                 std::shared_ptr<SharedSeconds> overhead = nullptr, bool share_prefills = true,
                 std::shared_ptr<BatchDrafting> drafting = nullptr);

  // Row `row`'s forward, the ForwardFn its decode loop calls: (logits [T, vocab] float32, final hidden
  // states [T, hidden] in the model's dtype when asked). Blocks until the batch's forward has run.
  ForwardFn forward_for(int64_t row);

  // Runs loops[i].run(prompts[i]) on one thread each, loop i calling forward_for(i), until every loop has
  // stopped; their results in order. The first exception a loop raised is rethrown once all have stopped.
  // cuda_streams: every loop thread runs on the caller's current CUDA streams (a model on a GPU; false
  // leaves CUDA untouched: querying it would initialise the driver in a CPU-only process).
  std::vector<DecodeResult> run(const std::vector<DecodeLoop*>& loops, const std::vector<at::Tensor>& prompts,
                                bool cuda_streams = false);

  // `fn` (a row's forward of its own: HF's forward deciding a near-tie) made to run on run()'s thread, once
  // every live row waits, as the batched forwards do: a loop's thread runs no parallel work of its own (see
  // run()). Calls from row `row`'s loop only, while the batch runs.
  ForwardFn on_runner(int64_t row, ForwardFn fn);

  // Row `row`'s draft step: logits [vocab] float32 of `token` at `position` through `decoder`, its keys and
  // values written into the row's draft cache (keys[l], values[l]: QuantizedDecoder::step's layout). Blocks
  // until every live row waits, then runs with every other row's pending draft step on the same decoder.
  // Called from a row's loop only (its thread), while the batch runs. head_scan: QuantizedDecoder::step's
  // (rows of one decoder step with the largest any of them asks).
  at::Tensor draft_step(int64_t row, const std::shared_ptr<QuantizedDecoder>& decoder, int64_t token,
                        int64_t position, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                        int64_t head_scan = 0);

  int64_t rows() const { return static_cast<int64_t>(rows_.size()); }
  int64_t forwards() const { return forwards_; }        // batched forwards run so far
  int64_t draft_steps() const { return draft_steps_; }  // batched draft steps (step_rows calls) so far
  int64_t draft_rows() const { return draft_rows_; }    // rows those draft steps ran
  // Rows whose prefill another row's identical one ran for (the sequences of one prompt): they took copies.
  int64_t shared_prefills() const { return shared_prefills_; }
  // Whether row `row`'s prefill was a copy of another row's (its loop counted a forward the model did not
  // run).
  bool prefill_copied(int64_t row) const;
  double forward_seconds() const { return forward_seconds_; }  // wall time in the batched forwards
  double draft_seconds() const { return draft_seconds_; }      // wall time in the batched draft steps
  // Seconds a batch step spends besides its forward and its draft steps (the rows' own work between two
  // forwards): a moving average over the steps of run(), 0 before its second forward.
  double step_overhead() const { return step_overhead_; }

 private:
  using Output = std::tuple<at::Tensor, std::optional<at::Tensor>>;
  struct Pending {
    TargetBlock block;
    bool done = false;
    Output out;
    std::exception_ptr error;
  };
  struct DraftPending {
    std::shared_ptr<QuantizedDecoder> decoder;
    int64_t token = 0, position = 0, head_scan = 0;
    std::vector<at::Tensor> keys, values;
    bool done = false;
    at::Tensor out;  // [vocab]
    std::exception_ptr error;
  };
  struct Task {
    std::function<Output()> fn;
    bool done = false;
    Output out;
    std::exception_ptr error;
  };
  Output submit(int64_t row, TargetBlock block);
  // With the lock held, `slot` just filled: wakes run()'s thread if every live row now waits, waits until
  // the slot's work has run, empties it and returns its output (or rethrows its error).
  template <typename Slot>
  auto wait_until_run(std::unique_lock<std::mutex>& lock, std::optional<Slot>& slot) {
    if (complete()) runner_cv_.notify_one();
    cv_.wait(lock, [&] { return slot->done; });
    Slot taken = std::move(*slot);
    slot.reset();
    if (taken.error) std::rethrow_exception(taken.error);
    return std::move(taken.out);
  }
  void leave(int64_t row);
  // With the lock held: whether every live row waits (and one at least), so that run()'s thread runs the
  // pending draft steps (if any), else the target's forward over every block handed in.
  bool complete() const;
  void run_tasks();
  void run_draft_steps();
  void run_forward();

  std::shared_ptr<TargetForward> target_;
  BatchForwardFn forward_;  // set where target_ is null
  std::vector<BatchRow> rows_;
  at::ScalarType hidden_dtype_;
  std::mutex mu_;
  std::condition_variable cv_;         // the rows wait on it for their outputs
  std::condition_variable runner_cv_;  // run()'s thread waits on it for every live row to wait
  std::vector<bool> live_;
  std::vector<bool> prefill_copied_;  // per row: its prefill was taken from another row's
  int64_t live_count_ = 0;
  std::vector<std::optional<Pending>> pending_;  // per row: the block it handed in, until it takes its output
  int64_t submitted_ = 0;                        // live rows with a block not yet run
  std::vector<std::optional<DraftPending>> drafts_;  // per row: its draft step, until it takes the logits
  int64_t drafting_ = 0;                             // live rows with a draft step not yet run
  std::vector<std::optional<Task>> tasks_;           // per row: its own forward to run on run()'s thread
  int64_t tasked_ = 0;                               // live rows with a task not yet run
  int64_t forwards_ = 0, draft_steps_ = 0, draft_rows_ = 0, shared_prefills_ = 0;
  bool share_prefills_ = true;
  double forward_seconds_ = 0.0, draft_seconds_ = 0.0;
  std::shared_ptr<SharedSeconds> overhead_;
  std::shared_ptr<BatchDrafting> batch_drafting_;
  // When the last decode forward (every block after its prefill) began, for BatchDrafting::end_step.
  std::optional<std::chrono::steady_clock::time_point> last_decode_start_;
  double step_overhead_ = 0.0;
  int64_t overhead_samples_ = 0;
  // Since the last forward of run() ended (none yet: no gap to measure): when, and the seconds run() spent on
  // draft steps and rows' own forwards since.
  std::optional<std::chrono::steady_clock::time_point> last_forward_end_;
  double other_work_ = 0.0;
};

}  // namespace mtprobe
