// KV-cache compaction on the device: the CUDA twin of csrc/core/kv_compact.h. Torch-free.
//
// For every (batch, head) slice of a [batch, heads, seq, head_dim] cache, row src[j] moves to
// row dst_start + j, j = 0..n-1, in place. src is increasing and dst_start + j <= src[j], so in
// order of j no row is overwritten before it is read: one block per slice copies the rows in that
// order (a __syncthreads() between rows), its threads sharing each row's elements.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mtprobe::kernels {

// Word: an unsigned type of the element's size (the copy never interprets values).
template <typename Word>
__global__ void compact_kv_kernel(Word* __restrict__ cache, int64_t num_slices, int64_t heads,
                                  int64_t stride_batch, int64_t stride_head, int64_t stride_seq,
                                  int64_t head_dim, const int64_t* __restrict__ src, int64_t n,
                                  int64_t dst_start) {
  const int64_t slice = blockIdx.x;
  if (slice >= num_slices) return;
  Word* base = cache + (slice / heads) * stride_batch + (slice % heads) * stride_head;
  for (int64_t j = 0; j < n; ++j) {
    const Word* from = base + src[j] * stride_seq;
    Word* to = base + (dst_start + j) * stride_seq;
    if (from != to) {
      for (int64_t e = threadIdx.x; e < head_dim; e += blockDim.x) to[e] = from[e];
    }
    __syncthreads();  // row j is written before row j + 1 may overwrite what it read
  }
}

// Element strides; the last dimension must be contiguous. src: n device indices, checked by the
// caller (increasing, dst_start + j <= src[j] < seq).
template <typename Word>
inline cudaError_t compact_kv(Word* cache, int64_t batch, int64_t heads, int64_t stride_batch,
                              int64_t stride_head, int64_t stride_seq, int64_t head_dim, const int64_t* src,
                              int64_t n, int64_t dst_start, cudaStream_t stream) {
  if (n == 0 || batch * heads == 0) return cudaSuccess;
  const int threads = head_dim >= 128 ? 128 : 64;
  compact_kv_kernel<Word><<<static_cast<unsigned>(batch * heads), threads, 0, stream>>>(
      cache, batch * heads, heads, stride_batch, stride_head, stride_seq, head_dim, src, n, dst_start);
  return cudaGetLastError();
}

}  // namespace mtprobe::kernels
