// MIRAGE sparse FFN kernels: the fused superblock FFN over page-major split
// Q8_0 pages (superblock_ffn_q8s) and over NVFP4 pages (superblock_ffn_nvfp4),
// and the finish both share with the Q2_K kernel (superblock_q2k.cu).
// Compiled after decode.cu (uses its sb_* helpers).
//
// Split Q8_0 ("q8s"): a ggml Q8_0 matrix of R rows x d (d % 32 == 0) stored
// as its quants [R][d] int8, then its block scales [R][d/32] f16. Same bytes
// as ggml (34 per 32 weights); the quants are 16-byte aligned rows, so a
// lane's 16-byte load is 16 consecutive weights of one 32-weight block.
//
// A page (128 FFN channels) is one contiguous span:
//   [gate quants 128 x d][up quants 128 x d][down_t quants 128 x d]
//   [gate scales 128 x d/32][up scales][down_t scales]
// down_t row i is column i of the page's slice of W_down (the artifact's
// transposed down slice, mirage_artifact::pack): in the down phase a warp
// reads, for 4 channels at once, the 128-byte line of each row that covers
// 128 outputs; gate, up and down share one row format and the page is
// exactly the artifact's.

#define SB_WARPS 8
#define SB_THREADS (SB_WARPS * 32)
#define SB_PAGE_CH 128
// Phase 1: 16-byte loads of each gate and up row in flight per lane and
// round (a round is 32 x SB_P1_VECS 16-element vectors of a row).
#define SB_P1_VECS 4
// Phase 2: 4-channel quads in flight per warp.
#define SB_P2_QUADS 4
// Phase 1 units per pass, a float2 each in shared memory (a unit is one
// round of a row: U <= 512 for d <= 65536).
#define SB_P1B_UNITS 512

// ---------------------------------------------------------------------------
// One reduce-scatter step over lane bit `bit` (16, 8 or 4) on the first 2 n
// values of a: afterwards a[0 .. n) holds the sums over the lane pair of
// elements (lane & bit ? n : 0) + i of the previous a[0 .. 2 n). Used by the
// phase 2 of the q8s, NVFP4 and Q2_K kernels.
template <int N>
__device__ __forceinline__ void nv_reduce_scatter(float* a, int lane, int bit) {
    const bool upper = lane & bit;
#pragma unroll
    for (int i = 0; i < N; i++) {
        const float send = upper ? a[i] : a[i + N];
        const float keep = upper ? a[i + N] : a[i];
        a[i] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
    }
}

// y[chunk's 128 outputs] = the sum of the K partials partials[k][d] of
// output chunk `chunk` (+ y if accumulate), in a fixed order: warp w sums
// parts w, w + 8, ... in order (lane: outputs 4 lane .. 4 lane + 3), then
// thread j adds the 8 warp sums in warp order. red[] is overwritten (after
// a block barrier, so it may hold the caller's data on entry).

// FB: 0 or 1, one load per loop trip, each add waiting for its load; FB > 1:
// a warp issues the loads of FB of its parts at once, then adds them in the
// same order (the same bits, one L2 round trip per FB parts).
template <int FB>
__device__ __forceinline__ void sb_sum_chunk_parts(float (*red)[128], const float* partials, int K, int d, int chunk,
                                                   int accumulate, float* y) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = (chunk << 7) + (lane << 2);
    const int j = threadIdx.x;
    float4 t4 = make_float4(0.f, 0.f, 0.f, 0.f);
    if (e < d) {
        if constexpr (FB <= 1) {
            for (int kk = warp; kk < K; kk += SB_WARPS) {
                float4 v = __ldcg((const float4*)(partials + (long)kk * d + e));
                t4.x += v.x; t4.y += v.y; t4.z += v.z; t4.w += v.w;
            }
        } else {
            for (int k0 = warp; k0 < K; k0 += SB_WARPS * FB) {
                float4 v[FB];
#pragma unroll
                for (int i = 0; i < FB; i++) {
                    const int kk = k0 + i * SB_WARPS;
                    v[i] = kk < K ? __ldcg((const float4*)(partials + (long)kk * d + e)) : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
                for (int i = 0; i < FB; i++) {
                    if (k0 + i * SB_WARPS < K) {
                        t4.x += v[i].x; t4.y += v[i].y; t4.z += v[i].z; t4.w += v[i].w;
                    }
                }
            }
        }
    }
    __syncthreads();  // everyone has read red[] (the caller's data)
    red[warp][4 * lane] = t4.x;
    red[warp][4 * lane + 1] = t4.y;
    red[warp][4 * lane + 2] = t4.z;
    red[warp][4 * lane + 3] = t4.w;
    __syncthreads();
    if (j < 128 && (chunk << 7) + j < d) {
        float t = 0.f;
#pragma unroll
        for (int w2 = 0; w2 < SB_WARPS; w2++) t += red[w2][j];
        float* o = y + (chunk << 7) + j;
        *o = accumulate ? *o + t : t;
    }
}

