// Unit tests for the pieces of one decoder step (csrc/core/decoder_step.h).
//
// Build and run (tests/test_core_cpp.py does exactly this):
//   g++ -std=c++17 -O1 -Wall -Wextra -Werror -I csrc csrc/core/*.cpp tests/core/test_decoder_step.cpp -o
//   test_decoder_step
//   ./test_decoder_step
// Each piece against its definition computed in double (tests/test_quantized_decoder.py checks the
// whole step against HF's modules).
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/decoder_step.h"
#include "harness.h"

namespace {

using namespace mtprobe::core;

bool close(double a, double b, double tol = 1e-5) { return std::fabs(a - b) <= tol * (1 + std::fabs(b)); }

std::vector<float> normal(int64_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

void test_rotate_half_worked_example() {
  std::vector<float> x = {1, 2, 3, 4};
  const float cos[] = {0, 1}, sin[] = {1, 0};
  rotate_half(x.data(), 1, 4, cos, sin);
  CHECK(x[0] == -3 && x[1] == 2 && x[2] == 1 && x[3] == 4);
}

void test_rotate_half_keeps_norms_per_pair() {
  const int64_t heads = 3, d = 8;
  std::vector<float> x = normal(heads * d, 1), y = x;
  std::vector<float> cos(d / 2), sin(d / 2);
  for (int64_t i = 0; i < d / 2; ++i) {
    cos[i] = std::cos(0.3f * (i + 1));
    sin[i] = std::sin(0.3f * (i + 1));
  }
  rotate_half(y.data(), heads, d, cos.data(), sin.data());
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d / 2; ++i) {
      const double a = x[h * d + i], b = x[h * d + i + d / 2];
      CHECK(close(y[h * d + i], a * cos[i] - b * sin[i]));
      CHECK(close(y[h * d + i + d / 2], b * cos[i] + a * sin[i]));
    }
  }
}

void test_rms_norm_against_double() {
  for (int64_t n : {1, 7, 576}) {
    std::vector<float> x = normal(n, 2), w = normal(n, 3), y(n);
    rms_norm(x.data(), w.data(), 1e-5f, n, y.data());
    double ss = 0;
    for (float v : x) ss += double(v) * v;
    const double r = 1 / std::sqrt(ss / n + 1e-5);
    for (int64_t i = 0; i < n; ++i) CHECK(close(y[i], w[i] * x[i] * r));
    rms_norm(x.data(), w.data(), 1e-5f, n, x.data());  // in place
    for (int64_t i = 0; i < n; ++i) CHECK(x[i] == y[i]);
  }
}

void test_attend_against_double() {
  const int64_t d = 16, stride = 40;  // rows further apart than head_dim, as in a cache of several heads
  for (int64_t group : {1, 3}) {
    for (int64_t len : {1, 2, 33}) {
      std::vector<float> q = normal(group * d, 4), k = normal(len * stride, 5), v = normal(len * stride, 6);
      std::vector<float> scores(group * len), out(group * d);
      attend(q.data(), group, k.data(), v.data(), len, d, stride, 0.25f, scores.data(), out.data());
      for (int64_t h = 0; h < group; ++h) {
        std::vector<double> p(len);
        double top = -INFINITY, total = 0;
        for (int64_t j = 0; j < len; ++j) {
          double s = 0;
          for (int64_t i = 0; i < d; ++i) s += double(q[h * d + i]) * k[j * stride + i];
          p[j] = 0.25 * s;
          top = std::max(top, p[j]);
        }
        for (double& s : p) total += (s = std::exp(s - top));
        for (int64_t i = 0; i < d; ++i) {
          double o = 0;
          for (int64_t j = 0; j < len; ++j) o += p[j] / total * v[j * stride + i];
          CHECK(close(out[h * d + i], o, 1e-4));
        }
      }
    }
  }
}

void test_silu_mul_against_double() {
  std::vector<float> g = normal(100, 7), u = normal(100, 8), y(100);
  silu_mul(g.data(), u.data(), 100, y.data());
  for (int i = 0; i < 100; ++i) CHECK(close(y[i], g[i] / (1 + std::exp(-double(g[i]))) * u[i]));
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"rotate_half_worked_example", test_rotate_half_worked_example},
      {"rotate_half_keeps_norms_per_pair", test_rotate_half_keeps_norms_per_pair},
      {"rms_norm_against_double", test_rms_norm_against_double},
      {"attend_against_double", test_attend_against_double},
      {"silu_mul_against_double", test_silu_mul_against_double},
  };
  return mtprobe_test::run_tests(tests);
}
