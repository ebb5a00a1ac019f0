#include "core/decoder_step.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/bf16.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MTPROBE_X86_SIMD 1
#include <immintrin.h>
#endif

namespace mtprobe::core {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;

// GELU's tanh form, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) = x sigmoid(2 sqrt(2 / pi) (..)).
float gelu_tanh(float x) {
  const float z = 2.0f * kSqrt2OverPi * (x + 0.044715f * x * x * x);
  return x / (1.0f + std::exp(-z));
}

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

// y = silu(gate) * up = gate * sigmoid(gate) * up, 8 at a time: sigmoid from e = e^-|gate| (exp_avx2's
// range), 1 / (1 + e) for gate >= 0 and e / (1 + e) below. A one-token forward runs 46k of them (SmolLM2),
// which through libm's expf one at a time cost about as much as a layer's attention.
__attribute__((target("avx2,fma"))) void silu_mul_avx2(const float* gate, const float* up, int64_t n,
                                                       float* y) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_avx2(_mm256_or_ps(g, sign));                                    // e^-|g|
    const __m256 s = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));  // blend on g's sign
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(g, s), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) y[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// y[i] = x sigmoid(2 u) * up[i] with x = gate[i], u = sqrt(2 / pi) (x + 0.044715 x^3): GELU's tanh form,
// 0.5 x (1 + tanh u), written through the sigmoid as silu_mul_avx2 computes it.
__attribute__((target("avx2,fma"))) void gelu_tanh_mul_avx2(const float* gate, const float* up, int64_t n,
                                                            float* y) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  const __m256 c = _mm256_set1_ps(2.0f * kSqrt2OverPi), cube = _mm256_set1_ps(0.044715f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 z = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(cube, g), _mm256_mul_ps(g, g), g));
    const __m256 e = exp_avx2(_mm256_or_ps(z, sign));                                    // e^-|z|
    const __m256 s = _mm256_div_ps(_mm256_blendv_ps(one, e, z), _mm256_add_ps(one, e));  // sigmoid(z)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(g, s), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) y[i] = gelu_tanh(gate[i]) * up[i];
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
// The attention kernel at two widths (attend_simd.inc): AVX-512 where the CPU has it, else AVX2.
// GCC 12's AVX-512 extracting and reducing intrinsics start from an "undefined" vector, which
// -Wmaybe-uninitialized reports as a use of an uninitialized value (a false positive inside its own
// header, as quantized_linear.cpp meets).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define MTPROBE_SIMD __attribute__((target("avx512f,avx512dq,avx2,fma")))
namespace avx512 {
using Vec = __m512;
constexpr int64_t kWidth = 16;
constexpr int kRegisters = 32;
MTPROBE_SIMD inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
MTPROBE_SIMD inline Vec load(const uint16_t* p) {  // bfloat16 bits into the upper halves of floats
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
MTPROBE_SIMD inline void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
MTPROBE_SIMD inline Vec set1(float x) { return _mm512_set1_ps(x); }
MTPROBE_SIMD inline Vec zero() { return _mm512_setzero_ps(); }
MTPROBE_SIMD inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
MTPROBE_SIMD inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
MTPROBE_SIMD inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }

// out[0..3] = the sums of a, b, c and d: halves added, then three horizontal adds for all four.
MTPROBE_SIMD inline void sum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
  const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

// e^x for x <= 0, 16 at a time: exp_avx2's polynomial, the power of two applied by scalef.
MTPROBE_SIMD inline Vec exp_le0(Vec x) {
  x = _mm512_max_ps(x, set1(-87.3f));
  const Vec fx = _mm512_roundscale_ps(fmadd(x, set1(1.44269504088896341f), set1(0.5f)),
                                      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, set1(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, set1(-2.12194440e-4f), x);
  Vec y = set1(1.9875691500E-4f);
  y = fmadd(y, x, set1(1.3981999507E-3f));
  y = fmadd(y, x, set1(8.3334519073E-3f));
  y = fmadd(y, x, set1(4.1665795894E-2f));
  y = fmadd(y, x, set1(1.6666665459E-1f));
  y = fmadd(y, x, set1(5.0000001201E-1f));
  y = fmadd(y, mul(x, x), add(x, set1(1.0f)));
  return _mm512_scalef_ps(y, fx);
}

MTPROBE_SIMD inline float exp_shifted(float* scores, int64_t len, float top) {
  const Vec t = set1(top);
  Vec acc = zero();
  int64_t j = 0;
  for (; j + kWidth <= len; j += kWidth) {
    const Vec e = exp_le0(_mm512_sub_ps(load(scores + j), t));
    store(scores + j, e);
    acc = add(acc, e);
  }
  float total = _mm512_reduce_add_ps(acc);
  for (; j < len; ++j) total += (scores[j] = std::exp(scores[j] - top));
  return total;
}

#include "core/attend_simd.inc"
}  // namespace avx512
#undef MTPROBE_SIMD
#pragma GCC diagnostic pop

#define MTPROBE_SIMD __attribute__((target("avx2,fma")))
namespace avx2 {
using Vec = __m256;
constexpr int64_t kWidth = 8;
constexpr int kRegisters = 16;
MTPROBE_SIMD inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
MTPROBE_SIMD inline Vec load(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
MTPROBE_SIMD inline void store(float* p, Vec x) { _mm256_storeu_ps(p, x); }
MTPROBE_SIMD inline Vec set1(float x) { return _mm256_set1_ps(x); }
MTPROBE_SIMD inline Vec zero() { return _mm256_setzero_ps(); }
MTPROBE_SIMD inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
MTPROBE_SIMD inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
MTPROBE_SIMD inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }

MTPROBE_SIMD inline void sum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

MTPROBE_SIMD inline float exp_shifted(float* scores, int64_t len, float top) {
  return exp_shifted_avx2(scores, len, top);
}

#include "core/attend_simd.inc"
}  // namespace avx2
#undef MTPROBE_SIMD

bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
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
            int64_t stride, float scale, float* scores, float* out, float* lse) {
#ifdef MTPROBE_X86_SIMD
  if (has_avx512() && avx512::attend_simd(q, group, k, v, len, head_dim, stride, scale, scores, out, lse))
    return;
  if (has_avx2() && avx2::attend_simd(q, group, k, v, len, head_dim, stride, scale, scores, out, lse)) return;
#endif
  // Any head size: key by key and value by value for the whole group, each cached row read once for
  // its `group` query heads (grouped-query attention).
  for (int64_t j = 0; j < len; ++j) {
    const float* kj = k + j * stride;
    for (int64_t h = 0; h < group; ++h) scores[h * len + j] = dot(q + h * head_dim, kj, head_dim) * scale;
  }
  std::fill(out, out + group * head_dim, 0.0f);
  std::vector<float> inv(static_cast<size_t>(group));
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores + h * len;
    const float top = *std::max_element(s, s + len);
    const float total = exp_shifted(s, len, top);
    inv[h] = 1.0f / total;
    if (lse != nullptr) lse[h] = top + std::log(total);
  }
  for (int64_t j = 0; j < len; ++j) {
    const float* vj = v + j * stride;
    for (int64_t h = 0; h < group; ++h) axpy(scores[h * len + j] * inv[h], vj, out + h * head_dim, head_dim);
  }
}

