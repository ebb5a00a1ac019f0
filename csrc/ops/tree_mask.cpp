#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <limits>

#include "core/tree.h"
#include "ops/ops.h"

namespace mtprobe::ops {

std::vector<int64_t> to_int64_vector(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 1, what, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, what,
              " must be int32 or int64, got ", t.scalar_type());
  at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

void check_parents_or_throw(const std::vector<int64_t>& parents) {
  std::string err = core::check_parents(parents.data(), static_cast<int64_t>(parents.size()));
  TORCH_CHECK(err.empty(), "invalid draft tree: ", err);
}

namespace {

template <typename T>
void fill_typed(const std::vector<uint8_t>& anc, int64_t n, int64_t prefix, at::Tensor& out) {
  // Half types are written through their bit patterns so the core stays torch-free.
  using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, T>;
  T zero_v = static_cast<T>(0.0f);
  T neg_v = std::numeric_limits<T>::lowest();
  Bits zero, neg;
  std::memcpy(&zero, &zero_v, sizeof(T));
  std::memcpy(&neg, &neg_v, sizeof(T));
  core::fill_tree_mask<Bits>(anc.data(), n, prefix, out.stride(-2), zero, neg,
                             reinterpret_cast<Bits*>(out.data_ptr<T>()));
}

}  // namespace

void fill_mask_rows(const std::vector<uint8_t>& anc, int64_t T, int64_t prefix_len, at::Tensor& out) {
  TORCH_CHECK(out.device().is_cpu(), "fill_mask_rows writes host memory");
  TORCH_CHECK(out.stride(-1) == 1, "mask rows must be contiguous");
  switch (out.scalar_type()) {
    case at::kFloat:
      fill_typed<float>(anc, T, prefix_len, out);
      break;
    case at::kDouble:
      fill_typed<double>(anc, T, prefix_len, out);
      break;
    case at::kHalf:
      fill_typed<c10::Half>(anc, T, prefix_len, out);
      break;
    case at::kBFloat16:
      fill_typed<c10::BFloat16>(anc, T, prefix_len, out);
      break;
    default:
      TORCH_CHECK(false, "tree mask dtype must be float32, float64, float16 or bfloat16, got ",
                  out.scalar_type());
  }
}

at::Tensor tree_attention_mask(const at::Tensor& parents, int64_t prefix_len, at::ScalarType dtype) {
  TORCH_CHECK(prefix_len >= 0, "prefix_len must be >= 0, got ", prefix_len);
  std::vector<int64_t> par = to_int64_vector(parents, "parents");
  check_parents_or_throw(par);
  const int64_t T = static_cast<int64_t>(par.size());
  std::vector<uint8_t> anc(static_cast<size_t>(T * T));
  core::ancestor_matrix(par.data(), T, anc.data());
  at::Tensor out =
      at::empty({1, 1, T, prefix_len + T}, at::TensorOptions().dtype(dtype));  // [1, 1, T, P + T]
  fill_mask_rows(anc, T, prefix_len, out);
  return out.to(parents.device());
}

at::Tensor tree_position_ids(const at::Tensor& parents, int64_t prefix_len) {
  TORCH_CHECK(prefix_len >= 0, "prefix_len must be >= 0, got ", prefix_len);
  std::vector<int64_t> par = to_int64_vector(parents, "parents");
  check_parents_or_throw(par);
  const int64_t T = static_cast<int64_t>(par.size());
  at::Tensor pos = at::empty({1, T}, at::TensorOptions().dtype(at::kLong));  // [1, T]
  int64_t* p = pos.data_ptr<int64_t>();
  core::tree_depths(par.data(), T, p);
  for (int64_t i = 0; i < T; ++i) p[i] += prefix_len;
  return pos.to(parents.device());
}

}  // namespace mtprobe::ops
