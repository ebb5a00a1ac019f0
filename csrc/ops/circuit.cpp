// Exact inference in circuit heads (csrc/core/circuit.h) as ATen ops, batched over B contexts: the
// head produces one set of parameters per context, so every parameter tensor has a leading [B].
// The CPU kernels are here (registration.cpp registers them for the CPU key); the CUDA launchers are
// in circuit_cuda.cu (kernels: csrc/kernels/circuit.cuh) and share check_circuit and
// check_circuit_tokens with these.
//
// Parameters, log-probabilities with a leading batch dimension (circuit.h has each layout):
//   weights      [B, r]            FF: [B, 0] (FF has no latent; mtprobe.ops takes None for it)
//   transitions  [B, L - 1, r, r]  FF, CP, and HMM or BTree with L = 1: [B, 0, r, r] (r = 1 for FF)
//   emissions    FF [B, n, V]; CP [B, r, n, V]; HMM, BTree [B, n, r, V]
// float32 or float64, all three the same dtype; float16 and bfloat16 are upcast to float32 (the
// log-values then come back in float32). Results are in that dtype; sums run in double. The
// parameters are not checked for normalisation (that costs O(n r V) per context, more than a
// log_prob): they must be log_softmax outputs, as the heads make them.
#include "core/circuit.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include "ops/ops.h"

namespace mtprobe::ops {

namespace {

core::CircuitKind parse_kind(const std::string& kind, const char* op) {
  if (kind == "ff") return core::CircuitKind::kFF;
  if (kind == "cp") return core::CircuitKind::kCP;
  if (kind == "hmm") return core::CircuitKind::kHMM;
  if (kind == "btree") return core::CircuitKind::kBTree;
  TORCH_CHECK_VALUE(false, op, ": circuit kind '", kind, "' is not one of 'ff', 'cp', 'hmm', 'btree'");
}

}  // namespace

CircuitBatch check_circuit(const char* op, const std::string& kind_name, const at::Tensor& weights,
                           const at::Tensor& transitions, const at::Tensor& emissions) {
  const core::CircuitKind kind = parse_kind(kind_name, op);
  const char* k = kind_name.c_str();
  const bool ff = kind == core::CircuitKind::kFF, cp = kind == core::CircuitKind::kCP;
  const char* layout = ff ? "[B, n, V]" : (cp ? "[B, r, n, V]" : "[B, n, r, V]");
  TORCH_CHECK_VALUE(emissions.dim() == (ff ? 3 : 4), op, ": ", k, " emissions must be ", layout, ", got ",
                    emissions.sizes());
  const int64_t B = emissions.size(0);
  const int64_t n = emissions.size(cp ? 2 : 1), r = ff ? 1 : emissions.size(cp ? 1 : 2);
  const int64_t V = emissions.size(-1);
  TORCH_CHECK_VALUE(n >= 1 && r >= 1 && V >= 1, op, ": ", k, " emissions ", layout, " = ", emissions.sizes(),
                    " need n, r and V >= 1");
  const at::ScalarType dtype = emissions.scalar_type();
  TORCH_CHECK_VALUE(
      dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16, op,
      ": emissions must be float32 or float64 (float16 and bfloat16 are upcast to float32), "
      "got ",
      dtype);
  TORCH_CHECK_VALUE(weights.scalar_type() == dtype && transitions.scalar_type() == dtype, op,
                    ": weights, transitions and emissions must share one dtype, got ", weights.scalar_type(),
                    ", ", transitions.scalar_type(), " and ", dtype);
  CircuitBatch c;
  try {
    c.structure = ff                                ? core::CircuitStructure::ff(n, V)
                  : cp                              ? core::CircuitStructure::cp(n, r, V)
                  : kind == core::CircuitKind::kHMM ? core::CircuitStructure::hmm(n, r, V)
                                                    : core::CircuitStructure::btree(n, r, V);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, op, ": ", e.what());
  }
  c.batch = B;
  const int64_t w = c.structure.weights_size(), L = c.structure.num_latents();
  TORCH_CHECK_VALUE(weights.dim() == 2 && weights.size(0) == B && weights.size(1) == w, op, ": ", k,
                    " weights must be ", ff ? "[B, 0] (FF has no latent)" : "[B, r]", " = [", B, ", ", w,
                    "], got ", weights.sizes());
  TORCH_CHECK_VALUE(transitions.dim() == 4 && transitions.size(0) == B && transitions.size(1) == L - 1 &&
                        transitions.size(2) == r && transitions.size(3) == r,
                    op, ": ", k, " transitions must be [B, L - 1, r, r] = [", B, ", ", L - 1, ", ", r, ", ",
                    r, "] (L = ", L, " latent", L == 1 ? "" : "s", " for n = ", n, "), got ",
                    transitions.sizes());
  const at::ScalarType compute = dtype == at::kDouble ? at::kDouble : at::kFloat;
  c.weights = weights.to(compute).contiguous();
  c.transitions = transitions.to(compute).contiguous();
  c.emissions = emissions.to(compute).contiguous();
  return c;
}

