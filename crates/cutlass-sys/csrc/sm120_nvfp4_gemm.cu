// SM120 block-scaled NVFP4 x NVFP4 GEMM (CUTLASS's sm120 blockscaled
// collective, OpClassBlockScaledTensorOp). Compiled for sm_120a: it runs only
// on Blackwell GeForce / RTX PRO (compute capability 12.0). On any other GPU
// (the H200 is 9.0) the entry returns MIRAGE_CUTLASS_UNSUPPORTED_ARCH before
// touching the device.
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "device_buffer.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

namespace {

// NVFP4: E2M1 data with one UE4M3 scale per 16 elements (nv_float4_t).
using ElementA = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
using LayoutA = cutlass::layout::RowMajor;
constexpr int AlignmentA = 32;
using ElementB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
using LayoutB = cutlass::layout::ColumnMajor;  // [n, k] row-major: the weight layout
constexpr int AlignmentB = 32;
using ElementD = cutlass::bfloat16_t;
using ElementC = cutlass::bfloat16_t;
using LayoutC = cutlass::layout::RowMajor;
constexpr int AlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;
constexpr int AlignmentC = 128 / cutlass::sizeof_bits<ElementC>::value;
using ElementAccumulator = float;
using ArchTag = cutlass::arch::Sm120;
using OperatorClass = cutlass::arch::OpClassBlockScaledTensorOp;
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _1, _1>;  // SM120 has no multi-SM clusters for this op

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    ArchTag, OperatorClass, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,
    ElementC, LayoutC, AlignmentC, ElementD, LayoutC, AlignmentD,
    cutlass::epilogue::collective::EpilogueScheduleAuto>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    ArchTag, OperatorClass, ElementA, LayoutA, AlignmentA, ElementB, LayoutB, AlignmentB,
    ElementAccumulator, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::collective::KernelScheduleAuto>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                        CollectiveMainloop, CollectiveEpilogue, void>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using BlkScaledConfig = typename Gemm::GemmKernel::CollectiveMainloop::Sm1xxBlkScaledConfig;
using DataA = typename ElementA::DataType;
using DataB = typename ElementB::DataType;
using ScaleA = typename ElementA::ScaleFactorType;
using ScaleB = typename ElementB::ScaleFactorType;

constexpr int kScaleBlock = 16;

int check_shape(int m, int n, int k) {
  using namespace mirage_cutlass;
  if (m <= 0 || n <= 0 || k <= 0)
    return fail(MIRAGE_CUTLASS_INVALID_ARGUMENT, "sm120 nvfp4 gemm: empty shape");
  if (k % 128 != 0)
    return fail(MIRAGE_CUTLASS_INVALID_ARGUMENT,
                "sm120 nvfp4 gemm: k=" + std::to_string(k) + " is not a multiple of 128");
  return MIRAGE_CUTLASS_OK;
}

auto sf_layout(int m, int n, int k, int operand) {
  auto problem = cute::make_shape(m, n, k, 1);
  return operand == 0 ? BlkScaledConfig::tile_atom_to_shape_SFA(problem)
                      : BlkScaledConfig::tile_atom_to_shape_SFB(problem);
}

size_t sf_bytes(int m, int n, int k, int operand) {
  // One byte per scale; the layout pads rows to 128 and k-blocks to 4.
  return operand == 0 ? size_t(cute::cosize(filter_zeros(sf_layout(m, n, k, 0))))
                      : size_t(cute::cosize(filter_zeros(sf_layout(m, n, k, 1))));
}

// Row-major [rows, k/16] scales -> CUTLASS's interleaved SM1xx layout. The
// layout is indexed by element coordinates (row, k, batch); the 16 elements
// of a block share one scale (stride 0 along them).
void reorder_scales(int m, int n, int k, int operand, const uint8_t* rowmajor,
                    std::vector<uint8_t>& out) {
  out.assign(sf_bytes(m, n, k, operand), 0);
  int rows = operand == 0 ? m : n;
  int blocks = k / kScaleBlock;
  if (operand == 0) {
    auto layout = sf_layout(m, n, k, 0);
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < blocks; ++j)
        out[layout(make_coord(r, j * kScaleBlock, 0))] = rowmajor[size_t(r) * blocks + j];
  } else {
    auto layout = sf_layout(m, n, k, 1);
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < blocks; ++j)
        out[layout(make_coord(r, j * kScaleBlock, 0))] = rowmajor[size_t(r) * blocks + j];
  }
}

