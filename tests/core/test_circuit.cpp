// Unit tests for exact inference in probabilistic-circuit heads (csrc/core/circuit.h).
//
// Build and run (tests/test_core_cpp.py does exactly this):
//   g++ -std=c++17 -O1 -Wall -Wextra -Werror -I csrc csrc/core/*.cpp tests/core/test_circuit.cpp -o
//   test_circuit
//   ./test_circuit
// Every quantity is checked against brute force on tiny vocabularies and windows: the joint as an
// explicit sum over every assignment of the latent variables (the model's definition, independent
// of the circuit's pass), marginals and conditionals as sums over all V^n windows. The sampler is
// checked by counting windows drawn from fixed-seed uniforms against the exact probabilities (the
// Python tests, tests/test_circuit.py, run a chi-square test on the PyTorch reference's sampler and
// on this sampler through torch.ops.mtprobe.circuit_sample).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/circuit.h"
#include "harness.h"

namespace {

using mtprobe::core::Circuit;
using mtprobe::core::CircuitKind;
using mtprobe::core::CircuitStructure;

constexpr double kTol = 1e-12;
constexpr CircuitKind kKinds[] = {CircuitKind::kFF, CircuitKind::kCP, CircuitKind::kHMM, CircuitKind::kBTree};

bool close(double a, double b, double tol = kTol) {
  if (a == b) return true;  // both -inf
  return std::fabs(a - b) <= tol * (1 + std::fabs(b));
}

CircuitStructure make_structure(CircuitKind kind, int64_t n, int64_t r, int64_t V) {
  switch (kind) {
    case CircuitKind::kFF:
      return CircuitStructure::ff(n, V);
    case CircuitKind::kCP:
      return CircuitStructure::cp(n, r, V);
    case CircuitKind::kHMM:
      return CircuitStructure::hmm(n, r, V);
    case CircuitKind::kBTree:
      break;
  }
  return CircuitStructure::btree(n, r, V);
}

// A structure with its parameters (owned), as log-probabilities.
struct Params {
  CircuitStructure s;
  std::vector<double> weights, transitions, emissions;

  Circuit<double> circuit() const {
    return Circuit<double>(s, weights.data(), static_cast<int64_t>(weights.size()), transitions.data(),
                           static_cast<int64_t>(transitions.size()), emissions.data(),
                           static_cast<int64_t>(emissions.size()));
  }
  // log q(x_i = v | its parent latent in state z), read with the documented layouts directly.
  double e(int64_t i, int64_t z, int64_t v) const {
    if (s.kind == CircuitKind::kCP) return emissions[(z * s.n + i) * s.vocab + v];
    return emissions[(i * s.r + z) * s.vocab + v];
  }
  double t(int64_t k, int64_t a, int64_t b) const { return transitions[((k - 1) * s.r + a) * s.r + b]; }
  double w(int64_t z) const { return s.kind == CircuitKind::kFF ? 0.0 : weights[z]; }
};

// Fills `count` rows of `k` log-probabilities: random positive probabilities, normalised.
void random_rows(std::vector<double>& out, int64_t count, int64_t k, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0.05, 1.0);
  out.assign(count * k, 0.0);
  for (int64_t row = 0; row < count; ++row) {
    double total = 0;
    for (int64_t j = 0; j < k; ++j) total += out[row * k + j] = u(rng);
    for (int64_t j = 0; j < k; ++j) out[row * k + j] = std::log(out[row * k + j] / total);
  }
}

Params random_params(CircuitKind kind, int64_t n, int64_t r, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Params p{make_structure(kind, n, r, V), {}, {}, {}};
  random_rows(p.weights, p.s.weights_size() > 0 ? 1 : 0, p.s.r, rng);
  random_rows(p.transitions, (p.s.num_latents() - 1) * p.s.r * (p.s.transitions_size() > 0), p.s.r, rng);
  random_rows(p.emissions, n * p.s.r, V, rng);
  return p;
}

Params from_probs(CircuitStructure s, std::vector<double> w, std::vector<double> t, std::vector<double> e) {
  for (auto* v : {&w, &t, &e})
    for (double& x : *v) x = std::log(x);
  return Params{std::move(s), std::move(w), std::move(t), std::move(e)};
}