// The end of one phase-2 item (output chunk `chunk`, part k of K) of the
// fused FFN kernels. On entry red[w][j] holds warp w's sum for output j of
// the chunk and the block has synchronized. Thread j adds the 8 warp sums in
// warp order, stores the block partial and, in the last block to finish
// the chunk, adds the chunk's partials (sb_sum_chunk_parts). Ends with a
// block barrier: red[] is rewritten by the next item.
// FB: how the last block reads the K partials (sb_sum_chunk_parts; 0 for
// superblock_ffn_nvfp4 and superblock_ffn_q2k, 8 for superblock_ffn_q8s).
template <int FB = 0>
__device__ __forceinline__ void sb_finish_item(float (*red)[128], int* last_flag, int chunk, int k, int K, int d,
                                               int accumulate, float* partials, sb_u32* counters, float* y) {
    const int j = threadIdx.x;  // output j of the chunk (threads 0..127)
    const bool own = j < 128 && (chunk << 7) + j < d;
    float p = 0.f;
    if (own) {
#pragma unroll
        for (int w2 = 0; w2 < SB_WARPS; w2++) p += red[w2][j];
    }
    if (own) partials[(long)k * d + (chunk << 7) + j] = p;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        sb_u32 t = atomicAdd(counters + chunk, 1u);
        *last_flag = (t == (sb_u32)K - 1);
        if (*last_flag) counters[chunk] = 0;  // nobody else touches it in this launch
    }
    __syncthreads();
    if (*last_flag) {
        __threadfence();
        sb_sum_chunk_parts<FB>(red, partials, K, d, chunk, accumulate, y);
    }
    __syncthreads();  // red[] is rewritten by the next item
}


// ---------------------------------------------------------------------------
// The fused sparse FFN over the active pages, in two launches of one kernel:
//   y (+)= sum over active pages p of W_down[:, p] (silu(W_gate[p] x) * (W_up[p] x))
//
// active[0 .. min(*n_active, max_active)) are page ids in device memory (a
// router kernel can write them; the host never reads them back). Ids >=
// n_pages contribute nothing. Let C = 128 * n_act be the active channels.
//
// phases 1 (gate/up/SwiGLU): block b takes the contiguous channels
// [C b / B, C (b + 1) / B) and its warps share them in units of one
// sb_q8s_round (32 SB_P1_VECS 16-byte vectors of a row: two units per
// 3584-wide row), so the busiest warp does about as many loads as the
// others; unit dots meet in shared memory and are summed in unit order.
// x is staged in shared memory as 4 planes (float4 j of 16-element vector v
// at xs[j * d/16 + v]) so that the lanes' float4 reads are conflict-free.
// h[channel] goes to hbuf (global, C floats, stays in L2).
// phases 2 (down), launched after phase 1 with the same grid (the kernel
// boundary is the barrier; phase 2's split depends on the grid): the output
// is cut into 128-wide chunks; block b takes (chunk, part) items, part k of
// K covering about C / K channels (whole groups of 8). A warp takes
// 4-channel quads: lane 8 s + q reads bytes 16 q .. 16 q + 15 of the chunk of
// channel s of the quad (one warp load = 4 channels' lines), 16 outputs in
// registers, SB_P2_QUADS quads in flight; at the item's end a reduce-scatter
// over lane bits 16 and 8 leaves lane (s, q) outputs 16 q + 4 s .. + 3, and
// the warp sums are added in warp order into one 128-float block partial per
// item. The partial goes to partials[k][d]; the last block to finish a chunk
// (per-chunk arrival counter) sums its K partials in part order and writes
// y = partial sum (+ y if accumulate): bit-reproducible for a given grid,
// part_ch and active list.
// K = min(gridDim / n_chunks, max(C / part_ch, 1)) with part_ch > 0 (a part
// holds at least part_ch channels: fewer, fuller parts when few channels are
// active or d is small), gridDim / n_chunks with part_ch <= 0.
// Scratch: hbuf (max_active * 128 floats), partials ((gridDim / n_chunks) *
// d floats), counters (n_chunks u32, zero at first use, self-resetting).
// Grid: any (the host takes the resident blocks); block SB_THREADS; dynamic
// shared memory d * 4 bytes for phase 1, none for phase 2; d % 32 == 0.
// nw != null folds the RMSNorm before the FFN into phase 1 (sb_stage_x).

