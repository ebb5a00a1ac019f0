// Exact inference in circuit heads on the device: the CUDA twins of core::Circuit's log_prob,
// prefix_log_marginals, next_token_log_probs and sample (csrc/core/circuit.h, which documents the
// kinds, the parameter layouts and the semantics these follow). Torch-free.
//
// The structure is passed flattened: latent_parent [L] (-1 for the root, latent 0) and token_parent
// [n], both from core::CircuitStructure (parents come before their children). One thread evaluates
// one window of one context: the circuits are small (n r + L r^2 per window), and a batch brings
// the parallelism (B contexts; B x n prefixes; B x V next tokens). Each thread keeps the per-latent
// state values in a local array of at most kMaxLatentStates = L * r doubles; the launcher refuses
// larger circuits. Sums run in double, as on the CPU.
//
// The bottom-up pass: inside[k][z] = log q(observed tokens below latent k | z_k = z); a token not
// observed contributes log 1 = 0 (its categorical is normalised). Tokens add their emission to their
// parent latent; then, children before parents (latent indices descending), latent k folds into its
// parent p: inside[p][a] += logsumexp_b(transition[k - 1][a][b] + inside[k][b]). The window's log q
// is logsumexp_z(weight[z] + inside[0][z]) (FF: one state, no weight).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace mtprobe::kernels {

constexpr int64_t kMaxLatentStates = 1024;  // L * r held per thread
constexpr int kCircuitThreads = 256;

// Error codes a sampling thread leaves per context (the launcher raises the CPU op's errors).
constexpr int kCircuitOk = 0, kCircuitNaN = 1, kCircuitNoMass = 2;

// kind: 0 FF, 1 CP, 2 HMM, 3 BTree (core::CircuitKind's order).
struct CircuitDims {
  int kind = 0;
  int64_t n = 0, r = 0, vocab = 0, latents = 0;
  int64_t weights_size = 0, transitions_size = 0, emissions_size = 0;  // per context
};

// What every kernel reads: the batch's parameters (contiguous, [B, ...] per context in circuit.h's
// layouts), their sizes and the flattened structure.
template <typename T>
struct CircuitArgs {
  const T* weights;
  const T* transitions;
  const T* emissions;
  CircuitDims dims;
  const int64_t* latent_parent;  // [L]
  const int64_t* token_parent;   // [n]
};

__device__ inline double circuit_log_add(double a, double b) {
  if (a == -INFINITY) return b;
  if (b == -INFINITY) return a;
  const double m = a > b ? a : b;
  return m + log1p(exp(-fabs(a - b)));
}

// log q(x_i = v | parent state z): CP is [r, n, V], FF [n, V] (r = 1), HMM and BTree [n, r, V].
template <typename T>
__device__ inline double circuit_emission(const T* e, const CircuitDims& d, int64_t i, int64_t z, int64_t v) {
  const int64_t row = d.kind == 1 ? z * d.n + i : i * d.r + z;
  return static_cast<double>(e[row * d.vocab + v]);
}

