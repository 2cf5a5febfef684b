// MIRAGE sparse FFN kernel over page-major Q2_K pages. Compiled after
// decode.cu and superblock.cu (one NVRTC unit): uses their sb_* helpers,
// nv_reduce_scatter and sb_finish_item.
//
// Split Q2_K ("q2ks"): a ggml Q2_K matrix of R rows x d (d % 256 == 0; a
// block_q2_K is scales[16] @0, qs[64] @16, d:f16 @80, dmin:f16 @82, 84 bytes
// per 256 weights) stored as three arrays, the same 84 bytes per block:
//   quants [R][d/4]:   the blocks' qs[64], verbatim, block after block;
//   scales [R][d/16]:  the blocks' scales[16], PERMUTED within each block:
//                      byte 4 u + j = scales[8 (u >> 1) + 2 j + (u & 1)]
//                      (u = 0..3 the block's quarter, j = 0..3; low nibble
//                      scale, high nibble min, as in ggml);
//   dm     [R][d/256]: one u32 per block = bytes 80..83 verbatim (d in the
//                      low half, dmin in the high half).
// Element e of a block (ggml's order) has code (qs[32 (e >> 7) + (e & 31)]
// >> 2 ((e >> 5) & 3)) & 3 and scale/min byte e / 16, value
// (d * (sc & 15)) * code - dmin * (sc >> 4). So the 16 bytes 16 u .. 16 u + 15
// of qs (quarter u = 2 h + hi) hold elements 128 h + 16 hi + 32 j + m
// (m = 0..15 the byte, j = 0..3 the bit pair) and need the four scale bytes
// 8 h + 2 j + hi: after the permutation those are the u32 u of the block's
// scales. A quarter is one uint4 of quants + one u32 of scales + the block's
// dm word: 64 weights.
//
// A page (128 FFN channels) is one contiguous span:
//   [gate quants 128 x d/4][up quants][down_t quants]
//   [gate scales 128 x d/16][up scales][down_t scales]
//   [gate dm 128 x d/64 bytes][up dm][down_t dm]
// 126 d bytes (2.625 bits a weight; 451,584 at d 3584). d % 256 == 0 keeps
// every quants row 64-byte aligned, every scales row 16-byte and every dm
// row 4-byte aligned. down_t row i is column i of the page's slice of W_down,
// quantized along d (as in the Q8_0 and NVFP4 pages).
//
// Codes to floats without I2F: a byte of (word & (0x03030303 << 2 j)) holds
// code * 4^j; PRMT puts it in the low mantissa byte of 2^(23 - 2 j), whose
// ulp is 4^-j, so one FADD of -2^(23 - 2 j) leaves the code exactly (about
// 3.25 integer/FP ops a weight, FMA included). Scale and min nibbles the same
// way with 2^23.
//
// Phase 1 (gate/up/SwiGLU): one warp per channel (grid-stride); lane l takes
// quarters l, l + 32, ... of the gate and up rows (a warp load is 512
// contiguous bytes of quants and 128 of scales per row), Q2_FFN_U1 quarters
// in flight. The min term is folded per 16 weights with the sum of their x:
//   dot = d * sum_j sc_j sum_m code x  -  dmin * sum_j min_j xsum_j.
// x sits in shared memory as 16 planes (plane 4 j + t, index q: the float4
// of word t, bit pair j of quarter q = x[256 (q >> 2) + 128 ((q >> 1) & 1) +
// 16 (q & 1) + 32 j + 4 t .. + 3]), so the lanes' float4 reads of a plane
// are consecutive (conflict-free); the 16-element sums xsum[j * Q + q]
// (Q = d / 64 quarters a row) live in red[] (unused until phase 2, so
// d <= Q2_MAX_D).
// Phase 2 (down): an item's warp takes 8 channels at once: lane l = 4 s + t
// reads the 8-byte word t of the 32 quant bytes of channel c0 + s's down_t
// row that cover the 128-output chunk (chunk = half h of block chunk / 2:
// qs bytes 32 h .. 32 h + 31), the u32 of scales of its quarter (2 h +
// (t >> 1)) and the block's dm word, and keeps 32 outputs in registers:
// a[8 j + i] is output 32 j + 8 t + i of the chunk. The min terms (the same
// for the 8 outputs of one bit pair) go to 4 extra sums, subtracted once per
// item. At the item's end the NVFP4 kernel's reduce-scatter over the 8
// channel lanes (lane bits 16, 8, 4: 28 shuffles) leaves lane (s, t) the
// sums a[4 s .. 4 s + 3] = outputs 32 (s >> 1) + 8 t + 4 (s & 1) .. + 3,
// written to red[] for sb_finish_item.
// Contract, grid, block, shared memory: as superblock_ffn_q8s (active ids and
// count in device memory, ids >= n_pages skipped, phases 1 and 2, the same
// scratch; dynamic shared memory d * 4 bytes, phase 2 alone none).

