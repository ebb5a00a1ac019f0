#include "decode/target_forward.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/bf16.h"
#include "core/decoder_step.h"
#include "core/panel_linear.h"
#include "core/quantized_linear.h"
#include "core/small_batch_linear.h"
#include "decode/layer_columns.h"
#include "ops/ops.h"
#include "runtime/onednn_linear.h"
#include "runtime/zeroed.h"

namespace mtprobe {
namespace {

// An additive mask entry at or below this hides its key: HF fills hidden entries with finfo.min.
constexpr float kHidden = -1e30f;

const char* dtype_name(at::ScalarType t) { return t == at::kBFloat16 ? "bfloat16" : "float32"; }

void check_vector(const at::Tensor& t, int64_t n, const std::string& name,
                  at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK_VALUE(t.defined() && t.dim() == 1 && t.size(0) == n &&
                        (t.scalar_type() == dtype || t.scalar_type() == at::kFloat) && t.is_cpu() &&
                        t.is_contiguous(),
                    "TargetForward: ", name, " must be a contiguous ", dtype_name(dtype), " CPU tensor [", n,
                    "], got ", t.defined() ? t.toString() + " " + c10::str(t.sizes()) : std::string("none"));
}

// A small vector of the model's dtype as float32: itself, or a copy of a bfloat16 one (norm weights and
// biases: a few thousand numbers, widened exactly).
void widen(at::Tensor& t) { t = t.to(at::kFloat).contiguous(); }

void check_linear(const TargetLinear& w, int64_t in, int64_t out, const std::string& name,
                  at::ScalarType dtype) {
  TORCH_CHECK_VALUE(
      w.weight.defined() && w.weight.dim() == 2 && w.weight.scalar_type() == dtype && w.weight.is_cpu() &&
          w.weight.is_contiguous(),
      "TargetForward: ", name, ".weight must be a contiguous ", dtype_name(dtype),
      " CPU tensor [out, in] (the embedding's dtype), got ",
      w.weight.defined() ? w.weight.toString() + " " + c10::str(w.weight.sizes()) : std::string("none"));
  TORCH_CHECK_VALUE(w.in_features() == in && w.out_features() == out, "TargetForward: ", name, " is [",
                    w.out_features(), ", ", w.in_features(), "] but the model needs [", out, ", ", in, "]");
  if (w.bias.defined()) check_vector(w.bias, out, name + ".bias", dtype);
}

const uint16_t* bf16_bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::BFloat16>());
}

}  // namespace

BlockPattern BlockPattern::of(const float* mask, int64_t T, int64_t prefix) {
  // mask [T, prefix + T] (or null: a causal chain). The prefix columns must all be visible; a block row's
  // entries 0 or hidden.
  BlockPattern p;
  p.last.assign(T, -1);
  p.first.assign(T, 0);
  p.lo.assign(T, 0);
  if (!mask) {
    for (int64_t t = 0; t < T; ++t) p.last[t] = t;
    return p;
  }
  p.visible.resize(T);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = mask + t * (prefix + T);
    for (int64_t j = 0; j < prefix; ++j) {
      TORCH_CHECK_VALUE(row[j] == 0.0f, "TargetForward: mask entry (", t, ", ", j,
                        ") hides a cached entry; this forward attends to the whole prefix (a sliding "
                        "window or a custom prefix mask needs HF's forward)");
    }
    for (int64_t j = 0; j < T; ++j) {
      const float m = row[prefix + j];
      if (m <= kHidden) continue;
      TORCH_CHECK_VALUE(m == 0.0f, "TargetForward: mask entry (", t, ", ", prefix + j, ") is ", m,
                        "; an additive mask holds 0 (visible) or a value <= -1e30 (hidden)");
      p.visible[t].push_back(j);
    }
    TORCH_CHECK_VALUE(prefix > 0 || !p.visible[t].empty(), "TargetForward: mask row ", t,
                      " hides every key (a query with nothing to attend to)");
    const int64_t n = static_cast<int64_t>(p.visible[t].size());
    if (n > 0 && p.visible[t].back() == n - 1) p.last[t] = n - 1;
  }
  return p;
}

BlockPattern BlockPattern::windowed(const int64_t* positions, int64_t prefix, int64_t window) const {
  BlockPattern w = *this;
  const int64_t T = static_cast<int64_t>(last.size());
  w.visible.resize(T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pq = positions[t];
    auto seen = [&](int64_t j) { return pq - positions[j] < window; };
    w.lo[t] = std::clamp<int64_t>(pq - window + 1, 0, prefix);  // cached row r sits at position r
    if (last[t] >= 0) {
      // A chain's positions rise along it, so the rows the window keeps are a suffix first..last; where
      // they are not, the row is attended as a tree row.
      int64_t f = 0;
      while (f <= last[t] && !seen(f)) ++f;
      bool suffix = true;
      for (int64_t j = f; j <= last[t]; ++j) suffix = suffix && seen(j);
      if (suffix && f <= last[t]) {
        w.first[t] = f;
        continue;
      }
      w.visible[t].clear();
      for (int64_t j = 0; j <= last[t]; ++j) {
        if (seen(j)) w.visible[t].push_back(j);
      }
      w.last[t] = -1;
    } else {
      std::vector<int64_t>& vis = w.visible[t];
      vis.erase(std::remove_if(vis.begin(), vis.end(), [&](int64_t j) { return !seen(j); }), vis.end());
      TORCH_CHECK_VALUE(w.lo[t] < prefix || !vis.empty(), "TargetForward: input ", t,
                        " sees no key within its sliding window of ", window);
    }
  }
  return w;
}

