#include "core/quantized_linear.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MTPROBE_X86_SIMD 1
#include <immintrin.h>
#endif

namespace mtprobe::core {
namespace {

constexpr int64_t kHalf = kQuantGroup / 2;
constexpr int kMaxRows = 4;  // inputs per pass over a weight row

// Bytes of one group's codes, and of one weight row's.
constexpr int64_t group_bytes(QuantFormat f) { return f == QuantFormat::kQ4_1 ? kHalf : kQuantGroup; }

// `level` where the CPU runs it, else (and for kDefault) the best it runs; `wide`: whether it has the
// kAvx512 kernel's instructions (the float kernels' AVX-512, the integer ones' AVX-512 VNNI).
inline SimdLevel runnable(SimdLevel level, bool wide, bool avx2) {
  if (level == SimdLevel::kDefault || (level == SimdLevel::kAvx512 && !wide) ||
      (level == SimdLevel::kAvx2 && !avx2)) {
    return wide ? SimdLevel::kAvx512 : avx2 ? SimdLevel::kAvx2 : SimdLevel::kScalar;
  }
  return level;
}

// Inputs [0, rows) in passes of up to kMaxRows: each(r0, rr) for each pass's first input and count.
template <typename Each>
void in_passes(int64_t rows, Each&& each) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) each(r0, rows - r0 < kMaxRows ? rows - r0 : kMaxRows);
}

// run(F) with the format as a std::integral_constant: the kernels are templates on it.
template <typename Run>
void by_format(QuantFormat format, Run&& run) {
  if (format == QuantFormat::kQ4_1) {
    run(std::integral_constant<QuantFormat, QuantFormat::kQ4_1>{});
  } else {
    run(std::integral_constant<QuantFormat, QuantFormat::kQ8_0>{});
  }
}

// The register block of a pass of rr (1..4) inputs: block(NC, R), both std::integral_constant, with more
// columns at a time for fewer inputs, so that every pass keeps about four independent accumulators in flight.
template <typename Block>
void by_inputs(int64_t rr, Block&& block) {
  using std::integral_constant;
  switch (rr) {
    case 1:
      block(integral_constant<int, 4>{}, integral_constant<int, 1>{});
      break;
    case 2:
      block(integral_constant<int, 2>{}, integral_constant<int, 2>{});
      break;
    case 3:
      block(integral_constant<int, 1>{}, integral_constant<int, 3>{});
      break;
    default:
      block(integral_constant<int, 1>{}, integral_constant<int, 4>{});
      break;
  }
}

template <QuantFormat F>
void rows_scalar(const float* x, const float* xsum, int64_t rows, int64_t in, const uint8_t* codes,
                 const float* scale, const float* min, const float* bias, float* y, int64_t ldy,
                 int64_t begin, int64_t end) {
  const int64_t groups = in / kQuantGroup;
  const int64_t row_bytes = groups * group_bytes(F);
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * in;
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* b = codes + n * row_bytes + g * group_bytes(F);
        const float* xg = xr + g * kQuantGroup;
        float d = 0.0f;
        for (int64_t j = 0; j < kHalf; ++j) {
          if constexpr (F == QuantFormat::kQ4_1) {
            d += xg[j] * static_cast<float>(b[j] & 0x0F) + xg[kHalf + j] * static_cast<float>(b[j] >> 4);
          } else {
            d += xg[j] * static_cast<float>(static_cast<int8_t>(b[j])) +
                 xg[kHalf + j] * static_cast<float>(static_cast<int8_t>(b[kHalf + j]));
          }
        }
        acc += scale[n * groups + g] * d;
        if constexpr (F == QuantFormat::kQ4_1) acc += min[n * groups + g] * xsum[r * groups + g];
      }
      y[r * ldy + n] = bias ? acc + bias[n] : acc;
    }
  }
}

