// Error reporting, device queries: no kernels here.
#include "common.h"
#include "cutlass/version.h"

namespace mirage_cutlass {

static thread_local std::string last_error;

int fail(int status, const std::string& msg) {
  last_error = msg;
  return status;
}

int check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return MIRAGE_CUTLASS_OK;
  return fail(MIRAGE_CUTLASS_CUDA_ERROR,
              std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

int require_arch(int major, int minor, const char* kernel) {
  int device = 0;
  int status = check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (status) return status;
  int found_major = 0, found_minor = 0;
  status = mirage_cutlass_device_capability(device, &found_major, &found_minor);
  if (status) return status;
  if (found_major != major || found_minor != minor) {
    return fail(MIRAGE_CUTLASS_UNSUPPORTED_ARCH,
                std::string(kernel) + " is built for sm_" + std::to_string(major * 10 + minor) +
                    "a only; device " + std::to_string(device) + " is sm_" +
                    std::to_string(found_major * 10 + found_minor));
  }
  return MIRAGE_CUTLASS_OK;
}

}  // namespace mirage_cutlass

extern "C" const char* mirage_cutlass_last_error(void) {
  return mirage_cutlass::last_error.c_str();
}

extern "C" int mirage_cutlass_version(void) { return CUTLASS_MAJOR * 100 + CUTLASS_MINOR; }

extern "C" int mirage_cutlass_device_capability(int device, int* major, int* minor) {
  using namespace mirage_cutlass;
  if (!major || !minor) return fail(MIRAGE_CUTLASS_INVALID_ARGUMENT, "null output pointer");
  int status = check_cuda(
      cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device),
      "cudaDeviceGetAttribute(major)");
  if (status) return status;
  return check_cuda(cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device),
                    "cudaDeviceGetAttribute(minor)");
}
