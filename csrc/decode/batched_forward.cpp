#include "decode/batched_forward.h"

#include <ATen/ThreadLocalState.h>

#include <string>
#include <thread>
#include <utility>

namespace mtprobe {

BatchedForward::BatchedForward(std::shared_ptr<TargetForward> target, std::vector<BatchRow> rows)
    : target_(std::move(target)), rows_(std::move(rows)) {
  TORCH_CHECK_VALUE(target_ != nullptr, "BatchedForward: no target forward");
  TORCH_CHECK_VALUE(!rows_.empty(), "BatchedForward: a batch needs at least one row");
  for (size_t r = 0; r < rows_.size(); ++r) {
    const BatchRow& row = rows_[r];
    TORCH_CHECK_VALUE(static_cast<int64_t>(row.keys.size()) == target_->num_layers() &&
                          row.values.size() == row.keys.size(),
                      "BatchedForward: row ", r, " must hold one key and one value buffer per layer (",
                      target_->num_layers(), "), got ", row.keys.size(), " and ", row.values.size());
    TORCH_CHECK_VALUE(row.prefill_logits_from >= 0, "BatchedForward: row ", r, " has prefill_logits_from ",
                      row.prefill_logits_from, " (must be >= 0)");
    TORCH_CHECK_VALUE(
        !row.prefilled.defined() || (row.prefilled.numel() == 1 && row.prefilled.scalar_type() == at::kBool &&
                                     row.prefilled.is_cpu()),
        "BatchedForward: row ", r, "'s prefilled flag must be a one-element bool CPU tensor");
  }
  hidden_dtype_ = target_->dtype();
  live_.assign(rows_.size(), false);
  pending_.resize(rows_.size());
}

ForwardFn BatchedForward::forward_for(int64_t row) {
  TORCH_CHECK_VALUE(row >= 0 && row < rows(), "BatchedForward: row ", row, " is not in [0, ", rows(), ")");
  return [this, row](const at::Tensor& tokens, const std::optional<at::Tensor>& embeds,
                     const at::Tensor& position_ids, const std::optional<at::Tensor>& mask,
                     int64_t prefix_len, bool want_hidden) -> Output {
    const BatchRow& r = rows_[row];
    TargetBlock block;
    block.tokens = tokens;
    block.embeds = embeds;
    block.positions = position_ids.dim() == 2 ? position_ids[0] : position_ids;  // [1, T] -> [T]
    if (mask.has_value() && mask->defined()) {
      // [1, 1, T, P + T] additive in the model's dtype -> [T, P + T] float32 (0 and its minimum stay apart).
      const at::Tensor& m = *mask;
      block.mask = (m.dim() == 4 ? m[0][0] : m).to(at::kFloat);
    }
    block.prefix_len = prefix_len;
    block.keys = r.keys;
    block.values = r.values;
    block.want_hidden = want_hidden;
    block.logits_from = prefix_len == 0 ? r.prefill_logits_from : 0;
    auto [logits, hidden] = submit(row, std::move(block));
    if (prefix_len == 0 && r.prefilled.defined()) r.prefilled.fill_(true);
    // The hidden states in the model's dtype, as HF's forward returns them to the drafters' heads.
    if (hidden.has_value()) hidden = hidden->to(hidden_dtype_);
    return {logits, hidden};
  };
}

BatchedForward::Output BatchedForward::submit(int64_t row, TargetBlock block) {
  std::unique_lock<std::mutex> lock(mu_);
  TORCH_CHECK(live_[row], "BatchedForward: row ", row, " handed in a block while not running");
  TORCH_CHECK(!pending_[row].has_value(), "BatchedForward: row ", row,
              " handed in a second block before its first ran: two loops share the row");
  pending_[row].emplace();
  pending_[row]->block = std::move(block);
  ++submitted_;
  run_if_complete();
  cv_.wait(lock, [&] { return pending_[row]->done; });
  Pending mine = std::move(*pending_[row]);
  pending_[row].reset();
  if (mine.error) std::rethrow_exception(mine.error);
  return std::move(mine.out);
}

void BatchedForward::leave(int64_t row) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!live_[row]) return;
  live_[row] = false;
  --live_count_;
  run_if_complete();
}

void BatchedForward::run_if_complete() {
  if (submitted_ == 0 || submitted_ < live_count_) return;
  // Every live row is waiting on its block: they cannot move until this forward has run, so it runs
  // here, under the lock.
  std::vector<int64_t> order;
  std::vector<TargetBlock> blocks;
  for (int64_t r = 0; r < rows(); ++r) {
    if (pending_[r].has_value() && !pending_[r]->done) {
      order.push_back(r);
      blocks.push_back(pending_[r]->block);
    }
  }
  try {
    auto outs = target_->forward_batch(blocks);
    for (size_t i = 0; i < order.size(); ++i) pending_[order[i]]->out = std::move(outs[i]);
  } catch (...) {
    // A bad block fails the forward of every row in it: each loop raises it (the first is rethrown by run).
    const std::exception_ptr error = std::current_exception();
    for (int64_t r : order) pending_[r]->error = error;
  }
  for (int64_t r : order) pending_[r]->done = true;
  submitted_ = 0;
  ++forwards_;
  cv_.notify_all();
}

std::vector<DecodeResult> BatchedForward::run(const std::vector<DecodeLoop*>& loops,
                                              const std::vector<at::Tensor>& prompts) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(loops.size()) == rows() && prompts.size() == loops.size(),
                    "BatchedForward.run: the batch has ", rows(), " rows, given ", loops.size(),
                    " loops and ", prompts.size(), " prompts");
  for (size_t i = 0; i < loops.size(); ++i)
    TORCH_CHECK_VALUE(loops[i] != nullptr, "BatchedForward.run: loop ", i, " is None");
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(live_count_ == 0, "BatchedForward.run: the batch is running already");
    live_.assign(rows_.size(), true);
    live_count_ = rows();
    submitted_ = 0;
    for (auto& p : pending_) p.reset();
  }
  std::vector<DecodeResult> results(loops.size());
  std::vector<std::exception_ptr> errors(loops.size());
  std::vector<std::thread> threads;
  // The caller's thread-local state (grad mode, inference mode, ...) on every loop's thread, as if the loops
  // ran on the caller's: HF's generate runs under no_grad, and ops with out= arguments refuse weights that
  // require grad outside it.
  const at::ThreadLocalState state;
  for (size_t i = 0; i < loops.size(); ++i) {
    threads.emplace_back([&, i] {
      at::ThreadLocalStateGuard guard(state);
      try {
        results[i] = loops[i]->run(prompts[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
      leave(static_cast<int64_t>(i));  // finished or failed: the others go on without this row
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return results;
}

}  // namespace mtprobe
