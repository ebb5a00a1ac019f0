#include "core/verify.h"

#include <ATen/ATen.h>

#include "ops/ops.h"

namespace mtprobe::ops {

at::Tensor verify_greedy(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& target,
                         int64_t root) {
  std::vector<int64_t> tok = to_int64_vector(tokens, "tokens");
  std::vector<int64_t> par = to_int64_vector(parents, "parents");
  std::vector<int64_t> tgt = to_int64_vector(target, "target");
  const int64_t n = static_cast<int64_t>(tok.size());
  TORCH_CHECK(static_cast<int64_t>(par.size()) == n && static_cast<int64_t>(tgt.size()) == n,
              "tokens, parents and target must have the same length, got ", n, ", ", par.size(), " and ",
              tgt.size());
  TORCH_CHECK(root >= 0 && root < n, "root = ", root, " is not a node index in [0, ", n, ")");
  check_parents_or_throw(par);
  std::vector<int64_t> path(static_cast<size_t>(n));
  int64_t len = core::verify_greedy(tok.data(), par.data(), tgt.data(), n, root, path.data());
  return at::tensor(std::vector<int64_t>(path.begin(), path.begin() + len), at::kLong).to(tokens.device());
}

void check_verify_rejection_args(const std::vector<int64_t>& tok, const std::vector<int64_t>& par,
                                 const at::Tensor& p, const at::Tensor& q, const at::Tensor& uniforms) {
  const int64_t n = static_cast<int64_t>(tok.size());
  TORCH_CHECK(n >= 1 && static_cast<int64_t>(par.size()) == n,
              "tokens and parents must have the same length >= 1, got ", n, " and ", par.size());
  check_parents_or_throw(par);
  TORCH_CHECK(par[0] == -1, "node 0 must be the root (parents[0] = -1), got parents[0] = ", par[0]);
  for (int64_t j = 1; j < n; ++j) {
    TORCH_CHECK(par[j] >= 0, "node ", j,
                " is a second root; verify_rejection needs one tree rooted at node 0");
  }
  TORCH_CHECK(p.dim() == 2 && p.size(0) == n, "p must be [n, vocab] = [", n, ", vocab], got ", p.sizes());
  const int64_t vocab = p.size(1);
  TORCH_CHECK(q.dim() == 2 && q.size(0) == n - 1 && q.size(1) == vocab, "q must be [n - 1, vocab] = [", n - 1,
              ", ", vocab, "], got ", q.sizes());
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == n + 1, "uniforms must be [n + 1] = [", n + 1,
              "], got ", uniforms.sizes());
  // A NaN probability compares false with everything: the walk would accept or reject at random
  // and the residual would not normalise. One reduction each, read back once.
  auto probabilities = [](const at::Tensor& t) { return (at::isfinite(t) & (t >= 0)).all(); };
  at::Tensor ok = at::stack({probabilities(p), probabilities(q)}).to(at::kCPU);
  TORCH_CHECK_VALUE(ok[0].item<bool>(),
                    "p holds a NaN, inf or negative entry; verify_rejection needs the target's "
                    "probabilities: finite and >= 0 (a softmax of finite scores)");
  TORCH_CHECK_VALUE(ok[1].item<bool>(),
                    "q holds a NaN, inf or negative entry; verify_rejection needs the drafter's "
                    "probabilities: finite and >= 0");
  if (n > 1) {
    // q[j - 1, x_j] > 0: read back n - 1 values, not the whole q.
    at::Tensor drafted = at::tensor(std::vector<int64_t>(tok.begin() + 1, tok.end()), at::kLong);
    for (int64_t j = 1; j < n; ++j) {
      TORCH_CHECK(tok[j] >= 0 && tok[j] < vocab, "token ", tok[j], " of node ", j,
                  " is outside the vocabulary [0, ", vocab, ")");
    }
    at::Tensor qx =
        q.gather(1, drafted.to(q.device()).unsqueeze(1)).squeeze(1).to(at::kCPU, at::kFloat).contiguous();
    const float* qxp = qx.data_ptr<float>();  // [n - 1]
    for (int64_t j = 1; j < n; ++j) {
      TORCH_CHECK(qxp[j - 1] > 0, "node ", j, " drafted token ", tok[j],
                  " with probability 0 under its own q row; draft tokens must be drawn from q");
    }
  }
}

std::tuple<at::Tensor, at::Tensor> verify_rejection(const at::Tensor& tokens, const at::Tensor& parents,
                                                    const at::Tensor& p, const at::Tensor& q,
                                                    const at::Tensor& uniforms) {
  std::vector<int64_t> tok = to_int64_vector(tokens, "tokens");
  std::vector<int64_t> par = to_int64_vector(parents, "parents");
  check_verify_rejection_args(tok, par, p, q, uniforms);
  const int64_t n = static_cast<int64_t>(tok.size()), vocab = p.size(1);
  at::Tensor pc = p.to(at::kCPU, at::kFloat).contiguous();
  at::Tensor qc = q.to(at::kCPU, at::kFloat).contiguous();
  at::Tensor uc = uniforms.to(at::kCPU, at::kDouble).contiguous();
  const float* qp = qc.data_ptr<float>();
  std::vector<float> residual(static_cast<size_t>(vocab));
  std::vector<int64_t> path(static_cast<size_t>(n));
  int64_t token = -1;
  const int64_t len = core::verify_rejection(tok.data(), par.data(), n, pc.data_ptr<float>(), qp, vocab,
                                             uc.data_ptr<double>(), residual.data(), path.data(), &token);
  at::Tensor path_t =
      at::tensor(std::vector<int64_t>(path.begin(), path.begin() + len), at::kLong).to(tokens.device());
  return {path_t, at::scalar_tensor(token, at::kLong).to(tokens.device())};
}

}  // namespace mtprobe::ops
