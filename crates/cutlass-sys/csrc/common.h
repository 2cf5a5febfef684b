// Shared helpers of the .cu files (not part of the C ABI).
#pragma once
#include <cuda_runtime.h>
#include <string>
#include "mirage_cutlass.h"

namespace mirage_cutlass {

// Records `msg` as this thread's last error and returns `status`.
int fail(int status, const std::string& msg);

// Fails with MIRAGE_CUTLASS_CUDA_ERROR if `err` is not cudaSuccess.
int check_cuda(cudaError_t err, const char* what);

// MIRAGE_CUTLASS_OK if the current device is exactly sm_<major><minor>;
// arch-specific ("a") cubins run on that one capability only.
int require_arch(int major, int minor, const char* kernel);

}  // namespace mirage_cutlass
