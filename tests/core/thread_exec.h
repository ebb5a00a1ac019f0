// Host threads as a CUDA block: ThreadExec{tid, threads, &barrier} runs the host/device code of
// csrc/core (exec.h) the way the kernels do, so the core tests exercise its parallel loops. Like
// the block (and unlike SerialExec's std::sort), it sorts with exec.h's exec_parallel_sort /
// exec_parallel_merge, so the tests check the device's sort against the host's.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mtprobe_test {

// A reusable barrier for `count` threads (std::barrier is C++20).
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t gen = generation_;
    if (++waiting_ == count_) {
      waiting_ = 0, ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen != generation_; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int count_, waiting_ = 0;
  int64_t generation_ = 0;
};

// Thread `tid` of `threads`, as threadIdx.x of blockDim.x.
struct ThreadExec {
  int64_t tid, threads;
  Barrier* barrier;
  int64_t first() const { return tid; }
  int64_t stride() const { return threads; }
  bool leader() const { return tid == 0; }
  void sync() const { barrier->wait(); }
};

// Runs body(exec) on `threads` host threads sharing one barrier.
template <typename F>
void run_threads(int threads, F body) {
  Barrier barrier(threads);
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) pool.emplace_back([&, i] { body(ThreadExec{i, threads, &barrier}); });
  for (auto& th : pool) th.join();
}

}  // namespace mtprobe_test
