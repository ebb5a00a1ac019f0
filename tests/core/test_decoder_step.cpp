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

// attend's out and lse for queries q [group, d] against len rows of stride floats, in double.
void attend_double(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                   int64_t group, int64_t len, int64_t d, int64_t stride, double scale,
                   std::vector<double>& out, std::vector<double>& lse) {
  out.assign(group * d, 0.0);
  lse.assign(group, 0.0);
  for (int64_t h = 0; h < group; ++h) {
    std::vector<double> p(len);
    double top = -INFINITY, total = 0;
    for (int64_t j = 0; j < len; ++j) {
      double s = 0;
      for (int64_t i = 0; i < d; ++i) s += double(q[h * d + i]) * k[j * stride + i];
      p[j] = scale * s;
      top = std::max(top, p[j]);
    }
    for (double& s : p) total += (s = std::exp(s - top));
    lse[h] = top + std::log(total);
    for (int64_t i = 0; i < d; ++i) {
      for (int64_t j = 0; j < len; ++j) out[h * d + i] += p[j] / total * v[j * stride + i];
    }
  }
}

// Head sizes for every path of attend on an x86 host with AVX-512: 16-256 the AVX-512 kernel (one to
// sixteen vectors), 8, 24 and 40 the AVX2 kernel (not a multiple of 16), 6 and 20 the portable loop;
// lengths around the kernels' steps of four keys and two values; rows further apart than head_dim, as
// in a cache of several heads.
void test_attend_against_double() {
  for (int64_t d : {6, 8, 16, 20, 24, 32, 40, 64, 80, 128, 256}) {
    const int64_t stride = d + 8;
    for (int64_t group : {1, 2, 3, 4, 7}) {  // one pass of several heads, and what is left over one by one
      for (int64_t len : {1, 2, 3, 4, 5, 7, 33, 130}) {
        std::vector<float> q = normal(group * d, 4), k = normal(len * stride, 5), v = normal(len * stride, 6);
        std::vector<float> scores(group * len), out(group * d), lse(group);
        const float scale = 1.0f / std::sqrt(static_cast<float>(d));
        attend(q.data(), group, k.data(), v.data(), len, d, stride, scale, scores.data(), out.data(),
               lse.data());
        std::vector<double> want, want_lse;
        attend_double(q, k, v, group, len, d, stride, scale, want, want_lse);
        for (int64_t i = 0; i < group * d; ++i) CHECK(close(out[i], want[i], 1e-4));
        for (int64_t h = 0; h < group; ++h) CHECK(close(lse[h], want_lse[h], 1e-5));
      }
    }
  }
}

void test_merge_attention_worked_example() {
  // One head of one float: ranges with out 1 and 3 and lse log 1 and log 3 -> (1 * 1 + 3 * 3) / 4.
  const float outs[] = {1.0f, 3.0f}, lses[] = {0.0f, std::log(3.0f)};
  float out = 0;
  merge_attention(outs, lses, 2, 1, 1, &out);
  CHECK(close(out, 2.5));
}

// Attention over all rows equals the merge of attentions over any split of them into ranges: what
// the quantized decoder's threads do.
void test_merge_attention_of_ranges() {
  const int64_t d = 64, group = 3, len = 300, stride = d;
  std::vector<float> q = normal(group * d, 9), k = normal(len * stride, 10), v = normal(len * stride, 11);
  std::vector<float> scores(group * len), whole(group * d);
  attend(q.data(), group, k.data(), v.data(), len, d, stride, 0.125f, scores.data(), whole.data());
  for (int64_t chunks : {1, 2, 3, 7}) {
    std::vector<float> outs(chunks * group * d), lses(chunks * group), merged(group * d);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t from = len * c / chunks, rows = len * (c + 1) / chunks - from;
      attend(q.data(), group, k.data() + from * stride, v.data() + from * stride, rows, d, stride, 0.125f,
             scores.data(), outs.data() + c * group * d, lses.data() + c * group);
    }
    merge_attention(outs.data(), lses.data(), chunks, group, d, merged.data());
    for (int64_t i = 0; i < group * d; ++i) CHECK(close(merged[i], whole[i], 1e-5));
  }
}

void test_silu_mul_against_double() {
  // 101 inputs (a tail past the vector width), gates from -100 to 100 (e^-|g| underflows at both ends), and
  // in place (y = gate), as the decoders call it.
  std::vector<float> g = normal(101, 7), u = normal(101, 8), y(101);
  for (int i = 0; i < 101; i += 5) g[i] *= 50.0f;
  g[1] = -100.0f, g[2] = 100.0f, g[3] = 0.0f;
  silu_mul(g.data(), u.data(), 101, y.data());
  for (int i = 0; i < 101; ++i) CHECK(close(y[i], g[i] / (1 + std::exp(-double(g[i]))) * u[i]));
  std::vector<float> same = g;
  silu_mul(same.data(), u.data(), 101, same.data());
  for (int i = 0; i < 101; ++i) CHECK(same[i] == y[i]);
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"rotate_half_worked_example", test_rotate_half_worked_example},
      {"rotate_half_keeps_norms_per_pair", test_rotate_half_keeps_norms_per_pair},
      {"rms_norm_against_double", test_rms_norm_against_double},
      {"attend_against_double", test_attend_against_double},
      {"merge_attention_worked_example", test_merge_attention_worked_example},
      {"merge_attention_of_ranges", test_merge_attention_of_ranges},
      {"silu_mul_against_double", test_silu_mul_against_double},
  };
  return mtprobe_test::run_tests(tests);
}
