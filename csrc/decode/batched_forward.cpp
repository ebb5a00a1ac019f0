#include "decode/batched_forward.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <chrono>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <string>
#include <thread>
#include <utility>

#include "runtime/zeroed.h"

namespace mtprobe {

namespace {
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The caller's current stream on every CUDA device (none without CUDA; run() asks only for a model on a GPU,
// since asking initialises the CUDA driver, which a CPU process that forks later must not): the loops'
// threads must queue their reads of a forward's logits behind the forward. A new thread's current stream is
// the default one, and at::ThreadLocalState does not carry streams: under a caller's `with
// torch.cuda.stream(s)` (or a stream left current by a failed graph capture) the forward ran on s while the
// loops read its outputs on the default stream, racing it (every row of a batch departed from greedy on the
// first GPU run).
std::vector<c10::Stream> callers_streams() {
  std::vector<c10::Stream> streams;
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return streams;
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::DeviceIndex n = cuda->deviceCount();  // 0 where torch has CUDA but the machine has no GPU
  for (c10::DeviceIndex d = 0; d < n; ++d)
    streams.push_back(cuda->getStream(c10::Device(c10::DeviceType::CUDA, d)));
  return streams;
}

bool same_tensor(const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& b) {
  const bool ha = a.has_value() && a->defined(), hb = b.has_value() && b->defined();
  if (!ha || !hb) return ha == hb;
  return a->sizes() == b->sizes() && a->scalar_type() == b->scalar_type() && at::equal(*a, *b);
}

// Whether two rows' blocks are the same prefill (the sequences of one prompt, num_return_sequences): the
// same inputs at the same positions with nothing cached, so that one forward computes both.
bool same_prefill(const TargetBlock& a, const TargetBlock& b) {
  return a.prefix_len == 0 && b.prefix_len == 0 && a.want_hidden == b.want_hidden &&
         a.logits_from == b.logits_from && same_tensor(a.tokens, b.tokens) &&
         same_tensor(a.positions, b.positions) && same_tensor(a.embeds, b.embeds) &&
         same_tensor(a.mask, b.mask);
}
}  // namespace

BatchedForward::BatchedForward(std::shared_ptr<TargetForward> target, BatchForwardFn forward,
                               std::vector<BatchRow> rows, std::shared_ptr<SharedSeconds> overhead,
                               bool share_prefills, std::shared_ptr<BatchDrafting> drafting)
    : target_(std::move(target)),
      forward_(std::move(forward)),
      rows_(std::move(rows)),
      share_prefills_(share_prefills),
      overhead_(std::move(overhead)),
      batch_drafting_(std::move(drafting)) {
  TORCH_CHECK_VALUE((target_ != nullptr) != static_cast<bool>(forward_),
                    "BatchedForward: give either a target forward or a batch forward function, not ",
                    target_ != nullptr ? "both" : "neither");
  TORCH_CHECK_VALUE(!rows_.empty(), "BatchedForward: a batch needs at least one row");
  const int64_t layers = target_ ? target_->num_layers() : static_cast<int64_t>(rows_.front().keys.size());
  for (size_t r = 0; r < rows_.size(); ++r) {
    const BatchRow& row = rows_[r];
    TORCH_CHECK_VALUE(static_cast<int64_t>(row.keys.size()) == layers && row.values.size() == row.keys.size(),
                      "BatchedForward: row ", r, " must hold one key and one value buffer per layer (",
                      layers, "), got ", row.keys.size(), " and ", row.values.size());
    TORCH_CHECK_VALUE(row.prefill_logits_from >= 0, "BatchedForward: row ", r, " has prefill_logits_from ",
                      row.prefill_logits_from, " (must be >= 0)");
    TORCH_CHECK_VALUE(
        !row.prefilled.defined() || (row.prefilled.numel() == 1 && row.prefilled.scalar_type() == at::kBool &&
                                     row.prefilled.is_cpu()),
        "BatchedForward: row ", r, "'s prefilled flag must be a one-element bool CPU tensor");
  }
  hidden_dtype_ = target_ ? target_->dtype() : at::kFloat;  // unused without target_ (forward_'s own dtype)
  live_.assign(rows_.size(), false);
  prefill_copied_.assign(rows_.size(), false);
  pending_.resize(rows_.size());
  drafts_.resize(rows_.size());
  tasks_.resize(rows_.size());
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
    block.row = row;
    if (!target_) {
      block.mask = mask;  // as the loop made it: HF's modules take it so (BatchForwardFn)
    } else if (mask.has_value() && mask->defined()) {
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
    if (target_ && hidden.has_value()) hidden = hidden->to(hidden_dtype_);
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
  return wait_until_run(lock, pending_[row]);
}

ForwardFn BatchedForward::on_runner(int64_t row, ForwardFn fn) {
  TORCH_CHECK_VALUE(row >= 0 && row < rows(), "BatchedForward: row ", row, " is not in [0, ", rows(), ")");
  TORCH_CHECK_VALUE(fn != nullptr, "BatchedForward.on_runner: no forward");
  return
      [this, row, fn = std::move(fn)](const at::Tensor& tokens, const std::optional<at::Tensor>& embeds,
                                      const at::Tensor& position_ids, const std::optional<at::Tensor>& mask,
                                      int64_t prefix_len, bool want_hidden) -> Output {
        std::unique_lock<std::mutex> lock(mu_);
        TORCH_CHECK(live_[row], "BatchedForward: row ", row, " ran a forward of its own while not running");
        TORCH_CHECK(!tasks_[row].has_value(), "BatchedForward: row ", row,
                    " handed in a second forward of its own before its first ran");
        tasks_[row].emplace();
        tasks_[row]->fn = [&] { return fn(tokens, embeds, position_ids, mask, prefix_len, want_hidden); };
        ++tasked_;
        return wait_until_run(lock, tasks_[row]);
      };
}

void BatchedForward::run_tasks() {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < rows(); ++r) {
    if (!tasks_[r].has_value() || tasks_[r]->done) continue;
    try {
      tasks_[r]->out = tasks_[r]->fn();
    } catch (...) {
      tasks_[r]->error = std::current_exception();
    }
    tasks_[r]->done = true;
  }
  tasked_ = 0;
  other_work_ += seconds_since(start);
}

at::Tensor BatchedForward::draft_step(int64_t row, const std::shared_ptr<QuantizedDecoder>& decoder,
                                      int64_t token, int64_t position, std::vector<at::Tensor> keys,
                                      std::vector<at::Tensor> values, int64_t head_scan) {
  TORCH_CHECK_VALUE(row >= 0 && row < rows(), "BatchedForward.draft_step: row ", row, " is not in [0, ",
                    rows(), ")");
  TORCH_CHECK_VALUE(decoder != nullptr, "BatchedForward.draft_step: no decoder");
  std::unique_lock<std::mutex> lock(mu_);
  TORCH_CHECK(live_[row], "BatchedForward.draft_step: row ", row,
              " is not running (draft steps meet only while the batch runs)");
  TORCH_CHECK(!drafts_[row].has_value() && !pending_[row].has_value() && !tasks_[row].has_value(),
              "BatchedForward.draft_step: row ", row,
              " handed in a draft step while waiting on another: two loops share the row");
  drafts_[row].emplace();
  DraftPending& mine = *drafts_[row];
  mine.decoder = decoder;
  mine.token = token;
  mine.position = position;
  mine.head_scan = head_scan;
  mine.keys = std::move(keys);
  mine.values = std::move(values);
  ++drafting_;
  return wait_until_run(lock, drafts_[row]);
}

void BatchedForward::run_draft_steps() {
  const auto start = std::chrono::steady_clock::now();
  // One step_rows per decoder (rows of one model draft with one; another format is another decoder).
  std::vector<bool> taken(rows_.size(), false);
  for (int64_t first = 0; first < rows(); ++first) {
    if (!drafts_[first].has_value() || drafts_[first]->done || taken[first]) continue;
    const std::shared_ptr<QuantizedDecoder>& decoder = drafts_[first]->decoder;
    std::vector<int64_t> order, tokens, positions;
    std::vector<std::vector<at::Tensor>> keys, values;
    int64_t head_scan = 0;
    for (int64_t r = first; r < rows(); ++r) {
      if (!drafts_[r].has_value() || drafts_[r]->done || drafts_[r]->decoder != decoder) continue;
      taken[r] = true;
      order.push_back(r);
      tokens.push_back(drafts_[r]->token);
      positions.push_back(drafts_[r]->position);
      head_scan = std::max(head_scan, drafts_[r]->head_scan);
      keys.push_back(drafts_[r]->keys);
      values.push_back(drafts_[r]->values);
    }
    try {
      const at::Tensor logits =
          decoder->step_rows(tokens, positions, keys, values, 0, {}, head_scan);  // [rows, vocab]
      for (size_t i = 0; i < order.size(); ++i) drafts_[order[i]]->out = logits[static_cast<int64_t>(i)];
    } catch (...) {
      const std::exception_ptr error = std::current_exception();
      for (int64_t r : order) drafts_[r]->error = error;
    }
    for (int64_t r : order) drafts_[r]->done = true;
    ++draft_steps_;
    draft_rows_ += static_cast<int64_t>(order.size());
  }
  drafting_ = 0;
  const double seconds = seconds_since(start);
  draft_seconds_ += seconds;
  other_work_ += seconds;
}

bool BatchedForward::prefill_copied(int64_t row) const {
  TORCH_CHECK_VALUE(row >= 0 && row < rows(), "BatchedForward.prefill_copied: row ", row, " is not in [0, ",
                    rows(), ")");
  return prefill_copied_[row];
}

void BatchedForward::leave(int64_t row) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!live_[row]) return;
  live_[row] = false;
  --live_count_;
  if (live_count_ == 0 || complete()) runner_cv_.notify_one();
}

