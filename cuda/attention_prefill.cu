// ===========================================================================
// The prefill attention of the dense module on f16 tensor cores (after
// attention.cu, whose KV-cache access, KvQ8, f16 mma helpers and KV_SCALES /
// KV_CACHE it uses).
// ===========================================================================

// Causal attention of a prefill batch on f16 tensor cores, FlashAttention-2
// style. The batch rows are consecutive positions of one sequence (the host
// checks). A block takes one KV head and FA_ROWS rows of the flattened
// (position, query head of that KV head's group) pairs, position-major, so
// each key and value tile it stages serves every query head of the group.
// Warp w owns rows 16 w .. 16 w + 15: Q (times scale * log2 e, in f16) stays
// in registers as mma A fragments; per tile of FA_KEYS keys S = Q K^T is 16 x
// FA_KEYS f32 accumulators (m16n8k16), masked past each row's position, then
// the online softmax (base 2; running max and sum per row, the sum kept per
// lane until the end), and P (f16, reusing S's accumulator layout as A
// fragments) times V into O, 16 x HD f32 accumulators. K is staged [key][d]
// and V transposed [d][key] in shared memory, rows padded by 8 halves so the
// fragment loads hit 32 distinct banks. Keys past the block's last position
// are staged as zeros and masked. Grid (ceil(n * group / FA_ROWS),
// n_head_kv, splits), block FA_WARPS warps. HD is 64 or 128.
// Long contexts split the keys (so that a batch of few rows still fills the
// device): block z takes keys [z chunk, (z + 1) chunk) (chunk a multiple of
// FA_KEYS) and writes, per row, its running max (base 2), sum and unscaled
// output to part (row (z, position, head), HD + 2 floats: m, l, o), which
// attend_prefill_combine merges; with part null (one split) the block
// writes the normalized output itself.
#define FA_ROWS 64
#define FA_KEYS 64
#define FA_WARPS 4
#define FA_LOG2E 1.4426950408889634f

