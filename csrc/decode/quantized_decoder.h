// The quantized self-draft's decoder step in C++: one token through a Llama-style model whose linear
// weights are group-quantized (csrc/core/quantized_linear.h), against a KV cache the caller owns.
//
// Why: through HF's modules, the quantized self-draft (python/mtprobe/target_model/self_draft.py) spends
// about half of each one-token forward outside its linear layers: module calls and a dozen small tensor ops a
// layer. This step runs the same computation with no Python and no per-op dispatch: the weights are
// planned once (the quantized twin's codes, shared, not copied), each step runs the layers in order.
// It computes what HF's LlamaDecoderLayer stack computes up to rounding; the draft only proposes, the
// target's own forward verifies, so the output is the target's either way.
//
// A step at position p: x = embed[token]; for each layer, attention (RMSNorm, q/k/v (with their biases:
// Qwen2), each head's RMSNorm (Qwen3), rotate-half RoPE at p, k and v written into the cache's row p,
// softmax over rows 0..p, o) and the SiLU MLP, each added to x; then the final norm and the head: logits
// [vocab] float32. Llama, Mistral, Qwen2 and Qwen3 layers are all this; Gemma 3's add the embedding's
// scale, norms of the attention's and the MLP's outputs, GELU, RoPE tables per layer type and sliding windows
// (a layer with a window attends to the rows p - window + 1..p only).
//
// Cache layout (mtprobe.target_model.cache.TreeKVLayer's buffers): keys and values [1, kv_heads, capacity,
// head_dim] float32 per layer, capacity > p; rows 0..p-1 must hold the sequence's entries already.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/aligned.h"
#include "core/decoder_step.h"
#include "decode/rope_tables.h"

namespace mtprobe {

// One linear layer: Q4_1 (uint8 codes [out, in / 2], scale and min [out, in / 32]) or Q8_0 (int8 codes
// [out, in], scale [out, in / 32], no min); bias [out] or undefined.
struct QuantizedWeights {
  at::Tensor codes, scale, min, bias;
  int64_t in_features() const;
  int64_t out_features() const { return codes.size(0); }
  bool q4() const { return codes.scalar_type() == at::kByte; }  // Q4_1 (else Q8_0)
  // ValueError, naming `who` and `name`, unless these are a layer [out, in]'s codes as above with float32
  // contiguous CPU scales (and Q4_1's minima) and bias.
  void check(int64_t in, int64_t out, const char* who, const std::string& name) const;
};

// The n layers w[0..n) (at most LayerColumns::kMax, each in_features wide) of one float32 input x [rows, in]
// into y[i] [rows, w[i]->out_features()], in one parallel region, their output columns one range split across
// the threads (decode/layer_columns.h), every row in one pass over the weights. xsum [rows, in / 32]: x's
// group sums (core::quantized_group_sums), read by the Q4_1 layers. limit > 0: only the first `limit` output
// columns of a single layer (y's rows keep its full width). Shared by QuantizedDecoder and TargetForward.
void quantized_linears(const QuantizedWeights* const* w, float* const* y, int64_t n, const float* x,
                       const float* xsum, int64_t rows, int64_t limit = 0);

// A layer as the target's C++ forward takes it (decode/target_forward.h's TargetLayer), its linear layers
// quantized.
struct QuantizedDecoderLayer {
  at::Tensor input_norm, post_norm;  // [hidden] float32 each: RMSNorm weights before attention and MLP
  QuantizedWeights q, k, v, o, gate, up, down;
  at::Tensor q_norm,
      k_norm;  // [head_dim] float32 each: Qwen3's and Gemma's RMSNorm over each head before RoPE, or
               // undefined
  at::Tensor attn_out_norm,
      mlp_out_norm;     // [hidden] float32 each: Gemma's norms of the outputs, or undefined
  at::Tensor inv_freq;  // [head_dim / 2] float32: this layer's own RoPE frequencies, or undefined
  int64_t window = 0;   // sliding attention: the rows p - window + 1..p attended at position p; 0: all
};

struct QuantizedDecoderConfig : core::DecoderShape {
  // The linear layers on x quantized to int8 per group of 32 (core::quantized_linear_int8): the weights read
  // nearer the memory's pace than the float kernel, which widens every code first; the draft's logits move by
  // the activations' rounding (about 1 % of their spread), which changes what it proposes, never the output.
  // Off by default: on SmolLM2 it agreed with the target less often than it saved
  // (self_draft.ACTIVATIONS_ENV).
  bool int8_activations = false;
};

class QuantizedDecoder {
 public:
  // embed [vocab, hidden] float32; inv_freq [head_dim / 2] float32 (RoPE's frequencies, HF's
  // rotary_emb.inv_freq); head: the output layer. Shapes are checked against each other (ValueError).
  QuantizedDecoder(at::Tensor embed, std::vector<QuantizedDecoderLayer> layers, at::Tensor final_norm,
                   QuantizedWeights head, at::Tensor inv_freq, QuantizedDecoderConfig config);