// log q(x_0 .. x_{m-1} [, x_m = extra]) of context b: the tokens before m are observed, and token m
// too when extra >= 0. inside: kMaxLatentStates doubles of scratch.
template <typename T>
__device__ inline double circuit_observed_log_prob(const CircuitArgs<T>& a, int64_t b, const int64_t* tokens,
                                                   int64_t m, int64_t extra, double* inside) {
  const CircuitDims& d = a.dims;
  const T* w = a.weights + b * d.weights_size;
  const T* t = a.transitions + b * d.transitions_size;
  const T* e = a.emissions + b * d.emissions_size;
  const int64_t r = d.r, L = d.latents;
  for (int64_t j = 0; j < L * r; ++j) inside[j] = 0.0;
  for (int64_t i = 0; i < m + (extra >= 0 ? 1 : 0); ++i) {
    const int64_t x = i < m ? tokens[i] : extra, k = a.token_parent[i];
    for (int64_t z = 0; z < r; ++z) inside[k * r + z] += circuit_emission(e, d, i, z, x);
  }
  for (int64_t k = L - 1; k >= 1; --k) {  // children before parents
    const int64_t p = a.latent_parent[k];
    const T* tk = t + (k - 1) * r * r;  // [a][b] = log q(z_k = b | z_p = a)
    for (int64_t s = 0; s < r; ++s) {
      double acc = -INFINITY;
      for (int64_t z = 0; z < r; ++z)
        acc = circuit_log_add(acc, static_cast<double>(tk[s * r + z]) + inside[k * r + z]);
      inside[p * r + s] += acc;
    }
  }
  if (d.kind == 0) return inside[0];  // FF: one state, no weight
  double total = -INFINITY;
  for (int64_t z = 0; z < r; ++z) total = circuit_log_add(total, static_cast<double>(w[z]) + inside[z]);
  return total;
}

// out[b] = log q(tokens[b] [0, m)) for the B contexts: log_prob (m = n) and the log q(prefix) that
// next_token_log_probs divides by (m = len; exactly 0 for len = 0, as on the CPU).
template <typename T>
__global__ void circuit_prefix_value_kernel(CircuitArgs<T> a, const int64_t* tokens, int64_t m, int64_t B,
                                            T* out) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= B) return;
  double inside[kMaxLatentStates];
  out[b] = m == 0 ? T(0) : static_cast<T>(circuit_observed_log_prob(a, b, tokens + b * m, m, -1, inside));
}

// out[b, j] = log q(tokens[b] [0, j + 1)): every prefix marginal, one thread per (b, j).
template <typename T>
__global__ void circuit_prefix_marginals_kernel(CircuitArgs<T> a, const int64_t* tokens, int64_t B, T* out) {
  const int64_t n = a.dims.n, idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= B * n) return;
  const int64_t b = idx / n, j = idx % n;
  double inside[kMaxLatentStates];
  out[idx] = static_cast<T>(circuit_observed_log_prob(a, b, tokens + b * n, j + 1, -1, inside));
}

// out[b, v] = log q(v | prefix[b]) = log q(prefix, v) - log q(prefix), -inf after a prefix of
// probability 0 (prefix_log_prob [B] from circuit_prefix_value_kernel); one thread per (b, v).
template <typename T>
__global__ void circuit_next_token_kernel(CircuitArgs<T> a, const int64_t* prefix, int64_t len,
                                          const T* prefix_log_prob, int64_t B, T* out) {
  const int64_t V = a.dims.vocab, idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= B * V) return;
  const int64_t b = idx / V, v = idx % V;
  const double before = static_cast<double>(prefix_log_prob[b]);
  if (before == -INFINITY) {
    out[idx] = static_cast<T>(-INFINITY);
    return;
  }
  double inside[kMaxLatentStates];
  out[idx] = static_cast<T>(circuit_observed_log_prob(a, b, prefix + b * len, len, v, inside) - before);
}

// core::sample_categorical: the first j with p_0 + .. + p_j > u * sum(p), p = exp(logp - max), never
// an entry of probability 0; -1 with *error set for a NaN or a row without mass.
template <typename T>
__device__ inline int64_t circuit_draw(const T* logp, int64_t stride, int64_t k, double u, int* error) {
  double m = -INFINITY;
  for (int64_t j = 0; j < k; ++j) {
    const double x = static_cast<double>(logp[j * stride]);
    if (isnan(x)) {
      *error = kCircuitNaN;
      return -1;
    }
    m = x > m ? x : m;
  }
  if (m == -INFINITY) {
    *error = kCircuitNoMass;
    return -1;
  }
  double total = 0;
  for (int64_t j = 0; j < k; ++j) total += exp(static_cast<double>(logp[j * stride]) - m);
  const double target = u * total;
  double cum = 0;
  int64_t last_positive = 0;
  for (int64_t j = 0; j < k; ++j) {
    const double p = exp(static_cast<double>(logp[j * stride]) - m);
    if (p > 0) last_positive = j;
    cum += p;
    if (p > 0 && cum > target) return j;
  }
  return last_positive;  // rounding: u * total came out at or above the summed total
}

