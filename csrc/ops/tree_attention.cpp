// Tree attention with the tree given compactly (one bit per (node, node) pair instead of a dense
// [T, P + T] float mask): the CPU kernels. CUDA: csrc/ops/tree_attention_cuda.cu.
#include <ATen/ATen.h>

#include "core/tree.h"
#include "ops/ops.h"

namespace mtprobe::ops {

at::Tensor tree_ancestor_bits(const at::Tensor& parents) {
  std::vector<int64_t> par = to_int64_vector(parents, "parents");
  check_parents_or_throw(par);
  const int64_t n = static_cast<int64_t>(par.size());
  at::Tensor bits = at::empty({n, core::ancestor_words(n)}, at::TensorOptions().dtype(at::kLong));  // [T, W]
  core::ancestor_bits(par.data(), n, reinterpret_cast<uint64_t*>(bits.data_ptr<int64_t>()));
  return bits.to(parents.device());
}

void check_tree_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& bits) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "tree_attention: q, k, v must be [batch, heads, len, head_dim], got ", q.sizes(), ", ",
                    k.sizes(), ", ", v.sizes());
  TORCH_CHECK_VALUE(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3),
                    "tree_attention: k and v must be [batch, kv_heads, P + T, head_dim] matching q ",
                    q.sizes(), ", got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, "tree_attention: ", k.size(1),
                    " kv heads do not divide ", q.size(1), " query heads");
  const int64_t T = q.size(2);
  TORCH_CHECK_VALUE(k.size(2) >= T, "tree_attention: ", k.size(2), " keys cannot hold the ", T,
                    " tree inputs");
  TORCH_CHECK_VALUE(bits.dim() == 2 && bits.size(0) == T && bits.size(1) == core::ancestor_words(T) &&
                        bits.scalar_type() == at::kLong,
                    "tree_attention: ancestor_bits must be int64 [T, ceil(T / 64)] = [", T, ", ",
                    core::ancestor_words(T), "] (torch.ops.mtprobe.tree_ancestor_bits), got ",
                    bits.scalar_type(), " ", bits.sizes());
}

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& bits, double scale) {
  check_tree_attention_args(q, k, v, bits);
  const int64_t T = q.size(2), P = k.size(2) - T;
  // Unpack the bits into the boolean pattern SDPA takes: on a CPU the dense mask costs nothing
  // next to the matmuls; the CUDA kernel reads the bits directly.
  at::Tensor b = bits.to(at::kCPU).contiguous();
  at::Tensor allowed = at::ones({T, P + T}, at::TensorOptions().dtype(at::kBool));  // [T, P + T]
  const int64_t words = b.size(1);
  const uint64_t* w = reinterpret_cast<const uint64_t*>(b.data_ptr<int64_t>());
  bool* a = allowed.data_ptr<bool>();
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t j = 0; j < T; ++j) a[i * (P + T) + P + j] = (w[i * words + j / 64] >> (j % 64)) & 1;
  }
  const int64_t group = q.size(1) / k.size(1);
  at::Tensor kk = group == 1 ? k : k.repeat_interleave(group, 1);  // [B, H, P + T, D]
  at::Tensor vv = group == 1 ? v : v.repeat_interleave(group, 1);
  return at::scaled_dot_product_attention(q, kk, vv, allowed.to(q.device()), 0.0, false, scale);
}

}  // namespace mtprobe::ops
