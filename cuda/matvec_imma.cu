// ===========================================================================
// Decode mat-vecs of split Q4_K on int8 tensor cores (after matvec_split.cu,
// whose launch helpers they share; mmq.cu uses mma_s8_k32_from from here).
//
// At the copy rate an H100 streams ~6e12 4-bit weights a second; turning
// each into a float and multiplying it (3+ instructions a weight) keeps the
// SMs' issue slots busier than the memory, so the f32 kernels stayed near
// half the copy rate. Here the weights never become floats:
//   * the activation row is quantized per 32-element block to 16 bits
//     (scale max|x| / 32639) and split into two int8 planes,
//     x = s * (256 * hi + lo), in shared memory (imma_stage_x): about
//     2^-15 of each block's largest value, against the 8-bit q8_1 blocks
//     of the prefill products;
//   * one mma.m16n8k32.s8 multiplies 16 weight rows by a 32-element
//     sub-block of both planes at once (B column 0 = hi, 1 = lo), so a
//     nibble costs one mask (or shift and mask) on its way into the A
//     fragment, and the exact int32 dot 256 * hi + lo gets the sub-block's
//     scales in f32.
// k-permutation: the dot sums over k, so any bijection of the 32 k-slots
// that A and B share is exact. Lane (g, t) loads 16 bytes of rows g and g + 8
// at byte 16t of a 64-byte span (two 32-byte qs groups of a super-block:
// lanes t < 2 the first, t >= 2 the second); the span's low nibbles are two
// sub-blocks and its high nibbles two more. B columns 0/1 carry the planes
// of the sub-block in lanes t < 2's k-slots, columns 2/3 those of lanes
// t >= 2's, so after two mmas lane t = 0 holds the first sub-block's
// (hi, lo) dots for rows g, g + 8 and lane t = 1 the second's.
//
//   mv3_q4_ks[_kS] : mv3 (matvec.cu: up to three matrices, bias and
//                    residual epilogues, folded norm), 16 rows a warp,
//                    S warps a row group splitting the super-blocks.
//   ffn_q4_ks[_kS] : gate, up and silu(g) * u, 16 channels a warp.
//   mvx_q4_ks_xS   : one matrix, long rows: the split across S blocks, each
//                    rounding only its slice of x (imma_xsplit).
// Dynamic shared memory: the folded norm's row (4 * cols bytes, when nx is
// set), then the planes (2 * cols + 8 * cols / 32 bytes: matvec.rs's
// imma_smem).
// ===========================================================================

#define IMMA_ROWS 16  // weight rows per warp: the mma's M

// d = a (16 x 32, row) * b (32 x 8, col) + c in every accumulator, s8
// inputs, s32 accumulators. Fragments per the PTX ISA (g = lane / 4, t =
// lane % 4): a[0] row g, a[1] row g + 8, a[2] row g, a[3] row g + 8,
// columns 4t..4t+3 (a[0], a[1]) and 16 + 4t.. (a[2], a[3]); b[0] column g,
// k 4t..4t+3, b[1] k 16 + 4t..; d[0], d[1] row g, columns 2t, 2t + 1; d[2],
// d[3] row g + 8.
__device__ __forceinline__ void mma_s8_k32_from(int* d, const u32* a, const u32* b, int c) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c), "r"(c), "r"(c), "r"(c));
}

// The activation row as the mma reads it: int8 planes hi and lo
// ([cols] each), and per 32-element block the scale and the f32 sum of x
// (for Q4_K's min term).
struct ImmaX {
    const i8 *hi, *lo;
    const float *sc, *sum;
};

