// Exact inference in the probabilistic circuits of multi-token prediction heads (seed 003, MTPC:
// section 3.2 and App. B): the distribution q(x_1..x_n | context) of a window of n future tokens,
// for one context, from the parameters a head already produced. Torch-free, C++17, log space.
//
// Used by: csrc/ops/circuit.cpp (torch.ops.mtprobe.circuit_*, batched over contexts); the head
// drafter of issue 15 will (it draws windows, scores draft trees with next-token conditionals and
// verifies by rejection sampling with the exact q of each draft).
//
// Structure and evaluation are separate (as in cirkit): CircuitStructure says which latent variables
// exist and what each one conditions; Circuit<T> binds the head's parameters (float or double
// buffers of log-probabilities, not owned) and evaluates. Every kind is a tree of discrete latent
// variables with r states each; a latent's children are tokens and latents, left to right in token
// order; each token is drawn from a categorical over V chosen by the state of its parent latent:
//
//   kind   latents                                   parameters (log-probabilities; shapes)
//   FF     none (one implicit latent with r = 1)     emissions [n, V]        q = prod_i p_i(x_i)
//   CP     one root z, parent of every token         weights [r]             q(z)
//                                                    emissions [r, n, V]     p_{z,i}(x_i)
//   HMM    a chain z_1 .. z_n, z_i parent of x_i     weights [r]             q(z_1)
//          and of z_{i+1}                            transitions [n-1, r, r] [i-1][a][b] = q(z_i=b|z_{i-1}=a)
//                                                    emissions [n, r, V]     [i][z][v] = q(x_i=v|z_i=z)
//   BTree  one latent per internal node of a         weights [r]             q(z_root)
//          balanced binary split of the window       transitions [L-1, r, r] [k-1][a][b] =
//          (L = max(n - 1, 1) latents)                                       q(z_k=b|z_parent(k)=a)
//                                                    emissions [n, r, V]     [i][z][v] =
//                                                                            q(x_i=v|z_parent(i)=z)
//
// BTree (section 3.2's recursion): a span [b, e) of e - b >= 2 tokens gets a latent, split at
// m = b + (e - b) / 2 into [b, m) and [m, e) (the later half is the larger when e - b is odd; the
// paper's printed bounds are off by one and we read them as this balanced split); a span of one
// token is a leaf, drawn given the latent above it. Latents are numbered breadth first (level
// order, left to right), the root being latent 0, so every parent comes before its children and
// latent k >= 1 uses transitions[k - 1]. For n = 1 the root latent is the one token's parent (a
// mixture of r categoricals, the same as CP). Example, n = 5:
//   latent 0 [0,5) -> latent 1 [0,2), latent 2 [2,5);  latent 1 -> x0, x1;
//   latent 2 [2,5) -> x2, latent 3 [3,5);             latent 3 -> x3, x4
//   parent latent of x0..x4 = 1 1 2 3 3;  transitions [3, r, r] for latents 1, 2, 3
// HMM with identity transitions (log 0 off the diagonal) is CP with the same weights and
// emissions (read with CP's [r, n, V] laid out as [n, r, V]); so is BTree: one latent state for
// the whole window. CP with r = 1 is FF.
//
// The buffers must hold normalised log-probabilities (log_softmax outputs): the head makes every
// circuit normalised by construction, so no partition function is computed. check_normalised()
// verifies it (O(size of the parameters); the evaluation routines do not, to stay cheap).
//
// Operations, for one window (tokens [n], ids in [0, V)):
//   log_prob                  log q(x_1..x_n).
//   prefix_log_marginals      log q(x_1..x_i) for i = 1..n, in one left-to-right pass: a token
//                             after the prefix sums to 1 over V (its categorical is normalised), so
//                             the pass carries, per latent, the log-probability of everything
//                             observed so far jointly with that latent's state (the forward
//                             algorithm for HMM; the same recursion over a tree for BTree).
//                             Cost O(n r + L r^2).
//   conditional_log_probs     log q(x_i | x_<i) = marginal(i) - marginal(i - 1), marginal(0) = 0.
//   next_token_log_probs      log q(v | x_1..x_len) for every v in [0, V) at a prefix of length
//                             len in [0, n): what a draft tree expands. Cost O(len r + L r^2 + r V).
//   candidate_log_probs       the same for a list of k candidate tokens: the state posterior of the
//                             next token's parent latent, then r terms per candidate. Cost
//                             O(len r + L r^2 + r k).
//   sample                    ancestral sampling of a whole window in one pass (App. B, Alg. 1):
//                             every latent from its parent's state (weights for the root), then
//                             every token from its parent latent's state. The caller supplies the
//                             uniforms in [0, 1) (deterministic, testable): u[0 .. S) for latents
//                             0 .. S-1 (S = 0 for FF, 1 for CP, n for HMM, L for BTree), then
//                             u[S + i] for token i; num_uniforms() = S + n. A categorical is drawn
//                             by inverting its CDF: the first k with p_0 + .. + p_k > u (p
//                             renormalised by its sum), never an entry of probability 0.
//   greedy_window             x_i = argmax_v q(v | x_<i) for i = 1..n (ties: the lower id): the
//                             chain a Top-1 draft tree drafts. Returns log q of the window.
//   beam_windows              the k most probable windows that a beam of width k finds: at every
//                             depth i, keep the k prefixes with the largest exact marginal
//                             q(x_1..x_i) among the extensions of the kept prefixes of depth i - 1
//                             (ties: the earlier prefix, then the lower id). Writes min(k, V^n)
//                             distinct windows with their exact log q, most probable first.
//                             What it is: for FF it is the exact top-k (positions are
//                             independent, so every prefix of a top-k window is a top-k prefix);
//                             k = 1 is greedy_window; k >= V^n enumerates every window, exactly
//                             sorted. For CP, HMM and BTree the most probable window of a mixture
//                             over latent states is NP-hard to find in general (MAP in a latent
//                             mixture / PC: de Campos 2011, Conaty, Maua and de Campos 2017), so
//                             there the beam is a heuristic: its windows and their probabilities
//                             are exact, but a more probable window may be missed (the example
//                             below: greedy misses the MAP window, a beam of 2 finds it).
//
// Worked example, CP with n = 2, r = 2, V = 2 (probabilities; the buffers hold their logs):
//   weights [.3 .7]; emissions [r, n, V] = component 0: x1 [.8 .2], x2 [.6 .4]
//                                          component 1: x1 [.4 .6], x2 [.1 .9]
//   q(0,0) = .3*.8*.6 + .7*.4*.1 = .172      q(0,1) = .3*.8*.4 + .7*.4*.9 = .348
//   q(1,0) = .3*.2*.6 + .7*.6*.1 = .078      q(1,1) = .3*.2*.4 + .7*.6*.9 = .402
//   prefix marginals of (1,1): q(x1=1) = .48, q(1,1) = .402; conditionals .48, .402/.48 = .8375
//   next_token_log_probs at prefix (0): log [.172/.52, .348/.52] = log [.3308, .6692]
//   greedy_window: x1 = 0 (.52 > .48), x2 = 1 -> (0,1), q = .348 (the MAP window is (1,1), .402)
//   beam_windows k = 2: (1,1) .402, (0,1) .348
//   sample with u = [.5 .9 .3]: z = 1 (.5 >= .3), x1 = 1 (.9 >= .4), x2 = 1 (.3 >= .1) -> (1,1)
//
// Bad input (n, r or V below 1, a buffer of the wrong size, a token outside [0, V), a uniform
// outside [0, 1), a prefix length outside [0, n), k < 1) throws std::invalid_argument naming the
// value and what is right. A window or prefix of probability 0 gives -inf, and so do its later
// conditionals; next_token_log_probs after a prefix of probability 0 writes -inf everywhere.
// Evaluations recurse over the latent tree (depth n for HMM, about log2 n for BTree).
#pragma once