// The model's definition: sum over every latent assignment of root weight x transitions x emissions.
double brute_joint(const Params& p, const std::vector<int64_t>& x) {
  const int64_t L = p.s.num_latents(), r = p.s.r;
  std::vector<int64_t> z(L, 0);
  double total = 0;
  while (true) {
    double logp = p.w(z[0]);
    for (int64_t k = 1; k < L; ++k) logp += p.t(k, z[p.s.latents[k].parent], z[k]);
    for (int64_t i = 0; i < p.s.n; ++i) logp += p.e(i, z[p.s.token_parent[i]], x[i]);
    total += std::exp(logp);
    int64_t k = 0;
    while (k < L && ++z[k] == r) z[k++] = 0;
    if (k == L) break;
  }
  return total;
}

// Every window of n tokens over V, in lexicographic order.
std::vector<std::vector<int64_t>> all_windows(int64_t n, int64_t V) {
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> x(n, 0);
  while (true) {
    out.push_back(x);
    int64_t i = n - 1;
    while (i >= 0 && ++x[i] == V) x[i--] = 0;
    if (i < 0) break;
  }
  return out;
}

// Brute-force q(x_1..x_len) by summing the joint over all completions.
double brute_prefix(const std::vector<std::vector<int64_t>>& windows, const std::vector<double>& joint,
                    const std::vector<int64_t>& x, int64_t len) {
  double total = 0;
  for (size_t w = 0; w < windows.size(); ++w)
    if (std::equal(x.begin(), x.begin() + len, windows[w].begin())) total += joint[w];
  return total;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no exception)";
}

// The worked example of csrc/core/circuit.h.
void test_worked_example() {
  const Params p = from_probs(CircuitStructure::cp(2, 2, 2), {.3, .7}, {}, {.8, .2, .6, .4, .4, .6, .1, .9});
  const Circuit<double> c = p.circuit();
  const double q[2][2] = {{.172, .348}, {.078, .402}};
  for (int64_t a = 0; a < 2; ++a)
    for (int64_t b = 0; b < 2; ++b) {
      const int64_t x[2] = {a, b};
      CHECK(close(c.log_prob(x), std::log(q[a][b])));
    }
  const int64_t x11[2] = {1, 1};
  double m[2], cond[2], next[2];
  c.prefix_log_marginals(x11, m);
  CHECK(close(m[0], std::log(.48)) && close(m[1], std::log(.402)));
  c.conditional_log_probs(x11, cond);
  CHECK(close(cond[0], std::log(.48)) && close(cond[1], std::log(.8375)));
  const int64_t x0[1] = {0};
  CHECK(close(c.next_token_log_probs(x0, 1, next), std::log(.52)));
  CHECK(close(next[0], std::log(.172 / .52)) && close(next[1], std::log(.348 / .52)));
  CHECK(close(c.next_token_log_probs(nullptr, 0, next), 0.0));
  CHECK(close(next[0], std::log(.52)) && close(next[1], std::log(.48)));
  int64_t g[2];
  CHECK(close(c.greedy_window(g), std::log(.348)) && g[0] == 0 && g[1] == 1);
  int64_t beam[4];
  double lp[2];
  CHECK(c.beam_windows(2, beam, lp) == 2);
  CHECK(beam[0] == 1 && beam[1] == 1 && beam[2] == 0 && beam[3] == 1);
  CHECK(close(lp[0], std::log(.402)) && close(lp[1], std::log(.348)));
  CHECK(c.structure().num_uniforms() == 3);
  const double u[3] = {.5, .9, .3};
  int64_t s[2];
  c.sample(u, s);
  CHECK(s[0] == 1 && s[1] == 1);
  const double u2[3] = {.29, .79, .59};  // z = 0 (.29 < .3), x1 = 0 (.79 < .8), x2 = 0 (.59 < .6)
  c.sample(u2, s);
  CHECK(s[0] == 0 && s[1] == 0);
}