#define SB_Q8S_PARAMS                                                                                      \
    const sb_u8 *__restrict__ pages, long page_bytes, int n_pages, int d, const float *__restrict__ x,    \
        const sb_u32 *__restrict__ active, const int *__restrict__ n_active, int max_active, int accumulate, \
        float *hbuf, float *partials, sb_u32 *counters, float *y, int phases

// The start of the NVFP4 and Q2_K kernels: the dynamic shared x tile XS,
// the reduction tile and the last-block flag of phase 2, the active count
// (clamped to the list's capacity) and its channels, this thread's warp and
// lane.
#define SB_PROLOGUE(XS)                                                                                    \
    PDL_ENTRY();                                                                                           \
    extern __shared__ float4 XS[];                                                                         \
    __shared__ float red[SB_WARPS][128];                                                                   \
    __shared__ int last_flag;                                                                              \
    const int n_act = max(min(*n_active, max_active), 0);                                                  \
    const int n_ch = n_act * SB_PAGE_CH;                                                                   \
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

__device__ __forceinline__ float sb_q8_dot4(sb_u32 w, float4 xv) {
    float f[4];
    sb_q8x4(w, f);
    return f[0] * xv.x + f[1] * xv.y + f[2] * xv.z + f[3] * xv.w;
}

// a[0 .. 16) += hv * the 16 Q8_0 quants in w (quant 4 i + n in byte n of
// word i): the down-row step of the 16-byte phase 2 and of the single pass.
__device__ __forceinline__ void sb_q8x16_axpy(uint4 w, float hv, float* a) {
    const sb_u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float f[4];
        sb_q8x4(words[i], f);
#pragma unroll
        for (int n = 0; n < 4; n++) a[4 * i + n] += hv * f[n];
    }
}

// Phase 2 for one item: the channel groups [g_begin, g_end) (groups of 8
// channels, the item's part) of output chunk `chunk`. Warp w's sums over
// its quads land in red[w][0 .. 128); the caller synchronizes before
// reading them. Every lane of every warp must call it (the reduce-scatter's
// shuffles).
__device__ __forceinline__ void sb_q8s_p2_quads(const sb_u8* __restrict__ pages, long page_bytes, int n_pages, int d,
                                                const sb_u32* __restrict__ active, float* hbuf, int chunk,
                                                int g_begin, int g_end, float (*red)[128], int warp, int lane) {
    const long mat = (long)SB_PAGE_CH * d;          // bytes of one quant matrix in a page
    const long smat = (long)SB_PAGE_CH * (d >> 5);  // f16 scales of one matrix
    const int sub = lane >> 3, piece = lane & 7;  // channel of the quad, 16-byte piece of the chunk
    const int e = (chunk << 7) + (piece << 4);
    const bool live = e < d;
    float a[16];
#pragma unroll
    for (int i = 0; i < 16; i++) a[i] = 0.f;
    // Quads of 4 consecutive channels (never across a page); the
    // loop is warp-uniform (the shuffles below need every lane).
    const int q_end = g_end << 1;
    for (int qi = (g_begin << 1) + warp; qi < q_end; qi += SB_WARPS * SB_P2_QUADS) {
        uint4 w[SB_P2_QUADS];
        sb_u16 sc[SB_P2_QUADS];
        float hq[SB_P2_QUADS];
        bool ok[SB_P2_QUADS];
#pragma unroll
        for (int u = 0; u < SB_P2_QUADS; u++) {
            const int quad = qi + u * SB_WARPS;
            const sb_u32 page = quad < q_end ? active[quad >> 5] : 0xffffffffu;
            ok[u] = live && page < (sb_u32)n_pages;
            const int c = (quad << 2) + sub, ch = c & 127;
            const sb_u8* base = pages + (long)(ok[u] ? page : 0u) * page_bytes;
            w[u] = ok[u] ? __ldg((const uint4*)(base + 2 * mat + (long)ch * d + e))
                         : make_uint4(0u, 0u, 0u, 0u);
            sc[u] = ok[u] ? __ldg((const sb_u16*)(base + 3 * mat) + 2 * smat + (long)ch * (d >> 5) + (e >> 5))
                          : (sb_u16)0;
            hq[u] = ok[u] ? __ldcg(hbuf + c) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < SB_P2_QUADS; u++) {
            if (!ok[u]) continue;
            sb_q8x16_axpy(w[u], hq[u] * sb_h2f(sc[u]), a);
        }
    }
    // Sum over the 4 channel lanes (lane bits 16, 8): lane (sub,
    // piece) ends with outputs 16 piece + 4 sub .. + 3.
    nv_reduce_scatter<8>(a, lane, 16);
    nv_reduce_scatter<4>(a, lane, 8);
#pragma unroll
    for (int i = 0; i < 4; i++) red[warp][16 * piece + 4 * sub + i] = a[i];
}

