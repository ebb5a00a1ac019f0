#include "decode/quantized_decoder.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/decoder_step.h"
#include "core/quantized_linear.h"
#include "decode/layer_columns.h"

namespace mtprobe {
namespace {

constexpr int64_t G = core::kQuantGroup;

bool is_q4(const QuantizedWeights& w) { return w.q4(); }

void check_vector(const at::Tensor& t, int64_t n, const std::string& name,
                  const char* who = "QuantizedDecoder") {
  TORCH_CHECK_VALUE(t.defined() && t.dim() == 1 && t.size(0) == n && t.scalar_type() == at::kFloat &&
                        t.is_cpu() && t.is_contiguous(),
                    who, ": ", name, " must be a contiguous float32 CPU tensor [", n, "], got ",
                    t.defined() ? t.toString() + " " + c10::str(t.sizes()) : std::string("none"));
}

void check_weights(const QuantizedWeights& w, int64_t in, int64_t out, const std::string& name) {
  w.check(in, out, "QuantizedDecoder", name);
}

}  // namespace

int64_t QuantizedWeights::in_features() const {
  return codes.scalar_type() == at::kByte ? codes.size(1) * 2 : codes.size(1);
}

void QuantizedWeights::check(int64_t in, int64_t out, const char* who, const std::string& name) const {
  TORCH_CHECK_VALUE(codes.defined() && codes.dim() == 2 && codes.is_contiguous() && codes.is_cpu() &&
                        (codes.scalar_type() == at::kByte || codes.scalar_type() == at::kChar),
                    who, ": ", name,
                    ".codes must be contiguous uint8 (Q4_1) or int8 (Q8_0) CPU codes [out, in / 2 or in]");
  TORCH_CHECK_VALUE(in_features() == in && out_features() == out, who, ": ", name, " is [", out_features(),
                    ", ", in_features(), "] but the model needs [", out, ", ", in, "]");
  TORCH_CHECK_VALUE(in % G == 0, who, ": ", name, " has ", in, " inputs, not groups of ", G,
                    " (keep such a layer unquantized)");
  auto check_groups = [&](const at::Tensor& t, const char* part) {
    TORCH_CHECK_VALUE(t.defined() && t.dim() == 2 && t.size(0) == out && t.size(1) == in / G &&
                          t.scalar_type() == at::kFloat && t.is_contiguous() && t.is_cpu(),
                      who, ": ", name, ".", part, " must be contiguous float32 [", out, ", ", in / G, "]");
  };
  check_groups(scale, "scale");
  if (q4()) check_groups(min, "min");
  TORCH_CHECK_VALUE(q4() || !min.defined(), who, ": ", name, " is Q8_0, which has no min");
  if (bias.defined()) check_vector(bias, out, name + ".bias", who);
}

void quantized_linears(const QuantizedWeights* const* w, float* const* y, int64_t n, const float* x,
                       const float* xsum, int64_t rows, int64_t limit) {
  const int64_t in = w[0]->in_features();
  TORCH_INTERNAL_ASSERT(n >= 1 && n <= LayerColumns::kMax);
  TORCH_INTERNAL_ASSERT(limit == 0 || (n == 1 && limit <= w[0]->out_features()));
  LayerColumns columns;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_INTERNAL_ASSERT(w[i]->in_features() == in);
    columns.add(limit > 0 ? limit : w[i]->out_features());
  }
  // A grain of 64 columns, as the quantized_linear op.
  at::parallel_for(0, columns.total(), 64, [&](int64_t begin, int64_t end) {
    columns.each(begin, end, [&](int64_t i, int64_t from, int64_t to) {
      const QuantizedWeights& L = *w[i];
      const bool q4 = L.q4();
      core::quantized_linear(x, q4 ? xsum : nullptr, rows, in, L.codes.const_data_ptr(),
                             q4 ? core::QuantFormat::kQ4_1 : core::QuantFormat::kQ8_0,
                             L.scale.const_data_ptr<float>(), q4 ? L.min.const_data_ptr<float>() : nullptr,
                             L.bias.defined() ? L.bias.const_data_ptr<float>() : nullptr, y[i],
                             L.out_features(), from, to);
    });
  });
}

