// Tree attention on the device with the tree given as ancestor bits (csrc/core/tree.h:
// ancestor_bits), not as a dense [T, P + T] float mask. Torch-free: raw pointers and a stream;
// csrc/ops/tree_attention_cuda.cu is the ATen launcher.
//
// For query i of head h (kv head h / (H / Hkv)):
//   key j < P            : attended (the cached prefix)
//   key P + a, a < T     : attended iff bit a of row i is set (a is i or an ancestor of i)
//   out[i] = softmax_j(scale * q_i . k_j) v_j over the attended keys, accumulated in float32.
//
// Split-KV ("flash decoding"): the keys are cut into chunks of kChunk; one block per (chunk, kv
// head, batch) loads its chunk of K and V into shared memory once and serves every query row
// that reads that kv head (H / Hkv heads x T tree queries), one warp per row at a time. Each
// (row, chunk) leaves a partial softmax: its maximum m, its sum l = sum exp(s - m) and the
// unnormalised acc = sum exp(s - m) v. The combine kernel merges the chunks:
//   M = max_c m_c,  out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c.
// The tree tokens are few (tens), so the work is the prefix: read once per kv head, not once per
// query as a per-query kernel would.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/reduce.cuh"

namespace mtprobe::kernels {

constexpr int kTreeAttentionWarps = 4;

// Floats of shared memory per block: K and V chunks (rows padded to D + 1 so that lanes reading
// different keys hit different banks), one query row and one row of probabilities per warp.
inline size_t tree_attention_smem_floats(int chunk, int64_t head_dim) {
  return static_cast<size_t>(2 * chunk * (head_dim + 1) + kTreeAttentionWarps * (head_dim + chunk));
}

// kChunk: keys per block (a multiple of 32); kDPL: head dims per lane, ceil(D / 32).
template <typename T, int kChunk, int kDPL>
__global__ void tree_attention_split_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                            const T* __restrict__ v, const uint64_t* __restrict__ bits,
                                            int64_t heads, int64_t kv_heads, int64_t num_nodes,
                                            int64_t kv_len, int64_t head_dim, float scale, int64_t num_splits,
                                            float* __restrict__ part_m, float* __restrict__ part_l,
                                            float* __restrict__ part_acc) {
  extern __shared__ float smem[];
  const int64_t stride = head_dim + 1;
  float* ks = smem;                                 // [kChunk, D + 1]
  float* vs = ks + kChunk * stride;                 // [kChunk, D + 1]
  float* qs = vs + kChunk * stride;                 // [warps, D]
  float* ps = qs + kTreeAttentionWarps * head_dim;  // [warps, kChunk]
  const int64_t split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int64_t start = split * kChunk;
  const int64_t n_keys = kv_len - start < kChunk ? kv_len - start : kChunk;
  const int64_t prefix = kv_len - num_nodes, words = (num_nodes + 63) / 64, group = heads / kv_heads;

  const T* k_chunk = k + ((b * kv_heads + kvh) * kv_len + start) * head_dim;  // [n_keys, D]
  const T* v_chunk = v + ((b * kv_heads + kvh) * kv_len + start) * head_dim;
  for (int64_t e = threadIdx.x; e < n_keys * head_dim; e += blockDim.x) {
    const int64_t j = e / head_dim, d = e % head_dim;
    ks[j * stride + d] = static_cast<float>(k_chunk[e]);
    vs[j * stride + d] = static_cast<float>(v_chunk[e]);
  }
  __syncthreads();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* qw = qs + warp * head_dim;
  float* pw = ps + warp * kChunk;
  for (int64_t r = warp; r < group * num_nodes; r += kTreeAttentionWarps) {
    const int64_t h = kvh * group + r / num_nodes, i = r % num_nodes;
    const T* q_row = q + ((b * heads + h) * num_nodes + i) * head_dim;
    for (int64_t d = lane; d < head_dim; d += 32) qw[d] = static_cast<float>(q_row[d]);
    __syncwarp();
    // Scores: lane takes keys lane, lane + 32, ... of the chunk.
    const uint64_t* row_bits = bits + i * words;
    float s[kChunk / 32];
    float m = -INFINITY;
#pragma unroll
    for (int t = 0; t < kChunk / 32; ++t) {
      const int64_t jj = lane + 32 * t, a = start + jj - prefix;
      float x = -INFINITY;
      if (jj < n_keys && (a < 0 || ((row_bits[a / 64] >> (a % 64)) & 1ull))) {
        const float* kr = ks + jj * stride;
        float dot = 0.f;
        for (int64_t d = 0; d < head_dim; ++d) dot += qw[d] * kr[d];
        x = dot * scale;
      }
      s[t] = x;
      m = fmaxf(m, x);
    }
    m = warp_max(m);
    float l = 0.f;
#pragma unroll
    for (int t = 0; t < kChunk / 32; ++t) {
      const float p = m == -INFINITY ? 0.f : expf(s[t] - m);  // a chunk may see no key of this row
      pw[lane + 32 * t] = p;
      l += p;
    }
    l = warp_sum(l);
    __syncwarp();
    // acc[d] = sum_j p_j v_j[d]: lane takes dims lane, lane + 32, ...
    float acc[kDPL];
#pragma unroll
    for (int t = 0; t < kDPL; ++t) acc[t] = 0.f;
    for (int64_t jj = 0; jj < n_keys; ++jj) {
      const float p = pw[jj];
      if (p == 0.f) continue;  // the same for every lane: no divergence
      const float* vr = vs + jj * stride;
#pragma unroll
      for (int t = 0; t < kDPL; ++t) {
        const int64_t d = lane + 32 * t;
        if (d < head_dim) acc[t] += p * vr[d];
      }
    }
    const int64_t o = ((b * heads + h) * num_nodes + i) * num_splits + split;  // [B, H, T, splits]
    if (lane == 0) part_m[o] = m, part_l[o] = l;
#pragma unroll
    for (int t = 0; t < kDPL; ++t) {
      const int64_t d = lane + 32 * t;
      if (d < head_dim) part_acc[o * head_dim + d] = acc[t];
    }
    __syncwarp();  // qw and pw are rewritten for the next row
  }
}

