// MIRAGE dense CUDA kernels, first file: ggml block decoding (the types,
// dequant_unit, embedding rows and GEMM weight tiles) and the helpers every
// later file uses. Compiled at run time by NVRTC (see
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

// The ggml block types the kernels read, one row each: X(TYPE, suffix,
// ggml type id, bytes per block, elements per block). The kernel names are
// <kernel>_<suffix>. A host test (crates/mirage-cuda/src/checks.rs) checks
// every row against mirage-gguf's type table (crates/mirage-gguf/src/types.rs).
#define GGML_TYPES(X)        \
    X(F32, f32, 0, 4, 1)     \
    X(F16, f16, 1, 2, 1)     \
    X(BF16, bf16, 30, 2, 1)  \
    X(Q4_0, q4_0, 2, 18, 32) \
    X(Q4_1, q4_1, 3, 20, 32) \
    X(Q5_0, q5_0, 6, 22, 32) \
    X(Q5_1, q5_1, 7, 24, 32) \
    X(Q8_0, q8_0, 8, 34, 32) \
    X(Q2_K, q2_k, 10, 84, 256) \
    X(Q3_K, q3_k, 11, 110, 256) \
    X(Q4_K, q4_k, 12, 144, 256) \
    X(Q5_K, q5_k, 13, 176, 256) \
    X(Q6_K, q6_k, 14, 210, 256)

#define GGML_TY_ID(T, S, ID, B, E) TY_##T = ID,
enum GgmlType { GGML_TYPES(GGML_TY_ID) };

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

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Block-wide sum over blockDim.x (a multiple of 32, at most 1024) threads.
__device__ float block_sum(float v, float* shared32) { return norm_block_sum(v, shared32); }


// Bytes per unit (legacy) or per super-block (K-quants), and units per
// block: a unit is 32 elements, a block at most one unit for the legacy
// types and eight for the K-quants.
template <int T> struct Layout;
#define GGML_LAYOUT(T, S, ID, B, E) \
    template <> struct Layout<TY_##T> { enum { BYTES = (E) >= 32 ? (B) : (B) * 32 / (E), UNITS = (E) >= 32 ? (E) / 32 : 1 }; };
GGML_TYPES(GGML_LAYOUT)

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

// Row `row` of type T dequantized by the block's threads (unit u by
// thread u mod blockDim.x): store(i, w) gets element i.
template <int T, class Store>
__device__ __forceinline__ void dequant_row(const u8* row, int cols, Store store) {
    for (int u = threadIdx.x; u < (cols >> 5); u += blockDim.x) {
        float w[32];
        dequant_unit<T>(row, u, w);
#pragma unroll
        for (int i = 0; i < 32; i++) store(u * 32 + i, w[i]);
    }
}

// out[i, :] = dequant(table[tokens[i], :]); grid (n_tokens), block 32 * k.
template <int T>
__device__ void embed(const u8* __restrict__ table, long row_bytes, int n_rows, int cols, const u32* __restrict__ tokens,
                      float* __restrict__ out) {
    u32 t = tokens[blockIdx.x];
    if (t >= (u32)n_rows) return;  // checked on the host
    float* o = out + (long)blockIdx.x * cols;
    dequant_row<T>(table + (long)t * row_bytes, cols, [&](int i, float w) { o[i] = w; });
}

// wh[r - r0, :] = f16(dequant(W[r, :])) for r in [r0, r0 + gridDim.x): the
// weight tile a tensor-core GEMM multiplies. Block 128.
template <int T>
__device__ void dequant_f16(const u8* __restrict__ W, long row_bytes, int cols, int r0, u16* __restrict__ wh) {
    u16* o = wh + (long)blockIdx.x * cols;
    dequant_row<T>(W + (long)(r0 + blockIdx.x) * row_bytes, cols, [&](int i, float w) { o[i] = f2h(w); });
}

// The ggml-layout kernels of every type: embedding rows, GEMM weight tiles.
#define GGML_KERNELS(T, S, ID, B, E)                                                                                 \
    extern "C" __global__ void embed_##S(const u8* table, long row_bytes, int n_rows, int cols, const u32* tokens,  \
                                         float* out) {                                                              \
        PDL_ENTRY();                                                                                                 \
        embed<TY_##T>(table, row_bytes, n_rows, cols, tokens, out);                                                  \
    }                                                                                                                \
    extern "C" __global__ void dequant_f16_##S(const u8* W, long row_bytes, int cols, int r0, u16* wh) {             \
        PDL_ENTRY();                                                                                                 \
        dequant_f16<TY_##T>(W, row_bytes, cols, r0, wh);                                                             \
    }
GGML_TYPES(GGML_KERNELS)
