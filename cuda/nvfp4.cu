// MIRAGE sparse-path CUDA kernels, part 1: shared decode helpers and the
// NVFP4 weight-only mat-vec. Compiled by NVRTC together with superblock.cu
// (this file first; see crates/mirage-cuda/src/superblock.rs). No headers, so
// NVRTC needs no include path.
//
// Decoding avoids the I2F conversion unit (16 results per clock per SM on
// Hopper, below what a bandwidth-bound mat-vec needs): a small integer u in a
// byte is turned into a float by placing it in the mantissa of 2^23
// (0x4B000000 | u == 2^23 + u) with one PRMT and removing the bias with one
// FADD. Both run on the full-rate integer/FP32 pipes.

typedef unsigned char sb_u8;
typedef unsigned short sb_u16;
typedef unsigned int sb_u32;

#define SB_MAGIC 0x4B000000u

__device__ __forceinline__ sb_u32 sb_prmt(sb_u32 a, sb_u32 b, sb_u32 sel) {
    sb_u32 r;
    // Generic mode: a selector nibble with bit 3 set replicates the sign of
    // the selected byte (the NVFP4 sign mask below relies on it).
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ float sb_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float sb_h2f(sb_u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// The copy engine's (sm_90 TMA) transaction barriers (one arrival: the issuing thread's)
// and the bulk global -> shared copy that completes on one of them.
__device__ __forceinline__ void sb_tx_init(unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"((sb_u32)__cvta_generic_to_shared(bar)) : "memory");
#else
    (void)bar;
#endif
}
// Once after the inits, before the barrier that lets the block use them:
// makes them visible to the copy engine (one fence for all: each costs a
// round trip).
__device__ __forceinline__ void sb_tx_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// Arrives on bar and makes its current phase wait for `bytes` more bytes of
// copies (issued next).
__device__ __forceinline__ void sb_tx_expect(unsigned long long* bar, sb_u32 bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"((sb_u32)__cvta_generic_to_shared(bar)),
                 "r"(bytes)
                 : "memory");
#else
    (void)bar;
    (void)bytes;
#endif
}
// bytes (a multiple of 16; both addresses 16-byte aligned) from src to dst.
__device__ __forceinline__ void sb_bulk_g2s(void* dst, const void* src, sb_u32 bytes, unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     (sb_u32)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(bytes), "r"((sb_u32)__cvta_generic_to_shared(bar))
                 : "memory");
#else
    (void)bar;
    for (sb_u32 i = 0; i < bytes / 16; i++) ((uint4*)dst)[i] = ((const uint4*)src)[i];
#endif
}
// Every thread: waits until the phase of bar with this parity has completed.
__device__ __forceinline__ void sb_tx_wait(unsigned long long* bar, sb_u32 parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    sb_u32 done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.b32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"((sb_u32)__cvta_generic_to_shared(bar)), "r"(parity)
            : "memory");
    } while (!done);
#else
    (void)bar;
    (void)parity;
    __syncthreads();
#endif
}
// Byte i of u (an unsigned value v + bias) as float, minus (2^23 + bias).
__device__ __forceinline__ float sb_byte_f32(sb_u32 u, int i, float magic_plus_bias) {
    return __uint_as_float(sb_prmt(u, SB_MAGIC, 0x7540u | (sb_u32)i)) - magic_plus_bias;
}

// Four signed bytes (ggml Q8_0 quants) as floats.
__device__ __forceinline__ void sb_q8x4(sb_u32 w, float f[4]) {
    sb_u32 u = w ^ 0x80808080u;  // q + 128, as unsigned bytes
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = sb_byte_f32(u, i, 8388736.0f);  // 2^23 + 128
}

// Four E2M1 codes (the low 16 bits of v, element i in nibble i) as floats of
// TWICE their value (doubled E2M1 values are the integers 0,1,2,3,4,6,8,12):
// two 8-entry byte tables (64 + value, 64 - value) picked by the magnitude,
// merged by a per-byte sign mask (PRMT's sign-replicate mode turns a nibble
// with bit 3 set into 0xFF and one without into 0x80; bit 7 of both tables
// is 0, so taking it from either is the same).
__device__ __forceinline__ void sb_e2m1x4_doubled(sb_u32 v, float f[4]) {
    sb_u32 sel = v & 0x7777u;
    sb_u32 pos = sb_prmt(0x43424140u, 0x4C484644u, sel);
    sb_u32 neg = sb_prmt(0x3D3E3F40u, 0x34383A3Cu, sel);
    sb_u32 m = sb_prmt(0x80808080u, 0x80808080u, v);
    sb_u32 u = (neg & m) | (pos & ~m);
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = sb_byte_f32(u, i, 8388672.0f);  // 2^23 + 64
}

