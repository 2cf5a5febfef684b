// ===========================================================================
// The split decode attention on f16 tensor cores, for long rows of an f16
// or q8_0 cache, and the pruned decode attention over pages on the same
// kernel (after attention.cu, whose att_chunk, fa_word, fa_pack,
// mma_f16_k16 and KvQ8 it uses, and mmq.cu, whose cp.async helpers it
// uses).
//
// attend_split's scores and value sums are f32 FMAs fed from shared memory:
// at 32k keys they, not the cache reads, set its pace (an H100 read a 7B
// cache at about 0.7 TB/s). Here a block takes one row, one KV head and one
// split, and the G query heads of that KV head are the 16 rows of m16n8k16
// products (G <= 16, the rest zero), so each staged key and value serves the
// whole group at tensor-core rate:
//   S (16 x 8 keys)  = Q K^T : B fragments are K rows as stored ([key][d]);
//                      Q is split into f16 hi + lo parts (two products), so
//                      the scores keep about 22 bits of Q;
//   O (16 x 8 dims) += P V   : P reuses S's accumulator layout as A
//                      fragments, split into f16 hi + lo parts as Q is;
//                      V's B fragments pair two keys of one dimension, read
//                      as halves from shared memory.
// With both splits the products' inputs keep about 22 bits, near the f32
// arithmetic of attend_split (one f16 rounding of Q or P, as the prefill
// kernel does, gave 4e-5 to 5e-4 of error in the host check).
// Each warp streams its own steps of TM_KEYS keys (steps w, w + W, ... of
// the block's chunk, W = tm_warps(HD)) through a ring of S = tm_stages(HD)
// stages in shared memory filled by cp.async, so S - 1 steps of keys and
// values are in flight while it computes one; its running max, sum and output stay in
// registers, and the warps' results are merged in warp order at the end
// into the split's partial, as attend_split writes it (m, l, V sum[HD]),
// for attend_combine. RoPE and the store of the rows' new keys and values
// can be folded in (attend_split_mma's rope argument). Grid (rows,
// n_head_kv, n_split), block tm_warps(HD) warps, dynamic shared memory
// 2 * tm_warps(HD) * tm_stages(HD) * TM_STAGE_HALVES(HD) bytes, for q8_0
// tm_warps(HD) * tm_stages(HD) * TM_Q8_STAGE_BYTES(HD) (decode.rs:
// mma_smem, which also sizes the splits for MMA_SM_WARPS warps an SM).
// ===========================================================================

#define TM_KEYS 16
#define TM_MAX_G 16

// Warps of a block and stages of each warp's ring, by head size: of the
// shapes measured on an H100 at 32k keys (benches/gpu/attention_split.py),
// 4 warps of 3 stages read a 64-wide cache fastest and 2 warps of 4 stages
// a 128-wide one.
__device__ __forceinline__ constexpr int tm_warps(int hd) { return hd == 64 ? 4 : 2; }
__device__ __forceinline__ constexpr int tm_stages(int hd) { return hd == 64 ? 3 : 4; }

// Halves of one stage of a warp's ring: TM_KEYS keys, then TM_KEYS values,
// rows padded by 8 halves so that fragment loads hit distinct banks. A
// block's dynamic shared memory: tm_warps(HD) rings of tm_stages(HD) stages.
#define TM_STAGE_HALVES(HD) (2 * TM_KEYS * ((HD) + 8))

// A stage of a q8_0 cache, in bytes: TM_KEYS rows of the keys' codes, then
// of the values' (rows padded by 16 bytes), then TM_KEYS rows of HD / 32
// key scales and of value scales (f16).
#define TM_Q8_LD(HD) ((HD) + 16)
#define TM_Q8_STAGE_BYTES(HD) (2 * TM_KEYS * TM_Q8_LD(HD) + 2 * TM_KEYS * ((HD) / 16))