QuantizedDecoder::QuantizedDecoder(at::Tensor embed, std::vector<QuantizedDecoderLayer> layers,
                                   at::Tensor final_norm, QuantizedWeights head, at::Tensor inv_freq,
                                   QuantizedDecoderConfig config)
    : embed_(std::move(embed)),
      final_norm_(std::move(final_norm)),
      inv_freq_(std::move(inv_freq)),
      layers_(std::move(layers)),
      rope_(inv_freq_),
      head_(std::move(head)),
      config_(config) {
  TORCH_CHECK_VALUE(
      embed_.dim() == 2 && embed_.scalar_type() == at::kFloat && embed_.is_cpu() && embed_.is_contiguous(),
      "QuantizedDecoder: embed must be a contiguous float32 CPU tensor [vocab, hidden], got ",
      embed_.sizes());
  TORCH_CHECK_VALUE(!layers_.empty(), "QuantizedDecoder: the model needs at least one layer");
  TORCH_CHECK_VALUE(config_.heads >= 1 && config_.kv_heads >= 1 && config_.heads % config_.kv_heads == 0,
                    "QuantizedDecoder: heads (", config_.heads, ") must be a positive multiple of kv_heads (",
                    config_.kv_heads, ")");
  hidden_ = embed_.size(1);
  vocab_ = head_.out_features();
  TORCH_CHECK_VALUE(hidden_ % G == 0, "QuantizedDecoder: hidden size ", hidden_, " must be a multiple of ",
                    G);
  const int64_t q_out = layers_[0].q.out_features();
  TORCH_CHECK_VALUE(q_out % config_.heads == 0, "QuantizedDecoder: q_proj's ", q_out,
                    " outputs do not split into ", config_.heads, " heads");
  head_dim_ = q_out / config_.heads;
  TORCH_CHECK_VALUE(head_dim_ % 2 == 0, "QuantizedDecoder: head_dim ", head_dim_, " must be even (RoPE)");
  intermediate_ = layers_[0].gate.out_features();
  check_vector(inv_freq_, head_dim_ / 2, "inv_freq");
  check_vector(final_norm_, hidden_, "final_norm");
  check_weights(head_, hidden_, vocab_, "head");
  const int64_t kv_out = config_.kv_heads * head_dim_;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const QuantizedDecoderLayer& L = layers_[l];
    const std::string at = "layer " + std::to_string(l) + " ";
    check_vector(L.input_norm, hidden_, at + "input_norm");
    check_vector(L.post_norm, hidden_, at + "post_norm");
    check_weights(L.q, hidden_, q_out, at + "q");
    check_weights(L.k, hidden_, kv_out, at + "k");
    check_weights(L.v, hidden_, kv_out, at + "v");
    check_weights(L.o, q_out, hidden_, at + "o");
    check_weights(L.gate, hidden_, intermediate_, at + "gate");
    check_weights(L.up, hidden_, intermediate_, at + "up");
    check_weights(L.down, intermediate_, hidden_, at + "down");
    auto optional_pair = [&](const at::Tensor& a, const at::Tensor& b, int64_t n, const char* an,
                             const char* bn) {
      TORCH_CHECK_VALUE(a.defined() == b.defined(), "QuantizedDecoder: ", at, "has one of ", an, " and ", bn,
                        " but not the other");
      if (!a.defined()) return;
      check_vector(a, n, at + an);
      check_vector(b, n, at + bn);
    };
    optional_pair(L.q_norm, L.k_norm, head_dim_, "q_norm", "k_norm");
    optional_pair(L.attn_out_norm, L.mlp_out_norm, hidden_, "attn_out_norm", "mlp_out_norm");
    TORCH_CHECK_VALUE(L.window >= 0, "QuantizedDecoder: ", at,
                      "window must be >= 0 (0: full attention), got ", L.window);
    if (L.inv_freq.defined()) check_vector(L.inv_freq, head_dim_ / 2, at + "inv_freq");
    rope_.add_layer(L.inv_freq);
  }
  x_.resize(hidden_);
  h_.resize(hidden_);
  out_.resize(hidden_);
  q_.resize(q_out);
  att_.resize(q_out);
  k_.resize(kv_out);
  v_.resize(kv_out);
  gate_.resize(intermediate_);
  up_.resize(intermediate_);
  xsum_.resize(std::max(hidden_, std::max(intermediate_, q_out)) / G);
  xscale_.resize(std::max(hidden_, std::max(intermediate_, q_out)) / G);
}