// tokens [B, len] int32/int64 with ids in [0, V), as contiguous int64 on their device.
at::Tensor check_circuit_tokens(const char* op, const char* what, const at::Tensor& tokens, int64_t B,
                                int64_t len, int64_t V) {
  TORCH_CHECK_VALUE(tokens.scalar_type() == at::kLong || tokens.scalar_type() == at::kInt, op, ": ", what,
                    " must be int32 or int64, got ", tokens.scalar_type());
  TORCH_CHECK_VALUE(tokens.dim() == 2 && tokens.size(0) == B && tokens.size(1) == len, op, ": ", what,
                    " must be [B, ", len, "] = [", B, ", ", len, "], got ", tokens.sizes());
  at::Tensor t = tokens.to(at::kLong).contiguous();
  const at::Tensor host = t.is_cpu() ? t : t.cpu();  // one device read for CUDA tokens
  const int64_t* p = host.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < B * len; ++j)
    TORCH_CHECK_VALUE(p[j] >= 0 && p[j] < V, op, ": ", what, "[", j / len, ", ", j % len, "] = ", p[j],
                      " is outside the vocabulary [0, ", V, ")");
  return t;
}

at::Tensor check_circuit_prefix(const char* op, const CircuitBatch& c, const at::Tensor& prefix) {
  const int64_t B = c.batch, n = c.structure.n;
  TORCH_CHECK_VALUE(prefix.dim() == 2 && prefix.size(0) == B && prefix.size(1) < n, op,
                    ": prefix must be [B, len] with len in [0, n) = [0, ", n,
                    ") (the next token must lie in the window), B = ", B, ", got ", prefix.sizes());
  return check_circuit_tokens(op, "prefix", prefix, B, prefix.size(1), c.structure.vocab);
}

at::Tensor check_circuit_uniforms(const char* op, const CircuitBatch& c, const at::Tensor& uniforms) {
  const int64_t B = c.batch, S = c.structure.sampled_latents(), U = S + c.structure.n;
  TORCH_CHECK_VALUE(uniforms.scalar_type() == at::kDouble || uniforms.scalar_type() == at::kFloat, op,
                    ": uniforms must be float64 (or float32), got ", uniforms.scalar_type());
  TORCH_CHECK_VALUE(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == U, op,
                    ": uniforms must be [B, S + n] = [", B, ", ", U, "] (S = ", S,
                    " sampled latents, then one per token), got ", uniforms.sizes());
  at::Tensor u = uniforms.to(c.emissions.device(), at::kDouble).contiguous();
  const at::Tensor host = u.is_cpu() ? u : u.cpu();  // one device read for CUDA uniforms
  const double* up = host.const_data_ptr<double>();
  for (int64_t j = 0; j < B * U; ++j)
    TORCH_CHECK_VALUE(up[j] >= 0.0 && up[j] < 1.0, op, ": uniforms[", j / U, ", ", j % U, "] = ", up[j],
                      " is outside [0, 1)");
  return u;
}

namespace {

// Runs f(b) for every context, in parallel; a std::invalid_argument from the core (NaN parameters
// met while sampling) becomes a ValueError naming the first context that threw.
template <typename F>
void for_each_context(const char* op, int64_t B, const F& f) {
  std::mutex mu;
  int64_t bad = -1;
  std::string message;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      try {
        f(b);
      } catch (const std::invalid_argument& e) {
        std::lock_guard<std::mutex> lock(mu);
        if (bad < 0 || b < bad) bad = b, message = e.what();
        return;
      }
    }
  });
  TORCH_CHECK_VALUE(bad < 0, op, ": context ", bad, ": ", message);
}

