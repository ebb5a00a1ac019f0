#include "drafters/plain.h"

namespace mtprobe {

DraftBlock PlainDrafter::propose(const at::Tensor& committed, int64_t prefix_len, const StepLimits& limits) {
  (void)prefix_len;
  (void)limits;
  return token_block(committed, {}, {});  // the committed chain alone
}

}  // namespace mtprobe