// x[0..cols) (global or shared) into the planes, by the whole block: a
// thread takes float4s, eight lanes a block of 32.
__device__ __forceinline__ void imma_quantize_x(const float* xa, int cols, i8* hi, i8* lo, float* sc, float* sum) {
    const int n4 = cols >> 2, lane = threadIdx.x & 31;
    for (int j0 = threadIdx.x; j0 - (int)threadIdx.x < n4; j0 += 4 * blockDim.x) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int j = j0 + u * blockDim.x;
            v[u] = j < n4 ? ((const float4*)xa)[j] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int j = j0 + u * blockDim.x;
            float amax = fmaxf(fmaxf(fabsf(v[u].x), fabsf(v[u].y)), fmaxf(fabsf(v[u].z), fabsf(v[u].w)));
            float s = (v[u].x + v[u].y) + (v[u].z + v[u].w);
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) {
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                s += __shfl_xor_sync(0xffffffffu, s, o);
            }
            if (j < n4) {
                const float inv = amax > 0.f ? 32639.f / amax : 0.f;
                const float e[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
                u32 hw = 0, lw = 0;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    // |q| <= 32639 = 127 * 256 + 127: hi and lo both fit int8.
                    const int q = __float2int_rn(e[i] * inv);
                    const int h = (q + 128) >> 8;
                    hw |= ((u32)h & 0xffu) << (8 * i);
                    lw |= ((u32)(q - (h << 8)) & 0xffu) << (8 * i);
                }
                ((u32*)hi)[j] = hw;
                ((u32*)lo)[j] = lw;
                if ((lane & 7) == 0) {
                    sc[j >> 3] = amax / 32639.f;
                    sum[j >> 3] = s;
                }
            }
        }
    }
}

// The planes of xa in dynamic shared memory, after the folded norm's row
// when there is one; every thread of the block calls it.
__device__ __forceinline__ ImmaX imma_stage_x(const float* xa, int cols, bool after_norm) {
    u8* base = (u8*)fused_norm_xs + (after_norm ? 4 * cols : 0);
    i8* hi = (i8*)base;
    i8* lo = hi + cols;
    float* sc = (float*)(lo + cols);
    float* sum = sc + (cols >> 5);
    imma_quantize_x(xa, cols, hi, lo, sc, sum);
    __syncthreads();
    return ImmaX{hi, lo, sc, sum};
}

