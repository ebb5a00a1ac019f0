// Whether the rows of a batch decoded together draft at all, chosen by measuring the batch's tokens per
// second both ways (issue 68).
//
// Why: each row's scheduler (AutoDrafter) prices its drafts by the batch's forward, but not everything a
// draft costs the other rows: their waits on its draft steps, its drafters' own work on a few shared cores, a
// batch whose steps are counted by its slowest row. On the 2-core AMD EPYC, batches of 8 and 16 rows with
// AutoConfig ran 6-15 % slower than plain decoding together (benchmarks/results/batch/). So the batch
// measures instead of modelling: it runs phases of `phase_steps` decode steps in which the rows' schedulers
// choose as usual, and phases in which every row decodes plainly without asking its drafters, keeps whichever
// made more tokens per second, and tries the slower again once the faster has run `exploit_phases` more
// phases (a phase's rate: tokens over seconds, averaged halfway with the mode's earlier ones). One object
// serves the batches of one model, configuration and size in turn (mtprobe.decode.batch keeps it), so what
// one call measured starts the next.
//
// Written by BatchedForward (end_step, once per decode forward, on its runner thread) and by every row's
// AutoDrafter (add_tokens in observe, allowed in propose, on the rows' threads): the rows' side is atomics;
// the phase bookkeeping takes a lock, since two calls on one model (threads of their own) may share the
// object.
#pragma once

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace mtprobe {

class BatchDrafting {
 public:
  BatchDrafting(int64_t phase_steps = 8, int64_t exploit_phases = 4)
      : phase_steps_(phase_steps), exploit_phases_(exploit_phases) {
    TORCH_CHECK_VALUE(phase_steps >= 1, "BatchDrafting: phase_steps must be >= 1, got ", phase_steps);
    TORCH_CHECK_VALUE(exploit_phases >= 0, "BatchDrafting: exploit_phases must be >= 0, got ",
                      exploit_phases);
  }

  // Whether the rows may draft this step (false: every row decodes plainly, its drafters not asked).
  bool allowed() const { return drafting_.load(std::memory_order_relaxed); }
  // A row's tokens committed by a decode step (its observe).
  void add_tokens(int64_t n) { tokens_.fetch_add(n, std::memory_order_relaxed); }

  // One decode step of the batch ended `seconds` after the one before (its rows' tokens reported): at the end
  // of a phase, its rate is recorded and the next phase's mode chosen.
  void end_step(double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    const int m = mode();
    phase_seconds_ += seconds;
    phase_tokens_ += tokens_.exchange(0, std::memory_order_relaxed);
    ++steps_[m];
    if (++phase_step_ < phase_steps_ || phase_seconds_ <= 0) return;
    const double rate = static_cast<double>(phase_tokens_) / phase_seconds_;
    rate_[m] = phases_[m] == 0 ? rate : 0.5 * (rate_[m] + rate);  // recent phases weigh most
    ++phases_[m];
    phase_step_ = 0;
    phase_seconds_ = 0.0;
    phase_tokens_ = 0;
    const int best = rate_[1] >= rate_[0] ? 1 : 0;
    int next = best;
    if (phases_[1 - m] == 0) {
      next = 1 - m;  // the other mode, never measured yet; then the faster for exploit_phases more
      exploit_left_ = exploit_phases_;
    } else if (m != best) {
      exploit_left_ = exploit_phases_;  // the slower tried again: back to the faster
    } else if (exploit_left_ > 0) {
      --exploit_left_;
    } else {
      next = 1 - best;  // the slower mode once more: what it costs may have changed
    }
    drafting_.store(next == 1, std::memory_order_relaxed);
  }

  // Tokens per second of the phases with drafting (true) or plain decoding (false), 0 before one ended.
  double rate(bool drafting) const {
    std::lock_guard<std::mutex> lock(mu_);
    return rate_[drafting ? 1 : 0];
  }
  // Decode steps run with drafting allowed (true) or plainly (false).
  int64_t steps(bool drafting) const {
    std::lock_guard<std::mutex> lock(mu_);
    return steps_[drafting ? 1 : 0];
  }
  int64_t phase_steps() const { return phase_steps_; }
  int64_t exploit_phases() const { return exploit_phases_; }

 private:
  int mode() const { return allowed() ? 1 : 0; }

  const int64_t phase_steps_, exploit_phases_;
  mutable std::mutex mu_;             // the phase bookkeeping below
  std::atomic<bool> drafting_{true};  // a batch starts drafting: its schedulers' first steps explore
  std::atomic<int64_t> tokens_{0};    // reported since the last end_step
  // The runner's: the phase in progress, and per mode (0 plain, 1 drafting) its rate, phases and steps.
  int64_t phase_step_ = 0, phase_tokens_ = 0, exploit_left_ = 0;
  double phase_seconds_ = 0.0;
  double rate_[2] = {0.0, 0.0};
  int64_t phases_[2] = {0, 0}, steps_[2] = {0, 0};
};

}  // namespace mtprobe
