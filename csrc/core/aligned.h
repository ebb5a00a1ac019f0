// Buffers aligned to a cache line (64 bytes). Torch-free, C++17.
//
// Why: the linear kernels load 64 bytes of an input row at a time (AVX-512). A std::vector<float> is only
// 16-byte aligned, so every such load straddled two cache lines: the C++ forward's AVX-512 kernel ran far
// slower than its AVX2 form until its buffers were aligned (rows of a multiple of 16 floats stay aligned
// row after row).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

namespace mtprobe::core {

template <typename T>
struct CacheAligned {
  using value_type = T;
  static constexpr std::size_t kAlign = 64;

  CacheAligned() = default;
  template <typename U>
  constexpr CacheAligned(const CacheAligned<U>&) noexcept {}

  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    void* p = std::aligned_alloc(kAlign, bytes == 0 ? kAlign : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }

  template <typename U>
  bool operator==(const CacheAligned<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const CacheAligned<U>&) const noexcept {
    return false;
  }
};

// A float buffer whose first element starts a cache line.
using AlignedFloats = std::vector<float, CacheAligned<float>>;

}  // namespace mtprobe::core