// Phase 1 stages x in shared memory (d floats, as float4s in the interleaved
// order the 16-byte loads read: float4 t at (t & 3) * (d / 16) + t / 4).
// With nw != null the RMSNorm that precedes the FFN is folded in (the sparse
// backend folds a recorded step's norm into the phase-1 launch, as the
// dense mat-vecs' norm_prologue does): x is then the norm's input, the block
// stages rms_norm_row(x, nw, neps) instead (norm.cu: the rms_norm kernel's
// arithmetic at the same 256 threads, so the same bits), and block 0 also
// writes it to nout, so that buffer holds what the norm would have.
__device__ __forceinline__ void sb_stage_x(float4* xs, const float* __restrict__ x, int d, const float* nw,
                                           float neps, float* nout) {
    const int nv = d >> 4;
    if (nw != 0) {
        __shared__ float s32[32];
        float* xf = (float*)xs;
        float* o = blockIdx.x == 0 ? nout : (float*)0;
        rms_norm_row(x, nw, neps, d, s32, [&](int i, float v) {
            const int t = i >> 2;
            xf[4 * ((t & 3) * nv + (t >> 2)) + (i & 3)] = v;
            if (o != 0) o[i] = v;
        });
    } else {
        const float4* x4 = (const float4*)x;
#pragma unroll 4
        for (int t = threadIdx.x; t < (d >> 2); t += SB_THREADS) xs[(t & 3) * nv + (t >> 2)] = x4[t];
    }
    __syncthreads();
}

// Channel ch's gate and up rows in split-Q8_0 pages: quants q[r] and f16
// scales s[r] (r = 0 gate, 1 up); for an id past n_pages, on is false and
// the pointers are page 0's (in range, never read: sb_q8s_round loads
// nothing when !on).
struct SbQ8sRows {
    const uint4* q[2];
    const sb_u16* s[2];
    bool on;
};
__device__ __forceinline__ SbQ8sRows sb_q8s_rows(const sb_u8* __restrict__ pages, long page_bytes, int n_pages, int d,
                                                 sb_u32 page, int ch) {
    const long mat = (long)SB_PAGE_CH * d;          // bytes of one quant matrix in a page
    const long smat = (long)SB_PAGE_CH * (d >> 5);  // f16 scales of one matrix
    const bool on = page < (sb_u32)n_pages;
    const sb_u8* base = pages + (long)(on ? page : 0u) * page_bytes;
    const sb_u16* sbase = (const sb_u16*)(base + 3 * mat);
    return {{(const uint4*)(base + (long)ch * d), (const uint4*)(base + mat + (long)ch * d)},
            {sbase + (long)ch * (d >> 5), sbase + smat + (long)ch * (d >> 5)},
            on};
}

// One round of a channel's gate and up dots: this lane's share over the
// 16-byte vectors [v0, v0 + 32 SB_P1_VECS) of the two rows (quants q[r], f16
// scales s[r]; nothing loaded when !on), all SB_P1_VECS x 2 loads issued
// before the first product, added to acc[r] (the caller reduces over the
// warp): the unit of phase 1.
__device__ __forceinline__ void sb_q8s_round(const uint4* const* q, const sb_u16* const* s, bool on, int nv,
                                             int v0, const float4* xs, int lane, float (&acc)[2]) {
    uint4 w[SB_P1_VECS][2];
    sb_u16 sc[SB_P1_VECS][2];
#pragma unroll
    for (int h = 0; h < SB_P1_VECS; h++) {
        const int v = v0 + 32 * h + lane;
        const bool ok = on && v < nv;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            w[h][r] = ok ? __ldg(q[r] + v) : make_uint4(0u, 0u, 0u, 0u);
            sc[h][r] = ok ? __ldg(s[r] + (v >> 1)) : (sb_u16)0;
        }
    }
