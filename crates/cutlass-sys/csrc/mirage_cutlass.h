// C ABI of cutlass-sys. Every entry returns a status code (MIRAGE_CUTLASS_*)
// and leaves a human-readable message for mirage_cutlass_last_error().
// Kernels are arch-specific (sm_90a, sm_120a): each entry first checks the
// current device's compute capability and refuses other GPUs instead of
// failing inside the launch with an opaque "no kernel image" error.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  MIRAGE_CUTLASS_OK = 0,
  MIRAGE_CUTLASS_INVALID_ARGUMENT = 1,
  MIRAGE_CUTLASS_UNSUPPORTED_ARCH = 2,
  MIRAGE_CUTLASS_CUDA_ERROR = 3,
  MIRAGE_CUTLASS_CANNOT_IMPLEMENT = 4,
  MIRAGE_CUTLASS_LAUNCH_FAILED = 5,
};

// Message of the last failed call on this thread ("" if none).
const char* mirage_cutlass_last_error(void);

// CUTLASS version compiled in (major*100 + minor).
int mirage_cutlass_version(void);

// Compute capability of CUDA device `device` (cudaDeviceGetAttribute).
int mirage_cutlass_device_capability(int device, int* major, int* minor);

// D[m,n] (f32, row-major) = A[m,k] (bf16, row-major) * B[n,k]^T (bf16,
// row-major [n,k], i.e. column-major k x n: the GGUF weight layout).
// Device pointers; stream may be NULL. Needs sm_90 (built as sm_90a, wgmma).
int mirage_cutlass_sm90_bf16_gemm(int m, int n, int k, const void* a, const void* b,
                                  float* d, void* stream);

// Host-memory convenience around the entry above: copies, runs once to
// check, then `iters` timed runs (CUDA events); *ms_per_iter gets the mean.
int mirage_cutlass_sm90_bf16_gemm_host(int m, int n, int k, const uint16_t* a,
                                       const uint16_t* b, float* d, int iters,
                                       float* ms_per_iter);

// Bytes of one scale-factor tensor in CUTLASS's SM1xx interleaved layout
// (operand 0 = A with m rows, 1 = B with n rows), for a GEMM m x n x k.
int mirage_cutlass_sm120_sf_bytes(int m, int n, int k, int operand, size_t* bytes);

// Reorders row-major block scales ([rows, k/16] bytes, rows = m for operand
// 0 = A, n for operand 1 = B) into the interleaved layout, zero-filling the
// padding; `out` must hold exactly mirage_cutlass_sm120_sf_bytes bytes.
// Host-only: needs no GPU.
int mirage_cutlass_sm120_reorder_scales(int m, int n, int k, int operand, const uint8_t* rowmajor,
                                        uint8_t* out, size_t out_bytes);

// D[m,n] (bf16, row-major) = alpha * A[m,k] * B[n,k]^T with A and B NVFP4:
// packed E2M1 (two per byte, low nibble first, row-major [rows, k/2]) and
// E4M3 block scales (one per 16 elements) already in the interleaved layout
// whose size mirage_cutlass_sm120_sf_bytes gives. alpha carries the two
// per-tensor FP32 scales. Device pointers. Needs sm_120 (built as sm_120a).
int mirage_cutlass_sm120_nvfp4_gemm(int m, int n, int k, const void* a, const void* sfa,
                                    const void* b, const void* sfb, float alpha, void* d,
                                    void* stream);

// Host-memory convenience: scales given row-major ([rows, k/16] bytes) are
// reordered into the interleaved layout; D is returned as f32.
int mirage_cutlass_sm120_nvfp4_gemm_host(int m, int n, int k, const uint8_t* a,
                                         const uint8_t* sfa_rowmajor, const uint8_t* b,
                                         const uint8_t* sfb_rowmajor, float alpha, float* d,
                                         int iters, float* ms_per_iter);

#ifdef __cplusplus
}
#endif
