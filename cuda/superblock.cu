// MIRAGE sparse-path CUDA kernels, part 2: the fused superblock FFN over
// page-major Q8_0 pages (one cooperative launch, atomic or ordered
// reduction) and the mat-vec on the same split Q8_0 layout. Compiled after nvfp4.cu (uses its sb_* helpers).
//
// Split Q8_0 ("q8s"): a ggml Q8_0 matrix of R rows x d (d % 32 == 0) stored
// as its quants [R][d] int8, then its block scales [R][d/32] f16. Same bytes
// as ggml (34 per 32 weights); the quants are 4-byte aligned, so lane l of a
// warp reads the 32-bit word l of each 128-element chunk (one coalesced
// 128-byte line per warp load) and the float4 of x it needs is float4 l of
// the chunk: conflict-free in shared memory.
//
// A page (128 FFN channels) is one contiguous span:
//   [gate quants 128 x d][up quants 128 x d][down_t quants 128 x d]
//   [gate scales 128 x d/32][up scales][down_t scales]
// (variant v14 alone reads the down slice tiled instead: see its phase 2)
// down_t row i is column i of the page's slice of W_down (the artifact's
// transposed down slice, mirage_artifact::pack): in the down phase a warp
// reads, for one channel, the 128-byte line of its row that covers 128
// outputs, and each lane keeps its 4 outputs in registers over many
// channels; the alternative [d rows x 128] slice would give each output a
// 128-byte row instead, equally contiguous, but this way gate, up and down
// share one row format and the page is exactly the artifact's.

#define SB_WARPS 8
#define SB_THREADS (SB_WARPS * 32)
#define SB_PAGE_CH 128
// Units of the balanced phase 1 (P1B) per pass, a float2 each in shared
// memory (a unit is 32 P1V vectors of a row: U <= 512 for d <= 65536).
#define SB_P1B_UNITS 512

// acc[k] += dot(row k, x) over d for NR rows of a split-Q8_0 matrix, this
// lane's share (the caller reduces over the warp). xs: x in shared memory.
template <int NR, int U>
__device__ __forceinline__ void sb_dot_rows_q8s(const sb_u8* const* q, const sb_u16* const* s, const float4* xs,
                                                int d, int lane, float* acc) {
    const int n_chunks = (d + 127) >> 7;
    for (int c = 0; c < n_chunks; c += U) {
        sb_u32 w[U][NR];
        sb_u16 sc[U][NR];
        bool ok[U];
#pragma unroll
        for (int h = 0; h < U; h++) {
            int e = ((c + h) << 7) + (lane << 2);
            ok[h] = (c + h < n_chunks) && (e < d);
#pragma unroll
            for (int k = 0; k < NR; k++) {
                w[h][k] = ok[h] ? __ldg((const sb_u32*)(q[k] + e)) : 0u;
                sc[h][k] = ok[h] ? __ldg(s[k] + (e >> 5)) : (sb_u16)0;
            }
        }
#pragma unroll
        for (int h = 0; h < U; h++) {
            if (!ok[h]) continue;
            float4 xv = xs[((c + h) << 5) + lane];
#pragma unroll
            for (int k = 0; k < NR; k++) {
                float f[4];
                sb_q8x4(w[h][k], f);
                acc[k] += sb_h2f(sc[h][k]) * (f[0] * xv.x + f[1] * xv.y + f[2] * xv.z + f[3] * xv.w);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Mat-vec on a split-Q8_0 matrix: y[r] = sum_k W[r, k] x[k]. Four rows per
// warp (they share x reads), blocks loop over row groups.
// Grid: any; block SB_THREADS; dynamic shared memory cols * 4 bytes.
extern "C" __global__ void __launch_bounds__(SB_THREADS)
    matvec_q8s(const sb_u8* __restrict__ W, int rows, int cols, const float* __restrict__ x, float* __restrict__ y) {
    PDL_ENTRY();
    extern __shared__ float4 q8_xs[];
    const float4* x4 = (const float4*)x;
    for (int m = threadIdx.x; m < (cols >> 2); m += blockDim.x) q8_xs[m] = x4[m];
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const sb_u8* quants = W;
    const sb_u16* scales = (const sb_u16*)(W + (long)rows * cols);
    const int groups = (rows + 3) >> 2;
    for (int grp = blockIdx.x * SB_WARPS + warp; grp < groups; grp += gridDim.x * SB_WARPS) {
        int r0 = grp << 2;
        const sb_u8* q[4];
        const sb_u16* s[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int r = min(r0 + k, rows - 1);
            q[k] = quants + (long)r * cols;
            s[k] = scales + (long)r * (cols >> 5);
        }
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        sb_dot_rows_q8s<4, 2>(q, s, q8_xs, cols, lane, acc);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float v = sb_warp_sum(acc[k]);
            if (lane == 0 && r0 + k < rows) y[r0 + k] = v;
        }
    }
}

// ---------------------------------------------------------------------------
// One reduce-scatter step over lane bit `bit` (16, 8 or 4) on the first 2 n
// values of a: afterwards a[0 .. n) holds the sums over the lane pair of
// elements (lane & bit ? n : 0) + i of the previous a[0 .. 2 n). Used by the
// phase 2 of superblock_ffn_nvfp4 and of the 16-byte q8s variants.
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

// Grid-wide barrier of a cooperative launch (all blocks resident). bar[0]
// counts arrivals, bar[1] is the generation; both stay consistent across
// launches (the last arriver resets the count and bumps the generation).
__device__ __forceinline__ void sb_grid_barrier(sb_u32* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile sb_u32* gen = bar + 1;
        sb_u32 g = *gen;
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            bar[0] = 0;
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (*gen == g) __nanosleep(64);
        }
        __threadfence();
    }
    __syncthreads();
}

// y[chunk's 128 outputs] = the sum of the K partials partials[k][d] of
// output chunk `chunk` (+ y if accumulate), in a fixed order: warp w sums
// parts w, w + 8, ... in order (lane: outputs 4 lane .. 4 lane + 3), then
// thread j adds the 8 warp sums in warp order. red[] is overwritten (after
// a block barrier, so it may hold the caller's data on entry).
// FB: 0 or 1, one load per loop trip, each add waiting for its load (the
// first version); FB > 1: a warp issues the loads of FB of its parts at
// once, then adds them in the same order (the same bits, one L2 round trip
// per FB parts).
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
// warp order and finishes by mode (see superblock_ffn_q8s). Ends with a
// block barrier: red[] is rewritten by the next item.
// FB: how the last block reads the K partials (sb_sum_chunk_parts; 0 for
// the first version, superblock_ffn_nvfp4 and superblock_ffn_q8s).
template <int FB = 0>
__device__ __forceinline__ void sb_finish_item(float (*red)[128], int* last_flag, int chunk, int k, int K, int d,
                                               int mode, int accumulate, float* partials, sb_u32* counters,
                                               float* y) {
    const int j = threadIdx.x;  // output j of the chunk (threads 0..127)
    const bool own = j < 128 && (chunk << 7) + j < d;
    float p = 0.f;
    if (own) {
#pragma unroll
        for (int w2 = 0; w2 < SB_WARPS; w2++) p += red[w2][j];
    }
    if (mode == 0) {
        if (own) atomicAdd(y + (chunk << 7) + j, p);
    } else {
        if (own) partials[(long)k * d + (chunk << 7) + j] = p;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            sb_u32 t = atomicAdd(counters + 2 + chunk, 1u);
            *last_flag = (t == (sb_u32)K - 1);
            if (*last_flag) counters[2 + chunk] = 0;  // nobody else touches it in this launch
        }
        __syncthreads();
        if (*last_flag) {
            __threadfence();
            sb_sum_chunk_parts<FB>(red, partials, K, d, chunk, accumulate, y);
        }
    }
    __syncthreads();  // red[] is rewritten by the next item
}