#include <cstdint>
#include <vector>

namespace mtprobe::core {

enum class CircuitKind { kFF, kCP, kHMM, kBTree };

// "FF", "CP", "HMM", "BTree".
const char* circuit_kind_name(CircuitKind kind);

struct CircuitLatent {
  int64_t parent = -1;            // latent index; -1 for the root (latent 0)
  int64_t begin = 0, end = 0;     // the tokens below it: [begin, end)
  std::vector<int64_t> children;  // left to right: c >= 0 is latent c, c < 0 is token -1 - c
};

// The symbolic structure: latents, what each conditions, and the parameter buffers' sizes.
struct CircuitStructure {
  CircuitKind kind = CircuitKind::kFF;
  int64_t n = 0, r = 0, vocab = 0;     // window, latent states (1 for FF), vocabulary
  std::vector<CircuitLatent> latents;  // [L] parents before children; latent 0 is the root
  std::vector<int64_t> token_parent;   // [n] the latent each token is drawn given

  // Throw std::invalid_argument unless n, r, vocab >= 1 and the buffer sizes fit in int64.
  static CircuitStructure ff(int64_t n, int64_t vocab);
  static CircuitStructure cp(int64_t n, int64_t r, int64_t vocab);
  static CircuitStructure hmm(int64_t n, int64_t r, int64_t vocab);
  static CircuitStructure btree(int64_t n, int64_t r, int64_t vocab);

