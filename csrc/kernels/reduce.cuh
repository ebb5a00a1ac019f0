// Warp- and block-wide reductions of floats, shared by the kernels. Torch-free.
#pragma once

#include <cuda_runtime.h>

namespace mtprobe::kernels {

__device__ inline float warp_max(float x) {
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ inline float warp_sum(float x) {
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Block-wide max (is_max) or sum of x, returned on every thread. blockDim.x: a multiple of 32,
// at most 1024.
__device__ inline float block_reduce(float x, bool is_max) {
  __shared__ float s[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  x = is_max ? warp_max(x) : warp_sum(x);
  if (lane == 0) s[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < warps ? s[lane] : (is_max ? -INFINITY : 0.f);
    x = is_max ? warp_max(x) : warp_sum(x);
    if (lane == 0) s[0] = x;
  }
  __syncthreads();
  x = s[0];
  __syncthreads();  // s is reused by the next call
  return x;
}

// Block-wide sum in double, returned on every thread: a softmax normaliser over a large vocabulary
// (151936 terms) summed in float drifts by ~1e-5 relative with the order of the terms; in double the
// host and the device agree to float precision. blockDim.x: a multiple of 32, at most 1024.
__device__ inline double block_sum_double(double x) {
  __shared__ double s[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  if (lane == 0) s[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < warps ? s[lane] : 0.0;
    for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    if (lane == 0) s[0] = x;
  }
  __syncthreads();
  x = s[0];
  __syncthreads();  // s is reused by the next call
  return x;
}

}  // namespace mtprobe::kernels