// Copies the keys and values k0 .. k0 + TM_KEYS - 1 (clamped to last: a
// key past it is masked, and its clamped row holds finite cache data) into
// a stage; every lane of the warp calls it.
template <int HD>
__device__ __forceinline__ void tm_issue(const u16* K, const u16* V, int k0, int last, u16* stage, int lane) {
    constexpr int UPR = HD / 8, LD = HD + 8;
    u16* vs = stage + TM_KEYS * LD;
#pragma unroll
    for (int c = 0; c < TM_KEYS * UPR / 32; c++) {
        const int i = lane + 32 * c, r = i / UPR, u = i % UPR;
        const long at = (long)min(k0 + r, last) * HD + 8 * u;
        cp_async16(stage + r * LD + 8 * u, K + at);
        cp_async16(vs + r * LD + 8 * u, V + at);
    }
}

// tm_issue for a q8_0 cache: the codes in 16-byte units, then each key's
// and value's row of scales (lanes 0 .. 15 the keys', 16 .. 31 the
// values'), rows clamped as tm_issue's.
template <int HD>
__device__ __forceinline__ void tm_issue_q8(KvQ8 K, KvQ8 V, int k0, int last, u8* stage, int lane) {
    constexpr int UPR = HD / 16, LD = TM_Q8_LD(HD), SB = HD / 16;
    u8* vs = stage + TM_KEYS * LD;
#pragma unroll
    for (int c = 0; c < TM_KEYS * UPR / 32; c++) {
        const int i = lane + 32 * c, r = i / UPR, u = i % UPR;
        const long at = (long)min(k0 + r, last) * HD + 16 * u;
        cp_async16(stage + r * LD + 16 * u, K.q + K.o + at);
        cp_async16(vs + r * LD + 16 * u, V.q + V.o + at);
    }
    const int r = lane & 15;
    const KvQ8 X = lane < 16 ? K : V;
    const u16* src = X.d + ((X.o + (long)min(k0 + r, last) * HD) >> 5);
    u8* dst = stage + 2 * TM_KEYS * LD + (lane < 16 ? 0 : TM_KEYS * SB) + r * SB;
    if constexpr (SB == 8)
        cp_async8(dst, src);
    else
        cp_async4(dst, src);
}