void test_hand_ff() {
  // p_1 = [.5 .3 .2], p_2 = [.1 .6 .3]: q(0, 1) = .3, greedy and MAP (0, 1).
  const Params p = from_probs(CircuitStructure::ff(2, 3), {}, {}, {.5, .3, .2, .1, .6, .3});
  const Circuit<double> c = p.circuit();
  const int64_t x[2] = {0, 1}, y[2] = {2, 0};
  CHECK(close(c.log_prob(x), std::log(.3)) && close(c.log_prob(y), std::log(.02)));
  int64_t g[2];
  CHECK(close(c.greedy_window(g), std::log(.3)) && g[0] == 0 && g[1] == 1);
  CHECK(c.structure().num_uniforms() == 2 && c.structure().sampled_latents() == 0);
  const double u[2] = {.85, .05};  // .85 >= .5 + .3: token 2; .05 < .1: token 0
  int64_t s[2];
  c.sample(u, s);
  CHECK(s[0] == 2 && s[1] == 0);
}

void test_hand_hmm() {
  // init [.3 .7], T = [[.9 .1] [.2 .8]], emissions x1: [.8 .2] [.4 .6], x2: [.6 .4] [.1 .9]
  //   q(0,0) = .3*.8*(.9*.6 + .1*.1) + .7*.4*(.2*.6 + .8*.1) = .132 + .056 = .188
  //   q(1,1) = .3*.2*(.9*.4 + .1*.9) + .7*.6*(.2*.4 + .8*.9) = .027 + .336 = .363
  const Params p = from_probs(CircuitStructure::hmm(2, 2, 2), {.3, .7}, {.9, .1, .2, .8},
                              {.8, .2, .4, .6, .6, .4, .1, .9});
  const Circuit<double> c = p.circuit();
  const int64_t x00[2] = {0, 0}, x11[2] = {1, 1};
  CHECK(close(c.log_prob(x00), std::log(.188)) && close(c.log_prob(x11), std::log(.363)));
  double m[2];
  c.prefix_log_marginals(x11, m);
  CHECK(close(m[0], std::log(.48)));  // .3*.2 + .7*.6
  // u = [.5 .95 .7 .5]: z1 = 1, z2 = 1 (.95 >= .2), x1 = 1 (.7 >= .4), x2 = 1 (.5 >= .1)
  const double u[4] = {.5, .95, .7, .5};
  int64_t s[2];
  c.sample(u, s);
  CHECK(s[0] == 1 && s[1] == 1);
  const double u2[4] = {.5, .1, .7, .5};  // z2 = 0 (.1 < .2): x2 from [.6 .4]: .5 < .6 -> 0
  c.sample(u2, s);
  CHECK(s[0] == 1 && s[1] == 0);
}

void test_hand_btree() {
  // n = 3: latent 0 -> x0, latent 1 -> x1, x2.  w [.3 .7], T = [[.9 .1] [.2 .8]],
  // emissions x0: [.8 .2] [.4 .6], x1: [.6 .4] [.1 .9], x2: [.5 .5] [.3 .7]
  //   q(0,0,0) = .3*.8*(.9*.6*.5 + .1*.1*.3) + .7*.4*(.2*.6*.5 + .8*.1*.3) = .06552 + .02352 = .08904
  const Params p = from_probs(CircuitStructure::btree(3, 2, 2), {.3, .7}, {.9, .1, .2, .8},
                              {.8, .2, .4, .6, .6, .4, .1, .9, .5, .5, .3, .7});
  const Circuit<double> c = p.circuit();
  const int64_t x[3] = {0, 0, 0};
  CHECK(close(c.log_prob(x), std::log(.08904)));
  double m[3];
  c.prefix_log_marginals(x, m);
  CHECK(close(m[0], std::log(.52)));  // .3*.8 + .7*.4
  // q(x0=0, x1=0) = .3*.8*(.9*.6 + .1*.1) + .7*.4*(.2*.6 + .8*.1) = .188 (the HMM's q(0,0) above)
  CHECK(close(m[1], std::log(.188)));
}

