#include "core/verify.h"

#include <algorithm>

#include "core/rejection.h"

namespace mtprobe::core {

int64_t verify_greedy(const int64_t* tokens, const int64_t* parents, const int64_t* target, int64_t n,
                      int64_t root, int64_t* path_out) {
  int64_t len = 0;
  int64_t cur = root;
  path_out[len++] = cur;
  while (true) {
    int64_t next = -1;
    // Children have larger indices than their parent: scan only the tail.
    for (int64_t c = cur + 1; c < n; ++c) {
      if (parents[c] == cur && tokens[c] == target[cur]) {
        next = c;
        break;
      }
    }
    if (next < 0) return len;
    path_out[len++] = next;
    cur = next;
  }
}

// One implementation for host and device: rejection.h, here on one thread.
int64_t sample_inverse_cdf(const float* w, int64_t vocab, double u) {
  double partial[2];
  int64_t position[2];
  const RejectionWorkspace ws{nullptr, partial, position};
  return exec_sample_inverse_cdf(SerialExec{}, w, vocab, u, ws);
}

int64_t verify_rejection(const int64_t* tokens, const int64_t* parents, int64_t n, const float* p,
                         const float* q, int64_t vocab, const double* uniforms, float* residual,
                         int64_t* path_out, int64_t* token_out) {
  double partial[2];
  int64_t position[2];
  const RejectionWorkspace ws{residual, partial, position};
  return exec_verify_rejection(SerialExec{}, tokens, parents, n, p, q, vocab, uniforms, ws, path_out,
                               token_out);
}

}  // namespace mtprobe::core