#pragma unroll
    for (int h = 0; h < SB_P1_VECS; h++) {
        const int v = v0 + 32 * h + lane;
        if (v >= nv) continue;
        float4 xv[4];
#pragma unroll
        for (int j = 0; j < 4; j++) xv[j] = xs[j * nv + v];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const uint4 wv = w[h][r];
            const float t = (sb_q8_dot4(wv.x, xv[0]) + sb_q8_dot4(wv.y, xv[1])) +
                            (sb_q8_dot4(wv.z, xv[2]) + sb_q8_dot4(wv.w, xv[3]));
            acc[r] += sb_h2f(sc[h][r]) * t;
        }
    }
}

// Phase 1: hbuf[c] = silu(gate_c . x) * (up_c . x) for the active channels
// c < n_ch that this block owns (see the contract above), x staged in xs
// (the kernel's dynamic shared memory) with the RMSNorm folded in when
// nw != null. Its own function so that the host check
// (hostcheck/check_ffn_p1.cpp) runs the kernel's code.
__device__ __forceinline__ void sb_ffn_q8s_phase1(const sb_u8* __restrict__ pages, long page_bytes, int n_pages, int d,
                                                  const float* __restrict__ x, const sb_u32* __restrict__ active,
                                                  int n_ch, float* hbuf, float4* sb_xs, const float* nw, float neps,
                                                  float* nout) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // Block b owns the channels [C b / B, C (b + 1) / B); a channel is U
    // units, one sb_q8s_round each; per pass of at most SB_P1B_UNITS units
    // the block's warps take equal contiguous shares of the units and leave
    // each unit's (gate, up) dots in shared memory, then thread t adds
    // channel t's U units in unit order and applies the SwiGLU.
    __shared__ float2 unit_dots[SB_P1B_UNITS];
    const int nv = d >> 4, U = (nv + 32 * SB_P1_VECS - 1) / (32 * SB_P1_VECS);
    const int per_pass = max(SB_P1B_UNITS / U, 1);
    const int cb = (int)((long)n_ch * blockIdx.x / gridDim.x);
    const int ce = (int)((long)n_ch * (blockIdx.x + 1) / gridDim.x);
    // The first page id is read before x is staged (two round trips
    // overlapped: what a small FFN waits on).
    const sb_u32 page0 = cb < ce ? active[cb >> 7] : 0xffffffffu;
    sb_stage_x(sb_xs, x, d, nw, neps, nout);
    for (int p0 = cb; p0 < ce; p0 += per_pass) {
        const int nc = min(per_pass, ce - p0), units = nc * U;
        const int u_end = units * (warp + 1) / SB_WARPS;
        for (int un = units * warp / SB_WARPS; un < u_end; un++) {
            const int c = p0 + un / U, ch = c & 127;
            const sb_u32 page = (c >> 7) == (cb >> 7) ? page0 : active[c >> 7];
            const SbQ8sRows r = sb_q8s_rows(pages, page_bytes, n_pages, d, page, ch);
            float acc[2] = {0.f, 0.f};
            sb_q8s_round(r.q, r.s, r.on, nv, (un % U) * 32 * SB_P1_VECS, sb_xs, lane, acc);
            const float g = sb_warp_sum(acc[0]), u = sb_warp_sum(acc[1]);
            if (lane == 0) unit_dots[un] = make_float2(g, u);
        }
        __syncthreads();
        for (int t = threadIdx.x; t < nc; t += SB_THREADS) {
            float g = 0.f, u = 0.f;
            for (int k = 0; k < U; k++) {
                const float2 v = unit_dots[t * U + k];
                g += v.x;
                u += v.y;
            }
            hbuf[p0 + t] = g / (1.f + expf(-g)) * u;  // 0 for a page out of range (g = u = 0)
        }
        __syncthreads();  // before the next pass rewrites unit_dots
    }
}