TargetForward::TargetForward(at::Tensor embed, std::vector<TargetLayer> layers, at::Tensor final_norm,
                             TargetLinear head, at::Tensor inv_freq, TargetForwardConfig config)
    : embed_(std::move(embed)),
      final_norm_(std::move(final_norm)),
      inv_freq_(std::move(inv_freq)),
      layers_(std::move(layers)),
      rope_(inv_freq_),
      head_(std::move(head)),
      config_(config) {
  dtype_ = embed_.scalar_type();
  TORCH_CHECK_VALUE(
      embed_.dim() == 2 && (dtype_ == at::kFloat || dtype_ == at::kBFloat16) && embed_.is_cpu() &&
          embed_.is_contiguous(),
      "TargetForward: embed must be a contiguous float32 or bfloat16 CPU tensor [vocab, hidden], "
      "got ",
      embed_.toString(), " ", embed_.sizes());
  TORCH_CHECK_VALUE(!layers_.empty(), "TargetForward: the model needs at least one layer");
  TORCH_CHECK_VALUE(config_.heads >= 1 && config_.kv_heads >= 1 && config_.heads % config_.kv_heads == 0,
                    "TargetForward: heads (", config_.heads, ") must be a positive multiple of kv_heads (",
                    config_.kv_heads, ")");
  TORCH_CHECK_VALUE(config_.small_rows >= 0 && config_.wide_rows >= 0,
                    "TargetForward: small_rows and wide_rows must be >= 0, got ", config_.small_rows, " and ",
                    config_.wide_rows);
  hidden_ = embed_.size(1);
  q_out_ = layers_[0].q.weight.defined() ? layers_[0].q.out_features() : 0;
  TORCH_CHECK_VALUE(q_out_ > 0 && q_out_ % config_.heads == 0, "TargetForward: q_proj's ", q_out_,
                    " outputs do not split into ", config_.heads, " heads");
  head_dim_ = q_out_ / config_.heads;
  TORCH_CHECK_VALUE(head_dim_ % 2 == 0, "TargetForward: head_dim ", head_dim_, " must be even (RoPE)");
  kv_out_ = config_.kv_heads * head_dim_;
  intermediate_ = layers_[0].gate.weight.defined() ? layers_[0].gate.out_features() : 0;
  check_vector(inv_freq_, head_dim_ / 2, "inv_freq");
  check_vector(final_norm_, hidden_, "final_norm", dtype_);
  widen(final_norm_);
  check_linear(head_, hidden_, head_.weight.defined() ? head_.out_features() : 0, "head", dtype_);
  // The norms and biases computed in float32 (copies for a bfloat16 model); the large weights read as
  // they are.
  auto widen_bias = [](TargetLinear& w) {
    if (w.bias.defined()) widen(w.bias);
  };
  widen_bias(head_);
  // A layer's quantized codes, checked, with its (float32) bias.
  auto check_quantized = [&](TargetLinear& w, const std::string& name) {
    if (!w.quantized.codes.defined()) return;
    TORCH_CHECK_VALUE(dtype_ == at::kFloat, "TargetForward: ", name,
                      " has quantized codes, which a float32 model's forward reads only; this one is ",
                      dtype_name(dtype_));
    w.quantized.bias = w.bias;
    w.quantized.check(w.in_features(), w.out_features(), "TargetForward", name + ".quantized");
  };
  check_quantized(head_, "head");
  for (size_t l = 0; l < layers_.size(); ++l) {
    TargetLayer& L = layers_[l];
    const std::string at = "layer " + std::to_string(l) + " ";
    check_vector(L.input_norm, hidden_, at + "input_norm", dtype_);
    check_vector(L.post_norm, hidden_, at + "post_norm", dtype_);
    // Norms that come in pairs or not at all: Qwen3's and Gemma's q/k norms, Gemma's output norms.
    auto optional_pair = [&](at::Tensor& a, at::Tensor& b, int64_t n, const char* an, const char* bn) {
      TORCH_CHECK_VALUE(a.defined() == b.defined(), "TargetForward: ", at, "has one of ", an, " and ", bn,
                        " but not the other");
      if (!a.defined()) return;
      check_vector(a, n, at + an, dtype_);
      check_vector(b, n, at + bn, dtype_);
      widen(a);
      widen(b);
    };
    optional_pair(L.q_norm, L.k_norm, head_dim_, "q_norm", "k_norm");
    optional_pair(L.attn_out_norm, L.mlp_out_norm, hidden_, "attn_out_norm", "mlp_out_norm");
    widen(L.input_norm);
    widen(L.post_norm);
    TORCH_CHECK_VALUE(L.window >= 0, "TargetForward: ", at, "window must be >= 0 (0: full attention), got ",
                      L.window);
    if (L.inv_freq.defined()) check_vector(L.inv_freq, head_dim_ / 2, at + "inv_freq");
    rope_.add_layer(L.inv_freq);
    layer_window_.push_back(-1);
    if (L.window > 0) {
      auto same = std::find(windows_.begin(), windows_.end(), L.window);
      if (same == windows_.end()) same = windows_.insert(windows_.end(), L.window);
      layer_window_.back() = static_cast<int64_t>(same - windows_.begin());
    }
    check_linear(L.q, hidden_, q_out_, at + "q", dtype_);
    check_linear(L.k, hidden_, kv_out_, at + "k", dtype_);
    check_linear(L.v, hidden_, kv_out_, at + "v", dtype_);
    check_linear(L.o, q_out_, hidden_, at + "o", dtype_);
    check_linear(L.gate, hidden_, intermediate_, at + "gate", dtype_);
    check_linear(L.up, hidden_, intermediate_, at + "up", dtype_);
    check_linear(L.down, intermediate_, hidden_, at + "down", dtype_);
    L.each_linear(widen_bias);
    const char* names[] = {"q", "k", "v", "o", "gate", "up", "down"};
    int i = 0;
    L.each_linear([&](TargetLinear& w) { check_quantized(w, at + names[i++]); });
  }
  TORCH_CHECK_VALUE(config_.quantized_rows >= 0, "TargetForward: quantized_rows must be >= 0, got ",
                    config_.quantized_rows);
  small_kernel_ = core::small_batch_linear_simd();
  // Without AVX2 the panels' portable loop is no faster than BLAS, as the small-batch kernel's.
  panels_ = config_.panels && (small_kernel_ || dtype_ == at::kBFloat16);
  if (panels_) {
    auto pack = [](TargetLinear& w) { w.panels = ops::pack_panels(w.weight); };
    pack(head_);
    for (TargetLayer& L : layers_) L.each_linear(pack);
  }
}

