// MIRAGE dense CUDA kernels: one decode/prefill step of the llama family on
// ggml-quantized weights. Compiled at run time by NVRTC (see
// crates/mirage-cuda/src/module.rs); no CUDA headers are included so that
// NVRTC needs no include path.
//
// Block layouts follow ggml (ggml-common.h); the element order of every
// dequantizer is the one of ggml's dequantize_row_* (and of
// mirage_gguf::quant), so a row dequantized here equals the CPU's.
//
// Unit of work: 32 consecutive elements of a row ("unit"). Legacy types have
// one block per unit; K-quants (256-element super-blocks) have 8 units per
// super-block. A mat-vec warp walks the units of one weight row, each lane
// taking every 32nd unit, and reduces with shuffles.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

#define MIRAGE_INF __int_as_float(0x7f800000)

#define TY_F32 0
#define TY_F16 1
#define TY_Q4_0 2
#define TY_Q4_1 3
#define TY_Q5_0 6
#define TY_Q5_1 7
#define TY_Q8_0 8
#define TY_Q2_K 10
#define TY_Q3_K 11
#define TY_Q4_K 12
#define TY_Q5_K 13
#define TY_Q6_K 14
#define TY_BF16 30

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }

__device__ __forceinline__ float warp_sum(float v) { return norm_warp_sum(v); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Bytes per unit (legacy) or per super-block (K-quants).
template <int T> struct Layout;
template <> struct Layout<TY_F32> { enum { BYTES = 128, UNITS = 1 }; };
template <> struct Layout<TY_F16> { enum { BYTES = 64, UNITS = 1 }; };
template <> struct Layout<TY_BF16> { enum { BYTES = 64, UNITS = 1 }; };
template <> struct Layout<TY_Q4_0> { enum { BYTES = 18, UNITS = 1 }; };
template <> struct Layout<TY_Q4_1> { enum { BYTES = 20, UNITS = 1 }; };
template <> struct Layout<TY_Q5_0> { enum { BYTES = 22, UNITS = 1 }; };
template <> struct Layout<TY_Q5_1> { enum { BYTES = 24, UNITS = 1 }; };
template <> struct Layout<TY_Q8_0> { enum { BYTES = 34, UNITS = 1 }; };
template <> struct Layout<TY_Q2_K> { enum { BYTES = 84, UNITS = 8 }; };
template <> struct Layout<TY_Q3_K> { enum { BYTES = 110, UNITS = 8 }; };
template <> struct Layout<TY_Q4_K> { enum { BYTES = 144, UNITS = 8 }; };
template <> struct Layout<TY_Q5_K> { enum { BYTES = 176, UNITS = 8 }; };
template <> struct Layout<TY_Q6_K> { enum { BYTES = 210, UNITS = 8 }; };

// Dequantizes unit `u` of a row starting at `row` into w[0..32).
template <int T> __device__ __forceinline__ void dequant_unit(const u8* row, int u, float* w);

template <> __device__ __forceinline__ void dequant_unit<TY_F32>(const u8* row, int u, float* w) {
    const float4* p = (const float4*)(row + u * 128);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 v = p[i];
        w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
}

template <> __device__ __forceinline__ void dequant_unit<TY_F16>(const u8* row, int u, float* w) {
    const u16* p = (const u16*)(row + u * 64);
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = h2f(p[i]);
}

template <> __device__ __forceinline__ void dequant_unit<TY_BF16>(const u8* row, int u, float* w) {
    const u16* p = (const u16*)(row + u * 64);
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = bf2f(p[i]);
}

template <> __device__ __forceinline__ void dequant_unit<TY_Q8_0>(const u8* row, int u, float* w) {
    const u8* b = row + u * 34;
    float d = h2f(ld16(b));
    const i8* q = (const i8*)(b + 2);
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = d * (float)q[i];
}

template <> __device__ __forceinline__ void dequant_unit<TY_Q4_0>(const u8* row, int u, float* w) {
    const u8* b = row + u * 18;
    float d = h2f(ld16(b));
    const u8* q = b + 2;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        w[i] = d * (float)((int)(q[i] & 15) - 8);
        w[i + 16] = d * (float)((int)(q[i] >> 4) - 8);
    }
}

template <> __device__ __forceinline__ void dequant_unit<TY_Q4_1>(const u8* row, int u, float* w) {
    const u8* b = row + u * 20;
    float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
    const u32* q = (const u32*)(b + 4);  // 20-byte blocks: offset 4 is 4-aligned
#pragma unroll
    for (int k = 0; k < 4; k++) {
        u32 v = q[k];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 byte = (v >> (8 * j)) & 255u;
            w[4 * k + j] = d * (float)(byte & 15) + m;
            w[4 * k + j + 16] = d * (float)(byte >> 4) + m;
        }
    }
}

template <> __device__ __forceinline__ void dequant_unit<TY_Q5_0>(const u8* row, int u, float* w) {
    const u8* b = row + u * 22;
    float d = h2f(ld16(b));
    u32 qh = (u32)b[2] | ((u32)b[3] << 8) | ((u32)b[4] << 16) | ((u32)b[5] << 24);
    const u8* q = b + 6;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        int x0 = (int)((q[j] & 15) | (((qh >> j) << 4) & 0x10)) - 16;
        int x1 = (int)((q[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16;
        w[j] = d * (float)x0;
        w[j + 16] = d * (float)x1;
    }
}

template <> __device__ __forceinline__ void dequant_unit<TY_Q5_1>(const u8* row, int u, float* w) {
    const u8* b = row + u * 24;
    float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
    u32 qh = *(const u32*)(b + 4);
    const u8* q = b + 8;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u32 x0 = (q[j] & 15) | (((qh >> j) << 4) & 0x10);
        u32 x1 = (q[j] >> 4) | ((qh >> (j + 12)) & 0x10);
        w[j] = d * (float)x0 + m;
        w[j + 16] = d * (float)x1 + m;
    }
}

template <> __device__ __forceinline__ void dequant_unit<TY_Q2_K>(const u8* row, int u, float* w) {
    const u8* b = row + (u >> 3) * 84;
    int sub = u & 7, h = sub >> 2, j = sub & 3;
    const u8* scales = b;
    const u8* q = b + 16 + h * 32;
    float d = h2f(ld16(b + 80)), dmin = h2f(ld16(b + 82));
    int shift = 2 * j;
    u8 s0 = scales[h * 8 + 2 * j], s1 = scales[h * 8 + 2 * j + 1];
    float dl0 = d * (float)(s0 & 15), ml0 = dmin * (float)(s0 >> 4);
    float dl1 = d * (float)(s1 & 15), ml1 = dmin * (float)(s1 >> 4);
#pragma unroll
    for (int l = 0; l < 16; l++) {
        w[l] = dl0 * (float)((q[l] >> shift) & 3) - ml0;
        w[l + 16] = dl1 * (float)((q[l + 16] >> shift) & 3) - ml1;
    }
}

// Q3_K super-block: hmask[32], qs[64], scales[12] (sixteen 6-bit scales,
// low nibbles in bytes 0..7, high pairs in bytes 8..11), d (f16). Unit `sub`
// is half h = sub / 4, bit-pair j = sub % 4 (ggml's dequantize_row_q3_K).
template <> __device__ __forceinline__ void dequant_unit<TY_Q3_K>(const u8* row, int u, float* w) {
    const u8* b = row + (u >> 3) * 110;
    int sub = u & 7, h = sub >> 2, j = sub & 3;
    const u8* hm = b;
    const u8* q = b + 32 + h * 32;
    const u8* s = b + 96;
    float d = h2f(ld16(b + 108));
    int shift = 2 * j;
    u32 m = 1u << (h * 4 + j);
    float dl[2];
#pragma unroll
    for (int t = 0; t < 2; t++) {
        int i = h * 8 + 2 * j + t;
        int lo = i < 8 ? (s[i] & 15) : (s[i - 8] >> 4);
        int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        dl[t] = d * (float)((lo | (hi << 4)) - 32);
    }
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int v = (int)((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4);
        w[l] = dl[l >> 4] * (float)v;
    }
}

__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

template <> __device__ __forceinline__ void dequant_unit<TY_Q4_K>(const u8* row, int u, float* w) {
    const u8* b = row + (u >> 3) * 144;
    int sub = u & 7;
    float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
    float sc, m;
    scale_min_k4(sub, b + 4, &sc, &m);
    float d1 = d * sc, m1 = dmin * m;
    const u32* q = (const u32*)(b + 16 + (sub >> 1) * 32);  // 144-byte blocks: 4-aligned
    int shift = (sub & 1) * 4;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        u32 v = q[k];
#pragma unroll
        for (int j = 0; j < 4; j++) w[4 * k + j] = d1 * (float)((v >> (8 * j + shift)) & 15) - m1;
    }
}

template <> __device__ __forceinline__ void dequant_unit<TY_Q5_K>(const u8* row, int u, float* w) {
    const u8* b = row + (u >> 3) * 176;
    int sub = u & 7;
    float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
    float sc, m;
    scale_min_k4(sub, b + 4, &sc, &m);
    float d1 = d * sc, m1 = dmin * m;
    const u8* qh = b + 16;
    const u8* ql = b + 48 + (sub >> 1) * 32;
    int shift = (sub & 1) * 4;
    u32 mask = 1u << sub;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        u32 v = ((ql[l] >> shift) & 15) + ((qh[l] & mask) ? 16 : 0);
        w[l] = d1 * (float)v - m1;
    }
}

template <> __device__ __forceinline__ void dequant_unit<TY_Q6_K>(const u8* row, int u, float* w) {
    const u8* b = row + (u >> 3) * 210;
    int sub = u & 7, h = sub >> 2, k = sub & 3;
    const u8* ql = b + h * 64 + (k & 1) * 32;
    const u8* qh = b + 128 + h * 32;
    const i8* sc = (const i8*)(b + 192 + h * 8);
    float d = h2f(ld16(b + 208));
    int lshift = (k >> 1) * 4, hshift = 2 * k;
    float d0 = d * (float)sc[2 * k], d1 = d * (float)sc[2 * k + 1];
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int q = (int)(((ql[l] >> lshift) & 15) | (((qh[l] >> hshift) & 3) << 4)) - 32;
        w[l] = (l < 16 ? d0 : d1) * (float)q;
    }
}

// y[a, r] = W[r, :] . x[a, :]; grid (ceil(rows / warps), n_act); one warp per
// weight row.
template <int T>
__device__ void matvec(const u8* __restrict__ W, long row_bytes, int rows, int cols, const float* __restrict__ x,
                       float* __restrict__ y) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x >> 5) + warp;
    if (r >= rows) return;
    int a = blockIdx.y;
    const u8* row = W + (long)r * row_bytes;
    const float* xa = x + (long)a * cols;
    int units = cols >> 5;
    float acc = 0.f;
    for (int u = lane; u < units; u += 32) {
        float w[32];
        dequant_unit<T>(row, u, w);
        const float4* xv = (const float4*)(xa + u * 32);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 v = __ldg(xv + i);
            acc += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) y[(long)a * rows + r] = acc;
}

// out[i, :] = dequant(table[tokens[i], :]); grid (n_tokens), block 32 * k.
template <int T>
__device__ void embed(const u8* __restrict__ table, long row_bytes, int n_rows, int cols, const u32* __restrict__ tokens,
                      float* __restrict__ out) {
    u32 t = tokens[blockIdx.x];
    if (t >= (u32)n_rows) return;  // checked on the host
    const u8* row = table + (long)t * row_bytes;
    float* o = out + (long)blockIdx.x * cols;
    for (int u = threadIdx.x; u < (cols >> 5); u += blockDim.x) {
        float w[32];
        dequant_unit<T>(row, u, w);
#pragma unroll
        for (int i = 0; i < 32; i++) o[u * 32 + i] = w[i];
    }
}

#define INSTANCE(NAME, T)                                                                                           \
    extern "C" __global__ void matvec_##NAME(const u8* W, long row_bytes, int rows, int cols, const float* x,       \
                                             float* y) { PDL_ENTRY();                                                \
        matvec<T>(W, row_bytes, rows, cols, x, y);                                                                  \
    }                                                                                                               \
    extern "C" __global__ void embed_##NAME(const u8* table, long row_bytes, int n_rows, int cols, const u32* tokens, \
                                            float* out) { PDL_ENTRY();                                               \
        embed<T>(table, row_bytes, n_rows, cols, tokens, out);                                                      \
    }

INSTANCE(f32, TY_F32)
INSTANCE(f16, TY_F16)
INSTANCE(bf16, TY_BF16)
INSTANCE(q4_0, TY_Q4_0)
INSTANCE(q4_1, TY_Q4_1)
INSTANCE(q5_0, TY_Q5_0)
INSTANCE(q5_1, TY_Q5_1)
INSTANCE(q8_0, TY_Q8_0)
INSTANCE(q2_k, TY_Q2_K)
INSTANCE(q3_k, TY_Q3_K)
INSTANCE(q4_k, TY_Q4_K)
INSTANCE(q5_k, TY_Q5_K)
INSTANCE(q6_k, TY_Q6_K)

// Block-wide sum over blockDim.x (a multiple of 32, at most 1024) threads.
__device__ float block_sum(float v, float* shared32) { return norm_block_sum(v, shared32); }

__device__ float block_max(float v, float* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    float t = lane < nw ? shared32[lane] : -MIRAGE_INF;
    return warp_max(t);
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w; grid (rows), block 256.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float eps, int width,
                                    float* __restrict__ out) {
    PDL_ENTRY();
    __shared__ float s32[32];
    float* o = out + (long)blockIdx.x * width;
    rms_norm_row(x + (long)blockIdx.x * width, w, eps, width, s32, [&](int i, float v) { o[i] = v; });
}

// x[i] += b[i % width]
extern "C" __global__ void add_bias(float* x, const float* __restrict__ b, int width, long n) {
    PDL_ENTRY();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % width];
}

// acc[i] += x[i]
extern "C" __global__ void add_inplace(float* acc, const float* __restrict__ x, long n) {
    PDL_ENTRY();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += x[i];
}

// Cross-op weight prefetch (CudaBackend::prefetch; the runtime hints which
// weights a kernel a few launches later reads): asks L2 for up to three
// regions [p, p + n) while the kernels in between leave DRAM idle (the decode
// attention; the second half of an FFN, whose pages are read by few blocks
// at a time). Weights only, so nothing waits for them. It lets its
// dependents launch first, so the next kernel starts as it would without
// this one, and it completes only after its own prerequisite has (its
// pdl_wait last): the next kernel's wait then covers both. With
// MIRAGE_XPF_EVICT_LAST the lines are fetched with the evict-last priority,
// so that the streaming reads in between evict each other first. Block b
// takes the b-th of gridDim.x line-aligned shares of each region (the
// regions are device allocations, so p is aligned); unused regions are
// (null, 0).
#ifdef MIRAGE_XPF_EVICT_LAST
#define XPF_EVICT_LAST true
#else
#define XPF_EVICT_LAST false
#endif
__device__ __forceinline__ void l2_prefetch_share(const char* p, long n) {
    const long share = ((n + gridDim.x - 1) / gridDim.x + 127) & ~127L;
    const long at = (long)blockIdx.x * share;
    if (at < n) l2_prefetch_block<XPF_EVICT_LAST>(p + at, min(share, n - at));
}

extern "C" __global__ void l2_prefetch(const char* p0, long n0, const char* p1, long n1, const char* p2, long n2) {
    pdl_trigger();
    l2_prefetch_share(p0, n0);
    l2_prefetch_share(p1, n1);
    l2_prefetch_share(p2, n2);
    pdl_wait();
}

// h[i] = silu(g[i]) * u[i]
extern "C" __global__ void swiglu(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ h,
                                  long n) {
    PDL_ENTRY();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = g[i];
        h[i] = v / (1.f + expf(-v)) * u[i];
    }
}

