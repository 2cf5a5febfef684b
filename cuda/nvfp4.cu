// MIRAGE CUDA kernels: the weight decode helpers the dense mat-vecs and the
// sparse FFN kernels share (both modules include this file before their
// kernels; no headers, so NVRTC needs no include path).
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