// Circuit<scalar_t> of context b.
template <typename scalar_t>
core::Circuit<scalar_t> context(const CircuitBatch& c, int64_t b) {
  const core::CircuitStructure& s = c.structure;
  const int64_t w = s.weights_size(), t = s.transitions_size(), e = s.emissions_size();
  return core::Circuit<scalar_t>(s, c.weights.const_data_ptr<scalar_t>() + b * w, w,
                                 c.transitions.const_data_ptr<scalar_t>() + b * t, t,
                                 c.emissions.const_data_ptr<scalar_t>() + b * e, e);
}

}  // namespace

at::Tensor circuit_log_prob(c10::string_view kind, const at::Tensor& weights, const at::Tensor& transitions,
                            const at::Tensor& emissions, const at::Tensor& tokens) {
  static constexpr const char* op = "circuit_log_prob";
  const CircuitBatch c = check_circuit(op, std::string(kind), weights, transitions, emissions);
  const int64_t B = c.batch, n = c.structure.n;
  const at::Tensor tok = check_circuit_tokens(op, "tokens", tokens, B, n, c.structure.vocab);
  at::Tensor out = at::empty({B}, c.emissions.options());  // [B]
  AT_DISPATCH_FLOATING_TYPES(c.emissions.scalar_type(), op, [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t* x = tok.const_data_ptr<int64_t>();
    for_each_context(op, B, [&](int64_t b) { o[b] = context<scalar_t>(c, b).log_prob(x + b * n); });
  });
  return out;
}

at::Tensor circuit_prefix_log_marginals(c10::string_view kind, const at::Tensor& weights,
                                        const at::Tensor& transitions, const at::Tensor& emissions,
                                        const at::Tensor& tokens) {
  static constexpr const char* op = "circuit_prefix_log_marginals";
  const CircuitBatch c = check_circuit(op, std::string(kind), weights, transitions, emissions);
  const int64_t B = c.batch, n = c.structure.n;
  const at::Tensor tok = check_circuit_tokens(op, "tokens", tokens, B, n, c.structure.vocab);
  at::Tensor out = at::empty({B, n}, c.emissions.options());  // [B, n]
  AT_DISPATCH_FLOATING_TYPES(c.emissions.scalar_type(), op, [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t* x = tok.const_data_ptr<int64_t>();
    for_each_context(op, B,
                     [&](int64_t b) { context<scalar_t>(c, b).prefix_log_marginals(x + b * n, o + b * n); });
  });
  return out;
}

at::Tensor circuit_next_token_log_probs(c10::string_view kind, const at::Tensor& weights,
                                        const at::Tensor& transitions, const at::Tensor& emissions,
                                        const at::Tensor& prefix) {
  static constexpr const char* op = "circuit_next_token_log_probs";
  const CircuitBatch c = check_circuit(op, std::string(kind), weights, transitions, emissions);
  const int64_t B = c.batch, V = c.structure.vocab;
  const at::Tensor tok = check_circuit_prefix(op, c, prefix);
  const int64_t len = tok.size(1);
  at::Tensor out = at::empty({B, V}, c.emissions.options());  // [B, V]
  AT_DISPATCH_FLOATING_TYPES(c.emissions.scalar_type(), op, [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t* x = tok.const_data_ptr<int64_t>();
    for_each_context(
        op, B, [&](int64_t b) { context<scalar_t>(c, b).next_token_log_probs(x + b * len, len, o + b * V); });
  });
  return out;
}

at::Tensor circuit_sample(c10::string_view kind, const at::Tensor& weights, const at::Tensor& transitions,
                          const at::Tensor& emissions, const at::Tensor& uniforms) {
  static constexpr const char* op = "circuit_sample";
  const CircuitBatch c = check_circuit(op, std::string(kind), weights, transitions, emissions);
  const int64_t B = c.batch, n = c.structure.n, U = c.structure.num_uniforms();
  const at::Tensor u = check_circuit_uniforms(op, c, uniforms);
  const double* up = u.const_data_ptr<double>();
  at::Tensor out = at::empty({B, n}, at::TensorOptions().dtype(at::kLong));  // [B, n]
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(c.emissions.scalar_type(), op, [&] {
    for_each_context(op, B, [&](int64_t b) { context<scalar_t>(c, b).sample(up + b * U, o + b * n); });
  });
  return out;
}

}  // namespace mtprobe::ops
