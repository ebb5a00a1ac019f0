// KV-cache compaction: move the accepted path's entries into place. Torch-free, C++17.
//
// After a verification forward the cache holds [prefix | whole draft block]. Only the accepted
// path survives: its entries are copied down to sit right after the prefix and the cache is
// cropped by its owner. The cost is O(accepted tokens) rows per head, never O(context).
#pragma once

#include <cstdint>
#include <string>

namespace mtprobe::core {

// Returns "" when src is strictly increasing and src[j] >= dst_start + j for all j (an in-order
// copy then never overwrites a row it still has to read), else a message naming the bad entry.
std::string check_compaction(const int64_t* src, int64_t n, int64_t dst_start, int64_t seq_len);

// One cache tensor viewed as `outer` blocks (batch x heads) of rows (sequence positions).
// Copies row src[j] to row dst_start + j in every block. Strides are in bytes.
void compact_rows(char* base, int64_t outer, int64_t outer_stride, int64_t row_stride, int64_t row_bytes,
                  const int64_t* src, int64_t n, int64_t dst_start);

}  // namespace mtprobe::core
