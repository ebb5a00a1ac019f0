// CUDA launchers of the circuit ops (kernels: csrc/kernels/circuit.cuh): the same schemas, checks
// (check_circuit, check_circuit_tokens in circuit.cpp) and results as the CPU kernels, for parameters
// on a CUDA device. Token checks, uniforms' range and sampling errors each cost one device read.
// Built only when torch has CUDA; CI compiles them, compile-only. Run on an H100 and an H200
// (benchmarks/results/gpu/): results match the CPU ops; a bad token's error message segfaulted there, in a
// static copy of libstdc++ the image's compiler had linked in (CMakeLists.txt links the shared one now).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "kernels/circuit.cuh"
#include "ops/ops.h"

namespace mtprobe::ops {

namespace {

// The batch's structure flattened for the kernels, on the parameters' device: [L + n] int64,
// latent_parent then token_parent.
struct DeviceCircuit {
  kernels::CircuitDims dims;
  at::Tensor structure;
  const int64_t* latent_parent() const { return structure.const_data_ptr<int64_t>(); }
  const int64_t* token_parent() const { return structure.const_data_ptr<int64_t>() + dims.latents; }
};

DeviceCircuit device_circuit(const char* op, const CircuitBatch& c) {
  const core::CircuitStructure& s = c.structure;
  TORCH_CHECK_VALUE(c.emissions.is_cuda() && c.weights.device() == c.emissions.device() &&
                        c.transitions.device() == c.emissions.device(),
                    op, ": weights, transitions and emissions must be on one CUDA device, got ",
                    c.weights.device(), ", ", c.transitions.device(), " and ", c.emissions.device());
  TORCH_CHECK_VALUE(s.num_latents() * s.r <= kernels::kMaxLatentStates, op,
                    ": the CUDA kernels hold L * r <= ", kernels::kMaxLatentStates,
                    " latent states per thread; this circuit has L = ", s.num_latents(),
                    " latents of r = ", s.r, " states (use the CPU op, or a smaller window or rank)");
  DeviceCircuit d;
  d.dims.kind = static_cast<int>(s.kind);
  d.dims.n = s.n;
  d.dims.r = s.r;
  d.dims.vocab = s.vocab;
  d.dims.latents = s.num_latents();
  d.dims.weights_size = s.weights_size();
  d.dims.transitions_size = s.transitions_size();
  d.dims.emissions_size = s.emissions_size();
  std::vector<int64_t> flat;
  flat.reserve(s.num_latents() + s.n);
  for (const core::CircuitLatent& l : s.latents) flat.push_back(l.parent);
  flat.insert(flat.end(), s.token_parent.begin(), s.token_parent.end());
  d.structure = at::tensor(flat, at::TensorOptions().dtype(at::kLong)).to(c.emissions.device());
  return d;
}

// The kernels' view of the batch.
template <typename T>
kernels::CircuitArgs<T> args(const CircuitBatch& c, const DeviceCircuit& d) {
  return {c.weights.const_data_ptr<T>(),
          c.transitions.const_data_ptr<T>(),
          c.emissions.const_data_ptr<T>(),
          d.dims,
          d.latent_parent(),
          d.token_parent()};
}

void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, op, " kernel: ", cudaGetErrorString(err));
}

// log q of the first m tokens of every context (m = n: log_prob; m = len: the prefix of next_token).
at::Tensor prefix_value(const char* op, const CircuitBatch& c, const DeviceCircuit& d, const at::Tensor& tok,
                        int64_t m) {
  at::Tensor out = at::empty({c.batch}, c.emissions.options());  // [B]
  AT_DISPATCH_FLOATING_TYPES(c.emissions.scalar_type(), "circuit_prefix_value", [&] {
    check_launch(op, kernels::circuit_prefix_value<scalar_t>(
                         args<scalar_t>(c, d), tok.const_data_ptr<int64_t>(), m, c.batch,
                         out.data_ptr<scalar_t>(), c10::cuda::getCurrentCUDAStream()));
  });
  return out;
}

}  // namespace

at::Tensor circuit_log_prob_cuda(c10::string_view kind, const at::Tensor& weights,
                                 const at::Tensor& transitions, const at::Tensor& emissions,
                                 const at::Tensor& tokens) {
  static constexpr const char* op = "circuit_log_prob";
  const CircuitBatch c = check_circuit(op, std::string(kind), weights, transitions, emissions);
  c10::cuda::CUDAGuard guard(c.emissions.device());
  const DeviceCircuit d = device_circuit(op, c);
  const at::Tensor tok = check_circuit_tokens(op, "tokens", tokens, c.batch, c.structure.n, c.structure.vocab)
                             .to(c.emissions.device());
  return prefix_value(op, c, d, tok, c.structure.n);
}