// Rows r0 + g and r0 + g + 8 (clamped to the last row; the caller does not
// store past it) of NM split-Q4_K matrices dotted with X over super-blocks
// [s_lo, s_hi), US super-blocks of loads in flight. Afterwards lane t = 0
// of each quad holds acc[m][0] (row g) and acc[m][1] (row g + 8). Every lane
// of the warp calls it.
template <int NM, int US>
__device__ __forceinline__ void imma_q4k_dot(const u8* const (&Ws)[NM], int rows, int cols, int r0, int s_lo,
                                             int s_hi, const ImmaX& X, int lane, float (&acc)[NM][2]) {
    const int g = lane >> 2, t = lane & 3;
    const long qs = cols >> 1;
    const int ns = cols >> 8;
    const int ra = min(r0 + g, rows - 1), rb = min(r0 + g + 8, rows - 1);
    // This lane's B column: plane g & 1 of the pair's sub-block g >> 1, in
    // its k-slots only (the other lanes' columns 2..7 stay zero).
    const bool xs_on = g < 4 && (g >> 1) == (t >> 1);
    const i8* xpl = (g & 1) ? X.lo : X.hi;
    for (int s = s_lo; s < s_hi; s += US) {
        uint4 qa[US][NM][2], qb[US][NM][2], ha[US][NM], hb[US][NM];
#pragma unroll
        for (int u = 0; u < US; u++) {
            const bool ok = s + u < s_hi;
#pragma unroll
            for (int m = 0; m < NM; m++) {
                const u8* wa = Ws[m] + (long)ra * qs + (long)(s + u) * 128 + 16 * t;
                const u8* wb = Ws[m] + (long)rb * qs + (long)(s + u) * 128 + 16 * t;
                const uint4* hdr = (const uint4*)(Ws[m] + (long)rows * qs);
                const uint4 z = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    qa[u][m][h] = ok ? __ldg((const uint4*)(wa + 64 * h)) : z;
                    qb[u][m][h] = ok ? __ldg((const uint4*)(wb + 64 * h)) : z;
                }
                ha[u][m] = ok && t < 2 ? __ldg(hdr + (long)ra * ns + s + u) : z;
                hb[u][m] = ok && t < 2 ? __ldg(hdr + (long)rb * ns + s + u) : z;
            }
        }
#pragma unroll
        for (int u = 0; u < US; u++) {
            if (s + u >= s_hi) break;
            float sa[NM], ma[NM], sb[NM], mb[NM];
#pragma unroll
            for (int m = 0; m < NM; m++) sa[m] = ma[m] = sb[m] = mb[m] = 0.f;
#pragma unroll
            for (int h = 0; h < 2; h++) {
#pragma unroll
                for (int nib = 0; nib < 2; nib++) {
                    // Sub-blocks 4h + nib (lanes t < 2) and 4h + nib + 2.
                    const int j0 = 4 * h + nib, sh = 4 * nib;
                    u32 b0[2] = {0u, 0u}, b1[2] = {0u, 0u};
                    if (xs_on) {
                        const i8* p = xpl + ((s + u) * 8 + j0 + 2 * (g >> 1)) * 32 + 16 * (t & 1);
                        const uint4 xv = *(const uint4*)p;
                        b0[0] = xv.x;
                        b0[1] = xv.y;
                        b1[0] = xv.z;
                        b1[1] = xv.w;
                    }
                    const int j = j0 + 2 * (t & 1);  // the sub-block lane t (< 2) reads out
                    const int blk = (s + u) * 8 + j;
                    const float sx = X.sc[blk], xsum = X.sum[blk];
#pragma unroll
                    for (int m = 0; m < NM; m++) {
                        const uint4 wa = qa[u][m][h], wb = qb[u][m][h];
                        int c[4], c1[4];
                        const u32 a0[4] = {(wa.x >> sh) & 0x0f0f0f0fu, (wb.x >> sh) & 0x0f0f0f0fu,
                                           (wa.y >> sh) & 0x0f0f0f0fu, (wb.y >> sh) & 0x0f0f0f0fu};
                        mma_s8_k32_from(c, a0, b0, 0);
                        const u32 a1[4] = {(wa.z >> sh) & 0x0f0f0f0fu, (wb.z >> sh) & 0x0f0f0f0fu,
                                           (wa.w >> sh) & 0x0f0f0f0fu, (wb.w >> sh) & 0x0f0f0f0fu};
                        mma_s8_k32_from(c1, a1, b1, 0);
#pragma unroll
                        for (int i = 0; i < 4; i++) c[i] += c1[i];
                        float sc, mn;
                        q4k_scale_min(ha[u][m], j, &sc, &mn);
                        sa[m] += sc * ((float)(c[0] * 256 + c[1]) * sx);
                        ma[m] += mn * xsum;
                        q4k_scale_min(hb[u][m], j, &sc, &mn);
                        sb[m] += sc * ((float)(c[2] * 256 + c[3]) * sx);
                        mb[m] += mn * xsum;
                    }
                }
            }
            if (t < 2) {
#pragma unroll
                for (int m = 0; m < NM; m++) {
                    acc[m][0] += h2f((u16)(ha[u][m].x & 0xffffu)) * sa[m] - h2f((u16)(ha[u][m].x >> 16)) * ma[m];
                    acc[m][1] += h2f((u16)(hb[u][m].x & 0xffffu)) * sb[m] - h2f((u16)(hb[u][m].x >> 16)) * mb[m];
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < NM; m++) {
        acc[m][0] += __shfl_xor_sync(0xffffffffu, acc[m][0], 1);
        acc[m][1] += __shfl_xor_sync(0xffffffffu, acc[m][1], 1);
    }
}

// Split Q6_K (q6_ks: every super-block's 128 ql bytes [rows][cols/2], then
// its 64 qh bytes [rows][cols/4], its 16 int8 scales [rows][cols/16] and
// its f16 d [rows][cols/256]). ql byte j of half h (0, 1) holds element
// 128 h + j in its low nibble and 128 h + 64 + j in its high one; their
// two high bits are bits 2 k of qh byte 32 h + j % 32, k = j / 32 (low) or
// 2 + j / 32 (high); sub-block e / 16 of the super-block has scale e / 16.
// Lane (g, t) loads 16 ql bytes of rows g and g + 8 at 64 h + 16 t and the
// 16 qh bytes they need at 32 h + 16 (t & 1). One mma per (h, nibble, half
// of those 16 bytes): the lane's 8 bytes are 8 elements of sub-block
// 8 h + 4 nibble + t, so each lane's k-slots belong to one sub-block and B
// column 2 t' + p carries plane p of x in lane t''s k-slots only: after the
// mma lane t holds its own sub-block's (hi, lo) dots for rows g and g + 8.
// Codes go in as q - 32 (int8), so no offset term is left.

// Four codes of ql word w (nibble nib) and qh word hw (bits 2 k) as int8
// q - 32.
__device__ __forceinline__ u32 q6k_imma_word(u32 w, u32 hw, int nib, int k) {
    const u32 lo = (w >> (4 * nib)) & 0x0f0f0f0fu;
    // The high bits b as (b - 2) << 4, sign-extended: 0x20 -> 0xe0, 0x30 -> 0xf0.
    u32 v = (((hw >> (2 * k)) & 0x03030303u) ^ 0x02020202u) << 4;
    v |= (v & 0x20202020u) * 6u;
    return v | lo;
}

// Byte i (0..15, any lane-dependent value) of v as a signed int.
__device__ __forceinline__ int imma_byte_i8(const uint4& v, int i) {
    const int w = i >> 2;
    const u32 word = w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
    return (int)(i8)(u8)(word >> (8 * (i & 3)));
}

// Component w of a uint4 (w known at compile time after unrolling).
__device__ __forceinline__ u32 imma_word(const uint4& v, int w) {
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// imma_q4k_dot for split Q6_K, one super-block of loads in flight.
template <int NM>
__device__ __forceinline__ void imma_q6k_dot(const u8* const (&Ws)[NM], int rows, int cols, int r0, int s_lo,
                                             int s_hi, const ImmaX& X, int lane, float (&acc)[NM][2]) {
    const int g = lane >> 2, t = lane & 3;
    const long qs = cols >> 1, hs = cols >> 2, ss = cols >> 4;
    const int ns = cols >> 8;
    const int ra = min(r0 + g, rows - 1), rb = min(r0 + g + 8, rows - 1);
    const bool xs_on = (g >> 1) == t;
    const i8* xpl = (g & 1) ? X.lo : X.hi;
    for (int s = s_lo; s < s_hi; s++) {
        uint4 la[NM][2], lb[NM][2], ha[NM][2], hb[NM][2], sca[NM], scb[NM];
        u32 da[NM], db[NM];
#pragma unroll
        for (int m = 0; m < NM; m++) {
            const u8* ql = Ws[m];
            const u8* qh = ql + (long)rows * qs;
            const u8* sc = qh + (long)rows * hs;
            const u16* dd = (const u16*)(sc + (long)rows * ss);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                la[m][h] = __ldg((const uint4*)(ql + (long)ra * qs + s * 128 + 64 * h + 16 * t));
                lb[m][h] = __ldg((const uint4*)(ql + (long)rb * qs + s * 128 + 64 * h + 16 * t));
                ha[m][h] = __ldg((const uint4*)(qh + (long)ra * hs + s * 64 + 32 * h + 16 * (t & 1)));
                hb[m][h] = __ldg((const uint4*)(qh + (long)rb * hs + s * 64 + 32 * h + 16 * (t & 1)));
            }
            sca[m] = __ldg((const uint4*)(sc + (long)ra * ss + s * 16));
            scb[m] = __ldg((const uint4*)(sc + (long)rb * ss + s * 16));
            da[m] = __ldg(dd + (long)ra * ns + s);
            db[m] = __ldg(dd + (long)rb * ns + s);
        }
        float fa[NM], fb[NM];
#pragma unroll
        for (int m = 0; m < NM; m++) fa[m] = fb[m] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; h++) {
#pragma unroll
            for (int nib = 0; nib < 2; nib++) {
                const int k = 2 * nib + (t >> 1), sub = 8 * h + 4 * nib + t;
                const float sx = X.sc[s * 8 + 4 * h + 2 * nib + (t >> 1)];
                int c[NM][4];
#pragma unroll
                for (int m = 0; m < NM; m++) c[m][0] = c[m][1] = c[m][2] = c[m][3] = 0;
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    u32 b[2] = {0u, 0u};
                    if (xs_on) {
                        const uint2 xv = *(const uint2*)(xpl + s * 256 + 128 * h + 64 * nib + 16 * t + 8 * half);
                        b[0] = xv.x;
                        b[1] = xv.y;
                    }
#pragma unroll
                    for (int m = 0; m < NM; m++) {
                        const u32 a[4] = {
                            q6k_imma_word(imma_word(la[m][h], 2 * half), imma_word(ha[m][h], 2 * half), nib, k),
                            q6k_imma_word(imma_word(lb[m][h], 2 * half), imma_word(hb[m][h], 2 * half), nib, k),
                            q6k_imma_word(imma_word(la[m][h], 2 * half + 1), imma_word(ha[m][h], 2 * half + 1), nib,
                                          k),
                            q6k_imma_word(imma_word(lb[m][h], 2 * half + 1), imma_word(hb[m][h], 2 * half + 1), nib,
                                          k)};
                        int d[4];
                        mma_s8_k32_from(d, a, b, 0);
#pragma unroll
                        for (int i = 0; i < 4; i++) c[m][i] += d[i];
                    }
                }
#pragma unroll
                for (int m = 0; m < NM; m++) {
                    fa[m] += (float)imma_byte_i8(sca[m], sub) * ((float)(c[m][0] * 256 + c[m][1]) * sx);
                    fb[m] += (float)imma_byte_i8(scb[m], sub) * ((float)(c[m][2] * 256 + c[m][3]) * sx);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < NM; m++) {
            acc[m][0] += h2f((u16)da[m]) * fa[m];
            acc[m][1] += h2f((u16)db[m]) * fb[m];
        }
    }
#pragma unroll
    for (int m = 0; m < NM; m++) {
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
            acc[m][0] += __shfl_xor_sync(0xffffffffu, acc[m][0], o);
            acc[m][1] += __shfl_xor_sync(0xffffffffu, acc[m][1], o);
        }
    }
}

// The rows [rb, rb + n) of a split-Q6_K matrix asked of L2 (ql, qh and the
// scales; the d are a few bytes).
__device__ __forceinline__ void q6ks_rows_l2_prefetch(const u8* W, int rows, int rb, int n, int cols) {
    if (blockIdx.y != 0) return;
    const long qs = cols >> 1, hs = cols >> 2;
    l2_prefetch_rows(W + (long)rb * qs, qs, n, min(qs, (long)L2_PREFETCH_ROW));
    l2_prefetch_rows(W + (long)rows * qs + (long)rb * hs, hs, n, min(hs, (long)L2_PREFETCH_ROW));
    l2_prefetch_block(W + (long)rows * (qs + hs) + (long)rb * (cols >> 4), (long)n * (cols >> 4));
}

// The weight types of the tensor-core decode mat-vecs.
#define IMMA_Q4K 0
#define IMMA_Q6K 1

// The rows [rb, rb + n) of a matrix of type TY asked of L2.
template <int TY>
__device__ __forceinline__ void imma_rows_l2_prefetch(const u8* W, int rows, int rb, int n, int cols) {
    if (TY == IMMA_Q6K)
        q6ks_rows_l2_prefetch(W, rows, rb, n, cols);
    else
        split_rows_l2_prefetch(W, rows, rb, n, cols >> 1, cols >> 4);
}

// The dot of TY (US: Q4_K's super-blocks of loads in flight).
template <int TY, int NM, int US>
__device__ __forceinline__ void imma_dot(const u8* const (&Ws)[NM], int rows, int cols, int r0, int s_lo, int s_hi,
                                         const ImmaX& X, int lane, float (&acc)[NM][2]) {
    if (TY == IMMA_Q6K)
        imma_q6k_dot<NM>(Ws, rows, cols, r0, s_lo, s_hi, X, lane, acc);
    else
        imma_q4k_dot<NM, US>(Ws, rows, cols, r0, s_lo, s_hi, X, lane, acc);
}

// Super-blocks [lo, lo + n) of slice `slice` of S over ns super-blocks.
template <int S>
__device__ __forceinline__ void imma_slice(int ns, int slice, int& lo, int& hi) {
    const int per = (ns + S - 1) / S;
    lo = min(ns, slice * per);
    hi = min(ns, lo + per);
}

// The end of an imma mat-vec: rows r0 + g, r0 + g + 8 from lane t = 0 of
// each quad (S = 1), or summed over the S slices of the row group in slice
// order by the slice-0 warp (part: FAST_WARPS x 16 floats of shared
// memory), through mv_store's epilogues.
template <int S>
__device__ __forceinline__ void imma_store(const float (&acc)[2], float (*part)[IMMA_ROWS], int warp, int lane,
                                           int slice, int r0, float* y, const float* bias, float* rs, int a,
                                           int rows) {
    const int g = lane >> 2, t = lane & 3;
    if (S == 1) {
#pragma unroll
        for (int k = 0; k < 2; k++)
            if (t == 0 && r0 + g + 8 * k < rows) mv_store(acc[k], y, bias, rs, a, rows, r0 + g + 8 * k);
    } else {
        if (t == 0) {
            part[warp][g] = acc[0];
            part[warp][g + 8] = acc[1];
        }
        __syncthreads();
        if (slice == 0 && lane < IMMA_ROWS && r0 + lane < rows) {
            float v = 0.f;
            for (int s = 0; s < S; s++) v += part[warp + s][lane];
            mv_store(v, y, bias, rs, a, rows, r0 + lane);
        }
    }
}

// mv3 of split Q4_K or Q6_K: (FAST_WARPS / S) row groups of 16 a block.
template <int TY, int S>
__device__ __forceinline__ void mv3_imma(MV3_PARAMS) {
    const int PER = (FAST_WARPS / S) * IMMA_ROWS;
    MV3_PICK_W(PER)
    imma_rows_l2_prefetch<TY>(W, rows, bx * PER, min(PER, rows - bx * PER), cols);
    PDL_ENTRY();
    FAST_INPUT
    const ImmaX X = imma_stage_x(xa, cols, nx != 0);
    __shared__ float part[S > 1 ? FAST_WARPS : 1][IMMA_ROWS];
    const int slice = warp % S, r0 = (bx * (FAST_WARPS / S) + warp / S) * IMMA_ROWS;
    int s_lo, s_hi;
    imma_slice<S>(cols >> 8, slice, s_lo, s_hi);
    float acc[1][2] = {{0.f, 0.f}};
    const u8* const Ws[1] = {W};
    if (r0 < rows) imma_dot<TY, 1, 2>(Ws, rows, cols, r0, s_lo, s_hi, X, lane, acc);
    imma_store<S>(acc[0], part, warp, lane, slice, r0, y, bias, rs, a, rows);
}

// gate/up/SwiGLU of split Q4_K or Q6_K: 16 channels a warp (their gate and
// up rows).
template <int TY, int S>
__device__ __forceinline__ void ffn_imma(FFN_PARAMS) {
    const int PER = (FAST_WARPS / S) * IMMA_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    (void)row_bytes;
    (void)ts_g;
    (void)ts_u;
    {
        // The block's gate and up rows.
        const int rb = blockIdx.x * PER, nb = min(PER, rows - rb);
        imma_rows_l2_prefetch<TY>(Wg, rows, rb, nb, cols);
        imma_rows_l2_prefetch<TY>(Wu, rows, rb, nb, cols);
    }
    PDL_ENTRY();
    FAST_INPUT
    const ImmaX X = imma_stage_x(xa, cols, nx != 0);
    __shared__ float part[S > 1 ? FAST_WARPS : 1][2 * IMMA_ROWS];
    const int slice = warp % S, r0 = (blockIdx.x * (FAST_WARPS / S) + warp / S) * IMMA_ROWS;
    int s_lo, s_hi;
    imma_slice<S>(cols >> 8, slice, s_lo, s_hi);
    float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    const u8* const Ws[2] = {Wg, Wu};
    if (r0 < rows) imma_dot<TY, 2, 1>(Ws, rows, cols, r0, s_lo, s_hi, X, lane, acc);
    const int g = lane >> 2, t = lane & 3;
    if (S == 1) {
#pragma unroll
        for (int k = 0; k < 2; k++)
            if (t == 0 && r0 + g + 8 * k < rows) h[(long)a * rows + r0 + g + 8 * k] = silu_mul(acc[0][k], acc[1][k]);
    } else {
        if (t == 0) {
            part[warp][g] = acc[0][0];
            part[warp][g + 8] = acc[0][1];
            part[warp][IMMA_ROWS + g] = acc[1][0];
            part[warp][IMMA_ROWS + g + 8] = acc[1][1];
        }
        __syncthreads();
        if (slice == 0 && lane < IMMA_ROWS && r0 + lane < rows) {
            float gs = 0.f, us = 0.f;
            for (int s = 0; s < S; s++) {
                gs += part[warp + s][lane];
                us += part[warp + s][IMMA_ROWS + lane];
            }
            h[(long)a * rows + r0 + lane] = silu_mul(gs, us);
        }
    }
}

// mvx_q4_ks_x{S}: the column split across blocks, for long rows (down):
// every block of mv3_q4_ks rounds the whole input row into its planes,
// which for a 7B down row (18,944 values, 224 blocks) was about a quarter
// of the kernel's time. Here a block is 8 row groups of 16 rows on one of S
// slices of the super-blocks and rounds only that slice; its warps' sums go
// to part[a][slice][row], and the block that completes a tile's S slices
// (ctr[a][tile], reset to 0 by that block) adds them in slice order and
// stores through mv_store's epilogues, so the result does not depend on
// which block finishes last. smem: the slice's planes (imma_smem of the
// slice's columns).
template <int TY, int S>
__device__ __forceinline__ void imma_xsplit(const u8* W, int rows, int cols, const float* xa, float* y,
                                            const float* bias, float* rs, float* part, unsigned* ctr, int a,
                                            int tile, int slice, int tiles, u8* smem) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int PER = FAST_WARPS * IMMA_ROWS;
    const int rb = tile * PER, nb = min(PER, rows - rb);
    int s_lo, s_hi;
    imma_slice<S>(cols >> 8, slice, s_lo, s_hi);
    const int c0 = s_lo * 256, nc = (s_hi - s_lo) * 256;
    i8* hi = (i8*)smem;
    i8* lo = hi + nc;
    float* sc = (float*)(lo + nc);
    float* sum = sc + (nc >> 5);
    imma_quantize_x(xa + c0, nc, hi, lo, sc, sum);
    __syncthreads();
    // Indexed by absolute super-block in imma_q4k_dot: shifted by the slice.
    const ImmaX X{hi - c0, lo - c0, sc - (c0 >> 5), sum - (c0 >> 5)};
    const int r0 = rb + warp * IMMA_ROWS;
    float acc[1][2] = {{0.f, 0.f}};
    const u8* const Ws[1] = {W};
    if (r0 < rows && s_lo < s_hi) imma_dot<TY, 1, 2>(Ws, rows, cols, r0, s_lo, s_hi, X, lane, acc);
    const int g = lane >> 2, t = lane & 3;
    float* mine = part + ((long)a * S + slice) * rows;
    if (t == 0) {
        if (r0 + g < rows) mine[r0 + g] = acc[0][0];
        if (r0 + g + 8 < rows) mine[r0 + g + 8] = acc[0][1];
    }
    // Each thread's partials are visible device-wide before the block
    // counts itself done (the pattern of CUDA's threadFenceReduction).
    __threadfence();
    __syncthreads();
    __shared__ unsigned xsplit_last;
    unsigned* c = ctr + (long)a * tiles + tile;
    if (threadIdx.x == 0) xsplit_last = atomicAdd(c, 1u) == (unsigned)(S - 1);
    __syncthreads();
    if (!xsplit_last) return;
    __threadfence();
    for (int i = threadIdx.x; i < nb; i += blockDim.x) {
        float v = 0.f;
        for (int k = 0; k < S; k++) v += __ldcg(part + ((long)a * S + k) * rows + rb + i);
        mv_store(v, y, bias, rs, a, rows, rb + i);
    }
    if (threadIdx.x == 0) *c = 0u;
}