// out[i, :] = x[idx[i], :]; grid (n_out), block 256.
extern "C" __global__ void gather_rows(const float* __restrict__ x, const u32* __restrict__ idx, int width,
                                       float* __restrict__ out) {
    PDL_ENTRY();
    const float* src = x + (long)idx[blockIdx.x] * width;
    float* dst = out + (long)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// KV-cache element access: f32 or f16 (stored as raw u16 bits).
__device__ __forceinline__ float kv_load(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float kv_load(const u16* p, long i) { return h2f(p[i]); }
__device__ __forceinline__ void kv_store(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void kv_store(u16* p, long i, float v) { p[i] = f2h(v); }
// kv_load in two steps, for loads that must all be in flight before the
// first value is used (att_load_keys): the element as stored, then as f32.
__device__ __forceinline__ float kv_widen(float v) { return v; }
__device__ __forceinline__ float kv_widen(u16 v) { return h2f(v); }
// What kv_load returns after kv_store(p, i, v): v as the cache holds it.
__device__ __forceinline__ float kv_round(const float*, float v) { return v; }
__device__ __forceinline__ float kv_round(const u16*, float v) { return h2f(f2h(v)); }

// RoPE of pair i of a head (elements ia, ib: neox halves or adjacent) at
// position pos, rope_store's arithmetic (shared with attend_rope, so both
// give the same bits).
// Split in two so that attend_rope_pre can take the angle before its PDL
// wait (it depends on the position only).
__device__ __forceinline__ void rope_angle(int i, int pos, int head_dim, float freq_base, float* c, float* s) {
    // The angle in double, as the CPU reference builds its tables.
    double theta = (double)pos * pow((double)freq_base, -2.0 * (double)i / (double)head_dim);
    *c = (float)cos(theta);
    *s = (float)sin(theta);
}
__device__ __forceinline__ void rope_turn(float a, float b, float c, float s, float* ra, float* rb) {
    // No FMA contraction: a * s + b * c may contract into either fma(a, s,
    // b * c) or fma(b, c, a * s), and NVRTC picked differently for the same
    // source inlined into rope_store and into attend_rope (measured: the
    // folded decode's logits differed on the H200). Rounded products, then
    // the sum: one result wherever this is inlined.
    *ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    *rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}
__device__ __forceinline__ void rope_rotate(float a, float b, int i, int pos, int head_dim, float freq_base, float* ra,
                                            float* rb) {
    float c, s;
    rope_angle(i, pos, head_dim, freq_base, &c, &s);
    rope_turn(a, b, c, s, ra, rb);
}

// Optional per-head RMSNorm (qwen3) and RoPE of every q and k head of every
// row, then the k and v heads are stored into the cache at the row's slot.
// slots[2 * row] = seq, slots[2 * row + 1] = pos (read from device memory, so
// a recorded step replays for any position). Grid (rows, n_head +
// n_head_kv), block head_dim / 2 (one thread per rotated pair).
// Cache layout per layer: [n_seq, n_head_kv, n_ctx, head_dim] of KV.
template <typename KV>
__device__ void rope_store(float* q, float* k, const float* __restrict__ v, const int* __restrict__ slots, int n_head,
                           int n_head_kv, int head_dim, int neox, float freq_base, const float* qn, const float* kn,
                           float norm_eps, KV* kc, KV* vc, int n_ctx) {
    __shared__ float s32[32];
    int row = blockIdx.x, hh = blockIdx.y, i = threadIdx.x, half = head_dim >> 1;
    int seq = slots[2 * row], pos = slots[2 * row + 1];
    bool is_q = hh < n_head;
    int head = is_q ? hh : hh - n_head;
    float* x = is_q ? q + ((long)row * n_head + head) * head_dim : k + ((long)row * n_head_kv + head) * head_dim;
    int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    float a = x[ia], b = x[ib];
    const float* nw = is_q ? qn : kn;
    if (nw != 0) {
        float ss = block_sum(a * a + b * b, s32);
        float scale = rsqrtf(ss / (float)head_dim + norm_eps);
        a = a * scale * nw[ia];
        b = b * scale * nw[ib];
    }
    float ra, rb;
    rope_rotate(a, b, i, pos, head_dim, freq_base, &ra, &rb);
    x[ia] = ra;
    x[ib] = rb;
    if (!is_q) {
        long at = (((long)seq * n_head_kv + head) * n_ctx + pos) * head_dim;
        kv_store(kc, at + ia, ra);
        kv_store(kc, at + ib, rb);
        const float* vr = v + ((long)row * n_head_kv + head) * head_dim;
        kv_store(vc, at + ia, vr[ia]);
        kv_store(vc, at + ib, vr[ib]);
    }
}

// Split-K ("flash-decoding") causal attention, part 1. Grid (rows, n_head,
// n_split), block ATT_THREADS. Block (row, head, s) attends the query head
// over positions [s * c, min((s + 1) * c, pos + 1)) of the row's
// sequence, c = att_chunk(pos + 1, n_split, chunk) (below), with an online softmax in tiles of ATT_TILE keys, and writes its
// running max m, its sum l and its unnormalised V sum to
// part[((row * n_head + head) * n_split + s) * (head_dim + 2) + {0, 1, 2..}].
// The grid depends only on the batch and the cache size, never on the
// position (read from device memory): a recorded step replays at any length.
// Scores: one warp per key. V sum: blockDim / head_dim groups of head_dim
// threads take every G-th key of a tile; groups are added at the end.
#define ATT_THREADS 256
#define ATT_TILE 64
// Keys per warp batch of the scores, elements of a key per lane (head_dim
// <= ATT_THREADS), V rows per batch of the weighted sum (attend_part).
// (Measured on the H200, sixth session: 8 keys per batch with the tile's V
// rows loaded before the scores was no faster, 7B sparse 40 % step 3.09 vs
// 2.93 ms in the same call; not kept.)
#define ATT_KB 4
#define ATT_HD_LANE (ATT_THREADS / 32)
#define ATT_VB 8
// Keys of a row's split blocks, chosen on the device from the row's length
// n (the grid is fixed for graph replay; n comes from `slots`): the least
// chunk that covers n with the launch's n_split blocks, at least
// MIRAGE_ATT_MIN_KEYS and at most the host's chunk = ceil(n_ctx / n_split).
// Why: with the host's chunk alone, a short sequence (a decode at position
// 80 of a 4096-position cache: chunk 114) is ONE block per head walking every
// key in dependent load batches (the 7B ncu table: 13.5 us a layer for ~80
// positions); at 16 keys a block every split block does one batch of keys
// and one of values, in parallel. Long sequences spread evenly over all the
// splits instead of filling the first ones. 0 keeps the host's chunk
// (`MIRAGE_CUDA_ATT_KEYS=0`, the previous schedule, for A/B runs). Every
// decode-attention kernel (attend_part, attend_rope, attend_combine, the
// fused merge) uses this one function, so they agree on the split of each
// row and stay bit-equal to one another.
#ifndef MIRAGE_ATT_MIN_KEYS
#define MIRAGE_ATT_MIN_KEYS 16
#endif
__device__ __forceinline__ int att_chunk(int n, int n_split, int chunk) {
    if (MIRAGE_ATT_MIN_KEYS <= 0) return chunk;
    return min(chunk, max(MIRAGE_ATT_MIN_KEYS, (n + n_split - 1) / n_split));
}
// Which (row, head, split) of a split attention a block computes, out of
// n_split splits: its grid position in the attention kernels (the default
// argument), or a work item of the attention block kernel (attn_block, one
// persistent grid for Q/K/V, attention and O), which runs the same code for
// the same items: the same bits.
struct AttIdx {
    int row, head, split, n_split;
};
__device__ __forceinline__ AttIdx att_grid_idx() {
    return AttIdx{(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z, (int)gridDim.z};
}

// The first loads of attend_part_with for block (row, head, split): this
// warp's first batch of keys and this thread's first batch of values of the
// split's first tile, with the same predicates (zeros where the loop would
// not load). attend_rope_pre reads them BEFORE its PDL wait: every position
// but the row's new one was written by earlier steps, and the new one is
// replaced by the staged copy (psub) exactly as when the loop loads it.
struct AttPre {
    float kx[ATT_KB][ATT_HD_LANE];
    float vx[ATT_VB];
};

// This lane's ATT_HD_LANE elements of the ATT_KB keys of warp batch jb of
// the tile at t0 (tile rows jb, jb + nw, ...; zeros past the tile's cnt
// rows or the head), every load issued before any product. One function
// for attend_part_with's loop and att_preload, so the preload reads
// exactly what the loop would. cnt >= 1; every lane of the warp calls it
// with the same jb (the key loop is warp-uniform).
// How the loads stay in flight together (SASS read with nvdisasm, sm_90):
// written as `jj < cnt && e < head_dim ? kv_load(..) : 0`, ptxas issued
// them one to three at a time, each f16 key's conversion (and the reuse of
// its register) waiting for the load before the next went out: a chain of
// round trips per batch. So the raw elements are loaded unconditionally at
// clamped (in-range, already-read) addresses (only a warp-uniform test skips
// the elements past a short head), a __syncwarp separates them from their
// uses, and the conversion and the zeroing follow: the same values (host
// check: hostcheck/check_attend.cpp). In the SASS of that form 29-31 key
// loads go out before the first conversion; the fence steers ptxas, it does
// not bind it (a version with per-lane predicates left 15 loads after it),
// so read the SASS again after changing this code. The default since the
// thirteenth session (H200, ncu median of 280 decode launches of the 7B
// shape: attend_rope_f16 11.87 -> 10.05 us; sparse 40 % step 2.755 / 2.759
// -> 2.663 / 2.667 ms, alternating processes); MIRAGE_CUDA_ATT_LOADS=serial
// at start (MIRAGE_ATT_LOADS_BATCH 0) restores the predicated form.
#ifndef MIRAGE_ATT_LOADS_BATCH
#define MIRAGE_ATT_LOADS_BATCH 1
#endif
template <typename KV>
__device__ __forceinline__ void att_load_keys(const KV* K, int t0, int jb, int cnt, int nw, int lane, int head_dim,
                                              float (&kx)[ATT_KB][ATT_HD_LANE]) {
    if (!MIRAGE_ATT_LOADS_BATCH) {
#pragma unroll
        for (int u = 0; u < ATT_KB; u++) {
            const int jj = jb + u * nw;
            const long kr = (long)(t0 + jj) * head_dim;
#pragma unroll
            for (int t = 0; t < ATT_HD_LANE; t++) {
                const int e = lane + 32 * t;
                kx[u][t] = jj < cnt && e < head_dim ? kv_load(K, kr + e) : 0.f;
            }
        }
        return;
    }
    KV raw[ATT_KB][ATT_HD_LANE];
#pragma unroll
    for (int u = 0; u < ATT_KB; u++) {
        const long kr = (long)(t0 + min(jb + u * nw, cnt - 1)) * head_dim;
#pragma unroll
        for (int t = 0; t < ATT_HD_LANE; t++)  // (a warp-uniform test: no loads past a short head)
            raw[u][t] = 32 * t < head_dim ? K[kr + min(lane + 32 * t, head_dim - 1)] : KV(0);
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < ATT_KB; u++)
#pragma unroll
        for (int t = 0; t < ATT_HD_LANE; t++)
            kx[u][t] = jb + u * nw < cnt && lane + 32 * t < head_dim ? kv_widen(raw[u][t]) : 0.f;
}

// This thread's element d of the ATT_VB values of batch jb of the tile at
// t0 (tile rows jb, jb + groups, ...; zeros past cnt), as att_load_keys
// (cnt >= 1). The warp fence only where every warp lies in one group of
// head_dim threads (head_dim % 32 == 0: then the warp's lanes share jb and
// the loop's trip count); otherwise the loads are left to ptxas.
template <typename KV>
__device__ __forceinline__ void att_load_values(const KV* V, int t0, int jb, int cnt, int groups, int d, int head_dim,
                                                float (&vx)[ATT_VB]) {
    if (!MIRAGE_ATT_LOADS_BATCH) {
#pragma unroll
        for (int u = 0; u < ATT_VB; u++) {
            const int jj = jb + u * groups;
            vx[u] = jj < cnt ? kv_load(V, (long)(t0 + jj) * head_dim + d) : 0.f;
        }
        return;
    }
    KV raw[ATT_VB];
#pragma unroll
    for (int u = 0; u < ATT_VB; u++) raw[u] = V[(long)(t0 + min(jb + u * groups, cnt - 1)) * head_dim + d];
    if (head_dim % 32 == 0) __syncwarp();
#pragma unroll
    for (int u = 0; u < ATT_VB; u++) vx[u] = jb + u * groups < cnt ? kv_widen(raw[u]) : 0.f;
}

template <typename KV>
__device__ __forceinline__ void att_preload(const KV* kc, const KV* vc, int seq, int n, int kvh, int n_head_kv,
                                            int head_dim, int n_ctx, int chunk, AttPre& p, AttIdx ix = att_grid_idx()) {
    chunk = att_chunk(n, ix.n_split, chunk);
    const int j0 = ix.split * chunk, cnt = min(ATT_TILE, min(n, j0 + chunk) - j0);
    const KV* K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    const KV* V = vc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int groups = blockDim.x / head_dim, g = threadIdx.x / head_dim, d = threadIdx.x % head_dim;
    // A split past the row's last position (cnt <= 0) returns before its
    // loop; its preload reads nothing.
    if (cnt > 0) {
        att_load_keys(K, j0, warp, cnt, nw, lane, head_dim, p.kx);
    } else {
#pragma unroll
        for (int u = 0; u < ATT_KB; u++)
#pragma unroll
            for (int t = 0; t < ATT_HD_LANE; t++) p.kx[u][t] = 0.f;
    }
    if (g < groups && cnt > 0) {
        att_load_values(V, j0, g, cnt, groups, d, head_dim, p.vx);
    } else {
#pragma unroll
        for (int u = 0; u < ATT_VB; u++) p.vx[u] = 0.f;
    }
}

// attend_part_with: the same, with the query head staged by load_q(qs) (a
// copy from q, or attend_rope's rotated copy) and, when psub >= 0, the key
// and value of position psub taken from ksub / vsub (shared memory, as the
// cache will hold them) instead of the cache, which the same launch writes.
// PRE: the first batches come from *pre (att_preload) instead of loads.
template <typename KV, typename LoadQ, bool PRE = false>
__device__ void attend_part_with(LoadQ load_q, const KV* __restrict__ kc, const KV* __restrict__ vc,
                                 const int* __restrict__ slots, int n_head, int n_head_kv, int head_dim, int n_ctx,
                                 int chunk, float scale, const float* ksub, const float* vsub, int psub,
                                 float* __restrict__ part, const AttPre* pre = nullptr, AttIdx ix = att_grid_idx()) {
    __shared__ float qs[ATT_THREADS];
    __shared__ float sc[ATT_TILE];
    __shared__ float red[ATT_THREADS];
    __shared__ float lred[ATT_THREADS / 64];
    int row = ix.row, head = ix.head, split = ix.split, n_split = ix.n_split;
    int seq = slots[2 * row], n = slots[2 * row + 1] + 1;
    chunk = att_chunk(n, n_split, chunk);
    int j0 = split * chunk, j1 = min(n, j0 + chunk);
    if (j0 >= j1) return;  // the combine step skips splits past the position
    int kvh = head / (n_head / n_head_kv);
    load_q(qs);
    const KV* K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    const KV* V = vc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int groups = blockDim.x / head_dim, g = threadIdx.x / head_dim, d = threadIdx.x % head_dim;
    float m = -MIRAGE_INF, l = 0.f, acc = 0.f;
    __syncthreads();
    for (int t0 = j0; t0 < j1; t0 += ATT_TILE) {
        int cnt = min(ATT_TILE, j1 - t0);
        // Warp w scores keys w, w + nw, ... as before, ATT_KB of them per
        // batch with every load of the batch issued before the first
        // product: one memory round trip per ATT_KB keys, not per key (a
        // decode step's attention is a chain of such round trips). Same
        // products and sums per key, in the same order: the same bits.
        for (int jb = warp; jb < cnt; jb += ATT_KB * nw) {
            float kx[ATT_KB][ATT_HD_LANE];
            if (PRE && t0 == j0 && jb == warp) {
#pragma unroll
                for (int u = 0; u < ATT_KB; u++)
#pragma unroll
                    for (int t = 0; t < ATT_HD_LANE; t++) kx[u][t] = pre->kx[u][t];
            } else {
                att_load_keys(K, t0, jb, cnt, nw, lane, head_dim, kx);
            }
#pragma unroll
            for (int u = 0; u < ATT_KB; u++)
#pragma unroll
                for (int t = 0; t < ATT_HD_LANE; t++)
                    if (t0 + jb + u * nw == psub && lane + 32 * t < head_dim) kx[u][t] = ksub[lane + 32 * t];
#pragma unroll
            for (int u = 0; u < ATT_KB; u++) {
                const int jj = jb + u * nw;
                float s = 0.f;
#pragma unroll
                for (int t = 0; t < ATT_HD_LANE; t++) {
                    const int e = lane + 32 * t;
                    if (e < head_dim) s += qs[e] * kx[u][t];
                }
                s = warp_sum(s);
                if (lane == 0 && jj < cnt) sc[jj] = s * scale;
            }
        }
        __syncthreads();
        // The tile's max by every warp at once (lanes, then shuffles), not
        // one thread reading every score in turn: the same value (max does
        // not depend on the order).
        float tm = -MIRAGE_INF;
        for (int jj = lane; jj < cnt; jj += 32) tm = fmaxf(tm, sc[jj]);
        tm = warp_max(tm);
        float nm = fmaxf(m, tm);
        float f = expf(m - nm);  // 0 on the first tile (m = -inf)
        __syncthreads();         // every thread has read the raw scores
        if (threadIdx.x < cnt) sc[threadIdx.x] = expf(sc[threadIdx.x] - nm);
        __syncthreads();
        acc *= f;
        l *= f;
        m = nm;
        if (g < groups) {
            // Keys g, g + groups, ... in batches of ATT_VB loads (as the
            // scores above; same order of the sums).
            for (int jb = g; jb < cnt; jb += ATT_VB * groups) {
                float vx[ATT_VB];
                if (PRE && t0 == j0 && jb == g) {
#pragma unroll
                    for (int u = 0; u < ATT_VB; u++) vx[u] = pre->vx[u];
                } else {
                    att_load_values(V, t0, jb, cnt, groups, d, head_dim, vx);
                }
#pragma unroll
                for (int u = 0; u < ATT_VB; u++)
                    if (t0 + jb + u * groups == psub) vx[u] = vsub[d];
#pragma unroll
                for (int u = 0; u < ATT_VB; u++) {
                    const int jj = jb + u * groups;
                    if (jj < cnt) {
                        const float p = sc[jj];
                        acc += p * vx[u];
                        l += p;
                    }
                }
            }
        }
        __syncthreads();  // before the next tile overwrites sc
    }
    if (g < groups) {
        red[g * head_dim + d] = acc;
        if (d == 0) lred[g] = l;
    }
    __syncthreads();
    float* P = part + (((long)row * n_head + head) * n_split + split) * (head_dim + 2);
    for (int e = threadIdx.x; e < head_dim; e += blockDim.x) {
        float a = 0.f;
        for (int k = 0; k < groups; k++) a += red[k * head_dim + e];
        P[2 + e] = a;
    }
    if (threadIdx.x == 0) {
        float ls = 0.f;
        for (int k = 0; k < groups; k++) ls += lred[k];
        P[0] = m;
        P[1] = ls;
    }
}

template <typename KV>
__device__ void attend_part(const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
                            const int* __restrict__ slots, int n_head, int n_head_kv, int head_dim, int n_ctx,
                            int chunk, float scale, float* __restrict__ part) {
    const float* qh = q + ((long)blockIdx.x * n_head + blockIdx.y) * head_dim;
    attend_part_with<KV>(
        [&](float* qs) {
            for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qh[d];
        },
        kc, vc, slots, n_head, n_head_kv, head_dim, n_ctx, chunk, scale, (const float*)0, (const float*)0, -1, part);
}

// Decode rows' RoPE and KV store folded into the split attention (one
// launch fewer per layer; MIRAGE_CUDA_ROPE_FUSE=0 keeps rope_store): block
// (row, head, split) rotates its query head itself, and the block of the
// last split (the one holding position pos, the row's new key) rotates the
// row's key head and stages it and the value head, rounded as the cache
// stores them, in shared memory; it attends position pos from there, since
// the cache slot is written in the same launch (by the block of the first
// query head of the KV group). Everything else is attend_part's. The same
// bits as rope_store then attend_part: the same rotation (rope_rotate) and
// the same values per key. Only for batches whose rows are in different
// sequences (a row never attends another row's new key) and without the
// per-head q/k norm (the host checks both). Grid and block as attend_part;
// head_dim <= ATT_THREADS.
// PRE (attend_rope_pre): the kernel's PDL wait is here, after the position,
// this thread's RoPE angle and the first key and value batches (att_preload)
// are read: none of them depends on the previous kernel.
// CG: q, k and v were written by other blocks of the same grid (attn_block):
// they are read through L2 (__ldcg), never through a non-coherent cache.
template <bool CG>
__device__ __forceinline__ float att_in(const float* p) {
    if constexpr (CG) return __ldcg(p);
    return *p;
}
template <typename KV, bool PRE = false, bool CG = false>
__device__ void attend_rope_part(const float* __restrict__ q, const float* __restrict__ k,
                                 const float* __restrict__ v, KV* kc, KV* vc, const int* __restrict__ slots,
                                 int n_head, int n_head_kv, int head_dim, int n_ctx, int chunk, float scale, int neox,
                                 float freq_base, float* __restrict__ part, AttIdx ix = att_grid_idx()) {
    __shared__ float qr[ATT_THREADS], kr[ATT_THREADS], vr[ATT_THREADS];
    const int row = ix.row, head = ix.head, half = head_dim >> 1;
    const int seq = slots[2 * row], pos = slots[2 * row + 1];
    const int kvh = head / (n_head / n_head_kv);
    // The split of position pos is the last one with positions.
    const bool has_new = ix.split == pos / att_chunk(pos + 1, ix.n_split, chunk);
    const bool stores = has_new && head % (n_head / n_head_kv) == 0;
    const float* qh = q + ((long)row * n_head + head) * head_dim;
    const float* kh = k + ((long)row * n_head_kv + kvh) * head_dim;
    const float* vh = v + ((long)row * n_head_kv + kvh) * head_dim;
    const long at = (((long)seq * n_head_kv + kvh) * n_ctx + pos) * head_dim;
    AttPre pre;
    float pc = 0.f, ps = 0.f;  // PRE: pair threadIdx.x's angle
    if constexpr (PRE) {
        if ((int)threadIdx.x < half) rope_angle(threadIdx.x, pos, head_dim, freq_base, &pc, &ps);
        att_preload<KV>(kc, vc, seq, pos + 1, kvh, n_head_kv, head_dim, n_ctx, chunk, pre, ix);
        PDL_ENTRY();
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        float c, s, ra, rb;
        if (PRE && i == (int)threadIdx.x) {
            c = pc;
            s = ps;
        } else {
            rope_angle(i, pos, head_dim, freq_base, &c, &s);
        }
        rope_turn(att_in<CG>(qh + ia), att_in<CG>(qh + ib), c, s, &ra, &rb);
        qr[ia] = ra;
        qr[ib] = rb;
        if (has_new) {
            rope_turn(att_in<CG>(kh + ia), att_in<CG>(kh + ib), c, s, &ra, &rb);
            const float va = att_in<CG>(vh + ia), vb = att_in<CG>(vh + ib);
            kr[ia] = kv_round(kc, ra);
            kr[ib] = kv_round(kc, rb);
            vr[ia] = kv_round(vc, va);
            vr[ib] = kv_round(vc, vb);
            if (stores) {
                kv_store(kc, at + ia, ra);
                kv_store(kc, at + ib, rb);
                kv_store(vc, at + ia, va);
                kv_store(vc, at + ib, vb);
            }
        }
    }
    __syncthreads();
    auto load_q = [&](float* qs) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qr[d];
    };
    attend_part_with<KV, decltype(load_q), PRE>(load_q, kc, vc, slots, n_head, n_head_kv, head_dim, n_ctx, chunk,
                                                scale, kr, vr, has_new ? pos : -1, part, &pre, ix);
}

// Split-K attention, part 2: out[row, head, :] = sum_s e^(m_s - M) acc_s /
// sum_s e^(m_s - M) l_s over the splits that hold positions of the row.
// Grid (rows, n_head), block head_dim.
// Output element d of (row, head) from the ns splits' partials P (the
// combine's arithmetic, shared by attend_combine and attend_fused; __ldcg:
// in attend_fused other blocks of the same grid wrote P).
// The loops are unrolled so that their independent loads go out together
// (a decode merges up to n_split partials); the sums keep their order.
__device__ __forceinline__ float attend_merge(const float* P, int ns, int head_dim, int d) {
    float M = -MIRAGE_INF;
#pragma unroll 8
    for (int s = 0; s < ns; s++) M = fmaxf(M, __ldcg(P + s * (head_dim + 2)));
    float L = 0.f, a = 0.f;
#pragma unroll 8
    for (int s = 0; s < ns; s++) {
        const float* ps = P + s * (head_dim + 2);
        float w = expf(__ldcg(ps) - M);
        L += w * __ldcg(ps + 1);
        a += w * __ldcg(ps + 2 + d);
    }
    return a / L;
}

extern "C" __global__ void attend_combine(const float* __restrict__ part, const int* __restrict__ slots, int n_head,
                                          int head_dim, int n_split, int chunk, float* __restrict__ out) {
    PDL_ENTRY();
    int row = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    int n = slots[2 * row + 1] + 1;
    chunk = att_chunk(n, n_split, chunk);
    int ns = min(n_split, (n + chunk - 1) / chunk);
    const float* P = part + ((long)row * n_head + head) * n_split * (head_dim + 2);
    out[((long)row * n_head + head) * head_dim + d] = attend_merge(P, ns, head_dim, d);
}

// attend_part, then the combine in the same launch: the last of the ns
// splits of (row, head) to finish (per-(row, head) arrival counter, reset by
// that block, so it is zero again for the next launch) merges the partials
// with attend_combine's arithmetic: the same bits as the two launches, one
// dependent launch fewer per layer. count: rows * n_head u32, zero at first
// use. Grid and block as attend_part. part_fn() runs the block's split
// (attend_part, or attend_rope_part for attend_rope). Returns whether this
// block merged (wrote out for its (row, head)); every thread gets the same.
template <typename PartFn>
__device__ bool attend_then_merge(PartFn part_fn, const int* slots, int n_head, int head_dim, int chunk, float* part,
                                  unsigned* count, float* out, AttIdx ix = att_grid_idx()) {
    __shared__ int last;
    const int row = ix.row, head = ix.head, n_split = ix.n_split;
    const int n = slots[2 * row + 1] + 1;
    chunk = att_chunk(n, n_split, chunk);
    const int ns = min(n_split, (n + chunk - 1) / chunk);
    if (ix.split >= ns) return false;  // attend_part's empty splits
    part_fn();
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* c = count + (long)row * n_head + head;
        last = atomicAdd(c, 1u) == (unsigned)ns - 1;
        if (last) *c = 0u;  // every split of this (row, head) has arrived
    }
    __syncthreads();
    if (!last) return false;
    __threadfence();
    const float* P = part + ((long)row * n_head + head) * n_split * (head_dim + 2);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
        out[((long)row * n_head + head) * head_dim + d] = attend_merge(P, ns, head_dim, d);
    return true;
}


// Tiled causal attention for a prefill batch: the batch rows are consecutive
// positions of one sequence (the host checks), so a block takes PF_ROWS of
// them for one query head and streams the keys and values once for all of
// them through shared memory (the split-K decode kernel reads every key once
// per row: at 32k positions and 512-row chunks that is the prefill's cost).
// Grid (ceil(n / PF_ROWS), n_head), block PF_THREADS = 16 x PF_ROWS threads;
// thread t serves row t / 16 and, of that row, keys t % 16 and t % 16 + 16
// of a PF_KEYS-key tile and output dims t % 16 + 16 i. Online softmax per row
// (rows beyond a row's position are masked; key 0 is in every row's range, so
// the first tile makes each row's running max finite). head_dim <= PF_MAX_HD,
// a multiple of 16. Exact arithmetic differs from attend_part only in the
// order of the sums.
#define PF_ROWS 16
#define PF_KEYS 32
#define PF_THREADS (16 * PF_ROWS)
#define PF_MAX_HD 128
template <typename KV>
__device__ void attend_prefill(const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
                               const int* __restrict__ slots, int n, int n_head, int n_head_kv, int head_dim,
                               int n_ctx, float scale, float* __restrict__ out) {
    __shared__ float qs[PF_ROWS][PF_MAX_HD];
    __shared__ float ks[PF_KEYS][PF_MAX_HD + 1];
    __shared__ float vs[PF_KEYS][PF_MAX_HD];
    __shared__ float ps[PF_ROWS][PF_KEYS];
    int r0 = blockIdx.x * PF_ROWS, head = blockIdx.y;
    int t = threadIdx.x, r = t >> 4, c = t & 15;
    int rows = min(PF_ROWS, n - r0);
    int seq = slots[2 * r0];
    int my_pos = r < rows ? slots[2 * (r0 + r) + 1] : -1;
    int last = slots[2 * (r0 + rows - 1) + 1];  // the tile's largest position
    int kvh = head / (n_head / n_head_kv);
    for (int i = t; i < PF_ROWS * head_dim; i += PF_THREADS) {
        int rr = i / head_dim, d = i % head_dim;
        qs[rr][d] = rr < rows ? q[((long)(r0 + rr) * n_head + head) * head_dim + d] : 0.f;
    }
    const KV* K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    const KV* V = vc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    float acc[PF_MAX_HD / 16];
#pragma unroll
    for (int i = 0; i < PF_MAX_HD / 16; i++) acc[i] = 0.f;
    float m = -MIRAGE_INF, l = 0.f;
    int nd = head_dim >> 4;
    for (int k0 = 0; k0 <= last; k0 += PF_KEYS) {
        int cnt = min(PF_KEYS, last + 1 - k0);
        __syncthreads();  // the previous tile is consumed (and qs is written)
        for (int i = t; i < cnt * head_dim; i += PF_THREADS) {
            int kk = i / head_dim, d = i % head_dim;
            long at = (long)(k0 + kk) * head_dim + d;
            ks[kk][d] = kv_load(K, at);
            vs[kk][d] = kv_load(V, at);
        }
        __syncthreads();
        float s[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int kk = c + 16 * h;
            float a = 0.f;
            if (kk < cnt && k0 + kk <= my_pos) {
                for (int e = 0; e < head_dim; e++) a += qs[r][e] * ks[kk][e];
                s[h] = a * scale;
            } else {
                s[h] = -MIRAGE_INF;
            }
        }
        float tm = fmaxf(s[0], s[1]);
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o, 16));
        float nm = fmaxf(m, tm);
        // nm is finite for a live row from the first tile on (key 0); padding
        // rows (my_pos = -1) keep -inf and are never written.
        float f = nm == -MIRAGE_INF ? 1.f : expf(m - nm);
        float p0 = s[0] == -MIRAGE_INF ? 0.f : expf(s[0] - nm);
        float p1 = s[1] == -MIRAGE_INF ? 0.f : expf(s[1] - nm);
        float ts = p0 + p1;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) ts += __shfl_xor_sync(0xffffffffu, ts, o, 16);
        l = l * f + ts;
        m = nm;
        ps[r][c] = p0;
        ps[r][c + 16] = p1;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < PF_MAX_HD / 16; i++) {
            if (i < nd) {
                int d = c + 16 * i;
                float a = acc[i] * f;
                for (int kk = 0; kk < cnt; kk++) a += ps[r][kk] * vs[kk][d];
                acc[i] = a;
            }
        }
    }
    if (r < rows) {
        float* o = out + ((long)(r0 + r) * n_head + head) * head_dim;
#pragma unroll
        for (int i = 0; i < PF_MAX_HD / 16; i++)
            if (i < nd) o[c + 16 * i] = acc[i] / l;
    }
}

