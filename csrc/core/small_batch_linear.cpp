#include "core/small_batch_linear.h"

#include <algorithm>

#include "core/bf16.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MTPROBE_X86_SIMD 1
#include <immintrin.h>
#endif

namespace mtprobe::core {
namespace {

// The portable path's inputs per pass over a weight row (its speed matters little: callers keep their
// BLAS on CPUs without AVX2/FMA).
constexpr int kMaxRowsPerPass = 12;

// A weight as float32: itself, or a bfloat16's bits widened.
inline float to_float(float w) { return w; }
inline float to_float(uint16_t w) { return bf16_to_float(w); }

// One pass: rows [0, R) of x (row stride ldx) against weight rows [begin, end).
template <int R, typename W>
void pass_scalar(const float* x, int64_t ldx, int64_t in, const W* w, const float* bias, float* y,
                 int64_t ldy, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const W* wn = w + n * in;
    for (int r = 0; r < R; ++r) {
      // The SIMD path's 8 partial sums, added in its order (it fuses each multiply-add, this does not).
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= in; k += 8) {
        for (int l = 0; l < 8; ++l) part[l] += x[r * ldx + k + l] * to_float(wn[k + l]);
      }
      float s = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
      for (; k < in; ++k) s += x[r * ldx + k] * to_float(wn[k]);
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

// 8 weights as float32 (bfloat16 ones widened: their bits shifted into the upper half).
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* w) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// One register block: weight rows [n, n + NC) against inputs [0, RR) of x, over the whole of `in`.
// NC * RR accumulators (8 partial sums each) plus the NC weight vectors and one input vector fit the
// 16 AVX2 registers at NC = 3, RR = 4: each k step loads 7 vectors for 12 FMAs, so the FMA units, not
// the loads, set the pace. Every accumulator sums its k in the order pass_scalar does, so the result
// does not depend on the blocking. While computing, the block prefetches [pf, pf_end): the next weight
// rows, which would otherwise be fetched from memory only after this block's compute, not during it.
template <typename W, int NC, int RR>
__attribute__((target("avx2,fma"))) void block_avx2(const float* x, int64_t ldx, int64_t in, const W* wn,
                                                    const float* bias, float* y, int64_t ldy, const char* pf,
                                                    const char* pf_end) {
  __m256 acc[NC][RR];  // acc[c][r]: 8 partial sums of input r's dot product with weight row n + c
  for (int c = 0; c < NC; ++c) {
    for (int r = 0; r < RR; ++r) acc[c][r] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    __m256 wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = load8(wn + c * in + k);
    if (pf < pf_end) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
    }
    for (int r = 0; r < RR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < NC; ++c) acc[c][r] = _mm256_fmadd_ps(xv, wv[c], acc[c][r]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    for (int r = 0; r < RR; ++r) {
      float s = sum_lanes(acc[c][r]);
      for (int64_t j = k; j < in; ++j) s += x[r * ldx + j] * to_float(wn[c * in + j]);
      y[r * ldy + c] = bias ? s + bias[c] : s;
    }
  }
}

constexpr int kBlockCols = 3;  // NC
constexpr int kBlockRows = 4;  // RR

template <typename W>
using Block = void (*)(const float*, int64_t, int64_t, const W*, const float*, float*, int64_t, const char*,
                       const char*);

template <typename W, int NC>
Block<W> avx2_block_rows(int rr) {
  static constexpr Block<W> table[kBlockRows + 1] = {nullptr, block_avx2<W, NC, 1>, block_avx2<W, NC, 2>,
                                                     block_avx2<W, NC, 3>, block_avx2<W, NC, 4>};
  return table[rr];
}

template <typename W>
Block<W> avx2_block(int nc, int rr) {
  switch (nc) {
    case 1:
      return avx2_block_rows<W, 1>(rr);
    case 2:
      return avx2_block_rows<W, 2>(rr);
    default:
      return avx2_block_rows<W, 3>(rr);
  }
}

// GCC 12's _mm512_reduce_add_ps extracts halves from an "undefined" vector, which -Wuninitialized
// reports as a use of an uninitialized value (a false positive inside its own header).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The AVX-512 form of block_avx2: 16 lanes, NC weight rows against RR inputs. The main loop loads whole
// vectors unmasked and only the tail of `in` (in % 16 inputs) runs a masked step: on an AMD EPYC (Zen 5) a
// masked load in every step had halved the block's multiply-add rate (from cache it now runs at 300-340
// GFLOP/s on 2 cores, benchmarks/results/native_forward/kernels-avx512.md). 16 or more accumulators keep
// both FMA pipes busy (12 ran at half their rate there); 16
// partial sums per output, then added by the reduction, so the rounding differs from the AVX2 path's (both
// within the same float32 bound of the tests).
// 16 weights as float32, whole or under mask m (the lanes past it zero).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const float* w) {
  return _mm512_loadu_ps(w);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const uint16_t* w) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(__mmask16 m, const float* w) {
  return _mm512_maskz_loadu_ps(m, w);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(__mmask16 m, const uint16_t* w) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <typename W, int NC, int RR>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void block_avx512(const float* x, int64_t ldx,
                                                                       int64_t in, const W* wn,
                                                                       const float* bias, float* y,
                                                                       int64_t ldy, const char* pf,
                                                                       const char* pf_end) {
  __m512 acc[NC][RR];
  for (int c = 0; c < NC; ++c) {
    for (int r = 0; r < RR; ++r) acc[c][r] = _mm512_setzero_ps();
  }
  const int64_t whole = in & ~int64_t{15};
  int64_t k = 0;
  for (; k < whole; k += 16) {
    __m512 wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = load16(wn + c * in + k);
    // NC cache lines of this group per step: as many of the next group's, so that all of it is
    // requested before this group's compute ends.
    for (int c = 0; c < NC && pf < pf_end; ++c) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
    }
    for (int r = 0; r < RR; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < NC; ++c) acc[c][r] = _mm512_fmadd_ps(xv, wv[c], acc[c][r]);
    }
  }
  if (k < in) {
    const auto m = static_cast<__mmask16>((1u << (in - k)) - 1);
    __m512 wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = load16(m, wn + c * in + k);
    for (int r = 0; r < RR; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * ldx + k);
      for (int c = 0; c < NC; ++c) acc[c][r] = _mm512_fmadd_ps(xv, wv[c], acc[c][r]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    for (int r = 0; r < RR; ++r) {
      const float s = _mm512_reduce_add_ps(acc[c][r]);
      y[r * ldy + c] = bias ? s + bias[c] : s;
    }
  }
}

#pragma GCC diagnostic pop

// The AVX-512 blocks by inputs per pass: NC x RR of at least 16 accumulators where the inputs allow.
// One or two inputs: 8 weight rows (8 or 16 accumulators, 8 weight vectors). Three: 5 rows (15). Four
// to six: 4 rows (16 to 24; 4 weight vectors, one input vector: at most 29 of the 32 registers).
constexpr int kMaxRowsPerPass512 = 6;

// NC weight rows against 1 to kMaxRowsPerPass512 inputs.
template <typename W, int NC>
Block<W> avx512_rows(int rr) {
  static constexpr Block<W> table[kMaxRowsPerPass512 + 1] = {nullptr,
                                                             block_avx512<W, NC, 1>,
                                                             block_avx512<W, NC, 2>,
                                                             block_avx512<W, NC, 3>,
                                                             block_avx512<W, NC, 4>,
                                                             block_avx512<W, NC, 5>,
                                                             block_avx512<W, NC, 6>};
  return table[rr];
}

template <typename W>
Block<W> avx512_block_for(int nc, int rr) {
  if (nc == 8 && rr == 1) return block_avx512<W, 8, 1>;
  if (nc == 8 && rr == 2) return block_avx512<W, 8, 2>;
  if (nc == 5 && rr == 3) return block_avx512<W, 5, 3>;
  if (nc == 4) return avx512_rows<W, 4>(rr);
  // A narrower group (the last of a thread's columns) runs column by column through the 1-column form.
  return avx512_rows<W, 1>(rr);
}

// The weight rows after a group's, [n + cols, n + 2 cols) within [.., end), as bytes split over the group's
// `passes` in whole cache lines: each pass prefetches its part while it computes, so that all of the next
// group is requested before this one's compute ends rather than after it. Into L2 (_MM_HINT_T1), not L1:
// on a 2-core AMD EPYC (Zen 4) prefetches into L1 held the L1's few miss buffers while the block's own
// loads waited, and memory and compute took turns; into L2 a 13-input forward of SmolLM2 took 30 ms against
// 38, an 8-input one 21 against 31 (benchmarks/results/native_forward/prefetch-l2.md).
struct NextGroup {
  const char* next;
  const char* stop;
  int64_t part;

