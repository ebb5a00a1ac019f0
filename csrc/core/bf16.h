// bfloat16 as torch stores it (the upper 16 bits of a float32), widened and rounded without torch.
// Torch-free, C++17.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mtprobe::core {

// The float32 a bfloat16 holds (exact: its bits become the float's upper half).
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The nearest bfloat16, ties to even, NaN kept a NaN: what torch's float32 -> bfloat16 conversion gives.
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace mtprobe::core