#define KV_INSTANCE(NAME, KV)                                                                                       \
    extern "C" __global__ void rope_store_##NAME(float* q, float* k, const float* v, const int* slots, int n_head,  \
                                                 int n_head_kv, int head_dim, int neox, float freq_base,            \
                                                 const float* qn, const float* kn, float norm_eps, KV* kc, KV* vc,  \
                                                 int n_ctx) { PDL_ENTRY();                                           \
        rope_store<KV>(q, k, v, slots, n_head, n_head_kv, head_dim, neox, freq_base, qn, kn, norm_eps, kc, vc,     \
                       n_ctx);                                                                                      \
    }                                                                                                               \
    extern "C" __global__ void attend_part_##NAME(const float* q, const KV* kc, const KV* vc, const int* slots,     \
                                                  int n_head, int n_head_kv, int head_dim, int n_ctx, int chunk,    \
                                                  float scale, float* part) { PDL_ENTRY();                           \
        attend_part<KV>(q, kc, vc, slots, n_head, n_head_kv, head_dim, n_ctx, chunk, scale, part);                 \
    }                                                                                                               \
    extern "C" __global__ void attend_fused_##NAME(const float* q, const KV* kc, const KV* vc, const int* slots,    \
                                                   int n_head, int n_head_kv, int head_dim, int n_ctx, int chunk,   \
                                                   float scale, float* part, unsigned* count, float* out) {         \
        PDL_ENTRY();                                                                                                \
        attend_then_merge(                                                                                          \
            [&] { attend_part<KV>(q, kc, vc, slots, n_head, n_head_kv, head_dim, n_ctx, chunk, scale, part); },      \
            slots, n_head, head_dim, chunk, part, count, out);                                                      \
    }                                                                                                               \
    /* attend_fused's arguments, then the rows' unrotated k and v and the RoPE's mode and base. */             \
    extern "C" __global__ void attend_rope_##NAME(const float* q, KV* kc, KV* vc, const int* slots, int n_head,     \
                                                  int n_head_kv, int head_dim, int n_ctx, int chunk, float scale,   \
                                                  float* part, unsigned* count, float* out, const float* k,         \
                                                  const float* v, int neox, float freq_base) {                      \
        PDL_ENTRY();                                                                                                \
        attend_then_merge(                                                                                          \
            [&] {                                                                                                   \
                attend_rope_part<KV>(q, k, v, kc, vc, slots, n_head, n_head_kv, head_dim, n_ctx, chunk, scale,     \
                                     neox, freq_base, part);                                                        \
            },                                                                                                      \
            slots, n_head, head_dim, chunk, part, count, out);                                                      \
    }                                                                                                               \
    /* attend_rope with the position, RoPE angle and first K/V batches read before the PDL wait (the same */ \
    /* bits; MIRAGE_CUDA_PRELOAD). Blocks past the row's last split exit without waiting. */                \
    extern "C" __global__ void attend_rope_pre_##NAME(const float* q, KV* kc, KV* vc, const int* slots, int n_head, \
                                                      int n_head_kv, int head_dim, int n_ctx, int chunk,            \
                                                      float scale, float* part, unsigned* count, float* out,        \
                                                      const float* k, const float* v, int neox, float freq_base) {  \
        attend_then_merge(                                                                                          \
            [&] {                                                                                                   \
                attend_rope_part<KV, true>(q, k, v, kc, vc, slots, n_head, n_head_kv, head_dim, n_ctx, chunk,      \
                                           scale, neox, freq_base, part);                                           \
            },                                                                                                      \
            slots, n_head, head_dim, chunk, part, count, out);                                                      \
    }                                                                                                               \
    extern "C" __global__ void attend_prefill_##NAME(const float* q, const KV* kc, const KV* vc, const int* slots,  \
                                                     int n, int n_head, int n_head_kv, int head_dim, int n_ctx,     \
                                                     float scale, float* out) { PDL_ENTRY();                         \
        attend_prefill<KV>(q, kc, vc, slots, n, n_head, n_head_kv, head_dim, n_ctx, scale, out);                   \
    }

KV_INSTANCE(f32, float)
KV_INSTANCE(f16, u16)

// wh[r - r0, :] = f16(dequant(W[r, :])) for r in [r0, r0 + gridDim.x): the
// weight tile a tensor-core GEMM multiplies. Block 128.
template <int T>
__device__ void dequant_f16(const u8* __restrict__ W, long row_bytes, int cols, int r0, u16* __restrict__ wh) {
    const u8* row = W + (long)(r0 + blockIdx.x) * row_bytes;
    u16* o = wh + (long)blockIdx.x * cols;
    for (int u = threadIdx.x; u < (cols >> 5); u += blockDim.x) {
        float w[32];
        dequant_unit<T>(row, u, w);
#pragma unroll
        for (int i = 0; i < 32; i++) o[u * 32 + i] = f2h(w[i]);
    }
}

#define DEQUANT_INSTANCE(NAME, T)                                                                                  \
    extern "C" __global__ void dequant_f16_##NAME(const u8* W, long row_bytes, int cols, int r0, u16* wh) { PDL_ENTRY(); \
        dequant_f16<T>(W, row_bytes, cols, r0, wh);                                                                \
    }

DEQUANT_INSTANCE(f32, TY_F32)
DEQUANT_INSTANCE(f16, TY_F16)
DEQUANT_INSTANCE(bf16, TY_BF16)
DEQUANT_INSTANCE(q4_0, TY_Q4_0)
DEQUANT_INSTANCE(q4_1, TY_Q4_1)
DEQUANT_INSTANCE(q5_0, TY_Q5_0)
DEQUANT_INSTANCE(q5_1, TY_Q5_1)
DEQUANT_INSTANCE(q8_0, TY_Q8_0)
DEQUANT_INSTANCE(q2_k, TY_Q2_K)
DEQUANT_INSTANCE(q3_k, TY_Q3_K)
DEQUANT_INSTANCE(q4_k, TY_Q4_K)
DEQUANT_INSTANCE(q5_k, TY_Q5_K)
DEQUANT_INSTANCE(q6_k, TY_Q6_K)

// y[i] = f16(x[i])
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, u16* __restrict__ y, long n) {
    PDL_ENTRY();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2h(x[i]);
}

// idx[r] = argmax(x[r, :]) (first maximum); grid (rows), block 1024.
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int width, u32* __restrict__ idx) {
    PDL_ENTRY();
    __shared__ float bv[32];
    __shared__ int bi[32];
    const float* xr = x + (long)blockIdx.x * width;
    float best = -MIRAGE_INF;
    int besti = 0x7fffffff;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = xr[i];
        if (v > best) { best = v; besti = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, besti, o);
        if (ov > best || (ov == best && oi < besti)) { best = ov; besti = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { bv[warp] = best; bi[warp] = besti; }
    __syncthreads();
    if (warp == 0) {
        best = lane < nw ? bv[lane] : -MIRAGE_INF;
        besti = lane < nw ? bi[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, besti, o);
            if (ov > best || (ov == best && oi < besti)) { best = ov; besti = oi; }
        }
        if (lane == 0) idx[blockIdx.x] = (u32)besti;
    }
}

// ===========================================================================
// Decode fast path (CudaBackend's default; MIRAGE_CUDA_FAST=0 keeps the
// kernels above). This file is compiled after nvfp4.cu (module.rs), whose
// sb_* decode helpers these kernels share with the sparse path.
//
// Weight layouts, chosen at upload:
//   ggml  : the file's blocks, read by dequant_unit<T> as above.
//   q8_0s : split Q8_0 (superblock.cu): quants [rows][cols] int8, then block
//           scales [rows][cols/32] f16. Lane l reads the 32-bit word l of
//           each 128-element chunk: one coalesced 128-byte line per warp load.
//   nvfp4 : the CPU codec's NVFP4 (mirage_gguf::quant::nvfp4): packed E2M1
//           codes [rows][cols/2], then E4M3 scales [rows][cols/16]; the f32
//           tensor scale is a kernel argument. Lane l reads word l of each
//           256-element chunk (128 bytes per row per warp load).
//
// Fusions (fewer dependent launches per layer):
//   mv3_*  : up to three products of the same input (Q, K, V) in one launch;
//            a single product passes rows1 = rows2 = 0. Blocks
//            [0, b0) take matrix 0, [b0, b0 + b1) matrix 1, the rest matrix 2.
//   ffn_*  : gate and up products of one row and silu(g) * u in one kernel.
// Grids stay fixed for a given shape (graph-replayable); gridDim.y = rows of
// the activation batch.
// ===========================================================================

#define FAST_WARPS 8   // warps per block
#define FAST_ROWS 4    // weight rows per warp (q8_0s, nvfp4)
#define Q8S_UNROLL 4   // 128-element chunks in flight per row (q8_0s)

__device__ __forceinline__ int pick3(int bx, int per_block, int rows0, int rows1, int* m) {
    int b0 = (rows0 + per_block - 1) / per_block, b1 = (rows1 + per_block - 1) / per_block;
    if (bx < b0) { *m = 0; return bx; }
    bx -= b0;
    if (bx < b1) { *m = 1; return bx; }
    *m = 2;
    return bx - b1;
}

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

// Output element (a, r) of a mat-vec with its optional epilogues, in the
// old ops' order: y = W x, then y += bias, then res += y.
__device__ __forceinline__ void mv_store(float v, float* y, const float* bias, float* rs, int a, int rows, int r) {
    if (bias != 0) v += bias[r];
    long i = (long)a * rows + r;
    y[i] = v;
    if (rs != 0) rs[i] += v;
}