  template <typename W>
  NextGroup(const W* weight, int64_t n, int64_t cols, int64_t end, int64_t in, int64_t passes)
      : next(reinterpret_cast<const char*>(weight + std::min(end, n + cols) * in)),
        stop(reinterpret_cast<const char*>(weight + std::min(end, n + 2 * cols) * in)),
        part(((stop - next) / passes + 63) / 64 * 64) {}
  const char* from(int64_t p) const { return std::min(stop, next + p * part); }
  const char* to(int64_t p) const { return std::min(stop, from(p) + part); }
};

// Weight rows [begin, end) in groups of `cols` (the register block's NC); each group's rows are read from
// memory once and reused from cache by its ceil(rows / kBlockRows) blocks.
template <typename W>
void linear_blocked(const float* x, int64_t rows, int64_t in, const W* weight, const float* bias, float* y,
                    int64_t out, int64_t begin, int64_t end, int cols, Block<W> (*block)(int, int)) {
  const int64_t passes = (rows + kBlockRows - 1) / kBlockRows;
  for (int64_t n = begin; n < end; n += cols) {
    const int nc = static_cast<int>(std::min<int64_t>(cols, end - n));
    const NextGroup pf(weight, n, cols, end, in, passes);
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t r0 = p * kBlockRows;
      const int rr = static_cast<int>(std::min<int64_t>(kBlockRows, rows - r0));
      block(nc, rr)(x + r0 * in, in, in, weight + n * in, bias ? bias + n : nullptr, y + r0 * out + n, out,
                    pf.from(p), pf.to(p));
    }
  }
}