#ifdef MTPROBE_X86_SIMD
bool has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has;
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_g min_n[g] * xsum_r[g], 8 groups at a time.
__attribute__((target("avx2,fma"))) inline float min_term(const float* min_n, const float* xsum_r,
                                                          int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(min_n + g), _mm256_loadu_ps(xsum_r + g), acc);
  float m = hsum(acc);
  for (; g < groups; ++g) m += min_n[g] * xsum_r[g];
  return m;
}

// A group's 32 weights as codes in float32, in x's order: four vectors of 8 (AVX2).
template <QuantFormat F>
__attribute__((target("avx2,fma"))) inline void unpack8(const uint8_t* b, __m256 w[4]) {
  if constexpr (F == QuantFormat::kQ4_1) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i lo = _mm_and_si128(v, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    for (int k = 0; k < 4; ++k) {
      w[k] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * k))));
    }
  }
}

// GCC 12's AVX-512 widening and extracting intrinsics start from an "undefined" vector, which
// -Wmaybe-uninitialized reports as a use of an uninitialized value (a false positive inside its own
// header; small_batch_linear.cpp meets the same).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// A group's 32 weights as two vectors of 16 (AVX-512: one widening shuffle per 16 codes, AVX2's
// kernel needs one per 8, and that shuffle port is what both wait on).
template <QuantFormat F>
__attribute__((target("avx512f,avx512bw,avx2,fma"))) inline void unpack16(const uint8_t* b, __m512 w[2]) {
  if constexpr (F == QuantFormat::kQ4_1) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low)));
  } else {
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))));
    w[1] =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16))));
  }
}

__attribute__((target("avx512f,avx512bw,avx2,fma"))) inline float hsum(__m512 v) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(v),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

// Two blocks ahead: the weight rows [ahead, ahead_end) (and their scales and minima) the core wants
// after this block and the next, fetched while this block computes rather than after it.
struct Prefetch {
  const char* next;
  const char* end;
};

template <QuantFormat F>
inline Prefetch prefetch_block(const uint8_t* codes, const float* scale, const float* min, int64_t groups,
                               int64_t n, int64_t nc, int64_t end) {
  const int64_t row_bytes = groups * group_bytes(F);
  const int64_t ahead = n + 2 * nc < end ? n + 2 * nc : end;
  const int64_t ahead_end = ahead + nc < end ? ahead + nc : end;
  for (int64_t at = ahead * groups; at < ahead_end * groups; at += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(scale + at), _MM_HINT_T0);
    if (F == QuantFormat::kQ4_1) _mm_prefetch(reinterpret_cast<const char*>(min + at), _MM_HINT_T0);
  }
  return {reinterpret_cast<const char*>(codes + ahead * row_bytes),
          reinterpret_cast<const char*>(codes + ahead_end * row_bytes)};
}

// One cache line of the codes two blocks ahead. Q8_0's into L2: its rows are twice Q4_1's bytes for the same
// arithmetic, so the stream is what bounds it, and on a 2-core Zen 4 prefetches into L1 held the L1's few
// miss buffers that the block's own loads wanted (as the small-batch kernel found): a q8_0 draft token of
// SmolLM2-135M 7-34 % faster in three before/after pairs
// (benchmarks/results/quantized_decoder/prefetch-l2-q8.md). Q4_1's into L1, as before: there unpacking the
// nibbles bounds it as much, and L2 measured no better.
template <QuantFormat F>
inline void prefetch_codes(const char* line) {
  if constexpr (F == QuantFormat::kQ8_0) {
    _mm_prefetch(line, _MM_HINT_T1);
  } else {
    _mm_prefetch(line, _MM_HINT_T0);
  }
}