bool BatchedForward::complete() const {
  const int64_t waiting = submitted_ + drafting_ + tasked_;
  return waiting > 0 && waiting >= live_count_;
}

void BatchedForward::run_forward() {
  std::vector<int64_t> order;
  std::vector<TargetBlock> blocks;
  for (int64_t r = 0; r < rows(); ++r) {
    if (pending_[r].has_value() && !pending_[r]->done) {
      order.push_back(r);
      blocks.push_back(pending_[r]->block);
    }
  }
  const auto start = std::chrono::steady_clock::now();
  if (batch_drafting_ &&
      std::all_of(blocks.begin(), blocks.end(), [](const TargetBlock& b) { return b.prefix_len > 0; })) {
    // A decode step: the one before it ended now (its tokens reported by the rows' observes).
    if (last_decode_start_.has_value())
      batch_drafting_->end_step(std::chrono::duration<double>(start - *last_decode_start_).count());
    last_decode_start_ = start;
  }
  if (last_forward_end_.has_value()) {  // the step since the last forward, less its forward and draft steps
    const double sample = std::max(0.0, seconds_since(*last_forward_end_) - other_work_);
    step_overhead_ = overhead_samples_++ == 0 ? sample : 0.9 * step_overhead_ + 0.1 * sample;
    if (overhead_) overhead_->set(step_overhead_);
  }
  try {
    // A prefill identical to an earlier row's runs once: the others take copies of its cache entries and
    // outputs, as the sequences of one prompt decoded one after another share its prefill.
    std::vector<int64_t> copies(blocks.size(), -1);  // the block whose prefill block i copies, or -1
    std::vector<TargetBlock> run;
    std::vector<size_t> ran;  // run[k] is blocks[ran[k]]
    for (size_t i = 0; i < blocks.size(); ++i) {
      for (size_t j = 0; share_prefills_ && j < i && blocks[i].prefix_len == 0; ++j) {
        if (copies[j] < 0 && same_prefill(blocks[i], blocks[j])) {
          copies[i] = static_cast<int64_t>(j);
          break;
        }
      }
      if (copies[i] < 0) {
        ran.push_back(i);
        run.push_back(blocks[i]);
      }
    }
    auto outs = target_ ? target_->forward_batch(run) : forward_(run);
    TORCH_CHECK(outs.size() == run.size(), "BatchedForward: the batch forward returned ", outs.size(),
                " outputs for ", run.size(), " blocks");
    std::vector<Output> by_block(blocks.size());
    for (size_t k = 0; k < ran.size(); ++k) by_block[ran[k]] = std::move(outs[k]);
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (copies[i] < 0) continue;
      const TargetBlock& from = blocks[copies[i]];
      const int64_t T = from.positions.size(0);
      for (size_t l = 0; l < from.keys.size(); ++l) {
        blocks[i].keys[l].narrow(2, 0, T).copy_(from.keys[l].narrow(2, 0, T));
        blocks[i].values[l].narrow(2, 0, T).copy_(from.values[l].narrow(2, 0, T));
      }
      const auto& [logits, hidden] = by_block[copies[i]];
      // The rows anyone reads, copied; the prompt's rows before them stay untouched zeros (runtime/zeroed.h).
      const int64_t read_from = blocks[i].logits_from;
      at::Tensor copy = zeroed_floats(logits.size(0), logits.size(1));  // [T, vocab]
      copy.narrow(0, read_from, T - read_from).copy_(logits.narrow(0, read_from, T - read_from));
      by_block[i] =
          Output{copy, hidden.has_value() ? std::optional<at::Tensor>(hidden->clone()) : std::nullopt};
      ++shared_prefills_;
      prefill_copied_[order[i]] = true;
    }
    for (size_t i = 0; i < order.size(); ++i) pending_[order[i]]->out = std::move(by_block[i]);
  } catch (...) {
    // A bad block fails the forward of every row in it: each loop raises it (the first is rethrown by run).
    const std::exception_ptr error = std::current_exception();
    for (int64_t r : order) pending_[r]->error = error;
  }
  for (int64_t r : order) pending_[r]->done = true;
  submitted_ = 0;
  ++forwards_;
  forward_seconds_ += seconds_since(start);
  last_forward_end_ = std::chrono::steady_clock::now();
  other_work_ = 0.0;
}