// The AVX-512 kernel over weight rows [begin, end): groups of 8 weight rows for one or two inputs, 5 for
// three, else 4, each group read from memory once and reused from cache by its passes over the inputs
// (ceil(rows / 6) passes of 3 to 6 inputs, split evenly). A group cut short by `end` runs column by column.
template <typename W>
void linear_blocked512(const float* x, int64_t rows, int64_t in, const W* weight, const float* bias, float* y,
                       int64_t out, int64_t begin, int64_t end) {
  const int cols = rows <= 2 ? 8 : rows == 3 ? 5 : 4;
  const int64_t passes = (rows + kMaxRowsPerPass512 - 1) / kMaxRowsPerPass512;
  for (int64_t n = begin; n < end; n += cols) {
    const int nc = static_cast<int>(std::min<int64_t>(cols, end - n));
    const NextGroup pf(weight, n, cols, end, in, passes);
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t r0 = p * rows / passes;
      const int rr = static_cast<int>((p + 1) * rows / passes - r0);
      for (int c = 0; c < nc; c += nc == cols ? nc : 1) {
        avx512_block_for<W>(nc == cols ? nc : 1, rr)(x + r0 * in, in, in, weight + (n + c) * in,
                                                     bias ? bias + n + c : nullptr, y + r0 * out + n + c, out,
                                                     pf.from(p), pf.to(p));
      }
    }
  }
}

bool cpu_has_avx512f() {
  // The bfloat16 weights' masked loads take AVX512BW and VL too (every AVX-512 CPU since Skylake-X).
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
}

bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

