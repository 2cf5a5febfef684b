// SM90 BF16 GEMM for prefill: CUTLASS 3.x collective builder, TMA loads and
// warp-specialized wgmma mainloop. Compiled for sm_90a only (wgmma is an
// arch-specific instruction), so the entry refuses every other device.
#include <string>

#include "common.h"
#include "device_buffer.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

namespace {

using ElementA = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // activations [m, k]
using ElementB = cutlass::bfloat16_t;
using LayoutB = cutlass::layout::ColumnMajor;  // weights stored [n, k] row-major
using ElementC = float;
using LayoutC = cutlass::layout::RowMajor;     // output [m, n]
using ElementAccumulator = float;
constexpr int AlignmentA = 128 / cutlass::sizeof_bits<ElementA>::value;
constexpr int AlignmentB = 128 / cutlass::sizeof_bits<ElementB>::value;
constexpr int AlignmentC = 128 / cutlass::sizeof_bits<ElementC>::value;

using TileShape = Shape<_128, _128, _64>;
using ClusterShape = Shape<_1, _1, _1>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,
    ElementC, LayoutC, AlignmentC, ElementC, LayoutC, AlignmentC,
    cutlass::epilogue::collective::EpilogueScheduleAuto>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, AlignmentA, ElementB,
    LayoutB, AlignmentB, ElementAccumulator, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::collective::KernelScheduleAuto>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

// Runs the GEMM once, then `iters` more times between CUDA events when
// iters > 0 (initialize once: the timed loop measures the kernel, not setup).
int run_gemm(int m, int n, int k, const void* a, const void* b, float* d, cudaStream_t stream,
             int iters, float* ms_per_iter) {
  using namespace mirage_cutlass;
  auto stride_a = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideA{}, {m, k, 1});
  auto stride_b = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideB{}, {n, k, 1});
  auto stride_c = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideC{}, {m, n, 1});
  auto stride_d = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideD{}, {m, n, 1});
  // beta = 0: C is never read, but the epilogue wants a valid pointer.
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k},
      {static_cast<const ElementA*>(a), stride_a, static_cast<const ElementB*>(b), stride_b},
      {{1.0f, 0.0f}, d, stride_c, d, stride_d}};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return fail(MIRAGE_CUTLASS_CANNOT_IMPLEMENT,
                "sm90 bf16 gemm cannot implement m=" + std::to_string(m) + " n=" +
                    std::to_string(n) + " k=" + std::to_string(k) +
                    " (k must be a multiple of 8, n of 4)");
  }
  size_t workspace_bytes = Gemm::get_workspace_size(args);
  DeviceBuffer workspace;
  if (int s = check_cuda(workspace.alloc(workspace_bytes), "cudaMalloc(workspace)")) return s;
  cutlass::Status status = gemm.initialize(args, workspace.ptr, stream);
  if (status != cutlass::Status::kSuccess) {
    return fail(MIRAGE_CUTLASS_LAUNCH_FAILED,
                std::string("sm90 bf16 gemm initialize: ") + cutlassGetStatusString(status));
  }
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    return fail(MIRAGE_CUTLASS_LAUNCH_FAILED,
                std::string("sm90 bf16 gemm run: ") + cutlassGetStatusString(status));
  }
  if (int s = check_cuda(cudaGetLastError(), "sm90 bf16 gemm launch")) return s;
  if (iters <= 0 || !ms_per_iter) return MIRAGE_CUTLASS_OK;
  EventPair events;
  if (int s = check_cuda(events.create(), "cudaEventCreate")) return s;
  cudaEventRecord(events.start, stream);
  for (int i = 0; i < iters; ++i) {
    status = gemm.run(stream);
    if (status != cutlass::Status::kSuccess)
      return fail(MIRAGE_CUTLASS_LAUNCH_FAILED,
                  std::string("sm90 bf16 gemm run: ") + cutlassGetStatusString(status));
  }
  cudaEventRecord(events.stop, stream);
  if (int s = check_cuda(cudaEventSynchronize(events.stop), "sm90 bf16 gemm timed runs")) return s;
  float ms = 0;
  cudaEventElapsedTime(&ms, events.start, events.stop);
  *ms_per_iter = ms / iters;
  return MIRAGE_CUTLASS_OK;
}

}  // namespace

extern "C" int mirage_cutlass_sm90_bf16_gemm(int m, int n, int k, const void* a, const void* b,
                                             float* d, void* stream) {
  using namespace mirage_cutlass;
  if (m <= 0 || n <= 0 || k <= 0 || !a || !b || !d)
    return fail(MIRAGE_CUTLASS_INVALID_ARGUMENT, "sm90 bf16 gemm: empty shape or null pointer");
  if (int s = require_arch(9, 0, "sm90 bf16 gemm")) return s;
  return run_gemm(m, n, k, a, b, d, static_cast<cudaStream_t>(stream), 0, nullptr);
}

extern "C" int mirage_cutlass_sm90_bf16_gemm_host(int m, int n, int k, const uint16_t* a,
                                                  const uint16_t* b, float* d, int iters,
                                                  float* ms_per_iter) {
  using namespace mirage_cutlass;
  if (m <= 0 || n <= 0 || k <= 0 || !a || !b || !d)
    return fail(MIRAGE_CUTLASS_INVALID_ARGUMENT, "sm90 bf16 gemm: empty shape or null pointer");
  if (int s = require_arch(9, 0, "sm90 bf16 gemm")) return s;
  size_t a_bytes = size_t(m) * k * 2, b_bytes = size_t(n) * k * 2, d_bytes = size_t(m) * n * 4;
  DeviceBuffer da, db, dd;
  if (int s = check_cuda(da.alloc(a_bytes), "cudaMalloc(a)")) return s;
  if (int s = check_cuda(db.alloc(b_bytes), "cudaMalloc(b)")) return s;
  if (int s = check_cuda(dd.alloc(d_bytes), "cudaMalloc(d)")) return s;
  if (int s = check_cuda(cudaMemcpy(da.ptr, a, a_bytes, cudaMemcpyHostToDevice), "copy a")) return s;
  if (int s = check_cuda(cudaMemcpy(db.ptr, b, b_bytes, cudaMemcpyHostToDevice), "copy b")) return s;
  float* out = static_cast<float*>(dd.ptr);
  if (int s = run_gemm(m, n, k, da.ptr, db.ptr, out, nullptr, iters, ms_per_iter)) return s;
  if (int s = check_cuda(cudaDeviceSynchronize(), "sm90 bf16 gemm")) return s;
  return check_cuda(cudaMemcpy(d, dd.ptr, d_bytes, cudaMemcpyDeviceToHost), "copy d");
}
