#include "core/kv_compact.h"

#include <ATen/ATen.h>

#include "ops/ops.h"

namespace mtprobe::ops {

void compact_kv_(at::TensorList caches, const at::Tensor& src, int64_t dst_start) {
  std::vector<int64_t> s = to_int64_vector(src, "src");
  const int64_t n = static_cast<int64_t>(s.size());
  if (caches.empty() || n == 0) return;
  const int64_t seq_len = caches[0].size(2);
  std::string err = core::check_compaction(s.data(), n, dst_start, seq_len);
  TORCH_CHECK(err.empty(), "compact_kv_: ", err);
  at::Tensor src_dev, dst_dev;  // built lazily for non-contiguous or non-CPU caches
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.dim() == 4, "compact_kv_: each cache must be [batch, heads, seq, head_dim], got ",
                c.sizes());
    TORCH_CHECK(c.size(2) == seq_len, "compact_kv_: caches disagree on sequence length (", c.size(2), " vs ",
                seq_len, ")");
    if (c.device().is_cpu() && c.stride(3) == 1 && c.stride(1) == c.size(2) * c.stride(2) &&
        c.stride(0) == c.size(1) * c.stride(1)) {
      // Contiguous over (batch, heads): one memcpy per accepted row per head.
      const int64_t el = c.element_size();
      core::compact_rows(static_cast<char*>(c.data_ptr()), c.size(0) * c.size(1), c.stride(1) * el,
                         c.stride(2) * el, c.size(3) * el, s.data(), n, dst_start);
    } else {
      if (!src_dev.defined()) {
        src_dev = at::tensor(s, at::kLong).to(c.device());
        dst_dev =
            at::arange(dst_start, dst_start + n, at::TensorOptions().dtype(at::kLong).device(c.device()));
      }
      // Gather first: index_copy_ from a view of itself could read rows it already overwrote.
      at::Tensor rows = c.index_select(2, src_dev);
      const_cast<at::Tensor&>(c).index_copy_(2, dst_dev, rows);
    }
  }
}

}  // namespace mtprobe::ops