int64_t TargetForward::panel_bytes() const {
  int64_t bytes = 0;
  auto add = [&](const TargetLinear& w) {
    bytes += w.panels.defined() ? static_cast<int64_t>(w.panels.nbytes()) : 0;
  };
  add(head_);
  for (const TargetLayer& L : layers_) L.each_linear(add);
  return bytes;
}

int64_t TargetForward::quantized_bytes() const {
  int64_t bytes = 0;
  auto add = [&](const TargetLinear& w) {
    for (const at::Tensor* t : {&w.quantized.codes, &w.quantized.scale, &w.quantized.min})
      bytes += t->defined() ? static_cast<int64_t>(t->nbytes()) : 0;
  };
  add(head_);
  for (const TargetLayer& L : layers_) L.each_linear(add);
  return bytes;
}

void TargetForward::set_quantized_rows(int64_t rows) {
  TORCH_CHECK_VALUE(rows >= 0, "TargetForward: quantized_rows must be >= 0, got ", rows);
  std::lock_guard<std::mutex> lock(busy_);  // not in the middle of a forward
  config_.quantized_rows = rows;
}

void TargetForward::linear(std::initializer_list<const TargetLinear*> ws, const float* x, int64_t rows,
                           std::initializer_list<float*> ys) {
  const TargetLinear* const* layers = ws.begin();
  float* const* outs = ys.begin();
  const int64_t n = static_cast<int64_t>(ws.size()), in = layers[0]->in_features();
  TORCH_INTERNAL_ASSERT(n == static_cast<int64_t>(ys.size()) && n <= LayerColumns::kMax);
  if (rows <= config_.quantized_rows &&
      std::all_of(ws.begin(), ws.end(), [](const TargetLinear* w) { return w->quantized.codes.defined(); })) {
    // The weights' own codes: the same function up to rounding, an eighth (a quarter) of the bytes.
    const QuantizedWeights* q[LayerColumns::kMax];
    bool any_q4 = false;
    for (int64_t i = 0; i < n; ++i) {
      q[i] = &layers[i]->quantized;
      any_q4 = any_q4 || q[i]->q4();
    }
    if (any_q4) {
      if (static_cast<int64_t>(xsum_.size()) < rows * in / core::kQuantGroup)
        xsum_.resize(rows * in / core::kQuantGroup);
      core::quantized_group_sums(x, rows, in, xsum_.data());
    }
    quantized_linears(q, outs, n, x, xsum_.data(), rows);
    return;
  }
  const bool bf16 = dtype_ == at::kBFloat16;
  // A few inputs (up to wide_rows) run the small-batch kernel on the model's own row-major weights: the
  // stream sets their pace, the panels gain nothing there (the linears alone: 15-19 ms either way at 1 to 4
  // inputs, benchmarks/results/native_forward/panels-kernels.md), and whole forwards through the panels had
  // measured 5-10 % slower at 1 to 4 inputs in this change's first runs.
  if (panels_ && rows > config_.wide_rows && rows <= config_.small_rows) {
    LayerColumns panels;  // the layers' panels as one range: 2 a grain (64 columns)
    for (int64_t i = 0; i < n; ++i) panels.add(core::panel_count(layers[i]->out_features()));
    at::parallel_for(0, panels.total(), 2, [&](int64_t begin, int64_t end) {
      panels.each(begin, end, [&](int64_t i, int64_t from, int64_t to) {
        const TargetLinear& w = *layers[i];
        const float* bias = w.bias.defined() ? w.bias.const_data_ptr<float>() : nullptr;
        if (bf16) {
          core::panel_linear(x, rows, in, bf16_bits(w.panels), bias, outs[i], w.out_features(), from, to);
        } else {
          core::panel_linear(x, rows, in, w.panels.const_data_ptr<float>(), bias, outs[i], w.out_features(),
                             from, to);
        }
      });
    });
    return;
  }
  if ((small_kernel_ || bf16) && rows <= config_.small_rows) {
    LayerColumns columns;
    for (int64_t i = 0; i < n; ++i) columns.add(layers[i]->out_features());
    // A grain of 64 columns, as the small_batch_linear op: each thread streams its own weight rows.
    const auto level = rows <= config_.wide_rows ? core::SimdLevel::kAvx512 : core::SimdLevel::kAvx2;
    at::parallel_for(0, columns.total(), 64, [&](int64_t begin, int64_t end) {
      columns.each(begin, end, [&](int64_t i, int64_t from, int64_t to) {
        const TargetLinear& w = *layers[i];
        const int64_t out = w.out_features();
        const float* bias = w.bias.defined() ? w.bias.const_data_ptr<float>() : nullptr;
        if (bf16) {
          core::small_batch_linear(x, rows, in, bf16_bits(w.weight), bias, outs[i], out, from, to, level);
        } else {
          core::small_batch_linear(x, rows, in, w.weight.const_data_ptr<float>(), bias, outs[i], out, from,
                                   to, level);
        }
      });
    });
    return;
  }
  for (int64_t i = 0; i < n; ++i) gemm(*layers[i], x, rows, outs[i]);
}

