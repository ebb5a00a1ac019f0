// Rejection sampling over a draft tree (the rule of core::verify_rejection in verify.h), written
// once for the host and the device: verify.cpp runs it with SerialExec, the CUDA kernel
// (csrc/kernels/verify.cuh) with the threads of one block. Every thread takes one contiguous chunk
// of the vocabulary; sums add the chunks' partials in thread order. With one thread this is
// exactly the serial loop; with more, sums round in another order (differences of ~1 ulp).
// Torch-free, allocation-free, C++17; compiles as CUDA too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/exec.h"

namespace mtprobe::core {

struct RejectionWorkspace {
  float* residual;    // [vocab]
  double* partial;    // [threads + 1]
  int64_t* position;  // [2 * threads]: per thread, the first token past the target, the last positive one
};

MTPROBE_HD inline size_t rejection_workspace_bytes(int64_t vocab, int64_t threads) {
  return static_cast<size_t>(threads + 1) * sizeof(double) +
         static_cast<size_t>(2 * threads) * sizeof(int64_t) + static_cast<size_t>(vocab) * sizeof(float);
}

MTPROBE_HD inline RejectionWorkspace carve_rejection_workspace(void* base, int64_t threads) {
  char* p = static_cast<char*>(base);
  RejectionWorkspace w{};
  w.partial = reinterpret_cast<double*>(p), p += static_cast<size_t>(threads + 1) * sizeof(double);
  w.position = reinterpret_cast<int64_t*>(p), p += static_cast<size_t>(2 * threads) * sizeof(int64_t);
  w.residual = reinterpret_cast<float*>(p);
  return w;
}

// The token of a draw from w[0, vocab) (non-negative, not necessarily normalised) by inverse CDF
// with u in [0, 1): the first token of positive weight whose cumulative weight exceeds u * total;
// the last token of positive weight when rounding runs past the end; 0 if none is positive.
template <typename Exec>
MTPROBE_HD int64_t exec_sample_inverse_cdf(const Exec& ex, const float* w, int64_t vocab, double u,
                                           RejectionWorkspace ws) {
  int64_t vb, ve;
  exec_chunk(ex, vocab, &vb, &ve);
  double all = 0, positive = 0;
  for (int64_t v = vb; v < ve; ++v) {
    all += w[v];
    if (w[v] > 0) positive += w[v];
  }
  const double target = u * exec_sum(ex, all, ws.partial);
  // Exclusive prefix of the chunks' positive mass: where this thread's cumulative sum starts.
  ws.partial[ex.first()] = positive;
  ex.sync();
  if (ex.leader()) {
    double run = 0;
    for (int64_t t = 0; t < ex.stride(); ++t) {
      const double x = ws.partial[t];
      ws.partial[t] = run;
      run += x;
    }
  }
  ex.sync();
  double cum = ws.partial[ex.first()];
  int64_t found = -1, last_positive = -1;
  for (int64_t v = vb; v < ve; ++v) {
    if (w[v] <= 0) continue;
    cum += w[v];
    last_positive = v;
    if (cum > target) {
      found = v;
      break;
    }
  }
  ws.position[2 * ex.first()] = found;
  ws.position[2 * ex.first() + 1] = last_positive;
  ex.sync();
  if (ex.leader()) {
    int64_t token = -1, last = 0;
    for (int64_t t = 0; t < ex.stride() && token < 0; ++t) token = ws.position[2 * t];
    for (int64_t t = 0; t < ex.stride(); ++t)
      last = ws.position[2 * t + 1] >= 0 ? ws.position[2 * t + 1] : last;
    ws.position[0] = token >= 0 ? token : last;
  }
  ex.sync();
  const int64_t token = ws.position[0];
  ex.sync();
  return token;
}

// The walk of core::verify_rejection (verify.h: shapes, the rule and a worked example). Writes the
// accepted path [0, ...] (leader) into path_out and the output token into *token_out; returns the
// path length on every thread.
template <typename Exec>
MTPROBE_HD int64_t exec_verify_rejection(const Exec& ex, const int64_t* tokens, const int64_t* parents,
                                         int64_t n, const float* p, const float* q, int64_t vocab,
                                         const double* uniforms, RejectionWorkspace ws, int64_t* path_out,
                                         int64_t* token_out) {
  int64_t vb, ve;
  exec_chunk(ex, vocab, &vb, &ve);
  float* r = ws.residual;
  int64_t cur = 0, len = 1;
  if (ex.leader()) path_out[0] = 0;
  while (true) {
    for (int64_t v = vb; v < ve; ++v) r[v] = p[cur * vocab + v];  // r = p_cur
    ex.sync();
    int64_t next = -1;
    for (int64_t c = cur + 1; c < n; ++c) {
      if (parents[c] != cur) continue;
      const float* qc = q + (c - 1) * vocab;
      const int64_t x = tokens[c];
      if (uniforms[c] * qc[x] < r[x]) {  // u < r[x] / q[x], without dividing by q[x]
        next = c;
        break;
      }
      // Rejected: r <- normalise(max(r - q_c, 0)), the mass of r that q_c does not cover.
      double local = 0;
      for (int64_t v = vb; v < ve; ++v) local += r[v] - qc[v] > 0.0f ? r[v] - qc[v] : 0.0f;
      const double total = exec_sum(ex, local, ws.partial);
      // total == 0 means r <= q_c everywhere, i.e. r == q_c, where acceptance is certain; only
      // rounding gets here, and r is left as it is.
      if (total > 0) {
        for (int64_t v = vb; v < ve; ++v) {
          r[v] = static_cast<float>((r[v] - qc[v] > 0.0f ? r[v] - qc[v] : 0.0f) / total);
        }
      }
      ex.sync();
    }
    ex.sync();  // every thread has read r[x] before r is refilled for the next node
    if (next < 0) break;
    if (ex.leader()) path_out[len] = next;
    ++len;
    cur = next;
  }
  const int64_t token = exec_sample_inverse_cdf(ex, r, vocab, uniforms[n], ws);
  if (ex.leader()) *token_out = token;
  return len;
}

}  // namespace mtprobe::core
