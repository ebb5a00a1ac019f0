#include "core/panel_linear.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/bf16.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MTPROBE_X86_SIMD 1
#include <immintrin.h>
#endif

namespace mtprobe::core {
namespace {

constexpr int64_t kW = kPanelWidth;

template <typename W>
void pack_any(const W* weight, int64_t out, int64_t in, W* panels) {
  const int64_t count = panel_count(out);
  for (int64_t p = 0; p < count; ++p) {
    W* panel = panels + p * in * kW;  // [in, kW]
    for (int64_t j = 0; j < kW; ++j) {
      const int64_t n = p * kW + j;
      for (int64_t k = 0; k < in; ++k) panel[k * kW + j] = n < out ? weight[n * in + k] : W{0};
    }
  }
}

inline float to_float(float w) { return w; }
inline float to_float(uint16_t w) { return bf16_to_float(w); }

// Each output sums its k in blocks of kBlockK, each block in order by fused multiply-adds from zero, and
// adds the blocks' sums in order to a total from zero: its rounding error is then bounded by gamma_(kBlockK +
// in / kBlockK) rather than gamma_in (Higham 3.1), 88 against 1,536 for a 1,536-long sum (an MLP's down
// projection), for one add per output every kBlockK steps.
constexpr int64_t kBlockK = 64;

// The portable loop, in the SIMD kernels' order (their lanes' sums, bit for bit).
template <typename W>
void panels_scalar(const float* x, int64_t rows, int64_t in, const W* panels, const float* bias, float* y,
                   int64_t out, int64_t begin, int64_t end) {
  for (int64_t p = begin; p < end; ++p) {
    const W* panel = panels + p * in * kW;
    const int64_t width = std::min(kW, out - p * kW);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < width; ++j) {
        float total = 0.0f;
        for (int64_t k0 = 0; k0 < in; k0 += kBlockK) {
          float s = 0.0f;
          for (int64_t k = k0; k < std::min(in, k0 + kBlockK); ++k)
            s = std::fma(x[r * in + k], to_float(panel[k * kW + j]), s);
          total += s;
        }
        const int64_t n = p * kW + j;
        y[r * out + n] = bias ? total + bias[n] : total;
      }
    }
  }
}

#ifdef MTPROBE_X86_SIMD
// Input rows [r0, r0 + rr) of a pass: `passes` passes over a panel split the rows evenly.
struct Passes {
  int64_t count, rows;
  Passes(int64_t rows_, int64_t most) : count((rows_ + most - 1) / most), rows(rows_) {}
  int64_t first(int64_t p) const { return p * rows / count; }
  int rows_of(int64_t p) const { return static_cast<int>(first(p + 1) - first(p)); }
};

// The next panel's bytes [next, stop), split over the panel's passes in whole cache lines: each pass
// prefetches its part into L2 while it computes (as small_batch_linear's NextGroup).
struct NextPanel {
  const char* next;
  const char* stop;
  int64_t part;
  template <typename W>
  NextPanel(const W* panels, int64_t p, int64_t end, int64_t in, int64_t passes)
      : next(reinterpret_cast<const char*>(panels + std::min(end, p + 1) * in * kW)),
        stop(reinterpret_cast<const char*>(panels + std::min(end, p + 2) * in * kW)),
        part(((stop - next) / passes + 63) / 64 * 64) {}
  const char* from(int64_t i) const { return std::min(stop, next + i * part); }
  const char* to(int64_t i) const { return std::min(stop, from(i) + part); }
};

// A panel row's cache lines: what each k step reads, and so prefetches of the next panel.
template <typename W>
constexpr int kLinesPerStep = static_cast<int>(kW * sizeof(W) / 64);

// GCC 12's AVX-512 headers read an "undefined" vector that -Wmaybe-uninitialized reports (a false positive
// inside its own header, as in small_batch_linear.cpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// --- AVX-512: the whole panel (2 x 16 lanes) against up to 13 inputs: 26 accumulators, the 2 panel
// vectors and the broadcast input in the 32 registers; 26 multiply-adds per 2 loads and 13 broadcasts.
#define MTPROBE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
MTPROBE_AVX512 inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
MTPROBE_AVX512 inline __m512 load16(const uint16_t* w) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

constexpr int kRows512 = 13;

