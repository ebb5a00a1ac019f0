// Tree verification on the device: the CUDA twins of core::verify_greedy and core::verify_rejection
// (csrc/core/verify.h).
// Torch-free. The tree has at most BC nodes, so one thread walks it: the point is not speed but
// that the accepted path stays on the device until the host needs it (no synchronisation).
//
// From `root`, repeatedly move to the first child (in index order) whose token equals the target's
// choice at the current node; path[0] = root, path[1..] = the accepted drafts; *length = the path's
// length. The bonus token is target[path[length - 1]].
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/rejection.h"
#include "kernels/exec.cuh"

namespace mtprobe::kernels {

__global__ inline void verify_greedy_kernel(const int64_t* __restrict__ tokens,
                                            const int64_t* __restrict__ parents,
                                            const int64_t* __restrict__ target, int64_t num_nodes,
                                            int64_t root, int64_t* __restrict__ path,
                                            int64_t* __restrict__ length) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t node = root, len = 0;
  path[len++] = node;
  for (bool moved = true; moved;) {
    moved = false;
    for (int64_t c = node + 1; c < num_nodes; ++c) {  // children come after their parent
      if (parents[c] == node && tokens[c] == target[node]) {
        node = c;
        path[len++] = c;
        moved = true;
        break;
      }
    }
  }
  *length = len;
}

// path: num_nodes entries; length: one.
inline cudaError_t verify_greedy(const int64_t* tokens, const int64_t* parents, const int64_t* target,
                                 int64_t num_nodes, int64_t root, int64_t* path, int64_t* length,
                                 cudaStream_t stream) {
  verify_greedy_kernel<<<1, 1, 0, stream>>>(tokens, parents, target, num_nodes, root, path, length);
  return cudaGetLastError();
}

// Rejection sampling over a tree (core::verify_rejection, the same code: csrc/core/rejection.h),
// one block whose threads share the vocabulary. tokens, parents [n]; p [n, vocab], q [n - 1, vocab]
// float32; uniforms [n + 1] float64; workspace: core::rejection_workspace_bytes(vocab,
// kRejectionThreads) bytes, 8-byte aligned; path [n], length [1], token [1].
constexpr int kRejectionThreads = 1024;

__global__ inline void verify_rejection_kernel(const int64_t* __restrict__ tokens,
                                               const int64_t* __restrict__ parents, int64_t n,
                                               const float* __restrict__ p, const float* __restrict__ q,
                                               int64_t vocab, const double* __restrict__ uniforms,
                                               void* workspace, int64_t* __restrict__ path,
                                               int64_t* __restrict__ length, int64_t* __restrict__ token) {
  const core::RejectionWorkspace ws = core::carve_rejection_workspace(workspace, blockDim.x);
  const int64_t len =
      core::exec_verify_rejection(BlockExec{}, tokens, parents, n, p, q, vocab, uniforms, ws, path, token);
  if (threadIdx.x == 0) *length = len;
}

inline cudaError_t verify_rejection(const int64_t* tokens, const int64_t* parents, int64_t n, const float* p,
                                    const float* q, int64_t vocab, const double* uniforms, void* workspace,
                                    int64_t* path, int64_t* length, int64_t* token, cudaStream_t stream) {
  verify_rejection_kernel<<<1, kRejectionThreads, 0, stream>>>(tokens, parents, n, p, q, vocab, uniforms,
                                                               workspace, path, length, token);
  return cudaGetLastError();
}

}  // namespace mtprobe::kernels
