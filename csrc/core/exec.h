// Executors: code written once for the host and the device (draft_tree_expand.h, rejection.h).
//
// An executor says which loop indices the calling thread takes and how threads meet:
//   for (i = ex.first(); i < n; i += ex.stride()) ...;  ex.sync();   // a parallel loop
//   if (ex.leader()) ...;  ex.sync();                                // one thread's step
// SerialExec is one host thread (first 0, stride 1, sync a no-op); the CUDA kernels use the
// threads of one block (csrc/kernels/exec.cuh), the core tests a pool of host threads.
// Torch-free, C++17; compiles as CUDA too.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MTPROBE_HD __host__ __device__
#else
#define MTPROBE_HD
#endif

namespace mtprobe::core {

struct SerialExec {
  MTPROBE_HD int64_t first() const { return 0; }
  MTPROBE_HD int64_t stride() const { return 1; }
  MTPROBE_HD bool leader() const { return true; }
  MTPROBE_HD void sync() const {}
};

// The sum of every thread's x, returned on every thread; partials in thread order, so the result
// is the same on every run with the same number of threads. scratch: stride() + 1 doubles.
template <typename Exec>
MTPROBE_HD double exec_sum(const Exec& ex, double x, double* scratch) {
  scratch[ex.first()] = x;
  ex.sync();
  if (ex.leader()) {
    double s = 0;
    for (int64_t t = 0; t < ex.stride(); ++t) s += scratch[t];
    scratch[ex.stride()] = s;
  }
  ex.sync();
  const double s = scratch[ex.stride()];
  ex.sync();  // scratch is reused by the next call
  return s;
}

// The chunk [*begin, *end) of n items that the calling thread owns: contiguous, in thread order.
template <typename Exec>
MTPROBE_HD void exec_chunk(const Exec& ex, int64_t n, int64_t* begin, int64_t* end) {
  const int64_t per = (n + ex.stride() - 1) / ex.stride();
  const int64_t b = ex.first() * per;
  *begin = b < n ? b : n;
  *end = b + per < n ? b + per : n;
}

}  // namespace mtprobe::core