at::Tensor circuit_prefix_log_marginals_cuda(c10::string_view kind, const at::Tensor& weights,
                                             const at::Tensor& transitions, const at::Tensor& emissions,
                                             const at::Tensor& tokens) {
  static constexpr const char* op = "circuit_prefix_log_marginals";
  const CircuitBatch c = check_circuit(op, std::string(kind), weights, transitions, emissions);
  c10::cuda::CUDAGuard guard(c.emissions.device());
  const DeviceCircuit d = device_circuit(op, c);
  const int64_t B = c.batch, n = c.structure.n;
  const at::Tensor tok =
      check_circuit_tokens(op, "tokens", tokens, B, n, c.structure.vocab).to(c.emissions.device());
  at::Tensor out = at::empty({B, n}, c.emissions.options());  // [B, n]
  AT_DISPATCH_FLOATING_TYPES(c.emissions.scalar_type(), op, [&] {
    check_launch(op, kernels::circuit_prefix_marginals<scalar_t>(
                         args<scalar_t>(c, d), tok.const_data_ptr<int64_t>(), B, out.data_ptr<scalar_t>(),
                         c10::cuda::getCurrentCUDAStream()));
  });
  return out;
}

at::Tensor circuit_next_token_log_probs_cuda(c10::string_view kind, const at::Tensor& weights,
                                             const at::Tensor& transitions, const at::Tensor& emissions,
                                             const at::Tensor& prefix) {
  static constexpr const char* op = "circuit_next_token_log_probs";
  const CircuitBatch c = check_circuit(op, std::string(kind), weights, transitions, emissions);
  const int64_t B = c.batch, V = c.structure.vocab;
  c10::cuda::CUDAGuard guard(c.emissions.device());
  const DeviceCircuit d = device_circuit(op, c);
  const at::Tensor tok = check_circuit_prefix(op, c, prefix).to(c.emissions.device());
  const int64_t len = tok.size(1);
  const at::Tensor before = prefix_value(op, c, d, tok, len);  // [B] log q(prefix)
  at::Tensor out = at::empty({B, V}, c.emissions.options());   // [B, V]
  AT_DISPATCH_FLOATING_TYPES(c.emissions.scalar_type(), op, [&] {
    check_launch(
        op, kernels::circuit_next_token<scalar_t>(
                args<scalar_t>(c, d), tok.const_data_ptr<int64_t>(), len, before.const_data_ptr<scalar_t>(),
                B, out.data_ptr<scalar_t>(), c10::cuda::getCurrentCUDAStream()));
  });
  return out;
}

at::Tensor circuit_sample_cuda(c10::string_view kind, const at::Tensor& weights,
                               const at::Tensor& transitions, const at::Tensor& emissions,
                               const at::Tensor& uniforms) {
  static constexpr const char* op = "circuit_sample";
  const CircuitBatch c = check_circuit(op, std::string(kind), weights, transitions, emissions);
  const int64_t B = c.batch, n = c.structure.n;
  c10::cuda::CUDAGuard guard(c.emissions.device());
  const DeviceCircuit d = device_circuit(op, c);
  const at::Tensor u = check_circuit_uniforms(op, c, uniforms);
  at::Tensor out = at::empty({B, n}, c.emissions.options().dtype(at::kLong));  // [B, n]
  at::Tensor error = at::zeros({B}, c.emissions.options().dtype(at::kInt));    // [B]
  AT_DISPATCH_FLOATING_TYPES(c.emissions.scalar_type(), op, [&] {
    check_launch(op, kernels::circuit_sample<scalar_t>(args<scalar_t>(c, d), u.const_data_ptr<double>(), B,
                                                       out.data_ptr<int64_t>(), error.data_ptr<int>(),
                                                       c10::cuda::getCurrentCUDAStream()));
  });
  // One device read: the first context a draw failed in, as the CPU op reports it.
  const at::Tensor failed = error.nonzero();
  if (failed.numel() > 0) {
    const int64_t b = failed[0][0].item<int64_t>();
    const bool nan = error[b].item<int>() == kernels::kCircuitNaN;
    TORCH_CHECK_VALUE(false, op, ": context ", b, ": sampling the circuit: ",
                      nan ? "NaN in its parameters" : "a categorical has no entry of positive probability");
  }
  return out;
}

}  // namespace mtprobe::ops

TORCH_LIBRARY_IMPL(mtprobe, CUDA, m) {
  m.impl("circuit_log_prob", &mtprobe::ops::circuit_log_prob_cuda);
  m.impl("circuit_prefix_log_marginals", &mtprobe::ops::circuit_prefix_log_marginals_cuda);
  m.impl("circuit_next_token_log_probs", &mtprobe::ops::circuit_next_token_log_probs_cuda);
  m.impl("circuit_sample", &mtprobe::ops::circuit_sample_cuda);
}