// This lane's share of the dot products of NR split-Q8_0 rows (quants q[k],
// scales s[k]) with xa[0..cols); the caller reduces over the warp.
template <int NR>
__device__ __forceinline__ void q8s_dot(const u8* const* q, const u16* const* s, const float* __restrict__ xa, int cols,
                                        int lane, float* acc) {
    const int n_chunks = (cols + 127) >> 7;
    for (int c = 0; c < n_chunks; c += Q8S_UNROLL) {
        u32 w[Q8S_UNROLL][NR];
        u16 sc[Q8S_UNROLL][NR];
#pragma unroll
        for (int h = 0; h < Q8S_UNROLL; h++) {
            int e = ((c + h) << 7) + (lane << 2);
            bool ok = e < cols;  // implies c + h < n_chunks
#pragma unroll
            for (int k = 0; k < NR; k++) {
                w[h][k] = ok ? __ldg((const u32*)(q[k] + e)) : 0u;
                sc[h][k] = ok ? __ldg(s[k] + (e >> 5)) : (u16)0;
            }
        }
#pragma unroll
        for (int h = 0; h < Q8S_UNROLL; h++) {
            int e = ((c + h) << 7) + (lane << 2);
            if (e >= cols) continue;
            float4 xv = *(const float4*)(xa + e);
#pragma unroll
            for (int k = 0; k < NR; k++) {
                float f[4];
                sb_q8x4(w[h][k], f);
                acc[k] += h2f(sc[h][k]) * (f[0] * xv.x + f[1] * xv.y + f[2] * xv.z + f[3] * xv.w);
            }
        }
    }
}

// This lane's share of NR NVFP4 rows (codes q[k] as words, scales s[k]) dotted
// with xa, in units of (E2M1 doubled) x (E4M3 scale): the caller multiplies
// by tensor_scale / 2.
template <int NR>
__device__ __forceinline__ void nvfp4_dot(const u32* const* q, const u8* const* s, const float* __restrict__ xa,
                                          int cols, int lane, float* acc) {
    const int n_chunks = (cols + 255) >> 8;
    for (int c = 0; c < n_chunks; c += 2) {
        u32 w[2][NR], sc[2][NR];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int e = ((c + h) << 8) + (lane << 3);
            bool ok = e < cols;
#pragma unroll
            for (int k = 0; k < NR; k++) {
                w[h][k] = ok ? __ldg(q[k] + (e >> 3)) : 0u;
                sc[h][k] = ok ? (u32)__ldg(s[k] + (e >> 4)) : 0u;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int e = ((c + h) << 8) + (lane << 3);
            if (e >= cols) continue;
            float4 xa4 = *(const float4*)(xa + e), xb4 = *(const float4*)(xa + e + 4);
#pragma unroll
            for (int k = 0; k < NR; k++) {
                float lo[4], hi[4];
                sb_e2m1x4_doubled(w[h][k], lo);
                sb_e2m1x4_doubled(w[h][k] >> 16, hi);
                float d = lo[0] * xa4.x + lo[1] * xa4.y + lo[2] * xa4.z + lo[3] * xa4.w + hi[0] * xb4.x +
                          hi[1] * xb4.y + hi[2] * xb4.z + hi[3] * xb4.w;
                acc[k] += d * sb_e4m3(sc[h][k]);
            }
        }
    }
}

// One lane's share of W[row] . xa on a ggml-layout row (the old matvec's
// loop, same order, so results equal matvec_<T> bit for bit). xa may be in
// global or shared memory (norm-fused launches), so x loads are generic.
template <int T>
__device__ __forceinline__ float ggml_row_dot(const u8* row, const float* __restrict__ xa, int cols, int lane) {
    int units = cols >> 5;
    float acc = 0.f;
    for (int u = lane; u < units; u += 32) {
        float w[32];
        dequant_unit<T>(row, u, w);
        const float4* xv = (const float4*)(xa + u * 32);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 v = xv[i];
            acc += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
        }
    }
    return acc;
}

// Epilogues (set by the backend when it folds the next op into a recorded
// step; null otherwise): bias_m adds a bias to matrix m's outputs, res adds
// matrix 0's outputs into a residual stream (y is written as well).
#define MV3_PARAMS                                                                                                   \
    const u8 *W0, const u8 *W1, const u8 *W2, int rows0, int rows1, int rows2, long row_bytes, int cols,          \
        const float *x, float *y0, float *y1, float *y2, float ts0, float ts1, float ts2, const float *bias0,       \
        const float *bias1, const float *bias2, float *res, const float *nx, const float *nw, float neps, float *nout
#define MV3_ARGS                                                                                                     \
    W0, W1, W2, rows0, rows1, rows2, row_bytes, cols, x, y0, y1, y2, ts0, ts1, ts2, bias0, bias1, bias2, res, nx, nw, \
        neps, nout
#define FFN_PARAMS                                                                                                   \
    const u8 *Wg, const u8 *Wu, int rows, long row_bytes, int cols, const float *x, float *h, float ts_g, float ts_u,  \
        const float *nx, const float *nw, float neps, float *nout

// RMSNorm folded into a mat-vec (nx != null; the backend sets it when the
// norm's only reader is this launch): the block normalizes activation row
// a of nx into shared memory (dynamic, cols floats) through rms_norm_row,
// the rms_norm kernel's arithmetic (256 threads both), and the dot reads it from there;
// blocks with blockIdx.x == 0 also write the norm's output row to nout, so
// the buffer holds what the unfused norm would have written. Every thread of
// the block must call it (block-wide reduction) before any early return.
extern __shared__ float fused_norm_xs[];
__device__ const float* norm_prologue(const float* nx, const float* nw, float eps, float* nout, int cols, int a) {
    __shared__ float s32[32];
    float* o = blockIdx.x == 0 && nout != 0 ? nout + (long)a * cols : (float*)0;
    rms_norm_row(nx + (long)a * cols, nw, eps, cols, s32, [&](int i, float v) {
        fused_norm_xs[i] = v;
        if (o != 0) o[i] = v;
    });
    __syncthreads();
    return fused_norm_xs;
}

// Activation row a = blockIdx.y of x, or of the folded norm's output.
#define FAST_INPUT                                                                                                   \
    int a = blockIdx.y;                                                                                              \
    const float* xa = nx != 0 ? norm_prologue(nx, nw, neps, nout, cols, a) : x + (long)a * cols;

#define MV3_PICK(PER_BLOCK)                                                                                          \
    MV3_PICK_W(PER_BLOCK)                                                                                            \
    FAST_INPUT

// MV3_PICK without reading the input: this block's matrix and row group.
#define MV3_PICK_W(PER_BLOCK)                                                                                        \
    MV3_MATRIX(blockIdx.x, PER_BLOCK)                                                                                \
    (void)row_bytes;                                                                                                 \
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

// Row group T of a launch over three matrices (mv3's numbering): its
// matrix's weights, rows, output, tensor scale, bias and residual, and its
// index bx within that matrix.
#define MV3_MATRIX(T, PER_BLOCK)                                                                                     \
    int m;                                                                                                           \
    int bx = pick3(T, PER_BLOCK, rows0, rows1, &m);                                                                  \
    const u8* W = m == 0 ? W0 : m == 1 ? W1 : W2;                                                                    \
    int rows = m == 0 ? rows0 : m == 1 ? rows1 : rows2;                                                              \
    float* y = m == 0 ? y0 : m == 1 ? y1 : y2;                                                                       \
    float ts = m == 0 ? ts0 : m == 1 ? ts1 : ts2;                                                                    \
    const float* bias = m == 0 ? bias0 : m == 1 ? bias1 : bias2;                                                     \
    float* rs = m == 0 ? res : (float*)0;                                                                            \
    (void)ts;

// ggml layout: one warp per row, FAST_WARPS rows per block.
template <int T>
__device__ void mv3_ggml(MV3_PARAMS) {
    MV3_PICK(FAST_WARPS)
    int r = bx * FAST_WARPS + warp;
    if (r >= rows) return;
    float acc = warp_sum(ggml_row_dot<T>(W + (long)r * row_bytes, xa, cols, lane));
    if (lane == 0) mv_store(acc, y, bias, rs, a, rows, r);
}

template <int T>
__device__ void ffn_ggml(FFN_PARAMS) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    FAST_INPUT
    int r = blockIdx.x * FAST_WARPS + warp;
    if (r >= rows) return;
    float g = warp_sum(ggml_row_dot<T>(Wg + (long)r * row_bytes, xa, cols, lane));
    float u = warp_sum(ggml_row_dot<T>(Wu + (long)r * row_bytes, xa, cols, lane));
    if (lane == 0) h[(long)a * rows + r] = silu_mul(g, u);
}

#define FAST_INSTANCE(NAME, T)                                                                                       \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_##NAME(MV3_PARAMS) { PDL_ENTRY();               \
        mv3_ggml<T>(MV3_ARGS);                                                                                       \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_##NAME(FFN_PARAMS) { PDL_ENTRY();               \
        ffn_ggml<T>(Wg, Wu, rows, row_bytes, cols, x, h, ts_g, ts_u, nx, nw, neps, nout);                            \
    }

FAST_INSTANCE(f32, TY_F32)
FAST_INSTANCE(f16, TY_F16)
FAST_INSTANCE(bf16, TY_BF16)
FAST_INSTANCE(q4_0, TY_Q4_0)
FAST_INSTANCE(q4_1, TY_Q4_1)
FAST_INSTANCE(q5_0, TY_Q5_0)
FAST_INSTANCE(q5_1, TY_Q5_1)
FAST_INSTANCE(q8_0, TY_Q8_0)
FAST_INSTANCE(q2_k, TY_Q2_K)
FAST_INSTANCE(q3_k, TY_Q3_K)
FAST_INSTANCE(q4_k, TY_Q4_K)
FAST_INSTANCE(q5_k, TY_Q5_K)
FAST_INSTANCE(q6_k, TY_Q6_K)

// Split Q8_0: FAST_ROWS rows per warp (they share the x loads).
extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_q8_0s(MV3_PARAMS) {
    PDL_ENTRY();
    MV3_PICK(FAST_WARPS * FAST_ROWS)
    int r0 = (bx * FAST_WARPS + warp) * FAST_ROWS;
    if (r0 >= rows) return;
    const u16* scales = (const u16*)(W + (long)rows * cols);
    const u8* q[FAST_ROWS];
    const u16* s[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) {
        int r = min(r0 + k, rows - 1);  // duplicate the last row; not stored
        q[k] = W + (long)r * cols;
        s[k] = scales + (long)r * (cols >> 5);
    }
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    q8s_dot<FAST_ROWS>(q, s, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) {
        float v = warp_sum(acc[k]);
        if (lane == 0 && r0 + k < rows) mv_store(v, y, bias, rs, a, rows, r0 + k);
    }
}

// Split Q8_0 gate/up/SwiGLU: FAST_ROWS / 2 channels per warp (their gate and
// up rows are the warp's FAST_ROWS rows).
extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_q8_0s(FFN_PARAMS) {
    PDL_ENTRY();
    const int NC = FAST_ROWS / 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    FAST_INPUT
    int r0 = (blockIdx.x * FAST_WARPS + warp) * NC;
    if (r0 >= rows) return;
    const u16* sg = (const u16*)(Wg + (long)rows * cols);
    const u16* su = (const u16*)(Wu + (long)rows * cols);
    const u8* q[FAST_ROWS];
    const u16* s[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int r = min(r0 + k, rows - 1);
        q[k] = Wg + (long)r * cols;
        s[k] = sg + (long)r * (cols >> 5);
        q[NC + k] = Wu + (long)r * cols;
        s[NC + k] = su + (long)r * (cols >> 5);
    }
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    q8s_dot<FAST_ROWS>(q, s, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < NC; k++) {
        float g = warp_sum(acc[k]), u = warp_sum(acc[NC + k]);
        if (lane == 0 && r0 + k < rows) h[(long)a * rows + r0 + k] = silu_mul(g, u);
    }
}

extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_nvfp4(MV3_PARAMS) {
    PDL_ENTRY();
    MV3_PICK(FAST_WARPS * FAST_ROWS)
    int r0 = (bx * FAST_WARPS + warp) * FAST_ROWS;
    if (r0 >= rows) return;
    const u8* scales = W + (long)rows * (cols >> 1);
    const u32* q[FAST_ROWS];
    const u8* s[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) {
        int r = min(r0 + k, rows - 1);
        q[k] = (const u32*)(W + (long)r * (cols >> 1));
        s[k] = scales + (long)r * (cols >> 4);
    }
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    nvfp4_dot<FAST_ROWS>(q, s, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) {
        float v = warp_sum(acc[k]);
        if (lane == 0 && r0 + k < rows) mv_store(v * (0.5f * ts), y, bias, rs, a, rows, r0 + k);
    }
}

extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_nvfp4(FFN_PARAMS) {
    PDL_ENTRY();
    const int NC = FAST_ROWS / 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    FAST_INPUT
    int r0 = (blockIdx.x * FAST_WARPS + warp) * NC;
    if (r0 >= rows) return;
    const u8* sg = Wg + (long)rows * (cols >> 1);
    const u8* su = Wu + (long)rows * (cols >> 1);
    const u32* q[FAST_ROWS];
    const u8* s[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int r = min(r0 + k, rows - 1);
        q[k] = (const u32*)(Wg + (long)r * (cols >> 1));
        s[k] = sg + (long)r * (cols >> 4);
        q[NC + k] = (const u32*)(Wu + (long)r * (cols >> 1));
        s[NC + k] = su + (long)r * (cols >> 4);
    }
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    nvfp4_dot<FAST_ROWS>(q, s, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < NC; k++) {
        float g = warp_sum(acc[k]) * (0.5f * ts_g), u = warp_sum(acc[NC + k]) * (0.5f * ts_u);
        if (lane == 0 && r0 + k < rows) h[(long)a * rows + r0 + k] = silu_mul(g, u);
    }
}

// Element i of row r of a repacked matrix, as f32.
__device__ __forceinline__ float q8s_elem(const u8* W, int rows, int cols, long r, int i) {
    const u16* scales = (const u16*)(W + (long)rows * cols);
    return h2f(scales[r * (cols >> 5) + (i >> 5)]) * (float)((const i8*)W)[r * cols + i];
}

__device__ __forceinline__ float e2m1_f32(u32 c) {
    u32 m = c & 7u;
    float v = m < 4u ? 0.5f * (float)m : (m == 4u ? 2.f : m == 5u ? 3.f : m == 6u ? 4.f : 6.f);
    return (c & 8u) ? -v : v;
}

__device__ __forceinline__ float nvfp4_elem(const u8* W, int rows, int cols, float ts, long r, int i) {
    u32 code = (W[r * (cols >> 1) + (i >> 1)] >> (4 * (i & 1))) & 15u;
    u32 sc = W[(long)rows * (cols >> 1) + r * (cols >> 4) + (i >> 4)];
    // The CPU codec's order: code value times (block scale times tensor scale).
    return e2m1_f32(code) * (sb_e4m3(sc) * ts);
}

// Embedding rows of repacked tables; grid (n_tokens), block 128.
extern "C" __global__ void embed_q8_0s(const u8* W, int n_rows, int cols, const u32* tokens, float* out) {
    PDL_ENTRY();
    u32 t = tokens[blockIdx.x];
    if (t >= (u32)n_rows) return;  // checked on the host
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(long)blockIdx.x * cols + i] = q8s_elem(W, n_rows, cols, t, i);
}

extern "C" __global__ void embed_nvfp4(const u8* W, int n_rows, int cols, float ts, const u32* tokens, float* out) {
    PDL_ENTRY();
    u32 t = tokens[blockIdx.x];
    if (t >= (u32)n_rows) return;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        out[(long)blockIdx.x * cols + i] = nvfp4_elem(W, n_rows, cols, ts, t, i);
}

// GEMM weight tiles of repacked matrices: wh[r - r0, :] for r in [r0, r0 +
// gridDim.x); block 128.
extern "C" __global__ void dequant_f16_q8_0s(const u8* W, int rows, int cols, int r0, u16* wh) {
    PDL_ENTRY();
    long r = r0 + blockIdx.x;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        wh[(long)blockIdx.x * cols + i] = f2h(q8s_elem(W, rows, cols, r, i));
}

extern "C" __global__ void dequant_f16_nvfp4(const u8* W, int rows, int cols, float ts, int r0, u16* wh) {
    PDL_ENTRY();
    long r = r0 + blockIdx.x;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        wh[(long)blockIdx.x * cols + i] = f2h(nvfp4_elem(W, rows, cols, ts, r, i));
}

// ---------------------------------------------------------------------------
// Split Q4_K ("q4_ks"): the 128 quant bytes of every super-block, [rows]
// [cols/2], then the 16 header bytes of every super-block (d, dmin, 12 packed
// 6-bit scales/mins), [rows][cols/256][16]. Same bytes as ggml. Lane l reads
// the 32-bit word l of a super-block's quants (one 128-byte line per warp
// load): bytes 4(l%8)..+3 of group j = l/8, i.e. elements 64j + 4(l%8) + i
// (low nibbles, sub-block 2j) and 64j + 32 + 4(l%8) + i (high nibbles,
// sub-block 2j + 1); the header is one broadcast 16-byte load.

// Byte i (0..11) of the packed scales held in header words y, z, w.
__device__ __forceinline__ u32 q4k_scale_byte(uint4 h, int i) {
    u32 word = i < 4 ? h.y : (i < 8 ? h.z : h.w);
    return (word >> (8 * (i & 3))) & 255u;
}

// Scale and min of sub-block s of a header (ggml's get_scale_min_k4).
__device__ __forceinline__ void q4k_scale_min(uint4 h, int s, float* sc, float* m) {
    if (s < 4) {
        *sc = (float)(q4k_scale_byte(h, s) & 63u);
        *m = (float)(q4k_scale_byte(h, s + 4) & 63u);
    } else {
        *sc = (float)((q4k_scale_byte(h, s + 4) & 15u) | ((q4k_scale_byte(h, s - 4) >> 6) << 4));
        *m = (float)((q4k_scale_byte(h, s + 4) >> 4) | ((q4k_scale_byte(h, s) >> 6) << 4));
    }
}