void test_btree_layout() {
  const auto parents = [](const CircuitStructure& s) {
    std::vector<int64_t> out;
    for (const auto& l : s.latents) out.push_back(l.parent);
    return out;
  };
  const CircuitStructure s1 = CircuitStructure::btree(1, 2, 3);
  CHECK(s1.num_latents() == 1 && s1.token_parent == std::vector<int64_t>{0});
  CHECK(s1.transitions_size() == 0 && s1.num_uniforms() == 2);
  const CircuitStructure s4 = CircuitStructure::btree(4, 2, 3);
  CHECK((parents(s4) == std::vector<int64_t>{-1, 0, 0}));
  CHECK((s4.latents[0].children == std::vector<int64_t>{1, 2}));
  CHECK((s4.latents[1].children == std::vector<int64_t>{-1, -2}));
  CHECK((s4.latents[2].children == std::vector<int64_t>{-3, -4}));
  CHECK((s4.token_parent == std::vector<int64_t>{1, 1, 2, 2}));
  // The header's example, n = 5.
  const CircuitStructure s5 = CircuitStructure::btree(5, 2, 3);
  CHECK((parents(s5) == std::vector<int64_t>{-1, 0, 0, 2}));
  CHECK((s5.token_parent == std::vector<int64_t>{1, 1, 2, 3, 3}));
  CHECK(s5.latents[2].begin == 2 && s5.latents[2].end == 5);
  CHECK((s5.latents[2].children == std::vector<int64_t>{-3, 3}));
  CHECK(s5.transitions_size() == 3 * 2 * 2 && s5.emissions_size() == 5 * 2 * 3);
  const CircuitStructure s8 = CircuitStructure::btree(8, 1, 2);
  CHECK((parents(s8) == std::vector<int64_t>{-1, 0, 0, 1, 1, 2, 2}));
  CHECK((s8.token_parent == std::vector<int64_t>{3, 3, 4, 4, 5, 5, 6, 6}));
  // Every n: n - 1 latents, parents first, children in token order covering the span.
  for (int64_t n = 2; n <= 33; ++n) {
    const CircuitStructure s = CircuitStructure::btree(n, 1, 1);
    CHECK(s.num_latents() == n - 1);
    for (int64_t k = 0; k < s.num_latents(); ++k) {
      const auto& l = s.latents[k];
      CHECK(l.parent < k && l.children.size() == 2);
      int64_t at = l.begin;
      for (int64_t c : l.children) {
        const int64_t b = c < 0 ? -1 - c : s.latents[c].begin, e = c < 0 ? b + 1 : s.latents[c].end;
        CHECK(b == at && (c < 0 || s.latents[c].parent == k));
        at = e;
      }
      CHECK(at == l.end && l.end - l.begin >= 2);
      const int64_t left = l.children[0] < 0 ? 1 : s.latents[l.children[0]].end - l.begin;
      CHECK(left == (l.end - l.begin) / 2);
    }
  }
}

// Normalisation, the joint against the latent sum, prefix marginals, conditionals and next-token
// distributions against sums over all windows.
void check_against_brute_force(const Params& p) {
  const int64_t n = p.s.n, V = p.s.vocab;
  const Circuit<double> c = p.circuit();
  c.check_normalised(1e-12);
  const auto windows = all_windows(n, V);
  std::vector<double> joint;
  double total = 0;
  for (const auto& x : windows) {
    joint.push_back(brute_joint(p, x));
    total += std::exp(c.log_prob(x.data()));
    CHECK(close(c.log_prob(x.data()), std::log(joint.back())));
  }
  CHECK(close(total, 1.0));
  std::vector<double> m(n), cond(n), next(V);
  for (const auto& x : windows) {
    c.prefix_log_marginals(x.data(), m.data());
    c.conditional_log_probs(x.data(), cond.data());
    for (int64_t i = 0; i < n; ++i) {
      const double prefix = brute_prefix(windows, joint, x, i + 1);
      const double before = brute_prefix(windows, joint, x, i);
      CHECK(close(m[i], std::log(prefix)));
      CHECK(close(cond[i], std::log(prefix / before)));
      CHECK(close(c.next_token_log_probs(x.data(), i, next.data()), std::log(before)));
      CHECK(close(next[x[i]], cond[i]));
      std::vector<int64_t> all(V);  // every token as a candidate, in reverse: the same conditionals
      for (int64_t v = 0; v < V; ++v) all[v] = V - 1 - v;
      std::vector<double> some(V);
      CHECK(close(c.candidate_log_probs(x.data(), i, all.data(), V, some.data()), std::log(before)));
      for (int64_t v = 0; v < V; ++v) CHECK(close(some[v], next[V - 1 - v]));
      double s = 0;
      for (double v : next) s += std::exp(v);
      CHECK(close(s, 1.0));
    }
  }
}