void TargetForward::gemm(const TargetLinear& w, const float* x, int64_t rows, float* y) const {
  const int64_t in = w.in_features(), out = w.out_features();
  const bool bf16 = dtype_ == at::kBFloat16;
  // A prefill's rows: compute-bound, BLAS's GEMM (packing the weight once pays for many rows).
  at::Tensor X = at::from_blob(const_cast<float*>(x), {rows, in}, at::kFloat);
  at::Tensor Y = at::from_blob(y, {rows, out}, at::kFloat);
  if (bf16) {
    // bfloat16 rows through bfloat16 GEMM (oneDNN's AVX512-BF16 kernels where the CPU has them), as HF's
    // bfloat16 forward computes its linears: 2.4x faster than a float32 GEMM on widened weights for a
    // 128-token prefill (benchmarks/results/native_forward/prefill-bf16.md).
    Y.copy_(at::mm(X.to(at::kBFloat16), w.weight.t()));
    if (w.bias.defined()) Y.add_(w.bias);
    return;
  }
  // float32: oneDNN's matmul where torch has it, twice MKL's rate on an AMD CPU (runtime/onednn_linear.h).
  const at::Tensor fast = onednn_linear(X, w.weight, w.bias);
  if (fast.defined()) {
    Y.copy_(fast);
  } else if (w.bias.defined()) {
    at::addmm_out(Y, w.bias, X, w.weight.t());
  } else {
    at::mm_out(Y, X, w.weight.t());
  }
}

void TargetForward::check_cache(const std::vector<at::Tensor>& caches, const char* name,
                                int64_t needed) const {
  TORCH_CHECK_VALUE(static_cast<int64_t>(caches.size()) == num_layers(), "TargetForward: ", name,
                    " must hold one buffer per layer (", num_layers(), "), got ", caches.size());
  for (const at::Tensor& t : caches) {
    TORCH_CHECK_VALUE(
        t.dim() == 4 && t.size(0) == 1 && t.size(1) == config_.kv_heads && t.size(3) == head_dim_ &&
            t.scalar_type() == dtype_ && t.is_cpu() && t.stride(3) == 1,
        "TargetForward: each of ", name, " must be ", dtype_name(dtype_), " CPU [1, ", config_.kv_heads,
        ", capacity, ", head_dim_, "] (the model's dtype) with unit stride in its last dimension, got ",
        t.scalar_type(), " ", t.sizes());
    TORCH_CHECK_VALUE(needed <= t.size(2), "TargetForward: ", needed,
                      " entries do not fit a cache of capacity ", t.size(2), " (", name,
                      "); reserve room before the forward");
  }
}

void TargetForward::attention(const float* q, const at::Tensor& keys, const at::Tensor& values, int64_t T,
                              int64_t prefix, const BlockPattern& block, float* att) {
  if (dtype_ == at::kBFloat16) {
    attend_block(q, bf16_bits(keys), bf16_bits(values), keys, values, T, prefix, block, att);
  } else {
    attend_block(q, keys.const_data_ptr<float>(), values.const_data_ptr<float>(), keys, values, T, prefix,
                 block, att);
  }
}

