// Dynamic draft-tree expansion on the device: the CUDA twin of the expand_draft_tree op
// (csrc/ops/draft_tree.cpp). Torch-free: raw pointers and a stream; csrc/ops/draft_tree_cuda.cu is
// the ATen launcher. Nothing is read back: the next tree stays on the device until the decode loop
// needs the accepted length.
//
// 1. top_candidates_kernel, one block per mask row: the softmax's maximum and normaliser, then the
//    row's top m tokens by logit (ties: lower id), one block-wide arg-max per rank, each over the
//    tokens strictly after the previous pick in that order. m rounds of O(vocab / threads): simple
//    and exact; a radix select is the next step if profiling shows this matters.
// 2. expand_dynamic_tree_kernel, one block: csrc/core/draft_tree_expand.h, the very code the
//    host runs, with the block's threads sharing its loops. Its ranking sorts with exec.h's
//    parallel merge sort (each key placed by binary search in the neighbouring run): O(C log^2 C)
//    work over the block for C candidates, where the host's std::sort does O(C log C).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/draft_tree_expand.h"
#include "kernels/exec.cuh"
#include "kernels/reduce.cuh"

namespace mtprobe::kernels {

// (value, index) pairs ordered by value descending, then index ascending; index -1 is "none".
__device__ inline bool cand_better(float v, int64_t i, float bv, int64_t bi) {
  return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}
__device__ inline bool cand_after(float v, int64_t i, float pv, int64_t pi) {
  return pi < 0 || v < pv || (v == pv && i > pi);
}

__device__ inline void warp_best(float& v, int64_t& i) {
  for (int off = 16; off > 0; off /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (cand_better(ov, oi, v, i)) v = ov, i = oi;
  }
}

// Block-wide best pair, returned on every thread. blockDim.x: a multiple of 32, at most 1024.
__device__ inline void block_best(float& v, int64_t& i) {
  __shared__ float sv[32];
  __shared__ int64_t si[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  warp_best(v, i);
  if (lane == 0) sv[warp] = v, si[warp] = i;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? sv[lane] : -INFINITY;
    i = lane < warps ? si[lane] : -1;
    warp_best(v, i);
    if (lane == 0) sv[0] = v, si[0] = i;
  }
  __syncthreads();
  v = sv[0], i = si[0];
  __syncthreads();  // sv / si are reused by the next call
}

// logits: [depths, vocab]; top_tokens [depths, m], top_probs [depths, m]. Grid: depths blocks.
template <typename T>
__global__ void top_candidates_kernel(const T* __restrict__ logits, int64_t vocab, int64_t m,
                                      int64_t* __restrict__ top_tokens, float* __restrict__ top_probs) {
  const T* row = logits + blockIdx.x * vocab;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) mx = fmaxf(mx, static_cast<float>(row[j]));
  mx = block_reduce(mx, true);
  double sum = 0.0;  // in double, as the host op sums: see block_sum_double
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) sum += expf(static_cast<float>(row[j]) - mx);
  sum = block_sum_double(sum);
  float prev_v = INFINITY;
  int64_t prev_i = -1;
  for (int64_t r = 0; r < m; ++r) {
    float v = -INFINITY;
    int64_t i = -1;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
      const float x = static_cast<float>(row[j]);
      if (cand_after(x, j, prev_v, prev_i) && cand_better(x, j, v, i)) v = x, i = j;
    }
    block_best(v, i);
    if (threadIdx.x == 0) {
      top_tokens[blockIdx.x * m + r] = i;
      top_probs[blockIdx.x * m + r] = static_cast<float>(static_cast<double>(expf(v - mx)) / sum);
    }
    prev_v = v, prev_i = i;
  }
}

__global__ inline void expand_dynamic_tree_kernel(
    const int64_t* __restrict__ root_token, const int64_t* __restrict__ cand_tokens,
    const float* __restrict__ cand_probs, int64_t depths, int64_t m, int64_t budget, bool prune,
    void* workspace, int64_t capacity, int64_t* __restrict__ out_tokens, int64_t* __restrict__ out_parents,
    double* __restrict__ out_probs, int64_t* __restrict__ num_nodes) {
  const core::DynamicTreeWorkspace w = core::carve_dynamic_tree_workspace(workspace, capacity, budget);
  const int64_t n = core::expand_dynamic_tree(BlockExec{}, *root_token, cand_tokens, cand_probs, depths, m,
                                              budget, prune, w, out_tokens, out_parents, out_probs);
  if (threadIdx.x == 0) *num_nodes = n;
}

// Device scratch for expand_draft_tree: the candidates, then the tree's workspace.
inline size_t expand_draft_tree_workspace_bytes(int64_t depths, int64_t width, int64_t budget) {
  const size_t cands = static_cast<size_t>(depths * width);
  const size_t head = cands * sizeof(int64_t) + ((cands * sizeof(float) + 7) / 8) * 8;
  return head +
         core::dynamic_tree_workspace_bytes(core::dynamic_tree_capacity(depths, width, budget), budget);
}

// logits [depths, vocab]; root_token: one int64 on the device; workspace of
// expand_draft_tree_workspace_bytes(...) bytes, 8-byte aligned; outputs [budget] and one count.
// width: the candidates per depth, m rounds of the top-m kernel (the op passes
// core::dynamic_tree_width(width, budget): wider never changes the tree).
template <typename T>
inline cudaError_t expand_draft_tree(const T* logits, int64_t depths, int64_t vocab, int64_t width,
                                     const int64_t* root_token, int64_t budget, bool prune, void* workspace,
                                     int64_t* out_tokens, int64_t* out_parents, double* out_probs,
                                     int64_t* num_nodes, cudaStream_t stream) {
  const size_t cands = static_cast<size_t>(depths * width);
  char* base = static_cast<char*>(workspace);
  int64_t* top_tokens = reinterpret_cast<int64_t*>(base);
  float* top_probs = reinterpret_cast<float*>(base + cands * sizeof(int64_t));
  void* tree = base + cands * sizeof(int64_t) + ((cands * sizeof(float) + 7) / 8) * 8;
  top_candidates_kernel<T>
      <<<static_cast<unsigned>(depths), 1024, 0, stream>>>(logits, vocab, width, top_tokens, top_probs);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t capacity = core::dynamic_tree_capacity(depths, width, budget);
  expand_dynamic_tree_kernel<<<1, 256, 0, stream>>>(root_token, top_tokens, top_probs, depths, width, budget,
                                                    prune, tree, capacity, out_tokens, out_parents, out_probs,
                                                    num_nodes);
  return cudaGetLastError();
}

}  // namespace mtprobe::kernels
