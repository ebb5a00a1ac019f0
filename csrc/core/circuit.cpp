#include "core/circuit.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

namespace mtprobe::core {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// log(exp(a) + exp(b)) without overflow; -inf when both are -inf; NaN in, NaN out.
double log_add(double a, double b) {
  if (std::isnan(b)) return b;
  if (a < b) std::swap(a, b);
  if (a == kNegInf) return kNegInf;
  return a + std::log1p(std::exp(b - a));
}

double log_sum(const double* x, int64_t k) {
  double m = kNegInf;
  for (int64_t j = 0; j < k; ++j) m = std::max(m, x[j]);
  if (m == kNegInf) return kNegInf;
  double s = 0;
  for (int64_t j = 0; j < k; ++j) s += std::exp(x[j] - m);
  return m + std::log(s);
}

std::string str(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

void check_dims(const char* kind, int64_t n, int64_t r, int64_t vocab) {
  const std::string k(kind);
  if (n < 1) throw std::invalid_argument(k + " circuit: window n = " + std::to_string(n) + ", must be >= 1");
  if (r < 1)
    throw std::invalid_argument(k + " circuit: latent states r = " + std::to_string(r) + ", must be >= 1");
  if (vocab < 1)
    throw std::invalid_argument(k + " circuit: vocabulary V = " + std::to_string(vocab) + ", must be >= 1");
  // n * r * V and n * r * r must fit in int64 (sizes of the emission and transition buffers).
  const int64_t big = std::max(r, vocab);
  if (n > std::numeric_limits<int64_t>::max() / r / big)
    throw std::invalid_argument(k + " circuit: n * r * max(r, V) = " + std::to_string(n) + " * " +
                                std::to_string(r) + " * " + std::to_string(big) + " overflows int64");
}

// Draws k with p_0 + .. + p_k > u * sum(p), p = exp(logp): the inverse CDF, never a zero entry.
template <typename T>
int64_t sample_categorical(const T* logp, int64_t k, double u, const char* what) {
  double m = kNegInf;
  for (int64_t j = 0; j < k; ++j) {
    if (std::isnan(static_cast<double>(logp[j])))
      throw std::invalid_argument(std::string("sampling the circuit: NaN in ") + what);
    m = std::max(m, static_cast<double>(logp[j]));
  }
  if (m == kNegInf)
    throw std::invalid_argument(std::string("sampling the circuit: ") + what +
                                " has no entry of positive probability");
  double total = 0;
  for (int64_t j = 0; j < k; ++j) total += std::exp(logp[j] - m);
  const double target = u * total;
  double cum = 0;
  int64_t last_positive = 0;
  for (int64_t j = 0; j < k; ++j) {
    const double p = std::exp(logp[j] - m);
    if (p > 0) last_positive = j;
    cum += p;
    if (p > 0 && cum > target) return j;
  }
  return last_positive;  // rounding: u * total came out at or above the summed total
}

[[noreturn]] void throw_nan(CircuitKind kind);

}  // namespace

const char* circuit_kind_name(CircuitKind kind) {
  switch (kind) {
    case CircuitKind::kFF:
      return "FF";
    case CircuitKind::kCP:
      return "CP";
    case CircuitKind::kHMM:
      return "HMM";
    case CircuitKind::kBTree:
      return "BTree";
  }
  return "?";
}

CircuitStructure CircuitStructure::ff(int64_t n, int64_t vocab) {
  check_dims("FF", n, 1, vocab);
  CircuitStructure s = cp(n, 1, vocab);
  s.kind = CircuitKind::kFF;
  return s;
}

CircuitStructure CircuitStructure::cp(int64_t n, int64_t r, int64_t vocab) {
  check_dims("CP", n, r, vocab);
  CircuitStructure s;
  s.kind = CircuitKind::kCP;
  s.n = n, s.r = r, s.vocab = vocab;
  CircuitLatent root;
  root.begin = 0, root.end = n;
  for (int64_t i = 0; i < n; ++i) root.children.push_back(-1 - i);
  s.latents.push_back(std::move(root));
  s.token_parent.assign(n, 0);
  return s;
}

CircuitStructure CircuitStructure::hmm(int64_t n, int64_t r, int64_t vocab) {
  check_dims("HMM", n, r, vocab);
  CircuitStructure s;
  s.kind = CircuitKind::kHMM;
  s.n = n, s.r = r, s.vocab = vocab;
  for (int64_t i = 0; i < n; ++i) {
    CircuitLatent z;
    z.parent = i - 1;
    z.begin = i, z.end = n;
    z.children.push_back(-1 - i);
    if (i + 1 < n) z.children.push_back(i + 1);
    s.latents.push_back(std::move(z));
    s.token_parent.push_back(i);
  }
  return s;
}

CircuitStructure CircuitStructure::btree(int64_t n, int64_t r, int64_t vocab) {
  check_dims("BTree", n, r, vocab);
  CircuitStructure s;
  s.kind = CircuitKind::kBTree;
  s.n = n, s.r = r, s.vocab = vocab;
  s.token_parent.assign(n, -1);
  if (n == 1) {
    CircuitLatent root;
    root.begin = 0, root.end = 1;
    root.children.push_back(-1);
    s.latents.push_back(std::move(root));
    s.token_parent[0] = 0;
    return s;
  }
  // Breadth first: a latent's index is its position in the queue, so parents precede children.
  CircuitLatent root;
  root.begin = 0, root.end = n;
  s.latents.push_back(std::move(root));
  for (size_t k = 0; k < s.latents.size(); ++k) {
    const int64_t b = s.latents[k].begin, e = s.latents[k].end, m = b + (e - b) / 2;
    for (const auto& [cb, ce] : {std::pair<int64_t, int64_t>{b, m}, std::pair<int64_t, int64_t>{m, e}}) {
      if (ce - cb == 1) {
        s.latents[k].children.push_back(-1 - cb);
        s.token_parent[cb] = static_cast<int64_t>(k);
      } else {
        CircuitLatent child;
        child.parent = static_cast<int64_t>(k);
        child.begin = cb, child.end = ce;
        s.latents[k].children.push_back(static_cast<int64_t>(s.latents.size()));
        s.latents.push_back(std::move(child));  // invalidates references into s.latents, none held
      }
    }
  }
  return s;
}

namespace {
void throw_nan(CircuitKind kind) {
  throw std::invalid_argument(std::string(circuit_kind_name(kind)) +
                              " circuit: a window's log-probability is NaN; the parameters must be "
                              "log-probabilities (check_normalised names the bad one)");
}
}  // namespace

template <typename T>
Circuit<T>::Circuit(CircuitStructure structure, const T* weights, int64_t weights_size, const T* transitions,
                    int64_t transitions_size, const T* emissions, int64_t emissions_size)
    : s_(std::move(structure)), weights_(weights), transitions_(transitions), emissions_(emissions) {
  const std::string kind = circuit_kind_name(s_.kind);
  const std::string dims = "n = " + std::to_string(s_.n) + ", r = " + std::to_string(s_.r) +
                           ", V = " + std::to_string(s_.vocab) + ", L = " + std::to_string(s_.num_latents());
  const auto check = [&](const char* name, const T* p, int64_t got, int64_t want, const char* shape) {
    if (p == nullptr) got = 0;
    if (got != want)
      throw std::invalid_argument(kind + " circuit: " + name + " holds " + std::to_string(got) + " values; " +
                                  shape + " needs " + std::to_string(want) + " (" + dims + ")");
  };
  const bool ff = s_.kind == CircuitKind::kFF, cp = s_.kind == CircuitKind::kCP;
  check("weights", weights, weights_size, s_.weights_size(), ff ? "FF (none)" : "[r]");
  check("transitions", transitions, transitions_size, s_.transitions_size(),
        ff || cp ? "no latent below the root (none)" : "[L - 1, r, r]");
  check("emissions", emissions, emissions_size, s_.emissions_size(),
        ff ? "[n, V]" : (cp ? "[r, n, V]" : "[n, r, V]"));
}

template <typename T>
double Circuit<T>::weight(int64_t z) const {
  return s_.kind == CircuitKind::kFF ? 0.0 : static_cast<double>(weights_[z]);
}

template <typename T>
double Circuit<T>::transition(int64_t latent, int64_t a, int64_t b) const {
  return static_cast<double>(transitions_[((latent - 1) * s_.r + a) * s_.r + b]);
}

template <typename T>
const T* Circuit<T>::emission_row(int64_t i, int64_t z) const {
  if (s_.kind == CircuitKind::kCP) return emissions_ + (z * s_.n + i) * s_.vocab;  // [r, n, V]
  return emissions_ + (i * s_.r + z) * s_.vocab;                                   // [n, r, V]
}

template <typename T>
void Circuit<T>::check_normalised(double tol) const {
  const std::string kind = circuit_kind_name(s_.kind);
  const auto check_row = [&](const T* p, int64_t k, const std::string& what) {
    double total = 0;
    for (int64_t j = 0; j < k; ++j) {
      const double x = static_cast<double>(p[j]);
      if (std::isnan(x) || x == std::numeric_limits<double>::infinity())
        throw std::invalid_argument(kind + " circuit: " + what + "[" + std::to_string(j) + "] is " + str(x) +
                                    "; log-probabilities must be finite or -inf");
      total += std::exp(x);
    }
    if (!(std::fabs(total - 1.0) <= tol))
      throw std::invalid_argument(kind + " circuit: " + what + " sums to " + str(total) +
                                  " (exp of the log values); every distribution must sum to 1 within " +
                                  str(tol));
  };
  const int64_t r = s_.r;
  if (s_.kind != CircuitKind::kFF) check_row(weights_, r, "weights");
  for (int64_t k = 1; k < s_.num_latents(); ++k)
    for (int64_t a = 0; a < r; ++a)
      check_row(transitions_ + ((k - 1) * r + a) * r, r,
                "transitions[" + std::to_string(k - 1) + "][" + std::to_string(a) + "]");
  for (int64_t i = 0; i < s_.n; ++i)
    for (int64_t z = 0; z < r; ++z) {
      const std::string where =
          s_.kind == CircuitKind::kFF
              ? "[" + std::to_string(i) + "]"
              : (s_.kind == CircuitKind::kCP ? "[" + std::to_string(z) + "][" + std::to_string(i) + "]"
                                             : "[" + std::to_string(i) + "][" + std::to_string(z) + "]");
      check_row(emission_row(i, z), s_.vocab, "emissions" + where);
    }
}

template <typename T>
void Circuit<T>::check_tokens(const int64_t* tokens, int64_t len, const char* what) const {
  if (len > 0 && tokens == nullptr)
    throw std::invalid_argument(std::string(circuit_kind_name(s_.kind)) + " circuit: " + what +
                                " is null but holds " + std::to_string(len) + " tokens");
  for (int64_t i = 0; i < len; ++i)
    if (tokens[i] < 0 || tokens[i] >= s_.vocab)
      throw std::invalid_argument(std::string(circuit_kind_name(s_.kind)) + " circuit: token " +
                                  std::to_string(tokens[i]) + " at " + what + " position " +
                                  std::to_string(i) + " is outside the vocabulary [0, " +
                                  std::to_string(s_.vocab) + ")");
}

// Visits latent a whose forward message F_a(z) = log q(tokens left of a's span, z_a = z) is at
// ws[a * r]; keeps in(z) = the log-probability of a's children processed so far given z_a = z at
// ws[(L + a) * r]. Token i's prefix marginal is logsumexp_z F_a(z) + in(z) + log e_i(z, x_i): the
// tokens after it sum to 1. At token `stop` it writes F_a + in to at_stop and returns true.
template <typename T>
bool Circuit<T>::visit(int64_t a, const int64_t* tokens, int64_t stop, double* ws, double* marginals,
                       double* at_stop) const {
  const int64_t r = s_.r, L = s_.num_latents();
  const double* f = ws + a * r;
  double* in = ws + (L + a) * r;
  std::fill(in, in + r, 0.0);
  std::vector<double> tmp(r);
  const std::vector<int64_t>& kids = s_.latents[a].children;
  for (size_t j = 0; j < kids.size(); ++j) {
    const int64_t c = kids[j];
    if (c < 0) {
      const int64_t i = -1 - c;
      if (i == stop) {
        for (int64_t z = 0; z < r; ++z) at_stop[z] = f[z] + in[z];
        return true;
      }
      for (int64_t z = 0; z < r; ++z) {
        const double e = static_cast<double>(emission_row(i, z)[tokens[i]]);
        in[z] += e;
        tmp[z] = f[z] + in[z];
      }
      if (marginals != nullptr) marginals[i] = log_sum(tmp.data(), r);
    } else {
      double* fc = ws + c * r;  // F_c(b) = logsumexp_a F_a(a) + in(a) + log T_c(a, b)
      for (int64_t b = 0; b < r; ++b) {
        double acc = kNegInf;
        for (int64_t z = 0; z < r; ++z) acc = log_add(acc, f[z] + in[z] + transition(c, z, b));
        fc[b] = acc;
      }
      if (visit(c, tokens, stop, ws, marginals, at_stop)) return true;
      // c's subtree given z_a, summed over z_c, joins in(z) even when c is a's last child: a's parent
      // folds a's complete in(z) into its own before a later sibling of a (BTree from n = 6 on, where
      // latent [0, 3) ends in latent [1, 3) and is followed by latent [3, 6)).
      const double* inc = ws + (L + c) * r;
      for (int64_t z = 0; z < r; ++z) {
        for (int64_t b = 0; b < r; ++b) tmp[b] = transition(c, z, b) + inc[b];
        in[z] += log_sum(tmp.data(), r);
      }
    }
  }
  return false;
}

template <typename T>
void Circuit<T>::forward_to(const int64_t* prefix, int64_t len, double* at_stop) const {
  std::vector<double> ws(2 * s_.num_latents() * s_.r);
  for (int64_t z = 0; z < s_.r; ++z) ws[z] = weight(z);
  visit(0, prefix, len, ws.data(), nullptr, at_stop);
}

template <typename T>
void Circuit<T>::extension_log_marginals(const int64_t* prefix, int64_t len, double* out) const {
  const int64_t r = s_.r, V = s_.vocab;
  std::vector<double> at(r);
  forward_to(prefix, len, at.data());
  // logsumexp over z of at(z) + log e_len(z, v), for every v: a max pass, then a sum pass.
  std::fill(out, out + V, kNegInf);
  for (int64_t z = 0; z < r; ++z) {
    const T* e = emission_row(len, z);
    for (int64_t v = 0; v < V; ++v) {
      const double x = at[z] + static_cast<double>(e[v]);
      if (x > out[v] || std::isnan(x)) out[v] = x;  // a NaN stays (x > NaN is false)
    }
  }
  std::vector<double> sum(V, 0.0);
  for (int64_t z = 0; z < r; ++z) {
    const T* e = emission_row(len, z);
    for (int64_t v = 0; v < V; ++v)
      if (out[v] != kNegInf) sum[v] += std::exp(at[z] + static_cast<double>(e[v]) - out[v]);
  }
  for (int64_t v = 0; v < V; ++v)
    if (out[v] != kNegInf) out[v] += std::log(sum[v]);
}

template <typename T>
void Circuit<T>::prefix_log_marginals(const int64_t* tokens, T* out) const {
  check_tokens(tokens, s_.n, "window");
  std::vector<double> ws(2 * s_.num_latents() * s_.r), marginals(s_.n);
  for (int64_t z = 0; z < s_.r; ++z) ws[z] = weight(z);
  visit(0, tokens, /*stop=*/-1, ws.data(), marginals.data(), nullptr);
  for (int64_t i = 0; i < s_.n; ++i) out[i] = static_cast<T>(marginals[i]);
}

template <typename T>
T Circuit<T>::log_prob(const int64_t* tokens) const {
  std::vector<T> m(s_.n);
  prefix_log_marginals(tokens, m.data());
  return m.back();
}

template <typename T>
void Circuit<T>::conditional_log_probs(const int64_t* tokens, T* out) const {
  check_tokens(tokens, s_.n, "window");
  std::vector<double> ws(2 * s_.num_latents() * s_.r), m(s_.n);
  for (int64_t z = 0; z < s_.r; ++z) ws[z] = weight(z);
  visit(0, tokens, -1, ws.data(), m.data(), nullptr);
  double prev = 0;
  for (int64_t i = 0; i < s_.n; ++i) {
    out[i] = static_cast<T>(prev == kNegInf ? kNegInf : m[i] - prev);
    prev = m[i];
  }
}

template <typename T>
T Circuit<T>::next_token_log_probs(const int64_t* prefix, int64_t len, T* out) const {
  if (len < 0 || len >= s_.n)
    throw std::invalid_argument(std::string(circuit_kind_name(s_.kind)) + " circuit: prefix length " +
                                std::to_string(len) + " is outside [0, n) = [0, " + std::to_string(s_.n) +
                                "): the next token must lie in the window");
  check_tokens(prefix, len, "prefix");
  std::vector<double> ext(s_.vocab);
  extension_log_marginals(prefix, len, ext.data());
  const double z = log_sum(ext.data(), s_.vocab);  // log q(prefix)
  for (int64_t v = 0; v < s_.vocab; ++v) out[v] = static_cast<T>(z == kNegInf ? kNegInf : ext[v] - z);
  return static_cast<T>(z);
}

template <typename T>
T Circuit<T>::candidate_log_probs(const int64_t* prefix, int64_t len, const int64_t* candidates, int64_t k,
                                  T* out) const {
  if (len < 0 || len >= s_.n)
    throw std::invalid_argument(std::string(circuit_kind_name(s_.kind)) + " circuit: prefix length " +
                                std::to_string(len) + " is outside [0, n) = [0, " + std::to_string(s_.n) +
                                "): the next token must lie in the window");
  if (k < 0) throw std::invalid_argument("candidate_log_probs: k = " + std::to_string(k) + ", must be >= 0");
  check_tokens(prefix, len, "prefix");
  check_tokens(candidates, k, "candidates");
  const int64_t r = s_.r;
  std::vector<double> at(r);
  forward_to(prefix, len, at.data());      // log q(prefix, state of the next token's parent latent)
  const double z = log_sum(at.data(), r);  // log q(prefix): the next token's categorical sums to 1
  for (int64_t j = 0; j < k; ++j) {
    double best = kNegInf, sum = 0;
    for (int64_t s = 0; s < r; ++s)
      best = std::max(best, at[s] + static_cast<double>(emission_row(len, s)[candidates[j]]));
    if (best != kNegInf && z != kNegInf) {
      for (int64_t s = 0; s < r; ++s)
        sum += std::exp(at[s] + static_cast<double>(emission_row(len, s)[candidates[j]]) - best);
      out[j] = static_cast<T>(best + std::log(sum) - z);
    } else {
      out[j] = static_cast<T>(kNegInf);
    }
  }
  return static_cast<T>(z);
}

template <typename T>
void Circuit<T>::sample(const double* uniforms, int64_t* out_tokens) const {
  const int64_t S = s_.sampled_latents(), U = s_.num_uniforms(), r = s_.r;
  if (uniforms == nullptr)
    throw std::invalid_argument("sampling the circuit: uniforms is null; it needs " + std::to_string(U) +
                                " values in [0, 1)");
  for (int64_t j = 0; j < U; ++j)
    if (!(uniforms[j] >= 0.0 && uniforms[j] < 1.0))
      throw std::invalid_argument("sampling the circuit: uniform u[" + std::to_string(j) +
                                  "] = " + str(uniforms[j]) + " is outside [0, 1)");
  std::vector<int64_t> state(s_.num_latents(), 0);
  if (S > 0) {
    state[0] = sample_categorical(weights_, r, uniforms[0], "weights");
    for (int64_t k = 1; k < S; ++k) {
      const T* row = transitions_ + ((k - 1) * r + state[s_.latents[k].parent]) * r;
      state[k] = sample_categorical(row, r, uniforms[k], "a transition row");
    }
  }
  for (int64_t i = 0; i < s_.n; ++i)
    out_tokens[i] = sample_categorical(emission_row(i, state[s_.token_parent[i]]), s_.vocab, uniforms[S + i],
                                       "an emission");
}

template <typename T>
T Circuit<T>::greedy_window(int64_t* out_tokens) const {
  std::vector<double> ext(s_.vocab);
  double best = kNegInf;
  for (int64_t i = 0; i < s_.n; ++i) {
    extension_log_marginals(out_tokens, i, ext.data());
    for (double x : ext)
      if (std::isnan(x)) throw_nan(s_.kind);
    // argmax of q(x_1..x_i, v) is the argmax of the conditional; the lower id on ties.
    const int64_t v = std::max_element(ext.begin(), ext.end()) - ext.begin();
    out_tokens[i] = v;
    best = ext[v];
  }
  return static_cast<T>(best);
}

template <typename T>
int64_t Circuit<T>::beam_windows(int64_t k, int64_t* out_tokens, T* out_log_probs) const {
  if (k < 1)
    throw std::invalid_argument(std::string(circuit_kind_name(s_.kind)) +
                                " circuit: beam width k = " + std::to_string(k) + ", must be >= 1");
  const int64_t n = s_.n, V = s_.vocab;
  struct Candidate {
    double score;
    int64_t beam, token;
  };
  std::vector<std::vector<int64_t>> beams(1);  // prefixes, best first
  std::vector<double> scores(1, 0.0), ext(V);
  std::vector<Candidate> cand;
  for (int64_t i = 0; i < n; ++i) {
    cand.clear();
    for (int64_t b = 0; b < static_cast<int64_t>(beams.size()); ++b) {
      extension_log_marginals(beams[b].data(), i, ext.data());
      for (int64_t v = 0; v < V; ++v) {
        if (std::isnan(ext[v])) throw_nan(s_.kind);
        cand.push_back({ext[v], b, v});
      }
    }
    const int64_t keep = std::min<int64_t>(k, static_cast<int64_t>(cand.size()));
    std::partial_sort(cand.begin(), cand.begin() + keep, cand.end(),
                      [](const Candidate& x, const Candidate& y) {
                        if (x.score != y.score) return x.score > y.score;
                        return x.beam != y.beam ? x.beam < y.beam : x.token < y.token;
                      });
    std::vector<std::vector<int64_t>> next(keep);
    scores.assign(keep, 0.0);
    for (int64_t j = 0; j < keep; ++j) {
      next[j] = beams[cand[j].beam];
      next[j].push_back(cand[j].token);
      scores[j] = cand[j].score;
    }
    beams = std::move(next);
  }
  const int64_t count = static_cast<int64_t>(beams.size());
  for (int64_t j = 0; j < count; ++j) {
    std::copy(beams[j].begin(), beams[j].end(), out_tokens + j * n);
    out_log_probs[j] = static_cast<T>(scores[j]);
  }
  return count;
}

template class Circuit<float>;
template class Circuit<double>;

}  // namespace mtprobe::core
