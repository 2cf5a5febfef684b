// ---------------------------------------------------------------------------

#define MV_NR 4     // weight rows per warp
#define MV_U_Q8 2   // 512-element chunks in flight per row (split Q8_0)
#define MV_U_Q4K 1  // chunks of 4 super-blocks in flight per row (split Q4_K)

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
// row end load zeros.
template <int NR, int NH, int U>
__device__ __forceinline__ void q8s_load16(const MvvRows& R, int cols, int lane, uint4 (&w)[U][NR], u32 (&sc)[U][NR],
                                           int c) {
#pragma unroll
    for (int h = 0; h < U; h++) {
        int e = ((c + h) << 9) + (lane << 4);
        bool ok = e < cols;  // implies c + h < n_chunks
#pragma unroll
        for (int k = 0; k < NR; k++) {
            w[h][k] = ok ? __ldg((const uint4*)(mvv_q<NH>(R, k) + e)) : make_uint4(0u, 0u, 0u, 0u);
            sc[h][k] = ok ? (u32)__ldg((const u16*)(mvv_m<NH>(R, k) + ((e >> 5) << 1))) : 0u;
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
template <int NR, int NH, int U>
__device__ __forceinline__ void q8s_dot16(const MvvRows& R, const float* __restrict__ xa, int cols, int lane,
                                          float* acc) {
    const int n_chunks = (cols + 511) >> 9;
    auto load = [&](uint4 (&w)[U][NR], u32 (&sc)[U][NR], int c) { q8s_load16<NR, NH, U>(R, cols, lane, w, sc, c); };
    auto compute = [&](const uint4 (&w)[U][NR], const u32 (&sc)[U][NR], int c) {
        q8s_compute16<NR, U>(xa, cols, lane, w, sc, c, acc);
    };
    uint4 w[U][NR];
    u32 sc[U][NR];
    for (int c = 0; c < n_chunks; c += U) {
        load(w, sc, c);
        compute(w, sc, c);
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
// Every lane runs every shuffle (no lane leaves the loop early).
template <int NR, int NH, int U>
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
    for (int c = 0; c < n_chunks; c += U) {
        load(w, hw, c);
        compute(w, hw, c);
    }
}

#define MVV_Q8 0
#define MVV_Q4K 1

template <int L, int NR, int NH, int U>
__device__ __forceinline__ void mvv_dot(const MvvRows& R, const float* xa, int cols, int lane, float* acc) {
    if (L == MVV_Q8)
        q8s_dot16<NR, NH, U>(R, xa, cols, lane, acc);
    else
        q4ks_dot16<NR, NH, U>(R, xa, cols, lane, acc);
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

// mv3 of a split layout: S warps per group of NR rows (S = 1: no split),
// each over one column slice of whole G-element granules.
template <int L, int NR, int U, int S>
__device__ __forceinline__ void mv3_split(MV3_PARAMS) {
    const int G = L == MVV_Q8 ? 128 : 256;
    MV3_PICK_W((FAST_WARPS / S) * NR)
    {
        // The block's rows (all columns), before waiting on the previous
        // kernel: weights only (pdl.cu).
        const int rb = bx * (FAST_WARPS / S) * NR, nb = min((FAST_WARPS / S) * NR, rows - rb);
        const int qs = mvv_qrow<L>(cols), ms = mvv_mrow<L>(cols);
        if (blockIdx.y == 0) {
            l2_prefetch_rows(W + (long)rb * qs, qs, nb, min(qs, L2_PREFETCH_ROW));
            l2_prefetch_block(W + (long)rows * qs + (long)rb * ms, (long)nb * ms);
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
        mvv_dot<L, NR, NR, U>(R, xa + c_lo, c_n, lane, acc);
    }
    mv3_store<NR, S>(acc, part, warp, lane, slice, r0, y, bias, rs, a, rows);
}

// mv3_grid's loop over the launch's row tiles, from xa (activation row a):
// this block's i-th tile is order(i, n_tiles); after(m, bx) runs on every
// thread after each tile's store (m the matrix, bx the tile within it).
template <int NR, int U, int S, class Order, class After>
__device__ __forceinline__ void mv3_tile_loop(MV3_PARAMS, const float* xa, int a, Order order, After after) {
    const int G = 128;  // split Q8_0 granule (mv3_split's G)
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
            mvv_dot<MVV_Q8, NR, NR, U>(R, xa + c_lo, c_n, lane, acc);
        }
        mv3_store<NR, S>(acc, part, warp, lane, slice, r0, y, bias, rs, a, rows);
        after(m, bx);
    }
}

// mv3_split on a persistent grid (`mv3_q8_0s_grid*`): block b takes the row
// groups ("tiles") b, b + gridDim.x, ... of the three matrices in
// mv3_split's numbering, so a grid of the device's resident blocks covers a
// launch of any size, and the input (with a folded norm, its RMSNorm) is
// read once per block, not once per tile. Each tile's loads and sums are
// mv3_split's: the same bits. Unlike mv3_split it asks L2 for none of its
// rows before the PDL wait. Why: at the 7B shape the Q/K/V launch is 576
// blocks on 264 resident (2.2 waves), the O and down launches 448 (1.7),
// and every block pays the norm prologue and its own start again.
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

// gate/up/SwiGLU of a split layout: NR / 2 channels per warp (their gate
// rows, then their up rows, are the warp's NR rows).
template <int L, int NR, int U>
__device__ __forceinline__ void ffn_split(FFN_PARAMS) {
    const int NC = NR / 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int qs = mvv_qrow<L>(cols), ms = mvv_mrow<L>(cols);
    {
        // The block's gate and up rows before waiting (see mv3_split).
        const int rb = blockIdx.x * FAST_WARPS * NC, nb = min(FAST_WARPS * NC, rows - rb);
        if (blockIdx.y == 0) {
            const long pr = min(qs, L2_PREFETCH_ROW);
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
    mvv_dot<L, NR, NC, U>(R, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < NC; k++) {
        float gs = warp_sum(acc[k]), us = warp_sum(acc[NC + k]);
        if (lane == 0 && r0 + k < rows) h[(long)a * rows + r0 + k] = silu_mul(gs, us);
    }
}

// The kernels: MV_NR rows per warp, MV_U_* chunks in flight per row, at
// every column split.
MV3_KERNELS(q8_0s, mv3_split, MVV_Q8, MV_NR, MV_U_Q8)
MV3_KERNELS(q8_0s_grid, mv3_grid, MV_NR, MV_U_Q8)
MV3_KERNELS(q4_ks, mv3_split, MVV_Q4K, MV_NR, MV_U_Q4K)
extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_q8_0s(FFN_PARAMS) {
    ffn_split<MVV_Q8, MV_NR, MV_U_Q8>(Wg, Wu, rows, row_bytes, cols, x, h, ts_g, ts_u, nx, nw, neps, nout);
}
extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_q4_ks(FFN_PARAMS) {
    ffn_split<MVV_Q4K, MV_NR, MV_U_Q4K>(Wg, Wu, rows, row_bytes, cols, x, h, ts_g, ts_u, nx, nw, neps, nout);
}