template <typename KV>
void TargetForward::attend_block(const float* q, const KV* K, const KV* V, const at::Tensor& keys,
                                 const at::Tensor& values, int64_t T, int64_t prefix,
                                 const BlockPattern& block, float* att) {
  const int64_t d = head_dim_, kv = config_.kv_heads, group = config_.heads / kv;
  const int64_t ks1 = keys.stride(1), ks2 = keys.stride(2), vs1 = values.stride(1), vs2 = values.stride(2);
  TORCH_CHECK_VALUE(ks2 == vs2, "TargetForward: keys and values differ in row stride");
  const std::vector<int64_t>& last = block.last;
  const std::vector<int64_t>& first = block.first;
  const std::vector<int64_t>& lo = block.lo;
  const std::vector<std::vector<int64_t>>& visible = block.visible;
  // Work items: (key/value head, input, part). A short block over a long prefix splits the prefix into
  // ranges so that every thread reads (flash decoding); the parts are merged by their log-sum-exps.
  const int64_t threads = at::get_num_threads(), items = kv * T;
  int64_t chunks = prefix > 0 ? 1 : 0;
  if (prefix >= 256 && items < 2 * threads) {
    chunks = std::min<int64_t>(prefix / 128, (2 * threads + items - 1) / items);
  }
  const int64_t slots = chunks + 1;  // the prefix's ranges, then the block's part
  part_out_.resize(items * slots * group * d);
  part_lse_.resize(items * slots * group);
  // The threads take contiguous runs of work; in a prefill an input's cost grows with its position, so
  // the inputs are taken from both ends in turn (0, T-1, 1, T-2, ...): every run of pairs costs about the
  // same, where runs in input order left one of two threads idle for 29 % of the attention's time (SmolLM2's
  // 3 key/value heads, 700 tokens). The results land at their (head, input) place either way.
  at::parallel_for(0, items * slots, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    thread_local std::vector<KV> gathered;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t c = w % slots, g = (w / slots) % kv, turn = w / slots / kv;
      const int64_t t = turn % 2 == 0 ? turn / 2 : T - 1 - turn / 2;
      const int64_t item = g * T + t, u = item * slots + c;
      const float* qh = q + t * q_out_ + g * group * d;
      const KV* Kg = K + g * ks1;
      const KV* Vg = V + g * vs1;
      float* out = part_out_.data() + u * group * d;
      float* lse = part_lse_.data() + u * group;
      const bool one_range = chunks <= 1 && block.one_range(t, prefix);
      int64_t from = 0, rows = 0;
      if (c < chunks) {  // a range of the cached prefix rows lo[t]..prefix-1
        from = lo[t] + (prefix - lo[t]) * c / chunks;
        rows = lo[t] + (prefix - lo[t]) * (c + 1) / chunks - from;
        if (one_range || rows == 0) {  // merged into the block's part below, or outside the window
          std::fill(lse, lse + group, -std::numeric_limits<float>::infinity());
          std::fill(out, out + group * d, 0.0f);
          continue;
        }
      } else if (last[t] >= 0) {  // block rows first[t]..last[t], with the prefix's when one range
        from = one_range && lo[t] < prefix ? lo[t] : prefix + first[t];
        rows = prefix + last[t] + 1 - from;
      } else {  // a tree row: its visible block rows gathered into one contiguous range
        const std::vector<int64_t>& vis = visible[t];
        const int64_t n = static_cast<int64_t>(vis.size());
        if (n == 0) {
          std::fill(lse, lse + group, -std::numeric_limits<float>::infinity());
          std::fill(out, out + group * d, 0.0f);
          continue;
        }
        gathered.resize(2 * n * d);
        for (int64_t i = 0; i < n; ++i) {
          std::copy_n(Kg + (prefix + vis[i]) * ks2, d, gathered.data() + i * d);
          std::copy_n(Vg + (prefix + vis[i]) * ks2, d, gathered.data() + (n + i) * d);
        }
        scores.resize(group * n);
        core::attend(qh, group, gathered.data(), gathered.data() + n * d, n, d, d, config_.scale,
                     scores.data(), out, lse);
        continue;
      }
      scores.resize(group * rows);
      core::attend(qh, group, Kg + from * ks2, Vg + from * ks2, rows, d, ks2, config_.scale, scores.data(),
                   out, lse);
    }
  });
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / T, t = item % T;
      float* dst = att + t * q_out_ + g * group * d;
      const float* outs = part_out_.data() + item * slots * group * d;
      if (chunks <= 1 && block.one_range(t, prefix)) {  // one range: the block's part is the answer
        std::copy_n(outs + chunks * group * d, group * d, dst);
      } else {
        core::merge_attention(outs, part_lse_.data() + item * slots * group, slots, group, d, dst);
      }
    }
  });
}

std::tuple<at::Tensor, std::optional<at::Tensor>> TargetForward::forward(
    const at::Tensor& tokens, const std::optional<at::Tensor>& embeds, const at::Tensor& positions,
    const std::optional<at::Tensor>& mask, int64_t prefix_len, const std::vector<at::Tensor>& keys,
    const std::vector<at::Tensor>& values, bool want_hidden, int64_t logits_from) {
  return forward_batch({TargetBlock{tokens, embeds, positions, mask, prefix_len, keys, values, want_hidden,
                                    logits_from}})
      .front();
}

