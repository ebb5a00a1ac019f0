// ATen launchers for the torch-free core: check shapes and dtypes, then call csrc/core.
// Registered as torch.ops.mtprobe.* in registration.cpp; the decode loop calls them directly.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

#include "core/circuit.h"

namespace mtprobe::ops {

// parents: [T] int32/int64.  Returns the additive mask [1, 1, T, prefix_len + T] in `dtype`
// (0 where attended, finfo(dtype).min elsewhere) on parents' device.
at::Tensor tree_attention_mask(const at::Tensor& parents, int64_t prefix_len, at::ScalarType dtype);

// parents: [T].  Returns position ids [1, T] int64: prefix_len + depth.
at::Tensor tree_position_ids(const at::Tensor& parents, int64_t prefix_len);

// tokens, parents, target: [N].  Returns the accepted path [n_path] int64 of node indices from `root`.
at::Tensor verify_greedy(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target,
                         int64_t root);

// Rejection sampling over a draft tree rooted at node 0 (csrc/core/verify.h). tokens, parents: [n];
// p: [n, vocab] target probabilities after each node; q: [n - 1, vocab] the distribution each draft
// node's token was drawn from; uniforms: [n + 1] float64 in [0, 1). Returns (path [n_path] int64,
// token [] int64: the output token after the path).
std::tuple<at::Tensor, at::Tensor> verify_rejection(const at::Tensor& tokens, const at::Tensor& parents,
                                                    const at::Tensor& p, const at::Tensor& q,
                                                    const at::Tensor& uniforms);
// Shapes, the tree (tok, par: the tokens and parents, on the host; one root at node 0) and
// q[j - 1, x_j] > 0, reading back n - 1 values of q.
void check_verify_rejection_args(const std::vector<int64_t>& tok, const std::vector<int64_t>& par,
                                 const at::Tensor& p, const at::Tensor& q, const at::Tensor& uniforms);

// caches: tensors [B, H, S, D] (dim 2 = sequence); src: [n] int64.  In place:
// cache[:, :, dst_start + j] = cache[:, :, src[j]] for j in order.
void compact_kv_(at::TensorList caches, const at::Tensor& src, int64_t dst_start);

// parents: [T].  Returns the compact ancestor pattern [T, ceil(T / 64)] int64 (csrc/core/tree.h).
at::Tensor tree_ancestor_bits(const at::Tensor& parents);

// Tree attention: q [B, H, T, D] (the tree inputs), k, v [B, Hkv, P + T, D] (the prefix, then the
// tree inputs), bits from tree_ancestor_bits. Query i attends to the P prefix keys and to the tree
// keys its row of bits marks. Returns [B, H, T, D].
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& bits, double scale);
void check_tree_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& bits);

// Dynamic tree expansion (seed 001, Alg. 1) from the masks' logits, without leaving the device.
// logits: [depths, vocab], row d - 1 the d-th mask token's logits; root_token: [] or [1] int.
// Per row, the top `width` tokens by logit (ties: lower id) with their softmax probabilities are
// the candidates of that depth; csrc/core/draft_tree_expand.h builds the tree. Returns
// (tokens [budget] int64, parents [budget] int64, probs [budget] float64 cumulative,
// num_nodes [] int64): the tree [root, ...] then padding (token -1, parent -1, prob 0).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_draft_tree(const at::Tensor& logits,
                                                                             const at::Tensor& root_token,
                                                                             int64_t budget, int64_t width,
                                                                             bool prune);
void check_expand_draft_tree_args(const at::Tensor& logits, const at::Tensor& root_token, int64_t budget,
                                  int64_t width);

// Exact inference in circuit heads (csrc/core/circuit.h), batched over B contexts; csrc/ops/circuit.cpp
// has the parameter layouts. kind: "ff", "cp", "hmm" or "btree". Returns log q(tokens) [B],
// log q(x_1..x_i) [B, n], log q(v | prefix) [B, V] (prefix [B, len], len in [0, n)), and windows
// [B, n] int64 drawn by inverse CDF from uniforms [B, S + n].
at::Tensor circuit_log_prob(c10::string_view kind, const at::Tensor& weights, const at::Tensor& transitions,
                            const at::Tensor& emissions, const at::Tensor& tokens);
at::Tensor circuit_prefix_log_marginals(c10::string_view kind, const at::Tensor& weights,
                                        const at::Tensor& transitions, const at::Tensor& emissions,
                                        const at::Tensor& tokens);
at::Tensor circuit_next_token_log_probs(c10::string_view kind, const at::Tensor& weights,
                                        const at::Tensor& transitions, const at::Tensor& emissions,
                                        const at::Tensor& prefix);
at::Tensor circuit_sample(c10::string_view kind, const at::Tensor& weights, const at::Tensor& transitions,
                          const at::Tensor& emissions, const at::Tensor& uniforms);

// The circuit ops' shared argument checks (circuit.cpp; the CUDA launchers in circuit_cuda.cu use them
// too): the kind, shapes and dtypes, parameters converted to one contiguous float or double dtype on
// their device; token ids checked against [0, V) (a CUDA tensor costs one device read).
struct CircuitBatch {
  core::CircuitStructure structure;
  int64_t batch = 0;
  at::Tensor weights, transitions, emissions;
};
CircuitBatch check_circuit(const char* op, const std::string& kind_name, const at::Tensor& weights,
                           const at::Tensor& transitions, const at::Tensor& emissions);
at::Tensor check_circuit_tokens(const char* op, const char* what, const at::Tensor& tokens, int64_t B,
                                int64_t len, int64_t V);