// Phase 2: the items of this block (see the contract above) into the
// partials, the last block of each output chunk adding them into y. Its own
// function so that the host check (hostcheck/check_ffn_p2.cpp) runs the
// kernel's code.
__device__ __forceinline__ void sb_ffn_q8s_phase2(const sb_u8* __restrict__ pages, long page_bytes, int n_pages, int d,
                                                  const sb_u32* __restrict__ active, int n_ch, int part_ch,
                                                  int accumulate, float* hbuf, float* partials, sb_u32* counters,
                                                  float* y) {
    __shared__ float red[SB_WARPS][128];
    __shared__ int last_flag;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_chunks = (d + 127) >> 7;
    int K = max((int)gridDim.x / n_chunks, 1);
    if (part_ch > 0) K = min(K, max(n_ch / part_ch, 1));
    const int items = K * n_chunks;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int chunk = it % n_chunks, k = it / n_chunks;
        const int g_begin = (int)((long)(n_ch >> 3) * k / K), g_end = (int)((long)(n_ch >> 3) * (k + 1) / K);
        sb_q8s_p2_quads(pages, page_bytes, n_pages, d, active, hbuf, chunk, g_begin, g_end, red, warp, lane);
        __syncthreads();
        sb_finish_item<8>(red, &last_flag, chunk, k, K, d, accumulate, partials, counters, y);
    }
}

// MINB 3: at most 80 registers, 3 blocks of 256 threads per SM.
extern "C" __global__ void __launch_bounds__(SB_THREADS, 3)
    superblock_ffn_q8s(SB_Q8S_PARAMS, int part_ch, const float* nw, float neps, float* nout) {
    PDL_ENTRY();
    extern __shared__ float4 sb_xs[];
    const int n_ch = max(min(*n_active, max_active), 0) * SB_PAGE_CH;
    if (phases & 1) sb_ffn_q8s_phase1(pages, page_bytes, n_pages, d, x, active, n_ch, hbuf, sb_xs, nw, neps, nout);
    if (phases & 2)
        sb_ffn_q8s_phase2(pages, page_bytes, n_pages, d, active, n_ch, part_ch, accumulate, hbuf, partials, counters,
                          y);
}

// ---------------------------------------------------------------------------
// The fused FFN over NVFP4 pages (weight-only NVFP4: codes and scales decoded
// in registers, f32 FMA; Hopper has no FP4 math). Same contract as
// superblock_ffn_q8s (active list and count in device memory, phases 1 and
// 2, the same scratch and grid rules) over pages of this layout:
//   [gate packed 128 x d/2][up packed 128 x d/2][down_t packed 128 x d/2]
//   [gate scales 128 x d/16][up scales][down_t scales]
// Codes and scales as the CPU codec stores them (mirage_gguf::quant::nvfp4:
// E2M1 codes, element 2j in the low nibble of byte j; one unsigned E4M3
// scale per 16 elements), 216 d bytes per page (4.5 bits a weight). The f32
// tensor scale of each layer matrix (gate, up, down) is an argument.
// d % 32 == 0 keeps every packed row 16-byte aligned and every scale row
// 2-byte aligned, so a lane reads a 32-element group as one uint4 of codes
// and one u16 of its two block scales.
//
// Phase 1: one warp per channel (grid-stride); lane l takes 32-element groups
// l, l + 32, ... of the gate and up rows (a warp load is 512 contiguous
// bytes per row), U groups in flight. x sits in shared memory as 8 planes
// (float4 j of group m at plane j, index m) so the lanes' float4 reads of
// one plane are consecutive: conflict-free.
// Phase 2: an item's warp takes 8 channels at once: lane l = 4 s + q reads
// the 16-byte word of channel c0 + s's down_t row that covers outputs
// 32 q .. 32 q + 31 of the chunk (4 lanes cover the chunk's 64 bytes, their
// u16 scales its 8 scale bytes), and keeps 32 outputs in registers. At the
// item's end a reduce-scatter over the 8 channel lanes (shuffles over lane
// bits 16, 8, 4: 28 instead of 96) leaves lane (s, q) the sums of outputs
// 32 q + 4 s .. + 3, written to red[] for sb_finish_item.
// Grid, block, shared memory: as superblock_ffn_q8s (dynamic d * 4 bytes,
// phase 2 alone needs none).

#define NV_FFN_U1 4  // 32-element groups per lane in flight in phase 1
#define NV_FFN_U2 4  // 8-channel groups per warp in flight in phase 2

