// A linear layer over a few rows (2 to ~32 inputs): y = x W^T + b with W streamed from memory once.
// Torch-free, C++17.
//
// Why: on a CPU, verifying a draft block runs every linear layer of the target over T inputs. For
// T = 1 BLAS takes a matrix-vector path that reads each weight once; for T >= 2 it takes its GEMM
// path, which packs the whole weight into panels first. A decoder's weights are far larger than the
// cache, so that packing is a second pass over them: on a 2-core CPU with SmolLM2-135M a forward
// over 2 inputs cost about 1.8x one over 1 input (benchmarks/results/small_batch_linear.md). Here
// each weight row is read from memory once, into registers for 4 inputs at a time and from cache for
// the next 4, while the next weight rows are prefetched; so a forward over a few inputs reads the
// weights once, like T = 1, and more inputs add only their multiply-adds.
//
// Layout (nn.Linear's): x [rows, in] row-major, weight [out, in] row-major, bias [out] or null,
// y [rows, out] row-major. Sums run over `in` in 8 (AVX2) or 16 (AVX-512) interleaved partial sums that are
// then added; the result differs from BLAS's only in rounding.
//
// Example: x = [[1, 2], [3, 4]], W = [[1, 0], [1, 1], [0, 2]], b = [0, 0, 1]
//   y = [[1, 3, 5], [3, 7, 9]].
#pragma once

#include <cstdint>

namespace mtprobe::core {

// True when this CPU runs a SIMD path (AVX2/FMA at least); otherwise a portable scalar loop computes the
// same values (slowly: callers should then keep their BLAS).
bool small_batch_linear_simd();

// The kernels, by instruction set. kAvx2 and kScalar add the same 8 partial sums in the same order (they
// differ only by the fused multiply-add); kAvx512 adds 16 partial sums; each within the float32 bound
// of an 8-way interleaved sum plus one level.
enum class SimdLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kDefault = 3 };

// Whether this CPU runs `level`'s kernel.
bool small_batch_linear_supported(SimdLevel level);

// The kernel kDefault runs: kAvx2 where the CPU has AVX2 and FMA (also on AVX-512 CPUs, where the
// AVX-512 kernel measured no faster with the weights streamed from memory), else kScalar.
SimdLevel small_batch_linear_default();

// Computes output columns [out_begin, out_end) of y for every row: callers split the columns
// across threads (each column reads one weight row). rows >= 1 of any count. `level`: the kernel
// (a level this CPU does not run falls back to the default).
void small_batch_linear(const float* x, int64_t rows, int64_t in_features, const float* weight,
                        const float* bias, float* y, int64_t out_features, int64_t out_begin, int64_t out_end,
                        SimdLevel level = SimdLevel::kDefault);

// The same with bfloat16 weights (their bits, as torch stores them): each widened to float32 as it is read,
// so the sums are exact float32 sums of the bfloat16 values, at half the weights' bytes.
void small_batch_linear(const float* x, int64_t rows, int64_t in_features, const uint16_t* weight,
                        const float* bias, float* y, int64_t out_features, int64_t out_begin, int64_t out_end,
                        SimdLevel level = SimdLevel::kDefault);

}  // namespace mtprobe::core