// The kernel: mv3's parameters (matrix 0 only, no folded norm: the host
// launches it only so), then part and ctr.
template <int TY, int S>
__device__ __forceinline__ void mvx_imma(MV3_PARAMS, float* part, unsigned* ctr) {
    const int tile = blockIdx.x / S, slice = blockIdx.x % S, tiles = gridDim.x / S;
    {
        // The block's rows of its slice: quants, then (Q4_K) headers or
        // (Q6_K) high bits and scales, each field a span per row.
        constexpr int PER = FAST_WARPS * IMMA_ROWS;
        const int rb = tile * PER, nb = min(PER, rows0 - rb), ns = cols >> 8;
        int s_lo, s_hi;
        imma_slice<S>(ns, slice, s_lo, s_hi);
        const long qs = cols >> 1;
        if (blockIdx.y == 0 && s_lo < s_hi) {
            const long n = s_hi - s_lo;
            l2_prefetch_rows(W0 + (long)rb * qs + (long)s_lo * 128, qs, nb, min(n * 128, (long)L2_PREFETCH_ROW));
            if (TY == IMMA_Q6K) {
                const long hs = cols >> 2, base = (long)rows0 * qs;
                l2_prefetch_rows(W0 + base + (long)rb * hs + (long)s_lo * 64, hs, nb, min(n * 64, (long)L2_PREFETCH_ROW));
                l2_prefetch_rows(W0 + base + (long)rows0 * hs + ((long)rb * ns + s_lo) * 16, (long)ns * 16, nb, n * 16);
            } else {
                l2_prefetch_rows(W0 + (long)rows0 * qs + ((long)rb * ns + s_lo) * 16, (long)ns * 16, nb, n * 16);
            }
        }
    }
    PDL_ENTRY();
    imma_xsplit<TY, S>(W0, rows0, cols, x + (long)blockIdx.y * cols, y0, bias0, res, part, ctr, blockIdx.y, tile,
                       slice, tiles, (u8*)fused_norm_xs);
}

