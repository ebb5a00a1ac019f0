// The small pieces of one Llama-style decoder step for a single token, on raw float32 pointers: the
// parts of the quantized self-draft's step (csrc/decode/quantized_decoder.h) that are not its linear
// layers (csrc/core/quantized_linear.h). Torch-free, C++17.
//
// Why: the quantized self-draft's forward through HF's modules spends about half its time outside its
// linear layers (module calls and a dozen small tensor ops per layer for one token); these loops over
// a few hundred floats cost microseconds. Each matches what HF's Llama modules compute, up to rounding:
//   rms_norm     LlamaRMSNorm:   y = w * x / sqrt(mean(x^2) + eps)
//   rotate_half  apply_rotary_pos_emb's rotate-half layout, pairs (i, i + d/2) turned by angle i
//   attend       the queries of one key/value head against `len` cached keys: softmax(scale * q.k)
//                over them, times the values (merge_attention joins ranges of keys attended apart)
//   silu_mul     LlamaMLP's act(gate) * up with SiLU (gelu_tanh_mul: Gemma's, with GELU's tanh form)
//
// Example (rotate_half, head_dim 4, one head, angles 90 and 0 degrees: cos {0, 1}, sin {1, 0}):
//   x = {1, 2, 3, 4} -> {1 * 0 - 3 * 1, 2 * 1 - 4 * 0, 3 * 0 + 1 * 1, 4 * 1 + 2 * 0} = {-3, 2, 1, 4}.
#pragma once

#include <cstdint>

namespace mtprobe::core {

// y[i] = w[i] * x[i] / sqrt(mean(x^2) + eps), n floats; y may be x.
void rms_norm(const float* x, const float* w, float eps, int64_t n, float* y);

// Turns each of `heads` vectors of `head_dim` floats (contiguous, head after head) in place:
// x[i] <- x[i] cos[i] - x[i + d/2] sin[i], x[i + d/2] <- x[i + d/2] cos[i] + x[i] sin[i], i < d/2.
void rotate_half(float* x, int64_t heads, int64_t head_dim, const float* cos, const float* sin);

// Attention of `group` query heads (q [group, head_dim], contiguous) that share one key/value head:
// out[h] = sum_j p_hj v_j with p_h = softmax_j(scale * q_h . k_j) over the `len` >= 1 keys and values
// k_j = k + j * stride (and v_j likewise); scores: scratch for group * len floats; out [group, head_dim].
// lse [group], unless null, receives log sum_j e^(scale * q_h . k_j): what merge_attention needs to
// combine attentions over separate ranges of keys (one thread each).
void attend(const float* q, int64_t group, const float* k, const float* v, int64_t len, int64_t head_dim,
            int64_t stride, float scale, float* scores, float* out, float* lse = nullptr);
// The same over bfloat16 keys and values (their bits, as torch stores them), widened as they are read.
void attend(const float* q, int64_t group, const uint16_t* k, const uint16_t* v, int64_t len,
            int64_t head_dim, int64_t stride, float scale, float* scores, float* out, float* lse = nullptr);

// The attention over the union of `chunks` disjoint key ranges from each range's own (attend's out and
// lse, chunk after chunk: outs [chunks, group, head_dim], lses [chunks, group]): out [group, head_dim] =
// sum_c e^(lse_c - lse) out_c with lse = log sum_c e^lse_c, the split-and-merge of flash decoding.
// Example (one head, head_dim 1): ranges with out 1 and 3 and lse log 1 and log 3 -> (1 * 1 + 3 * 3) / 4.
void merge_attention(const float* outs, const float* lses, int64_t chunks, int64_t group, int64_t head_dim,
                     float* out);

// y[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i], n floats; y may be gate.
void silu_mul(const float* gate, const float* up, int64_t n, float* y);

// y[i] = gelu_tanh(gate[i]) * up[i] (Gemma's MLP; torch's gelu(approximate="tanh")), n floats; y may be gate.
void gelu_tanh_mul(const float* gate, const float* up, int64_t n, float* y);

// A gated MLP's activation: act(gate) * up.
enum class Activation { kSilu, kGeluTanh };

// What the target's C++ forward and the self-draft's C++ step share of a decoder's configuration
// (decode/target_forward.h's TargetForwardConfig and decode/quantized_decoder.h's QuantizedDecoderConfig
// extend it).
struct DecoderShape {
  int64_t heads = 0, kv_heads = 0;  // query heads, key/value heads (a multiple: grouped-query attention)
  float eps = 1e-5f;                // RMSNorm's
  float scale = 0.0f;               // attention logits' factor, head_dim^-0.5 for Llama
  float rope_scaling = 1.0f;        // RoPE's cos and sin factor (HF's attention_scaling)
  float embed_scale = 1.0f;  // the tokens' embedding rows' factor (Gemma: sqrt(hidden) in the model's dtype)
  Activation activation = Activation::kSilu;  // the MLP's: SiLU, or GELU's tanh form (Gemma)
};

// y[i] = act(gate[i]) * up[i] by `act`, n floats; y may be gate.
inline void act_mul(Activation act, const float* gate, const float* up, int64_t n, float* y) {
  if (act == Activation::kGeluTanh) {
    gelu_tanh_mul(gate, up, n, y);
  } else {
    silu_mul(gate, up, n, y);
  }
}

}  // namespace mtprobe::core