TargetForward::Prepared TargetForward::prepare(const TargetBlock& b, const std::string& who) const {
  const int64_t vocab = embed_.size(0);
  TORCH_CHECK_VALUE(b.tokens.dim() == 1 && b.tokens.scalar_type() == at::kLong && b.tokens.is_cpu(),
                    "TargetForward: ", who, "tokens must be a 1-D int64 CPU tensor, got ",
                    b.tokens.toString(), " ", b.tokens.sizes());
  Prepared p;
  p.n_tok = b.tokens.size(0);
  if (b.embeds.has_value() && b.embeds->defined()) {
    const at::Tensor& e = *b.embeds;
    TORCH_CHECK_VALUE(e.dim() == 2 && e.size(1) == hidden_ &&
                          (e.scalar_type() == at::kFloat || e.scalar_type() == dtype_) && e.is_cpu(),
                      "TargetForward: ", who, "embeds must be float32 (or the model's dtype) CPU [n, ",
                      hidden_, "], got ", e.toString(), " ", e.sizes());
    p.n_emb = e.size(0);
    if (p.n_emb > 0) p.emb = e.to(at::kFloat).contiguous();
  }
  const int64_t T = p.T = p.n_tok + p.n_emb;
  TORCH_CHECK_VALUE(T >= 1, "TargetForward: ", who, "a forward needs at least one input");
  TORCH_CHECK_VALUE(b.positions.dim() == 1 && b.positions.size(0) == T &&
                        b.positions.scalar_type() == at::kLong && b.positions.is_cpu(),
                    "TargetForward: ", who, "positions must be int64 CPU [", T, "] (one per input), got ",
                    b.positions.toString(), " ", b.positions.sizes());
  TORCH_CHECK_VALUE(b.prefix_len >= 0, "TargetForward: ", who, "prefix_len must be >= 0, got ", b.prefix_len);
  TORCH_CHECK_VALUE(b.logits_from >= 0 && b.logits_from <= T, "TargetForward: ", who,
                    "logits_from must be in [0, ", T, "], got ", b.logits_from);
  const int64_t P = b.prefix_len;
  at::Tensor m;
  if (b.mask.has_value() && b.mask->defined()) {
    const at::Tensor& mask = *b.mask;
    TORCH_CHECK_VALUE(mask.dim() == 2 && mask.size(0) == T && mask.size(1) == P + T &&
                          mask.scalar_type() == at::kFloat && mask.is_cpu(),
                      "TargetForward: ", who, "mask must be float32 CPU [T, P + T] = [", T, ", ", P + T,
                      "], got ", mask.toString(), " ", mask.sizes());
    m = mask.contiguous();
  }
  check_cache(b.keys, "keys", P + T);
  check_cache(b.values, "values", P + T);
  p.tok = b.tokens.contiguous();
  p.pos = b.positions.contiguous();
  const int64_t* tp = p.tok.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < p.n_tok; ++i) {
    TORCH_CHECK_VALUE(tp[i] >= 0 && tp[i] < vocab, "TargetForward: ", who, "token ", tp[i], " at input ", i,
                      " is outside the vocabulary [0, ", vocab, ")");
  }
  const int64_t* pp = p.pos.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i) {
    TORCH_CHECK_VALUE(pp[i] >= 0, "TargetForward: ", who, "position ", pp[i], " at input ", i,
                      " is negative");
  }
  // The block's pattern, read once for every layer.
  p.pattern = BlockPattern::of(m.defined() ? m.const_data_ptr<float>() : nullptr, T, P);
  for (int64_t w : windows_) p.windowed.push_back(p.pattern.windowed(pp, P, w));
  return p;
}

const BlockPattern& TargetForward::pattern_of(const Prepared& p, size_t l) const {
  return layer_window_[l] < 0 ? p.pattern : p.windowed[layer_window_[l]];
}