// prefix [B, len], len in [0, n): as check_circuit_tokens. uniforms [B, S + n] float64/float32 in [0, 1),
// returned as contiguous float64 on the parameters' device.
at::Tensor check_circuit_prefix(const char* op, const CircuitBatch& c, const at::Tensor& prefix);
at::Tensor check_circuit_uniforms(const char* op, const CircuitBatch& c, const at::Tensor& uniforms);

// y = x weight^T + bias for a few rows of x, the weight read once (csrc/core/small_batch_linear.h).
// x [..., in] float32 CPU, weight [out, in] contiguous float32 or bfloat16 (widened as it is read), bias
// [out] float32 or none. Returns [..., out] float32.
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias);
// The same with the kernel named: level 0 the portable loop, 1 AVX2/FMA, 2 AVX-512, 3 the default (a
// level this CPU does not run falls back to the default); for tests and the kernels' A/B benchmark.
at::Tensor small_batch_linear_at_level(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, int64_t level);
// Whether a SIMD kernel (AVX2/FMA at least) runs on this CPU (otherwise a scalar loop, slower than BLAS).
bool small_batch_linear_simd();
// The kernel the op runs on this CPU: "avx2" or "scalar" (csrc/core/small_batch_linear.h).
std::string small_batch_linear_isa();

// A weight [out, in] (float32 or bfloat16, CPU) packed in panels [ceil(out / 32), in, 32] of its dtype
// (csrc/core/panel_linear.h), for panel_linear.
at::Tensor pack_panels(const at::Tensor& weight);
// y = x W^T + bias from W's panels: x [..., in] float32 CPU, panels as pack_panels returns them, bias [out]
// float32 or none, out_features W's first dimension. Returns [..., out] float32.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features);
// The same with the kernel named: 0 the portable loop, 1 AVX2/FMA, 2 AVX-512, 3 the widest this CPU runs (a
// level it does not run falls back to that); every level gives the same bits.
at::Tensor panel_linear_at_level(const at::Tensor& x, const at::Tensor& panels,
                                 const std::optional<at::Tensor>& bias, int64_t out_features, int64_t level);
// The kernel panel_linear runs on this CPU: "avx512", "avx2" or "scalar".
std::string panel_linear_isa();

// A linear layer's input as rows and its output: x [..., in] viewed as [rows, in] (contiguous), y [rows, out]
// allocated, the bias checked (float32 CPU [out]; undefined if none) and the shape [..., out] y takes back.
// For the CPU linear ops; `op` names the op in errors.
struct LinearRows {
  at::Tensor x;     // [rows, in]
  at::Tensor y;     // [rows, out]
  at::Tensor bias;  // [out], contiguous, or undefined
  std::vector<int64_t> out_shape;
  int64_t rows;
};
LinearRows linear_rows(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                       int64_t in_features, int64_t out_features);

// y = x W^T + bias with W in groups of 32 codes and a scale (csrc/core/quantized_linear.h): uint8 codes
// [out, in / 2] are Q4_1 (with min [out, in / 32]), int8 codes [out, in] Q8_0 (min none). x [..., in] float32
// CPU, scale [out, in / 32] float32, bias [out] or none. Returns [..., out].
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const std::optional<at::Tensor>& min, const std::optional<at::Tensor>& bias);
// The same with the kernel named, as small_batch_linear_at_level: for tests of every kernel this CPU runs.
at::Tensor quantized_linear_at_level(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                     const std::optional<at::Tensor>& min,
                                     const std::optional<at::Tensor>& bias, int64_t level);
// The kernel quantized_linear runs on this CPU: "avx512", "avx2" or "scalar".
std::string quantized_linear_isa();
// quantized_linear on x quantized to int8 per group of 32 (core::quantized_linear_int8: the quantized
// self-draft's kernel); the same arguments and checks. Levels: 0 portable, 1 AVX2, 2 AVX-512 VNNI, 3 default.
at::Tensor quantized_linear_int8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& min, const std::optional<at::Tensor>& bias);
at::Tensor quantized_linear_int8_at_level(const at::Tensor& x, const at::Tensor& codes,
                                          const at::Tensor& scale, const std::optional<at::Tensor>& min,
                                          const std::optional<at::Tensor>& bias, int64_t level);
// The kernel quantized_linear_int8 runs on this CPU: "avx512_vnni", "avx2" or "scalar".
std::string quantized_linear_int8_isa();

// The searched rounding of every group of weight [out, in] (core::search_q4_1_group, search_q8_0_group):
// GGUF's codes [out, in] (as floats), scale and min [out, in / 32] in, the searched ones out (new tensors).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_search_q4_1(
    const at::Tensor& weight, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
    const at::Tensor& error_weights, at::ArrayRef<double> cuts, int64_t refines);
std::tuple<at::Tensor, at::Tensor> quantize_search_q8_0(const at::Tensor& weight, const at::Tensor& codes,
                                                        const at::Tensor& scale,
                                                        const at::Tensor& error_weights, int64_t iterations);

// Host-side helpers shared with the decode loop.
std::vector<int64_t> to_int64_vector(const at::Tensor& t, const char* what);
void check_parents_or_throw(const std::vector<int64_t>& parents);
// Writes the additive mask of one block into rows [T] of `out` (rows of prefix_len + T columns,
// row stride out.stride(-2)); `anc` is the [T, T] ancestor matrix.
void fill_mask_rows(const std::vector<uint8_t>& anc, int64_t T, int64_t prefix_len, at::Tensor& out);

}  // namespace mtprobe::ops