// R inputs against NC weight rows at a time, rows [begin, end). A group's codes unpack once, shared by
// the R inputs; the NC x R accumulators are independent chains, so the out-of-order core overlaps them
// rather than waiting on one chain of multiply-adds. V: the vector type (AVX2's 8 lanes, AVX-512's 16).
#define MTPROBE_QL_KERNEL(NAME, TARGET, VEC, LANES, ZERO, LOAD, MUL, FMA, SET1, UNPACK)                 \
  template <QuantFormat F, int NC, int R>                                                               \
  __attribute__((target(TARGET))) void NAME(                                                            \
      const float* x, const float* xsum, int64_t in, const uint8_t* codes, const float* scale,          \
      const float* min, const float* bias, float* y, int64_t ldy, int64_t begin, int64_t end) {         \
    constexpr int V = kQuantGroup / LANES; /* vectors per group */                                      \
    const int64_t groups = in / kQuantGroup;                                                            \
    const int64_t row_bytes = groups * group_bytes(F);                                                  \
    int64_t n = begin;                                                                                  \
    for (; n + NC <= end; n += NC) {                                                                    \
      Prefetch pf = prefetch_block<F>(codes, scale, min, groups, n, NC, end);                           \
      VEC acc[NC][R]; /* acc[c][r]: partial sums of input r's dot product with weight row n + c */      \
      for (int c = 0; c < NC; ++c) {                                                                    \
        for (int r = 0; r < R; ++r) acc[c][r] = ZERO();                                                 \
      }                                                                                                 \
      for (int64_t g = 0; g < groups; ++g) {                                                            \
        for (int c = 0; c < NC; ++c) {                                                                  \
          if (pf.next < pf.end) {                                                                       \
            prefetch_codes<F>(pf.next);                                                                 \
            pf.next += 64;                                                                              \
          }                                                                                             \
          VEC w[V];                                                                                     \
          UNPACK<F>(codes + (n + c) * row_bytes + g * group_bytes(F), w);                               \
          const VEC s = SET1(scale[(n + c) * groups + g]);                                              \
          for (int r = 0; r < R; ++r) {                                                                 \
            const float* xg = x + r * in + g * kQuantGroup;                                             \
            VEC d = MUL(LOAD(xg), w[0]);                                                                \
            if constexpr (V == 2) {                                                                     \
              d = FMA(LOAD(xg + LANES), w[1], d);                                                       \
            } else {                                                                                    \
              const VEC d23 = FMA(LOAD(xg + 3 * LANES), w[V - 1], MUL(LOAD(xg + 2 * LANES), w[V - 2])); \
              d = FMA(LOAD(xg + LANES), w[1], d);                                                       \
              d = d + d23;                                                                              \
            }                                                                                           \
            acc[c][r] = FMA(s, d, acc[c][r]);                                                           \
          }                                                                                             \
        }                                                                                               \
      }                                                                                                 \
      for (int c = 0; c < NC; ++c) {                                                                    \
        for (int r = 0; r < R; ++r) {                                                                   \
          float v = hsum(acc[c][r]);                                                                    \
          if constexpr (F == QuantFormat::kQ4_1)                                                        \
            v += min_term(min + (n + c) * groups, xsum + r * groups, groups);                           \
          y[r * ldy + n + c] = bias ? v + bias[n + c] : v;                                              \
        }                                                                                               \
      }                                                                                                 \
    }                                                                                                   \
    if constexpr (NC > 1) {                                                                             \
      if (n < end) NAME<F, 1, R>(x, xsum, in, codes, scale, min, bias, y, ldy, n, end);                 \
    }                                                                                                   \
  }

MTPROBE_QL_KERNEL(rows_avx2, "avx2,fma", __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_mul_ps,
                  _mm256_fmadd_ps, _mm256_set1_ps, unpack8)
MTPROBE_QL_KERNEL(rows_avx512, "avx512f,avx512bw,avx2,fma", __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps,
                  _mm512_mul_ps, _mm512_fmadd_ps, _mm512_set1_ps, unpack16)
#undef MTPROBE_QL_KERNEL
#pragma GCC diagnostic pop

// One pass of rr (1..4) inputs.
template <QuantFormat F, bool Wide>
void pass(int64_t rr, const float* x, const float* xsum, int64_t in, const uint8_t* codes, const float* scale,
          const float* min, const float* bias, float* y, int64_t ldy, int64_t begin, int64_t end) {
  by_inputs(rr, [&](auto nc, auto r) {
    constexpr int NC = decltype(nc)::value, R = decltype(r)::value;
    if constexpr (Wide) {
      rows_avx512<F, NC, R>(x, xsum, in, codes, scale, min, bias, y, ldy, begin, end);
    } else {
      rows_avx2<F, NC, R>(x, xsum, in, codes, scale, min, bias, y, ldy, begin, end);
    }
  });
}
#endif