// Ancestral sampling (core::Circuit::sample): latents in index order (parents first) from the
// weights and transition rows, then every token from its parent latent's state; uniforms [B, S + n]
// (S = 0 for FF, else L). One thread per context; error [B] gets kCircuitOk or what went wrong.
template <typename T>
__global__ void circuit_sample_kernel(CircuitArgs<T> a, const double* uniforms, int64_t B, int64_t* out,
                                      int* error) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const CircuitDims& d = a.dims;
  const int64_t r = d.r, S = d.kind == 0 ? 0 : d.latents, U = S + d.n;
  const T* wb = a.weights + b * d.weights_size;
  const T* tb = a.transitions + b * d.transitions_size;
  const T* eb = a.emissions + b * d.emissions_size;
  const double* u = uniforms + b * U;
  int64_t* x = out + b * d.n;
  int err = kCircuitOk;
  int64_t state[kMaxLatentStates];  // L <= L * r
  state[0] = 0;
  if (S > 0) {
    state[0] = circuit_draw(wb, 1, r, u[0], &err);
    for (int64_t k = 1; k < S && err == kCircuitOk; ++k)
      state[k] = circuit_draw(tb + ((k - 1) * r + state[a.latent_parent[k]]) * r, 1, r, u[k], &err);
  }
  for (int64_t i = 0; i < d.n && err == kCircuitOk; ++i) {
    const int64_t z = state[a.token_parent[i]];
    const int64_t row = d.kind == 1 ? z * d.n + i : i * r + z;
    x[i] = circuit_draw(eb + row * d.vocab, 1, d.vocab, u[S + i], &err);
  }
  if (err != kCircuitOk)
    for (int64_t i = 0; i < d.n; ++i) x[i] = -1;
  error[b] = err;
}

inline unsigned circuit_blocks(int64_t threads) {
  return static_cast<unsigned>((threads + kCircuitThreads - 1) / kCircuitThreads);
}

// The launchers (B > 0 contexts).
template <typename T>
cudaError_t circuit_prefix_value(const CircuitArgs<T>& a, const int64_t* tokens, int64_t m, int64_t B, T* out,
                                 cudaStream_t stream) {
  if (B > 0)
    circuit_prefix_value_kernel<T><<<circuit_blocks(B), kCircuitThreads, 0, stream>>>(a, tokens, m, B, out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t circuit_prefix_marginals(const CircuitArgs<T>& a, const int64_t* tokens, int64_t B, T* out,
                                     cudaStream_t stream) {
  if (B > 0)
    circuit_prefix_marginals_kernel<T>
        <<<circuit_blocks(B * a.dims.n), kCircuitThreads, 0, stream>>>(a, tokens, B, out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t circuit_next_token(const CircuitArgs<T>& a, const int64_t* prefix, int64_t len,
                               const T* prefix_log_prob, int64_t B, T* out, cudaStream_t stream) {
  if (B > 0)
    circuit_next_token_kernel<T><<<circuit_blocks(B * a.dims.vocab), kCircuitThreads, 0, stream>>>(
        a, prefix, len, prefix_log_prob, B, out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t circuit_sample(const CircuitArgs<T>& a, const double* uniforms, int64_t B, int64_t* out,
                           int* error, cudaStream_t stream) {
  if (B > 0)
    circuit_sample_kernel<T><<<circuit_blocks(B), kCircuitThreads, 0, stream>>>(a, uniforms, B, out, error);
  return cudaGetLastError();
}

}  // namespace mtprobe::kernels
