// csrc/core/panel_linear.h: the packed layout, the worked example, and every kernel this CPU runs against a
// double-precision loop over awkward shapes (within float32's rounding bound for a sum of `in` fused terms)
// and against each other bit for bit; panel ranges as threads split them; bfloat16 panels.
// tests/test_panel_linear.py checks the ATen ops against the PyTorch reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/bf16.h"
#include "core/panel_linear.h"
#include "harness.h"

using namespace mtprobe::core;

namespace {

std::vector<SimdLevel> levels() {
  std::vector<SimdLevel> out;
  for (SimdLevel l : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (panel_linear_supported(l)) out.push_back(l);
  }
  return out;
}

void test_layout() {
  const int64_t out = 35, in = 3;
  std::vector<float> w(out * in);
  for (int64_t i = 0; i < out * in; ++i) w[i] = static_cast<float>(i + 1);
  CHECK(panel_count(out) == 2 && panel_count(32) == 1 && panel_count(0) == 0);
  std::vector<float> panels(panel_count(out) * in * kPanelWidth, -1.0f);
  pack_panels(w.data(), out, in, panels.data());
  for (int64_t p = 0; p < 2; ++p)
    for (int64_t k = 0; k < in; ++k)
      for (int64_t j = 0; j < kPanelWidth; ++j) {
        const int64_t n = p * kPanelWidth + j;
        CHECK(panels[(p * in + k) * kPanelWidth + j] == (n < out ? w[n * in + k] : 0.0f));
      }
}

void test_worked_example() {
  const float x[] = {1, 2, 3, 4};        // [2, 2]
  const float w[] = {1, 0, 1, 1, 0, 2};  // [3, 2]
  const float b[] = {0, 0, 1};
  const float expected[] = {1, 3, 5, 3, 7, 9};
  std::vector<float> panels(2 * kPanelWidth);
  pack_panels(w, 3, 2, panels.data());
  CHECK(panels[0] == 1 && panels[1] == 1 && panels[2] == 0 && panels[32] == 0 && panels[33] == 1 &&
        panels[34] == 2);
  for (SimdLevel simd : levels()) {
    float y[6] = {};
    panel_linear(x, 2, 2, panels.data(), b, y, 3, 0, 1, simd);
    for (int i = 0; i < 6; ++i) CHECK(y[i] == expected[i]);
  }
}

// No inputs, or an empty panel range: nothing is written. No features in: the bias (or zeros).
void test_empty_calls() {
  const float x[] = {1, 2};
  std::vector<float> panels(kPanelWidth * 2, 1.0f);
  for (SimdLevel simd : levels()) {
    float y[2] = {-1, -1};
    panel_linear(x, 0, 2, panels.data(), nullptr, y, 2, 0, 1, simd);
    panel_linear(x, 1, 2, panels.data(), nullptr, y, 2, 1, 1, simd);
    CHECK(y[0] == -1 && y[1] == -1);
    const float b[] = {5, 6};
    panel_linear(x, 1, 0, panels.data(), b, y, 2, 0, 1, simd);
    CHECK(y[0] == 5 && y[1] == 6);
  }
}

// Every (rows, in, out) against the double sum, each output within gamma_m * sum |x w| (blocks of 64
// fused multiply-adds, then their sums) plus the bias's rounding; every kernel bit for bit the portable
// loop's; in panel ranges as a thread pool splits them; bfloat16 panels on their widened values.
void test_shapes_against_double() {
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const double u = std::ldexp(1.0, -24);
  for (int64_t rows : {1, 2, 5, 6, 7, 12, 13, 14, 26, 27, 40}) {
    for (int64_t in : {1, 7, 16, 33, 577}) {
      for (int64_t out : {1, 16, 17, 32, 33, 70, 96}) {
        for (bool bf16 : {false, true}) {
          std::vector<float> x(rows * in), w(out * in), b(out);
          for (float& v : x) v = normal(gen);
          for (float& v : w) v = normal(gen);
          for (float& v : b) v = normal(gen);
          std::vector<uint16_t> wb(out * in);
          if (bf16) {
            for (int64_t i = 0; i < out * in; ++i) {
              wb[i] = float_to_bf16(w[i]);
              w[i] = bf16_to_float(wb[i]);
            }
          }
          const int64_t count = panel_count(out);
          std::vector<float> panels(count * in * kPanelWidth);
          std::vector<uint16_t> panels_bf16(count * in * kPanelWidth);
          pack_panels(w.data(), out, in, panels.data());
          pack_panels(wb.data(), out, in, panels_bf16.data());
          // Blocks of 64 fused terms, their sums then added: gamma_(min(in, 64) + ceil(in / 64)).
          const double m = static_cast<double>(std::min<int64_t>(in, 64) + (in + 63) / 64);
          const double gamma = m * u / (1 - m * u);
          std::vector<float> portable;
          for (SimdLevel simd : levels()) {
            auto call = [&](float* y, int64_t begin, int64_t end) {
              if (bf16) {
                panel_linear(x.data(), rows, in, panels_bf16.data(), b.data(), y, out, begin, end, simd);
              } else {
                panel_linear(x.data(), rows, in, panels.data(), b.data(), y, out, begin, end, simd);
              }
            };
            std::vector<float> whole(rows * out, NAN), split(rows * out, NAN);
            call(whole.data(), 0, count);
            for (int64_t p = 0; p < count; p += 2) call(split.data(), p, p + 2 < count ? p + 2 : count);
            if (portable.empty()) portable = whole;  // kScalar comes first
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t n = 0; n < out; ++n) {
                double exact = b[n], mag = 0.0;
                for (int64_t k = 0; k < in; ++k) {
                  exact += static_cast<double>(x[r * in + k]) * w[n * in + k];
                  mag += std::fabs(static_cast<double>(x[r * in + k]) * w[n * in + k]);
                }
                const double bound = gamma * mag + u * (std::fabs(exact) + mag) + 1e-30;
                CHECK(std::fabs(whole[r * out + n] - exact) <= bound);
                CHECK(split[r * out + n] == whole[r * out + n]);
                CHECK(whole[r * out + n] == portable[r * out + n]);
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"layout", test_layout},
      {"worked_example", test_worked_example},
      {"empty_calls", test_empty_calls},
      {"shapes_against_double", test_shapes_against_double},
  };
  return mtprobe_test::run_tests(tests);
}
