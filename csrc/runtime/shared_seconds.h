// A measured duration that several objects share: what a batch's decode step spends besides its forwards
// and draft steps (each row's loop, verification and Python work between two forwards), written by
// BatchedForward and read by every row's AutoDrafter, whose own wall time between steps includes its waits on
// the other rows and so cannot tell its overhead apart.
#pragma once

#include <atomic>

namespace mtprobe {

class SharedSeconds {
 public:
  double get() const { return seconds_.load(std::memory_order_relaxed); }
  void set(double seconds) { seconds_.store(seconds, std::memory_order_relaxed); }

 private:
  std::atomic<double> seconds_{0.0};
};

}  // namespace mtprobe