void QuantizedDecoder::linear(std::initializer_list<const QuantizedWeights*> ws, const float* x, int64_t rows,
                              std::initializer_list<float*> ys, int64_t limit, std::optional<bool> int8) {
  const QuantizedWeights* const* w = ws.begin();
  float* const* y = ys.begin();
  const int64_t n = static_cast<int64_t>(ws.size()), in = w[0]->in_features();
  bool any_q4 = false, any_q8 = false;
  for (int64_t i = 0; i < n; ++i) {
    any_q4 = any_q4 || is_q4(*w[i]);
    any_q8 = any_q8 || !is_q4(*w[i]);
  }
  if (any_q4) core::quantized_group_sums(x, rows, in, xsum_.data());  // x's, shared by the layers
  TORCH_INTERNAL_ASSERT(n == static_cast<int64_t>(ys.size()) && n <= LayerColumns::kMax);
  if (!int8.value_or(config_.int8_activations)) {
    quantized_linears(w, y, n, x, xsum_.data(), rows, limit);
    return;
  }
  TORCH_INTERNAL_ASSERT(limit == 0 || (n == 1 && limit <= w[0]->out_features()));
  LayerColumns columns;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_INTERNAL_ASSERT(w[i]->in_features() == in);
    columns.add(limit > 0 ? limit : w[i]->out_features());
  }
  // x's codes, once for the layers of each format.
  if (static_cast<int64_t>(xq4_.size()) < rows * in) {
    xq4_.resize(rows * in);
    xq8_.resize(rows * in);
  }
  if (any_q4) core::quantize_activations(x, rows, in, core::QuantFormat::kQ4_1, xq4_.data(), xscale_.data());
  if (any_q8) core::quantize_activations(x, rows, in, core::QuantFormat::kQ8_0, xq8_.data(), xscale_.data());
  // A grain of 64 columns, as the quantized_linear op; every row in one pass over the weights.
  at::parallel_for(0, columns.total(), 64, [&](int64_t begin, int64_t end) {
    columns.each(begin, end, [&](int64_t i, int64_t from, int64_t to) {
      const QuantizedWeights& L = *w[i];
      const bool q4 = is_q4(L);
      core::quantized_linear_int8(
          q4 ? xq4_.data() : xq8_.data(), xscale_.data(), q4 ? xsum_.data() : nullptr, rows, in,
          L.codes.const_data_ptr(), q4 ? core::QuantFormat::kQ4_1 : core::QuantFormat::kQ8_0,
          L.scale.const_data_ptr<float>(), q4 ? L.min.const_data_ptr<float>() : nullptr,
          L.bias.defined() ? L.bias.const_data_ptr<float>() : nullptr, y[i], L.out_features(), from, to);
    });
  });
}

void QuantizedDecoder::check_cache(const std::vector<at::Tensor>& caches, const char* name,
                                   int64_t position) const {
  TORCH_CHECK_VALUE(static_cast<int64_t>(caches.size()) == num_layers(), "QuantizedDecoder.step: ", name,
                    " must hold one buffer per layer (", num_layers(), "), got ", caches.size());
  for (const at::Tensor& t : caches) {
    TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == 1 && t.size(1) == config_.kv_heads &&
                          t.size(3) == head_dim_ && t.scalar_type() == at::kFloat && t.is_cpu() &&
                          t.stride(3) == 1,
                      "QuantizedDecoder.step: each of ", name, " must be float32 CPU [1, ", config_.kv_heads,
                      ", capacity, ", head_dim_, "] with unit stride in its last dimension, got ",
                      t.scalar_type(), " ", t.sizes());
    TORCH_CHECK_VALUE(position < t.size(2), "QuantizedDecoder.step: position ", position,
                      " does not fit a cache of capacity ", t.size(2), " (", name, ")");
  }
}

void QuantizedDecoder::set_head_scan(QuantizedWeights scan) {
  TORCH_CHECK_VALUE(
      scan.codes.defined() && scan.q4(),
      "QuantizedDecoder.set_head_scan: the scan head must be Q4_1 codes (uint8 [vocab, hidden / 2])");
  check_weights(scan, hidden_, vocab_, "head_scan");
  TORCH_CHECK_VALUE(!scan.bias.defined(),
                    "QuantizedDecoder.set_head_scan: the scan head takes the head's own bias; pass none");
  scan.bias = head_.bias;  // its logits are the head's, up to the codes' rounding
  head_scan_ = std::move(scan);
}

