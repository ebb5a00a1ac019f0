// A linear layer over a few rows (1 to ~40 inputs) with its weight packed in panels: y = x W^T + b, the
// weight streamed from memory once, one contiguous stream per thread. Torch-free, C++17.
//
// Why: the verification forward's linears read their weights from memory once for every input of a block
// (csrc/core/small_batch_linear.h does that on nn.Linear's own row-major weight). With the row-major
// weight every output is a dot product: a register block walks 4 weight rows side by side (4 streams a
// row's length apart), and each output ends in a horizontal sum. Packed in panels of 32 outputs, k-major,
// a panel is one contiguous run of memory the hardware prefetcher follows, and each output's sum stays in
// one lane of a register: a broadcast input times a row of the panel, no horizontal sums. On a 2-core AMD
// EPYC (Zen 4), SmolLM2-135M's 211 linear layers streamed from memory: 13 inputs 20.9 ms against 29.4
// with the row-major kernel and 50.2 with oneDNN's GEMM, 8 inputs 14.8 against 20.0, 64 inputs 84.7
// against oneDNN's 112.5 (benchmarks/results/native_forward/panels-kernels.md). The cost: the packed copy,
// as many bytes as the weight (the caller keeps it beside the model's own).
//
// Layout: panels [ceil(out / 32), in, 32]: panels[p][k][j] = W[32 p + j][k], rows past `out` zero.
// x [rows, in] row-major, bias [out] or null, y [rows, out] row-major. Every kernel (AVX-512, AVX2, the
// portable loop) sums each output's k in blocks of 64, each block in order by fused multiply-adds from zero,
// adds the blocks' sums in order, then the bias: the three give the same bits, within gamma_(64 + in / 64)
// of the exact sum (the blocks cost one add per output every 64 steps).
//
// Example: x = [[1, 2], [3, 4]], W = [[1, 0], [1, 1], [0, 2]], b = [0, 0, 1]
//   panels [1, 2, 32] = [[[1, 1, 0, 0, ...], [0, 1, 2, 0, ...]]];  y = [[1, 3, 5], [3, 7, 9]].
#pragma once

#include <cstdint>

#include "core/small_batch_linear.h"  // SimdLevel

namespace mtprobe::core {

constexpr int64_t kPanelWidth = 32;

// Panels of a layer with `out` output features: ceil(out / kPanelWidth).
inline int64_t panel_count(int64_t out) { return (out + kPanelWidth - 1) / kPanelWidth; }

// weight [out, in] row-major into panels [panel_count(out), in, kPanelWidth] (the layout above).
void pack_panels(const float* weight, int64_t out, int64_t in, float* panels);
// The same for bfloat16 weights (their bits, as torch stores them), packed as they are.
void pack_panels(const uint16_t* weight, int64_t out, int64_t in, uint16_t* panels);

// Whether this CPU runs `level`'s kernel (as small_batch_linear_supported).
bool panel_linear_supported(SimdLevel level);

// Output columns of panels [panel_begin, panel_end) of y for every row (columns past `out` not written):
// callers split the panels across threads. rows >= 1 of any count. `level`: the kernel (kDefault or a level
// this CPU does not run: the widest it runs).
void panel_linear(const float* x, int64_t rows, int64_t in, const float* panels, const float* bias, float* y,
                  int64_t out, int64_t panel_begin, int64_t panel_end, SimdLevel level = SimdLevel::kDefault);
// The same with bfloat16 panels: each weight widened to float32 as it is read (exact float32 sums of the
// bfloat16 values, at half the bytes).
void panel_linear(const float* x, int64_t rows, int64_t in, const uint16_t* panels, const float* bias,
                  float* y, int64_t out, int64_t panel_begin, int64_t panel_end,
                  SimdLevel level = SimdLevel::kDefault);

}  // namespace mtprobe::core