// Doubled-E2M1 dot of the 16 elements in words a, b (element 8i + n in
// nibble n of word i) with x (xv: their 4 float4).
__device__ __forceinline__ float nv_dot16(sb_u32 a, sb_u32 b, const float4* xv) {
    float f[4];
    sb_e2m1x4_doubled(a, f);
    float s = f[0] * xv[0].x + f[1] * xv[0].y + f[2] * xv[0].z + f[3] * xv[0].w;
    sb_e2m1x4_doubled(a >> 16, f);
    s += f[0] * xv[1].x + f[1] * xv[1].y + f[2] * xv[1].z + f[3] * xv[1].w;
    sb_e2m1x4_doubled(b, f);
    s += f[0] * xv[2].x + f[1] * xv[2].y + f[2] * xv[2].z + f[3] * xv[2].w;
    sb_e2m1x4_doubled(b >> 16, f);
    s += f[0] * xv[3].x + f[1] * xv[3].y + f[2] * xv[3].z + f[3] * xv[3].w;
    return s;
}

// acc[k] += (this lane's share of) dot(row k, x) / tensor_scale * 2 for NR
// NVFP4 rows of G 32-element groups: q[k] the row's codes (one uint4 per
// group), s[k] its block scales (one u16 per group); xs: x as 8 planes.
template <int NR, int U>
__device__ __forceinline__ void nv_dot_rows(const uint4* const* q, const sb_u16* const* s, const float4* xs, int G,
                                            int lane, float* acc) {
    for (int c = 0; c < G; c += 32 * U) {
        uint4 w[U][NR];
        sb_u32 sc[U][NR];
        bool ok[U];
#pragma unroll
        for (int h = 0; h < U; h++) {
            const int m = c + 32 * h + lane;
            ok[h] = m < G;
#pragma unroll
            for (int k = 0; k < NR; k++) {
                w[h][k] = ok[h] ? __ldg(q[k] + m) : make_uint4(0u, 0u, 0u, 0u);
                sc[h][k] = ok[h] ? (sb_u32)__ldg(s[k] + m) : 0u;
            }
        }
#pragma unroll
        for (int h = 0; h < U; h++) {
            if (!ok[h]) continue;
            const int m = c + 32 * h + lane;
            float4 xv[8];
#pragma unroll
            for (int j = 0; j < 8; j++) xv[j] = xs[j * G + m];
#pragma unroll
            for (int k = 0; k < NR; k++) {
                const float b0 = nv_dot16(w[h][k].x, w[h][k].y, xv);
                const float b1 = nv_dot16(w[h][k].z, w[h][k].w, xv + 4);
                acc[k] += b0 * sb_e4m3(sc[h][k]) + b1 * sb_e4m3(sc[h][k] >> 8);
            }
        }
    }
}

