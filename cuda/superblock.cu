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

// The end of one phase-2 item (output chunk `chunk`, part k of K) of the
// fused FFN kernels. On entry red[w][j] holds warp w's sum for output j of
// the chunk and the block has synchronized. Thread j adds the 8 warp sums in
// warp order and finishes by mode (see superblock_ffn_q8s). Ends with a
// block barrier: red[] is rewritten by the next item.
__device__ __forceinline__ void sb_finish_item(float (*red)[128], int* last_flag, int chunk, int k, int K, int d,
                                               int mode, int accumulate, float* partials, sb_u32* counters,
                                               float* y) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = (chunk << 7) + (lane << 2);  // lane: outputs e .. e + 3 in the ordered sum
    const bool live = e < d;
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
            // Warp w sums parts w, w + 8, ... in order (lane: outputs
            // 4 lane .. 4 lane + 3), then thread j adds the 8 warp sums
            // in warp order: a fixed order, and one L2 round trip per
            // 8 parts instead of K dependent ones.
            float4 t4 = make_float4(0.f, 0.f, 0.f, 0.f);
            if (live) {
                for (int kk = warp; kk < K; kk += SB_WARPS) {
                    float4 v = __ldcg((const float4*)(partials + (long)kk * d + e));
                    t4.x += v.x; t4.y += v.y; t4.z += v.z; t4.w += v.w;
                }
            }
            __syncthreads();  // everyone has read red[] above
            red[warp][4 * lane] = t4.x;
            red[warp][4 * lane + 1] = t4.y;
            red[warp][4 * lane + 2] = t4.z;
            red[warp][4 * lane + 3] = t4.w;
            __syncthreads();
            if (own) {
                float t = 0.f;
#pragma unroll
                for (int w2 = 0; w2 < SB_WARPS; w2++) t += red[w2][j];
                float* o = y + (chunk << 7) + j;
                *o = accumulate ? *o + t : t;
            }
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
extern "C" __global__ void __launch_bounds__(SB_THREADS)
    superblock_ffn_q8s(const sb_u8* __restrict__ pages, long page_bytes, int n_pages, int d,
                       const float* __restrict__ x, const sb_u32* __restrict__ active,
                       const int* __restrict__ n_active, int max_active, int mode, int accumulate,
                       float* hbuf, float* partials, sb_u32* counters, float* y, int phases) {
    extern __shared__ float4 sb_xs[];
    __shared__ float red[SB_WARPS][128];
    __shared__ int last_flag;
    const int n_act = max(min(*n_active, max_active), 0);
    const int n_ch = n_act * SB_PAGE_CH;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long mat = (long)SB_PAGE_CH * d;          // bytes of one quant matrix in a page
    const long smat = (long)SB_PAGE_CH * (d >> 5);  // f16 scales of one matrix

    // Phase 1.
    if (phases & 1) {
    const float4* x4 = (const float4*)x;
    for (int m = threadIdx.x; m < (d >> 2); m += blockDim.x) sb_xs[m] = x4[m];
    __syncthreads();
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
    }
    if (phases == 3) sb_grid_barrier(counters);
    if (!(phases & 2)) return;

    // Phase 2.
    const int n_chunks = (d + 127) >> 7;
    const int K = max((int)gridDim.x / n_chunks, 1);
    const int items = K * n_chunks;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int chunk = it % n_chunks, k = it / n_chunks;
        const int g_begin = (int)((long)(n_ch >> 3) * k / K), g_end = (int)((long)(n_ch >> 3) * (k + 1) / K);
        const int e = (chunk << 7) + (lane << 2);
        const bool live = e < d;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        // Groups of 8 consecutive channels (never across a page): one page
        // lookup per 8 rows, rows at stride d.
        for (int gi = g_begin + warp; gi < g_end && live; gi += SB_WARPS) {
            const int c0 = gi << 3;
            const sb_u32 page = active[c0 >> 7];
            if (page >= (sb_u32)n_pages) continue;
            const int ch = c0 & 127;
            const sb_u8* base = pages + (long)page * page_bytes;
            const sb_u8* row = base + 2 * mat + (long)ch * d + e;
            const sb_u16* srow = (const sb_u16*)(base + 3 * mat) + 2 * smat + (long)ch * (d >> 5) + (e >> 5);
            sb_u32 w[8];
            sb_u16 sc[8];
#pragma unroll
            for (int r = 0; r < 8; r++) {
                w[r] = __ldg((const sb_u32*)(row + (long)r * d));
                sc[r] = __ldg(srow + (long)r * (d >> 5));
            }
            const float4 h0 = __ldcg((const float4*)(hbuf + c0));
            const float4 h1 = __ldcg((const float4*)(hbuf + c0 + 4));
            const float hh[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
            for (int r = 0; r < 8; r++) {
                float f[4];
                sb_q8x4(w[r], f);
                float hv = hh[r] * sb_h2f(sc[r]);
                a0 += hv * f[0];
                a1 += hv * f[1];
                a2 += hv * f[2];
                a3 += hv * f[3];
            }
        }
        red[warp][4 * lane] = a0;
        red[warp][4 * lane + 1] = a1;
        red[warp][4 * lane + 2] = a2;
        red[warp][4 * lane + 3] = a3;
        __syncthreads();
        sb_finish_item(red, &last_flag, chunk, k, K, d, mode, accumulate, partials, counters, y);
    }
}

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

// One reduce-scatter step over lane bit `bit` (16, 8 or 4) on the first 2 n
// values of a: afterwards a[0 .. n) holds the sums over the lane pair of
// elements (lane & bit ? n : 0) + i of the previous a[0 .. 2 n).
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

// At most 128 registers (2 blocks of 256 threads per SM): with the unroll
// factors above ptxas needs 127 (see crates/mirage-cuda/NOTES.md).
extern "C" __global__ void __launch_bounds__(SB_THREADS, 2)
    superblock_ffn_nvfp4(const sb_u8* __restrict__ pages, long page_bytes, int n_pages, int d, float ts_gate,
                         float ts_up, float ts_down, const float* __restrict__ x, const sb_u32* __restrict__ active,
                         const int* __restrict__ n_active, int max_active, int mode, int accumulate, float* hbuf,
                         float* partials, sb_u32* counters, float* y, int phases) {
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