template <typename W, int RR>
MTPROBE_AVX512 void panel_avx512(const float* x, int64_t in, const W* panel, const float* bias, float* y,
                                 int64_t ldy, int width, const char* pf, const char* pf_end) {
  __m512 lo[RR], hi[RR];  // a block's sums, in registers (two arrays, as half_avx2's)
  __m512 total[RR][2];    // the blocks' sums added (from zero), in L1
#pragma GCC unroll 16
  for (int r = 0; r < RR; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < in; k0 += kBlockK) {
#pragma GCC unroll 16
    for (int r = 0; r < RR; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    const int64_t k1 = std::min(in, k0 + kBlockK);
    for (int64_t k = k0; k < k1; ++k) {
      const __m512 w0 = load16(panel + k * kW), w1 = load16(panel + k * kW + 16);
      for (int l = 0; l < kLinesPerStep<W> && pf < pf_end; ++l, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
#pragma GCC unroll 16
      for (int r = 0; r < RR; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * in + k]);
        lo[r] = _mm512_fmadd_ps(xv, w0, lo[r]);
        hi[r] = _mm512_fmadd_ps(xv, w1, hi[r]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < RR; ++r) {
      total[r][0] = _mm512_add_ps(total[r][0], lo[r]);
      total[r][1] = _mm512_add_ps(total[r][1], hi[r]);
    }
  }
  // The columns this panel has (all 32 but in a layer's last panel).
  const auto m0 = static_cast<__mmask16>(width >= 16 ? 0xFFFF : (1u << width) - 1);
  const auto m1 = static_cast<__mmask16>(width >= 32 ? 0xFFFF : width <= 16 ? 0 : (1u << (width - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < RR; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, bias ? _mm512_add_ps(total[r][0], b0) : total[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, bias ? _mm512_add_ps(total[r][1], b1) : total[r][1]);
  }
}

template <typename W>
using Panel = void (*)(const float*, int64_t, const W*, const float*, float*, int64_t, int, const char*,
                       const char*);

template <typename W, int... R>
Panel<W> pick(int rr, std::integer_sequence<int, R...>) {
  static constexpr Panel<W> table[] = {nullptr, panel_avx512<W, R + 1>...};
  return table[rr];
}

template <typename W>
void panels_avx512(const float* x, int64_t rows, int64_t in, const W* panels, const float* bias, float* y,
                   int64_t out, int64_t begin, int64_t end) {
  const Passes passes(rows, kRows512);
  for (int64_t p = begin; p < end; ++p) {
    const NextPanel pf(panels, p, end, in, passes.count);
    const int width = static_cast<int>(std::min(kW, out - p * kW));
    for (int64_t i = 0; i < passes.count; ++i) {
      const int64_t r0 = passes.first(i);
      pick<W>(passes.rows_of(i), std::make_integer_sequence<int, kRows512>{})(
          x + r0 * in, in, panels + p * in * kW, bias ? bias + p * kW : nullptr, y + r0 * out + p * kW, out,
          width, pf.from(i), pf.to(i));
    }
  }
}

#pragma GCC diagnostic pop

// --- AVX2: half a panel (2 x 8 lanes) against up to 6 inputs: 12 accumulators, 2 panel vectors and the
// broadcast input in the 16 registers.
#define MTPROBE_AVX2 __attribute__((target("avx2,fma")))
MTPROBE_AVX2 inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
MTPROBE_AVX2 inline __m256 load8(const uint16_t* w) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

constexpr int kRows256 = 6;

template <typename W, int RR>
MTPROBE_AVX2 void half_avx2(const float* x, int64_t in, const W* half, const float* bias, float* y,
                            int64_t ldy, int width, const char* pf, const char* pf_end) {
  // Two arrays, not one [RR][2]: with the 2-D array GCC 12 stored every accumulator to memory at each step
  // (half the multiply-add rate from cache).
  __m256 lo[RR], hi[RR];
  __m256 total[RR][2];  // as panel_avx512's
#pragma GCC unroll 16
  for (int r = 0; r < RR; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < in; k0 += kBlockK) {
#pragma GCC unroll 16
    for (int r = 0; r < RR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    const int64_t k1 = std::min(in, k0 + kBlockK);
    for (int64_t k = k0; k < k1; ++k) {
      const __m256 w0 = load8(half + k * kW), w1 = load8(half + k * kW + 8);
      if (pf < pf_end) {  // a line a step: at least the half panel's own pace
        _mm_prefetch(pf, _MM_HINT_T1);
        pf += 64;
      }
#pragma GCC unroll 16
      for (int r = 0; r < RR; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * in + k);
        lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
        hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < RR; ++r) {
      total[r][0] = _mm256_add_ps(total[r][0], lo[r]);
      total[r][1] = _mm256_add_ps(total[r][1], hi[r]);
    }
  }
  // The columns this half has (16 but in a layer's last panel), as lane masks.
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(width), lane);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(width - 8), lane);
  const __m256 b0 = bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < RR; ++r) {
    _mm256_maskstore_ps(y + r * ldy, m0, bias ? _mm256_add_ps(total[r][0], b0) : total[r][0]);
    _mm256_maskstore_ps(y + r * ldy + 8, m1, bias ? _mm256_add_ps(total[r][1], b1) : total[r][1]);
  }
}

template <typename W, int... R>
Panel<W> pick_avx2(int rr, std::integer_sequence<int, R...>) {
  static constexpr Panel<W> table[] = {nullptr, half_avx2<W, R + 1>...};
  return table[rr];
}

template <typename W>
void panels_avx2(const float* x, int64_t rows, int64_t in, const W* panels, const float* bias, float* y,
                 int64_t out, int64_t begin, int64_t end) {
  const Passes passes(rows, kRows256);
  for (int64_t p = begin; p < end; ++p) {
    const NextPanel pf(panels, p, end, in, 2 * passes.count);
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t col = p * kW + h * 16;
      const int width = static_cast<int>(std::clamp<int64_t>(out - col, 0, 16));
      if (width == 0) break;
      for (int64_t i = 0; i < passes.count; ++i) {
        const int64_t r0 = passes.first(i);
        pick_avx2<W>(passes.rows_of(i), std::make_integer_sequence<int, kRows256>{})(
            x + r0 * in, in, panels + p * in * kW + h * 16, bias ? bias + col : nullptr, y + r0 * out + col,
            out, width, pf.from(h * passes.count + i), pf.to(h * passes.count + i));
      }
    }
  }
}

#endif

template <typename W>
void run(const float* x, int64_t rows, int64_t in, const W* panels, const float* bias, float* y, int64_t out,
         int64_t begin, int64_t end, SimdLevel level) {
  end = std::min(end, panel_count(out));
  if (rows <= 0 || in <= 0 || begin >= end) {
    // in == 0: every sum is empty.
    if (rows > 0 && in <= 0) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = begin * kW; n < std::min(out, end * kW); ++n) y[r * out + n] = bias ? bias[n] : 0.0f;
    }
    return;
  }
  if (level == SimdLevel::kDefault || !panel_linear_supported(level)) {
    level = panel_linear_supported(SimdLevel::kAvx512) ? SimdLevel::kAvx512
            : panel_linear_supported(SimdLevel::kAvx2) ? SimdLevel::kAvx2
                                                       : SimdLevel::kScalar;
  }