// Fused sparse FFN over the active pages, ONE cooperative launch:
//   y (+)= sum over active pages p of W_down[:, p] (silu(W_gate[p] x) * (W_up[p] x))
//
// active[0 .. min(*n_active, max_active)) are page ids in device memory (a
// router kernel can write them; the host never reads them back). Ids >=
// n_pages contribute nothing. Let C = 128 * n_act be the active channels.
//
// Phase 1 (gate/up/SwiGLU): every warp of the grid takes channels gw, gw +
// warps, ...; per channel it streams the gate and up rows (sharing the x
// reads, x staged in shared memory) and writes h[channel] to hbuf (global,
// C floats, stays in L2).
// Grid barrier.
// Phase 2 (down): the output is cut into 128-wide chunks; block b takes
// (chunk, part) items, part k of K = gridDim / n_chunks covering about C / K
// channels (whole groups of 8). Its 8 warps take interleaved groups of 8
// channels and stream, per channel, the 128-byte line of its down_t row that
// covers the chunk (lane l: outputs 4l..4l+3, kept in registers).
// Warp sums are added in warp order in shared memory: one 128-float block
// partial per item. So each output element receives K partials, not one
// per block: few atomics, a small partial buffer.
// Finish (mode):
//   0 (atomic): atomicAdd of the block partial into y (y holds what to add
//     onto: zeros or the residual). The float order varies run to run.
//   1 (ordered): the partial goes to partials[k][d]; the last block to finish
//     a chunk (per-chunk arrival counter) sums its K partials in part order
//     and writes y = partial sum (+ y if accumulate). Bit-reproducible for a
//     given grid.
// Scratch: hbuf (max_active * 128 floats), partials (K * n_chunks * 128
// floats), counters (2 + n_chunks u32, zero at first use, self-resetting).
// Grid: at most the resident blocks (launched cooperatively); block
// SB_THREADS; dynamic shared memory d * 4 bytes; d % 32 == 0.
// phases: 3 = both phases with the grid barrier (cooperative launch); 1 or 2
// = that phase only, so the pair can run as two ordinary launches (the
// kernel boundary is the barrier) inside a captured CUDA graph, with the
// same grid for both (phase 2's split K depends on it). Phase 2 alone needs
// no dynamic shared memory.
// Variants (the first version reads at 52 % of the copy bandwidth at 100 %
// of the 7B pages and less below: phase 1 is latency-bound, its rounds of
// one channel per warp unbalanced; at d 896 the last block of a chunk adds
// 94 partials one dependent load at a time). One implementation,
// sb_ffn_q8s<P1V, P2, P2U, FB>, instantiated as superblock_ffn_q8s (the
// first version, the arguments above) and superblock_ffn_q8s_v<N> (the same
// arguments plus `int part_ch` last; the list is at the end of this
// section). Knobs:
//   P1V  phase 1. 0: as above (grid-stride channels, 4-byte loads, 4 of the
//        28 128-byte lines of a 3584-wide row in flight per warp). N > 0:
//        16-byte loads (a warp load is 512 contiguous bytes of a row), N of
//        them per lane and row in flight (N = 8: a whole 3584-byte gate row
//        and up row at once); x staged as 4 planes (float4 j of 16-element
//        vector v at xs[j * d/16 + v]) so the lanes' float4 reads are
//        conflict-free; warp w of W takes the contiguous channels
//        [C w / W, C (w + 1) / W) (equal shares, neighbouring rows), and
//        reads its first page id before staging x.
//   P2   phase 2. 0: as above (lane = 4 outputs, a warp load = one channel's
//        128-byte line), P2U 8-channel groups in flight per warp (P2U = 1:
//        the first version). 1: 16-byte loads, lane 8 s + q reads bytes
//        16 q .. 16 q + 15 of the chunk of channel s of a 4-channel quad (one
//        warp load = 4 channels' lines), 16 outputs in registers, P2U quads
//        in flight per warp; at the item's end a reduce-scatter over lane
//        bits 16 and 8 (12 shuffles) leaves lane (s, q) outputs
//        16 q + 4 s .. + 3. 2: output-stationary over a tiled down slice
//        (sb_ffn_q8s_phase2_tiled; P2U, FB and part_ch unused). 3: P2 1's
//        items with the ordered finish in a thread-block cluster
//        (superblock_ffn_q8s_c2, its own launch; FB and part_ch unused).
//   FB   sb_finish_item's batch (0: the first version's loop).
//   PFD  (P1V > 0 only) 1: phase 1 also asks L2 for each of its channels'
//        down_t row and scales (prefetch.global.L2, one line a lane) while
//        it streams the gate and up rows, so phase 2's loads hit L2 (the
//        40 % 7B page set's down_t rows are 27 MB, the H200's L2 50 MB).
//   P1B  (P1V > 0 only) 1: balanced phase 1. The equal shares of whole
//        channels per warp leave some warps one channel more than others
//        when few channels are active (7B at 40 %: 2.38 a warp, so 38 % of
//        the warps do 3 and set the phase's time); instead block b takes
//        the contiguous channels [C b / B, C (b + 1) / B) and its warps
//        share them in units of one sb_q8s_round (32 P1V vectors of a row:
//        two units per 3584-wide row at P1V 4), so the busiest warp does
//        2.5 channels' loads there, not 3. Unit dots meet in shared memory,
//        summed in unit order: other bits than P1B 0.
// part_ch > 0 caps the parts per output chunk: K = min(gridDim / n_chunks,
// max(C / part_ch, 1)), C the active channels read from the device count,
// so a part holds at least part_ch channels (fewer, fuller parts and fewer
// partials for the last block to add when few channels are active or d is
// small); part_ch <= 0: K = gridDim / n_chunks as above. The partial buffer
// stays (gridDim / n_chunks) * d floats. Ordered mode is bit-reproducible
// for a given variant, grid, part_ch and active list (phases 3, or 1 then
// 2, give the same bits); variants add in different orders, so their bits
// differ from each other (v0 with part_ch 0 is superblock_ffn_q8s).

#define SB_Q8S_PARAMS                                                                                      \
    const sb_u8 *__restrict__ pages, long page_bytes, int n_pages, int d, const float *__restrict__ x,    \
        const sb_u32 *__restrict__ active, const int *__restrict__ n_active, int max_active, int mode,     \
        int accumulate, float *hbuf, float *partials, sb_u32 *counters, float *y, int phases
#define SB_Q8S_ARGS \
    pages, page_bytes, n_pages, d, x, active, n_active, max_active, mode, accumulate, hbuf, partials, counters, y, phases

// dot(4 Q8_0 quants in w, xv), unscaled.
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