// f16x2 arithmetic, rounded once (no contraction).
__device__ __forceinline__ u32 h2_sub(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 h2_mul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// Two q8_0 codes (bytes 0 and 1 of c) times their scales (the halves of
// s, f16) as an f16x2 word: 0x6400 | (b ^ 0x80) is 1152 + b as f16, so the
// codes are exact before the one rounding of each product (the value an
// f16 cache would hold of the CPU's q * d).
__device__ __forceinline__ u32 q8_h2(u32 c, u32 s) {
    return h2_mul(h2_sub(__byte_perm(c ^ 0x8080u, 0x64u, 0x4140u), 0x64806480u), s);
}

// Element c of a query head x after RoPE at position pos, rope_store's
// arithmetic (the same bits).
template <int HD>
__device__ __forceinline__ float tm_rope_q(const float* x, int c, int pos, int neox, const float* rope) {
    constexpr int half = HD / 2;
    const int i = neox ? c % half : c / 2;
    const bool second = neox ? c >= half : (c & 1);
    float cs, sn, ra, rb;
    rope_cs(rope, pos, i, HD, &cs, &sn);
    rope_turn(x[neox ? i : 2 * i], x[neox ? i + half : 2 * i + 1], cs, sn, &ra, &rb);
    return second ? rb : ra;
}

// With rope non-null, RoPE and the KV store of the rows' new position are
// folded in, with rope_store's arithmetic (the same bits): the block whose
// split holds the position rotates k and stores k and v there before its
// copies read the cache (the launch is that slot's only writer and reader),
// and every block rotates its copy of q. k and v: the rows' unrotated keys
// and values ([rows][n_head_kv][HD]); neox the pairing.
//
// With PAGES (attend_pages_mma: the pruned decode attention) the block's
// keys are not a range of positions but its split of the pages the group's
// query heads chose (union_pages in attention_pruned.cu: the union in
// increasing order, and per page which heads chose it): split z takes pages
// [z c, (z + 1) c) of that list (c = ceil(count / n_split)), a step of
// TM_KEYS keys lies in one page (page % TM_KEYS == 0), and a head's row
// masks the keys of pages it did not choose and positions past its own.
// Batch row row_base + blockIdx.x (q, slots), launch row blockIdx.x (the
// union, part); rows the pruned attention skips (pruned_row) are left to
// the full attention, and a split with no key writes m = -inf, as
// attend_pages_part does. No RoPE (the pruned path stores with rope_store).
struct MmaPages {
    const int* upages;
    const unsigned* umask;
    const int* ucount;
    int max_pages, page, only_decode, n_rows, row_base;
};
template <int HD, bool PAGES = false, typename KP>
__device__ void attend_split_mma(const float* __restrict__ q, KP kc, KP vc, const int* __restrict__ slots,
                                 int n_head, int n_head_kv, int n_ctx, int chunk, float scale,
                                 float* __restrict__ part, const float* __restrict__ k, const float* __restrict__ v,
                                 int neox, const float* __restrict__ rope, u16* smem, MmaPages pg = MmaPages{}) {
    constexpr bool Q8 = kv_bytes(KP{}) == 1;
    constexpr int LD = HD + 8, WARPS = tm_warps(HD), STAGES = tm_stages(HD);
    // A stage in bytes, and the row stride of its codes (q8_0) in bytes.
    constexpr int STAGE_BYTES = Q8 ? TM_Q8_STAGE_BYTES(HD) : 2 * TM_STAGE_HALVES(HD), LDB = TM_Q8_LD(HD);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row = PAGES ? pg.row_base + blockIdx.x : blockIdx.x, kvh = blockIdx.y, split = blockIdx.z,
              n_split = gridDim.z;
    const int G = n_head / n_head_kv;
    const int seq = slots[2 * row], n = slots[2 * row + 1] + 1;
    // Without PAGES, keys [j0, j1) are positions; with, indices into the
    // split's pages (page e0 + key / page of the union).
    int j0, j1, e0 = 0;
    const int* upages = 0;
    const unsigned* umask = 0;
    if constexpr (PAGES) {
        if (!pruned_row(slots, row, pg.n_rows, pg.only_decode)) return;
        const long u = ((long)blockIdx.x * n_head_kv + kvh) * pg.max_pages;
        upages = pg.upages + u;
        umask = pg.umask + u;
        const int count = pg.ucount[blockIdx.x * n_head_kv + kvh], per = (count + n_split - 1) / n_split;
        e0 = min(count, split * per);
        j0 = 0;
        j1 = (min(count, e0 + per) - e0) * pg.page;
    } else {
        chunk = att_chunk(n, n_split, chunk);
        j0 = split * chunk;
        j1 = min(n, j0 + chunk);
        if (j0 >= j1) return;  // attend_combine skips splits past the position
    }
    // The first position of a step's keys (PAGES: in one page).
    auto step_pos = [&](int k0) { return PAGES ? upages[e0 + k0 / pg.page] * pg.page + k0 % pg.page : k0; };
    const int pos = n - 1;
    if (rope) {
        if (j1 == n && (int)threadIdx.x < HD / 2) {  // the split that holds pos
            const int i = threadIdx.x, ia = neox ? i : 2 * i, ib = neox ? i + HD / 2 : 2 * i + 1;
            const float* kh = k + ((long)row * n_head_kv + kvh) * HD;
            const float* vh = v + ((long)row * n_head_kv + kvh) * HD;
            float cs, sn, ra, rb, h0, h1;
            rope_cs(rope, pos, i, HD, &cs, &sn);
            rope_turn(kh[ia], kh[ib], cs, sn, &ra, &rb);
            const long at = (((long)seq * n_head_kv + kvh) * n_ctx + pos) * HD;
            kv_store_pair(kc, at, i, neox, HD / 2, ra, rb, &h0, &h1);
            kv_store_pair(vc, at, i, neox, HD / 2, vh[ia], vh[ib], &h0, &h1);
            __threadfence();  // in L2, where the block's cp.async copies read
        }
        __syncthreads();
    }
    // Q of the group's heads (rotated with rope), scaled, as hi and lo A
    // fragments.
    const float* qg = q + ((long)row * n_head + (long)kvh * G) * HD;
    u32 qh[HD / 16][4], ql[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            // A q8_0 key's B fragment takes 4 consecutive codes a lane (k
            // index 2t + {0, 1} is dimension 4t + {0, 1}, 2t + 8 + {0, 1}
            // is 4t + 2 + {0, 1}): Q's columns follow the same order.
            const int r = g + 8 * (i & 1), c = 16 * kk + (Q8 ? 4 * t + 2 * (i >> 1) : 2 * t + 8 * (i >> 1));
            float x0 = 0.f, x1 = 0.f;
            if (r < G) {
                const float* x = qg + r * HD;
                x0 = (rope ? tm_rope_q<HD>(x, c, pos, neox, rope) : x[c]) * scale;
                x1 = (rope ? tm_rope_q<HD>(x, c + 1, pos, neox, rope) : x[c + 1]) * scale;
            }
            const u16 h0 = f2h(x0), h1 = f2h(x1);
            qh[kk][i] = (u32)h0 | ((u32)h1 << 16);
            ql[kk][i] = fa_pack(x0 - h2f(h0), x1 - h2f(h1));
        }
    const KP K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * HD;
    const KP V = vc + ((long)seq * n_head_kv + kvh) * n_ctx * HD;
    const int steps = (j1 - j0 + TM_KEYS - 1) / TM_KEYS;
    const int mine = steps > warp ? (steps - warp + WARPS - 1) / WARPS : 0;
    u8* ring = (u8*)smem + warp * STAGES * STAGE_BYTES;
    // With PAGES a step's positions past the row's are clamped to its last.
    const int last = PAGES ? n - 1 : j1 - 1;
    auto issue = [&](int p, u8* stage) {
        const int k0 = step_pos(j0 + (warp + p * WARPS) * TM_KEYS);
        if constexpr (Q8)
            tm_issue_q8<HD>(K, V, k0, last, stage, lane);
        else
            tm_issue<HD>(K, V, k0, last, (u16*)stage, lane);
    };
#pragma unroll
    for (int p = 0; p < STAGES - 1; p++) {
        if (p < mine) issue(p, ring + p * STAGE_BYTES);
        cp_async_commit();
    }
    float o[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[j][e] = 0.f;
    float m[2] = {-MIRAGE_INF, -MIRAGE_INF}, l[2] = {0.f, 0.f};
    for (int i = 0; i < mine; i++) {
        cp_async_wait<STAGES - 2>();  // step i has landed
        __syncwarp();
        {
            // Refill the stage step i - 1 used (read before the __syncwarp
            // that ended it).
            const int p = i + STAGES - 1;
            if (p < mine) issue(p, ring + (p % STAGES) * STAGE_BYTES);
            cp_async_commit();
        }
        const u8* stage = ring + (i % STAGES) * STAGE_BYTES;
        const u16* ks = (const u16*)stage;
        const u16* vs = ks + TM_KEYS * LD;
        // q8_0: the codes' rows and the scales' rows (HD / 32 a row).
        const u8* kq = stage;
        const u8* vq = stage + TM_KEYS * LDB;
        const u16* kds = (const u16*)(stage + 2 * TM_KEYS * LDB);
        const u16* vds = kds + TM_KEYS * (HD / 32);
        const int kv0 = j0 + (warp + i * WARPS) * TM_KEYS, k0 = step_pos(kv0);
        // PAGES: the heads (rows) that chose this step's page.
        const unsigned heads = PAGES ? umask[e0 + kv0 / pg.page] : 0u;
        float s[2][4];
#pragma unroll
        for (int j = 0; j < 2; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[j][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                u32 b[2];
                if constexpr (Q8) {
                    const u32 c = *(const u32*)(kq + (8 * j + g) * LDB + 16 * kk + 4 * t);
                    const u32 d = kds[(8 * j + g) * (HD / 32) + kk / 2];
                    const u32 d2 = d | (d << 16);
                    b[0] = q8_h2(c, d2);
                    b[1] = q8_h2(c >> 16, d2);
                } else {
                    const u16* kr = ks + (8 * j + g) * LD + 16 * kk + 2 * t;
                    b[0] = fa_word(kr);
                    b[1] = fa_word(kr + 8);
                }
                mma_f16_k16(s[j], qh[kk], b);
                mma_f16_k16(s[j], ql[kk], b);
            }
        }
        // Online softmax of rows g (e < 2) and g + 8: keys past the chunk
        // masked, the step's max over the quad, the rounded weights.
        float mx[2] = {-MIRAGE_INF, -MIRAGE_INF};
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if constexpr (PAGES) {
                    if (k0 + 8 * j + 2 * t + (e & 1) >= n || !((heads >> (g + 8 * (e >> 1))) & 1u))
                        s[j][e] = -MIRAGE_INF;
                } else if (k0 + 8 * j + 2 * t + (e & 1) >= j1) {
                    s[j][e] = -MIRAGE_INF;
                }
                mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
            }
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float nm = fmaxf(m[h], mx[h]);  // finite without PAGES: key k0 is before j1
            // 0 on the first step (m = -inf); with PAGES a row may have seen
            // no key yet (nm = -inf).
            alpha[h] = PAGES && nm == -MIRAGE_INF ? 1.f : expf(m[h] - nm);
            m[h] = nm;
            l[h] *= alpha[h];
        }
        u32 ph[4], pl[4];
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                float p0 = expf(s[j][2 * hh] - m[hh]), p1 = expf(s[j][2 * hh + 1] - m[hh]);
                if (PAGES && m[hh] == -MIRAGE_INF) p0 = p1 = 0.f;  // every key so far masked
                const u16 h0 = f2h(p0), h1 = f2h(p1);
                l[hh] += p0 + p1;
                ph[2 * j + hh] = (u32)h0 | ((u32)h1 << 16);
                pl[2 * j + hh] = fa_pack(p0 - h2f(h0), p1 - h2f(h1));
            }
#pragma unroll
        for (int jd = 0; jd < HD / 8; jd++) {
#pragma unroll
            for (int e = 0; e < 4; e++) o[jd][e] *= alpha[e >> 1];
            u32 b[2];
            if constexpr (Q8) {
                // Keys 2t, 2t + 1 and 2t + 8, 2t + 9 of dimension 8 jd + g.
                const u8* vr = vq + 2 * t * LDB + 8 * jd + g;
                const u16* dr = vds + 2 * t * (HD / 32) + jd / 4;
                b[0] = q8_h2((u32)vr[0] | ((u32)vr[LDB] << 8), (u32)dr[0] | ((u32)dr[HD / 32] << 16));
                b[1] = q8_h2((u32)vr[8 * LDB] | ((u32)vr[9 * LDB] << 8),
                             (u32)dr[8 * (HD / 32)] | ((u32)dr[9 * (HD / 32)] << 16));
            } else {
                const u16* vr = vs + 2 * t * LD + 8 * jd + g;
                b[0] = (u32)vr[0] | ((u32)vr[LD] << 16);
                b[1] = (u32)vr[8 * LD] | ((u32)vr[9 * LD] << 16);
            }
            mma_f16_k16(o[jd], ph, b);
            mma_f16_k16(o[jd], pl, b);
        }
        __syncwarp();  // the stage is read before the next step refills it
    }
    cp_async_wait<0>();  // the trailing groups are empty
    // The warps' results, merged in warp order: per row the block's max, then
    // each warp's sum and output scaled to it. The rings are free now.
    __syncthreads();
    float* red = (float*)smem;  // [WARPS][16][HD]
    float* wm = red + WARPS * 16 * HD;
    float* wl = wm + WARPS * 16;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        if (t == 0) {
            wm[warp * 16 + g + 8 * h] = m[h];
            wl[warp * 16 + g + 8 * h] = l[h];
        }
    }