template <typename W>
using Pass = void (*)(const float*, int64_t, int64_t, const W*, const float*, float*, int64_t, int64_t,
                      int64_t);

template <typename W>
Pass<W> scalar_pass(int r) {
  static constexpr Pass<W> table[kMaxRowsPerPass + 1] = {
      nullptr,           pass_scalar<1, W>, pass_scalar<2, W>,  pass_scalar<3, W>,
      pass_scalar<4, W>, pass_scalar<5, W>, pass_scalar<6, W>,  pass_scalar<7, W>,
      pass_scalar<8, W>, pass_scalar<9, W>, pass_scalar<10, W>, pass_scalar<11, W>,
      pass_scalar<12, W>};
  return table[r];
}

}  // namespace

bool small_batch_linear_simd() {
#ifdef MTPROBE_X86_SIMD
  return cpu_has_avx2_fma();
#else
  return false;
#endif
}

bool small_batch_linear_supported(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return true;
#ifdef MTPROBE_X86_SIMD
    case SimdLevel::kAvx2:
      return cpu_has_avx2_fma();
    case SimdLevel::kAvx512:
      return cpu_has_avx512f();
#endif
    default:
      return false;
  }
}

SimdLevel small_batch_linear_default() {
  // AVX2 also where the CPU has AVX-512: with the weights streamed from memory (a forward's linears, more
  // than L3 holds) the two ran within about 10 % of each other on a 2-core AMD EPYC (Zen 5), though from
  // cache the AVX-512 kernel multiplies 1.5x faster at 8 to 32 inputs: the stream sets the pace. Callers
  // that measured otherwise ask for a level (TargetForward's wide_rows;
  // benchmarks/results/native_forward/kernels-avx512.md, curve-wide-rows.md).
  return small_batch_linear_supported(SimdLevel::kAvx2) ? SimdLevel::kAvx2 : SimdLevel::kScalar;
}

namespace {

template <typename W>
void linear_any(const float* x, int64_t rows, int64_t in_features, const W* weight, const float* bias,
                float* y, int64_t out_features, int64_t out_begin, int64_t out_end, SimdLevel level) {
  if (rows <= 0 || out_begin >= out_end) return;  // nothing to write; the SIMD paths divide by the passes
  if (level == SimdLevel::kDefault || !small_batch_linear_supported(level))
    level = small_batch_linear_default();
#ifdef MTPROBE_X86_SIMD
  if (level == SimdLevel::kAvx512) {
    linear_blocked512(x, rows, in_features, weight, bias, y, out_features, out_begin, out_end);
    return;
  }
  if (level == SimdLevel::kAvx2) {
    linear_blocked(x, rows, in_features, weight, bias, y, out_features, out_begin, out_end, kBlockCols,
                   avx2_block<W>);
    return;
  }
#endif
  // Weight rows in tiles that stay in cache while every pass over the inputs reuses them.
  constexpr int64_t kTile = 32;
  for (int64_t n0 = out_begin; n0 < out_end; n0 += kTile) {
    const int64_t n1 = std::min(out_end, n0 + kTile);
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRowsPerPass) {
      const int r = static_cast<int>(std::min<int64_t>(kMaxRowsPerPass, rows - r0));
      scalar_pass<W>(r)(x + r0 * in_features, in_features, in_features, weight, bias, y + r0 * out_features,
                        out_features, n0, n1);
    }
  }
}

}  // namespace

void small_batch_linear(const float* x, int64_t rows, int64_t in_features, const float* weight,
                        const float* bias, float* y, int64_t out_features, int64_t out_begin, int64_t out_end,
                        SimdLevel level) {
  linear_any(x, rows, in_features, weight, bias, y, out_features, out_begin, out_end, level);
}

void small_batch_linear(const float* x, int64_t rows, int64_t in_features, const uint16_t* weight,
                        const float* bias, float* y, int64_t out_features, int64_t out_begin, int64_t out_end,
                        SimdLevel level) {
  linear_any(x, rows, in_features, weight, bias, y, out_features, out_begin, out_end, level);
}

}  // namespace mtprobe::core
