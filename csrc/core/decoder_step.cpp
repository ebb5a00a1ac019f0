#include "core/decoder_step.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MTPROBE_X86_SIMD 1
#include <immintrin.h>
#endif

namespace mtprobe::core {
namespace {

// Attention over a long context is dot products, exponentials and scaled adds over head_dim floats:
// without SIMD (float sums are not reassociated by the compiler) it cost more than HF's whole
// attention from a few hundred cached tokens on. The AVX2 paths below run where the CPU has AVX2/FMA.
#ifdef MTPROBE_X86_SIMD
bool has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float total = _mm_cvtss_f32(s);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// y += p * x
__attribute__((target("avx2,fma"))) void axpy_avx2(float p, const float* x, float* y, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += p * x[i];
}

// e^x for x <= 0 (softmax's shifted scores), 8 at a time: Cephes' expf, relative error about 1e-7.
__attribute__((target("avx2,fma"))) __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // below, e^x is under float's normal range: 0 in effect
  const __m256 fx =
      _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// scores[j] <- e^(scores[j] - top) for j < len; returns their sum.
__attribute__((target("avx2,fma"))) float exp_shifted_avx2(float* scores, int64_t len, float top) {
  const __m256 t = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + j), t));
    _mm256_storeu_ps(scores + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float total = 0.0f;
  for (float v : lanes) total += v;
  for (; j < len; ++j) total += (scores[j] = std::exp(scores[j] - top));
  return total;
}
#endif

float dot(const float* a, const float* b, int64_t n) {
#ifdef MTPROBE_X86_SIMD
  if (has_avx2()) return dot_avx2(a, b, n);
#endif
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(float p, const float* x, float* y, int64_t n) {
#ifdef MTPROBE_X86_SIMD
  if (has_avx2()) return axpy_avx2(p, x, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

float exp_shifted(float* scores, int64_t len, float top) {
#ifdef MTPROBE_X86_SIMD
  if (has_avx2()) return exp_shifted_avx2(scores, len, top);
#endif
  float total = 0.0f;
  for (int64_t j = 0; j < len; ++j) total += (scores[j] = std::exp(scores[j] - top));
  return total;
}

}  // namespace

void rms_norm(const float* x, const float* w, float eps, int64_t n, float* y) {
  double ss = 0.0;  // a few hundred squares: double keeps the sum as exact as HF's float32 mean
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

void rotate_half(float* x, int64_t heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* a = x + h * head_dim;
    float* b = a + half;
    for (int64_t i = 0; i < half; ++i) {
      const float ai = a[i], bi = b[i];
      a[i] = ai * cos[i] - bi * sin[i];
      b[i] = bi * cos[i] + ai * sin[i];
    }
  }
}

void attend(const float* q, int64_t group, const float* k, const float* v, int64_t len, int64_t head_dim,
            int64_t stride, float scale, float* scores, float* out) {
  // Key by key and value by value for the whole group: each cached row is read once for its `group`
  // query heads (grouped-query attention), not once per head.
  for (int64_t j = 0; j < len; ++j) {
    const float* kj = k + j * stride;
    for (int64_t h = 0; h < group; ++h) scores[h * len + j] = dot(q + h * head_dim, kj, head_dim) * scale;
  }
  std::fill(out, out + group * head_dim, 0.0f);
  std::vector<float> inv(static_cast<size_t>(group));
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores + h * len;
    inv[h] = 1.0f / exp_shifted(s, len, *std::max_element(s, s + len));
  }
  for (int64_t j = 0; j < len; ++j) {
    const float* vj = v + j * stride;
    for (int64_t h = 0; h < group; ++h) axpy(scores[h * len + j] * inv[h], vj, out + h * head_dim, head_dim);
  }
}

void silu_mul(const float* gate, const float* up, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

}  // namespace mtprobe::core