// Phase 2's 16-byte form (P2 1) for one item: the channel groups [g_begin,
// g_end) (groups of 8 channels, the item's part) of output chunk `chunk`.
// Warp w's sums over its quads land in red[w][0 .. 128); the caller
// synchronizes before reading them. warp / lane: the caller's (threadIdx.x
// >> 5 / & 31; passed in, so the inlined code is v10's as it was). Every lane of every warp must call it
// (the reduce-scatter's shuffles). The split-K phase 2 of sb_ffn_q8s and the
// cluster-finished one (superblock_ffn_q8s_c2) share it.
template <int P2U>
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
    for (int qi = (g_begin << 1) + warp; qi < q_end; qi += SB_WARPS * P2U) {
        uint4 w[P2U];
        sb_u16 sc[P2U];
        float hq[P2U];
        bool ok[P2U];
#pragma unroll
        for (int u = 0; u < P2U; u++) {
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
        for (int u = 0; u < P2U; u++) {
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

// Phase 1 stages x in shared memory (d floats, as float4s; P1V > 0 in the
// interleaved order the 16-byte loads read: float4 t at (t & 3) * (d / 16) +
// t / 4). With nw != null the RMSNorm that precedes the FFN is folded in
// (the sparse backend patches a recorded step's phase-1 launch, as
// dense.cu's norm_prologue for the mat-vecs): x is then the norm's input,
// the block stages rms_norm_row(x, nw, neps) instead (norm.cu: the rms_norm
// kernel's arithmetic at the same 256 threads, so the same bits), and block
// 0 also writes it to nout, so that buffer holds what the norm would have.
template <int P1V>
__device__ __forceinline__ void sb_stage_x(float4* xs, const float* __restrict__ x, int d, const float* nw,
                                           float neps, float* nout) {
    const int nv = d >> 4;
    if (nw != 0) {
        __shared__ float s32[32];
        float* xf = (float*)xs;
        float* o = blockIdx.x == 0 ? nout : (float*)0;
        rms_norm_row(x, nw, neps, d, s32, [&](int i, float v) {
            const int t = i >> 2;
            xf[4 * (P1V > 0 ? (t & 3) * nv + (t >> 2) : t) + (i & 3)] = v;
            if (o != 0) o[i] = v;
        });
    } else {
        const float4* x4 = (const float4*)x;
        if constexpr (P1V > 0) {
#pragma unroll 4
            for (int t = threadIdx.x; t < (d >> 2); t += SB_THREADS) xs[(t & 3) * nv + (t >> 2)] = x4[t];
        } else {
            for (int m = threadIdx.x; m < (d >> 2); m += blockDim.x) xs[m] = x4[m];
        }
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
// 16-byte vectors [v0, v0 + 32 P1V) of the two rows (quants q[r], f16 scales
// s[r]; nothing loaded when !on), all P1V x 2 loads issued before the first
// product, added to acc[r] (the caller reduces over the warp). The loop body
// of sb_q8s_channel and the unit of the balanced phase 1 (P1B).
template <int P1V>
__device__ __forceinline__ void sb_q8s_round(const uint4* const* q, const sb_u16* const* s, bool on, int nv,
                                             int v0, const float4* xs, int lane, float (&acc)[2]) {
    uint4 w[P1V][2];
    sb_u16 sc[P1V][2];
#pragma unroll
    for (int h = 0; h < P1V; h++) {
        const int v = v0 + 32 * h + lane;
        const bool ok = on && v < nv;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            w[h][r] = ok ? __ldg(q[r] + v) : make_uint4(0u, 0u, 0u, 0u);
            sc[h][r] = ok ? __ldg(s[r] + (v >> 1)) : (sb_u16)0;
        }
    }
#pragma unroll
    for (int h = 0; h < P1V; h++) {
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

// One channel's SwiGLU value silu(gate . x) * (up . x) over split-Q8_0
// page rows, computed by a whole warp (every lane returns it; 0 when `page`
// is out of range): the phase 1 of the 16-byte variants (P1V > 0: P1V
// 16-byte loads of each row in flight per lane; xs: x as 4 planes, see
// sb_stage_x) and of the single-pass kernel. PFD: also ask L2 for the
// channel's down_t row and scales (see PFD below).
template <int P1V, int PFD>
__device__ __forceinline__ float sb_q8s_channel(const sb_u8* __restrict__ pages, long page_bytes, int n_pages, int d,
                                                sb_u32 page, int ch, const float4* xs, int lane) {
    const int nv = d >> 4;  // 16-element (16-byte) vectors per row
    const SbQ8sRows r = sb_q8s_rows(pages, page_bytes, n_pages, d, page, ch);
    if constexpr (PFD) {
        // This channel's down_t row (d bytes) and its scales into
        // L2 now, so phase 2 reads them from L2 (see PFD above): the row
        // 2 matrices past its gate row, the scales 2 scale blocks past its
        // gate scales.
        if (r.on) {
            const sb_u8* drow = (const sb_u8*)r.q[0] + 2 * (long)SB_PAGE_CH * d;
            for (int o = lane << 7; o < d; o += 32 << 7) asm volatile("prefetch.global.L2 [%0];" ::"l"(drow + o));
            const sb_u8* dsc = (const sb_u8*)(r.s[0] + 2 * (long)SB_PAGE_CH * (d >> 5));
            if ((lane << 7) < (d >> 4) + 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(dsc + (lane << 7)));
        }
    }
    float acc[2] = {0.f, 0.f};
    for (int v0 = 0; v0 < nv; v0 += 32 * P1V) sb_q8s_round<P1V>(r.q, r.s, r.on, nv, v0, xs, lane, acc);
    const float g = sb_warp_sum(acc[0]), u = sb_warp_sum(acc[1]);
    return r.on ? g / (1.f + expf(-g)) * u : 0.f;
}

// Phase 1 of sb_ffn_q8s: hbuf[c] = silu(gate_c . x) * (up_c . x) for the
// active channels c < n_ch that this block owns under the P1V / P1B scheme
// (see the knobs above), x staged in xs (the kernel's dynamic shared
// memory) with the RMSNorm folded in when nw != null. Its own function so
// that the host check (hostcheck/check_ffn_p1.cpp) runs the kernel's code;
// cutting it out left the PTX of every variant as it was but for the order
// of two shared declarations in v10-v13 (sass_loads.py --diff: the SASS of
// v0-v10 unchanged).
template <int P1V, int PFD, int P1B>
__device__ __forceinline__ void sb_ffn_q8s_phase1(const sb_u8* __restrict__ pages, long page_bytes, int n_pages, int d,
                                                  const float* __restrict__ x, const sb_u32* __restrict__ active,
                                                  int n_ch, float* hbuf, float4* sb_xs, const float* nw, float neps,
                                                  float* nout) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long mat = (long)SB_PAGE_CH * d;          // bytes of one quant matrix in a page
    const long smat = (long)SB_PAGE_CH * (d >> 5);  // f16 scales of one matrix
    if constexpr (P1V == 0) {
    sb_stage_x<0>(sb_xs, x, d, nw, neps, nout);
    const int warps = gridDim.x * SB_WARPS;
    for (int c = blockIdx.x * SB_WARPS + warp; c < n_ch; c += warps) {
        const sb_u32 page = active[c >> 7];
        const int ch = c & 127;
        float hv = 0.f;
        if (page < (sb_u32)n_pages) {
            const sb_u8* base = pages + (long)page * page_bytes;
            const sb_u16* sbase = (const sb_u16*)(base + 3 * mat);
            const sb_u8* q[2] = {base + (long)ch * d, base + mat + (long)ch * d};
            const sb_u16* s[2] = {sbase + (long)ch * (d >> 5), sbase + smat + (long)ch * (d >> 5)};
            float acc[2] = {0.f, 0.f};
            sb_dot_rows_q8s<2, 4>(q, s, sb_xs, d, lane, acc);
            float g = sb_warp_sum(acc[0]), u = sb_warp_sum(acc[1]);
            hv = g / (1.f + expf(-g)) * u;
        }
        if (lane == 0) hbuf[c] = hv;
    }
    } else if constexpr (P1B) {
        // Balanced (see P1B above): block b owns the channels [C b / B,
        // C (b + 1) / B); a channel is U units, one sb_q8s_round each; per
        // pass of at most SB_P1B_UNITS units the block's warps take equal
        // contiguous shares of the units and leave each unit's (gate, up)
        // dots in shared memory, then thread t adds channel t's U units in
        // unit order and applies the SwiGLU.
        __shared__ float2 unit_dots[SB_P1B_UNITS];
        const int nv = d >> 4, U = (nv + 32 * P1V - 1) / (32 * P1V);
        const int per_pass = max(SB_P1B_UNITS / U, 1);
        const int cb = (int)((long)n_ch * blockIdx.x / gridDim.x);
        const int ce = (int)((long)n_ch * (blockIdx.x + 1) / gridDim.x);
        const sb_u32 page0 = cb < ce ? active[cb >> 7] : 0xffffffffu;
        sb_stage_x<P1V>(sb_xs, x, d, nw, neps, nout);
        for (int p0 = cb; p0 < ce; p0 += per_pass) {
            const int nc = min(per_pass, ce - p0), units = nc * U;
            const int u_end = units * (warp + 1) / SB_WARPS;
            for (int un = units * warp / SB_WARPS; un < u_end; un++) {
                const int c = p0 + un / U, ch = c & 127;
                const sb_u32 page = (c >> 7) == (cb >> 7) ? page0 : active[c >> 7];
                const SbQ8sRows r = sb_q8s_rows(pages, page_bytes, n_pages, d, page, ch);
                float acc[2] = {0.f, 0.f};
                sb_q8s_round<P1V>(r.q, r.s, r.on, nv, (un % U) * 32 * P1V, sb_xs, lane, acc);
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
    } else {
        const long warps = (long)gridDim.x * SB_WARPS, gw = (long)blockIdx.x * SB_WARPS + warp;
        const int c_begin = (int)(n_ch * gw / warps), c_end = (int)(n_ch * (gw + 1) / warps);
        // The first page id is read before x is staged (two round trips
        // overlapped: what a small FFN waits on).
        const sb_u32 page0 = c_begin < c_end ? active[c_begin >> 7] : 0xffffffffu;
        sb_stage_x<P1V>(sb_xs, x, d, nw, neps, nout);
        for (int c = c_begin; c < c_end; c++) {
            const sb_u32 page = (c >> 7) == (c_begin >> 7) ? page0 : active[c >> 7];
            const float hv = sb_q8s_channel<P1V, PFD>(pages, page_bytes, n_pages, d, page, c & 127, sb_xs, lane);
            if (lane == 0) hbuf[c] = hv;
        }
    }
}

// ---------------------------------------------------------------------------
// Phase 2 over a tiled down slice (P2 2: superblock_ffn_q8s_v14), output-
// stationary: no split of the channels, so no partials, no arrival counters
// and no last-block sums (the ordered finish's chain of L2 round trips).
// OPT-IN AND SLOWER: on the H200 this phase 2 takes 30.7 us at 7B 40 % where
// v10's takes 15.6 (kernel-bench; 72.0 vs 28.1 at 100 %), although over an
// empty list both launches take 5.9 us against v10's 7.1. Four forms were
// measured (crates/mirage-cuda/NOTES.md, fourteenth session) and none came
// near v10; why the copies stream at ~1-1.6 TB/s is not known. It stays as
// the tested starting point for the next attempt at copy-engine streaming.
// The page's down slice is stored for this kernel as [d][128] quants (row o:
// output o's weight of the page's 128 channels) and [d/32][128] f16 scales
// (row g: the scales of the 32-output group g, a channel each) -- the same
// quants and scales as the split layout's down_t rows, transposed on the
// host (superblock::tile_q8s_down) -- so R consecutive outputs of a group
// are one contiguous span of R x 128 bytes in every page.
// The outputs are cut into row blocks of R = 32, 16 or 8 (the largest that
// still gives SB_T2_MIN_BLOCKS of them; R divides 32, so a row block has one
// scale row); block b of the first W = min(gridDim, d / R) takes the row
// blocks [n b / W, n (b + 1) / W). Per row block thread 0 asks the copy
// engine (cp.async.bulk, completing on one transaction barrier per batch)
// for each batch of SB_T2_PAGES active pages: every page's R rows and scale
// row, and the batch's hbuf values in one copy; as many batches are in
// flight as the dynamic shared memory holds (SB_T2_MAX_BATCHES at most; the
// launch passes superblock::Q8S_T2_SMEM bytes), so the block computes one
// batch while the others stream in. It runs as its own launch,
// superblock_ffn_q8s_t2, of SB_T2_THREADS threads a block (the forms with
// 8 warps inside the variant kernel were no faster).
// The W warps of a block make G = max(W / R, 1) groups of W / G; group q
// takes pages q, q + G, .. of each batch, and in a group warp w takes rows
// w RW .. w RW + RW - 1 (RW = R G / W), lane l channels 4 l .. 4 l + 3: the
// lane adds its terms page by page in list order, the warp sums its lanes,
// then group 0 adds the G group sums in group order. Every output is
// finished in an order set by R and W alone, not by the grid: y = sum (+ y
// if accumulate); `mode` is ignored. With less dynamic shared memory than
// one batch the block writes NaN (a launch error, made visible). Needs sm_90
// for the copy engine; elsewhere thread 0 copies and the block synchronizes
// (correct, slow).
#define SB_T2_PAGES 4          // pages per batch (one transaction barrier, one copy of their hbuf values)
#define SB_T2_MAX_BATCHES 8    // batches in flight at most
#define SB_T2_MIN_BLOCKS 96    // least row blocks before R halves (so small d keeps the SMs busy)
#define SB_T2_THREADS 1024     // threads of a superblock_ffn_q8s_t2 block
#define SB_T2_IDS 1024         // active ids staged in shared memory (the rest are read from the list)
// Timing probes (MIRAGE_CUDA_T2_PROBE=copy|math, module::with_env_defines):
// 1 = the copies and waits only (no arithmetic: y = 0), 2 = the arithmetic
// only (no copies, no waits: it adds whatever the ring holds). Their outputs
// are wrong; they split the phase's time between the copy path and the
// consume loop (kernel-bench), nothing else.
#ifndef MIRAGE_T2_PROBE
#define MIRAGE_T2_PROBE 0
#endif
// Bytes of one batch buffer: per page 32 rows of quants, a scale row, 128 h.
#define SB_T2_BATCH_BYTES (SB_T2_PAGES * (32 * SB_PAGE_CH + 2 * SB_PAGE_CH + 4 * SB_PAGE_CH))

// The copy engine's barriers and bulk copies (sb_tx_*, sb_bulk_g2s) are in nvfp4.cu:
// dense.cu's attention block uses them too.
// Bytes of dynamic shared memory this block was launched with.
__device__ __forceinline__ sb_u32 sb_dynamic_smem() {
    sb_u32 v;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v;
}

// Phase 2 of superblock_ffn_q8s_v14 (see above): y[o] (+)= the down slice's
// row o . hbuf over the n_act active pages, for the outputs this block owns.
// ring: the dynamic shared memory, ring_bytes of it.
__device__ __forceinline__ void sb_ffn_q8s_phase2_tiled(const sb_u8* __restrict__ pages, long page_bytes, int n_pages,
                                                        int d, const sb_u32* __restrict__ active, int n_act,
                                                        int accumulate, const float* hbuf, float* y, sb_u8* ring,
                                                        sb_u32 ring_bytes) {
    __shared__ __align__(8) unsigned long long t2_bar[SB_T2_MAX_BATCHES];
    __shared__ float t2_group[4][32];  // group q's sum of row r (G <= 4)
    __shared__ sb_u32 t2_ids[SB_T2_IDS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
    const int R = (d >> 5) >= SB_T2_MIN_BLOCKS ? 32 : (d >> 4) >= SB_T2_MIN_BLOCKS ? 16 : 8;
    const int G = W > R ? W / R : 1, RW = R * G / W, grp = warp / (W / G), wr = warp % (W / G) * RW;
    const int n_rb = d / R, workers = min((int)gridDim.x, n_rb);
    if ((int)blockIdx.x >= workers) return;
    const int rb_begin = (int)((long)n_rb * blockIdx.x / workers), rb_end = (int)((long)n_rb * (blockIdx.x + 1) / workers);
    const int nb = min((int)(ring_bytes / SB_T2_BATCH_BYTES), SB_T2_MAX_BATCHES);
    if (nb == 0) {  // launched without its ring: make it visible
        for (int o = rb_begin * R + threadIdx.x; o < rb_end * R; o += blockDim.x) y[o] = __int_as_float(0x7fc00000);
        return;
    }
    const long mat = (long)SB_PAGE_CH * d;          // bytes of one quant matrix in a page
    const long smat = (long)SB_PAGE_CH * (d >> 5);  // f16 scales of one matrix
    const int n_batches = (n_act + SB_T2_PAGES - 1) / SB_T2_PAGES;
    // Batch buffer k: quants [SB_T2_PAGES][32 * 128], scale rows
    // [SB_T2_PAGES][128] f16, h [SB_T2_PAGES][128] f32.
    auto buf_q = [&](int k, int j) { return ring + (long)k * SB_T2_BATCH_BYTES + j * (32 * SB_PAGE_CH); };
    auto buf_s = [&](int k, int j) {
        return (sb_u16*)(ring + (long)k * SB_T2_BATCH_BYTES + SB_T2_PAGES * (32 * SB_PAGE_CH)) + j * SB_PAGE_CH;
    };
    auto buf_h = [&](int k) {
        return (float*)(ring + (long)k * SB_T2_BATCH_BYTES + SB_T2_PAGES * (34 * SB_PAGE_CH));
    };
    if (threadIdx.x == 0) {
        for (int k = 0; k < nb; k++) sb_tx_init(&t2_bar[k]);
        sb_tx_init_fence();
    }
    // The list once into shared memory: thread 0 issues a batch right after
    // each block barrier, and a list read there (an L2 round trip) would
    // hold the whole block at the next barrier.
    for (int i = threadIdx.x; i < min(n_act, SB_T2_IDS); i += blockDim.x) t2_ids[i] = active[i];
    __syncthreads();
    auto id_at = [&](int i) { return i < SB_T2_IDS ? t2_ids[i] : active[i]; };
    // Batch number `seq` (counted over the row blocks) fills buffer seq % nb
    // and completes phase seq / nb of that buffer's barrier.
    int seq0 = 0;
    for (int rb = rb_begin; rb < rb_end; rb++) {
        const int r0 = rb * R, g = r0 >> 5;
        const sb_u32 q_bytes = R * SB_PAGE_CH;
        // The ids of batch bt (past the list: out of range).
        auto batch_ids = [&](int bt, sb_u32 (&ids)[SB_T2_PAGES]) {
            const int i0 = bt * SB_T2_PAGES;
#pragma unroll
            for (int j = 0; j < SB_T2_PAGES; j++) ids[j] = i0 + j < n_act ? id_at(i0 + j) : 0xffffffffu;
        };
        auto issue = [&](int bt) {  // thread 0
            const int k = (seq0 + bt) % nb, i0 = bt * SB_T2_PAGES, n = min(SB_T2_PAGES, n_act - i0);
            unsigned long long* bar = &t2_bar[k];
            sb_u32 ids[SB_T2_PAGES];
            batch_ids(bt, ids);
            if (MIRAGE_T2_PROBE == 2) return;
            sb_u32 total = n * SB_PAGE_CH * 4;  // the batch's hbuf values, one copy
#pragma unroll
            for (int j = 0; j < SB_T2_PAGES; j++)
                if (ids[j] < (sb_u32)n_pages) total += q_bytes + SB_PAGE_CH * 2;
            sb_tx_expect(bar, total);
            sb_bulk_g2s(buf_h(k), hbuf + (long)i0 * SB_PAGE_CH, n * SB_PAGE_CH * 4, bar);
#pragma unroll
            for (int j = 0; j < SB_T2_PAGES; j++) {
                const sb_u32 page = ids[j];
                if (page >= (sb_u32)n_pages) continue;
                const sb_u8* base = pages + (long)page * page_bytes;
                sb_bulk_g2s(buf_q(k, j), base + 2 * mat + (long)r0 * SB_PAGE_CH, q_bytes, bar);
                sb_bulk_g2s(buf_s(k, j), base + 3 * mat + 4 * smat + (long)g * SB_PAGE_CH * 2, SB_PAGE_CH * 2, bar);
            }
        };
        if (threadIdx.x == 0)
            for (int bt = 0; bt < min(nb, n_batches); bt++) issue(bt);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};  // rows warp * RW + i of the row block
        for (int bt = 0; bt < n_batches; bt++) {
            const int seq = seq0 + bt, k = seq % nb;
            sb_u32 ids[SB_T2_PAGES];
            batch_ids(bt, ids);  // read while the batch streams in
            if (MIRAGE_T2_PROBE != 2) sb_tx_wait(&t2_bar[k], (sb_u32)(seq / nb) & 1u);
#pragma unroll
            for (int j = 0; j < SB_T2_PAGES; j++) {
                if (MIRAGE_T2_PROBE == 1) break;
                if (j % G != grp) continue;                // another group's page
                if (ids[j] >= (sb_u32)n_pages) continue;  // past the list or out of range: nothing was copied
                const float4 h = ((const float4*)buf_h(k))[j * 32 + lane];
                const sb_u16* s = buf_s(k, j) + 4 * lane;
                const float hs[4] = {h.x * sb_h2f(s[0]), h.y * sb_h2f(s[1]), h.z * sb_h2f(s[2]), h.w * sb_h2f(s[3])};
                const sb_u32* q = (const sb_u32*)buf_q(k, j) + wr * 32 + lane;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    if (i >= RW) break;
                    float f[4];
                    sb_q8x4(q[i * 32], f);
                    acc[i] += f[0] * hs[0] + f[1] * hs[1] + f[2] * hs[2] + f[3] * hs[3];
                }
            }
            __syncthreads();  // every warp is done with this buffer
            if (threadIdx.x == 0 && bt + nb < n_batches) issue(bt + nb);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (i >= RW) break;
            const float t = sb_warp_sum(acc[i]);
            if (lane == 0) t2_group[grp][wr + i] = t;
        }
        __syncthreads();
        if (threadIdx.x < R) {
            float t = t2_group[0][threadIdx.x];
            for (int q = 1; q < G; q++) t += t2_group[q][threadIdx.x];
            float* o = y + r0 + threadIdx.x;
            *o = accumulate ? *o + t : t;
        }
        __syncthreads();  // before the next row block rewrites t2_group
        seq0 += n_batches;
    }
}

template <int P1V, int P2, int P2U, int FB, int PFD = 0, int P1B = 0>
__device__ __forceinline__ void sb_ffn_q8s(SB_Q8S_PARAMS, int part_ch, const float* nw, float neps, float* nout) {
    extern __shared__ float4 sb_xs[];
    __shared__ float red[SB_WARPS][128];
    __shared__ int last_flag;
    const int n_act = max(min(*n_active, max_active), 0);
    const int n_ch = n_act * SB_PAGE_CH;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long mat = (long)SB_PAGE_CH * d;          // bytes of one quant matrix in a page
    const long smat = (long)SB_PAGE_CH * (d >> 5);  // f16 scales of one matrix

    // Phase 1.
    if (phases & 1) sb_ffn_q8s_phase1<P1V, PFD, P1B>(pages, page_bytes, n_pages, d, x, active, n_ch, hbuf, sb_xs, nw, neps, nout);
    if (phases == 3) sb_grid_barrier(counters);
    if (!(phases & 2)) return;

    // Phase 2.
    if constexpr (P2 >= 2) {
        // In its own launch (superblock_ffn_q8s_t2 / _c2); here (the
        // cooperative form, which the hosts refuse) the output is made NaN,
        // visibly.
        for (int o = blockIdx.x * blockDim.x + threadIdx.x; o < d; o += gridDim.x * blockDim.x)
            y[o] = __int_as_float(0x7fc00000);
    } else {
    const int n_chunks = (d + 127) >> 7;
    int K = max((int)gridDim.x / n_chunks, 1);
    if (part_ch > 0) K = min(K, max(n_ch / part_ch, 1));
    const int items = K * n_chunks;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int chunk = it % n_chunks, k = it / n_chunks;
        const int g_begin = (int)((long)(n_ch >> 3) * k / K), g_end = (int)((long)(n_ch >> 3) * (k + 1) / K);
        if constexpr (P2 == 0) {
        const int e = (chunk << 7) + (lane << 2);
        const bool live = e < d;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        // Groups of 8 consecutive channels (never across a page): one page
        // lookup per 8 rows, rows at stride d.
        for (int gi = g_begin + warp; gi < g_end && live; gi += SB_WARPS * P2U) {
            sb_u32 w[P2U][8];
            sb_u16 sc[P2U][8];
            float hh[P2U][8];
            bool ok[P2U];
#pragma unroll
            for (int u = 0; u < P2U; u++) {
                const int g = gi + u * SB_WARPS;
                const int c0 = g << 3;
                const sb_u32 page = g < g_end ? active[c0 >> 7] : 0xffffffffu;
                ok[u] = page < (sb_u32)n_pages;
                if (!ok[u]) continue;
                const int ch = c0 & 127;
                const sb_u8* base = pages + (long)page * page_bytes;
                const sb_u8* row = base + 2 * mat + (long)ch * d + e;
                const sb_u16* srow = (const sb_u16*)(base + 3 * mat) + 2 * smat + (long)ch * (d >> 5) + (e >> 5);
#pragma unroll
                for (int r = 0; r < 8; r++) {
                    w[u][r] = __ldg((const sb_u32*)(row + (long)r * d));
                    sc[u][r] = __ldg(srow + (long)r * (d >> 5));
                }
                const float4 h0 = __ldcg((const float4*)(hbuf + c0));
                const float4 h1 = __ldcg((const float4*)(hbuf + c0 + 4));
                hh[u][0] = h0.x; hh[u][1] = h0.y; hh[u][2] = h0.z; hh[u][3] = h0.w;
                hh[u][4] = h1.x; hh[u][5] = h1.y; hh[u][6] = h1.z; hh[u][7] = h1.w;
            }
#pragma unroll
            for (int u = 0; u < P2U; u++) {
                if (!ok[u]) continue;
#pragma unroll
                for (int r = 0; r < 8; r++) {
                    float f[4];
                    sb_q8x4(w[u][r], f);
                    float hv = hh[u][r] * sb_h2f(sc[u][r]);
                    a0 += hv * f[0];
                    a1 += hv * f[1];
                    a2 += hv * f[2];
                    a3 += hv * f[3];
                }
            }
        }
        red[warp][4 * lane] = a0;
        red[warp][4 * lane + 1] = a1;
        red[warp][4 * lane + 2] = a2;
        red[warp][4 * lane + 3] = a3;
        } else {
            sb_q8s_p2_quads<P2U>(pages, page_bytes, n_pages, d, active, hbuf, chunk, g_begin, g_end, red, warp, lane);
        }
        __syncthreads();
        sb_finish_item<FB>(red, &last_flag, chunk, k, K, d, mode, accumulate, partials, counters, y);
    }
    }
}

// The first version (the argument list the sparse backend launches today).
extern "C" __global__ void __launch_bounds__(SB_THREADS) superblock_ffn_q8s(SB_Q8S_PARAMS) {
    PDL_ENTRY();
    sb_ffn_q8s<0, 0, 1, 0>(SB_Q8S_ARGS, 0, (const float*)0, 0.f, (float*)0);
}

// superblock_ffn_q8s_v<N>(SB_Q8S_PARAMS, int part_ch, nw, neps, nout): the
// last three fold the FFN's RMSNorm into phase 1 (sb_stage_x; nw = null:
// x is the FFN's input as it is). MINB: blocks per SM
// that __launch_bounds__ asks ptxas to fit (a register cap); the grid is the
// resident block count of that function, so every variant runs at its own
// occupancy. The host table (Q8_FFN_VARIANTS in
// crates/mirage-cuda/src/superblock.rs) describes each; keep them in step.
#define SB_Q8S_VARIANT_B(N, MINB, P1V, P2, P2U, FB, PFD, P1B)                                    \
    extern "C" __global__ void __launch_bounds__(SB_THREADS, MINB) superblock_ffn_q8s_v##N(        \
        SB_Q8S_PARAMS, int part_ch, const float* nw, float neps, float* nout) {                   \
        PDL_ENTRY();                                                                              \
        sb_ffn_q8s<P1V, P2, P2U, FB, PFD, P1B>(SB_Q8S_ARGS, part_ch, nw, neps, nout);             \
    }
#define SB_Q8S_VARIANT(N, MINB, P1V, P2, P2U, FB, PFD) SB_Q8S_VARIANT_B(N, MINB, P1V, P2, P2U, FB, PFD, 0)

// Tried on the H200 and dropped (slower; crates/mirage-cuda/NOTES.md): the
// active ids staged in shared memory, phase-2 items of 512 outputs (a warp
// load = 512 contiguous bytes of one down_t row, four finishes per item),
// L2 prefetches of the next channel / trip.
// MINB 5: at most 51 registers, 5 blocks of 256 threads per SM (the first
// version's 48 registers, its occupancy); 4: 64; 3: 80 (85); 2: 128.
// v0: the first version (plus part_ch).
SB_Q8S_VARIANT(0, 5, 0, 0, 1, 0, 0)
// v1: the first version's phases, batched finish (8 partial loads in flight
// per warp).
SB_Q8S_VARIANT(1, 5, 0, 0, 1, 8, 0)
// v2: phase 1 a whole 3584-wide gate and up row in flight per warp (8 x 16
// bytes a lane and row), phase 2 16-byte loads, 8 quads (32 channels) in
// flight per warp; 2 blocks per SM.
SB_Q8S_VARIANT(2, 2, 8, 1, 8, 8, 0)
// v3: half of that per warp (4 x 16 bytes a lane and row: a 3584 row in two
// steps; 4 quads), 3 blocks per SM.
SB_Q8S_VARIANT(3, 3, 4, 1, 4, 8, 0)
// v4: 2 x 16 bytes a lane and row (one step for an 896 row), 4 quads, 4
// blocks per SM.
SB_Q8S_VARIANT(4, 4, 2, 1, 4, 8, 0)
// v5: the first version's occupancy (5 blocks per SM) with 16-byte loads:
// 1 x 16 bytes a lane and row, 2 quads.
SB_Q8S_VARIANT(5, 5, 1, 1, 2, 8, 0)
// v6: v3 with phase 1 prefetching the down_t rows into L2 (PFD).
SB_Q8S_VARIANT(6, 3, 4, 1, 4, 8, 1)
// v7: v4 (4 blocks per SM) with the same prefetch.
SB_Q8S_VARIANT(7, 4, 2, 1, 4, 8, 1)
// v10: v3 with the balanced phase 1 (P1B); v11: v4 with it (4 units per
// 3584-wide row). (v8 and v9, the single pass, are below.)
SB_Q8S_VARIANT_B(10, 3, 4, 1, 4, 8, 0, 1)
SB_Q8S_VARIANT_B(11, 4, 2, 1, 4, 8, 0, 1)
// v12 / v13: v10 with 5 / 6 quads in flight per warp in phase 2 (at 7B
// 40 % a warp's part is 17 quads: 5 rounds of 4, 4 of 5, 3 of 6).
SB_Q8S_VARIANT_B(12, 3, 4, 1, 5, 8, 0, 1)
SB_Q8S_VARIANT_B(13, 3, 4, 1, 6, 8, 0, 1)
// v14: v10's phase 1; phase 2 (P2 2) is superblock_ffn_q8s_t2 below, over
// the tiled down slice (pages uploaded with superblock::tile_q8s_down).
SB_Q8S_VARIANT_B(14, 3, 4, 2, 4, 8, 0, 1)
// v15: v10's phase 1; phase 2 (P2 3) is superblock_ffn_q8s_c2 below: v10's
// items, the ordered finish inside a thread-block cluster.
SB_Q8S_VARIANT_B(15, 3, 4, 3, 4, 8, 0, 1)

// Phase 2 of v14: the arguments of the variants, SB_T2_THREADS threads a
// block, superblock::Q8S_T2_SMEM bytes of dynamic shared memory (the copy
// ring), a grid of superblock::q8s_t2_grid(d) blocks (one row block each;
// any grid gives the same bits).
extern "C" __global__ void __launch_bounds__(SB_T2_THREADS, 1) superblock_ffn_q8s_t2(
    SB_Q8S_PARAMS, int part_ch, const float* nw, float neps, float* nout) {
    PDL_ENTRY();
    extern __shared__ float4 sb_xs[];
    const int n_act = max(min(*n_active, max_active), 0);
    sb_ffn_q8s_phase2_tiled(pages, page_bytes, n_pages, d, active, n_act, accumulate, hbuf, y, (sb_u8*)sb_xs,
                            sb_dynamic_smem());
}

// Thread-block clusters (sm_90; elsewhere a cluster is one block): this
// block's rank in its cluster, the cluster's size, the cluster's index and
// the number of clusters, along x. A launch without cluster dimensions runs
// clusters of one block (rank 0, size 1, index blockIdx.x).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SB_CLUSTER_SREG(NAME, REG, ELSEWHERE)                  \
    __device__ __forceinline__ unsigned NAME() {               \
        unsigned r;                                            \
        asm("mov.u32 %0, %%" REG ";" : "=r"(r));               \
        return r;                                              \
    }
#else
#define SB_CLUSTER_SREG(NAME, REG, ELSEWHERE) \
    __device__ __forceinline__ unsigned NAME() { return ELSEWHERE; }
#endif
SB_CLUSTER_SREG(sb_cluster_rank, "cluster_ctarank", 0u)
SB_CLUSTER_SREG(sb_cluster_size, "cluster_nctarank", 1u)
SB_CLUSTER_SREG(sb_cluster_id, "clusterid.x", blockIdx.x)
SB_CLUSTER_SREG(sb_cluster_count, "nclusterid.x", gridDim.x)
// Every thread of every block of the cluster: a barrier whose release /
// acquire makes each block's shared-memory writes before it visible to the
// other blocks' reads after it (and a block barrier).
__device__ __forceinline__ void sb_cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}
// The float at p (this block's shared memory) in the shared memory of the
// cluster's block `rank` (distributed shared memory).
__device__ __forceinline__ float sb_dsmem_load(const float* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    sb_u32 a;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"((sb_u32)__cvta_generic_to_shared(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
#else
    (void)rank;
    return *p;
#endif
}

// Most blocks in a cluster the c2 finish reads (the H200's non-portable
// limit; superblock::Q8S_C2_MAX_CLUSTER).
#define SB_C2_MAX_CLUSTER 16

// Phase 2 of v15 (superblock_ffn_q8s_c2): v10's split-K phase 2 (its items
// are sb_q8s_p2_quads with P2U quads a warp in flight) whose ordered finish
// runs inside a thread-block cluster instead of through global memory. The
// K parts of an output chunk are the K blocks of one cluster (K = the
// cluster size the host launches with, at most SB_C2_MAX_CLUSTER); cluster c
// takes chunks c, c + clusters, ...; block k of the cluster covers the
// channel groups [G k / K, G (k + 1) / K) (G = active channels / 8). Each
// block sums its warps in warp order into cpart (its own shared memory);
// after a cluster barrier block k adds outputs [128 k / K, 128 (k + 1) / K)
// of the chunk over the K blocks' cpart in part order (distributed shared
// memory) and writes y = sum (+ y if accumulate); a second cluster barrier
// keeps every cpart alive until all have read it. So no partial buffer, no
// arrival counters, no last-block sums: the v10 finish's chain of L2 round
// trips (partial store, fence, atomic, K partial loads) becomes two cluster
// barriers and K shared-memory loads. Bits: a function of K alone (not of the
// number of clusters). mode 0 (atomic) atomically adds each block's partial
// into y instead (no cluster barrier). Every thread must call it.
template <int P2U>
__device__ __forceinline__ void sb_ffn_q8s_phase2_cluster(const sb_u8* __restrict__ pages, long page_bytes, int n_pages,
                                                          int d, const sb_u32* __restrict__ active, int n_ch, int mode,
                                                          int accumulate, float* hbuf, float* y,
                                                          float (*red)[128], float* cpart) {
    const unsigned K = sb_cluster_size(), k = sb_cluster_rank();
    const int n_chunks = (d + 127) >> 7;
    const int j = threadIdx.x, warp = j >> 5, lane = j & 31;
    const int lo = (int)(128u * k / K), hi = (int)(128u * (k + 1) / K);  // this block's outputs of the finish
    const int g_begin = (int)((long)(n_ch >> 3) * k / K), g_end = (int)((long)(n_ch >> 3) * (k + 1) / K);
    for (int chunk = (int)sb_cluster_id(); chunk < n_chunks; chunk += (int)sb_cluster_count()) {
        sb_q8s_p2_quads<P2U>(pages, page_bytes, n_pages, d, active, hbuf, chunk, g_begin, g_end, red, warp, lane);
        __syncthreads();
        float p = 0.f;
        if (j < 128) {
#pragma unroll
            for (int w = 0; w < SB_WARPS; w++) p += red[w][j];
        }
        if (mode == 0) {
            if (j < 128 && (chunk << 7) + j < d) atomicAdd(y + (chunk << 7) + j, p);
            __syncthreads();  // red[] is rewritten by the next chunk
            continue;
        }
        if (j < 128) cpart[j] = p;
        sb_cluster_sync();  // every part's partial is in its block (and red[] is free again)
        if (j < hi - lo && (chunk << 7) + lo + j < d) {
            float v[SB_C2_MAX_CLUSTER];
#pragma unroll
            for (int kk = 0; kk < SB_C2_MAX_CLUSTER; kk++) v[kk] = kk < (int)K ? sb_dsmem_load(cpart + lo + j, kk) : 0.f;
            float t = 0.f;
#pragma unroll
            for (int kk = 0; kk < SB_C2_MAX_CLUSTER; kk++)
                if (kk < (int)K) t += v[kk];
            float* o = y + (chunk << 7) + lo + j;
            *o = accumulate ? *o + t : t;
        }
        sb_cluster_sync();  // nobody reads cpart any more: the next chunk rewrites it, the blocks may exit
    }
}

// Phase 2 of v15: the variants' arguments (x, partials, counters, phases,
// part_ch and the folded norm unused), SB_THREADS threads a block, launched
// with cluster dimensions (K, 1, 1) by the host (superblock::q8s_c2_shape),
// grid = clusters x K. Without a cluster launch it is correct with K = 1.
extern "C" __global__ void __launch_bounds__(SB_THREADS, 3) superblock_ffn_q8s_c2(
    SB_Q8S_PARAMS, int part_ch, const float* nw, float neps, float* nout) {
    PDL_ENTRY();
    __shared__ float red[SB_WARPS][128];
    __shared__ float cpart[128];
    (void)x; (void)partials; (void)counters; (void)phases; (void)part_ch; (void)nw; (void)neps; (void)nout;
    if (mode != 0 && sb_cluster_size() > SB_C2_MAX_CLUSTER) {
        // The finish reads at most SB_C2_MAX_CLUSTER parts: made visible.
        for (int o = blockIdx.x * blockDim.x + threadIdx.x; o < d; o += gridDim.x * blockDim.x)
            y[o] = __int_as_float(0x7fc00000);
        return;
    }
    const int n_act = max(min(*n_active, max_active), 0);
    sb_ffn_q8s_phase2_cluster<4>(pages, page_bytes, n_pages, d, active, n_act * SB_PAGE_CH, mode, accumulate, hbuf,
                                 y, red, cpart);
}

// ---------------------------------------------------------------------------
// The single-pass fused FFN (`superblock_ffn_q8s_v8`, same arguments as the
// variants; part_ch is ignored): no grid barrier and no second launch in the
// atomic mode. Block b owns the contiguous active channels [C b / B,
// C (b + 1) / B) (B = gridDim). In rounds of SB_LOCAL_CH channels its warps
// compute h (sb_q8s_channel, channel i of the round on warp i % 8) into
// shared memory, then the block multiplies them by their down_t rows: thread
// (g, p) (p < d / 16 a 16-output piece, g < G = 256 / (d / 16) a share of
// the round's channels) keeps 16 outputs in registers over every round; at
// the end the G shares are added in g order. So each block holds ONE d-wide
// partial of the FFN output, and:
//   mode 0 (atomic): adds it into y with atomics, right away: one launch,
//     no barrier, the float order varies. With accumulate, y holds what to
//     add onto (the residual); without, block 0 zeroes y first and the
//     others wait for a flag before their atomics (one word of counters);
//   mode 1 (ordered): writes it to partials[b][d]; after the grid barrier
//     (phases 3) or in the phase-2 launch, block k sums output chunk k
//     (128 outputs) over the B partials in block order (warp w: blocks w,
//     w + 8, ...; then the 8 warp sums in warp order) and writes y = sum
//     (+ y if accumulate). Bit-reproducible for a given grid.
// In the atomic mode the phase-2 launch does nothing, so the two launch
// modes give the same bits in both reductions. Needs d <= 4096 (one piece a
// thread); the partial buffer holds gridDim * d floats (ffn_partials_len).
#define SB_LOCAL_CH 64
#define SB_LOCAL_MAX_D 4096
#define SB_LOCAL_ZEROED 0x80000000u

// y[0..4) += v with atomics (one 16-byte vector reduction on sm_90, y
// 16-byte aligned).
__device__ __forceinline__ void sb_red_add4(float* y, float4 v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(y), "f"(v.x), "f"(v.y), "f"(v.z),
                 "f"(v.w)
                 : "memory");
#else
    atomicAdd(y, v.x);
    atomicAdd(y + 1, v.y);
    atomicAdd(y + 2, v.z);
    atomicAdd(y + 3, v.w);
#endif
}

template <int P1V>
__device__ __forceinline__ void sb_ffn_q8s_local(SB_Q8S_PARAMS, const float* nw, float neps, float* nout) {
    extern __shared__ float4 sb_xs[];
    __shared__ float hs[SB_LOCAL_CH];
    __shared__ __align__(16) float comb[SB_LOCAL_MAX_D];
    __shared__ float red[SB_WARPS][128];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_pieces = d >> 4;
    const int G = max(SB_THREADS / max(n_pieces, 1), 1);
    if (phases & 1) {
        const int n_ch = max(min(*n_active, max_active), 0) * SB_PAGE_CH;
        const long mat = (long)SB_PAGE_CH * d, smat = (long)SB_PAGE_CH * (d >> 5);
        const int cb = (int)((long)n_ch * blockIdx.x / gridDim.x);
        const int ce = (int)((long)n_ch * (blockIdx.x + 1) / gridDim.x);
        const int g = threadIdx.x / max(n_pieces, 1), p = threadIdx.x - g * n_pieces;
        const bool down = g < G && n_pieces > 0 && p < n_pieces;
        float a[16];
#pragma unroll
        for (int i = 0; i < 16; i++) a[i] = 0.f;
        // Mode 0 without accumulate: y = FFN(x). Block 0 zeroes y first and
        // raises the flag bit of counters[2]; every block waits for it
        // before its atomics (all blocks are resident: the grid is the
        // resident block count) and then counts itself out in the low bits;
        // the last one clears the word for the next launch.
        const bool zero_y = mode == 0 && !accumulate;
        if (zero_y && blockIdx.x == 0) {
            for (int j4 = threadIdx.x; j4 < (d >> 2); j4 += SB_THREADS)
                *(float4*)(y + 4 * j4) = make_float4(0.f, 0.f, 0.f, 0.f);
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) atomicOr(counters + 2, SB_LOCAL_ZEROED);
        }
        sb_stage_x<P1V>(sb_xs, x, d, nw, neps, nout);
        for (int c0 = cb; c0 < ce; c0 += SB_LOCAL_CH) {
            const int n = min(SB_LOCAL_CH, ce - c0);
            for (int i = warp; i < n; i += SB_WARPS) {
                const int c = c0 + i;
                const float hv = sb_q8s_channel<P1V, 0>(pages, page_bytes, n_pages, d, active[c >> 7], c & 127, sb_xs, lane);
                if (lane == 0) hs[i] = hv;
            }
            __syncthreads();
            if (down) {
                // Channels g, g + G, ... of the round, 4 rows in flight.
                for (int i0 = g; i0 < n; i0 += 4 * G) {
                    uint4 w[4];
                    float hv[4];
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        const int i = i0 + u * G;
                        const int c = c0 + i;
                        const sb_u32 page = i < n ? active[c >> 7] : 0xffffffffu;
                        const bool on = page < (sb_u32)n_pages;
                        const sb_u8* base = pages + (long)(on ? page : 0u) * page_bytes;
                        const int ch = c & 127;
                        w[u] = on ? __ldg((const uint4*)(base + 2 * mat + (long)ch * d) + p) : make_uint4(0u, 0u, 0u, 0u);
                        const sb_u16 sc = on ? __ldg((const sb_u16*)(base + 3 * mat) + 2 * smat + (long)ch * (d >> 5) + (p >> 1))
                                             : (sb_u16)0;
                        hv[u] = on ? hs[i] * sb_h2f(sc) : 0.f;
                    }
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        if (i0 + u * G < n) sb_q8x16_axpy(w[u], hv[u], a);
                    }
                }
            }
            __syncthreads();  // hs[] is rewritten by the next round
        }
        // The G shares of each output, in g order.
        if (down) {
#pragma unroll
            for (int i = 0; i < 16; i++) comb[g * d + 16 * p + i] = a[i];
        }
        __syncthreads();
        if (zero_y) {
            if (threadIdx.x == 0) {
                while (!(atomicAdd(counters + 2, 0u) & SB_LOCAL_ZEROED)) __nanosleep(32);
                __threadfence();
            }
            __syncthreads();
        }
        if (cb < ce || mode == 1) {
            for (int j4 = threadIdx.x; j4 < (d >> 2); j4 += SB_THREADS) {
                float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
                for (int gg = 0; gg < G; gg++) {
                    const float4 v = *(const float4*)(comb + gg * d + 4 * j4);
                    t.x += v.x; t.y += v.y; t.z += v.z; t.w += v.w;
                }
                if (mode == 0) {
                    sb_red_add4(y + 4 * j4, t);
                } else {
                    *(float4*)(partials + (long)blockIdx.x * d + 4 * j4) = t;
                }
            }
        }
        if (zero_y && threadIdx.x == 0) {
            // Everyone has seen the flag once the count is complete.
            if (((atomicAdd(counters + 2, 1u) + 1u) & ~SB_LOCAL_ZEROED) == gridDim.x) atomicExch(counters + 2, 0u);
        }
    }
    if (mode == 0) return;
    if (phases == 3) sb_grid_barrier(counters);
    if (!(phases & 2)) return;
    // The ordered sum: block k takes output chunks k, k + B, ...
    const int n_chunks = (d + 127) >> 7;
    for (int chunk = blockIdx.x; chunk < n_chunks; chunk += gridDim.x) {
        sb_sum_chunk_parts<8>(red, partials, gridDim.x, d, chunk, accumulate, y);
        __syncthreads();  // red[] is rewritten by the next chunk
    }
}