template <QuantFormat F>
void run(const float* x, const float* xsum, int64_t rows, int64_t in, const uint8_t* codes,
         const float* scale, const float* min, const float* bias, float* y, int64_t out, int64_t begin,
         int64_t end, SimdLevel level) {
#ifdef MTPROBE_X86_SIMD
  level = runnable(level, has_avx2() && has_avx512(), has_avx2());
  if (level != SimdLevel::kScalar) {
    const int64_t groups = in / kQuantGroup;
    in_passes(rows, [&](int64_t r0, int64_t rr) {
      const float* sr = xsum ? xsum + r0 * groups : nullptr;
      if (level == SimdLevel::kAvx512) {
        pass<F, true>(rr, x + r0 * in, sr, in, codes, scale, min, bias, y + r0 * out, out, begin, end);
      } else {
        pass<F, false>(rr, x + r0 * in, sr, in, codes, scale, min, bias, y + r0 * out, out, begin, end);
      }
    });
    return;
  }
#else
  (void)level;
#endif
  rows_scalar<F>(x, xsum, rows, in, codes, scale, min, bias, y, out, begin, end);
}

}  // namespace

void quantized_group_sums(const float* x, int64_t rows, int64_t in_features, float* xsum) {
  const int64_t groups = in_features / kQuantGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t j = 0; j < kQuantGroup; ++j) s += x[r * in_features + g * kQuantGroup + j];
      xsum[r * groups + g] = s;
    }
  }
}

const char* quantized_linear_isa() {
#ifdef MTPROBE_X86_SIMD
  if (has_avx2()) return has_avx512() ? "avx512" : "avx2";
#endif
  return "scalar";
}

namespace {
constexpr int kG = static_cast<int>(kQuantGroup);
constexpr int kLanes = 8;  // partial sums kept apart, so that the compiler vectorises the loops over a group
constexpr float kTiny = std::numeric_limits<float>::min();

// x in [lo, hi] (|lo|, |hi| < 2^22) rounded half to even, as torch.round (the reference): adding and taking
// back 1.5 * 2^23 leaves no fraction bits, without a library call. Clamping first rounds the same as after.
inline float clamp_round(float x, float lo, float hi) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  return (std::min(std::max(x, lo), hi) + kShift) - kShift;
}

inline double lane_sum(const float* v) {
  double t = 0.0;
  for (int l = 0; l < kLanes; ++l) t += v[l];
  return t;
}

// The weighted error of W_j = s q_j + m against w.
double group_error(const float* w, const float* a, const float* q, float s, float m) {
  float e[kLanes] = {};
  for (int j0 = 0; j0 < kG; j0 += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float d = q[j0 + l] * s + m - w[j0 + l];
      e[l] += a[j0 + l] * d * d;
    }
  return lane_sum(e);
}
}  // namespace