std::vector<std::tuple<at::Tensor, std::optional<at::Tensor>>> TargetForward::forward_batch(
    const std::vector<TargetBlock>& blocks) {
  TORCH_CHECK_VALUE(!blocks.empty(), "TargetForward: forward_batch needs at least one block");
  std::vector<Prepared> prep;
  int64_t T = 0;  // every block's inputs, packed one block after another
  for (size_t i = 0; i < blocks.size(); ++i) {
    const std::string who = blocks.size() > 1 ? "block " + std::to_string(i) + ": " : "";
    prep.push_back(prepare(blocks[i], who));
    prep.back().offset = T;
    T += prep.back().T;
  }

  std::lock_guard<std::mutex> lock(busy_);
  const int64_t d = head_dim_, half = d / 2, heads = config_.heads, kv = config_.kv_heads;
  x_.resize(T * hidden_);
  h_.resize(T * hidden_);
  out_.resize(T * hidden_);
  q_.resize(T * q_out_);
  att_.resize(T * q_out_);
  k_.resize(T * kv_out_);
  v_.resize(T * kv_out_);
  gate_.resize(T * intermediate_);
  up_.resize(T * intermediate_);
  const int64_t tables = static_cast<int64_t>(rope_.tables.size());
  cos_.resize(tables * T * half);  // [tables, T, half]
  sin_.resize(tables * T * half);
  const float scale = config_.embed_scale;
  for (const Prepared& p : prep) {
    float* x = x_.data() + p.offset * hidden_;
    const int64_t* tp = p.tok.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < p.n_tok; ++i) {
      float* xi = x + i * hidden_;
      if (dtype_ == at::kBFloat16) {
        const uint16_t* e = bf16_bits(embed_) + tp[i] * hidden_;
        for (int64_t j = 0; j < hidden_; ++j) xi[j] = core::bf16_to_float(e[j]);
      } else {
        std::copy_n(embed_.const_data_ptr<float>() + tp[i] * hidden_, hidden_, xi);
      }
      // Gemma's scaled embedding; the `embeds` rows come in as they are (HF scales input ids only).
      if (scale != 1.0f) {
        for (int64_t j = 0; j < hidden_; ++j) xi[j] *= scale;
      }
    }
    if (p.n_emb > 0) std::copy_n(p.emb.const_data_ptr<float>(), p.n_emb * hidden_, x + p.n_tok * hidden_);
    // RoPE's angles per input and table.
    rope_.angles(p.pos.const_data_ptr<int64_t>(), p.T, p.offset, T, half, config_.rope_scaling, cos_.data(),
                 sin_.data());
  }
  // Row loops of a prefill are long enough to share between threads; a verification block's are not.
  const int64_t grain = std::max<int64_t>(1, 64 / std::max<int64_t>(1, hidden_ / 256));
  auto rows_norm = [&](const float* w, int64_t from, int64_t to) {
    at::parallel_for(from, to, grain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        core::rms_norm(x_.data() + t * hidden_, w, config_.eps, hidden_, h_.data() + t * hidden_);
    });
  };
  const bool bf16 = dtype_ == at::kBFloat16;
  // An output norm (Gemma's sandwich norms) over out_'s rows [from, to), then those added to the residual x_.
  auto add_residual = [&](const at::Tensor& norm, int64_t from, int64_t to) {
    at::parallel_for(from, to, grain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        float* o = out_.data() + t * hidden_;
        float* xt = x_.data() + t * hidden_;
        if (norm.defined()) core::rms_norm(o, norm.const_data_ptr<float>(), config_.eps, hidden_, o);
        for (int64_t j = 0; j < hidden_; ++j) xt[j] += o[j];
      }
    });
  };
  // Past the last layer's attention only the rows whose logits are read go on (of a prompt's prefill: its
  // last row), as nothing reads the others' hidden states; every layer's keys and values are written for
  // all. kept: those rows, in order (all T unless some block reads from a later row without hidden states).
  std::vector<int64_t> kept;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t from = blocks[i].want_hidden ? 0 : std::min<int64_t>(blocks[i].logits_from, prep[i].T);
    for (int64_t t = from; t < prep[i].T; ++t) kept.push_back(prep[i].offset + t);
  }
  // Moves row kept[j] of a [T, width] buffer to row j, for every j (forward), or back (!forward): each
  // move's source is not a row an earlier move wrote, as kept[j] >= j rises with j.
  auto move_rows = [&](float* rows, int64_t width, bool forward) {
    const int64_t n = static_cast<int64_t>(kept.size());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = forward ? i : n - 1 - i;
      if (kept[j] == j) continue;
      float* a = rows + kept[j] * width;
      float* b = rows + j * width;
      if (forward) {
        std::copy_n(a, width, b);
      } else {
        std::copy_n(b, width, a);
      }
    }
  };
  for (size_t l = 0; l < layers_.size(); ++l) {
    const TargetLayer& L = layers_[l];
    const float* cos_l = cos_.data() + rope_.of_layer[l] * T * half;
    const float* sin_l = sin_.data() + rope_.of_layer[l] * T * half;
    // Every linear layer once over the rows of every block: its weights read once for all of them.
    rows_norm(L.input_norm.const_data_ptr<float>(), 0, T);
    linear({&L.q, &L.k, &L.v}, h_.data(), T, {q_.data(), k_.data(), v_.data()});
    for (size_t i = 0; i < blocks.size(); ++i) {
      const Prepared& p = prep[i];
      const at::Tensor& keys = blocks[i].keys[l];
      const at::Tensor& values = blocks[i].values[l];
      // This block's keys and values into its cache (rounded to bfloat16 for a bfloat16 model's, as HF's
      // cache holds them).
      char* Kc = static_cast<char*>(keys.mutable_data_ptr());
      char* Vc = static_cast<char*>(values.mutable_data_ptr());
      const int64_t size = keys.element_size(), P = blocks[i].prefix_len;
      auto store = [&](const float* src, char* dst) {
        if (bf16) {
          uint16_t* out = reinterpret_cast<uint16_t*>(dst);
          for (int64_t j = 0; j < d; ++j) out[j] = core::float_to_bf16(src[j]);
        } else {
          std::copy_n(src, d, reinterpret_cast<float*>(dst));
        }
      };
      const int64_t ks1 = keys.stride(1), ks2 = keys.stride(2);
      const int64_t vs1 = values.stride(1), vs2 = values.stride(2);
      at::parallel_for(0, p.T, grain, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          const int64_t r = p.offset + t;  // the packed row
          float* qt = q_.data() + r * q_out_;
          float* kt = k_.data() + r * kv_out_;
          if (L.q_norm.defined()) {  // Qwen3, Gemma 3: RMSNorm over each head before RoPE
            for (int64_t h = 0; h < heads; ++h)
              core::rms_norm(qt + h * d, L.q_norm.const_data_ptr<float>(), config_.eps, d, qt + h * d);
            for (int64_t h = 0; h < kv; ++h)
              core::rms_norm(kt + h * d, L.k_norm.const_data_ptr<float>(), config_.eps, d, kt + h * d);
          }
          core::rotate_half(qt, heads, d, cos_l + r * half, sin_l + r * half);
          core::rotate_half(kt, kv, d, cos_l + r * half, sin_l + r * half);
          for (int64_t h = 0; h < kv; ++h) {
            store(kt + h * d, Kc + (h * ks1 + (P + t) * ks2) * size);
            store(v_.data() + r * kv_out_ + h * d, Vc + (h * vs1 + (P + t) * vs2) * size);
          }
        }
      });
      // Each block attends over its own cache.
      attention(q_.data() + p.offset * q_out_, keys, values, p.T, P, pattern_of(p, l),
                att_.data() + p.offset * q_out_);
    }
    // The rows that go on: all T, or in the last layer those kept, moved to rows [0, n) and back after.
    const bool last = l + 1 == layers_.size() && static_cast<int64_t>(kept.size()) < T;
    const int64_t n = last ? static_cast<int64_t>(kept.size()) : T;
    if (last) {
      move_rows(att_.data(), q_out_, true);
      move_rows(x_.data(), hidden_, true);
    }
    if (n > 0) {
      linear(L.o, att_.data(), n, out_.data());
      add_residual(L.attn_out_norm, 0, n);
      rows_norm(L.post_norm.const_data_ptr<float>(), 0, n);
      linear({&L.gate, &L.up}, h_.data(), n, {gate_.data(), up_.data()});
      at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
        float* g = gate_.data() + b * intermediate_;
        core::act_mul(config_.activation, g, up_.data() + b * intermediate_, (e - b) * intermediate_, g);
      });
      linear(L.down, gate_.data(), n, out_.data());
      add_residual(L.mlp_out_norm, 0, n);
    }
    if (last) move_rows(x_.data(), hidden_, false);
  }
  // The final norm over the rows anyone reads; the head once over the rows whose logits anyone reads,
  // gathered from every block.
  std::vector<float> wanted;  // [rows, hidden]: the head's input rows, block after block
  int64_t head_rows = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Prepared& p = prep[i];
    const int64_t from = blocks[i].want_hidden ? 0 : blocks[i].logits_from;
    rows_norm(final_norm_.const_data_ptr<float>(), p.offset + from, p.offset + p.T);
    head_rows += p.T - blocks[i].logits_from;
  }
  const float* head_in = h_.data() + prep[0].offset * hidden_ + blocks[0].logits_from * hidden_;
  if (blocks.size() > 1) {
    wanted.resize(head_rows * hidden_);
    int64_t at_row = 0;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const int64_t n = prep[i].T - blocks[i].logits_from;
      std::copy_n(h_.data() + (prep[i].offset + blocks[i].logits_from) * hidden_, n * hidden_,
                  wanted.data() + at_row * hidden_);
      at_row += n;
    }
    head_in = wanted.data();
  }
  at::Tensor all = at::empty({head_rows, vocab_size()}, at::kFloat);  // [head rows, vocab]
  if (head_rows > 0) linear(head_, head_in, head_rows, all.mutable_data_ptr<float>());
  // A bfloat16 model's logits rounded to bfloat16, as HF's forward returns them: greedy decoding then breaks
  // its ties as HF's does (the lowest token id among equal logits), and a tie in HF's logits is usually one
  // here too. Unrounded, a third of the answers that departed from HF's bfloat16 greedy did so at HF's exact
  // ties (35 of 120 questions, benchmarks/results/native_forward/interleaved-bf16-full-split-2026-11-30.md).
  if (dtype_ == at::kBFloat16 && head_rows > 0) all.copy_(all.to(at::kBFloat16));
  std::vector<std::tuple<at::Tensor, std::optional<at::Tensor>>> outs;
  int64_t at_row = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Prepared& p = prep[i];
    const int64_t from = blocks[i].logits_from, n = p.T - from;
    at::Tensor logits;  // [T, vocab]
    if (blocks.size() == 1 && from == 0) {
      logits = all;
    } else {
      // Rows before `from` stay zeros that nobody writes (runtime/zeroed.h).
      logits = from > 0 ? zeroed_floats(p.T, vocab_size()) : at::empty({p.T, vocab_size()}, at::kFloat);
      if (n > 0) logits.narrow(0, from, n).copy_(all.narrow(0, at_row, n));
    }
    at_row += n;
    std::optional<at::Tensor> hidden;
    if (blocks[i].want_hidden) {
      hidden = at::empty({p.T, hidden_}, at::kFloat);  // [T, hidden]
      std::copy_n(h_.data() + p.offset * hidden_, p.T * hidden_, hidden->mutable_data_ptr<float>());
    }
    outs.emplace_back(std::move(logits), std::move(hidden));
  }
  return outs;
}

}  // namespace mtprobe
