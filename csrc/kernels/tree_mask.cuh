// Tree attention mask and position ids on the device: the CUDA twin of csrc/core/tree.h.
// Torch-free: raw pointers and a stream; csrc/ops/tree_mask_cuda.cu is the ATen launcher.
//
// For a block of T inputs after P cached positions, with parents[T] (-1 for a root):
//   mask[i, j]       = 0 for j < P (every input sees the whole prefix)
//   mask[i, P + a]   = 0 if a is i or one of its ancestors, else `masked` (the dtype's lowest)
//   position_ids[i]  = P + depth(i)
// Each thread walks one node's parent chain: O(depth) per element, and depth <= T <= BC (tens).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mtprobe::kernels {

template <typename T>
__global__ void tree_attention_mask_kernel(const int64_t* __restrict__ parents, int64_t num_nodes,
                                           int64_t prefix_len, T zero, T masked, T* __restrict__ mask) {
  const int64_t width = prefix_len + num_nodes;
  const int64_t row = blockIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= num_nodes || col >= width) return;
  bool seen = col < prefix_len;
  if (!seen) {
    const int64_t target = col - prefix_len;
    for (int64_t v = row; v >= 0 && !seen; v = parents[v]) seen = v == target;
  }
  mask[row * width + col] = seen ? zero : masked;
}

__global__ inline void tree_position_ids_kernel(const int64_t* __restrict__ parents, int64_t num_nodes,
                                                int64_t prefix_len, int64_t* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_nodes) return;
  int64_t depth = 0;
  for (int64_t v = parents[i]; v >= 0; v = parents[v]) ++depth;
  out[i] = prefix_len + depth;
}

// The compact pattern of csrc/core/tree.h (ancestor_bits): bits[i, a / 64] has bit a % 64 set when
// a is i or an ancestor of i. One thread per node walks its chain.
__global__ inline void tree_ancestor_bits_kernel(const int64_t* __restrict__ parents, int64_t num_nodes,
                                                 uint64_t* __restrict__ bits) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_nodes) return;
  const int64_t words = (num_nodes + 63) / 64;
  uint64_t* row = bits + i * words;
  for (int64_t w = 0; w < words; ++w) row[w] = 0;
  for (int64_t v = i; v >= 0; v = parents[v]) row[v / 64] |= 1ull << (v % 64);
}

inline cudaError_t tree_ancestor_bits(const int64_t* parents, int64_t num_nodes, uint64_t* bits,
                                      cudaStream_t stream) {
  if (num_nodes == 0) return cudaSuccess;
  constexpr int kThreads = 128;
  tree_ancestor_bits_kernel<<<static_cast<unsigned>((num_nodes + kThreads - 1) / kThreads), kThreads, 0,
                              stream>>>(parents, num_nodes, bits);
  return cudaGetLastError();
}

// mask: [num_nodes, prefix_len + num_nodes], row-major. parents must be a valid forest (checked
// by the caller: parents[i] < i).
template <typename T>
inline cudaError_t tree_attention_mask(const int64_t* parents, int64_t num_nodes, int64_t prefix_len, T zero,
                                       T masked, T* mask, cudaStream_t stream) {
  if (num_nodes == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t width = prefix_len + num_nodes;
  dim3 grid(static_cast<unsigned>((width + kThreads - 1) / kThreads), static_cast<unsigned>(num_nodes));
  tree_attention_mask_kernel<T>
      <<<grid, kThreads, 0, stream>>>(parents, num_nodes, prefix_len, zero, masked, mask);
  return cudaGetLastError();
}

inline cudaError_t tree_position_ids(const int64_t* parents, int64_t num_nodes, int64_t prefix_len,
                                     int64_t* out, cudaStream_t stream) {
  if (num_nodes == 0) return cudaSuccess;
  constexpr int kThreads = 128;
  const unsigned blocks = static_cast<unsigned>((num_nodes + kThreads - 1) / kThreads);
  tree_position_ids_kernel<<<blocks, kThreads, 0, stream>>>(parents, num_nodes, prefix_len, out);
  return cudaGetLastError();
}

}  // namespace mtprobe::kernels