namespace {
// The ids of the k largest of v[0..n) (0 < k <= n), best first, -1 where fewer than k values exceed -inf:
// a sorted list of the best so far, which most values pass with one comparison (a NaN never enters).
void top_ids(const float* v, int64_t n, int64_t k, int64_t* ids, float* best) {
  std::fill_n(best, k, -std::numeric_limits<float>::infinity());
  std::fill_n(ids, k, int64_t{-1});
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[i];
    if (!(x > best[k - 1])) continue;
    int64_t j = k - 1;
    for (; j > 0 && best[j - 1] < x; --j) {
      best[j] = best[j - 1];
      ids[j] = ids[j - 1];
    }
    best[j] = x;
    ids[j] = i;
  }
}
}  // namespace

void QuantizedDecoder::exact_rows(int64_t r, float* logits, const int64_t* ids, int64_t n) {
  const bool q4 = is_q4(head_);
  const auto format = q4 ? core::QuantFormat::kQ4_1 : core::QuantFormat::kQ8_0;
  const int64_t groups = hidden_ / G;
  const float* sums = q4 ? xsum_.data() + r * groups : nullptr;
  const float* min = q4 ? head_.min.const_data_ptr<float>() : nullptr;
  const float* bias = head_.bias.defined() ? head_.bias.const_data_ptr<float>() : nullptr;
  const int8_t* xq = (q4 ? xq4_.data() : xq8_.data()) + r * hidden_;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0) continue;
    // Row r's logit ids[i] alone, by the kernel and in the order the whole head computes it: the same bits.
    if (config_.int8_activations) {
      core::quantized_linear_int8(xq, xscale_.data() + r * groups, sums, 1, hidden_,
                                  head_.codes.const_data_ptr(), format, head_.scale.const_data_ptr<float>(),
                                  min, bias, logits, vocab_, ids[i], ids[i] + 1);
    } else {
      core::quantized_linear(h_.data() + r * hidden_, sums, 1, hidden_, head_.codes.const_data_ptr(), format,
                             head_.scale.const_data_ptr<float>(), min, bias, logits, vocab_, ids[i],
                             ids[i] + 1);
    }
  }
}

void QuantizedDecoder::head(int64_t rows, float* logits, int64_t head_rows,
                            const std::vector<int64_t>& extra_rows, int64_t head_scan) {
  const int64_t limit = head_rows == 0 || head_rows >= vocab_ ? vocab_ : head_rows;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  if (head_scan > 0 && head_scan < limit) {
    // The 4-bit head over the rows asked for, then each row's best head_scan of them (and the extra rows)
    // in 8 bits. The 4-bit pass leaves the normed x's group sums in xsum_, which an 8-bit head ignores.
    // The scan ranks only, so it runs on int8 activations (the memory's pace); the head's own rows then run
    // as the whole head would, on the activations it is configured for (int8 ones quantized here for it).
    linear(head_scan_, h_.data(), rows, logits, limit < vocab_ ? limit : 0, true);
    if (config_.int8_activations) {
      const core::QuantFormat format = is_q4(head_) ? core::QuantFormat::kQ4_1 : core::QuantFormat::kQ8_0;
      core::quantize_activations(h_.data(), rows, hidden_, format,
                                 (format == core::QuantFormat::kQ4_1 ? xq4_ : xq8_).data(), xscale_.data());
    }
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> ids(head_scan);
      std::vector<float> best(head_scan);
      for (int64_t r = begin; r < end; ++r) {
        float* row = logits + r * vocab_;
        top_ids(row, limit, head_scan, ids.data(), best.data());
        exact_rows(r, row, ids.data(), head_scan);
        if (limit == vocab_) continue;
        std::fill(row + limit, row + vocab_, kNone);
        for (const int64_t id : extra_rows) {
          if (id >= limit) exact_rows(r, row, &id, 1);
        }
      }
    });
    return;
  }
  if (limit == vocab_) {
    linear(head_, h_.data(), rows, logits);
    return;
  }
  // linear() leaves the normed x's group sums (Q4_1) or codes (int8) in the scratch: the extra rows reuse
  // them.
  linear(head_, h_.data(), rows, logits, head_rows);
  for (int64_t r = 0; r < rows; ++r)
    std::fill(logits + r * vocab_ + head_rows, logits + (r + 1) * vocab_, kNone);
  const bool q4 = is_q4(head_);
  const auto format = q4 ? core::QuantFormat::kQ4_1 : core::QuantFormat::kQ8_0;
  const float* min = q4 ? head_.min.const_data_ptr<float>() : nullptr;
  const float* bias = head_.bias.defined() ? head_.bias.const_data_ptr<float>() : nullptr;
  const float* sums = q4 ? xsum_.data() : nullptr;
  for (const int64_t id : extra_rows) {
    if (id < head_rows) continue;  // computed already
    if (config_.int8_activations) {
      core::quantized_linear_int8(q4 ? xq4_.data() : xq8_.data(), xscale_.data(), sums, rows, hidden_,
                                  head_.codes.const_data_ptr(), format, head_.scale.const_data_ptr<float>(),
                                  min, bias, logits, vocab_, id, id + 1);
    } else {
      core::quantized_linear(h_.data(), sums, rows, hidden_, head_.codes.const_data_ptr(), format,
                             head_.scale.const_data_ptr<float>(), min, bias, logits, vocab_, id, id + 1);
    }
  }
}