#pragma unroll
    for (int jd = 0; jd < HD / 8; jd++)
#pragma unroll
        for (int e = 0; e < 4; e++) red[(warp * 16 + g + 8 * (e >> 1)) * HD + 8 * jd + 2 * t + (e & 1)] = o[jd][e];
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const int r = i / HD, d = i % HD;
        float M = -MIRAGE_INF;
        for (int w = 0; w < WARPS; w++) M = fmaxf(M, wm[w * 16 + r]);
        float L = 0.f, a = 0.f;
        for (int w = 0; w < WARPS; w++) {
            const float mw = wm[w * 16 + r];
            const float f = mw == -MIRAGE_INF ? 0.f : expf(mw - M);  // a warp with no step
            L += f * wl[w * 16 + r];
            a += f * red[(w * 16 + r) * HD + d];
        }
        float* P = part + (((long)blockIdx.x * n_head + (long)kvh * G + r) * n_split + split) * (HD + 2);
        P[2 + d] = a;
        if (d == 0) {
            P[0] = M;
            P[1] = L;
        }
    }
}

// Per cache type (f16, q8_0: attention.cu's KV_SCALES, KV_CACHE) and head size.
#define SPLIT_MMA_INSTANCE(NAME, KV, HD)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * tm_warps(HD))                                                 \
        attend_split_mma_##NAME##_d##HD(const float* q, KV* kc, KV* vc, const int* slots, int n_head,              \
                                        int n_head_kv, int n_ctx, int chunk, float scale, float* part,              \
                                        const float* k, const float* v, int neox,                                   \
                                        const float* rope KV_SCALES_##NAME) {                                       \
        extern __shared__ __align__(16) u16 tm_smem[];                                                              \
        PDL_ENTRY();                                                                                                \
        attend_split_mma<HD>(q, KV_CACHE_##NAME(kc, kd), KV_CACHE_##NAME(vc, vd), slots, n_head, n_head_kv, n_ctx,  \
                             chunk, scale, part, k, v, neox, rope, tm_smem);                                        \
    }