template <int NR>
__device__ __forceinline__ void q4ks_dot(const u8* const* q, const u8* const* meta, const float* __restrict__ xa,
                                         int cols, int lane, float* acc) {
    const int n_sb = cols >> 8;
    const int j = lane >> 3, off = 64 * j + ((lane & 7) << 2);
    for (int c = 0; c < n_sb; c += 2) {
        u32 w[2][NR];
        uint4 hd[2][NR];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            bool ok = c + h < n_sb;
#pragma unroll
            for (int k = 0; k < NR; k++) {
                w[h][k] = ok ? __ldg((const u32*)(q[k] + ((c + h) << 7) + (lane << 2))) : 0u;
                hd[h][k] = ok ? __ldg((const uint4*)(meta[k] + ((c + h) << 4))) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (c + h >= n_sb) continue;
            const float* xs = xa + ((c + h) << 8) + off;
            float4 xl = *(const float4*)xs, xh = *(const float4*)(xs + 32);
            float sxl = xl.x + xl.y + xl.z + xl.w, sxh = xh.x + xh.y + xh.z + xh.w;
#pragma unroll
            for (int k = 0; k < NR; k++) {
                u32 lo = w[h][k] & 0x0f0f0f0fu, hi = (w[h][k] >> 4) & 0x0f0f0f0fu;
                float ql[4], qh[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    ql[i] = sb_byte_f32(lo, i, 8388608.0f);  // 2^23
                    qh[i] = sb_byte_f32(hi, i, 8388608.0f);
                }
                float dl = ql[0] * xl.x + ql[1] * xl.y + ql[2] * xl.z + ql[3] * xl.w;
                float dh = qh[0] * xh.x + qh[1] * xh.y + qh[2] * xh.z + qh[3] * xh.w;
                uint4 hh = hd[h][k];
                float d = h2f((u16)(hh.x & 0xffffu)), dmin = h2f((u16)(hh.x >> 16));
                float sc0, m0, sc1, m1;
                q4k_scale_min(hh, 2 * j, &sc0, &m0);
                q4k_scale_min(hh, 2 * j + 1, &sc1, &m1);
                acc[k] += d * (sc0 * dl + sc1 * dh) - dmin * (m0 * sxl + m1 * sxh);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_q4_ks(MV3_PARAMS) {
    PDL_ENTRY();
    MV3_PICK(FAST_WARPS * FAST_ROWS)
    int r0 = (bx * FAST_WARPS + warp) * FAST_ROWS;
    if (r0 >= rows) return;
    const u8* meta = W + (long)rows * (cols >> 1);
    const u8* q[FAST_ROWS];
    const u8* mt[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) {
        int r = min(r0 + k, rows - 1);
        q[k] = W + (long)r * (cols >> 1);
        mt[k] = meta + (long)r * (cols >> 4);
    }
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    q4ks_dot<FAST_ROWS>(q, mt, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) {
        float v = warp_sum(acc[k]);
        if (lane == 0 && r0 + k < rows) mv_store(v, y, bias, rs, a, rows, r0 + k);
    }
}

extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_q4_ks(FFN_PARAMS) {
    PDL_ENTRY();
    const int NC = FAST_ROWS / 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    FAST_INPUT
    int r0 = (blockIdx.x * FAST_WARPS + warp) * NC;
    if (r0 >= rows) return;
    const u8* mg = Wg + (long)rows * (cols >> 1);
    const u8* mu = Wu + (long)rows * (cols >> 1);
    const u8* q[FAST_ROWS];
    const u8* mt[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int r = min(r0 + k, rows - 1);
        q[k] = Wg + (long)r * (cols >> 1);
        mt[k] = mg + (long)r * (cols >> 4);
        q[NC + k] = Wu + (long)r * (cols >> 1);
        mt[NC + k] = mu + (long)r * (cols >> 4);
    }
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    q4ks_dot<FAST_ROWS>(q, mt, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < NC; k++) {
        float g = warp_sum(acc[k]), u = warp_sum(acc[NC + k]);
        if (lane == 0 && r0 + k < rows) h[(long)a * rows + r0 + k] = silu_mul(g, u);
    }
}

// Element i of row r of a split-Q4_K matrix (dequant_unit<TY_Q4_K>'s
// arithmetic).
__device__ __forceinline__ float q4ks_elem(const u8* W, int rows, int cols, long r, int i) {
    int sb = i >> 8, e = i & 255, j = e >> 6, hi = (e >> 5) & 1, l = e & 31;
    u32 byte = W[r * (cols >> 1) + ((long)sb << 7) + 32 * j + l];
    u32 qv = hi ? (byte >> 4) : (byte & 15u);
    const u8* hp = W + (long)rows * (cols >> 1) + r * (cols >> 4) + ((long)sb << 4);
    uint4 hh = *(const uint4*)hp;
    float d = h2f((u16)(hh.x & 0xffffu)), dmin = h2f((u16)(hh.x >> 16));
    float sc, m;
    q4k_scale_min(hh, 2 * j + hi, &sc, &m);
    float d1 = d * sc, m1 = dmin * m;
    return d1 * (float)qv - m1;
}

extern "C" __global__ void embed_q4_ks(const u8* W, int n_rows, int cols, const u32* tokens, float* out) {
    PDL_ENTRY();
    u32 t = tokens[blockIdx.x];
    if (t >= (u32)n_rows) return;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(long)blockIdx.x * cols + i] = q4ks_elem(W, n_rows, cols, t, i);
}

extern "C" __global__ void dequant_f16_q4_ks(const u8* W, int rows, int cols, int r0, u16* wh) {
    PDL_ENTRY();
    long r = r0 + blockIdx.x;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        wh[(long)blockIdx.x * cols + i] = f2h(q4ks_elem(W, rows, cols, r, i));
}

// ---------------------------------------------------------------------------
// Split Q5_0 ("q5_0s"): the 16 quant bytes of every block [rows][cols/2],
// then the 32-bit high-bit words [rows][cols/32], then the f16 scales
// [rows][cols/32]. Same bytes as ggml. Lane l reads the 32-bit word l of a
// 128-byte line of quants (8 blocks, 256 elements): block l/4, bytes
// j = 4(l%4)..+3, i.e. elements j (low nibbles, high bit j of qh) and j + 16
// (high nibbles, high bit j + 16).
template <int NR>
__device__ __forceinline__ void q5s_dot(const u8* const* q, const u32* const* qh, const u16* const* s,
                                        const float* __restrict__ xa, int cols, int lane, float* acc) {
    const int n_chunks = (cols + 255) >> 8;
    const int blk = lane >> 2, t = lane & 3;
    for (int c = 0; c < n_chunks; c += 2) {
        u32 w[2][NR], hb[2][NR];
        u16 sc[2][NR];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int b = ((c + h) << 3) + blk;  // block index in the row
            bool ok = (b << 5) < cols;
#pragma unroll
            for (int k = 0; k < NR; k++) {
                w[h][k] = ok ? __ldg((const u32*)(q[k] + ((c + h) << 7) + (lane << 2))) : 0u;
                hb[h][k] = ok ? __ldg(qh[k] + b) : 0u;
                sc[h][k] = ok ? __ldg(s[k] + b) : (u16)0;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int b = ((c + h) << 3) + blk;
            if ((b << 5) >= cols) continue;
            const float* xs = xa + (b << 5) + (t << 2);
            float4 xl = *(const float4*)xs, xh = *(const float4*)(xs + 16);
#pragma unroll
            for (int k = 0; k < NR; k++) {
                u32 hl = hb[h][k] >> (t << 2), hh = hb[h][k] >> ((t << 2) + 16);
                u32 lo = w[h][k] & 0x0f0f0f0fu, hi = (w[h][k] >> 4) & 0x0f0f0f0fu;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    lo |= ((hl >> i) & 1u) << (8 * i + 4);
                    hi |= ((hh >> i) & 1u) << (8 * i + 4);
                }
                float ql[4], qv[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    ql[i] = sb_byte_f32(lo, i, 8388624.0f);  // 2^23 + 16: q - 16
                    qv[i] = sb_byte_f32(hi, i, 8388624.0f);
                }
                float dsum = ql[0] * xl.x + ql[1] * xl.y + ql[2] * xl.z + ql[3] * xl.w + qv[0] * xh.x + qv[1] * xh.y +
                             qv[2] * xh.z + qv[3] * xh.w;
                acc[k] += h2f(sc[h][k]) * dsum;
            }
        }
    }
}

#define Q5S_ROW_PTRS(W, rows, r, k, q, qh, s)                                                                        \
    q[k] = W + (long)(r) * (cols >> 1);                                                                              \
    qh[k] = (const u32*)(W + (long)(rows) * (cols >> 1)) + (long)(r) * (cols >> 5);                                  \
    s[k] = (const u16*)(W + (long)(rows) * (cols >> 1) + (long)(rows) * (cols >> 3)) + (long)(r) * (cols >> 5);

extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_q5_0s(MV3_PARAMS) {
    PDL_ENTRY();
    MV3_PICK(FAST_WARPS * FAST_ROWS)
    int r0 = (bx * FAST_WARPS + warp) * FAST_ROWS;
    if (r0 >= rows) return;
    const u8* q[FAST_ROWS];
    const u32* qh[FAST_ROWS];
    const u16* s[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) {
        int r = min(r0 + k, rows - 1);
        Q5S_ROW_PTRS(W, rows, r, k, q, qh, s)
    }
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    q5s_dot<FAST_ROWS>(q, qh, s, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) {
        float v = warp_sum(acc[k]);
        if (lane == 0 && r0 + k < rows) mv_store(v, y, bias, rs, a, rows, r0 + k);
    }
}

extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_q5_0s(FFN_PARAMS) {
    PDL_ENTRY();
    const int NC = FAST_ROWS / 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    FAST_INPUT
    int r0 = (blockIdx.x * FAST_WARPS + warp) * NC;
    if (r0 >= rows) return;
    const u8* q[FAST_ROWS];
    const u32* qh[FAST_ROWS];
    const u16* s[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int r = min(r0 + k, rows - 1);
        Q5S_ROW_PTRS(Wg, rows, r, k, q, qh, s)
        Q5S_ROW_PTRS(Wu, rows, r, NC + k, q, qh, s)
    }
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    q5s_dot<FAST_ROWS>(q, qh, s, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < NC; k++) {
        float g = warp_sum(acc[k]), u = warp_sum(acc[NC + k]);
        if (lane == 0 && r0 + k < rows) h[(long)a * rows + r0 + k] = silu_mul(g, u);
    }
}

// Element i of row r of a split-Q5_0 matrix (dequant_unit<TY_Q5_0>'s
// arithmetic).
__device__ __forceinline__ float q5s_elem(const u8* W, int rows, int cols, long r, int i) {
    long b = r * (cols >> 5) + (i >> 5);
    int e = i & 31, j = e & 15;
    u32 byte = W[r * (cols >> 1) + ((long)(i >> 5) << 4) + j];
    u32 qh = ((const u32*)(W + (long)rows * (cols >> 1)))[b];
    float d = h2f(((const u16*)(W + (long)rows * (cols >> 1) + (long)rows * (cols >> 3)))[b]);
    int x = e < 16 ? (int)((byte & 15) | (((qh >> j) << 4) & 0x10)) - 16
                   : (int)((byte >> 4) | ((qh >> (j + 12)) & 0x10)) - 16;
    return d * (float)x;
}

extern "C" __global__ void embed_q5_0s(const u8* W, int n_rows, int cols, const u32* tokens, float* out) {
    PDL_ENTRY();
    u32 t = tokens[blockIdx.x];
    if (t >= (u32)n_rows) return;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(long)blockIdx.x * cols + i] = q5s_elem(W, n_rows, cols, t, i);
}

extern "C" __global__ void dequant_f16_q5_0s(const u8* W, int rows, int cols, int r0, u16* wh) {
    PDL_ENTRY();
    long r = r0 + blockIdx.x;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        wh[(long)blockIdx.x * cols + i] = f2h(q5s_elem(W, rows, cols, r, i));
}

// ---------------------------------------------------------------------------
// Split Q6_K ("q6_ks"): every super-block's 128 ql bytes [rows][cols/2], then
// its 64 qh bytes [rows][cols/4], then its 16 int8 scales [rows][cols/16],
// then its f16 d [rows][cols/256]. Same bytes as ggml. Lane l reads the
// 32-bit ql word l of a super-block (one 128-byte line per warp load): half
// n = l / 16, m = l % 16; m < 8: ql bytes 64n + 4m..+3 hold quarters 0
// (low nibbles) and 2 (high) at position p = 4m; m >= 8: ql bytes
// 64n + 32 + p (p = 4m - 32) hold quarters 1 and 3. Quarter k of half n is
// elements 128n + 32k + p .. +3, its 2 high bits at qh[32n + p] >> 2k, its
// scale scales[8n + 2k + p / 16] (ggml's dequantize_row_q6_K).
template <int NR>
__device__ __forceinline__ void q6ks_dot(const u8* const* ql, const u8* const* qh, const i8* const* sc,
                                         const u16* const* dd, const float* __restrict__ xa, int cols, int lane,
                                         float* acc) {
    const int n_sb = cols >> 8;
    const int n = lane >> 4, m = lane & 15;
    const int p = m < 8 ? 4 * m : 4 * m - 32;
    const int k_lo = m < 8 ? 0 : 1, k_hi = k_lo + 2;
    const int qh_off = 32 * n + p, sc_lo = 8 * n + 2 * k_lo + (p >> 4), sc_hi = sc_lo + 4;
    const int x_lo = 128 * n + 32 * k_lo + p, x_hi = x_lo + 64;
    for (int c = 0; c < n_sb; c += 2) {
        u32 w[2][NR], hb[2][NR];
        float s_lo[2][NR], s_hi[2][NR];
        u16 dv[2][NR];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            bool ok = c + h < n_sb;
            int sb = c + h;
#pragma unroll
            for (int k = 0; k < NR; k++) {
                w[h][k] = ok ? __ldg((const u32*)(ql[k] + (sb << 7) + (lane << 2))) : 0u;
                hb[h][k] = ok ? __ldg((const u32*)(qh[k] + (sb << 6) + qh_off)) : 0u;
                s_lo[h][k] = ok ? (float)__ldg(sc[k] + (sb << 4) + sc_lo) : 0.f;
                s_hi[h][k] = ok ? (float)__ldg(sc[k] + (sb << 4) + sc_hi) : 0.f;
                dv[h][k] = ok ? __ldg(dd[k] + sb) : (u16)0;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (c + h >= n_sb) continue;
            const float* xs = xa + ((c + h) << 8);
            float4 xl = *(const float4*)(xs + x_lo), xh = *(const float4*)(xs + x_hi);
#pragma unroll
            for (int k = 0; k < NR; k++) {
                u32 lo = (w[h][k] & 0x0f0f0f0fu) | (((hb[h][k] >> (2 * k_lo)) & 0x03030303u) << 4);
                u32 hi = ((w[h][k] >> 4) & 0x0f0f0f0fu) | (((hb[h][k] >> (2 * k_hi)) & 0x03030303u) << 4);
                float ql4[4], qh4[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    ql4[i] = sb_byte_f32(lo, i, 8388640.0f);  // 2^23 + 32: q - 32
                    qh4[i] = sb_byte_f32(hi, i, 8388640.0f);
                }
                float dl = ql4[0] * xl.x + ql4[1] * xl.y + ql4[2] * xl.z + ql4[3] * xl.w;
                float dh = qh4[0] * xh.x + qh4[1] * xh.y + qh4[2] * xh.z + qh4[3] * xh.w;
                acc[k] += h2f(dv[h][k]) * (s_lo[h][k] * dl + s_hi[h][k] * dh);
            }
        }
    }
}

#define Q6S_ROW_PTRS(W, rows, r, k)                                                                                  \
    ql[k] = W + (long)(r) * (cols >> 1);                                                                             \
    qh[k] = W + (long)(rows) * (cols >> 1) + (long)(r) * (cols >> 2);                                                \
    sc[k] = (const i8*)(W + (long)(rows) * (cols >> 1) + (long)(rows) * (cols >> 2)) + (long)(r) * (cols >> 4);     \
    dd[k] = (const u16*)(W + (long)(rows) * (cols >> 1) + (long)(rows) * (cols >> 2) + (long)(rows) * (cols >> 4)) + \
            (long)(r) * (cols >> 8);

extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_q6_ks(MV3_PARAMS) {
    PDL_ENTRY();
    MV3_PICK(FAST_WARPS * FAST_ROWS)
    int r0 = (bx * FAST_WARPS + warp) * FAST_ROWS;
    if (r0 >= rows) return;
    const u8* ql[FAST_ROWS];
    const u8* qh[FAST_ROWS];
    const i8* sc[FAST_ROWS];
    const u16* dd[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) {
        int r = min(r0 + k, rows - 1);
        Q6S_ROW_PTRS(W, rows, r, k)
    }
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    q6ks_dot<FAST_ROWS>(ql, qh, sc, dd, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) {
        float v = warp_sum(acc[k]);
        if (lane == 0 && r0 + k < rows) mv_store(v, y, bias, rs, a, rows, r0 + k);
    }
}

extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_q6_ks(FFN_PARAMS) {
    PDL_ENTRY();
    const int NC = FAST_ROWS / 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    FAST_INPUT
    int r0 = (blockIdx.x * FAST_WARPS + warp) * NC;
    if (r0 >= rows) return;
    const u8* ql[FAST_ROWS];
    const u8* qh[FAST_ROWS];
    const i8* sc[FAST_ROWS];
    const u16* dd[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int r = min(r0 + k, rows - 1);
        Q6S_ROW_PTRS(Wg, rows, r, k)
        Q6S_ROW_PTRS(Wu, rows, r, NC + k)
    }
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    q6ks_dot<FAST_ROWS>(ql, qh, sc, dd, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < NC; k++) {
        float g = warp_sum(acc[k]), u = warp_sum(acc[NC + k]);
        if (lane == 0 && r0 + k < rows) h[(long)a * rows + r0 + k] = silu_mul(g, u);
    }
}

// Element i of row r of a split-Q6_K matrix (dequant_unit<TY_Q6_K>'s
// arithmetic).
__device__ __forceinline__ float q6ks_elem(const u8* W, int rows, int cols, long r, int i) {
    int sb = i >> 8, e = i & 255, n = e >> 7, k = (e >> 5) & 3, l = e & 31;
    long nsb = cols >> 8, b = r * nsb + sb;
    const u8* ql = W + b * 128 + 64 * n + (k & 1) * 32;
    const u8* qh = W + (long)rows * (cols >> 1) + b * 64 + 32 * n;
    const i8* sc = (const i8*)(W + (long)rows * (cols >> 1) + (long)rows * (cols >> 2)) + b * 16 + 8 * n;
    float d = h2f(((const u16*)(W + (long)rows * (cols >> 1) + (long)rows * (cols >> 2) + (long)rows * (cols >> 4)))[b]);
    int q = (int)(((ql[l] >> ((k >> 1) * 4)) & 15) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
    float dl = d * (float)sc[2 * k + (l >> 4)];
    return dl * (float)q;
}

extern "C" __global__ void embed_q6_ks(const u8* W, int n_rows, int cols, const u32* tokens, float* out) {
    PDL_ENTRY();
    u32 t = tokens[blockIdx.x];
    if (t >= (u32)n_rows) return;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(long)blockIdx.x * cols + i] = q6ks_elem(W, n_rows, cols, t, i);
}

extern "C" __global__ void dequant_f16_q6_ks(const u8* W, int rows, int cols, int r0, u16* wh) {
    PDL_ENTRY();
    long r = r0 + blockIdx.x;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        wh[(long)blockIdx.x * cols + i] = f2h(q6ks_elem(W, rows, cols, r, i));
}

// ---------------------------------------------------------------------------
// Split-K variants of the repacked mat-vecs (`mv3_<suffix>_k<S>`): the S
// warps of a group share the group's FAST_ROWS rows, each dotting one
// contiguous slice of the columns (whole granules of G elements, so every
// slice starts where the type's chunk loop expects), and lane 0 of slice 0
// adds the S partial sums in slice order from shared memory, so the result
// is deterministic (it differs from the S = 1 kernel's only in summation
// order). A block covers (FAST_WARPS / S) * FAST_ROWS rows, so matrices with
// few rows and long columns (attention output, FFN down: 3584 x 18944 in a
// 7B) get S times more blocks and warps in flight than the one-warp-per-row
// kernels, which leave most of the H200's 132 SMs with a single block. No
// warp returns early: every thread reaches the block barrier.
#define MV3K_BEGIN(S, G)                                                                                             \
    MV3_PICK((FAST_WARPS / (S)) * FAST_ROWS)                                                                         \
    __shared__ float mv3k_part[FAST_WARPS][FAST_ROWS];                                                               \
    const int slice = warp % (S);                                                                                    \
    const int r0 = (bx * (FAST_WARPS / (S)) + warp / (S)) * FAST_ROWS;                                              \
    const int n_gran = (cols + (G) - 1) / (G), per_slice = (n_gran + (S) - 1) / (S);                                 \
    const int c_lo = min(cols, slice * per_slice * (G));                                                             \
    const int c_n = min(cols, c_lo + per_slice * (G)) - c_lo;                                                        \
    float acc[FAST_ROWS];                                                                                            \
    _Pragma("unroll") for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;                                             \
    if (r0 < rows && c_n > 0) {

#define MV3K_END(S, OUT_SCALE)                                                                                       \
    }                                                                                                                \
    _Pragma("unroll") for (int k = 0; k < FAST_ROWS; k++) {                                                          \
        float v = warp_sum(acc[k]);                                                                                  \
        if (lane == 0) mv3k_part[warp][k] = v;                                                                       \
    }                                                                                                                \
    __syncthreads();                                                                                                 \
    if (slice == 0 && lane < FAST_ROWS && r0 + lane < rows) {                                                        \
        float v = 0.f;                                                                                               \
        for (int j = 0; j < (S); j++) v += mv3k_part[warp + j][lane];                                                \
        mv_store(v * (OUT_SCALE), y, bias, rs, a, rows, r0 + lane);                                                  \
    }

#define MV3K_Q8_0S(S)                                                                                                \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_q8_0s_k##S(MV3_PARAMS) { PDL_ENTRY();           \
        MV3K_BEGIN(S, 128)                                                                                           \
        const u16* scales = (const u16*)(W + (long)rows * cols);                                                     \
        const u8* q[FAST_ROWS];                                                                                      \
        const u16* s[FAST_ROWS];                                                                                     \
        _Pragma("unroll") for (int k = 0; k < FAST_ROWS; k++) {                                                      \
            int r = min(r0 + k, rows - 1);                                                                           \
            q[k] = W + (long)r * cols + c_lo;                                                                        \
            s[k] = scales + (long)r * (cols >> 5) + (c_lo >> 5);                                                     \
        }                                                                                                            \
        q8s_dot<FAST_ROWS>(q, s, xa + c_lo, c_n, lane, acc);                                                         \
        MV3K_END(S, 1.f)                                                                                             \
    }

