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

}  // namespace mtprobe::ops