#define Q2_FFN_U1 2      // quarters (64 weights) per lane and row in flight in phase 1
#define Q2_FFN_U2 4      // 8-channel groups per warp in flight in phase 2
#define Q2_MAX_D 16384   // xsum (d / 16 floats) lives in red[SB_WARPS][128]

// Byte i of u, which holds code * 4^J (code 0..3), as the float code.
template <int J>
__device__ __forceinline__ float q2_code(sb_u32 u, int i) {
    const sb_u32 magic = 0x4B000000u - ((sb_u32)J << 24);  // 2^(23 - 2 J)
    return __uint_as_float(sb_prmt(u, magic, 0x7540u | (sb_u32)i)) - __uint_as_float(magic);
}

// The four scales (lo) or mins (hi) of a quarter's scale word as floats.
__device__ __forceinline__ void q2_nibbles(sb_u32 scw, float* sc, float* mn) {
    const sb_u32 s = scw & 0x0F0F0F0Fu, m = (scw >> 4) & 0x0F0F0F0Fu;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        sc[j] = q2_code<0>(s, j);
        mn[j] = q2_code<0>(m, j);
    }
}

// sum over the 16 weights of bit pair J in the 4 words of w of code * x.
template <int J>
__device__ __forceinline__ float q2_dot16(const uint4& w, const float4* xv) {
    const sb_u32 msk = 0x03030303u << (2 * J);
    const sb_u32 words[4] = {w.x & msk, w.y & msk, w.z & msk, w.w & msk};
    float s = 0.f;
#pragma unroll
    for (int t = 0; t < 4; t++) {
        s += q2_code<J>(words[t], 0) * xv[t].x + q2_code<J>(words[t], 1) * xv[t].y +
             q2_code<J>(words[t], 2) * xv[t].z + q2_code<J>(words[t], 3) * xv[t].w;
    }
    return s;
}

// Bit pair J of one quarter for NR rows: P[k] += sc_J * dot, M[k] += min_J * xsum.
template <int J, int NR>
__device__ __forceinline__ void q2_pair(const uint4* w, const float (*sc)[4], const float (*mn)[4], const float4* xs,
                                        const float* xsum, int Q, int qi, float* P, float* M) {
    float4 xv[4];
#pragma unroll
    for (int t = 0; t < 4; t++) xv[t] = xs[(4 * J + t) * Q + qi];
    const float xsj = xsum[J * Q + qi];
#pragma unroll
    for (int k = 0; k < NR; k++) {
        P[k] += sc[k][J] * q2_dot16<J>(w[k], xv);
        M[k] += mn[k][J] * xsj;
    }
}

// acc[k] += (this lane's share of) dot(row k, x) for NR split-Q2_K rows of Q
// quarters: q[k] the row's quants (one uint4 per quarter), s[k] its permuted
// scales (one u32 per quarter), m[k] its dm words (one per 4 quarters).
template <int NR, int U>
__device__ __forceinline__ void q2_dot_rows(const uint4* const* q, const sb_u32* const* s, const sb_u32* const* m,
                                            const float4* xs, const float* xsum, int Q, int lane, float* acc) {
    for (int c = 0; c < Q; c += 32 * U) {
        uint4 w[U][NR];
        sb_u32 sw[U][NR], dw[U][NR];
        bool ok[U];
#pragma unroll
        for (int h = 0; h < U; h++) {
            const int qi = c + 32 * h + lane;
            ok[h] = qi < Q;
#pragma unroll
            for (int k = 0; k < NR; k++) {
                w[h][k] = ok[h] ? __ldg(q[k] + qi) : make_uint4(0u, 0u, 0u, 0u);
                sw[h][k] = ok[h] ? __ldg(s[k] + qi) : 0u;
                dw[h][k] = ok[h] ? __ldg(m[k] + (qi >> 2)) : 0u;
            }
        }
#pragma unroll
        for (int h = 0; h < U; h++) {
            if (!ok[h]) continue;
            const int qi = c + 32 * h + lane;
            float sc[NR][4], mn[NR][4], P[NR], M[NR];
#pragma unroll
            for (int k = 0; k < NR; k++) {
                q2_nibbles(sw[h][k], sc[k], mn[k]);
                P[k] = 0.f;
                M[k] = 0.f;
            }
            q2_pair<0, NR>(w[h], sc, mn, xs, xsum, Q, qi, P, M);
            q2_pair<1, NR>(w[h], sc, mn, xs, xsum, Q, qi, P, M);
            q2_pair<2, NR>(w[h], sc, mn, xs, xsum, Q, qi, P, M);
            q2_pair<3, NR>(w[h], sc, mn, xs, xsum, Q, qi, P, M);
#pragma unroll
            for (int k = 0; k < NR; k++) {
                const float dd = sb_h2f((sb_u16)(dw[h][k] & 0xffffu)), dmin = sb_h2f((sb_u16)(dw[h][k] >> 16));
                acc[k] += dd * P[k] - dmin * M[k];
            }
        }
    }
}