// Every kind, n = 1..4, V = 2..3, r = 1..3; and longer windows of HMM and BTree, whose latent trees
// get deeper (from n = 6 on, a BTree has a latent that ends in a latent and has a later sibling).
void test_against_brute_force() {
  uint64_t seed = 1;
  for (CircuitKind kind : kKinds)
    for (int64_t n = 1; n <= 4; ++n)
      for (int64_t V = 2; V <= 3; ++V)
        for (int64_t r = 1; r <= 3; ++r) {
          if (kind == CircuitKind::kFF && r > 1) continue;
          check_against_brute_force(random_params(kind, n, r, V, seed++));
        }
  for (CircuitKind kind : {CircuitKind::kHMM, CircuitKind::kBTree})
    for (int64_t n = 5; n <= 8; ++n) check_against_brute_force(random_params(kind, n, 2, 2, seed++));
}

// HMM (and BTree) with identity transitions equal CP with the same weights and emissions.
void test_identity_transitions_equal_cp() {
  for (int64_t n = 1; n <= 4; ++n) {
    const int64_t r = 3, V = 2;
    const Params cp = random_params(CircuitKind::kCP, n, r, V, 100 + n);
    for (CircuitKind kind : {CircuitKind::kHMM, CircuitKind::kBTree}) {
      Params other{make_structure(kind, n, r, V), cp.weights, {}, std::vector<double>(n * r * V)};
      for (int64_t i = 0; i < n; ++i)
        for (int64_t z = 0; z < r; ++z)
          for (int64_t v = 0; v < V; ++v) other.emissions[(i * r + z) * V + v] = cp.e(i, z, v);
      other.transitions.assign(other.s.transitions_size(), -INFINITY);
      for (int64_t k = 1; k < other.s.num_latents(); ++k)
        for (int64_t z = 0; z < r; ++z) other.transitions[((k - 1) * r + z) * r + z] = 0.0;
      const Circuit<double> a = cp.circuit(), b = other.circuit();
      b.check_normalised(1e-12);
      std::vector<double> ma(n), mb(n), na(V), nb(V);
      for (const auto& x : all_windows(n, V)) {
        a.prefix_log_marginals(x.data(), ma.data());
        b.prefix_log_marginals(x.data(), mb.data());
        for (int64_t i = 0; i < n; ++i) CHECK(close(ma[i], mb[i]));
        for (int64_t len = 0; len < n; ++len) {
          a.next_token_log_probs(x.data(), len, na.data());
          b.next_token_log_probs(x.data(), len, nb.data());
          for (int64_t v = 0; v < V; ++v) CHECK(close(na[v], nb[v]));
        }
      }
    }
  }
}

// Zero-probability entries: -inf log-probabilities, never sampled, -inf for impossible windows.
void test_zero_probabilities() {
  // CP, r = 2: component 0 never emits token 1 at position 0, component 1 never emits token 0 at 1.
  const Params p = from_probs(CircuitStructure::cp(2, 2, 2), {.5, .5}, {}, {1, 0, .5, .5, .5, .5, 1, 0});
  const Circuit<double> c = p.circuit();
  const int64_t x[2] = {1, 1};
  // q(1,1) = .5*0*.5 + .5*.5*0 = 0
  CHECK(c.log_prob(x) == -INFINITY);
  double cond[2], next[2];
  c.conditional_log_probs(x, cond);
  CHECK(close(cond[0], std::log(.25)) && cond[1] == -INFINITY);
  const Params ff = from_probs(CircuitStructure::ff(2, 2), {}, {}, {0, 1, .5, .5});
  const Circuit<double> f = ff.circuit();
  const int64_t y[2] = {0, 0};
  f.conditional_log_probs(y, cond);
  CHECK(cond[0] == -INFINITY && cond[1] == -INFINITY);
  CHECK(f.next_token_log_probs(y, 1, next) == -INFINITY && next[0] == -INFINITY && next[1] == -INFINITY);
  const double u[2] = {0.0, 0.0};  // u = 0 draws the first entry of positive probability
  int64_t s[2];
  f.sample(u, s);
  CHECK(s[0] == 1 && s[1] == 0);
  const double u2[2] = {std::nextafter(1.0, 0.0), std::nextafter(1.0, 0.0)};
  f.sample(u2, s);
  CHECK(s[0] == 1 && s[1] == 1);
  int64_t beam[8];
  double lp[4];
  CHECK(f.beam_windows(4, beam, lp) == 4);
  CHECK(close(lp[0], std::log(.5)) && close(lp[1], std::log(.5)) && lp[2] == -INFINITY);
  CHECK(beam[0] == 1 && beam[1] == 0 && beam[2] == 1 && beam[3] == 1);
}

