#include "core/verify.h"

namespace mtprobe::core {

int64_t verify_greedy(const int64_t* tokens, const int64_t* parents, const int64_t* target, int64_t n,
                      int64_t root, int64_t* path_out) {
  int64_t len = 0;
  int64_t cur = root;
  path_out[len++] = cur;
  while (true) {
    int64_t next = -1;
    // Children have larger indices than their parent: scan only the tail.
    for (int64_t c = cur + 1; c < n; ++c) {
      if (parents[c] == cur && tokens[c] == target[cur]) {
        next = c;
        break;
      }
    }
    if (next < 0) return len;
    path_out[len++] = next;
    cur = next;
  }
}

}  // namespace mtprobe::core
