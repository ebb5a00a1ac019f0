// torch.ops.mtprobe: schemas and CPU kernels. Fake (meta) kernels live in python/mtprobe/ops.py,
// so torch.compile can trace through every op.
#include <torch/library.h>

#include "ops/ops.h"

TORCH_LIBRARY(mtprobe, m) {
  m.def("tree_attention_mask(Tensor parents, SymInt prefix_len, ScalarType dtype) -> Tensor");
  m.def("tree_position_ids(Tensor parents, SymInt prefix_len) -> Tensor");
  m.def("verify_greedy(Tensor tokens, Tensor parents, Tensor target, int root) -> Tensor");
  m.def(
      "verify_rejection(Tensor tokens, Tensor parents, Tensor p, Tensor q, Tensor uniforms) -> (Tensor, "
      "Tensor)");
  m.def("compact_kv_(Tensor(a!)[] caches, Tensor src, int dst_start) -> ()");
  m.def("tree_ancestor_bits(Tensor parents) -> Tensor");
  m.def(
      "expand_draft_tree(Tensor logits, Tensor root_token, int budget, int width, bool prune) -> (Tensor, "
      "Tensor, Tensor, Tensor)");
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor ancestor_bits, float scale) -> Tensor");
  // A linear layer over a few rows on the CPU (csrc/ops/small_batch_linear.cpp).
  m.def("small_batch_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // The same from the weight packed in panels (csrc/ops/panel_linear.cpp): the C++ target forward's kernel.
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  // A linear layer with a group-quantized weight on the CPU, the quantized self-draft's
  // (csrc/ops/quantized_linear.cpp).
  m.def("quantized_linear(Tensor x, Tensor codes, Tensor scale, Tensor? min, Tensor? bias) -> Tensor");
  // The same on x quantized to int8 per group of 32: the quantized self-draft's C++ step's kernel.
  m.def("quantized_linear_int8(Tensor x, Tensor codes, Tensor scale, Tensor? min, Tensor? bias) -> Tensor");
  // Its searched rounding, group by group (mtprobe.cpu.quantized_linear.quantize(search=True)).
  m.def(
      "quantize_search_q4_1(Tensor weight, Tensor codes, Tensor scale, Tensor min, Tensor error_weights, "
      "float[] cuts, int refines) -> (Tensor, Tensor, Tensor)");
  m.def(
      "quantize_search_q8_0(Tensor weight, Tensor codes, Tensor scale, Tensor error_weights, int iterations) "
      "-> "
      "(Tensor, Tensor)");
  // Circuit heads (csrc/ops/circuit.cpp; CUDA: circuit_cuda.cu).
  m.def(
      "circuit_log_prob(str kind, Tensor weights, Tensor transitions, Tensor emissions, Tensor tokens) -> "
      "Tensor");
  m.def(
      "circuit_prefix_log_marginals(str kind, Tensor weights, Tensor transitions, Tensor emissions, Tensor "
      "tokens) -> Tensor");
  m.def(
      "circuit_next_token_log_probs(str kind, Tensor weights, Tensor transitions, Tensor emissions, Tensor "
      "prefix) -> Tensor");
  m.def(
      "circuit_sample(str kind, Tensor weights, Tensor transitions, Tensor emissions, Tensor uniforms) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(mtprobe, CPU, m) {
  m.impl("tree_attention_mask", &mtprobe::ops::tree_attention_mask);
  m.impl("tree_position_ids", &mtprobe::ops::tree_position_ids);
  m.impl("verify_greedy", &mtprobe::ops::verify_greedy);
  m.impl("verify_rejection", &mtprobe::ops::verify_rejection);
  m.impl("compact_kv_", &mtprobe::ops::compact_kv_);
  m.impl("tree_ancestor_bits", &mtprobe::ops::tree_ancestor_bits);
  m.impl("tree_attention", &mtprobe::ops::tree_attention);
  m.impl("expand_draft_tree", &mtprobe::ops::expand_draft_tree);
  m.impl("small_batch_linear", &mtprobe::ops::small_batch_linear);
  m.impl("pack_panels", &mtprobe::ops::pack_panels);
  m.impl("panel_linear", &mtprobe::ops::panel_linear);
  m.impl("quantized_linear", &mtprobe::ops::quantized_linear);
  m.impl("quantized_linear_int8", &mtprobe::ops::quantized_linear_int8);
  m.impl("quantize_search_q4_1", &mtprobe::ops::quantize_search_q4_1);
  m.impl("quantize_search_q8_0", &mtprobe::ops::quantize_search_q8_0);
  m.impl("circuit_log_prob", &mtprobe::ops::circuit_log_prob);
  m.impl("circuit_prefix_log_marginals", &mtprobe::ops::circuit_prefix_log_marginals);
  m.impl("circuit_next_token_log_probs", &mtprobe::ops::circuit_next_token_log_probs);
  m.impl("circuit_sample", &mtprobe::ops::circuit_sample);
}