#define MV3K_Q4_KS(S)                                                                                                \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_q4_ks_k##S(MV3_PARAMS) { PDL_ENTRY();           \
        MV3K_BEGIN(S, 256)                                                                                           \
        const u8* meta = W + (long)rows * (cols >> 1);                                                               \
        const u8* q[FAST_ROWS];                                                                                      \
        const u8* mt[FAST_ROWS];                                                                                     \
        _Pragma("unroll") for (int k = 0; k < FAST_ROWS; k++) {                                                      \
            int r = min(r0 + k, rows - 1);                                                                           \
            q[k] = W + (long)r * (cols >> 1) + (c_lo >> 1);                                                          \
            mt[k] = meta + (long)r * (cols >> 4) + (c_lo >> 4);                                                      \
        }                                                                                                            \
        q4ks_dot<FAST_ROWS>(q, mt, xa + c_lo, c_n, lane, acc);                                                       \
        MV3K_END(S, 1.f)                                                                                             \
    }

#define MV3K_Q5_0S(S)                                                                                                \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_q5_0s_k##S(MV3_PARAMS) { PDL_ENTRY();           \
        MV3K_BEGIN(S, 256)                                                                                           \
        const u8* q[FAST_ROWS];                                                                                      \
        const u32* qh[FAST_ROWS];                                                                                    \
        const u16* s[FAST_ROWS];                                                                                     \
        _Pragma("unroll") for (int k = 0; k < FAST_ROWS; k++) {                                                      \
            int r = min(r0 + k, rows - 1);                                                                           \
            Q5S_ROW_PTRS(W, rows, r, k, q, qh, s)                                                                    \
            q[k] += c_lo >> 1;                                                                                       \
            qh[k] += c_lo >> 5;                                                                                      \
            s[k] += c_lo >> 5;                                                                                       \
        }                                                                                                            \
        q5s_dot<FAST_ROWS>(q, qh, s, xa + c_lo, c_n, lane, acc);                                                     \
        MV3K_END(S, 1.f)                                                                                             \
    }

#define MV3K_Q6_KS(S)                                                                                                \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_q6_ks_k##S(MV3_PARAMS) { PDL_ENTRY();           \
        MV3K_BEGIN(S, 256)                                                                                           \
        const u8* ql[FAST_ROWS];                                                                                     \
        const u8* qh[FAST_ROWS];                                                                                     \
        const i8* sc[FAST_ROWS];                                                                                     \
        const u16* dd[FAST_ROWS];                                                                                    \
        _Pragma("unroll") for (int k = 0; k < FAST_ROWS; k++) {                                                      \
            int r = min(r0 + k, rows - 1);                                                                           \
            Q6S_ROW_PTRS(W, rows, r, k)                                                                              \
            ql[k] += c_lo >> 1;                                                                                      \
            qh[k] += c_lo >> 2;                                                                                      \
            sc[k] += c_lo >> 4;                                                                                      \
            dd[k] += c_lo >> 8;                                                                                      \
        }                                                                                                            \
        q6ks_dot<FAST_ROWS>(ql, qh, sc, dd, xa + c_lo, c_n, lane, acc);                                              \
        MV3K_END(S, 1.f)                                                                                             \
    }

#define MV3K_NVFP4(S)                                                                                                \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_nvfp4_k##S(MV3_PARAMS) { PDL_ENTRY();           \
        MV3K_BEGIN(S, 256)                                                                                           \
        const u8* scales = W + (long)rows * (cols >> 1);                                                             \
        const u32* q[FAST_ROWS];                                                                                     \
        const u8* s[FAST_ROWS];                                                                                      \
        _Pragma("unroll") for (int k = 0; k < FAST_ROWS; k++) {                                                      \
            int r = min(r0 + k, rows - 1);                                                                           \
            q[k] = (const u32*)(W + (long)r * (cols >> 1) + (c_lo >> 1));                                            \
            s[k] = scales + (long)r * (cols >> 4) + (c_lo >> 4);                                                     \
        }                                                                                                            \
        nvfp4_dot<FAST_ROWS>(q, s, xa + c_lo, c_n, lane, acc);                                                       \
        MV3K_END(S, 0.5f * ts)                                                                                       \
    }

#define MV3K_ALL(S) MV3K_Q8_0S(S) MV3K_Q4_KS(S) MV3K_Q5_0S(S) MV3K_Q6_KS(S) MV3K_NVFP4(S)
MV3K_ALL(2)
MV3K_ALL(4)
MV3K_ALL(8)

// ---------------------------------------------------------------------------
// Mat-vec variants of the split Q8_0 and split Q4_K layouts (issue 6;
// `MIRAGE_CUDA_MV=v1|v2|v3`, `CudaBackend::set_matvec_variant`; v1 = the
// kernels above, the default). Same device bytes, same parameter lists
// (MV3_PARAMS / FFN_PARAMS, so the recorder, the epilogue and norm folding
// work unchanged); kernel names get `_v2` / `_v3` before the split-K suffix:
// `mv3_q8_0s_v2`, `mv3_q8_0s_v2_k4`, `ffn_q4_ks_v3`, ...
//
// What changes against v1:
//   * 16-byte weight loads: lane l reads bytes 16l..16l+15 of a 512-byte
//     stretch of a row (one uint4), so a warp load is four 128-byte lines
//     per row and a lane issues 4x fewer load instructions per byte;
//   * Q8_0: 16 elements of one lane lie in one 32-element block, so one f16
//     scale load per 16 elements (v1: one per 4);
//   * Q4_K: a warp covers 4 super-blocks of a row per load (8 lanes per
//     super-block); the 16-byte header is not loaded per lane: lane s of a
//     super-block's 8 lanes loads 32-bit header word s & 3, the 4 words are
//     broadcast in the group with shuffles, and each lane decodes the
//     packed 6-bit scales/mins of its two sub-blocks with lane-constant
//     shifts (two sub-blocks at once in 16-bit pairs, no per-byte selects);
//   * v2: 4 rows per warp (32 per block), v3: 2 rows per warp (16 per block)
//     with twice the chunks in flight per row: twice the blocks for the
//     same matrix, so few-row matrices fill more SMs even without split-K.
// Split-K (`_k2/_k4/_k8`) as above: the S warps of a group dot one column
// slice each (whole 128-element (Q8_0) / 256-element (Q4_K) granules) and
// slice 0 adds the partial sums in slice order.
// ---------------------------------------------------------------------------

// Rows of a variant's dot: row k < NH of the warp is quants qa + rk * qs and
// scales/headers ma + rk * ms with rk = min(k, last) (the last row is
// duplicated past the matrix end; the caller does not store it); rows
// k >= NH likewise from qb / mb (gate rows, then up rows, of the FFN
// kernel). 32-bit row offsets instead of 2 NR 64-bit pointers.
struct MvvRows {
    const u8 *qa, *qb, *ma, *mb;
    int qs, ms, last;
};

template <int NH>
__device__ __forceinline__ const u8* mvv_q(const MvvRows& R, int k) {
    int kk = k < NH ? k : k - NH;
    return (k < NH ? R.qa : R.qb) + min(kk, R.last) * R.qs;
}
template <int NH>
__device__ __forceinline__ const u8* mvv_m(const MvvRows& R, int k) {
    int kk = k < NH ? k : k - NH;
    return (k < NH ? R.ma : R.mb) + min(kk, R.last) * R.ms;
}

// Rows r0.. of an FFN kernel's warp: gate rows from Wg, up rows from Wu
// (split layout: quants qs bytes a row, then scales ms bytes a row).
__device__ __forceinline__ MvvRows ffn_rows(const u8* Wg, const u8* Wu, int rows, int r0, int qs, int ms) {
    MvvRows R;
    R.qa = Wg + (long)r0 * qs;
    R.qb = Wu + (long)r0 * qs;
    R.ma = Wg + (long)rows * qs + (long)r0 * ms;
    R.mb = Wu + (long)rows * qs + (long)r0 * ms;
    R.qs = qs;
    R.ms = ms;
    R.last = rows - 1 - r0;
    return R;
}

// The U chunks of 512 elements from chunk c of NR split-Q8_0 rows: this
// lane's 16 quants of each (w) and their block scale (sc); chunks past the
// row end load zeros. Reads weights only, so the preload variants issue it
// before pdl_wait(). GEN: the rows are in shared memory (attn_block's O
// tiles), read by generic loads; otherwise global, through __ldg.
template <bool GEN, typename T>
__device__ __forceinline__ T mvv_ld(const T* p) {
    if constexpr (GEN) return *p;
    return __ldg(p);
}
template <int NR, int NH, int U, bool GEN = false>
__device__ __forceinline__ void q8s_load16(const MvvRows& R, int cols, int lane, uint4 (&w)[U][NR], u32 (&sc)[U][NR],
                                           int c) {
#pragma unroll
    for (int h = 0; h < U; h++) {
        int e = ((c + h) << 9) + (lane << 4);
        bool ok = e < cols;  // implies c + h < n_chunks
#pragma unroll
        for (int k = 0; k < NR; k++) {
            w[h][k] = ok ? mvv_ld<GEN>((const uint4*)(mvv_q<NH>(R, k) + e)) : make_uint4(0u, 0u, 0u, 0u);
            sc[h][k] = ok ? (u32)mvv_ld<GEN>((const u16*)(mvv_m<NH>(R, k) + ((e >> 5) << 1))) : 0u;
        }
    }
}

// acc[k] += this lane's products of the chunks q8s_load16 loaded from chunk c.
template <int NR, int U>
__device__ __forceinline__ void q8s_compute16(const float* __restrict__ xa, int cols, int lane,
                                              const uint4 (&w)[U][NR], const u32 (&sc)[U][NR], int c, float* acc) {
#pragma unroll
    for (int h = 0; h < U; h++) {
        int e = ((c + h) << 9) + (lane << 4);
        if (e >= cols) continue;
        const float4* xp = (const float4*)(xa + e);
        float4 x0 = xp[0], x1 = xp[1], x2 = xp[2], x3 = xp[3];
#pragma unroll
        for (int k = 0; k < NR; k++) {
            float f[4], d;
            sb_q8x4(w[h][k].x, f);
            d = f[0] * x0.x + f[1] * x0.y + f[2] * x0.z + f[3] * x0.w;
            sb_q8x4(w[h][k].y, f);
            d += f[0] * x1.x + f[1] * x1.y + f[2] * x1.z + f[3] * x1.w;
            sb_q8x4(w[h][k].z, f);
            d += f[0] * x2.x + f[1] * x2.y + f[2] * x2.z + f[3] * x2.w;
            sb_q8x4(w[h][k].w, f);
            d += f[0] * x3.x + f[1] * x3.y + f[2] * x3.z + f[3] * x3.w;
            acc[k] += h2f((u16)sc[h][k]) * d;
        }
    }
}

// This lane's share of NR split-Q8_0 rows dotted with xa[0..cols), U chunks
// of 512 elements in flight per row. cols % 32 == 0, so a lane's 16
// elements at a 16-aligned e < cols are all in range and in one block.
// PF (prefetch): the loads of the next U chunks are issued before the
// current ones are used (software pipelining, two register sets), so a warp
// keeps loads in flight while it computes; without it a warp loads U chunks,
// waits, computes, and loads again.
template <int NR, int NH, int U, bool PF>
__device__ __forceinline__ void q8s_dot16(const MvvRows& R, const float* __restrict__ xa, int cols, int lane,
                                          float* acc) {
    const int n_chunks = (cols + 511) >> 9;
    auto load = [&](uint4 (&w)[U][NR], u32 (&sc)[U][NR], int c) { q8s_load16<NR, NH, U>(R, cols, lane, w, sc, c); };
    auto compute = [&](const uint4 (&w)[U][NR], const u32 (&sc)[U][NR], int c) {
        q8s_compute16<NR, U>(xa, cols, lane, w, sc, c, acc);
    };
    uint4 w[U][NR];
    u32 sc[U][NR];
    if (!PF) {
        for (int c = 0; c < n_chunks; c += U) {
            load(w, sc, c);
            compute(w, sc, c);
        }
    } else {
        uint4 w2[U][NR];
        u32 sc2[U][NR];
        load(w, sc, 0);
        for (int c = 0; c < n_chunks; c += 2 * U) {
            load(w2, sc2, c + U);  // past the end: predicated off (zeros)
            compute(w, sc, c);
            if (c + 2 * U < n_chunks) load(w, sc, c + 2 * U);
            compute(w2, sc2, c + U);
        }
    }
}

// Sum of the four bytes of v (small unsigned values), each times the
// matching x.
__device__ __forceinline__ float q4v_nib_dot(u32 v, float4 x) {
    return sb_byte_f32(v, 0, 8388608.0f) * x.x + sb_byte_f32(v, 1, 8388608.0f) * x.y +
           sb_byte_f32(v, 2, 8388608.0f) * x.z + sb_byte_f32(v, 3, 8388608.0f) * x.w;
}

// This lane's share of NR split-Q4_K rows dotted with xa[0..cols), U chunks
// of 4 super-blocks in flight per row. Lane l takes super-block 4c + l / 8
// of chunk c, bytes 16 (l % 8)..+15 of its 128 quant bytes: group j = (l % 8)
// / 2 of ggml's qs, elements 64j + 16 ((l % 8) & 1) + i (low nibbles,
// sub-block 2j) and 32 more (high nibbles, sub-block 2j + 1), i < 16.
// Every lane runs every shuffle (no lane leaves the loop early). PF as for
// q8s_dot16.
template <int NR, int NH, int U, bool PF>
__device__ __forceinline__ void q4ks_dot16(const MvvRows& R, const float* __restrict__ xa, int cols, int lane,
                                           float* acc) {
    const int n_sb = cols >> 8;
    const int g = lane >> 3, s8 = lane & 7, j = s8 >> 1;
    const int xoff = 64 * j + 16 * (s8 & 1);
    const int sh = 16 * (j & 1);  // byte pair (2j, 2j + 1) mod 4 of a scale word
    const bool upper = j >= 2;    // sub-blocks 4..7: 6-bit values split over two bytes
    const int base = lane & 24;   // first lane of this super-block's group
    const int n_chunks = (n_sb + 3) >> 2;
    auto load = [&](uint4 (&w)[U][NR], u32 (&hw)[U][NR], int c) {
#pragma unroll
        for (int h = 0; h < U; h++) {
            int sb = ((c + h) << 2) + g;
            bool ok = sb < n_sb;
#pragma unroll
            for (int k = 0; k < NR; k++) {
                w[h][k] = ok ? __ldg((const uint4*)(mvv_q<NH>(R, k) + (sb << 7) + (s8 << 4)))
                             : make_uint4(0u, 0u, 0u, 0u);
                hw[h][k] = ok ? __ldg((const u32*)(mvv_m<NH>(R, k) + (sb << 4)) + (s8 & 3)) : 0u;
            }
        }
    };
    auto compute = [&](const uint4 (&w)[U][NR], const u32 (&hw)[U][NR], int c) {
#pragma unroll
        for (int h = 0; h < U; h++) {
            int sb = ((c + h) << 2) + g;
            // Header words of every row, from lanes base..base+3 (all lanes).
            u32 hx[NR], sc2[NR], m2[NR];
#pragma unroll
            for (int k = 0; k < NR; k++) {
                hx[k] = __shfl_sync(0xffffffffu, hw[h][k], base);
                u32 a = __shfl_sync(0xffffffffu, hw[h][k], base + 1) >> sh;
                u32 b = __shfl_sync(0xffffffffu, hw[h][k], base + 2) >> sh;
                u32 cc = __shfl_sync(0xffffffffu, hw[h][k], base + 3) >> sh;
                // ggml's get_scale_min_k4 for sub-blocks 2j and 2j + 1 (bytes 0, 1).
                sc2[k] = upper ? ((cc & 0x0f0fu) | ((a >> 2) & 0x3030u)) : (a & 0x3f3fu);
                m2[k] = upper ? (((cc >> 4) & 0x0f0fu) | ((b >> 2) & 0x3030u)) : (b & 0x3f3fu);
            }
            if (sb >= n_sb) continue;
            const float* xs = xa + (sb << 8) + xoff;
            float dl[NR], dh[NR];
            float sxl, sxh;
            {
                const float4* xp = (const float4*)xs;
                float4 x0 = xp[0], x1 = xp[1], x2 = xp[2], x3 = xp[3];
                sxl = ((x0.x + x0.y) + (x0.z + x0.w)) + ((x1.x + x1.y) + (x1.z + x1.w)) +
                      ((x2.x + x2.y) + (x2.z + x2.w)) + ((x3.x + x3.y) + (x3.z + x3.w));
#pragma unroll
                for (int k = 0; k < NR; k++) {
                    dl[k] = q4v_nib_dot(w[h][k].x & 0x0f0f0f0fu, x0) + q4v_nib_dot(w[h][k].y & 0x0f0f0f0fu, x1) +
                            q4v_nib_dot(w[h][k].z & 0x0f0f0f0fu, x2) + q4v_nib_dot(w[h][k].w & 0x0f0f0f0fu, x3);
                }
            }
            {
                const float4* xp = (const float4*)(xs + 32);
                float4 x0 = xp[0], x1 = xp[1], x2 = xp[2], x3 = xp[3];
                sxh = ((x0.x + x0.y) + (x0.z + x0.w)) + ((x1.x + x1.y) + (x1.z + x1.w)) +
                      ((x2.x + x2.y) + (x2.z + x2.w)) + ((x3.x + x3.y) + (x3.z + x3.w));
#pragma unroll
                for (int k = 0; k < NR; k++) {
                    dh[k] = q4v_nib_dot((w[h][k].x >> 4) & 0x0f0f0f0fu, x0) +
                            q4v_nib_dot((w[h][k].y >> 4) & 0x0f0f0f0fu, x1) +
                            q4v_nib_dot((w[h][k].z >> 4) & 0x0f0f0f0fu, x2) +
                            q4v_nib_dot((w[h][k].w >> 4) & 0x0f0f0f0fu, x3);
                }
            }
#pragma unroll
            for (int k = 0; k < NR; k++) {
                float d = h2f((u16)(hx[k] & 0xffffu)), dmin = h2f((u16)(hx[k] >> 16));
                float sc0 = sb_byte_f32(sc2[k], 0, 8388608.0f), sc1 = sb_byte_f32(sc2[k], 1, 8388608.0f);
                float m0 = sb_byte_f32(m2[k], 0, 8388608.0f), m1 = sb_byte_f32(m2[k], 1, 8388608.0f);
                acc[k] += d * (sc0 * dl[k] + sc1 * dh[k]) - dmin * (m0 * sxl + m1 * sxh);
            }
        }
    };
    uint4 w[U][NR];
    u32 hw[U][NR];
    if (!PF) {
        for (int c = 0; c < n_chunks; c += U) {
            load(w, hw, c);
            compute(w, hw, c);
        }
    } else {
        uint4 w2[U][NR];
        u32 hw2[U][NR];
        load(w, hw, 0);
        for (int c = 0; c < n_chunks; c += 2 * U) {
            load(w2, hw2, c + U);  // past the end: predicated off (zeros)
            compute(w, hw, c);
            if (c + 2 * U < n_chunks) load(w, hw, c + 2 * U);
            compute(w2, hw2, c + U);  // every lane: the shuffles run in step
        }
    }
}

