// csrc/core/rejection.h: the rejection-sampling walk run by several host threads sharing one
// workspace (as the threads of the CUDA kernel do) against the serial walk, and the worked
// example of verify.h. tests/test_verify.py checks the serial walk against the Python reference
// and its output distribution.
#include <cstdint>
#include <random>
#include <vector>

#include "core/rejection.h"
#include "core/verify.h"
#include "harness.h"
#include "thread_exec.h"

using namespace mtprobe::core;

namespace {

struct Outcome {
  std::vector<int64_t> path;
  int64_t token = -1;
};

// threads == 0: the serial core::verify_rejection.
Outcome walk(int threads, const std::vector<int64_t>& tokens, const std::vector<int64_t>& parents,
             const std::vector<float>& p, const std::vector<float>& q, int64_t vocab,
             const std::vector<double>& u) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  Outcome o;
  std::vector<int64_t> path(n, -7);
  if (threads == 0) {
    std::vector<float> residual(vocab);
    const int64_t len = verify_rejection(tokens.data(), parents.data(), n, p.data(), q.data(), vocab,
                                         u.data(), residual.data(), path.data(), &o.token);
    o.path.assign(path.begin(), path.begin() + len);
    return o;
  }
  std::vector<double> scratch(rejection_workspace_bytes(vocab, threads) / sizeof(double) + 1);
  const RejectionWorkspace ws = carve_rejection_workspace(scratch.data(), threads);
  std::vector<int64_t> lens(threads, -1);
  mtprobe_test::run_threads(threads, [&](const mtprobe_test::ThreadExec& ex) {
    lens[ex.tid] = exec_verify_rejection(ex, tokens.data(), parents.data(), n, p.data(), q.data(), vocab,
                                         u.data(), ws, path.data(), &o.token);
  });
  for (int64_t len : lens) CHECK(len == lens[0]);  // every thread returns the length
  o.path.assign(path.begin(), path.begin() + lens[0]);
  return o;
}

void test_worked_example() {
  // verify.h: p_0 = [0.6, 0.4], node 1 drafted 1 from q_1 = [0.2, 0.8]; accept iff u_1 * 0.8 < 0.4.
  const std::vector<int64_t> tokens{9, 1}, parents{-1, 0};
  const std::vector<float> p{0.6f, 0.4f, 0.0f, 1.0f}, q{0.2f, 0.8f};
  for (int threads : {0, 1, 2, 3}) {
    Outcome accepted = walk(threads, tokens, parents, p, q, 2, {0.0, 0.3, 0.5});
    CHECK((accepted.path == std::vector<int64_t>{0, 1}));
    CHECK(accepted.token == 1);  // p_1 = [0, 1]
    Outcome rejected = walk(threads, tokens, parents, p, q, 2, {0.0, 0.7, 0.99});
    CHECK((rejected.path == std::vector<int64_t>{0}));
    CHECK(rejected.token == 0);  // r = normalise(max(p_0 - q_1, 0)) = [1, 0]
  }
}

std::vector<float> random_rows(std::mt19937& gen, int64_t rows, int64_t vocab) {
  std::vector<float> x(rows * vocab);
  std::uniform_real_distribution<float> unif(0.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      const float a = unif(gen);
      x[r * vocab + v] = (gen() % 4 == 0) ? 0.0f : a * a * a;  // zeros and peaks
      s += x[r * vocab + v];
    }
    if (s == 0) x[r * vocab] = 1.0f, s = 1.0;
    for (int64_t v = 0; v < vocab; ++v) x[r * vocab + v] = static_cast<float>(x[r * vocab + v] / s);
  }
  return x;
}

void test_threads_match_serial() {
  std::mt19937 gen(11);
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  int cases = 0, accepted_any = 0, rejected_any = 0;
  for (int64_t vocab : {1, 2, 5, 37, 1000}) {
    for (int rep = 0; rep < 40; ++rep) {
      const int64_t n = 1 + gen() % 10;
      std::vector<int64_t> parents(n, -1), tokens(n, 0);
      for (int64_t j = 1; j < n; ++j) parents[j] = gen() % j;
      const std::vector<float> p = random_rows(gen, n, vocab);
      std::vector<float> q = random_rows(gen, n > 1 ? n - 1 : 1, vocab);
      // Siblings share one q row (independent draws from one distribution), tokens drawn from it.
      for (int64_t j = 1; j < n; ++j) {
        for (int64_t s = 1; s < j; ++s) {
          if (parents[s] == parents[j]) {
            for (int64_t v = 0; v < vocab; ++v) q[(j - 1) * vocab + v] = q[(s - 1) * vocab + v];
            break;
          }
        }
        const float* row = q.data() + (j - 1) * vocab;
        tokens[j] = sample_inverse_cdf(row, vocab, unif(gen));
        CHECK(row[tokens[j]] > 0);
      }
      std::vector<double> u(n + 1);
      for (auto& x : u) x = unif(gen);
      const Outcome serial = walk(0, tokens, parents, p, q, vocab, u);
      CHECK(serial.path.size() >= 1 && serial.path[0] == 0);
      CHECK(serial.token >= 0 && serial.token < vocab);
      accepted_any += serial.path.size() > 1;
      rejected_any += n > 1 && serial.path.size() == 1;
      for (int threads : {1, 2, 3, 8}) {
        const Outcome par = walk(threads, tokens, parents, p, q, vocab, u);
        CHECK(par.path == serial.path);
        CHECK(par.token == serial.token);
      }
      ++cases;
    }
  }
  CHECK(cases == 200);
  CHECK(accepted_any > 20 && rejected_any > 20);  // both branches were exercised
}

void test_inverse_cdf_edges() {
  // Rounding past the end falls back to the last positive token; no positive weight gives 0.
  const std::vector<float> w{0.0f, 0.5f, 0.5f, 0.0f};
  for (int threads : {1, 3}) {
    std::vector<double> scratch(rejection_workspace_bytes(4, threads) / sizeof(double) + 1);
    const RejectionWorkspace ws = carve_rejection_workspace(scratch.data(), threads);
    std::vector<int64_t> got(threads);
    for (double u : {0.0, 0.49, 0.5, 0.999999, 1.0}) {
      mtprobe_test::run_threads(threads, [&](const mtprobe_test::ThreadExec& ex) {
        got[ex.tid] = exec_sample_inverse_cdf(ex, w.data(), 4, u, ws);
      });
      const int64_t expected = u < 0.5 ? 1 : 2;  // u = 1 runs past the end: the last positive, 2
      for (int64_t g : got) CHECK(g == expected);
    }
    const std::vector<float> zeros{0.0f, 0.0f, 0.0f};
    mtprobe_test::run_threads(threads, [&](const mtprobe_test::ThreadExec& ex) {
      got[ex.tid] = exec_sample_inverse_cdf(ex, zeros.data(), 3, 0.5, ws);
    });
    for (int64_t g : got) CHECK(g == 0);
  }
  CHECK(sample_inverse_cdf(w.data(), 4, 0.49) == 1);
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"worked_example", test_worked_example},
      {"threads_match_serial", test_threads_match_serial},
      {"inverse_cdf_edges", test_inverse_cdf_edges},
  };
  return mtprobe_test::run_tests(tests);
}
