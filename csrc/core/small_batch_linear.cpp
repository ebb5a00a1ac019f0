#include "core/small_batch_linear.h"

#include <algorithm>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MTPROBE_X86_SIMD 1
#include <immintrin.h>
#endif

namespace mtprobe::core {
namespace {

// Inputs per pass over a weight row: 12 accumulators of 8 lanes, the row's vector and one input's
// fit the 16 AVX2 registers; more rows take another pass over the (then cached) weight rows.
constexpr int kMaxRowsPerPass = 12;

// One pass: rows [0, R) of x (row stride ldx) against weight rows [begin, end).
template <int R>
void pass_scalar(const float* x, int64_t ldx, int64_t in, const float* w, const float* bias, float* y,
                 int64_t ldy, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const float* wn = w + n * in;
    for (int r = 0; r < R; ++r) {
      // The SIMD path's 8 partial sums, added in its order (it fuses each multiply-add, this does not).
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= in; k += 8) {
        for (int l = 0; l < 8; ++l) part[l] += x[r * ldx + k + l] * wn[k + l];
      }
      float s = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
      for (; k < in; ++k) s += x[r * ldx + k] * wn[k];
      y[r * ldy + n] = bias ? s + bias[n] : s;
    }
  }
}

#ifdef MTPROBE_X86_SIMD
__attribute__((target("avx2,fma"))) inline float sum_lanes(__m256 v) {
  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), as pass_scalar adds them.
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // [l0+l4 .. l3+l7]
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));  // [(0+4)+(2+6), (1+5)+(3+7)]
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R>
__attribute__((target("avx2,fma"))) void pass_avx2(const float* x, int64_t ldx, int64_t in, const float* w,
                                                   const float* bias, float* y, int64_t ldy, int64_t begin,
                                                   int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const float* wn = w + n * in;
    __m256 acc[R];  // acc[r]: 8 partial sums of row r's dot product with weight row n
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= in; k += 8) {
      const __m256 wv = _mm256_loadu_ps(wn + k);  // the weight is read once for all R rows
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + k), wv, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float s = sum_lanes(acc[r]);
      for (int64_t j = k; j < in; ++j) s += x[r * ldx + j] * wn[j];
      y[r * ldy + n] = bias ? s + bias[n] : s;
    }
  }
}

bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

using Pass = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*, int64_t, int64_t,
                      int64_t);

Pass scalar_pass(int r) {
  static constexpr Pass table[kMaxRowsPerPass + 1] = {
      nullptr,         pass_scalar<1>,  pass_scalar<2>, pass_scalar<3>, pass_scalar<4>,
      pass_scalar<5>,  pass_scalar<6>,  pass_scalar<7>, pass_scalar<8>, pass_scalar<9>,
      pass_scalar<10>, pass_scalar<11>, pass_scalar<12>};
  return table[r];
}

#ifdef MTPROBE_X86_SIMD
Pass avx2_pass(int r) {
  static constexpr Pass table[kMaxRowsPerPass + 1] = {
      nullptr,      pass_avx2<1>, pass_avx2<2>, pass_avx2<3>,  pass_avx2<4>,  pass_avx2<5>, pass_avx2<6>,
      pass_avx2<7>, pass_avx2<8>, pass_avx2<9>, pass_avx2<10>, pass_avx2<11>, pass_avx2<12>};
  return table[r];
}
#endif

}  // namespace

bool small_batch_linear_simd() {
#ifdef MTPROBE_X86_SIMD
  return cpu_has_avx2_fma();
#else
  return false;
#endif
}

void small_batch_linear(const float* x, int64_t rows, int64_t in_features, const float* weight,
                        const float* bias, float* y, int64_t out_features, int64_t out_begin, int64_t out_end,
                        bool simd) {
  simd = simd && small_batch_linear_simd();
  // Weight rows in tiles that stay in L2 while every pass over the inputs reuses them.
  constexpr int64_t kTile = 32;
  for (int64_t n0 = out_begin; n0 < out_end; n0 += kTile) {
    const int64_t n1 = std::min(out_end, n0 + kTile);
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRowsPerPass) {
      const int r = static_cast<int>(std::min<int64_t>(kMaxRowsPerPass, rows - r0));
#ifdef MTPROBE_X86_SIMD
      Pass pass = simd ? avx2_pass(r) : scalar_pass(r);
#else
      (void)simd;
      Pass pass = scalar_pass(r);
#endif
      pass(x + r0 * in_features, in_features, in_features, weight, bias, y + r0 * out_features, out_features,
           n0, n1);
    }
  }
}

}  // namespace mtprobe::core