// The pruned decode attention over the pages union_pages listed: grid
// (rows, n_head_kv, n_split), the block of attend_split_mma.
#define PAGES_MMA_INSTANCE(NAME, KV, HD)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * tm_warps(HD))                                                 \
        attend_pages_mma_##NAME##_d##HD(const float* q, KV* kc, KV* vc, const int* slots, const int* upages,        \
                                        const unsigned* umask, const int* ucount, int n_head, int n_head_kv,       \
                                        int n_ctx, int max_pages, int page, int only_decode, int n_rows,            \
                                        int row_base, float scale, float* part KV_SCALES_##NAME) {                  \
        extern __shared__ __align__(16) u16 tm_smem[];                                                              \
        PDL_ENTRY();                                                                                                \
        attend_split_mma<HD, true>(                                                                                 \
            q, KV_CACHE_##NAME(kc, kd), KV_CACHE_##NAME(vc, vd), slots, n_head, n_head_kv, n_ctx, 0, scale, part,   \
            (const float*)0, (const float*)0, 0, (const float*)0, tm_smem,                                          \
            MmaPages{upages, umask, ucount, max_pages, page, only_decode, n_rows, row_base});                        \
    }
PAGES_MMA_INSTANCE(f16, u16, 64)
PAGES_MMA_INSTANCE(f16, u16, 128)
PAGES_MMA_INSTANCE(q8_0, i8, 64)
PAGES_MMA_INSTANCE(q8_0, i8, 128)

SPLIT_MMA_INSTANCE(f16, u16, 64)
SPLIT_MMA_INSTANCE(f16, u16, 128)
SPLIT_MMA_INSTANCE(q8_0, i8, 64)
SPLIT_MMA_INSTANCE(q8_0, i8, 128)