std::vector<DecodeResult> BatchedForward::run(const std::vector<DecodeLoop*>& loops,
                                              const std::vector<at::Tensor>& prompts, bool cuda_streams) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(loops.size()) == rows() && prompts.size() == loops.size(),
                    "BatchedForward.run: the batch has ", rows(), " rows, given ", loops.size(),
                    " loops and ", prompts.size(), " prompts");
  for (size_t i = 0; i < loops.size(); ++i)
    TORCH_CHECK_VALUE(loops[i] != nullptr, "BatchedForward.run: loop ", i, " is None");
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(live_count_ == 0, "BatchedForward.run: the batch is running already");
    live_.assign(rows_.size(), true);
    prefill_copied_.assign(rows_.size(), false);
    live_count_ = rows();
    submitted_ = 0;
    drafting_ = 0;
    tasked_ = 0;
    last_forward_end_.reset();
    last_decode_start_.reset();
    other_work_ = 0.0;
    for (auto& p : pending_) p.reset();
    for (auto& d : drafts_) d.reset();
    for (auto& t : tasks_) t.reset();
  }
  std::vector<DecodeResult> results(loops.size());
  std::vector<std::exception_ptr> errors(loops.size());
  std::vector<std::thread> threads;
  // The caller's thread-local state (grad mode, inference mode, ...) on every loop's thread, as if the loops
  // ran on the caller's: HF's generate runs under no_grad, and ops with out= arguments refuse weights that
  // require grad outside it.
  const at::ThreadLocalState state;
  const std::vector<c10::Stream> streams = cuda_streams ? callers_streams() : std::vector<c10::Stream>{};
  for (size_t i = 0; i < loops.size(); ++i) {
    threads.emplace_back([&, i] {
      at::ThreadLocalStateGuard guard(state);
      const c10::MultiStreamGuard on_callers_streams(streams);
#ifdef _OPENMP
      // A loop's own ops (its drafter's argmax over the vocabulary, verification) run on its thread alone:
      // an OpenMP team per loop thread would put more of libgomp's threads than cores in the process, and
      // libgomp then all but stops spinning, so that each parallel region of the batched forwards (hundreds
      // a draft step) waits on a wake-up: step_rows of 4 rows took 8.7 ms alone, 22.4 ms beside four idle
      // threads that had run one parallel op. (omp_set_num_threads sets this thread's own setting, not the
      // process's; ATen sets it once per thread at the thread's first parallel call, so that comes first.)
      (void)at::get_num_threads();
      omp_set_num_threads(1);
#endif
      try {
        results[i] = loops[i]->run(prompts[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
      leave(static_cast<int64_t>(i));  // finished or failed: the others go on without this row
    });
  }
  // This thread runs every batched forward, draft step and row's own forward (on_runner), once every live
  // row waits (none can move until something runs). One thread, not whichever row arrived last: OpenMP's
  // team is per calling thread, and one team is all the process should hold (see the loops' threads above):
  // a 4-row draft step measured 8 ms from one thread, 17.5 ms taking turns on four. The draft steps run
  // before the target's forward: their rows go on drafting and hand in their blocks later, and the forward
  // waits for them, so that it takes every row's block at once.
  {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      runner_cv_.wait(lock, [&] { return live_count_ == 0 || complete(); });
      if (live_count_ == 0) break;
      if (tasked_ > 0) {
        run_tasks();
      } else if (drafting_ > 0) {
        run_draft_steps();
      } else {
        run_forward();
      }
      cv_.notify_all();
    }
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return results;
}

}  // namespace mtprobe