void search_q4_1_group(const float* w, const float* a, const float* cuts, int num_cuts, int refines,
                       float* codes, float* scale, float* min) {
  double sa = 0.0, saw = 0.0;
  float lo = w[0], hi = w[0];
  for (int j = 0; j < kG; ++j) {
    sa += a[j];
    saw += static_cast<double>(a[j]) * w[j];
    lo = std::min(lo, w[j]);
    hi = std::max(hi, w[j]);
  }
  double best = group_error(w, a, codes, *scale, *min);
  const double step = 1e-3 * *scale;
  if (best <= step * step * sa) return;  // on its grid already: nothing can do better
  float q[kG];
  // The codes of `start` + `step` q, with their weighted least-squares scale and minimum, if strictly better.
  auto keep_better = [&](float start, float step_size) {
    float psq[kLanes] = {}, psqq[kLanes] = {}, psqw[kLanes] = {};
    for (int j0 = 0; j0 < kG; j0 += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const int j = j0 + l;
        q[j] = clamp_round((w[j] - start) / step_size, 0.0f, 15.0f);
        const float aq = a[j] * q[j];
        psq[l] += aq;
        psqq[l] += aq * q[j];
        psqw[l] += aq * w[j];
      }
    const double sq = lane_sum(psq), sqq = lane_sum(psqq), sqw = lane_sum(psqw);
    const double det = sa * sqq - sq * sq;
    if (!(det > 1e-12 * sa * sqq)) return;
    const auto s = static_cast<float>((sa * sqw - sq * saw) / det);
    const auto m = static_cast<float>((saw - static_cast<double>(s) * sq) / sa);
    if (!(s > 0.0f)) return;
    const double e = group_error(w, a, q, s, m);
    if (e < best) {
      best = e;
      std::copy(q, q + kG, codes);
      *scale = s;
      *min = m;
    }
  };
  const float width = hi - lo;
  for (int b = 0; b < num_cuts; ++b)
    for (int t = 0; t < num_cuts; ++t)
      if (cuts[b] != 0.0f || cuts[t] != 0.0f)
        keep_better(lo + cuts[b] * width, std::max(width * (1.0f - cuts[b] - cuts[t]) / 15.0f, kTiny));
  for (int r = 0; r < refines; ++r) keep_better(*min, std::max(*scale, kTiny));
}

void search_q8_0_group(const float* w, const float* a, int iterations, float* codes, float* scale) {
  double best = group_error(w, a, codes, *scale, 0.0f);
  float q[kG];
  for (int it = 0; it < iterations; ++it) {
    float pden[kLanes] = {}, pnum[kLanes] = {};
    for (int j0 = 0; j0 < kG; j0 += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const float ac = a[j0 + l] * codes[j0 + l];
        pden[l] += ac * codes[j0 + l];
        pnum[l] += ac * w[j0 + l];
      }
    const double den = lane_sum(pden), num = lane_sum(pnum);
    const float s = den > 0.0 ? static_cast<float>(num / den) : *scale;
    if (!(s > 0.0f)) return;
    const float step = std::max(s, kTiny);
    for (int j = 0; j < kG; ++j) q[j] = clamp_round(w[j] / step, -127.0f, 127.0f);
    const double e = group_error(w, a, q, s, 0.0f);
    if (!(e < best)) return;  // the codes and scale stay where they were: later refits would repeat this one
    best = e;
    std::copy(q, q + kG, codes);
    *scale = s;
  }
}

// ---- The layer on int8 activations (quantized_linear_int8) ----
namespace {

// Where input j (0..31) of group g sits in Q4_1's activation order (quantized_linear_int8 in the header).
inline int64_t q4_position(int64_t g, int64_t j, int64_t groups) {
  if (g == groups - 1 && groups % 2 == 1) return kQuantGroup * g + j;  // a last odd group: as it is
  const int64_t pair = kQuantGroup * (g - g % 2), side = g % 2;        // offset of the pair's 64 inputs
  return pair + (j < kHalf ? 0 : kQuantGroup) + side * kHalf + j % kHalf;
}

template <QuantFormat F>
void rows_int8_scalar(const int8_t* xq, const float* xscale, const float* xsum, int64_t rows, int64_t in,
                      const uint8_t* codes, const float* scale, const float* min, const float* bias, float* y,
                      int64_t ldy, int64_t begin, int64_t end) {
  const int64_t groups = in / kQuantGroup;
  const int64_t row_bytes = groups * group_bytes(F);
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* xr = xq + r * in;
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* b = codes + n * row_bytes + g * group_bytes(F);
        int32_t d = 0;
        for (int64_t j = 0; j < kHalf; ++j) {
          if constexpr (F == QuantFormat::kQ4_1) {
            d += (b[j] & 0x0F) * xr[q4_position(g, j, groups)] +
                 (b[j] >> 4) * xr[q4_position(g, kHalf + j, groups)];
          } else {
            d += static_cast<int8_t>(b[j]) * xr[kQuantGroup * g + j] +
                 static_cast<int8_t>(b[kHalf + j]) * xr[kQuantGroup * g + kHalf + j];
          }
        }
        acc += scale[n * groups + g] * xscale[r * groups + g] * static_cast<float>(d);
        if constexpr (F == QuantFormat::kQ4_1) acc += min[n * groups + g] * xsum[r * groups + g];
      }
      y[r * ldy + n] = bias ? acc + bias[n] : acc;
    }
  }
}

