// Executors: code written once for the host and the device (draft_tree_expand.h, rejection.h).
//
// An executor says which loop indices the calling thread takes and how threads meet:
//   for (i = ex.first(); i < n; i += ex.stride()) ...;  ex.sync();   // a parallel loop
//   if (ex.leader()) ...;  ex.sync();                                // one thread's step
// SerialExec is one host thread (first 0, stride 1, sync a no-op); the CUDA kernels use the
// threads of one block (csrc/kernels/exec.cuh), the core tests a pool of host threads.
// exec_merge / exec_sort order int32 keys: on SerialExec with std::merge / std::sort, on any other
// executor with exec_parallel_merge / exec_parallel_sort, whose every step is "for each key".
// Torch-free, C++17; compiles as CUDA too.
#pragma once

#include <algorithm>
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

// How many keys of the sorted run[0, n) order before x: a binary search, O(log n).
template <typename Less>
MTPROBE_HD int64_t exec_count_before(const int32_t* run, int64_t n, int32_t x, const Less& less) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (less(run[mid], x)) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The merges and sorts below take a strict total order `less` on the keys (no two distinct keys
// equivalent), so their result is unique: every executor gives the same. The input must be
// published (a sync after it was written); the output is published on return, on every thread.

// Merges the sorted runs a[0, na) and b[0, nb) into out[0, na + nb) (out must not overlap them).
// Each key lands at its index in its run plus the number of keys of the other run before it:
// O((na + nb) log(na + nb)) work over the threads, one sync.
template <typename Exec, typename Less>
MTPROBE_HD void exec_parallel_merge(const Exec& ex, const int32_t* a, int64_t na, const int32_t* b,
                                    int64_t nb, int32_t* out, const Less& less) {
  for (int64_t k = ex.first(); k < na + nb; k += ex.stride()) {
    if (k < na) {
      out[k + exec_count_before(b, nb, a[k], less)] = a[k];
    } else {
      out[k - na + exec_count_before(a, na, b[k - na], less)] = b[k - na];
    }
  }
  ex.sync();
}

// Sorts keys[0, n) in place; tmp: [n] scratch. Bottom-up merge sort: pass p merges neighbouring
// runs of 2^p keys from one buffer into the other, as exec_parallel_merge does; O(n log^2 n) work
// over the threads, ceil(log2 n) + 1 syncs at most.
template <typename Exec, typename Less>
MTPROBE_HD void exec_parallel_sort(const Exec& ex, int32_t* keys, int32_t* tmp, int64_t n, const Less& less) {
  int32_t *src = keys, *dst = tmp;
  for (int64_t run = 1; run < n; run *= 2) {
    for (int64_t k = ex.first(); k < n; k += ex.stride()) {
      const int64_t lo = k / (2 * run) * (2 * run);
      const int64_t mid = lo + run < n ? lo + run : n, hi = lo + 2 * run < n ? lo + 2 * run : n;
      const int32_t x = src[k];
      if (k < mid) {
        dst[k + exec_count_before(src + mid, hi - mid, x, less)] = x;
      } else {
        dst[k - mid + lo + exec_count_before(src + lo, mid - lo, x, less)] = x;
      }
    }
    ex.sync();
    int32_t* t = src;
    src = dst, dst = t;
  }
  if (src != keys) {
    for (int64_t k = ex.first(); k < n; k += ex.stride()) keys[k] = src[k];
    ex.sync();
  }
}

// exec_merge(ex, a, na, b, nb, out, less) and exec_sort(ex, keys, tmp, n, less): as above; one
// host thread uses the standard library's O(na + nb) merge and O(n log n) sort instead (tmp
// unused). In device code, where SerialExec never runs, it falls back to the parallel versions.
template <typename Exec, typename Less>
MTPROBE_HD void exec_merge(const Exec& ex, const int32_t* a, int64_t na, const int32_t* b, int64_t nb,
                           int32_t* out, const Less& less) {
  exec_parallel_merge(ex, a, na, b, nb, out, less);
}

template <typename Exec, typename Less>
MTPROBE_HD void exec_sort(const Exec& ex, int32_t* keys, int32_t* tmp, int64_t n, const Less& less) {
  exec_parallel_sort(ex, keys, tmp, n, less);
}

template <typename Less>
MTPROBE_HD void exec_merge(const SerialExec& ex, const int32_t* a, int64_t na, const int32_t* b, int64_t nb,
                           int32_t* out, const Less& less) {
#if defined(__CUDA_ARCH__)
  exec_parallel_merge(ex, a, na, b, nb, out, less);
#else
  (void)ex;
  std::merge(a, a + na, b, b + nb, out, less);
#endif
}

template <typename Less>
MTPROBE_HD void exec_sort(const SerialExec& ex, int32_t* keys, int32_t* tmp, int64_t n, const Less& less) {
#if defined(__CUDA_ARCH__)
  exec_parallel_sort(ex, keys, tmp, n, less);
#else
  (void)ex, (void)tmp;
  std::sort(keys, keys + n, less);
#endif
}

}  // namespace mtprobe::core