// Phase 2: bit pair J of one channel's 8 quant bytes (words w0, w1) into
// a[8 J .. 8 J + 7] with scale sf.
template <int J>
__device__ __forceinline__ void q2_down_pair(sb_u32 w0, sb_u32 w1, float sf, float* a) {
    const sb_u32 msk = 0x03030303u << (2 * J);
    const sb_u32 u0 = w0 & msk, u1 = w1 & msk;
#pragma unroll
    for (int b = 0; b < 4; b++) {
        a[8 * J + b] += sf * q2_code<J>(u0, b);
        a[8 * J + 4 + b] += sf * q2_code<J>(u1, b);
    }
}

// At most 128 registers (2 blocks of 256 threads per SM): ptxas takes 128
// with the unroll factors above anyway.
extern "C" __global__ void __launch_bounds__(SB_THREADS, 2) superblock_ffn_q2k(SB_Q8S_PARAMS) {
    SB_PROLOGUE(q2_xs)
    const int Q = d >> 6;                            // quarters (64 weights) per row
    const long mat = (long)SB_PAGE_CH * (d >> 2);    // quant bytes of one matrix in a page
    const long smat = (long)SB_PAGE_CH * (d >> 4);   // scale bytes of one matrix
    const long dmat = (long)SB_PAGE_CH * (d >> 6);   // dm bytes of one matrix

    // Phase 1.
    if (phases & 1) {
        float* xsum = &red[0][0];
        const float4* x4 = (const float4*)x;
        for (int t = threadIdx.x; t < (d >> 2); t += blockDim.x) {
            // float4 t = elements 4 t .. 4 t + 3: block t >> 6, half h, bit
            // pair j, 16-group hi, word w of the quarter.
            const int b = t & 63, h = b >> 5, j = (b >> 3) & 3, hi = (b >> 2) & 1, w = b & 3;
            q2_xs[(4 * j + w) * Q + 4 * (t >> 6) + 2 * h + hi] = x4[t];
        }
        __syncthreads();
        for (int g = threadIdx.x; g < (d >> 4); g += blockDim.x) {
            const int j = g / Q, qi = g - j * Q;
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < 4; w++) {
                const float4 v = q2_xs[(4 * j + w) * Q + qi];
                s += (v.x + v.y) + (v.z + v.w);
            }
            xsum[g] = s;
        }
        __syncthreads();
        const int warps = gridDim.x * SB_WARPS;
        for (int c = blockIdx.x * SB_WARPS + warp; c < n_ch; c += warps) {
            const sb_u32 page = active[c >> 7];
            const int ch = c & 127;
            float hv = 0.f;
            if (page < (sb_u32)n_pages) {
                const sb_u8* base = pages + (long)page * page_bytes;
                const sb_u8* sbase = base + 3 * mat;
                const sb_u8* mbase = sbase + 3 * smat;
                const uint4* q[2] = {(const uint4*)(base + (long)ch * (d >> 2)),
                                     (const uint4*)(base + mat + (long)ch * (d >> 2))};
                const sb_u32* s[2] = {(const sb_u32*)(sbase + (long)ch * (d >> 4)),
                                      (const sb_u32*)(sbase + smat + (long)ch * (d >> 4))};
                const sb_u32* m[2] = {(const sb_u32*)(mbase + (long)ch * (d >> 6)),
                                      (const sb_u32*)(mbase + dmat + (long)ch * (d >> 6))};
                float acc[2] = {0.f, 0.f};
                q2_dot_rows<2, Q2_FFN_U1>(q, s, m, q2_xs, xsum, Q, lane, acc);
                const float g = sb_warp_sum(acc[0]), u = sb_warp_sum(acc[1]);
                hv = g / (1.f + expf(-g)) * u;
            }
            if (lane == 0) hbuf[c] = hv;
        }
    }
    if (!(phases & 2)) return;

    // Phase 2.
    const int n_chunks = d >> 7;
    const int K = max((int)gridDim.x / n_chunks, 1);
    const int items = K * n_chunks;
    const int sub = lane >> 2, t8 = lane & 3;  // channel of the 8, 8-byte word of the chunk's 32 quant bytes
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        const int chunk = it % n_chunks, k = it / n_chunks;
        const int g_begin = (int)((long)(n_ch >> 3) * k / K), g_end = (int)((long)(n_ch >> 3) * (k + 1) / K);
        // This lane's words: quants bytes 32 chunk + 8 t8 of the row, scale
        // u32 of quarter 2 (chunk & 1) + (t8 >> 1) of block chunk >> 1, the
        // block's dm word.
        const long qoff = 2 * mat + (long)(chunk << 5) + (t8 << 3);
        const long soff = 3 * mat + 2 * smat + (long)(chunk << 3) + ((t8 >> 1) << 2);
        const long moff = 3 * mat + 3 * smat + 2 * dmat + (long)((chunk >> 1) << 2);
        float a[32];