  // A second copy of the head in Q4_1 (`scan`, [vocab, hidden]) for steps that ask for a head scan (step()'s
  // head_scan). Why: the head in 8 bits is a quarter to a third of the draft's bytes (SmolLM2-135M: 32 of
  // 112 MB in 4 bits, of 151 in 8), and a draft reads only its best token (and, to stop a chain, the
  // margin to the second): in 4 bits the head reads two thirds of those bytes, and the rows it ranks
  // highest hold the 8-bit head's best (on SmolLM2's dev answers its top 16 held it at every one of 11,817
  // positions, its top 1 at 84 %), so those rows alone are computed again in 8 bits.
  void set_head_scan(QuantizedWeights scan);
  bool has_head_scan() const { return head_scan_.codes.defined(); }

  // Logits [vocab] float32 of `token` at `position`, its keys and values written into row `position`
  // of keys[l] and values[l] (one per layer, the layout above). One step at a time (a lock: the scratch
  // is the decoder's, and one decoder serves every generation of its model).
  //
  // head_rows > 0 computes the logits of the head's first head_rows rows and of the rows `extra_rows` (ids in
  // [head_rows, vocab)) only, every other logit -inf: a draft's vocabulary. Why: the head is a quarter of the
  // draft's bytes (SmolLM2-135M: 28 of 112 MB), and a BPE vocabulary's ids follow its merges, the most
  // frequent first, so the first rows and the sequence's own tokens hold almost every token a draft needs;
  // a token outside them is never proposed, which costs acceptance, never the output (the target verifies).
  //
  // head_scan > 0 (a decoder with a scan head, set_head_scan): the head's rows in 4 bits first (on int8
  // activations: it only ranks), then the head_scan rows ranked highest there (of the head_rows, where
  // given) and the extra_rows in 8 bits. Those logits are the whole head's, bit for bit; every other is its
  // 4-bit value. The draft proposes the best of
  // the 8-bit ones unless the 8-bit head's best lay outside the head_scan (never seen with 16 on SmolLM2);
  // a sampled draft's q is these logits' softmax, which verification judges it by, so the output stays the
  // target's.
  at::Tensor step(int64_t token, int64_t position, const std::vector<at::Tensor>& keys,
                  const std::vector<at::Tensor>& values, int64_t head_rows = 0,
                  const std::vector<int64_t>& extra_rows = {}, int64_t head_scan = 0);
  // step() for B rows at once, each its own sequence: row r's token at positions[r] against its own
  // caches keys[r], values[r] (distinct buffers); logits [B, vocab]. The linear layers take every row in
  // one pass over the weights, so B sequences drafting together read the 4-bit weights once a step.
  // head_rows, extra_rows and head_scan as step()'s, the same for every row.
  at::Tensor step_rows(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                       const std::vector<std::vector<at::Tensor>>& keys,
                       const std::vector<std::vector<at::Tensor>>& values, int64_t head_rows = 0,
                       const std::vector<int64_t>& extra_rows = {}, int64_t head_scan = 0);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool int8_activations() const { return config_.int8_activations; }

 private:
  // The linear layers `ws` of one input x [rows, in] into ys[i] [rows, ws[i].out_features()], in one
  // parallel region, their output columns one range split across the threads (decode/layer_columns.h).
  // `columns` > 0: only the first `columns` output columns of a single layer (y's rows keep its full width).
  // int8: on x quantized to int8 (QuantizedDecoderConfig::int8_activations), by default as configured.
  void linear(std::initializer_list<const QuantizedWeights*> ws, const float* x, int64_t rows,
              std::initializer_list<float*> ys, int64_t columns = 0, std::optional<bool> int8 = std::nullopt);
  void linear(const QuantizedWeights& w, const float* x, int64_t rows, float* y, int64_t columns = 0,
              std::optional<bool> int8 = std::nullopt) {
    linear({&w}, x, rows, {y}, columns, int8);
  }
  // The head's logits [rows, vocab] of the normed x (h_), all of them or a draft's vocabulary (step()).
  void head(int64_t rows, float* logits, int64_t head_rows, const std::vector<int64_t>& extra_rows,
            int64_t head_scan);
  // Row r's logits (logits: its [vocab]) of the head's rows ids[0..n) only (an id < 0 skipped), on the float
  // activations h_ (and, for a Q4_1 head, the group sums in xsum_).
  void exact_rows(int64_t r, float* logits, const int64_t* ids, int64_t n);
  void check_cache(const std::vector<at::Tensor>& caches, const char* name, int64_t position) const;

  at::Tensor embed_, final_norm_, inv_freq_;
  std::vector<QuantizedDecoderLayer> layers_;
  RopeTables rope_;  // inv_freq_, then the layers' own frequencies
  QuantizedWeights head_;
  QuantizedWeights head_scan_;  // the head in Q4_1 (set_head_scan), or undefined
  QuantizedDecoderConfig config_;
  int64_t hidden_, head_dim_, intermediate_, vocab_;
  // Scratch, grown as rows and contexts need: x, the normed x, q, k, v, the attention output, o/down's
  // output, gate, up, Q4_1's group sums of the input ([rows, width] each); scores; the attention's
  // per-range outputs [items, group, head_dim] and log-sum-exps [items, group].
  core::AlignedFloats x_, h_, q_, k_, v_, att_, out_, gate_, up_, xsum_, scores_, part_out_, part_lse_;
  // With int8_activations: the input's codes in Q4_1's and Q8_0's orders, and its groups' scales.
  std::vector<int8_t> xq4_, xq8_;
  core::AlignedFloats xscale_;
  std::mutex busy_;
};

}  // namespace mtprobe