void attend(const float* q, int64_t group, const uint16_t* k, const uint16_t* v, int64_t len,
            int64_t head_dim, int64_t stride, float scale, float* scores, float* out, float* lse) {
#ifdef MTPROBE_X86_SIMD
  if (has_avx512() && avx512::attend_simd(q, group, k, v, len, head_dim, stride, scale, scores, out, lse))
    return;
  if (has_avx2() && avx2::attend_simd(q, group, k, v, len, head_dim, stride, scale, scores, out, lse)) return;
#endif
  // Other head sizes and CPUs: the rows widened into float32, then attend's float path (slower, rare).
  std::vector<float> kf(static_cast<size_t>(len * head_dim)), vf(kf.size());
  for (int64_t j = 0; j < len; ++j) {
    for (int64_t i = 0; i < head_dim; ++i) {
      kf[j * head_dim + i] = bf16_to_float(k[j * stride + i]);
      vf[j * head_dim + i] = bf16_to_float(v[j * stride + i]);
    }
  }
  attend(q, group, kf.data(), vf.data(), len, head_dim, head_dim, scale, scores, out, lse);
}

void merge_attention(const float* outs, const float* lses, int64_t chunks, int64_t group, int64_t head_dim,
                     float* out) {
  for (int64_t h = 0; h < group; ++h) {
    float top = lses[h];
    for (int64_t c = 1; c < chunks; ++c) top = std::max(top, lses[c * group + h]);
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) total += std::exp(lses[c * group + h] - top);
    float* o = out + h * head_dim;
    std::fill(o, o + head_dim, 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float w = std::exp(lses[c * group + h] - top) / total;
      axpy(w, outs + (c * group + h) * head_dim, o, head_dim);
    }
  }
}

void gelu_tanh_mul(const float* gate, const float* up, int64_t n, float* y) {
#ifdef MTPROBE_X86_SIMD
  if (has_avx2()) return gelu_tanh_mul_avx2(gate, up, n, y);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = gelu_tanh(gate[i]) * up[i];
}

void silu_mul(const float* gate, const float* up, int64_t n, float* y) {
#ifdef MTPROBE_X86_SIMD
  if (has_avx2()) return silu_mul_avx2(gate, up, n, y);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

}  // namespace mtprobe::core
