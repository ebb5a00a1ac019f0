#include "core/kv_compact.h"

#include <cstring>

namespace mtprobe::core {

std::string check_compaction(const int64_t* src, int64_t n, int64_t dst_start, int64_t seq_len) {
  if (dst_start < 0) return "dst_start = " + std::to_string(dst_start) + " must be >= 0";
  for (int64_t j = 0; j < n; ++j) {
    if (src[j] >= seq_len) {
      return "src[" + std::to_string(j) + "] = " + std::to_string(src[j]) + " is past the cache length " +
             std::to_string(seq_len);
    }
    if (src[j] < dst_start + j) {
      return "src[" + std::to_string(j) + "] = " + std::to_string(src[j]) + " is below its destination " +
             std::to_string(dst_start + j) + "; sources must satisfy src[j] >= dst_start + j";
    }
    if (j > 0 && src[j] <= src[j - 1]) {
      return "src must be strictly increasing, but src[" + std::to_string(j) +
             "] = " + std::to_string(src[j]) + " follows " + std::to_string(src[j - 1]);
    }
  }
  return "";
}

void compact_rows(char* base, int64_t outer, int64_t outer_stride, int64_t row_stride, int64_t row_bytes,
                  const int64_t* src, int64_t n, int64_t dst_start) {
  for (int64_t j = 0; j < n; ++j) {
    if (src[j] == dst_start + j) continue;  // already in place (e.g. the root)
    for (int64_t b = 0; b < outer; ++b) {
      char* block = base + b * outer_stride;
      std::memcpy(block + (dst_start + j) * row_stride, block + src[j] * row_stride,
                  static_cast<size_t>(row_bytes));
    }
  }
}

}  // namespace mtprobe::core
