// ---------------------------------------------------------------------------

#define MV_NR 4     // weight rows per warp
#define MV_U_Q8 2   // 512-element chunks in flight per row (split Q8_0)

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

// Rows r0.. of a split Q8_0 matrix (a row: qs = cols int8 quants, then
// ms = cols / 16 bytes of f16 scales) from column c_lo on.
__device__ __forceinline__ MvvRows mv3_rows(const u8* W, int rows, int r0, int c_lo, int qs, int ms) {
    MvvRows R;
    R.qa = R.qb = W + (long)r0 * qs + c_lo;
    R.ma = R.mb = W + (long)rows * qs + (long)r0 * ms + (c_lo >> 4);
    R.qs = qs;
    R.ms = ms;
    R.last = rows - 1 - r0;
    return R;
}

// Rows [rb, rb + n) of a split-layout matrix W (rows of qs quant bytes,
// then rows of ms scale or header bytes) asked of L2 before the block waits
// on the previous kernel (weights only, pdl.cu): the first L2_PREFETCH_ROW
// bytes of each row's quants and all of their scales, by the blocks of
// activation row 0.
__device__ __forceinline__ void split_rows_l2_prefetch(const u8* W, int rows, int rb, int n, int qs, int ms) {
    if (blockIdx.y != 0) return;
    l2_prefetch_rows(W + (long)rb * qs, qs, n, min(qs, L2_PREFETCH_ROW));
    l2_prefetch_block(W + (long)rows * qs + (long)rb * ms, (long)n * ms);
}

// mv3 of split Q8_0: S warps per group of NR rows (S = 1: no split), each
// over one column slice of whole G-element granules.
template <int NR, int U, int S>
__device__ __forceinline__ void mv3_split(MV3_PARAMS) {
    const int G = 128;
    MV3_PICK_W((FAST_WARPS / S) * NR)
    {
        // The block's rows (all columns).
        const int rb = bx * (FAST_WARPS / S) * NR;
        split_rows_l2_prefetch(W, rows, rb, min((FAST_WARPS / S) * NR, rows - rb), cols, cols >> 4);
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
        const MvvRows R = mv3_rows(W, rows, r0, c_lo, cols, cols >> 4);
        q8s_dot16<NR, NR, U>(R, xa + c_lo, c_n, lane, acc);
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
    const int qs = cols, ms = cols >> 4;
    for (int i = blockIdx.x; i < n_tiles; i += gridDim.x) {
        const int t = order(i, n_tiles);
        MV3_MATRIX(t, per_block)
        const int r0 = (bx * (FAST_WARPS / S) + warp / S) * NR;
        float acc[NR];
#pragma unroll
        for (int k = 0; k < NR; k++) acc[k] = 0.f;
        if (r0 < rows && c_n > 0) {
            const MvvRows R = mv3_rows(W, rows, r0, c_lo, qs, ms);
            q8s_dot16<NR, NR, U>(R, xa + c_lo, c_n, lane, acc);
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

// gate/up/SwiGLU of split Q8_0: NR / 2 channels per warp (their gate
// rows, then their up rows, are the warp's NR rows).
template <int NR, int U>
__device__ __forceinline__ void ffn_split(FFN_PARAMS) {
    const int NC = NR / 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int qs = cols, ms = cols >> 4;
    {
        // The block's gate and up rows.
        const int rb = blockIdx.x * FAST_WARPS * NC, nb = min(FAST_WARPS * NC, rows - rb);
        split_rows_l2_prefetch(Wg, rows, rb, nb, qs, ms);
        split_rows_l2_prefetch(Wu, rows, rb, nb, qs, ms);
    }
    PDL_ENTRY();
    FAST_INPUT
    int r0 = (blockIdx.x * FAST_WARPS + warp) * NC;
    if (r0 >= rows) return;
    const MvvRows R = ffn_rows(Wg, Wu, rows, r0, qs, ms);
    float acc[NR];
#pragma unroll
    for (int k = 0; k < NR; k++) acc[k] = 0.f;
    q8s_dot16<NR, NC, U>(R, xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < NC; k++) {
        float gs = warp_sum(acc[k]), us = warp_sum(acc[NC + k]);
        if (lane == 0 && r0 + k < rows) h[(long)a * rows + r0 + k] = silu_mul(gs, us);
    }
}

// The kernels: MV_NR rows per warp, MV_U_* chunks in flight per row, at
// every column split.
MV3_KERNELS(q8_0s, mv3_split, MV_NR, MV_U_Q8)
MV3_KERNELS(q8_0s_grid, mv3_grid, MV_NR, MV_U_Q8)
extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_q8_0s(FFN_PARAMS) {
    ffn_split<MV_NR, MV_U_Q8>(Wg, Wu, rows, row_bytes, cols, x, h, ts_g, ts_u, nx, nw, neps, nout);
}