#define IMMA_KERNELS(NAME, TY, SUFFIX, S)                                                                            \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mv3_##NAME##SUFFIX(MV3_PARAMS) {                  \
        mv3_imma<TY, S>(MV3_ARGS);                                                                                   \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_##NAME##SUFFIX(FFN_PARAMS) {                  \
        ffn_imma<TY, S>(Wg, Wu, rows, row_bytes, cols, x, h, ts_g, ts_u, nx, nw, neps, nout);                        \
    }
#define IMMA_SPLITS(NAME, TY)         \
    IMMA_KERNELS(NAME, TY, , 1)       \
    IMMA_KERNELS(NAME, TY, _k2, 2)    \
    IMMA_KERNELS(NAME, TY, _k4, 4)    \
    IMMA_KERNELS(NAME, TY, _k8, 8)
IMMA_SPLITS(q4_ks, IMMA_Q4K)
IMMA_SPLITS(q6_ks, IMMA_Q6K)

#define MVX_KERNEL(NAME, TY, S)                                                                                      \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) mvx_##NAME##_x##S(MV3_PARAMS, float* part,        \
                                                                                  unsigned* ctr) {                  \
        mvx_imma<TY, S>(MV3_ARGS, part, ctr);                                                                        \
    }
#define MVX_SPLITS(NAME, TY)    \
    MVX_KERNEL(NAME, TY, 2)     \
    MVX_KERNEL(NAME, TY, 4)     \
    MVX_KERNEL(NAME, TY, 8)     \
    MVX_KERNEL(NAME, TY, 16)
MVX_SPLITS(q4_ks, IMMA_Q4K)
MVX_SPLITS(q6_ks, IMMA_Q6K)