int run_gemm(int m, int n, int k, const void* a, const void* sfa, const void* b, const void* sfb,
             float alpha, void* d, cudaStream_t stream, int iters, float* ms_per_iter) {
  using namespace mirage_cutlass;
  auto stride_a = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideA{}, {m, k, 1});
  auto stride_b = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideB{}, {n, k, 1});
  auto stride_c = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideC{}, {m, n, 1});
  auto stride_d = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideD{}, {m, n, 1});
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const DataA*>(a), stride_a, static_cast<const DataB*>(b), stride_b,
       static_cast<const ScaleA*>(sfa), sf_layout(m, n, k, 0), static_cast<const ScaleB*>(sfb),
       sf_layout(m, n, k, 1)},
      {{alpha, 0.0f},
       static_cast<const ElementC*>(d), stride_c, static_cast<ElementD*>(d), stride_d}};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return fail(MIRAGE_CUTLASS_CANNOT_IMPLEMENT,
                "sm120 nvfp4 gemm cannot implement m=" + std::to_string(m) + " n=" +
                    std::to_string(n) + " k=" + std::to_string(k));
  }
  DeviceBuffer workspace;
  if (int s = check_cuda(workspace.alloc(Gemm::get_workspace_size(args)), "cudaMalloc(workspace)"))
    return s;
  cutlass::Status status = gemm.initialize(args, workspace.ptr, stream);
  if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess)
    return fail(MIRAGE_CUTLASS_LAUNCH_FAILED,
                std::string("sm120 nvfp4 gemm: ") + cutlassGetStatusString(status));
  if (int s = check_cuda(cudaGetLastError(), "sm120 nvfp4 gemm launch")) return s;
  if (iters <= 0 || !ms_per_iter) return MIRAGE_CUTLASS_OK;
  EventPair events;
  if (int s = check_cuda(events.create(), "cudaEventCreate")) return s;
  cudaEventRecord(events.start, stream);
  for (int i = 0; i < iters && status == cutlass::Status::kSuccess; ++i) status = gemm.run(stream);
  cudaEventRecord(events.stop, stream);
  if (status != cutlass::Status::kSuccess)
    return fail(MIRAGE_CUTLASS_LAUNCH_FAILED,
                std::string("sm120 nvfp4 gemm: ") + cutlassGetStatusString(status));
  if (int s = check_cuda(cudaEventSynchronize(events.stop), "sm120 nvfp4 gemm timed runs")) return s;
  float ms = 0;
  cudaEventElapsedTime(&ms, events.start, events.stop);
  *ms_per_iter = ms / iters;
  return MIRAGE_CUTLASS_OK;
}

}  // namespace

extern "C" int mirage_cutlass_sm120_sf_bytes(int m, int n, int k, int operand, size_t* bytes) {
  using namespace mirage_cutlass;
  if (int s = check_shape(m, n, k)) return s;
  if ((operand != 0 && operand != 1) || !bytes)
    return fail(MIRAGE_CUTLASS_INVALID_ARGUMENT, "sm120 sf bytes: operand must be 0 (A) or 1 (B)");
  *bytes = sf_bytes(m, n, k, operand);
  return MIRAGE_CUTLASS_OK;
}

extern "C" int mirage_cutlass_sm120_reorder_scales(int m, int n, int k, int operand,
                                                   const uint8_t* rowmajor, uint8_t* out,
                                                   size_t out_bytes) {
  using namespace mirage_cutlass;
  if (int s = check_shape(m, n, k)) return s;
  if ((operand != 0 && operand != 1) || !rowmajor || !out)
    return fail(MIRAGE_CUTLASS_INVALID_ARGUMENT, "sm120 reorder scales: bad operand or null pointer");
  if (out_bytes != sf_bytes(m, n, k, operand))
    return fail(MIRAGE_CUTLASS_INVALID_ARGUMENT,
                "sm120 reorder scales: out holds " + std::to_string(out_bytes) + " bytes, expected " +
                    std::to_string(sf_bytes(m, n, k, operand)));
  std::vector<uint8_t> tmp;
  reorder_scales(m, n, k, operand, rowmajor, tmp);
  std::memcpy(out, tmp.data(), tmp.size());
  return MIRAGE_CUTLASS_OK;
}

