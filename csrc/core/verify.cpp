#include "core/verify.h"

#include <algorithm>

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

int64_t sample_inverse_cdf(const float* w, int64_t vocab, double u) {
  double total = 0;
  for (int64_t v = 0; v < vocab; ++v) total += w[v];
  const double target = u * total;
  double cum = 0;
  int64_t last_positive = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    if (w[v] <= 0) continue;
    cum += w[v];
    last_positive = v;
    if (cum > target) return v;
  }
  return last_positive;
}

int64_t verify_rejection(const int64_t* tokens, const int64_t* parents, int64_t n, const float* p,
                         const float* q, int64_t vocab, const double* uniforms, float* residual,
                         int64_t* path_out, int64_t* token_out) {
  int64_t len = 0;
  int64_t cur = 0;
  path_out[len++] = cur;
  while (true) {
    std::copy(p + cur * vocab, p + (cur + 1) * vocab, residual);  // r = p_cur
    int64_t next = -1;
    for (int64_t c = cur + 1; c < n && next < 0; ++c) {
      if (parents[c] != cur) continue;
      const float* qc = q + (c - 1) * vocab;
      const int64_t x = tokens[c];
      if (uniforms[c] * qc[x] < residual[x]) {  // u < r[x] / q[x], without dividing by q[x]
        next = c;
        break;
      }
      // Rejected: the remaining mass of r not covered by q_c.
      double total = 0;
      for (int64_t v = 0; v < vocab; ++v) total += std::max(residual[v] - qc[v], 0.0f);
      // total == 0 means r <= q_c everywhere, i.e. r == q_c, where acceptance is certain; only
      // rounding gets here, and r is left as it is.
      if (total > 0) {
        for (int64_t v = 0; v < vocab; ++v) {
          residual[v] = static_cast<float>(std::max(residual[v] - qc[v], 0.0f) / total);
        }
      }
    }
    if (next < 0) break;
    path_out[len++] = next;
    cur = next;
  }
  *token_out = sample_inverse_cdf(residual, vocab, uniforms[n]);
  return len;
}

}  // namespace mtprobe::core
