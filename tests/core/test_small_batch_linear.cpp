// csrc/core/small_batch_linear.h: the worked example, and every path (AVX-512 and AVX2/FMA where this
// CPU has them, and the portable loop) against a double-precision loop over awkward shapes, within
// float32's rounding bound; column ranges as threads split them. tests/test_small_batch_linear.py checks the
// ATen op against the PyTorch reference.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/small_batch_linear.h"
#include "harness.h"

using namespace mtprobe::core;

namespace {

// Every kernel this CPU runs.
std::vector<SimdLevel> levels() {
  std::vector<SimdLevel> out;
  for (SimdLevel l : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (small_batch_linear_supported(l)) out.push_back(l);
  }
  return out;
}

void test_worked_example() {
  const float x[] = {1, 2, 3, 4};        // [2, 2]
  const float w[] = {1, 0, 1, 1, 0, 2};  // [3, 2]
  const float b[] = {0, 0, 1};
  const float expected[] = {1, 3, 5, 3, 7, 9};
  for (SimdLevel simd : levels()) {
    float y[6] = {};
    small_batch_linear(x, 2, 2, w, b, y, 3, 0, 3, simd);
    for (int i = 0; i < 6; ++i) CHECK(y[i] == expected[i]);
  }
}

// No inputs, or an empty column range: nothing is written, on either path.
void test_empty_calls_write_nothing() {
  const float x[] = {1, 2};
  const float w[] = {1, 1, 2, 2};
  for (SimdLevel simd : levels()) {
    float y[2] = {-1, -1};
    small_batch_linear(x, 0, 2, w, nullptr, y, 2, 0, 2, simd);
    small_batch_linear(x, 1, 2, w, nullptr, y, 2, 1, 1, simd);
    CHECK(y[0] == -1 && y[1] == -1);
  }
}

// Every (rows, in, out) below against the double sum, each output within gamma_m * sum |x w|
// (m = ceil(in / 8) + 3; AVX-512's 16 partial sums of ceil(in / 16) terms and 4 levels of adding
// them fit it for these lengths), computed in one call and in column ranges split as a thread pool would.
void test_shapes_against_double() {
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const double u = std::ldexp(1.0, -24);
  for (int64_t rows : {1, 2, 3, 4, 5, 7, 8, 12, 13, 25, 32, 33}) {
    for (int64_t in : {1, 7, 8, 9, 33, 577}) {
      for (int64_t out : {1, 5, 64, 67}) {
        for (bool with_bias : {true, false}) {
          std::vector<float> x(rows * in), w(out * in), b(out);
          for (float& v : x) v = normal(gen);
          for (float& v : w) v = normal(gen);
          for (float& v : b) v = normal(gen);
          const float* bias = with_bias ? b.data() : nullptr;
          const double m = static_cast<double>((in + 7) / 8 + 3);
          const double gamma = m * u / (1 - m * u);
          for (SimdLevel simd : levels()) {
            std::vector<float> whole(rows * out, NAN), split(rows * out, NAN);
            small_batch_linear(x.data(), rows, in, w.data(), bias, whole.data(), out, 0, out, simd);
            for (int64_t c = 0; c < out; c += 13)
              small_batch_linear(x.data(), rows, in, w.data(), bias, split.data(), out, c,
                                 c + 13 < out ? c + 13 : out, simd);
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t n = 0; n < out; ++n) {
                double exact = with_bias ? b[n] : 0.0, mag = 0.0;
                for (int64_t k = 0; k < in; ++k) {
                  exact += static_cast<double>(x[r * in + k]) * w[n * in + k];
                  mag += std::fabs(static_cast<double>(x[r * in + k]) * w[n * in + k]);
                }
                // The bias is added last: one more rounding of the sum's size.
                const double bound = gamma * mag + u * (std::fabs(exact) + mag) + 1e-30;
                CHECK(std::fabs(whole[r * out + n] - exact) <= bound);
                CHECK(split[r * out + n] == whole[r * out + n]);  // columns are independent
              }
            }
          }
        }
      }
    }
  }
}

// The AVX2 and portable paths add the same 8 partial sums in the same order; only the fused multiply-add
// differs, so on integer-valued inputs (every product and sum exact) they agree bit for bit, and so does
// the AVX-512 path, whose sums are exact there too.
void test_paths_agree_on_exact_inputs() {
  std::mt19937 gen(3);
  std::uniform_int_distribution<int> small(-4, 4);
  const int64_t rows = 5, in = 45, out = 70;
  std::vector<float> x(rows * in), w(out * in);
  for (float& v : x) v = static_cast<float>(small(gen));
  for (float& v : w) v = static_cast<float>(small(gen));
  std::vector<float> s(rows * out);
  small_batch_linear(x.data(), rows, in, w.data(), nullptr, s.data(), out, 0, out, SimdLevel::kScalar);
  for (SimdLevel level : levels()) {
    std::vector<float> a(rows * out);
    small_batch_linear(x.data(), rows, in, w.data(), nullptr, a.data(), out, 0, out, level);
    for (int64_t i = 0; i < rows * out; ++i) CHECK(a[i] == s[i]);
  }
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"worked_example", test_worked_example},
      {"empty_calls_write_nothing", test_empty_calls_write_nothing},
      {"shapes_against_double", test_shapes_against_double},
      {"paths_agree_on_exact_inputs", test_paths_agree_on_exact_inputs},
  };
  return mtprobe_test::run_tests(tests);
}