extern "C" int mirage_cutlass_sm120_nvfp4_gemm(int m, int n, int k, const void* a, const void* sfa,
                                               const void* b, const void* sfb, float alpha, void* d,
                                               void* stream) {
  using namespace mirage_cutlass;
  if (int s = check_shape(m, n, k)) return s;
  if (!a || !sfa || !b || !sfb || !d)
    return fail(MIRAGE_CUTLASS_INVALID_ARGUMENT, "sm120 nvfp4 gemm: null pointer");
  if (int s = require_arch(12, 0, "sm120 nvfp4 gemm")) return s;
  return run_gemm(m, n, k, a, sfa, b, sfb, alpha, d, static_cast<cudaStream_t>(stream), 0, nullptr);
}

extern "C" int mirage_cutlass_sm120_nvfp4_gemm_host(int m, int n, int k, const uint8_t* a,
                                                    const uint8_t* sfa_rowmajor, const uint8_t* b,
                                                    const uint8_t* sfb_rowmajor, float alpha,
                                                    float* d, int iters, float* ms_per_iter) {
  using namespace mirage_cutlass;
  if (int s = check_shape(m, n, k)) return s;
  if (!a || !sfa_rowmajor || !b || !sfb_rowmajor || !d)
    return fail(MIRAGE_CUTLASS_INVALID_ARGUMENT, "sm120 nvfp4 gemm: null pointer");
  if (int s = require_arch(12, 0, "sm120 nvfp4 gemm")) return s;
  std::vector<uint8_t> sfa, sfb;
  reorder_scales(m, n, k, 0, sfa_rowmajor, sfa);
  reorder_scales(m, n, k, 1, sfb_rowmajor, sfb);
  size_t a_bytes = size_t(m) * k / 2, b_bytes = size_t(n) * k / 2, d_elems = size_t(m) * n;
  DeviceBuffer da, dsfa, db, dsfb, dd;
  if (int s = check_cuda(da.alloc(a_bytes), "cudaMalloc(a)")) return s;
  if (int s = check_cuda(db.alloc(b_bytes), "cudaMalloc(b)")) return s;
  if (int s = check_cuda(dsfa.alloc(sfa.size()), "cudaMalloc(sfa)")) return s;
  if (int s = check_cuda(dsfb.alloc(sfb.size()), "cudaMalloc(sfb)")) return s;
  if (int s = check_cuda(dd.alloc(d_elems * 2), "cudaMalloc(d)")) return s;
  if (int s = check_cuda(cudaMemcpy(da.ptr, a, a_bytes, cudaMemcpyHostToDevice), "copy a")) return s;
  if (int s = check_cuda(cudaMemcpy(db.ptr, b, b_bytes, cudaMemcpyHostToDevice), "copy b")) return s;
  if (int s = check_cuda(cudaMemcpy(dsfa.ptr, sfa.data(), sfa.size(), cudaMemcpyHostToDevice), "copy sfa"))
    return s;
  if (int s = check_cuda(cudaMemcpy(dsfb.ptr, sfb.data(), sfb.size(), cudaMemcpyHostToDevice), "copy sfb"))
    return s;
  if (int s = run_gemm(m, n, k, da.ptr, dsfa.ptr, db.ptr, dsfb.ptr, alpha, dd.ptr, nullptr, iters,
                       ms_per_iter))
    return s;
  if (int s = check_cuda(cudaDeviceSynchronize(), "sm120 nvfp4 gemm")) return s;
  std::vector<uint16_t> bf16(d_elems);
  if (int s = check_cuda(cudaMemcpy(bf16.data(), dd.ptr, d_elems * 2, cudaMemcpyDeviceToHost), "copy d"))
    return s;
  for (size_t i = 0; i < d_elems; ++i) {
    uint32_t bits = uint32_t(bf16[i]) << 16;
    std::memcpy(&d[i], &bits, 4);
  }
  return MIRAGE_CUTLASS_OK;
}