#pragma unroll
        for (int i = 0; i < 32; i++) a[i] = 0.f;
        float mins[4] = {0.f, 0.f, 0.f, 0.f};
        for (int gi = g_begin + warp; gi < g_end; gi += SB_WARPS * Q2_FFN_U2) {
            uint2 w[Q2_FFN_U2];
            sb_u32 sw[Q2_FFN_U2], dw[Q2_FFN_U2];
            float hv[Q2_FFN_U2];
#pragma unroll
            for (int v = 0; v < Q2_FFN_U2; v++) {
                // Group g: channels 8 g .. 8 g + 7, never across a page.
                const int g = gi + v * SB_WARPS;
                const sb_u32 page = g < g_end ? active[g >> 4] : 0xffffffffu;
                w[v] = make_uint2(0u, 0u);
                sw[v] = 0u;
                dw[v] = 0u;
                hv[v] = 0.f;
                if (page < (sb_u32)n_pages) {
                    const int c = (g << 3) + sub, ch = c & 127;
                    const sb_u8* base = pages + (long)page * page_bytes;
                    w[v] = __ldg((const uint2*)(base + qoff + (long)ch * (d >> 2)));
                    sw[v] = __ldg((const sb_u32*)(base + soff + (long)ch * (d >> 4)));
                    dw[v] = __ldg((const sb_u32*)(base + moff + (long)ch * (d >> 6)));
                    hv[v] = __ldcg(hbuf + c);
                }
            }
#pragma unroll
            for (int v = 0; v < Q2_FFN_U2; v++) {
                const float hd = hv[v] * sb_h2f((sb_u16)(dw[v] & 0xffffu));
                const float hm = hv[v] * sb_h2f((sb_u16)(dw[v] >> 16));
                float sc[4], mn[4];
                q2_nibbles(sw[v], sc, mn);
#pragma unroll
                for (int j = 0; j < 4; j++) mins[j] += hm * mn[j];
                q2_down_pair<0>(w[v].x, w[v].y, hd * sc[0], a);
                q2_down_pair<1>(w[v].x, w[v].y, hd * sc[1], a);
                q2_down_pair<2>(w[v].x, w[v].y, hd * sc[2], a);
                q2_down_pair<3>(w[v].x, w[v].y, hd * sc[3], a);
            }
        }
#pragma unroll
        for (int i = 0; i < 32; i++) a[i] -= mins[i >> 3];
        // Sum over the 8 channel lanes (lane bits 16, 8, 4): lane (sub, t8)
        // ends with a[4 sub .. 4 sub + 3] = outputs 32 (sub >> 1) + 8 t8 +
        // 4 (sub & 1) .. + 3.
        nv_reduce_scatter<16>(a, lane, 16);
        nv_reduce_scatter<8>(a, lane, 8);
        nv_reduce_scatter<4>(a, lane, 4);
#pragma unroll
        for (int i = 0; i < 4; i++) red[warp][32 * (sub >> 1) + 8 * t8 + 4 * (sub & 1) + i] = a[i];
        __syncthreads();
        sb_finish_item(red, &last_flag, chunk, k, K, d, accumulate, partials, counters, y);
    }
}