// One block per output row (b, h, i).
template <typename T>
__global__ void tree_attention_combine_kernel(const float* __restrict__ part_m,
                                              const float* __restrict__ part_l,
                                              const float* __restrict__ part_acc, int64_t num_splits,
                                              int64_t head_dim, T* __restrict__ out) {
  const int64_t row = blockIdx.x;
  const float* m = part_m + row * num_splits;
  const float* l = part_l + row * num_splits;
  float big = -INFINITY;
  for (int64_t c = 0; c < num_splits; ++c) big = fmaxf(big, m[c]);
  float total = 0.f;  // > 0: every query attends to itself
  for (int64_t c = 0; c < num_splits; ++c) total += m[c] == -INFINITY ? 0.f : expf(m[c] - big) * l[c];
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int64_t c = 0; c < num_splits; ++c) {
      if (m[c] != -INFINITY) acc += expf(m[c] - big) * part_acc[(row * num_splits + c) * head_dim + d];
    }
    out[row * head_dim + d] = static_cast<T>(acc / total);
  }
}

// Floats of workspace for tree_attention: the partial softmax of every (row, chunk).
inline size_t tree_attention_workspace_floats(int64_t batch, int64_t heads, int64_t num_nodes, int64_t kv_len,
                                              int64_t head_dim) {
  const int64_t chunk = head_dim <= 128 ? 128 : 64;
  const int64_t splits = (kv_len + chunk - 1) / chunk;
  return static_cast<size_t>(batch * heads * num_nodes * splits * (head_dim + 2));
}

template <typename T, int kChunk, int kDPL>
inline cudaError_t tree_attention_launch(const T* q, const T* k, const T* v, const uint64_t* bits,
                                         int64_t batch, int64_t heads, int64_t kv_heads, int64_t num_nodes,
                                         int64_t kv_len, int64_t head_dim, float scale, float* workspace,
                                         T* out, cudaStream_t stream) {
  const int64_t splits = (kv_len + kChunk - 1) / kChunk, rows = batch * heads * num_nodes;
  float* part_m = workspace;
  float* part_l = part_m + rows * splits;
  float* part_acc = part_l + rows * splits;
  const size_t smem = tree_attention_smem_floats(kChunk, head_dim) * sizeof(float);
  auto kernel = tree_attention_split_kernel<T, kChunk, kDPL>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(kv_heads), static_cast<unsigned>(batch));
  kernel<<<grid, 32 * kTreeAttentionWarps, smem, stream>>>(q, k, v, bits, heads, kv_heads, num_nodes, kv_len,
                                                           head_dim, scale, splits, part_m, part_l, part_acc);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  tree_attention_combine_kernel<T>
      <<<static_cast<unsigned>(rows), 64, 0, stream>>>(part_m, part_l, part_acc, splits, head_dim, out);
  return cudaGetLastError();
}

// q: [B, H, T, D], k and v: [B, Hkv, P + T, D], out: [B, H, T, D], all contiguous; bits: [T, W];
// D <= 256; workspace: tree_attention_workspace_floats(...) floats.
template <typename T>
inline cudaError_t tree_attention(const T* q, const T* k, const T* v, const uint64_t* bits, int64_t batch,
                                  int64_t heads, int64_t kv_heads, int64_t num_nodes, int64_t kv_len,
                                  int64_t head_dim, float scale, float* workspace, T* out,
                                  cudaStream_t stream) {
  if (batch * heads * num_nodes == 0) return cudaSuccess;
  if (head_dim <= 32)
    return tree_attention_launch<T, 128, 1>(q, k, v, bits, batch, heads, kv_heads, num_nodes, kv_len,
                                            head_dim, scale, workspace, out, stream);
  if (head_dim <= 64)
    return tree_attention_launch<T, 128, 2>(q, k, v, bits, batch, heads, kv_heads, num_nodes, kv_len,
                                            head_dim, scale, workspace, out, stream);
  if (head_dim <= 128)
    return tree_attention_launch<T, 128, 4>(q, k, v, bits, batch, heads, kv_heads, num_nodes, kv_len,
                                            head_dim, scale, workspace, out, stream);
  if (head_dim <= 256)
    return tree_attention_launch<T, 64, 8>(q, k, v, bits, batch, heads, kv_heads, num_nodes, kv_len, head_dim,
                                           scale, workspace, out, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mtprobe::kernels