// Unsigned E4M3 ("fn") byte as float: its 7 bits shifted to the f32
// exponent/mantissa position give the value times 2^-120 (subnormals too:
// both formats' subnormals line up), so one exact multiply restores it.
__device__ __forceinline__ float sb_e4m3(sb_u32 b) {
    return __uint_as_float((b & 0x7fu) << 20) * 1.329227995784916e36f;  // 2^120
}

// ---------------------------------------------------------------------------
// NVFP4 mat-vec: y[r] = sum_k W[r, k] x[k].
// W as the CPU codec stores it (mirage_gguf::quant::nvfp4): packed codes
// [rows][cols/2] (element 2j low nibble of byte j), E4M3 block scales
// [rows][cols/16], one f32 tensor scale; cols % 16 == 0.
//
// A warp takes NV_ROWS rows at once (they share the x reads); lane l reads
// the 32-bit word l of each 128-byte chunk (elements 8l..8l+7 of a 256-element
// chunk), so a warp load is one coalesced 128-byte line per row. x sits in
// shared memory as two planes (elements 8m..8m+3 in plane A at float4 m,
// 8m+4..8m+7 in plane B) so that the per-lane float4 reads hit 32 distinct
// banks. Blocks loop over row groups (x is staged once per block).
// Grid: any; block NV_WARPS * 32; dynamic shared memory cols * 4 bytes.

#define NV_ROWS 4
#define NV_WARPS 8

extern "C" __global__ void __launch_bounds__(NV_WARPS * 32)
    matvec_nvfp4(const sb_u8* __restrict__ packed, const sb_u8* __restrict__ scales, float tensor_scale, int rows,
                 int cols, const float* __restrict__ x, float* __restrict__ y) {
    PDL_ENTRY();
    extern __shared__ float4 nv_xs[];
    const int n8 = cols >> 3;  // float4 pairs
    float4* plane_a = nv_xs;
    float4* plane_b = nv_xs + n8;
    const float4* x4 = (const float4*)x;
    for (int m = threadIdx.x; m < n8; m += blockDim.x) {
        plane_a[m] = x4[2 * m];
        plane_b[m] = x4[2 * m + 1];
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long row_bytes = cols >> 1;
    const int scale_row = cols >> 4;
    const int n_chunks = (cols + 255) >> 8;
    // Block scales fold in the tensor scale and the 1/2 of the doubled codes.
    const float ts_half = 0.5f * tensor_scale;
    const int groups = (rows + NV_ROWS - 1) / NV_ROWS;
    for (int grp = blockIdx.x * NV_WARPS + warp; grp < groups; grp += gridDim.x * NV_WARPS) {
        int r0 = grp * NV_ROWS;
        const sb_u32* q[NV_ROWS];
        const sb_u8* s[NV_ROWS];
#pragma unroll
        for (int k = 0; k < NV_ROWS; k++) {
            int r = min(r0 + k, rows - 1);  // duplicate the last row; not stored
            q[k] = (const sb_u32*)(packed + (long)r * row_bytes);
            s[k] = scales + (long)r * scale_row;
        }
        float acc[NV_ROWS];
#pragma unroll
        for (int k = 0; k < NV_ROWS; k++) acc[k] = 0.f;
        for (int c = 0; c < n_chunks; c += 2) {
            sb_u32 w[2][NV_ROWS];
            sb_u32 sc[2][NV_ROWS];
            bool ok[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int e = ((c + h) << 8) + (lane << 3);  // first element of this lane
                ok[h] = (c + h < n_chunks) && (e < cols);
#pragma unroll
                for (int k = 0; k < NV_ROWS; k++) {
                    w[h][k] = ok[h] ? __ldg(q[k] + (e >> 3)) : 0u;
                    sc[h][k] = ok[h] ? (sb_u32)__ldg(s[k] + (e >> 4)) : 0u;
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (!ok[h]) continue;
                int m = ((c + h) << 5) + lane;
                float4 xa = plane_a[m], xb = plane_b[m];
#pragma unroll
                for (int k = 0; k < NV_ROWS; k++) {
                    float lo[4], hi[4];
                    sb_e2m1x4_doubled(w[h][k], lo);
                    sb_e2m1x4_doubled(w[h][k] >> 16, hi);
                    float d = lo[0] * xa.x + lo[1] * xa.y + lo[2] * xa.z + lo[3] * xa.w + hi[0] * xb.x +
                              hi[1] * xb.y + hi[2] * xb.z + hi[3] * xb.w;
                    acc[k] += d * (sb_e4m3(sc[h][k]) * ts_half);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < NV_ROWS; k++) {
            float v = sb_warp_sum(acc[k]);
            if (lane == 0 && r0 + k < rows) y[r0 + k] = v;
        }
    }
}