// v8, v9: the single-pass kernel above. v8: 4 x 16 bytes a lane and row in
// its gate/up pass (as v3), 2 blocks per SM (at 3 the 80-register cap
// spills the 16 accumulators); v9: 2 x 16 bytes (as v4), 3 blocks per SM.
#define SB_Q8S_LOCAL(N, MINB, P1V)                                                         \
    extern "C" __global__ void __launch_bounds__(SB_THREADS, MINB) superblock_ffn_q8s_v##N( \
        SB_Q8S_PARAMS, int part_ch, const float* nw, float neps, float* nout) {            \
        PDL_ENTRY();                                                                       \
        sb_ffn_q8s_local<P1V>(SB_Q8S_ARGS, nw, neps, nout);                                \
    }
SB_Q8S_LOCAL(8, 2, 4)
SB_Q8S_LOCAL(9, 3, 2)

// ---------------------------------------------------------------------------
// The fused FFN over NVFP4 pages (weight-only NVFP4: codes and scales decoded
// in registers, f32 FMA; Hopper has no FP4 math). Same contract as
// superblock_ffn_q8s (active list and count in device memory, phases 1/2/3,
// modes 0/1, the same scratch and grid rules) over pages of this layout:
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
// Phase 1: one warp per channel as in q8s; lane l takes 32-element groups
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
// factors above ptxas needs 127 (see crates/mirage-cuda/NOTES.md).
extern "C" __global__ void __launch_bounds__(SB_THREADS, 2)
    superblock_ffn_nvfp4(const sb_u8* __restrict__ pages, long page_bytes, int n_pages, int d, float ts_gate,
                         float ts_up, float ts_down, const float* __restrict__ x, const sb_u32* __restrict__ active,
                         const int* __restrict__ n_active, int max_active, int mode, int accumulate, float* hbuf,
                         float* partials, sb_u32* counters, float* y, int phases) {
    PDL_ENTRY();
    extern __shared__ float4 nvsb_xs[];
    __shared__ float red[SB_WARPS][128];
    __shared__ int last_flag;
    const int n_act = max(min(*n_active, max_active), 0);
    const int n_ch = n_act * SB_PAGE_CH;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
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
    if (phases == 3) sb_grid_barrier(counters);
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
        sb_finish_item(red, &last_flag, chunk, k, K, d, mode, accumulate, partials, counters, y);
    }
}