at::Tensor QuantizedDecoder::step(int64_t token, int64_t position, const std::vector<at::Tensor>& keys,
                                  const std::vector<at::Tensor>& values, int64_t head_rows,
                                  const std::vector<int64_t>& extra_rows, int64_t head_scan) {
  return step_rows({token}, {position}, {keys}, {values}, head_rows, extra_rows, head_scan)[0];
}

at::Tensor QuantizedDecoder::step_rows(const std::vector<int64_t>& tokens,
                                       const std::vector<int64_t>& positions,
                                       const std::vector<std::vector<at::Tensor>>& keys,
                                       const std::vector<std::vector<at::Tensor>>& values, int64_t head_rows,
                                       const std::vector<int64_t>& extra_rows, int64_t head_scan) {
  const int64_t B = static_cast<int64_t>(tokens.size());
  TORCH_CHECK_VALUE(head_scan >= 0,
                    "QuantizedDecoder.step: head_scan must be >= 0 (0: the whole 8-bit head), got ",
                    head_scan);
  TORCH_CHECK_VALUE(head_scan == 0 || has_head_scan(), "QuantizedDecoder.step: head_scan=", head_scan,
                    " needs a 4-bit scan head (set_head_scan), which this decoder lacks; pass head_scan=0");
  TORCH_CHECK_VALUE(head_rows >= 0 && head_rows <= vocab_, "QuantizedDecoder.step: head_rows must be in [0, ",
                    vocab_, "] (0: the whole head), got ", head_rows);
  for (const int64_t id : extra_rows) {
    TORCH_CHECK_VALUE(id >= 0 && id < vocab_, "QuantizedDecoder.step: extra_rows holds ", id,
                      ", outside the vocabulary [0, ", vocab_, ")");
  }
  TORCH_CHECK_VALUE(B >= 1 && positions.size() == tokens.size() && keys.size() == tokens.size() &&
                        values.size() == tokens.size(),
                    "QuantizedDecoder.step_rows: one token, position, keys and values per row; got ", B,
                    " tokens, ", positions.size(), " positions, ", keys.size(), " keys, ", values.size(),
                    " values");
  for (int64_t r = 0; r < B; ++r) {
    TORCH_CHECK_VALUE(tokens[r] >= 0 && tokens[r] < embed_.size(0), "QuantizedDecoder.step: row ", r,
                      "'s token ", tokens[r], " is outside the vocabulary [0, ", embed_.size(0), ")");
    TORCH_CHECK_VALUE(positions[r] >= 0, "QuantizedDecoder.step: row ", r, "'s position must be >= 0, got ",
                      positions[r]);
    check_cache(keys[r], "keys", positions[r]);
    check_cache(values[r], "values", positions[r]);
    for (int64_t o = 0; o < r; ++o) {
      TORCH_CHECK_VALUE(!keys[o][0].is_same(keys[r][0]), "QuantizedDecoder.step_rows: rows ", o, " and ", r,
                        " share a cache; each row writes its own");
    }
  }
  std::lock_guard<std::mutex> lock(busy_);
  const int64_t d = head_dim_, half = d / 2, heads = config_.heads, kv = config_.kv_heads;
  const int64_t group = heads / kv, q_out = heads * d, kv_out = kv * d;
  // Scratch for B rows ([B, width] each), grown as needed and kept.
  auto fit = [](core::AlignedFloats& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  };
  fit(x_, B * hidden_), fit(h_, B * hidden_), fit(out_, B * hidden_), fit(q_, B * q_out),
      fit(att_, B * q_out);
  fit(k_, B * kv_out), fit(v_, B * kv_out), fit(gate_, B * intermediate_), fit(up_, B * intermediate_);
  fit(xsum_, B * std::max(hidden_, std::max(intermediate_, q_out)) / G);
  fit(xscale_, B * std::max(hidden_, std::max(intermediate_, q_out)) / G);
  // RoPE's angles at each row's position per table, in float32 as HF computes them: [tables, B, half] each.
  const int64_t tables = static_cast<int64_t>(rope_.tables.size());
  std::vector<float> cos(tables * B * half), sin(tables * B * half);
  // Per row: its rows attended (len), its ranges (chunks: up to two per thread and head, of 128 rows or
  // more, since shorter ones cost more to merge than they save), and where its scratch starts.
  std::vector<int64_t> len(B), chunks(B), item0(B + 1, 0), score0(B + 1, 0);
  for (int64_t r = 0; r < B; ++r) {
    float* xr = x_.data() + r * hidden_;
    std::copy_n(embed_.const_data_ptr<float>() + tokens[r] * hidden_, hidden_, xr);
    if (config_.embed_scale != 1.0f) {
      for (int64_t j = 0; j < hidden_; ++j) xr[j] *= config_.embed_scale;
    }
    rope_.angles(&positions[r], 1, r, B, half, config_.rope_scaling, cos.data(), sin.data());
    len[r] = positions[r] + 1;
    chunks[r] = std::max<int64_t>(1, std::min<int64_t>(len[r] / 128, 2 * at::get_num_threads()));
    item0[r + 1] = item0[r] + kv * chunks[r];
    score0[r + 1] = score0[r] + heads * len[r];
  }
  fit(scores_, score0[B]);
  fit(part_out_, item0[B] * group * d);
  fit(part_lse_, item0[B] * group);
  // out_'s rows normed by `norm` (Gemma's output norms) where it is defined, then added to x_.
  auto add_residual = [&](const at::Tensor& norm) {
    for (int64_t r = 0; norm.defined() && r < B; ++r) {
      float* o = out_.data() + r * hidden_;
      core::rms_norm(o, norm.const_data_ptr<float>(), config_.eps, hidden_, o);
    }
    for (int64_t i = 0; i < B * hidden_; ++i) x_[i] += out_[i];
  };
  for (size_t l = 0; l < layers_.size(); ++l) {
    const QuantizedDecoderLayer& L = layers_[l];
    const float* cos_l = cos.data() + rope_.of_layer[l] * B * half;
    const float* sin_l = sin.data() + rope_.of_layer[l] * B * half;
    for (int64_t r = 0; r < B; ++r)
      core::rms_norm(x_.data() + r * hidden_, L.input_norm.const_data_ptr<float>(), config_.eps, hidden_,
                     h_.data() + r * hidden_);
    linear({&L.q, &L.k, &L.v}, h_.data(), B, {q_.data(), k_.data(), v_.data()});
    for (int64_t r = 0; r < B; ++r) {
      if (L.q_norm.defined()) {  // Qwen3, Gemma: RMSNorm over each head before RoPE
        float* qr = q_.data() + r * q_out;
        float* kr = k_.data() + r * kv_out;
        for (int64_t h = 0; h < heads; ++h)
          core::rms_norm(qr + h * d, L.q_norm.const_data_ptr<float>(), config_.eps, d, qr + h * d);
        for (int64_t h = 0; h < kv; ++h)
          core::rms_norm(kr + h * d, L.k_norm.const_data_ptr<float>(), config_.eps, d, kr + h * d);
      }
      core::rotate_half(q_.data() + r * q_out, heads, d, cos_l + r * half, sin_l + r * half);
      core::rotate_half(k_.data() + r * kv_out, kv, d, cos_l + r * half, sin_l + r * half);
      float* K = keys[r][l].mutable_data_ptr<float>();
      float* V = values[r][l].mutable_data_ptr<float>();
      const int64_t ks1 = keys[r][l].stride(1), ks2 = keys[r][l].stride(2);
      const int64_t vs1 = values[r][l].stride(1), vs2 = values[r][l].stride(2);
      TORCH_CHECK_VALUE(ks2 == vs2, "QuantizedDecoder.step: keys and values of layer ", l,
                        " differ in row stride");
      for (int64_t h = 0; h < kv; ++h) {
        std::copy_n(k_.data() + r * kv_out + h * d, d, K + h * ks1 + positions[r] * ks2);
        std::copy_n(v_.data() + r * kv_out + h * d, d, V + h * vs1 + positions[r] * vs2);
      }
    }
    // Each row's key/value heads, their rows split into ranges, one work item each, merged by their
    // log-sum-exps: a handful of heads over a long context keeps every thread reading.
    at::parallel_for(0, item0[B], 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = std::upper_bound(item0.begin(), item0.end(), item) - item0.begin() - 1;
        const int64_t local = item - item0[r], n = chunks[r];
        const int64_t g = local / n, c = local % n;
        // The rows attended: all of 0..p, or the window's last ones.
        const int64_t lo = L.window > 0 ? std::max<int64_t>(0, len[r] - L.window) : 0;
        const int64_t from = lo + (len[r] - lo) * c / n, rows = lo + (len[r] - lo) * (c + 1) / n - from;
        if (rows == 0) {  // a range the window left empty (n > 1: merged below)
          std::fill_n(part_lse_.data() + item * group, group, -std::numeric_limits<float>::infinity());
          std::fill_n(part_out_.data() + item * group * d, group * d, 0.0f);
          continue;
        }
        const at::Tensor& Kt = keys[r][l];
        const at::Tensor& Vt = values[r][l];
        const int64_t ks1 = Kt.stride(1), ks2 = Kt.stride(2), vs1 = Vt.stride(1);
        float* out = n == 1 ? att_.data() + r * q_out + g * group * d : part_out_.data() + item * group * d;
        core::attend(q_.data() + r * q_out + g * group * d, group,
                     Kt.const_data_ptr<float>() + g * ks1 + from * ks2,
                     Vt.const_data_ptr<float>() + g * vs1 + from * ks2, rows, d, ks2, config_.scale,
                     scores_.data() + score0[r] + g * group * len[r] + from * group, out,
                     part_lse_.data() + item * group);
      }
    });
    for (int64_t r = 0; r < B; ++r) {
      if (chunks[r] == 1) continue;
      for (int64_t g = 0; g < kv; ++g) {
        const int64_t item = item0[r] + g * chunks[r];
        core::merge_attention(part_out_.data() + item * group * d, part_lse_.data() + item * group, chunks[r],
                              group, d, att_.data() + r * q_out + g * group * d);
      }
    }
    linear(L.o, att_.data(), B, out_.data());
    add_residual(L.attn_out_norm);
    for (int64_t r = 0; r < B; ++r)
      core::rms_norm(x_.data() + r * hidden_, L.post_norm.const_data_ptr<float>(), config_.eps, hidden_,
                     h_.data() + r * hidden_);
    linear({&L.gate, &L.up}, h_.data(), B, {gate_.data(), up_.data()});
    core::act_mul(config_.activation, gate_.data(), up_.data(), B * intermediate_, gate_.data());
    linear(L.down, gate_.data(), B, out_.data());
    add_residual(L.mlp_out_norm);
  }
  for (int64_t r = 0; r < B; ++r)
    core::rms_norm(x_.data() + r * hidden_, final_norm_.const_data_ptr<float>(), config_.eps, hidden_,
                   h_.data() + r * hidden_);
  at::Tensor logits = at::empty({B, vocab_}, at::kFloat);  // [B, vocab]
  head(B, logits.mutable_data_ptr<float>(), head_rows, extra_rows, head_scan);
  return logits;
}

}  // namespace mtprobe