// Greedy against brute-force conditionals; the beam against the brute-force ranking.
void test_greedy_and_beam() {
  uint64_t seed = 500;
  for (CircuitKind kind : kKinds)
    for (int64_t n = 1; n <= 4; ++n)
      for (int64_t V = 2; V <= 3; ++V) {
        const int64_t r = kind == CircuitKind::kFF ? 1 : 2;
        const Params p = random_params(kind, n, r, V, seed++);
        const Circuit<double> c = p.circuit();
        auto windows = all_windows(n, V);
        std::vector<double> logp;
        for (const auto& x : windows) logp.push_back(c.log_prob(x.data()));
        // Greedy: x_i maximises the brute-force conditional given the greedy prefix.
        std::vector<int64_t> g(n), expect;
        const double g_logp = c.greedy_window(g.data());
        for (int64_t i = 0; i < n; ++i) {
          int64_t best_v = 0;
          double best = -INFINITY;
          for (int64_t v = 0; v < V; ++v) {
            std::vector<int64_t> ext = expect;
            ext.push_back(v);
            double s = 0;
            for (size_t w = 0; w < windows.size(); ++w)
              if (std::equal(ext.begin(), ext.end(), windows[w].begin())) s += std::exp(logp[w]);
            if (s > best) best = s, best_v = v;
          }
          expect.push_back(best_v);
        }
        CHECK(g == expect);
        CHECK(close(g_logp, c.log_prob(g.data())));
        // k = 1 is greedy.
        std::vector<int64_t> b1(n);
        double lp1;
        CHECK(c.beam_windows(1, b1.data(), &lp1) == 1 && b1 == g && close(lp1, g_logp));
        // The brute-force ranking: log-probability descending, then lexicographic.
        std::vector<size_t> order(windows.size());
        for (size_t w = 0; w < order.size(); ++w) order[w] = w;
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return logp[a] > logp[b]; });
        const int64_t all = static_cast<int64_t>(windows.size());
        for (int64_t k : {int64_t{2}, int64_t{3}, all, all + 5}) {
          std::vector<int64_t> toks(k * n);
          std::vector<double> lps(k);
          const int64_t got = c.beam_windows(k, toks.data(), lps.data());
          CHECK(got == std::min(k, all));
          for (int64_t j = 0; j < got; ++j) {
            const std::vector<int64_t> x(toks.begin() + j * n, toks.begin() + (j + 1) * n);
            CHECK(close(lps[j], c.log_prob(x.data())));  // exact
            if (j > 0) CHECK(lps[j] <= lps[j - 1]);      // sorted
            for (int64_t i = 0; i < j; ++i)              // distinct
              CHECK(!std::equal(x.begin(), x.end(), toks.begin() + i * n));
            // Exact top-k for FF and for a beam as wide as the enumeration.
            if (kind == CircuitKind::kFF || k >= all) CHECK(close(lps[j], logp[order[j]]));
          }
        }
      }
}