#define MVV_Q8 0
#define MVV_Q4K 1

template <int L, int NR, int NH, int U, bool PF>
__device__ __forceinline__ void mvv_dot(const MvvRows& R, const float* xa, int cols, int lane, float* acc) {
    if (L == MVV_Q8)
        q8s_dot16<NR, NH, U, PF>(R, xa, cols, lane, acc);
    else
        q4ks_dot16<NR, NH, U, PF>(R, xa, cols, lane, acc);
}

// Quant bytes and scale/header bytes per row of layout L (split Q8_0: cols
// int8 then cols / 32 f16; split Q4_K: cols / 2 then cols / 16).
template <int L>
__device__ __forceinline__ int mvv_qrow(int cols) {
    return L == MVV_Q8 ? cols : (cols >> 1);
}
template <int L>
__device__ __forceinline__ int mvv_mrow(int cols) {
    return L == MVV_Q8 ? (cols >> 4) : (cols >> 4);
}

// The end of a split mat-vec: the warp sums of acc stored (S = 1), or added
// over the S slices of each row group in slice order by the slice-0 warp
// (S > 1; part: FAST_WARPS x NR floats of shared memory).
template <int NR, int S>
__device__ __forceinline__ void mv3_store(const float* acc, float (*part)[NR], int warp, int lane, int slice, int r0,
                                          float* y, const float* bias, float* rs, int a, int rows) {
    if (S == 1) {
#pragma unroll
        for (int k = 0; k < NR; k++) {
            float v = warp_sum(acc[k]);
            if (lane == 0 && r0 + k < rows) mv_store(v, y, bias, rs, a, rows, r0 + k);
        }
    } else {
#pragma unroll
        for (int k = 0; k < NR; k++) {
            float v = warp_sum(acc[k]);
            if (lane == 0) part[warp][k] = v;
        }
        __syncthreads();
        if (slice == 0 && lane < NR && r0 + lane < rows) {
            float v = 0.f;
            for (int t = 0; t < S; t++) v += part[warp + t][lane];
            mv_store(v, y, bias, rs, a, rows, r0 + lane);
        }
    }
}

// Columns [lo, lo + n) of warp slice `slice` of S over rows of cols
// elements, in whole G-element granules (n = 0 past the row's end).
template <int G, int S>
__device__ __forceinline__ void mv3_slice(int cols, int slice, int& lo, int& n) {
    const int n_gran = (cols + G - 1) / G, per_slice = (n_gran + S - 1) / S;
    lo = min(cols, slice * per_slice * G);
    n = min(cols, lo + per_slice * G) - lo;
}

// Rows r0.. of a split matrix of layout L from column c_lo on. Bytes of
// the slice start: c_lo / 2 (Q4_K quants) or c_lo (Q8_0); scales/headers
// c_lo / 16 in both (2 bytes per 32, 16 per 256).
template <int L>
__device__ __forceinline__ MvvRows mv3_rows(const u8* W, int rows, int r0, int c_lo, int qs, int ms) {
    MvvRows R;
    R.qa = R.qb = W + (long)r0 * qs + (L == MVV_Q8 ? c_lo : (c_lo >> 1));
    R.ma = R.mb = W + (long)rows * qs + (long)r0 * ms + (c_lo >> 4);
    R.qs = qs;
    R.ms = ms;
    R.last = rows - 1 - r0;
    return R;
}

// mv3 of a variant: S warps per group of NR rows (S = 1: no split), each
// over one column slice of whole G-element granules.
template <int L, int NR, int U, bool PF, int S>
__device__ __forceinline__ void mv3_variant(MV3_PARAMS) {
    const int G = L == MVV_Q8 ? 128 : 256;
    MV3_PICK_W((FAST_WARPS / S) * NR)
    {
        // The block's rows (all columns), before waiting on the previous
        // kernel: weights only (pdl.cu).
        const int rb = bx * (FAST_WARPS / S) * NR, nb = min((FAST_WARPS / S) * NR, rows - rb);
        const int qs = mvv_qrow<L>(cols), ms = mvv_mrow<L>(cols);
        if (blockIdx.y == 0) {
            l2_prefetch_rows(W + (long)rb * qs, qs, nb, min(qs, MIRAGE_PREFETCH_ROW));
            if (MIRAGE_PREFETCH_ROW > 0) l2_prefetch_block(W + (long)rows * qs + (long)rb * ms, (long)nb * ms);
        }
    }
    PDL_ENTRY();
    FAST_INPUT
    __shared__ float part[S > 1 ? FAST_WARPS : 1][NR];
    const int slice = warp % S;
    const int r0 = (bx * (FAST_WARPS / S) + warp / S) * NR;
    int c_lo, c_n;
    mv3_slice<G, S>(cols, slice, c_lo, c_n);
    float acc[NR];
#pragma unroll
    for (int k = 0; k < NR; k++) acc[k] = 0.f;
    if (r0 < rows && c_n > 0) {
        const MvvRows R = mv3_rows<L>(W, rows, r0, c_lo, mvv_qrow<L>(cols), mvv_mrow<L>(cols));
        mvv_dot<L, NR, NR, U, PF>(R, xa + c_lo, c_n, lane, acc);
    }
    mv3_store<NR, S>(acc, part, warp, lane, slice, r0, y, bias, rs, a, rows);
}

// mv3_grid's loop over the launch's row tiles, from xa (activation row a):
// this block's i-th tile is order(i, n_tiles); after(m, bx) runs on every
// thread after each tile's store (m the matrix, bx the tile within it).
template <int NR, int U, int S, class Order, class After>
__device__ __forceinline__ void mv3_tile_loop(MV3_PARAMS, const float* xa, int a, Order order, After after) {
    const int G = 128;  // split Q8_0 granule (mv3_variant's G)
    const int per_block = (FAST_WARPS / S) * NR;
    const int n_tiles = (rows0 + per_block - 1) / per_block + (rows1 + per_block - 1) / per_block +
                        (rows2 + per_block - 1) / per_block;
    (void)row_bytes;
    (void)x;
    (void)nx;
    (void)nw;
    (void)neps;
    (void)nout;
    __shared__ float part[S > 1 ? FAST_WARPS : 1][NR];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, slice = warp % S;
    int c_lo, c_n;
    mv3_slice<G, S>(cols, slice, c_lo, c_n);
    const int qs = mvv_qrow<MVV_Q8>(cols), ms = mvv_mrow<MVV_Q8>(cols);
    for (int i = blockIdx.x; i < n_tiles; i += gridDim.x) {
        const int t = order(i, n_tiles);
        MV3_MATRIX(t, per_block)
        const int r0 = (bx * (FAST_WARPS / S) + warp / S) * NR;
        float acc[NR];
#pragma unroll
        for (int k = 0; k < NR; k++) acc[k] = 0.f;
        if (r0 < rows && c_n > 0) {
            const MvvRows R = mv3_rows<MVV_Q8>(W, rows, r0, c_lo, qs, ms);
            mvv_dot<MVV_Q8, NR, NR, U, false>(R, xa + c_lo, c_n, lane, acc);
        }
        mv3_store<NR, S>(acc, part, warp, lane, slice, r0, y, bias, rs, a, rows);
        after(m, bx);
    }
}

// mv3_variant on a persistent grid (instances `mv3_*_v2g*`, measured by
// kernel-bench --variants): block b takes the row groups ("tiles") b,
// b + gridDim.x, ... of the three matrices in mv3_variant's numbering, so a
// grid of the device's resident blocks covers a launch of any size, and the
// input (with a folded norm, its RMSNorm) is read once per block, not once
// per tile. Each tile's loads and sums are mv3_variant's: the same bits.
// Unlike mv3_variant it asks L2 for none of its rows before the PDL wait
// (MIRAGE_PREFETCH_ROW); the measurements of the grid are without it.
// Why try it: at the 7B shape the Q/K/V launch is 576 blocks on 264
// resident (2.2 waves), the O and down launches 448 (1.7), and every block
// pays the norm prologue and its own start again.
template <int NR, int U, int S>
__device__ __forceinline__ void mv3_grid(MV3_PARAMS) {
    PDL_ENTRY();
    FAST_INPUT
    mv3_tile_loop<NR, U, S>(
        MV3_ARGS, xa, a, [](int i, int) { return i; },
        [](int, int) {
            if (S > 1) __syncthreads();  // the slice-0 warps have read part
        });
}

// The preload form of mv3_variant (split Q8_0 only, instances `mv3_*_v2p*`):
// the same slices, loads and arithmetic (the same bits), but the warp's
// first U chunks of weights go into registers BEFORE pdl_wait(), not only
// the heads of its rows into L2. Weights are constant during a step, so a
// grid that is resident while the previous kernel runs (the O projection's
// blocks during the attention, which uses 56 blocks of 132 SMs) has its
// weights on chip when its input lands; the chain after the wait is then
// the input, the products, the sums and the store. At 7B the Q/K/V and O
// slices (k4: 896 columns, two chunks) fit in U = 2 whole.
template <int NR, int U, int S>
__device__ __forceinline__ void mv3_preload(MV3_PARAMS) {
    const int G = 128;
    MV3_PICK_W((FAST_WARPS / S) * NR)
    const int slice = warp % S;
    const int r0 = (bx * (FAST_WARPS / S) + warp / S) * NR;
    int c_lo, c_n;
    mv3_slice<G, S>(cols, slice, c_lo, c_n);
    const bool live = r0 < rows && c_n > 0;
    const MvvRows R = mv3_rows<MVV_Q8>(W, rows, r0, c_lo, mvv_qrow<MVV_Q8>(cols), mvv_mrow<MVV_Q8>(cols));
    uint4 w[U][NR];
    u32 sc[U][NR];
    if (live) q8s_load16<NR, NR, U>(R, c_n, lane, w, sc, 0);
    PDL_ENTRY();
    FAST_INPUT
    __shared__ float part[S > 1 ? FAST_WARPS : 1][NR];
    float acc[NR];
#pragma unroll
    for (int k = 0; k < NR; k++) acc[k] = 0.f;
    if (live) {
        const float* xs = xa + c_lo;
        q8s_compute16<NR, U>(xs, c_n, lane, w, sc, 0, acc);
        const int n_chunks = (c_n + 511) >> 9;
        for (int c = U; c < n_chunks; c += U) {
            q8s_load16<NR, NR, U>(R, c_n, lane, w, sc, c);
            q8s_compute16<NR, U>(xs, c_n, lane, w, sc, c, acc);
        }
    }
    mv3_store<NR, S>(acc, part, warp, lane, slice, r0, y, bias, rs, a, rows);
}

// gate/up/SwiGLU of a variant: NR / 2 channels per warp (their gate rows,
// then their up rows, are the warp's NR rows).
template <int L, int NR, int U, bool PF>
__device__ __forceinline__ void ffn_variant(FFN_PARAMS) {
    const int NC = NR / 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int qs = mvv_qrow<L>(cols), ms = mvv_mrow<L>(cols);
    {
        // The block's gate and up rows before waiting (see mv3_variant).
        const int rb = blockIdx.x * FAST_WARPS * NC, nb = min(FAST_WARPS * NC, rows - rb);
        if (blockIdx.y == 0) {
            const long pr = min(qs, MIRAGE_PREFETCH_ROW);
            l2_prefetch_rows(Wg + (long)rb * qs, qs, nb, pr);
            l2_prefetch_rows(Wu + (long)rb * qs, qs, nb, pr);
            if (pr > 0) {
                l2_prefetch_block(Wg + (long)rows * qs + (long)rb * ms, (long)nb * ms);
                l2_prefetch_block(Wu + (long)rows * qs + (long)rb * ms, (long)nb * ms);
            }
        }
    }
    PDL_ENTRY();
    FAST_INPUT
    int r0 = (blockIdx.x * FAST_WARPS + warp) * NC;
    if (r0 >= rows) return;
    const MvvRows R = ffn_rows(Wg, Wu, rows, r0, qs, ms);
    float acc[NR];
#pragma unroll
    for (int k = 0; k < NR; k++) acc[k] = 0.f;
    mvv_dot<L, NR, NC, U, PF>(R, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < NC; k++) {
        float gs = warp_sum(acc[k]), us = warp_sum(acc[NC + k]);
        if (lane == 0 && r0 + k < rows) h[(long)a * rows + r0 + k] = silu_mul(gs, us);
    }
}

// The preload form of ffn_variant (split Q8_0; `ffn_*_v2p`): the warp's
// first U chunks of its gate and up rows into registers before pdl_wait()
// (see mv3_preload), then the rest as ffn_variant does it. The same bits.
template <int NR, int U>
__device__ __forceinline__ void ffn_preload(FFN_PARAMS) {
    const int NC = NR / 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int qs = cols, ms = cols >> 4;
    const int r0 = (blockIdx.x * FAST_WARPS + warp) * NC;
    const MvvRows R = ffn_rows(Wg, Wu, rows, r0, qs, ms);
    uint4 w[U][NR];
    u32 sc[U][NR];
    if (r0 < rows) q8s_load16<NR, NC, U>(R, cols, lane, w, sc, 0);
    PDL_ENTRY();
    FAST_INPUT
    if (r0 >= rows) return;
    float acc[NR];
#pragma unroll
    for (int k = 0; k < NR; k++) acc[k] = 0.f;
    q8s_compute16<NR, U>(xa, cols, lane, w, sc, 0, acc);
    const int n_chunks = (cols + 511) >> 9;
    for (int c = U; c < n_chunks; c += U) {
        q8s_load16<NR, NC, U>(R, cols, lane, w, sc, c);
        q8s_compute16<NR, U>(xa, cols, lane, w, sc, c, acc);
    }
#pragma unroll
    for (int k = 0; k < NC; k++) {
        float gs = warp_sum(acc[k]), us = warp_sum(acc[NC + k]);
        if (lane == 0 && r0 + k < rows) h[(long)a * rows + r0 + k] = silu_mul(gs, us);
    }
}

// Variant parameters: rows per warp (NR), chunks in flight per row (U); the
// launch bounds follow each instance (v4: at least 4 resident blocks per SM
// for Q8_0, i.e. <= 64 registers; 3 for Q4_K, where 64 spills).
#define MVV2_NR 4
#define MVV2_U_Q8 2
#define MVV2_U_Q4K 1
#define MVV3_NR 2
#define MVV3_U_Q8 4
#define MVV3_U_Q4K 2
#define MVV4_NR 2
#define MVV4_U_Q8 2
#define MVV4_U_Q4K 1
#define MVV5_NR 2     // v5: v4's shape, software-pipelined (PF)
#define MVV5_U_Q8 1
#define MVV5_U_Q4K 1

#define MVV_INSTANCE(NAME, L, V, NR, U, PF, ...)                                                                              \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) mv3_##NAME##_##V(MV3_PARAMS) {                     \
        mv3_variant<L, NR, U, PF, 1>(MV3_ARGS);                                                                          \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) mv3_##NAME##_##V##_k2(MV3_PARAMS) {                \
        mv3_variant<L, NR, U, PF, 2>(MV3_ARGS);                                                                          \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) mv3_##NAME##_##V##_k4(MV3_PARAMS) {                \
        mv3_variant<L, NR, U, PF, 4>(MV3_ARGS);                                                                          \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) mv3_##NAME##_##V##_k8(MV3_PARAMS) {                \
        mv3_variant<L, NR, U, PF, 8>(MV3_ARGS);                                                                          \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) ffn_##NAME##_##V(FFN_PARAMS) {                     \
        ffn_variant<L, NR, U, PF>(Wg, Wu, rows, row_bytes, cols, x, h, ts_g, ts_u, nx, nw, neps, nout);                  \
    }

// MIRAGE_MV2_MIN_BLOCKS (MIRAGE_CUDA_MV2_BLOCKS at start): the least
// resident blocks per SM the split Q8_0 v2 kernels are compiled for. Unset,
// the split-K instances take 102 registers: 2 blocks (16 warps) per SM, and
// ncu found the Q/K/V and O mat-vecs at 25-27 % of DRAM peak, waiting on
// their loads with few warps to cover them.
#ifdef MIRAGE_MV2_MIN_BLOCKS
#define MVV2_Q8_BOUNDS FAST_WARPS * 32, MIRAGE_MV2_MIN_BLOCKS
#else
#define MVV2_Q8_BOUNDS FAST_WARPS * 32
#endif
MVV_INSTANCE(q8_0s, MVV_Q8, v2, MVV2_NR, MVV2_U_Q8, false, MVV2_Q8_BOUNDS)
// The four split-K kernels mv3_NAME, mv3_NAME_k2/_k4/_k8 of a mat-vec body
// FN<NR, U, S> (mv3_preload, mv3_grid), with the launch bounds that follow.
#define MV3_SPLIT_KERNELS(NAME, FN, NR, U, ...)                                                                      \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) mv3_##NAME(MV3_PARAMS) { FN<NR, U, 1>(MV3_ARGS); }  \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) mv3_##NAME##_k2(MV3_PARAMS) {                      \
        FN<NR, U, 2>(MV3_ARGS);                                                                                      \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) mv3_##NAME##_k4(MV3_PARAMS) {                      \
        FN<NR, U, 4>(MV3_ARGS);                                                                                      \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) mv3_##NAME##_k8(MV3_PARAMS) {                      \
        FN<NR, U, 8>(MV3_ARGS);                                                                                      \
    }
// v2p: v2's split Q8_0 kernels with the weight preload (mv3_preload,
// ffn_preload); the backend picks them with `MIRAGE_CUDA_PRELOAD`.
#define MVV_PRE_INSTANCE(NAME, NR, U, ...)                                                                           \
    MV3_SPLIT_KERNELS(NAME##_v2p, mv3_preload, NR, U, __VA_ARGS__)                                                   \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) ffn_##NAME##_v2p(FFN_PARAMS) {                     \
        ffn_preload<NR, U>(Wg, Wu, rows, row_bytes, cols, x, h, ts_g, ts_u, nx, nw, neps, nout);                     \
    }
