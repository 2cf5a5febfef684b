// ===========================================================================
// Decode mat-vecs of the dense module (after ggml.cu; nvfp4.cu's sb_*
// decode helpers are shared with the sparse path).
//
// Weight layouts, chosen at upload (crates/mirage-cuda/src/weights.rs):
//   ggml  : the file's blocks, read by dequant_unit<T> (ggml.cu), this file.
//   q8_0s, q4_ks : split Q8_0 / Q4_K (quants of every row, then their
//           scales or super-block headers): matvec_split.cu (Q8_0) and
//           matvec_imma.cu (Q4_K, on int8 tensor cores).
//   nvfp4, q5_0s : matvec_lanes.cu.
// Element accessors of the repacked layouts (embedding rows, GEMM weight
// tiles) are at the end of this file.
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
#define FAST_ROWS 4    // weight rows per warp (matvec_lanes.cu)

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
// unfused ops' order: y = W x, then y += bias, then res += y.
__device__ __forceinline__ void mv_store(float v, float* y, const float* bias, float* rs, int a, int rows, int r) {
    if (bias != 0) v += bias[r];
    long i = (long)a * rows + r;
    y[i] = v;
    if (rs != 0) rs[i] += v;
}

// One lane's share of W[row] . xa on a ggml-layout row: units lane, lane +
// 32, ... in turn. xa may be in global or shared memory (norm-fused
// launches), so x loads are generic.
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

#define GGML_MATVECS(T, S, ID, B, E)                                                                                 \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_##S(MV3_PARAMS) {                             \
        PDL_ENTRY();                                                                                                 \
        mv3_ggml<TY_##T>(MV3_ARGS);                                                                                  \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_##S(FFN_PARAMS) {                             \
        PDL_ENTRY();                                                                                                 \
        ffn_ggml<TY_##T>(Wg, Wu, rows, row_bytes, cols, x, h, ts_g, ts_u, nx, nw, neps, nout);                       \
    }
GGML_TYPES(GGML_MATVECS)

// Columns [lo, lo + n) of warp slice `slice` of S over rows of cols
// elements, in whole G-element granules (n = 0 past the row's end).
template <int G, int S>
__device__ __forceinline__ void mv3_slice(int cols, int slice, int& lo, int& n) {
    const int n_gran = (cols + G - 1) / G, per_slice = (n_gran + S - 1) / S;
    lo = min(cols, slice * per_slice * G);
    n = min(cols, lo + per_slice * G) - lo;
}
// The end of a split mat-vec: the warp sums of acc stored (S = 1), or added
// over the S slices of each row group in slice order by the slice-0 warp
// (S > 1; part: FAST_WARPS x NR floats of shared memory), times scale.
template <int NR, int S>
__device__ __forceinline__ void mv3_store(const float* acc, float (*part)[NR], int warp, int lane, int slice, int r0,
                                          float* y, const float* bias, float* rs, int a, int rows,
                                          float scale = 1.f) {
    if (S == 1) {
#pragma unroll
        for (int k = 0; k < NR; k++) {
            float v = warp_sum(acc[k]);
            if (lane == 0 && r0 + k < rows) mv_store(v * scale, y, bias, rs, a, rows, r0 + k);
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
            mv_store(v * scale, y, bias, rs, a, rows, r0 + lane);
        }
    }
}
// mv3_<suffix>, mv3_<suffix>_k2, _k4, _k8 (the column splits S) from the
// template FN<..., S>.
#define MV3_KERNELS(NAME, FN, ...)                                                                                   \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_##NAME(MV3_PARAMS) {                          \
        FN<__VA_ARGS__, 1>(MV3_ARGS);                                                                                \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_##NAME##_k2(MV3_PARAMS) {                      \
        FN<__VA_ARGS__, 2>(MV3_ARGS);                                                                                \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_##NAME##_k4(MV3_PARAMS) {                      \
        FN<__VA_ARGS__, 4>(MV3_ARGS);                                                                                \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_##NAME##_k8(MV3_PARAMS) {                      \
        FN<__VA_ARGS__, 8>(MV3_ARGS);                                                                                \
    }

// Element i of row r of a repacked matrix, as f32 (the arithmetic of the
// ggml type's dequant_unit, or of the CPU's NVFP4 codec).
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
// ---------------------------------------------------------------------------
// Split Q4_K ("q4_ks"): the 128 quant bytes of every super-block, [rows]
// [cols/2], then the 16 header bytes of every super-block (d, dmin, 12 packed
// 6-bit scales/mins), [rows][cols/256][16]. Same bytes as ggml. The
// mat-vecs are in matvec_imma.cu.

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
// Embedding rows (grid n_tokens, block 128) and GEMM weight tiles (wh[r -
// r0, :] for r in [r0, r0 + gridDim.x), block 128) of a repacked layout,
// from its element accessor ELEM(W, rows, cols, r, i); __VA_ARGS__: the
// layout's extra parameters (nvfp4's tensor scale).
#define REPACKED_ELEMENT_KERNELS(NAME, ELEM, ...)                                                                   \
    extern "C" __global__ void embed_##NAME(const u8* W, int n_rows, int cols, __VA_ARGS__ const u32* tokens,      \
                                            float* out) {                                                           \
        PDL_ENTRY();                                                                                                 \
        u32 t = tokens[blockIdx.x];                                                                                  \
        if (t >= (u32)n_rows) return; /* checked on the host */                                                     \
        for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(long)blockIdx.x * cols + i] = ELEM(W, n_rows, cols, t, i); \
    }                                                                                                                \
    extern "C" __global__ void dequant_f16_##NAME(const u8* W, int rows, int cols, __VA_ARGS__ int r0, u16* wh) {  \
        PDL_ENTRY();                                                                                                 \
        long r = r0 + blockIdx.x;                                                                                    \
        for (int i = threadIdx.x; i < cols; i += blockDim.x) wh[(long)blockIdx.x * cols + i] = f2h(ELEM(W, rows, cols, r, i)); \
    }
#define NVFP4_ELEM(W, rows, cols, r, i) nvfp4_elem(W, rows, cols, ts, r, i)
REPACKED_ELEMENT_KERNELS(q8_0s, q8s_elem, )
REPACKED_ELEMENT_KERNELS(q4_ks, q4ks_elem, )
REPACKED_ELEMENT_KERNELS(q5_0s, q5s_elem, )
REPACKED_ELEMENT_KERNELS(q6_ks, q6ks_elem, )
REPACKED_ELEMENT_KERNELS(nvfp4, NVFP4_ELEM, float ts, )
