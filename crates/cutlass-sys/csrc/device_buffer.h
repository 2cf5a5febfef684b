// Minimal owning device allocation for the *_host convenience entries.
#pragma once
#include <cuda_runtime.h>
#include <cstddef>

namespace mirage_cutlass {

struct DeviceBuffer {
  void* ptr = nullptr;
  cudaError_t alloc(size_t bytes) { return cudaMalloc(&ptr, bytes ? bytes : 1); }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
};

struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaError_t create() {
    cudaError_t err = cudaEventCreate(&start);
    return err ? err : cudaEventCreate(&stop);
  }
  ~EventPair() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }
};

}  // namespace mirage_cutlass