MVV_INSTANCE(q8_0s, MVV_Q8, v3, MVV3_NR, MVV3_U_Q8, false, FAST_WARPS * 32)
MVV_PRE_INSTANCE(q8_0s, MVV2_NR, MVV2_U_Q8, MVV2_Q8_BOUNDS)
// v2g: v2's split Q8_0 mat-vecs on a persistent grid (mv3_grid).
MV3_SPLIT_KERNELS(q8_0s_v2g, mv3_grid, MVV2_NR, MVV2_U_Q8, MVV2_Q8_BOUNDS)
MVV_INSTANCE(q4_ks, MVV_Q4K, v2, MVV2_NR, MVV2_U_Q4K, false, FAST_WARPS * 32)
MVV_INSTANCE(q4_ks, MVV_Q4K, v3, MVV3_NR, MVV3_U_Q4K, false, FAST_WARPS * 32)
MVV_INSTANCE(q8_0s, MVV_Q8, v4, MVV4_NR, MVV4_U_Q8, false, FAST_WARPS * 32, 4)
MVV_INSTANCE(q4_ks, MVV_Q4K, v4, MVV4_NR, MVV4_U_Q4K, false, FAST_WARPS * 32, 3)
MVV_INSTANCE(q8_0s, MVV_Q8, v5, MVV5_NR, MVV5_U_Q8, true, FAST_WARPS * 32, 3)
MVV_INSTANCE(q4_ks, MVV_Q4K, v5, MVV5_NR, MVV5_U_Q4K, true, FAST_WARPS * 32, 3)

// ---------------------------------------------------------------------------
// The attention block of a one-row decode layer in ONE launch
// (`attn_block_q8s_f16` / `_f32`; `MIRAGE_CUDA_ATTN_BLOCK=1`, CudaBackend's
// `fuse_attention_blocks` over a recorded step). The launches
//   mv3_q8_0s_v2[g][_kS]  Q, K, V (+ the folded RMSNorm, + biases)
//   attend_rope_<kv>      RoPE, KV store, split attention and its merge
//   mv3_q8_0s_v2[g][_kS]  O (+ the residual add)
// become one persistent grid that runs the same work items with the same
// code, so every output keeps its bits; between the items, counters in
// device memory take the place of the kernel boundaries:
//   1. before the PDL wait, thread 0 asks the copy engine for the block's O
//      row tiles, whole, into dynamic shared memory: weights only, so they
//      stream in while the previous kernel, the Q/K/V products and the
//      attention run;
//   2. the Q/K/V row tiles of mv3_grid (K and V tiles first: every attention
//      item needs its KV head), each followed by +1 on the ready counter of
//      each head it wrote rows of;
//   3. the attention items (head, split) of attend_rope: each waits until
//      its query head and KV head are complete, then runs attend_rope_part
//      and attend_then_merge; the block that merges a head adds 1 to the
//      merged-heads counter;
//   4. the O row tiles: wait for every head, copy the attention output into
//      shared memory (through L2), dot it with the rows from step 1 (or from
//      global memory, tiles step 1 did not take);
//   5. the last block to finish zeroes the counters for the next launch and,
//      when the layer's next launch is the RMSNorm of the residual stream
//      (the sparse FFN's, whose phase 1 does not fold it), runs that norm.
// Why: the three kernels are latency chains (ncu, 7B: Q/K/V 13.6 us, the
// attention ~10 us at ~20 positions, O 9.7 us, plus ~3 us a boundary), and
// every change that kept the boundaries (PDL, L2 prefetch, preload into
// registers) left the step where it was. Here O's 13.6 MB leave the
// critical path and two boundaries go.
// No deadlock: every block is resident (the host sizes the grid to the
// resident blocks at this shared memory), each block does all its step-2
// items (which wait on nothing) before any wait, step 3 waits on step 2
// only and step 4 on step 3 only.
// sync: ATTB_SYNC(n_head, n_head_kv) u32, zero before the first launch:
// [0, n_head) the query heads' finished tiles, then the K heads', the V
// heads', the merged heads, the finished blocks. One activation row;
// head_dim <= ATT_THREADS; blocks of ATTB_THREADS, the mat-vecs' and the
// attention's block size, so their code runs unchanged.
// ---------------------------------------------------------------------------
#define ATTB_THREADS (FAST_WARPS * 32)
#define ATTB_SYNC(n_head, n_head_kv) ((n_head) + 2 * (n_head_kv) + 2)

__device__ __forceinline__ unsigned attb_load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every thread of the block: returns once *p >= target (thread 0 polls).
// A wait past ATTB_WAIT_CYCLES (~10 s) means blocks that should be resident
// are not (the launch broke the kernel's one assumption): trap, so that the
// launch fails with an error instead of hanging the process.
#define ATTB_WAIT_CYCLES (20ll * 1000 * 1000 * 1000)
__device__ __forceinline__ void attb_wait(const unsigned* p, unsigned target) {
    if (threadIdx.x == 0) {
        const long long t0 = clock64();
        while (attb_load_acquire(p) < target) {
            __nanosleep(32);
            if (clock64() - t0 > ATTB_WAIT_CYCLES) __trap();
        }
    }
    __syncthreads();
}

// Every thread of the block, after its stores: +1 on c[h0..=h1].
__device__ __forceinline__ void attb_signal(unsigned* c, int h0, int h1) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        for (int h = h0; h <= h1; h++) atomicAdd(c + h, 1u);
}

// Row tiles of T rows that hold rows of head h of a matrix of `rows` rows.
__device__ __forceinline__ unsigned attb_tiles_of(int h, int head_dim, int rows, int T) {
    const int r0 = h * head_dim, r1 = min(rows, (h + 1) * head_dim) - 1;
    return (unsigned)(r1 / T - r0 / T + 1);
}

#define ATTB_PARAMS(KV)                                                                                              \
    const u8 *W0, const u8 *W1, const u8 *W2, int rows0, int rows1, int rows2, int cols, const float *x, float *y0, \
        float *y1, float *y2, const float *bias0, const float *bias1, const float *bias2, const float *nx,          \
        const float *nw, float neps, float *nout, int s_qkv, KV *kc, KV *vc, const int *slots, int n_head,          \
        int n_head_kv, int head_dim, int n_ctx, int chunk, float scale, float *part, unsigned *count, float *att,   \
        int neox, float freq_base, int n_split, const u8 *Wo, int rows_o, int cols_o, float *yo, const float *bo,    \
        float *res_o, int s_o, const float *tw, float teps, float *tout, unsigned *sync, int o_pre, int vec_floats
#define ATTB_ARGS                                                                                                    \
    W0, W1, W2, rows0, rows1, rows2, cols, x, y0, y1, y2, bias0, bias1, bias2, nx, nw, neps, nout, s_qkv, kc, vc,   \
        slots, n_head, n_head_kv, head_dim, n_ctx, chunk, scale, part, count, att, neox, freq_base, n_split, Wo,     \
        rows_o, cols_o, yo, bo, res_o, s_o, tw, teps, tout, sync, o_pre, vec_floats

// Step 2: mv3_grid's tiles of Q, K and V (S warps a row group) from xa,
// K and V first; after each, +1 on the ready counter of every head it wrote
// rows of (the counters' barrier also frees mv3_store's part for the next).
template <int S>
__device__ __forceinline__ void attb_qkv(const u8* W0, const u8* W1, const u8* W2, int rows0, int rows1, int rows2,
                                         int cols, const float* xa, float* y0, float* y1, float* y2,
                                         const float* bias0, const float* bias1, const float* bias2, unsigned* sync,
                                         int n_head, int n_head_kv, int head_dim) {
    const int per_block = (FAST_WARPS / S) * MVV2_NR, tq = (rows0 + per_block - 1) / per_block;
    const int rows[3] = {rows0, rows1, rows2}, base[3] = {0, n_head, n_head + n_head_kv};
    mv3_tile_loop<MVV2_NR, MVV2_U_Q8, S>(
        W0, W1, W2, rows0, rows1, rows2, 0, cols, xa, y0, y1, y2, 0.f, 0.f, 0.f, bias0, bias1, bias2, (float*)0,
        (const float*)0, (const float*)0, 0.f, (float*)0, xa, 0, [&](int i, int n) { return (i + tq) % n; },
        [&](int m, int bx) {
            const int last = min(rows[m], (bx + 1) * per_block) - 1;
            attb_signal(sync + base[m], bx * per_block / head_dim, last / head_dim);
        });
}

// Step 4: the O tiles of this block (S warps a row group), the first o_pre
// of them from the copies step 1 asked for (otiles, landing on bar).
template <int S>
__device__ __forceinline__ void attb_o(const u8* Wo, int rows_o, int cols_o, float* yo, const float* bo, float* res_o,
                                       const float* att, float* xs, const u8* otiles, int o_pre,
                                       unsigned long long* bar, const unsigned* merged, int n_head) {
    const int NR = MVV2_NR, U = MVV2_U_Q8, G = 128;
    const int per_block = (FAST_WARPS / S) * NR;
    const int n_tiles = (rows_o + per_block - 1) / per_block;
    if ((int)blockIdx.x >= n_tiles) return;
    __shared__ float part[S > 1 ? FAST_WARPS : 1][NR];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, slice = warp % S;
    int c_lo, c_n;
    mv3_slice<G, S>(cols_o, slice, c_lo, c_n);
    const int qs = mvv_qrow<MVV_Q8>(cols_o), ms = mvv_mrow<MVV_Q8>(cols_o);
    const long tile_bytes = (long)per_block * (qs + ms);
    attb_wait(merged, (unsigned)n_head);
    for (int i = threadIdx.x; i < cols_o; i += blockDim.x) xs[i] = __ldcg(att + i);
    __syncthreads();
    if (o_pre > 0) sb_tx_wait(bar, 0);
    int i = 0;
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x, i++) {
        const int r0 = (t * (FAST_WARPS / S) + warp / S) * NR;
        float acc[NR];
#pragma unroll
        for (int k = 0; k < NR; k++) acc[k] = 0.f;
        if (r0 < rows_o && c_n > 0) {
            if (i < o_pre) {
                // q8s_dot16's loop (PF off) over the rows in shared memory:
                // the same loads' values, the same arithmetic.
                const u8* tq = otiles + i * tile_bytes;
                const int rr = r0 - t * per_block;
                MvvRows R;
                R.qa = R.qb = tq + (long)rr * qs + c_lo;
                R.ma = R.mb = tq + (long)per_block * qs + (long)rr * ms + (c_lo >> 4);
                R.qs = qs;
                R.ms = ms;
                R.last = rows_o - 1 - r0;
                uint4 w[U][NR];
                u32 sc[U][NR];
                const int n_chunks = (c_n + 511) >> 9;
                for (int c = 0; c < n_chunks; c += U) {
                    q8s_load16<NR, NR, U, true>(R, c_n, lane, w, sc, c);
                    q8s_compute16<NR, U>(xs + c_lo, c_n, lane, w, sc, c, acc);
                }
            } else {
                const MvvRows R = mv3_rows<MVV_Q8>(Wo, rows_o, r0, c_lo, qs, ms);
                mvv_dot<MVV_Q8, NR, NR, U, false>(R, xs + c_lo, c_n, lane, acc);
            }
        }
        mv3_store<NR, S>(acc, part, warp, lane, slice, r0, yo, bo, res_o, 0, rows_o);
        if (S > 1) __syncthreads();  // the slice-0 warps have read part
    }
}

#define ATTB_SPLIT(S, CALL)                                                                                          \
    switch (S) {                                                                                                     \
        case 1: CALL(1); break;                                                                                      \
        case 2: CALL(2); break;                                                                                      \
        case 4: CALL(4); break;                                                                                      \
        default: CALL(8); break;                                                                                     \
    }

template <typename KV>
__device__ void attn_block(ATTB_PARAMS(KV)) {
    __shared__ __align__(8) unsigned long long attb_bar;
    // Step 1 (weights only: allowed before the wait). The host passes o_pre
    // > 0 only when every O tile is whole (rows_o % tile rows == 0) and its
    // two spans (quants, scales) are 16-byte multiples at 16-byte offsets.
    // The tiles start at the first 128-byte boundary after the vector (the
    // copy engine writes 16-byte aligned shared memory; the extern array is
    // only float-aligned by its type; the host plans 128 bytes of slack).
    u8* otiles = (u8*)(((unsigned long long)(fused_norm_xs + vec_floats) + 127) & ~127ull);
    {
        const int TO = (FAST_WARPS / s_o) * MVV2_NR, n_to = (rows_o + TO - 1) / TO;
        const long qb = (long)TO * cols_o, mb = (long)TO * (cols_o >> 4);
        if (o_pre > 0 && (int)blockIdx.x < n_to && threadIdx.x == 0) {
            int nt = 0;
            for (int t = blockIdx.x; t < n_to && nt < o_pre; t += gridDim.x) nt++;
            sb_tx_init(&attb_bar);
            sb_tx_init_fence();
            sb_tx_expect(&attb_bar, (sb_u32)(nt * (qb + mb)));
            for (int i = 0; i < nt; i++) {
                const long t = blockIdx.x + (long)i * gridDim.x;
                u8* d = otiles + i * (qb + mb);
                sb_bulk_g2s(d, Wo + t * qb, (sb_u32)qb, &attb_bar);
                sb_bulk_g2s(d + qb, Wo + (long)rows_o * cols_o + t * mb, (sb_u32)mb, &attb_bar);
            }
        }
    }
    PDL_ENTRY();
    // The folded norm reads the residual stream, which step 4 adds O into.
    // Safe: a block with Q/K/V tiles finishes this before its first tile,
    // and step 4 waits (through the merged heads) for every tile; a block
    // without tiles never uses xa, and nout is block 0's, which has tile 0.
    const float* xa = nx != 0 ? norm_prologue(nx, nw, neps, nout, cols, 0) : x;
    // Step 2.
#define ATTB_QKV(S)                                                                                                  \
    attb_qkv<S>(W0, W1, W2, rows0, rows1, rows2, cols, xa, y0, y1, y2, bias0, bias1, bias2, sync, n_head,            \
                n_head_kv, head_dim)
    ATTB_SPLIT(s_qkv, ATTB_QKV)
#undef ATTB_QKV
    // Step 3.
    {
        const int TQ = (FAST_WARPS / s_qkv) * MVV2_NR, group = n_head / n_head_kv;
        unsigned* merged = sync + n_head + 2 * n_head_kv;
        for (int u = blockIdx.x; u < n_head * n_split; u += gridDim.x) {
            const AttIdx ix{0, u / n_split, u % n_split, n_split};
            const int kvh = ix.head / group;
            const bool merger = attend_then_merge(
                [&] {
                    attb_wait(sync + ix.head, attb_tiles_of(ix.head, head_dim, rows0, TQ));
                    attb_wait(sync + n_head + kvh, attb_tiles_of(kvh, head_dim, rows1, TQ));
                    attb_wait(sync + n_head + n_head_kv + kvh, attb_tiles_of(kvh, head_dim, rows2, TQ));
                    attend_rope_part<KV, false, true>(y0, y1, y2, kc, vc, slots, n_head, n_head_kv, head_dim, n_ctx,
                                                      chunk, scale, neox, freq_base, part, ix);
                },
                slots, n_head, head_dim, chunk, part, count, att, ix);
            if (merger) attb_signal(merged, 0, 0);
        }
    }
    // Step 4 (the vector area of the dynamic shared memory held the norm's
    // output, which this block's step 2 has finished reading).
#define ATTB_O(S)                                                                                                    \
    attb_o<S>(Wo, rows_o, cols_o, yo, bo, res_o, att, fused_norm_xs, otiles, o_pre, &attb_bar,                      \
              sync + n_head + 2 * n_head_kv, n_head)
    ATTB_SPLIT(s_o, ATTB_O)
#undef ATTB_O
    // Step 5: the last block out is past every wait of every block, and
    // every O row is in the residual stream: it zeroes the counters and,
    // when tw is set, runs the RMSNorm that follows the attention in the
    // layer (the `rms_norm` launch it replaces: rms_norm_row at 256 threads
    // over the same values, so the same bits) on the residual, read through
    // L2 (other blocks wrote it; this SM's L1 may hold the lines step 2's
    // norm read) into the vector area first.
    __shared__ int attb_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        attb_last = atomicAdd(sync + ATTB_SYNC(n_head, n_head_kv) - 1, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!attb_last) return;
    if (tw != 0) {
        __threadfence();
        for (int i = threadIdx.x; i < rows_o; i += blockDim.x) fused_norm_xs[i] = __ldcg(res_o + i);
        __syncthreads();
        __shared__ float s32[32];
        rms_norm_row(fused_norm_xs, tw, teps, rows_o, s32, [&](int i, float v) { tout[i] = v; });
    }
    if (threadIdx.x == 0) {
        for (int i = 0; i < ATTB_SYNC(n_head, n_head_kv); i++) sync[i] = 0u;
        __threadfence();
    }
}

#define ATTB_INSTANCE(NAME, KV)                                                                                      \
    extern "C" __global__ void __launch_bounds__(ATTB_THREADS) attn_block_q8s_##NAME(ATTB_PARAMS(KV)) {             \
        attn_block<KV>(ATTB_ARGS);                                                                                   \
    }
ATTB_INSTANCE(f32, float)
ATTB_INSTANCE(f16, u16)

// ---------------------------------------------------------------------------
// The floor of one decode-graph node (kernel-bench --launch-floor): a kernel
// that does nothing but the PDL handshake every kernel starts with and one
// dependent read-modify-write (block 0, thread 0: *counter += 1 after the
// wait, so each node sees the previous node's write). Its time per node in a
// replayed graph, with and without programmatic serialization, at grids of
// 1 to several blocks per SM, is what a kernel boundary costs by itself.
extern "C" __global__ void pdl_floor(unsigned* counter) {
    PDL_ENTRY();
    if (blockIdx.x == 0 && threadIdx.x == 0) *counter += 1u;
}

// The floor of a dependency inside a persistent grid (kernel-bench
// --launch-floor, beside pdl_floor): `steps` rounds of a handoff through one
// counter in global memory, the way attn_block's blocks wait on each other
// (thread 0: a fence, an atomic add, acquire-load polls; then a block
// barrier). chain 0: every round is grid-wide (each block adds 1, then
// waits until all gridDim.x of the round have); chain 1: round s is block
// s % gridDim.x's alone, after round s - 1's add (one producer, one
// consumer). The last block out zeroes both counters (counter[1] counts
// the blocks out), so the next launch starts from zero. Its time per round
// beside pdl_floor's per node is a flag against a kernel boundary.
extern "C" __global__ void flag_floor(unsigned* counter, int steps, int chain) {
    PDL_ENTRY();
    if (!chain) {
        for (int s = 0; s < steps; s++) {
            if (threadIdx.x == 0) {
                __threadfence();
                atomicAdd(counter, 1u);
                const unsigned target = (unsigned)(s + 1) * gridDim.x;
                while (attb_load_acquire(counter) < target) {
                }
            }
            __syncthreads();
        }
    } else {
        for (int s = blockIdx.x; s < steps; s += gridDim.x) {
            if (threadIdx.x == 0) {
                while (attb_load_acquire(counter) < (unsigned)s) {
                }
                __threadfence();
                atomicAdd(counter, 1u);
            }
            __syncthreads();
        }
    }
    if (threadIdx.x == 0 && atomicAdd(counter + 1, 1u) == gridDim.x - 1) {
        counter[0] = 0u;
        counter[1] = 0u;
        __threadfence();
    }
}