// Frequencies of windows drawn from fixed-seed uniforms against the exact probabilities: every
// window's count within 5 standard deviations, and Pearson's statistic below a bound that a
// correct sampler exceeds with probability < 1e-6 (27 cells at most; a chi-square with 26
// degrees of freedom exceeds 80 with probability ~1e-7).
void test_sampling_frequencies() {
  uint64_t seed = 900;
  for (CircuitKind kind : kKinds) {
    const int64_t n = 3, V = 3, r = kind == CircuitKind::kFF ? 1 : 3;
    const Params p = random_params(kind, n, r, V, seed++);
    const Circuit<double> c = p.circuit();
    const auto windows = all_windows(n, V);
    std::vector<double> prob;
    for (const auto& x : windows) prob.push_back(std::exp(c.log_prob(x.data())));
    const int64_t N = 60000, U = c.structure().num_uniforms();
    std::mt19937_64 rng(seed * 7919);
    std::uniform_real_distribution<double> unif(0.0, 1.0);
    std::vector<double> u(U);
    std::vector<int64_t> s(n), counts(windows.size(), 0);
    for (int64_t t = 0; t < N; ++t) {
      for (double& x : u) x = unif(rng);
      c.sample(u.data(), s.data());
      int64_t idx = 0;
      for (int64_t i = 0; i < n; ++i) idx = idx * V + s[i];
      ++counts[idx];
    }
    double chi2 = 0;
    for (size_t w = 0; w < windows.size(); ++w) {
      const double expect = N * prob[w], sd = std::sqrt(N * prob[w] * (1 - prob[w]));
      CHECK(std::fabs(counts[w] - expect) <= 5 * sd + 1);
      chi2 += (counts[w] - expect) * (counts[w] - expect) / expect;
    }
    CHECK(chi2 < 80.0);
  }
  // Power: the same count rejects the sampler that ignores the shared latent (independent
  // positions drawn from their marginals) on a CP whose components disagree strongly.
  const Params p = from_probs(CircuitStructure::cp(2, 2, 2), {.5, .5}, {}, {.9, .1, .9, .1, .1, .9, .1, .9});
  const Circuit<double> c = p.circuit();
  const double q[4] = {.41, .09, .09, .41};  // .5*.81 + .5*.01, ...
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  int64_t right[4] = {0, 0, 0, 0}, wrong[4] = {0, 0, 0, 0};
  const int64_t N = 60000;
  for (int64_t t = 0; t < N; ++t) {
    const double u[3] = {unif(rng), unif(rng), unif(rng)};
    int64_t s[2];
    c.sample(u, s);
    ++right[s[0] * 2 + s[1]];
    ++wrong[(u[1] >= .5) * 2 + (u[2] >= .5)];  // each position's marginal is [.5 .5]
  }
  double chi_right = 0, chi_wrong = 0;
  for (int64_t w = 0; w < 4; ++w) {
    chi_right += (right[w] - N * q[w]) * (right[w] - N * q[w]) / (N * q[w]);
    chi_wrong += (wrong[w] - N * q[w]) * (wrong[w] - N * q[w]) / (N * q[w]);
  }
  CHECK(chi_right < 80.0 && chi_wrong > 80.0);
}

// Float buffers give the double results to float precision.
void test_float() {
  const Params p = random_params(CircuitKind::kBTree, 4, 3, 3, 77);
  std::vector<float> w(p.weights.begin(), p.weights.end()), t(p.transitions.begin(), p.transitions.end()),
      e(p.emissions.begin(), p.emissions.end());
  const Circuit<float> cf(p.s, w.data(), static_cast<int64_t>(w.size()), t.data(),
                          static_cast<int64_t>(t.size()), e.data(), static_cast<int64_t>(e.size()));
  const Circuit<double> cd = p.circuit();
  cf.check_normalised(1e-5);
  for (const auto& x : all_windows(4, 3)) CHECK(close(cf.log_prob(x.data()), cd.log_prob(x.data()), 1e-5));
  float next[3];
  const int64_t prefix[2] = {2, 1};
  cf.next_token_log_probs(prefix, 2, next);
  double nd[3];
  cd.next_token_log_probs(prefix, 2, nd);
  for (int64_t v = 0; v < 3; ++v) CHECK(close(next[v], nd[v], 1e-5));
}

