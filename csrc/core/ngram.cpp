#include "core/ngram.h"

#include <algorithm>

namespace mtprobe::core {

int64_t prompt_lookup(const int64_t* seq, int64_t len, int64_t max_ngram, int64_t max_tokens, int64_t* out) {
  for (int64_t n = std::min(max_ngram, len - 1); n >= 1; --n) {
    const int64_t* tail = seq + len - n;
    // Occurrences starting at i with i + n < len have at least one token after them.
    for (int64_t i = 0; i + n < len; ++i) {
      if (std::equal(tail, tail + n, seq + i)) {
        const int64_t start = i + n;
        const int64_t count = std::min(max_tokens, len - start);
        std::copy(seq + start, seq + start + count, out);
        return count;
      }
    }
  }
  return 0;
}

}  // namespace mtprobe::core
