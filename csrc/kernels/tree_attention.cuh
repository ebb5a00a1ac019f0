// Tree attention on the device with the tree given as ancestor bits (csrc/core/tree.h:
// ancestor_bits), not as a dense [T, P + T] float mask. Torch-free: raw pointers and a stream;
// csrc/ops/tree_attention_cuda.cu is the ATen launcher. First version: correct and simple, not
// tuned (one block per (batch, head, query); scores in shared memory; no tensor cores).
//
// For query i of head h (kv head h / (H / Hkv)):
//   key j < P            : attended (the cached prefix)
//   key P + a, a < T     : attended iff bit a of row i is set (a is i or an ancestor of i)
//   out[i] = softmax_j(scale * q_i . k_j) v_j over the attended keys, accumulated in float32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mtprobe::kernels {

template <typename T>
__global__ void tree_attention_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                      const T* __restrict__ v, const uint64_t* __restrict__ bits,
                                      int64_t heads, int64_t kv_heads, int64_t num_nodes, int64_t kv_len,
                                      int64_t head_dim, float scale, T* __restrict__ out) {
  extern __shared__ float smem[];  // [head_dim] query, then [kv_len] scores
  float* q_s = smem;
  float* scores = smem + head_dim;
  __shared__ float reduce[32];

  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t kvh = h / (heads / kv_heads);
  const int64_t prefix = kv_len - num_nodes, words = (num_nodes + 63) / 64;
  const T* q_row = q + ((b * heads + h) * num_nodes + i) * head_dim;
  const T* k_base = k + (b * kv_heads + kvh) * kv_len * head_dim;
  const T* v_base = v + (b * kv_heads + kvh) * kv_len * head_dim;
  const uint64_t* row_bits = bits + i * words;

  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = static_cast<float>(q_row[d]);
  __syncthreads();

  // 1. Scores of the attended keys; -inf elsewhere. Each thread keeps its running maximum.
  float local_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < kv_len; j += blockDim.x) {
    const int64_t a = j - prefix;
    const bool attended = a < 0 || ((row_bits[a / 64] >> (a % 64)) & 1ull);
    float s = -INFINITY;
    if (attended) {
      const T* kj = k_base + j * head_dim;
      float dot = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) dot += q_s[d] * static_cast<float>(kj[d]);
      s = dot * scale;
    }
    scores[j] = s;
    local_max = fmaxf(local_max, s);
  }
  // Block-wide maximum: warp shuffles, then one value per warp through shared memory.
  for (int off = 16; off > 0; off /= 2)
    local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, off));
  if (threadIdx.x % 32 == 0) reduce[threadIdx.x / 32] = local_max;
  __syncthreads();
  float row_max = -INFINITY;
  for (int w = 0; w < static_cast<int>((blockDim.x + 31) / 32); ++w) row_max = fmaxf(row_max, reduce[w]);
  __syncthreads();

  // 2. exp(s - max) and their sum (the query always attends to itself, so row_max is finite).
  float local_sum = 0.f;
  for (int64_t j = threadIdx.x; j < kv_len; j += blockDim.x) {
    const float e = __expf(scores[j] - row_max);  // -inf -> 0
    scores[j] = e;
    local_sum += e;
  }
  for (int off = 16; off > 0; off /= 2) local_sum += __shfl_xor_sync(0xffffffffu, local_sum, off);
  if (threadIdx.x % 32 == 0) reduce[threadIdx.x / 32] = local_sum;
  __syncthreads();
  float row_sum = 0.f;
  for (int w = 0; w < static_cast<int>((blockDim.x + 31) / 32); ++w) row_sum += reduce[w];

  // 3. out[d] = sum_j p_j v_j[d] / sum.
  T* out_row = out + ((b * heads + h) * num_nodes + i) * head_dim;
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < kv_len; ++j) acc += scores[j] * static_cast<float>(v_base[j * head_dim + d]);
    out_row[d] = static_cast<T>(acc / row_sum);
  }
}

// q: [B, H, T, D], k and v: [B, Hkv, P + T, D], out: [B, H, T, D], all contiguous; bits: [T, W].
// Shared memory: (D + P + T) floats per block; the caller checks it fits.
template <typename T>
inline cudaError_t tree_attention(const T* q, const T* k, const T* v, const uint64_t* bits, int64_t batch,
                                  int64_t heads, int64_t kv_heads, int64_t num_nodes, int64_t kv_len,
                                  int64_t head_dim, float scale, T* out, cudaStream_t stream) {
  if (batch * heads * num_nodes == 0) return cudaSuccess;
  constexpr int kThreads = 128;  // a multiple of 32 (the reductions are per warp)
  const size_t smem = static_cast<size_t>(head_dim + kv_len) * sizeof(float);
  cudaError_t err = cudaFuncSetAttribute(tree_attention_kernel<T>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  dim3 grid(static_cast<unsigned>(num_nodes), static_cast<unsigned>(heads), static_cast<unsigned>(batch));
  tree_attention_kernel<T><<<grid, kThreads, smem, stream>>>(q, k, v, bits, heads, kv_heads, num_nodes,
                                                             kv_len, head_dim, scale, out);
  return cudaGetLastError();
}

}  // namespace mtprobe::kernels