// At most 128 registers (2 blocks of 256 threads per SM): with the unroll
// factors above ptxas needs 127.
extern "C" __global__ void __launch_bounds__(SB_THREADS, 2)
    superblock_ffn_nvfp4(const sb_u8* __restrict__ pages, long page_bytes, int n_pages, int d, float ts_gate,
                         float ts_up, float ts_down, const float* __restrict__ x, const sb_u32* __restrict__ active,
                         const int* __restrict__ n_active, int max_active, int accumulate, float* hbuf,
                         float* partials, sb_u32* counters, float* y, int phases) {
    SB_PROLOGUE(nvsb_xs)
    const int G = d >> 5;                           // 32-element groups per row
    const long mat = (long)SB_PAGE_CH * (d >> 1);   // packed bytes of one matrix in a page
    const long smat = (long)SB_PAGE_CH * (d >> 4);  // scale bytes of one matrix

    // Phase 1.
    if (phases & 1) {
        const float4* x4 = (const float4*)x;
        for (int t = threadIdx.x; t < (d >> 2); t += blockDim.x) nvsb_xs[(t & 7) * G + (t >> 3)] = x4[t];
        __syncthreads();
        // The block sums are of doubled E2M1 values: fold the 1/2 in.
        const float hg = 0.5f * ts_gate, hu = 0.5f * ts_up;
        const int warps = gridDim.x * SB_WARPS;
        for (int c = blockIdx.x * SB_WARPS + warp; c < n_ch; c += warps) {
            const sb_u32 page = active[c >> 7];
            const int ch = c & 127;
            float hv = 0.f;
            if (page < (sb_u32)n_pages) {
                const sb_u8* base = pages + (long)page * page_bytes;
                const sb_u8* sbase = base + 3 * mat;
                const uint4* q[2] = {(const uint4*)(base + (long)ch * (d >> 1)),
                                     (const uint4*)(base + mat + (long)ch * (d >> 1))};
                const sb_u16* s[2] = {(const sb_u16*)(sbase + (long)ch * (d >> 4)),
                                      (const sb_u16*)(sbase + smat + (long)ch * (d >> 4))};
                float acc[2] = {0.f, 0.f};
                nv_dot_rows<2, NV_FFN_U1>(q, s, nvsb_xs, G, lane, acc);
                const float g = sb_warp_sum(acc[0]) * hg, u = sb_warp_sum(acc[1]) * hu;
                hv = g / (1.f + expf(-g)) * u;
            }
            if (lane == 0) hbuf[c] = hv;
        }
    }
    if (!(phases & 2)) return;

    // Phase 2.
    const int n_chunks = (d + 127) >> 7;
    const int K = max((int)gridDim.x / n_chunks, 1);
    const int items = K * n_chunks;
    const int sub = lane >> 2, quarter = lane & 3;  // channel of the 8, 32-output quarter of the chunk
    const float hd = 0.5f * ts_down;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int chunk = it % n_chunks, k = it / n_chunks;
        const int g_begin = (int)((long)(n_ch >> 3) * k / K), g_end = (int)((long)(n_ch >> 3) * (k + 1) / K);
        const int m = (chunk << 2) + quarter;  // this lane's 32-output group of the row
        const bool live = m < G;
        float a[32];
#pragma unroll
        for (int i = 0; i < 32; i++) a[i] = 0.f;
        for (int gi = g_begin + warp; gi < g_end && live; gi += SB_WARPS * NV_FFN_U2) {
            uint4 w[NV_FFN_U2];
            sb_u32 sc[NV_FFN_U2];
            float hv[NV_FFN_U2];
#pragma unroll
            for (int v = 0; v < NV_FFN_U2; v++) {
                // Group g: channels 8 g .. 8 g + 7, never across a page.
                const int g = gi + v * SB_WARPS;
                const sb_u32 page = g < g_end ? active[g >> 4] : 0xffffffffu;
                w[v] = make_uint4(0u, 0u, 0u, 0u);
                sc[v] = 0u;
                hv[v] = 0.f;
                if (page < (sb_u32)n_pages) {
                    const int c = (g << 3) + sub, ch = c & 127;
                    const sb_u8* base = pages + (long)page * page_bytes;
                    w[v] = __ldg((const uint4*)(base + 2 * mat + (long)ch * (d >> 1)) + m);
                    sc[v] = __ldg((const sb_u16*)(base + 3 * mat + 2 * smat + (long)ch * (d >> 4)) + m);
                    hv[v] = __ldcg(hbuf + c);
                }
            }
#pragma unroll
            for (int v = 0; v < NV_FFN_U2; v++) {
                const float s0 = hv[v] * sb_e4m3(sc[v]), s1 = hv[v] * sb_e4m3(sc[v] >> 8);
                const sb_u32 words[4] = {w[v].x, w[v].y, w[v].z, w[v].w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float sv = i < 2 ? s0 : s1;
                    float f[4];
                    sb_e2m1x4_doubled(words[i], f);
#pragma unroll
                    for (int n = 0; n < 4; n++) a[8 * i + n] += sv * f[n];
                    sb_e2m1x4_doubled(words[i] >> 16, f);
#pragma unroll
                    for (int n = 0; n < 4; n++) a[8 * i + 4 + n] += sv * f[n];
                }
            }
        }
        // Sum over the 8 channel lanes (lane bits 16, 8, 4): lane (sub,
        // quarter) ends with outputs 32 quarter + 4 sub .. + 3.
        nv_reduce_scatter<16>(a, lane, 16);
        nv_reduce_scatter<8>(a, lane, 8);
        nv_reduce_scatter<4>(a, lane, 4);
#pragma unroll
        for (int i = 0; i < 4; i++) red[warp][32 * quarter + 4 * sub + i] = a[i] * hd;
        __syncthreads();
        sb_finish_item(red, &last_flag, chunk, k, K, d, accumulate, partials, counters, y);
    }
}