#ifdef MTPROBE_X86_SIMD
bool has_vnni() {
  static const bool has = has_avx2() && __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512f");
  return has;
}

// The int32 lanes of a's unsigned bytes times b's signed bytes, four products a lane: AVX2's form (the
// 16-bit pair sums cannot saturate: |a| <= 127 or a <= 15 here) and VNNI's one instruction.
__attribute__((target("avx2,fma"))) inline __m256i dot_avx2(__m256i a, __m256i b) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}
__attribute__((target("avx2,fma"))) inline __m256i dot2_avx2(__m256i a, __m256i b, __m256i c, __m256i d) {
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a, b), _mm256_maddubs_epi16(c, d)),
                           _mm256_set1_epi16(1));
}
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni"))) inline __m256i dot_vnni(__m256i a,
                                                                                        __m256i b) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
}
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni"))) inline __m256i dot2_vnni(__m256i a, __m256i b,
                                                                                         __m256i c,
                                                                                         __m256i d) {
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b), c, d);
}

// R inputs against NC weight rows at a time, rows [begin, end), on 8 int32 lanes: Q4_1 a pair of groups
// per vector (lanes 0-3 the first group's partial sums, 4-7 the second's), Q8_0 one group. Each group's
// integer sum is scaled once into float accumulators (scale[n, g] d[r, g], spread over its lanes). A last
// odd Q4_1 group runs as the portable loop does (one group of a row: a few per cent of a 576-input row).
#define MTPROBE_QL8_KERNEL(NAME, TARGET, DOT, DOT2)                                                          \
  template <QuantFormat F, int NC, int R>                                                                    \
  __attribute__((target(TARGET))) void NAME(const int8_t* xq, const float* xscale, const float* xsum,        \
                                            int64_t in, const uint8_t* codes, const float* scale,            \
                                            const float* min, const float* bias, float* y, int64_t ldy,      \
                                            int64_t begin, int64_t end) {                                    \
    const int64_t groups = in / kQuantGroup;                                                                 \
    const int64_t row_bytes = groups * group_bytes(F);                                                       \
    const bool odd = F == QuantFormat::kQ4_1 && groups % 2 == 1;                                             \
    const int64_t paired = odd ? groups - 1 : groups; /* groups the vector loop takes */                     \
    const __m256i low = _mm256_set1_epi8(0x0F);                                                              \
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);                                        \
    int64_t n = begin;                                                                                       \
    for (; n + NC <= end; n += NC) {                                                                         \
      Prefetch pf = prefetch_block<F>(codes, scale, min, groups, n, NC, end);                                \
      __m256 acc[NC][R];                                                                                     \
      for (int c = 0; c < NC; ++c) {                                                                         \
        for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();                                         \
      }                                                                                                      \
      if constexpr (F == QuantFormat::kQ4_1) {                                                               \
        for (int64_t g = 0; g < paired; g += 2) {                                                            \
          for (int c = 0; c < NC; ++c) {                                                                     \
            if (pf.next < pf.end) {                                                                          \
              prefetch_codes<F>(pf.next);                                                                    \
              pf.next += 64;                                                                                 \
            }                                                                                                \
            const __m256i v = _mm256_loadu_si256(                                                            \
                reinterpret_cast<const __m256i*>(codes + (n + c) * row_bytes + g * kHalf));                  \
            const __m256i lo = _mm256_and_si256(v, low);                                                     \
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);                               \
            const __m128 s2 = _mm_castsi128_ps(                                                              \
                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scale + (n + c) * groups + g)));            \
            for (int r = 0; r < R; ++r) {                                                                    \
              const int8_t* xg = xq + r * in + g * kQuantGroup;                                              \
              const __m256i d =                                                                              \
                  DOT2(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg)), hi,                     \
                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + kQuantGroup)));              \
              const __m128 sd = _mm_mul_ps(                                                                  \
                  s2, _mm_castsi128_ps(                                                                      \
                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(xscale + r * groups + g))));      \
              const __m256 s8 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(sd), spread);                \
              acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s8, acc[c][r]);                             \
            }                                                                                                \
          }                                                                                                  \
        }                                                                                                    \
      } else {                                                                                               \
        for (int64_t g = 0; g < groups; ++g) {                                                               \
          for (int c = 0; c < NC; ++c) {                                                                     \
            if (pf.next < pf.end) {                                                                          \
              prefetch_codes<F>(pf.next);                                                                    \
              pf.next += 64;                                                                                 \
            }                                                                                                \
            const __m256i w = _mm256_loadu_si256(                                                            \
                reinterpret_cast<const __m256i*>(codes + (n + c) * row_bytes + g * kQuantGroup));            \
            const __m256i aw = _mm256_sign_epi8(w, w); /* |w|: codes lie in [-127, 127] */                   \
            const float s = scale[(n + c) * groups + g];                                                     \
            for (int r = 0; r < R; ++r) {                                                                    \
              const __m256i x =                                                                              \
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * in + g * kQuantGroup));       \
              const __m256i d = DOT(aw, _mm256_sign_epi8(x, w)); /* |w| (x sign(w)) = w x */                 \
              acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(s * xscale[r * groups + g]), \
                                          acc[c][r]);                                                        \
            }                                                                                                \
          }                                                                                                  \
        }                                                                                                    \
      }                                                                                                      \
      for (int c = 0; c < NC; ++c) {                                                                         \
        for (int r = 0; r < R; ++r) {                                                                        \
          float v = hsum(acc[c][r]);                                                                         \
          if constexpr (F == QuantFormat::kQ4_1) {                                                           \
            if (odd) { /* the last group, as the portable loop */                                            \
              const int64_t g = groups - 1;                                                                  \
              const uint8_t* b = codes + (n + c) * row_bytes + g * kHalf;                                    \
              const int8_t* xg = xq + r * in + g * kQuantGroup;                                              \
              int32_t d = 0;                                                                                 \
              for (int64_t j = 0; j < kHalf; ++j) d += (b[j] & 0x0F) * xg[j] + (b[j] >> 4) * xg[kHalf + j];  \
              v += scale[(n + c) * groups + g] * xscale[r * groups + g] * static_cast<float>(d);             \
            }                                                                                                \
            v += min_term(min + (n + c) * groups, xsum + r * groups, groups);                                \
          }                                                                                                  \
          y[r * ldy + n + c] = bias ? v + bias[n + c] : v;                                                   \
        }                                                                                                    \
      }                                                                                                      \
    }                                                                                                        \
    if constexpr (NC > 1) {                                                                                  \
      if (n < end) NAME<F, 1, R>(xq, xscale, xsum, in, codes, scale, min, bias, y, ldy, n, end);             \
    }                                                                                                        \
  }

