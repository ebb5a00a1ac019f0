// The threads of one CUDA block as an executor of the host/device code in csrc/core (exec.h):
// first = threadIdx.x, stride = blockDim.x, sync = __syncthreads. Host-callable too, as one
// thread, so the shared templates compile for both sides. exec_sort / exec_merge on a block are
// exec.h's parallel merge sort and merge.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/exec.h"

namespace mtprobe::kernels {

struct BlockExec {
  __host__ __device__ int64_t first() const {
#ifdef __CUDA_ARCH__
    return threadIdx.x;
#else
    return 0;
#endif
  }
  __host__ __device__ int64_t stride() const {
#ifdef __CUDA_ARCH__
    return blockDim.x;
#else
    return 1;
#endif
  }
  __host__ __device__ bool leader() const { return first() == 0; }
  __host__ __device__ void sync() const {
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
  }
};

}  // namespace mtprobe::kernels