void test_bad_input() {
  CHECK_CONTAINS(message_of([] { CircuitStructure::cp(0, 2, 3); }), "window n = 0, must be >= 1");
  CHECK_CONTAINS(message_of([] { CircuitStructure::hmm(2, 0, 3); }), "latent states r = 0, must be >= 1");
  CHECK_CONTAINS(message_of([] { CircuitStructure::btree(2, 2, 0); }), "vocabulary V = 0, must be >= 1");
  CHECK_CONTAINS(message_of([] { CircuitStructure::ff(-1, 3); }), "FF circuit: window n = -1");
  CHECK_CONTAINS(message_of([] { CircuitStructure::cp(1 << 20, 1 << 20, 1 << 30); }), "overflows int64");

  const Params p = random_params(CircuitKind::kHMM, 3, 2, 4, 5);
  CHECK_CONTAINS(message_of([&] {
                   Circuit<double>(p.s, p.weights.data(), 2, p.transitions.data(), 7, p.emissions.data(), 24);
                 }),
                 "HMM circuit: transitions holds 7 values; [L - 1, r, r] needs 8");
  CHECK_CONTAINS(
      message_of([&] { Circuit<double>(p.s, nullptr, 2, p.transitions.data(), 8, p.emissions.data(), 24); }),
      "weights holds 0 values; [r] needs 2");
  CHECK_CONTAINS(message_of([&] {
                   Circuit<double>(CircuitStructure::cp(3, 2, 4), p.weights.data(), 2, p.transitions.data(),
                                   8, p.emissions.data(), 24);
                 }),
                 "CP circuit: transitions holds 8 values");
  const Circuit<double> c = p.circuit();
  const int64_t bad[3] = {0, 4, 1};
  double out[4];
  CHECK_CONTAINS(message_of([&] { c.log_prob(bad); }),
                 "token 4 at window position 1 is outside the vocabulary [0, 4)");
  CHECK_CONTAINS(message_of([&] { c.prefix_log_marginals(bad, out); }), "token 4");
  CHECK_CONTAINS(message_of([&] { c.next_token_log_probs(bad, 2, out); }), "token 4 at prefix position 1");
  CHECK_CONTAINS(message_of([&] { c.next_token_log_probs(bad, 3, out); }),
                 "prefix length 3 is outside [0, n) = [0, 3)");
  CHECK_CONTAINS(message_of([&] { c.next_token_log_probs(bad, -1, out); }), "prefix length -1");
  int64_t s[3], b[3];
  const double u[6] = {.1, .2, .3, 1.0, .5, .5};
  CHECK_CONTAINS(message_of([&] { c.sample(u, s); }), "uniform u[3] = 1 is outside [0, 1)");
  const double un[6] = {.1, -0.25, .3, .3, .5, .5};
  CHECK_CONTAINS(message_of([&] { c.sample(un, s); }), "uniform u[1] = -0.25 is outside [0, 1)");
  CHECK_CONTAINS(message_of([&] { c.sample(nullptr, s); }), "needs 6 values in [0, 1)");
  CHECK_CONTAINS(message_of([&] { c.beam_windows(0, b, out); }), "beam width k = 0, must be >= 1");

  Params off = p;
  off.emissions[5] = std::log(0.9);  // emissions[0][1] ([i][z]) now sums to more than 1
  CHECK_CONTAINS(message_of([&] { off.circuit().check_normalised(1e-6); }),
                 "HMM circuit: emissions[0][1] sums to");
  off = p;
  off.transitions[2] = NAN;
  CHECK_CONTAINS(message_of([&] { off.circuit().check_normalised(1e-6); }),
                 "transitions[0][1][0] is nan; log-probabilities must be finite or -inf");
  off = p;
  off.weights[0] = -INFINITY;
  CHECK_CONTAINS(message_of([&] { off.circuit().check_normalised(1e-6); }), "weights sums to");
  off.transitions[2] = NAN;
  CHECK_CONTAINS(message_of([&] { off.circuit().greedy_window(b); }), "log-probability is NaN");
  const Params cp = random_params(CircuitKind::kCP, 2, 2, 3, 6);
  Params zero = cp;
  zero.weights = {-INFINITY, -INFINITY};
  const double u3[3] = {.5, .5, .5};
  CHECK_CONTAINS(message_of([&] { zero.circuit().sample(u3, s); }),
                 "weights has no entry of positive probability");
  // Sanity: valid parameters pass.
  CHECK_CONTAINS(message_of([&] { c.check_normalised(1e-12); }), "(no exception)");
}

}  // namespace

int main() {
  const mtprobe_test::Test tests[] = {
      {"worked_example", test_worked_example},
      {"hand_ff", test_hand_ff},
      {"hand_hmm", test_hand_hmm},
      {"hand_btree", test_hand_btree},
      {"btree_layout", test_btree_layout},
      {"against_brute_force", test_against_brute_force},
      {"identity_transitions_equal_cp", test_identity_transitions_equal_cp},
      {"zero_probabilities", test_zero_probabilities},
      {"greedy_and_beam", test_greedy_and_beam},
      {"sampling_frequencies", test_sampling_frequencies},
      {"float", test_float},
      {"bad_input", test_bad_input},
  };
  return mtprobe_test::run_tests(tests);
}