MTPROBE_QL8_KERNEL(rows_int8_avx2, "avx2,fma", dot_avx2, dot2_avx2)
MTPROBE_QL8_KERNEL(rows_int8_vnni, "avx2,fma,avx512f,avx512vl,avx512vnni", dot_vnni, dot2_vnni)
#undef MTPROBE_QL8_KERNEL

template <QuantFormat F, bool Vnni>
void pass_int8(int64_t rr, const int8_t* xq, const float* xscale, const float* xsum, int64_t in,
               const uint8_t* codes, const float* scale, const float* min, const float* bias, float* y,
               int64_t ldy, int64_t begin, int64_t end) {
  by_inputs(rr, [&](auto nc, auto r) {
    constexpr int NC = decltype(nc)::value, R = decltype(r)::value;
    if constexpr (Vnni) {
      rows_int8_vnni<F, NC, R>(xq, xscale, xsum, in, codes, scale, min, bias, y, ldy, begin, end);
    } else {
      rows_int8_avx2<F, NC, R>(xq, xscale, xsum, in, codes, scale, min, bias, y, ldy, begin, end);
    }
  });
}
#endif

template <QuantFormat F>
void run_int8(const int8_t* xq, const float* xscale, const float* xsum, int64_t rows, int64_t in,
              const uint8_t* codes, const float* scale, const float* min, const float* bias, float* y,
              int64_t out, int64_t begin, int64_t end, SimdLevel level) {
#ifdef MTPROBE_X86_SIMD
  level = runnable(level, has_vnni(), has_avx2());
  if (level != SimdLevel::kScalar) {
    const int64_t groups = in / kQuantGroup;
    in_passes(rows, [&](int64_t r0, int64_t rr) {
      const float* sr = xsum ? xsum + r0 * groups : nullptr;
      const int8_t* xr = xq + r0 * in;
      const float* dr = xscale + r0 * groups;
      if (level == SimdLevel::kAvx512) {
        pass_int8<F, true>(rr, xr, dr, sr, in, codes, scale, min, bias, y + r0 * out, out, begin, end);
      } else {
        pass_int8<F, false>(rr, xr, dr, sr, in, codes, scale, min, bias, y + r0 * out, out, begin, end);
      }
    });
    return;
  }
#else
  (void)level;
#endif
  rows_int8_scalar<F>(xq, xscale, xsum, rows, in, codes, scale, min, bias, y, out, begin, end);
}

}  // namespace