// Keys and values k0 .. k0 + FA_KEYS - 1 into ks ([key][d], row stride HD +
// 8) and vt ([d][key], row stride FA_KEYS + 8) as f16; keys past `last` as
// zeros. An f16 cache is copied 8 halves at a time.
template <int HD>
__device__ __forceinline__ void fa_stage(const u16* __restrict__ K, const u16* __restrict__ V, u16* ks, u16* vt, int k0,
                                         int last) {
    for (int i = threadIdx.x; i < FA_KEYS * HD / 8; i += FA_WARPS * 32) {
        int kk = i / (HD / 8), d = 8 * (i % (HD / 8));
        bool live = k0 + kk <= last;
        long at = (long)(k0 + kk) * HD + d;
        uint4 kv = live ? __ldg((const uint4*)(K + at)) : make_uint4(0, 0, 0, 0);
        uint4 vv = live ? __ldg((const uint4*)(V + at)) : make_uint4(0, 0, 0, 0);
        *(uint4*)(ks + kk * (HD + 8) + d) = kv;
        u32 w[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
        for (int e = 0; e < 8; e++) vt[(d + e) * (FA_KEYS + 8) + kk] = (u16)(w[e >> 1] >> (16 * (e & 1)));
    }
}
// An f32 or q8_0 cache is rounded to f16 an element at a time.
template <int HD, typename KP>
__device__ __forceinline__ void fa_stage(KP K, KP V, u16* ks, u16* vt, int k0, int last) {
    for (int i = threadIdx.x; i < FA_KEYS * HD; i += FA_WARPS * 32) {
        int kk = i / HD, d = i % HD;
        bool live = k0 + kk <= last;
        long at = (long)(k0 + kk) * HD + d;
        ks[kk * (HD + 8) + d] = live ? f2h(kv_load(K, at)) : (u16)0;
        vt[d * (FA_KEYS + 8) + kk] = live ? f2h(kv_load(V, at)) : (u16)0;
    }
}

template <int HD, typename KP>
__device__ void attend_prefill(const float* __restrict__ q, KP kc, KP vc,
                               const int* __restrict__ slots, int n, int n_head, int n_head_kv, int n_ctx, float scale,
                               int chunk, float* __restrict__ part, float* __restrict__ out) {
    constexpr int LDK = HD + 8, LDV = FA_KEYS + 8;
    __shared__ __align__(16) u16 ks[FA_KEYS * LDK];  // Q's staging first, then each key tile
    __shared__ __align__(16) u16 vt[HD * LDV];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int group = n_head / n_head_kv, kvh = blockIdx.y, total = n * group;
    const int f0 = blockIdx.x * FA_ROWS;
    const int seq = slots[0], pos0 = slots[1];
    // The block's and this warp's last positions (rows past the batch: -1).
    const int last = pos0 + (min(f0 + FA_ROWS, total) - 1) / group;
    const int wf = f0 + 16 * warp;
    const int wlast = wf < total ? pos0 + (min(wf + 16, total) - 1) / group : -1;
    int rpos[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int f = wf + g + 8 * h;
        rpos[h] = f < total ? pos0 + f / group : -1;
    }
    // Q rows of the block, scaled, to f16 in ks, then to A fragments.
    for (int i = threadIdx.x; i < FA_ROWS * HD; i += FA_WARPS * 32) {
        int r = i / HD, d = i % HD, f = f0 + r;
        float v = 0.f;
        if (f < total) v = q[((long)(f / group) * n_head + kvh * group + f % group) * HD + d] * (scale * FA_LOG2E);
        ks[r * LDK + d] = f2h(v);
    }
    __syncthreads();
    u32 qa[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        const u16* r0 = ks + (16 * warp + g) * LDK + 16 * kk + 2 * t;
        qa[kk][0] = fa_word(r0);
        qa[kk][1] = fa_word(r0 + 8 * LDK);
        qa[kk][2] = fa_word(r0 + 8);
        qa[kk][3] = fa_word(r0 + 8 * LDK + 8);
    }
    float o[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[j][e] = 0.f;
    float m[2] = {-MIRAGE_INF, -MIRAGE_INF}, l[2] = {0.f, 0.f};
    const KP K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * HD;
    const KP V = vc + ((long)seq * n_head_kv + kvh) * n_ctx * HD;
    const int kbeg = blockIdx.z * chunk, kend = min(kbeg + chunk, last + 1);
    for (int k0 = kbeg; k0 < kend; k0 += FA_KEYS) {
        __syncthreads();  // Q's fragments are read, or the previous tile is consumed
        fa_stage<HD>(K, V, ks, vt, k0, last);
        __syncthreads();
        if (k0 > wlast) continue;  // every row of this warp is before the tile
        float s[FA_KEYS / 8][4];
#pragma unroll
        for (int j = 0; j < FA_KEYS / 8; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[j][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                const u16* kr = ks + (8 * j + g) * LDK + 16 * kk + 2 * t;
                u32 b[2] = {fa_word(kr), fa_word(kr + 8)};
                mma_f16_k16(s[j], qa[kk], b);
            }
        }
        float mx[2] = {-MIRAGE_INF, -MIRAGE_INF};
#pragma unroll
        for (int j = 0; j < FA_KEYS / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = k0 + 8 * j + 2 * t + (e & 1);
                if (key > rpos[e >> 1]) s[j][e] = -MIRAGE_INF;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
            }
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            float nm = fmaxf(m[h], mx[h]);
            // nm stays -inf only for a row with no key yet (or a padding row).
            alpha[h] = nm == -MIRAGE_INF ? 1.f : exp2f(m[h] - nm);
            m[h] = nm;
            l[h] *= alpha[h];
        }
#pragma unroll
        for (int j = 0; j < FA_KEYS / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = s[j][e] == -MIRAGE_INF ? 0.f : exp2f(s[j][e] - m[e >> 1]);
                s[j][e] = p;
                l[e >> 1] += p;
            }
#pragma unroll
        for (int j = 0; j < HD / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[j][e] *= alpha[e >> 1];
#pragma unroll
        for (int kk = 0; kk < FA_KEYS / 16; kk++) {
            u32 pa[4] = {fa_pack(s[2 * kk][0], s[2 * kk][1]), fa_pack(s[2 * kk][2], s[2 * kk][3]),
                         fa_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]), fa_pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int j = 0; j < HD / 8; j++) {
                const u16* vr = vt + (8 * j + g) * LDV + 16 * kk + 2 * t;
                u32 b[2] = {fa_word(vr), fa_word(vr + 8)};
                mma_f16_k16(o[j], pa, b);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        int f = wf + g + 8 * h;
        if (f >= total) continue;
        long row = (long)(f / group) * n_head + kvh * group + f % group;
        float* orow;
        float inv;
        if (part != 0) {
            float* pr = part + ((long)blockIdx.z * n * n_head + row) * (HD + 2);
            if (t == 0) {
                pr[0] = m[h];
                pr[1] = l[h];
            }
            orow = pr + 2;
            inv = 1.f;
        } else {
            orow = out + row * HD;
            inv = 1.f / l[h];
        }
#pragma unroll
        for (int j = 0; j < HD / 8; j++) {
            orow[8 * j + 2 * t] = o[j][2 * h] * inv;
            orow[8 * j + 2 * t + 1] = o[j][2 * h + 1] * inv;
        }
    }
}

// Output element d of row `row` (position x head) of a split prefill
// attention: the splits' partials (attend_prefill's part, n_rows rows per
// split) weighted by 2^(m_z - max m); a split that saw no key of the row
// (m = -inf) weighs 0. Key 0 is in the first split, so max m is finite.
__device__ __forceinline__ float attend_prefill_merge(const float* __restrict__ part, long row, long n_rows, int hd,
                                                      int n_split, int d) {
    float mx = -MIRAGE_INF;
    for (int z = 0; z < n_split; z++) mx = fmaxf(mx, part[(z * n_rows + row) * (hd + 2)]);
    float L = 0.f, a = 0.f;
    for (int z = 0; z < n_split; z++) {
        const float* pr = part + (z * n_rows + row) * (hd + 2);
        if (pr[0] == -MIRAGE_INF) continue;
        float w = exp2f(pr[0] - mx);
        L += w * pr[1];
        a += w * pr[2 + d];
    }
    return a / L;
}

#define PREFILL_INSTANCE(NAME, KV)                                                                                  \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)                                                    \
        attend_prefill_##NAME##_d64(const float* q, const KV* kc, const KV* vc, const int* slots, int n, int n_head, \
                                    int n_head_kv, int n_ctx, float scale, int chunk, float* part,                  \
                                    float* out KV_SCALES_##NAME) {                                                  \
        PDL_ENTRY();                                                                                                \
        attend_prefill<64>(q, KV_CACHE_##NAME(kc, kd), KV_CACHE_##NAME(vc, vd), slots, n, n_head, n_head_kv,       \
                           n_ctx, scale, chunk, part, out);                                                         \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)                                                    \
        attend_prefill_##NAME##_d128(const float* q, const KV* kc, const KV* vc, const int* slots, int n,          \
                                     int n_head, int n_head_kv, int n_ctx, float scale, int chunk, float* part,     \
                                     float* out KV_SCALES_##NAME) {                                                 \
        PDL_ENTRY();                                                                                                \
        attend_prefill<128>(q, KV_CACHE_##NAME(kc, kd), KV_CACHE_##NAME(vc, vd), slots, n, n_head, n_head_kv,      \
                            n_ctx, scale, chunk, part, out);                                                        \
    }

PREFILL_INSTANCE(f32, float)
PREFILL_INSTANCE(f16, u16)
PREFILL_INSTANCE(q8_0, i8)

// out[row, :] for the rows (position x head) of a split prefill attention;
// grid (n * n_head), block 128.
extern "C" __global__ void attend_prefill_combine(const float* part, long n_rows, int hd, int n_split, float* out) {
    PDL_ENTRY();
    long row = blockIdx.x;
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        out[row * hd + d] = attend_prefill_merge(part, row, n_rows, hd, n_split, d);
}