  int64_t num_latents() const { return static_cast<int64_t>(latents.size()); }
  int64_t weights_size() const { return kind == CircuitKind::kFF ? 0 : r; }
  int64_t transitions_size() const { return (num_latents() - 1) * r * r; }  // 0 for FF and CP
  int64_t emissions_size() const { return n * r * vocab; }
  int64_t sampled_latents() const { return kind == CircuitKind::kFF ? 0 : num_latents(); }
  int64_t num_uniforms() const { return sampled_latents() + n; }
};

// A structure bound to one context's parameters. The buffers are not copied and must outlive the
// Circuit. Log-values come back as T; sums run in double.
template <typename T>
class Circuit {
 public:
  // Throws std::invalid_argument when a size differs from the structure's (a null pointer counts
  // as size 0; FF and CP take no transitions, FF no weights).
  Circuit(CircuitStructure structure, const T* weights, int64_t weights_size, const T* transitions,
          int64_t transitions_size, const T* emissions, int64_t emissions_size);

  const CircuitStructure& structure() const { return s_; }

  // Throws std::invalid_argument naming the first categorical whose probabilities do not sum to 1
  // within tol, or that holds NaN or +inf.
  void check_normalised(double tol) const;

  T log_prob(const int64_t* tokens /* [n] */) const;
  void prefix_log_marginals(const int64_t* tokens /* [n] */, T* out /* [n] */) const;
  void conditional_log_probs(const int64_t* tokens /* [n] */, T* out /* [n] */) const;
  // Writes log q(v | prefix) for v in [0, V); returns log q(prefix) (0 for len = 0).
  T next_token_log_probs(const int64_t* prefix /* [len] */, int64_t len, T* out /* [V] */) const;
  // The same conditionals for the k tokens of `candidates` only: O(len r + L r^2 + r k), what a draft
  // tree expands when it only looks at a shortlist. Returns log q(prefix).
  T candidate_log_probs(const int64_t* prefix /* [len] */, int64_t len, const int64_t* candidates /* [k] */,
                        int64_t k, T* out /* [k] */) const;
  void sample(const double* uniforms /* [num_uniforms()] */, int64_t* out_tokens /* [n] */) const;
  T greedy_window(int64_t* out_tokens /* [n] */) const;
  // Returns the number of windows written, min(k, V^n).
  int64_t beam_windows(int64_t k, int64_t* out_tokens /* [k, n] */, T* out_log_probs /* [k] */) const;

 private:
  double weight(int64_t z) const;
  double transition(int64_t latent, int64_t a, int64_t b) const;
  const T* emission_row(int64_t i, int64_t z) const;  // [V]
  void check_tokens(const int64_t* tokens, int64_t len, const char* what) const;
  bool visit(int64_t a, const int64_t* tokens, int64_t stop, double* ws, double* marginals,
             double* at_stop) const;
  // log q(x_1..x_len): per-state joint at the parent latent of token len, written to at_stop [r].
  void forward_to(const int64_t* prefix, int64_t len, double* at_stop) const;
  // log q(x_1..x_len, x_{len+1} = v) for every v, into out [V].
  void extension_log_marginals(const int64_t* prefix, int64_t len, double* out) const;

  CircuitStructure s_;
  const T* weights_;
  const T* transitions_;
  const T* emissions_;
};

extern template class Circuit<float>;
extern template class Circuit<double>;

}  // namespace mtprobe::core