void quantize_activations(const float* x, int64_t rows, int64_t in_features, QuantFormat format, int8_t* xq,
                          float* xscale) {
  const int64_t groups = in_features / kQuantGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * in_features + g * kQuantGroup;
      float amax = 0.0f;
      for (int64_t j = 0; j < kQuantGroup; ++j) amax = std::max(amax, std::fabs(xg[j]));
      // As the reference: the factor 127 / amax in float32, each code round(x * factor), half to even.
      const float factor = amax > 0.0f ? 127.0f / amax : 0.0f;
      xscale[r * groups + g] = amax / 127.0f;
      for (int64_t j = 0; j < kQuantGroup; ++j) {
        const auto c = static_cast<int8_t>(std::nearbyint(xg[j] * factor));
        const int64_t at = format == QuantFormat::kQ4_1 ? q4_position(g, j, groups) : kQuantGroup * g + j;
        xq[r * in_features + at] = c;
      }
    }
  }
}

void quantized_linear_int8(const int8_t* xq, const float* xscale, const float* xsum, int64_t rows,
                           int64_t in_features, const void* codes, QuantFormat format, const float* scale,
                           const float* min, const float* bias, float* y, int64_t out_features,
                           int64_t out_begin, int64_t out_end, SimdLevel level) {
  const auto* c = static_cast<const uint8_t*>(codes);
  by_format(format, [&](auto f) {
    run_int8<decltype(f)::value>(xq, xscale, xsum, rows, in_features, c, scale, min, bias, y, out_features,
                                 out_begin, out_end, level);
  });
}

const char* quantized_linear_int8_isa() {
#ifdef MTPROBE_X86_SIMD
  if (has_vnni()) return "avx512_vnni";
  if (has_avx2()) return "avx2";
#endif
  return "scalar";
}

void quantized_linear(const float* x, const float* xsum, int64_t rows, int64_t in_features, const void* codes,
                      QuantFormat format, const float* scale, const float* min, const float* bias, float* y,
                      int64_t out_features, int64_t out_begin, int64_t out_end, SimdLevel level) {
  const auto* c = static_cast<const uint8_t*>(codes);
  by_format(format, [&](auto f) {
    run<decltype(f)::value>(x, xsum, rows, in_features, c, scale, min, bias, y, out_features, out_begin,
                            out_end, level);
  });
}

}  // namespace mtprobe::core