#ifdef MTPROBE_X86_SIMD
  if (level == SimdLevel::kAvx512) return panels_avx512(x, rows, in, panels, bias, y, out, begin, end);
  if (level == SimdLevel::kAvx2) return panels_avx2(x, rows, in, panels, bias, y, out, begin, end);
#endif
  panels_scalar(x, rows, in, panels, bias, y, out, begin, end);
}

}  // namespace

void pack_panels(const float* weight, int64_t out, int64_t in, float* panels) {
  pack_any(weight, out, in, panels);
}
void pack_panels(const uint16_t* weight, int64_t out, int64_t in, uint16_t* panels) {
  pack_any(weight, out, in, panels);
}

bool panel_linear_supported(SimdLevel level) {
  // The same instructions as the small-batch kernel's levels (AVX-512 F/BW/VL; AVX2 and FMA).
  return small_batch_linear_supported(level);
}

void panel_linear(const float* x, int64_t rows, int64_t in, const float* panels, const float* bias, float* y,
                  int64_t out, int64_t panel_begin, int64_t panel_end, SimdLevel level) {
  run(x, rows, in, panels, bias, y, out, panel_begin, panel_end, level);
}
void panel_linear(const float* x, int64_t rows, int64_t in, const uint16_t* panels, const float* bias,
                  float* y, int64_t out, int64_t panel_begin, int64_t panel_end, SimdLevel level) {
  run(x, rows, in, panels, bias, y, out, panel_begin, panel_end, level);
}

}  // namespace mtprobe::core
