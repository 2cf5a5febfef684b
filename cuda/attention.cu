// Decode attention of the dense module over the KV cache: RoPE and the
// cache store, and the split-K decode attention (the query heads of a KV
// group together, RoPE and the store folded in where it can) with its
// combine. The tiled prefill attention is attention_prefill.cu's.

// KV-cache element access: f32 or f16 (stored as raw u16 bits), through
// the read-only path (__ldg: no kernel that reads the cache element by
// element writes it).
__device__ __forceinline__ float kv_load(const float* p, long i) { return __ldg(p + i); }
__device__ __forceinline__ float kv_load(const u16* p, long i) { return h2f(__ldg(p + i)); }
__device__ __forceinline__ void kv_store(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void kv_store(u16* p, long i, float v) { p[i] = f2h(v); }
// What kv_load returns after kv_store(p, i, v): v as the cache holds it.
__device__ __forceinline__ float kv_round(const float*, float v) { return v; }
__device__ __forceinline__ float kv_round(const u16*, float v) { return h2f(f2h(v)); }

// A q8_0 cache (kernels named *_q8_0): the codes as signed bytes in the
// layout of the other caches ([n_seq, n_head_kv, n_ctx, head_dim], one byte
// an element) and one f16 scale per 32 codes in a second array ([n_seq,
// n_head_kv, n_ctx, head_dim / 32]): element e is q[e] * d[e / 32], ggml's
// q8_0 blocks as the CPU's cache holds them. A KvQ8 stands for element o of
// such a cache and adds offsets as a pointer does, so the kernels' templates
// take it where they take a pointer to an f32 or f16 cache.
struct KvQ8 {
    i8* q;
    u16* d;
    long o;
};
__device__ __forceinline__ KvQ8 operator+(KvQ8 p, long i) { return KvQ8{p.q, p.d, p.o + i}; }
__device__ __forceinline__ float kv_load(KvQ8 p, long i) {
    const long e = p.o + i;
    return (float)__ldg(p.q + e) * h2f(__ldg(p.d + (e >> 5)));
}
// Bytes an element takes in the cache's main array (T: float or u16 for an
// f32 or f16 cache).
__device__ __forceinline__ constexpr int kv_bytes(KvQ8) { return 1; }
template <typename T> __device__ __forceinline__ constexpr int kv_bytes(const T*) { return (int)sizeof(T); }
// Asks L2 for elements [0, n) at p (and their scales).
template <typename T> __device__ __forceinline__ void kv_prefetch(const T* p, long n) {
    l2_prefetch_block(p, (long)sizeof(T) * n);
}
__device__ __forceinline__ void kv_prefetch(KvQ8 p, long n) {
    l2_prefetch_block(p.q + p.o, n);
    l2_prefetch_block(p.d + (p.o >> 5), n / 16);
}

// Stores a rotated pair of a head row into the cache: thread i of threads
// 0 .. half - 1 (whole warps, all of them calling) holds elements ia and ib
// (neox: i and i + half, else 2i and 2i + 1) of the row that starts at
// element `at`, values a and b (only if `store`); *ha and *hb get the
// values the cache then holds (kv_load's). A q8_0 row is quantized as the
// CPU's quantize_q8_0 (d = max|x| / 127, q = round(x * (1 / d)) with ties
// away from zero, d stored as f16): with neox the 32 lanes of a warp hold one block of each half, else
// 16 lanes hold one block (head sizes of 64 and more).
template <typename T>
__device__ __forceinline__ void kv_store_pair(T* p, long at, int i, int neox, int half, float a, float b, float* ha,
                                              float* hb, bool store = true) {
    const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    if (store) {
        kv_store(p, at + ia, a);
        kv_store(p, at + ib, b);
    }
    *ha = kv_round(p, a);
    *hb = kv_round(p, b);
}
__device__ __forceinline__ i8 q8_code(float x, float inv) { return (i8)roundf(x * inv); }
__device__ __forceinline__ void kv_store_pair(KvQ8 p, long at, int i, int neox, int half, float a, float b, float* ha,
                                              float* hb, bool store = true) {
    float ma, mb;
    if (neox) {
        ma = warp_max(fabsf(a));
        mb = warp_max(fabsf(b));
    } else {
        ma = fmaxf(fabsf(a), fabsf(b));
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) ma = fmaxf(ma, __shfl_xor_sync(0xffffffffu, ma, o));
        mb = ma;
    }
    const float da = ma / 127.f, db = mb / 127.f;
    const i8 qa = q8_code(a, da != 0.f ? 1.f / da : 0.f), qb = q8_code(b, db != 0.f ? 1.f / db : 0.f);
    const u16 ha16 = f2h(da), hb16 = f2h(db);
    const long e = p.o + at;
    const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    if (store) {
        p.q[e + ia] = qa;
        p.q[e + ib] = qb;
    }
    if (store && (neox ? (i & 31) == 0 : (i & 15) == 0)) {
        p.d[(e + ia) >> 5] = ha16;
        if (neox) p.d[(e + ib) >> 5] = hb16;
    }
    *ha = (float)qa * h2f(ha16);
    *hb = (float)qb * h2f(hb16);
}

// RoPE of pair i of a head (elements ia, ib: neox halves or adjacent) at
// position pos, rope_store's arithmetic (shared with attend_rope, so both
// give the same bits).
__device__ __forceinline__ void rope_angle(int i, int pos, int head_dim, float freq_base, float* c, float* s) {
    // The angle in double, as the CPU reference builds its tables.
    double theta = (double)pos * pow((double)freq_base, -2.0 * (double)i / (double)head_dim);
    *c = (float)cos(theta);
    *s = (float)sin(theta);
}
__device__ __forceinline__ void rope_turn(float a, float b, float c, float s, float* ra, float* rb) {
    // No FMA contraction: a * s + b * c may contract into either fma(a, s,
    // b * c) or fma(b, c, a * s), and NVRTC picked differently for the same
    // source inlined into rope_store and into attend_rope (measured: the
    // folded decode's logits differed on the H200). Rounded products, then
    // the sum: one result wherever this is inlined.
    *ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    *rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}
// The RoPE table of a KV cache (rope_table): per position and pair i, the
// cosine and sine rope_angle gives, so the decode and prefill kernels read
// the same bits with one load instead of the double-precision chain (pow,
// cos, sin: several microseconds of latency per launch).
__device__ __forceinline__ void rope_cs(const float* __restrict__ rope, int pos, int i, int head_dim, float* c,
                                        float* s) {
    const float2 t = ((const float2*)rope)[(long)pos * (head_dim >> 1) + i];
    *c = t.x;
    *s = t.y;
}

// rope[pos, i] = (cos, sin) of pair i at position pos, for positions
// 0 .. n_pos - 1. Grid ceil(n_pos * head_dim / 2 / 256), block 256.
__device__ void rope_table_body(float* __restrict__ rope, int n_pos, int head_dim, float freq_base) {
    const long half = head_dim >> 1, e = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long)n_pos * half) return;
    float c, s;
    rope_angle((int)(e % half), (int)(e / half), head_dim, freq_base, &c, &s);
    ((float2*)rope)[e] = make_float2(c, s);
}

// Optional per-head RMSNorm (qwen3) and RoPE of every q and k head of every
// row, then the k and v heads are stored into the cache at the row's slot.
// slots[2 * row] = seq, slots[2 * row + 1] = pos (read from device memory, so
// a recorded step replays for any position). Grid (rows, n_head +
// n_head_kv), block head_dim / 2 (one thread per rotated pair).
// Cache layout per layer: [n_seq, n_head_kv, n_ctx, head_dim] of KV.
template <typename KP>
__device__ void rope_store(float* q, float* k, const float* __restrict__ v, const int* __restrict__ slots, int n_head,
                           int n_head_kv, int head_dim, int neox, const float* __restrict__ rope, const float* qn,
                           const float* kn, float norm_eps, KP kc, KP vc, int n_ctx) {
    __shared__ float s32[32];
    int row = blockIdx.x, hh = blockIdx.y, i = threadIdx.x, half = head_dim >> 1;
    int seq = slots[2 * row], pos = slots[2 * row + 1];
    bool is_q = hh < n_head;
    int head = is_q ? hh : hh - n_head;
    float* x = is_q ? q + ((long)row * n_head + head) * head_dim : k + ((long)row * n_head_kv + head) * head_dim;
    int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    float a = x[ia], b = x[ib];
    const float* nw = is_q ? qn : kn;
    if (nw != 0) {
        float ss = block_sum(a * a + b * b, s32);
        float scale = rsqrtf(ss / (float)head_dim + norm_eps);
        a = a * scale * nw[ia];
        b = b * scale * nw[ib];
    }
    float c, s, ra, rb;
    rope_cs(rope, pos, i, head_dim, &c, &s);
    rope_turn(a, b, c, s, &ra, &rb);
    x[ia] = ra;
    x[ib] = rb;
    if (!is_q) {
        long at = (((long)seq * n_head_kv + head) * n_ctx + pos) * head_dim;
        const float* vr = v + ((long)row * n_head_kv + head) * head_dim;
        float h0, h1;
        kv_store_pair(kc, at, i, neox, half, ra, rb, &h0, &h1);
        kv_store_pair(vc, at, i, neox, half, vr[ia], vr[ib], &h0, &h1);
    }
}

// Decode attention: split-K ("flash-decoding") over the cache, in two
// launches. attend_split_* (grid (rows, n_head_kv * hg, n_split), block
// AS_THREADS): block (row, y, s) takes the query heads h0 .. h0 + gb of KV
// head kvh = y / hg (hpb heads of a GQA group per block, at most AS_MAX_G:
// hg = ceil(G / hpb) blocks per group, G = n_head / n_head_kv), so every key
// and value of the split is read once for all of them, over positions
// [s * c, min((s + 1) * c, n)) of the row's sequence (n = pos + 1,
// c = att_chunk(n, n_split, chunk)), with an online softmax in tiles of
// AS_TILE keys, and writes each head's running max m, sum l and
// unnormalised V sum to part[((row * n_head + head) * n_split + s) *
// (head_dim + 2) + {0, 1, 2..}]. attend_combine (one block per (row, head))
// merges the splits. The grids depend only on the batch and the cache size,
// never on the position (read from device memory): a recorded step replays
// at any length, and the host sizes n_split so that a long context fills
// the device (several blocks per SM) while a short one still takes one
// split per ATT_MIN_KEYS keys.
// Short contexts (every row's keys fit one split) take one launch instead:
// one split, one or a few heads per block (hpb) for more blocks, each
// block writing its heads' final output (the `out` argument), no combine.
// Pruned attention (attention_pruned.cu) uses ATT_THREADS / ATT_TILE and the
// partial helpers below, and the same combine.
#define ATT_THREADS 256
#define ATT_TILE 64
// Keys of a row's split blocks, chosen on the device from the row's length
// n (the grid is fixed for graph replay; n comes from `slots`): the least
// chunk that covers n with the launch's n_split blocks, at least
// ATT_MIN_KEYS and at most the host's chunk = ceil(n_ctx / n_split). A short
// sequence takes few splits of at least ATT_MIN_KEYS keys (smaller ones cost
// more in launches' idle blocks and in the combine than they add in loads in
// flight) and a long one spreads evenly over all of them. attend_split and attend_combine both use
// this one function, so they agree on the splits of each row.
#define ATT_MIN_KEYS 64
__device__ __forceinline__ int att_chunk(int n, int n_split, int chunk) {
    return min(chunk, max(ATT_MIN_KEYS, (n + n_split - 1) / n_split));
}

// The online softmax's step to a tile whose running max is nm: its cnt
// scores in sc become exp(s - nm) and the running max m, weight sum l and V
// sum acc are rescaled by exp(m - nm) (0 on the first tile, m = -inf).
// Every thread of the block calls it, after reading the raw scores.
__device__ __forceinline__ void att_rescale(float* sc, int cnt, float nm, float& m, float& l, float& acc) {
    const float f = expf(m - nm);
    __syncthreads();  // every thread has read the raw scores
    if (threadIdx.x < cnt) sc[threadIdx.x] = expf(sc[threadIdx.x] - nm);
    __syncthreads();
    acc *= f;
    l *= f;
    m = nm;
}

// The end of a split's attention: group g's V sum `acc` (element d) and
// weight sum `l` added over the groups, in group order, into the split's
// partial P = (m, l, V sum[head_dim]). red: groups * head_dim floats and
// lred: groups floats of shared memory; every thread of the block calls it.
__device__ __forceinline__ void att_store_partial(float acc, float l, float m, int g, int groups, int d,
                                                  int head_dim, float* red, float* lred, float* P) {
    if (g < groups) {
        red[g * head_dim + d] = acc;
        if (d == 0) lred[g] = l;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < head_dim; e += blockDim.x) {
        float a = 0.f;
        for (int k = 0; k < groups; k++) a += red[k * head_dim + e];
        P[2 + e] = a;
    }
    if (threadIdx.x == 0) {
        float ls = 0.f;
        for (int k = 0; k < groups; k++) ls += lred[k];
        P[0] = m;
        P[1] = ls;
    }
}

// attend_split: threads per block, keys per tile, query heads per block,
// lanes that share one key's scores (each loads 16-byte units of the key:
// 8 lanes read 128 contiguous bytes), and the largest number of splits.
#define AS_THREADS 128
#define AS_TILE 128
#define AS_MAX_G 8
#define AS_LPK 8
#define AS_MAX_SPLITS 1024

// The 16-byte unit of the cache's main array at element e of p (e a
// multiple of its elements per unit).
__device__ __forceinline__ uint4 kv_unit(KvQ8 p, long e) { return *(const uint4*)(p.q + p.o + e); }
template <typename T> __device__ __forceinline__ uint4 kv_unit(const T* p, long e) { return *(const uint4*)(p + e); }

// The elements of the 16-byte unit r (element e of p, for a q8_0 cache's
// scale) as f32.
__device__ __forceinline__ void kv_unpack(uint4 r, const float*, long, float* x) {
    x[0] = __uint_as_float(r.x);
    x[1] = __uint_as_float(r.y);
    x[2] = __uint_as_float(r.z);
    x[3] = __uint_as_float(r.w);
}
__device__ __forceinline__ void kv_unpack(uint4 r, const u16*, long, float* x) {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x[2 * i] = h2f((u16)(w[i] & 0xffffu));
        x[2 * i + 1] = h2f((u16)(w[i] >> 16));
    }
}
__device__ __forceinline__ void kv_unpack(uint4 r, KvQ8 p, long e, float* x) {
    const float d = h2f(p.d[(p.o + e) >> 5]);
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 16; i++) x[i] = (float)(i8)(w[i >> 2] >> (8 * (i & 3))) * d;
}
// N consecutive elements at p (N elements' bytes, aligned to that) as f32.
template <int N>
__device__ __forceinline__ void kv_load_n(const float* p, float* x) {
    if constexpr (N == 2) {
        const float2 r = *(const float2*)p;
        x[0] = r.x;
        x[1] = r.y;
    } else {
        static_assert(N == 4, "2 or 4 elements");
        const float4 r = *(const float4*)p;
        x[0] = r.x;
        x[1] = r.y;
        x[2] = r.z;
        x[3] = r.w;
    }
}
template <int N>
__device__ __forceinline__ void kv_load_n(const u16* p, float* x) {
    if constexpr (N == 2) {
        const unsigned r = *(const unsigned*)p;
        x[0] = h2f((u16)(r & 0xffffu));
        x[1] = h2f((u16)(r >> 16));
    } else {
        static_assert(N == 4, "2 or 4 elements");
        const uint2 r = *(const uint2*)p;
        x[0] = h2f((u16)(r.x & 0xffffu));
        x[1] = h2f((u16)(r.x >> 16));
        x[2] = h2f((u16)(r.y & 0xffffu));
        x[3] = h2f((u16)(r.y >> 16));
    }
}
template <int N>
__device__ __forceinline__ void kv_load_n(KvQ8 p, float* x) {
    static_assert(N == 2 || N == 4, "2 or 4 elements");
    const unsigned r = N == 2 ? (unsigned)*(const unsigned short*)(p.q + p.o) : *(const unsigned*)(p.q + p.o);
    const float d = h2f(p.d[p.o >> 5]);
#pragma unroll
    for (int i = 0; i < N; i++) x[i] = (float)(i8)(r >> (8 * i)) * d;
}

// The query heads of block (row, y) of attend_split, which takes hpb
// (1 .. AS_MAX_G) heads of a group per block: the first head h0 and how many
// (gb), the KV head and whether this block is the group's first.
struct SplitHeads {
    int kvh, h0, gb;
    bool first;
};
__device__ __forceinline__ SplitHeads split_heads(int n_head, int n_head_kv, int hpb) {
    const int G = n_head / n_head_kv, hg = (G + hpb - 1) / hpb;
    const int kvh = blockIdx.y / hg, sub = blockIdx.y % hg;
    const int h0 = kvh * G + sub * hpb;
    return SplitHeads{kvh, h0, min(hpb, kvh * G + G - h0), sub == 0};
}

// Before pdl_wait(): asks L2 for the first tile (AS_TILE positions) of the
// keys and values this block attends before the row's own position, so that
// its first loads after the wait, the chain that a short-context attention's
// time is, find them there while the previous kernel still runs. The slots
// are the step's inputs (copied before its first launch); the positions
// before the row's were written by earlier steps, or in a prefill batch by
// the rope_store just before, which a prefetch cannot make stale: it reads
// into L2, where every write lands, and changes no value.
template <int HD, typename KP>
__device__ __forceinline__ void split_prefetch_kv(KP kc, KP vc, const int* slots, int n_head,
                                                  int n_head_kv, int n_ctx, int chunk, int hpb) {
    // Only when the launch has one split (short rows): at long context the
    // first tile is a small share of a split's reads (measured on an H100 at
    // depth 32768 with every launch prefetching: 0.975-0.997x, no gain).
    if (gridDim.z != 1) return;
    const int seq = slots[2 * blockIdx.x], pos = slots[2 * blockIdx.x + 1];
    const SplitHeads sh = split_heads(n_head, n_head_kv, hpb);
    const int c = att_chunk(pos + 1, gridDim.z, chunk);
    const int j0 = blockIdx.z * c, j1 = min(min(pos, j0 + c), j0 + AS_TILE);
    if (j0 >= j1) return;
    const long at = (((long)seq * n_head_kv + sh.kvh) * n_ctx + j0) * HD;
    kv_prefetch(kc + at, (long)(j1 - j0) * HD);
    kv_prefetch(vc + at, (long)(j1 - j0) * HD);
}

// attend_split's body for head size HD (64, 128 or 256): the query heads
// staged by load_q(qs) (a copy from q, or attend_split_rope's rotated copy)
// and, when psub >= 0, the key and value of position psub taken from ksub /
// vsub (shared memory, as the cache will hold them) instead of the cache,
// which the same launch writes. With out non-null (a launch of one split
// whose chunk covers every row: the host's short-context form) the block
// writes each head's normalized output acc / l to out, the bits
// attend_combine would give for that one split, and no partial.
// Scores: AS_LPK lanes per key, each multiplying its 16-byte units of the
// key with every query head (a shuffle sum over the AS_LPK lanes per head);
// the loads of AS_U keys per lane are issued before the first product.
// Weighted V sum: thread t owns DPT consecutive output elements of every
// head and takes every NGRP-th key of the tile (NGRP groups of HD / DPT
// threads, added in group order at the end).
template <int HD, typename KP, typename LoadQ>
__device__ void attend_split_with(LoadQ load_q, KP kc, KP vc,
                                  const int* __restrict__ slots, int n_head, int n_head_kv, int n_ctx, int chunk,
                                  int hpb, float scale, const float* ksub, const float* vsub, int psub,
                                  float* __restrict__ part, float* __restrict__ out) {
    constexpr int EPU = 16 / kv_bytes(KP{});        // elements per 16-byte unit
    constexpr int LPK = HD / EPU < AS_LPK ? HD / EPU : AS_LPK;  // lanes per key
    constexpr int UPL = HD / EPU / LPK;             // units per lane of one key
    constexpr int AS_U = UPL >= 8 ? 1 : UPL >= 4 ? 2 : 4;  // keys per lane in flight
    constexpr int KPW = 32 / LPK;                   // keys per warp and step
    constexpr int NW = AS_THREADS / 32;
    constexpr int DPT = HD >= 256 ? 4 : 2;          // V elements per thread
    constexpr int TPK = HD / DPT;                   // threads per value row
    constexpr int NGRP = AS_THREADS / TPK;          // key groups of the V sum
    constexpr int VU = 8;                           // value rows per thread in flight
    static_assert(UPL >= 1 && TPK <= AS_THREADS && AS_THREADS % TPK == 0, "head size");
    __shared__ float qs[AS_MAX_G][HD];
    __shared__ float sc[AS_MAX_G][AS_TILE];
    __shared__ float red[AS_MAX_G * HD];
    __shared__ float ms[AS_MAX_G], ls[AS_MAX_G], fs[AS_MAX_G];
    const int row = blockIdx.x, split = blockIdx.z, n_split = gridDim.z;
    const SplitHeads sh = split_heads(n_head, n_head_kv, hpb);
    const int gb = sh.gb;
    const int seq = slots[2 * row], n = slots[2 * row + 1] + 1;
    chunk = att_chunk(n, n_split, chunk);
    const int j0 = split * chunk, j1 = min(n, j0 + chunk);
    if (j0 >= j1) return;  // attend_combine skips splits past the position
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    load_q(qs, sh.h0, gb);
    if (tid < AS_MAX_G) {
        ms[tid] = -MIRAGE_INF;
        ls[tid] = 0.f;
    }
    const KP K = kc + ((long)seq * n_head_kv + sh.kvh) * n_ctx * HD;
    const KP V = vc + ((long)seq * n_head_kv + sh.kvh) * n_ctx * HD;
    const int kl = lane % LPK, kw = lane / LPK;
    const int grp = tid / TPK, d0 = (tid % TPK) * DPT;
    float acc[AS_MAX_G][DPT];
#pragma unroll
    for (int g = 0; g < AS_MAX_G; g++)
#pragma unroll
        for (int e = 0; e < DPT; e++) acc[g][e] = 0.f;
    __syncthreads();
    for (int t0 = j0; t0 < j1; t0 += AS_TILE) {
        const int cnt = min(AS_TILE, j1 - t0);
        // The tile's values are read only after its softmax, and the next
        // tile's keys only after that: ask L2 for both now, so that their
        // DRAM reads overlap the scoring instead of following it.
        kv_prefetch(V + (long)t0 * HD, (long)cnt * HD);
        if (t0 + AS_TILE < j1) {
            const long next = (long)min(AS_TILE, j1 - t0 - AS_TILE) * HD;
            kv_prefetch(K + (long)(t0 + AS_TILE) * HD, next);
            kv_prefetch(V + (long)(t0 + AS_TILE) * HD, next);
        }
        // Scores of the tile's keys (warp-uniform loop: every lane of the
        // warp takes part in the shuffles).
        for (int sb = warp * KPW; sb < cnt; sb += NW * KPW * AS_U) {
            uint4 raw[AS_U][UPL];
#pragma unroll
            for (int u = 0; u < AS_U; u++) {
                const int kk = min(sb + u * NW * KPW + kw, cnt - 1);  // clamped: an in-range, read row
#pragma unroll
                for (int i = 0; i < UPL; i++) raw[u][i] = kv_unit(K, (long)(t0 + kk) * HD + (kl + LPK * i) * EPU);
            }
#pragma unroll
            for (int u = 0; u < AS_U; u++) {
                const int kk = sb + u * NW * KPW + kw;
                float s[AS_MAX_G];
#pragma unroll
                for (int g = 0; g < AS_MAX_G; g++) s[g] = 0.f;
#pragma unroll
                for (int i = 0; i < UPL; i++) {
                    const int e0 = (kl + LPK * i) * EPU;
                    float x[EPU];
                    // The row raw was loaded from (clamped: a q8_0 scale is read there too).
                    kv_unpack(raw[u][i], K, (long)(t0 + min(kk, cnt - 1)) * HD + e0, x);
                    if (t0 + kk == psub)
#pragma unroll
                        for (int e = 0; e < EPU; e++) x[e] = ksub[e0 + e];
#pragma unroll
                    for (int g = 0; g < AS_MAX_G; g++)
                        if (g < gb)
#pragma unroll
                            for (int e = 0; e < EPU; e++) s[g] += qs[g][e0 + e] * x[e];
                }
#pragma unroll
                for (int g = 0; g < AS_MAX_G; g++) {
                    if (g < gb) {
#pragma unroll
                        for (int o = LPK / 2; o > 0; o >>= 1) s[g] += __shfl_xor_sync(0xffffffffu, s[g], o);
                        if (kl == 0 && kk < cnt) sc[g][kk] = s[g] * scale;
                    }
                }
            }
        }
        __syncthreads();
        // Per head: the tile's max, the weights exp(s - max) and the
        // running max and sum (warp w takes heads w, w + NW, ...).
        for (int g = warp; g < gb; g += NW) {
            float tm = -MIRAGE_INF;
            for (int jj = lane; jj < cnt; jj += 32) tm = fmaxf(tm, sc[g][jj]);
            tm = warp_max(tm);
            const float m = ms[g], nm = fmaxf(m, tm);
            float sum = 0.f;
            for (int jj = lane; jj < cnt; jj += 32) {
                const float p = expf(sc[g][jj] - nm);
                sc[g][jj] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float f = expf(m - nm);  // 0 on the first tile (m = -inf)
                ms[g] = nm;
                ls[g] = ls[g] * f + sum;
                fs[g] = f;
            }
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < AS_MAX_G; g++)
            if (g < gb)
#pragma unroll
                for (int e = 0; e < DPT; e++) acc[g][e] *= fs[g];
        for (int jb = grp; jb < cnt; jb += NGRP * VU) {
            float vx[VU][DPT];
#pragma unroll
            for (int u = 0; u < VU; u++) kv_load_n<DPT>(V + (long)(t0 + min(jb + u * NGRP, cnt - 1)) * HD + d0, vx[u]);
#pragma unroll
            for (int u = 0; u < VU; u++) {
                const int jj = jb + u * NGRP;
                if (jj < cnt) {
                    if (t0 + jj == psub)
#pragma unroll
                        for (int e = 0; e < DPT; e++) vx[u][e] = vsub[d0 + e];
#pragma unroll
                    for (int g = 0; g < AS_MAX_G; g++)
                        if (g < gb) {
                            const float p = sc[g][jj];
#pragma unroll
                            for (int e = 0; e < DPT; e++) acc[g][e] += p * vx[u][e];
                        }
                }
            }
        }
        __syncthreads();  // before the next tile overwrites sc
    }
    // The key groups' sums, added in group order: red = group 1, + group 2,
    // ..., then group 0 adds red.
    for (int k = 1; k < NGRP; k++) {
        if (grp == k)
#pragma unroll
            for (int g = 0; g < AS_MAX_G; g++)
                if (g < gb)
#pragma unroll
                    for (int e = 0; e < DPT; e++) {
                        float* r = &red[g * HD + d0 + e];
                        *r = k == 1 ? acc[g][e] : *r + acc[g][e];
                    }
        __syncthreads();
    }
    // Group 0 holds each head's V sum (its own plus red's): with out, the
    // output attend_combine's arithmetic gives for one split (weight
    // exp(0) = 1, so L = l and a = the V sum, then a / L); else the partial.
    if (grp == 0) {
#pragma unroll
        for (int g = 0; g < AS_MAX_G; g++)
            if (g < gb) {
                const long head = (long)row * n_head + sh.h0 + g;
                float* o = out ? out + head * HD : (float*)0;
                float* P = out ? (float*)0 : part + (head * n_split + split) * (HD + 2);
                const float L = ls[g];
#pragma unroll
                for (int e = 0; e < DPT; e++) {
                    const float a = NGRP > 1 ? acc[g][e] + red[g * HD + d0 + e] : acc[g][e];
                    if (o)
                        o[d0 + e] = L > 0.f ? a / L : 0.f;
                    else
                        P[2 + d0 + e] = a;
                }
                if (P && d0 == 0) {
                    P[0] = ms[g];
                    P[1] = L;
                }
            }
    }
}

// The query heads h0 .. h0 + gb of the row as they are.
template <int HD>
__device__ __forceinline__ void split_copy_q(const float* __restrict__ q, int n_head, float (*qs)[HD], int h0, int gb) {
    const float* qh = q + ((long)blockIdx.x * n_head + h0) * HD;
    for (int i = threadIdx.x; i < gb * HD; i += blockDim.x) qs[i / HD][i % HD] = qh[i];
}

template <int HD, typename KP>
__device__ void attend_split(const float* __restrict__ q, KP kc, KP vc,
                             const int* __restrict__ slots, int n_head, int n_head_kv, int n_ctx, int chunk, int hpb,
                             float scale, float* __restrict__ part, float* __restrict__ out) {
    attend_split_with<HD>(
        [&](float (*qs)[HD], int h0, int gb) { split_copy_q<HD>(q, n_head, qs, h0, gb); }, kc, vc, slots, n_head,
        n_head_kv, n_ctx, chunk, hpb, scale, (const float*)0, (const float*)0, -1, part, out);
}

// Decode rows' RoPE and KV store folded into the split attention (one
// launch fewer per layer than rope_store, which prefill keeps): block
// (row, y, split) rotates its query heads itself, and the blocks of the
// split holding position pos (the row's new key) rotate the row's key head
// and stage it and the value head, rounded as the cache stores them, in
// shared memory; they attend position pos from there, since the cache slot
// is written in the same launch (by the group's first block of that
// split). Everything else is attend_split's. The same bits as rope_store
// then attend_split: the same rotation (rope_angle, rope_turn) and the same
// values per key. Only for batches whose rows are in different sequences (a
// row never attends another row's new key) and without the per-head q/k
// norm (the host checks both). Thread i < HD / 2 rotates pair i of the key
// and of every query head, with that pair's angle from the cache's RoPE
// table (rope_cs).
template <int HD, typename KP>
__device__ void attend_split_rope(const float* __restrict__ q, const float* __restrict__ k,
                                  const float* __restrict__ v, KP kc, KP vc, const int* __restrict__ slots,
                                  int n_head, int n_head_kv, int n_ctx, int chunk, int hpb, float scale, int neox,
                                  const float* __restrict__ rope, float* __restrict__ part, float* __restrict__ out) {
    __shared__ float kr[HD], vr[HD];
    constexpr int half = HD / 2;
    static_assert(half <= AS_THREADS, "one rotated pair per thread");
    const int row = blockIdx.x, i = threadIdx.x;
    const int seq = slots[2 * row], pos = slots[2 * row + 1];
    const SplitHeads sh = split_heads(n_head, n_head_kv, hpb);
    const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    float c = 0.f, s = 0.f;
    if (i < half) rope_cs(rope, pos, i, HD, &c, &s);
    // The split of position pos is the last one with positions.
    const bool has_new = (int)blockIdx.z == pos / att_chunk(pos + 1, gridDim.z, chunk);
    const bool stores = has_new && sh.first;
    const float* kh = k + ((long)row * n_head_kv + sh.kvh) * HD;
    const float* vh = v + ((long)row * n_head_kv + sh.kvh) * HD;
    const long at = (((long)seq * n_head_kv + sh.kvh) * n_ctx + pos) * HD;
    if (has_new && i < half) {
        float ra, rb;
        rope_turn(kh[ia], kh[ib], c, s, &ra, &rb);
        // Every block of the split quantizes the row (the same bits); the
        // group's first stores it.
        kv_store_pair(kc, at, i, neox, half, ra, rb, &kr[ia], &kr[ib], stores);
        kv_store_pair(vc, at, i, neox, half, vh[ia], vh[ib], &vr[ia], &vr[ib], stores);
    }
    auto load_q = [&](float (*qs)[HD], int h0, int gb) {
        const float* qh = q + ((long)row * n_head + h0) * HD;
        if (i < half) {
            for (int g = 0; g < gb; g++) {
                float ra, rb;
                rope_turn(qh[g * HD + ia], qh[g * HD + ib], c, s, &ra, &rb);
                qs[g][ia] = ra;
                qs[g][ib] = rb;
            }
        }
    };
    attend_split_with<HD>(load_q, kc, vc, slots, n_head, n_head_kv, n_ctx, chunk, hpb, scale, kr, vr,
                              has_new ? pos : -1, part, out);
}

// Whether row `row` is the only row of its sequence among `n_rows` (always,
// unless only_decode: see attention_pruned.cu).
__device__ __forceinline__ bool pruned_row(const int* __restrict__ slots, int row, int n_rows, int only_decode) {
    if (!only_decode) return true;
    int seq = slots[2 * row];
    for (int r = 0; r < n_rows; r++)
        if (r != row && slots[2 * r] == seq) return false;
    return true;
}

// Split-K attention, part 2: out[row, head, :] = sum_s e^(m_s - M) acc_s /
// sum_s e^(m_s - M) l_s over the splits (0 when no split saw a position).
// Grid (rows, n_head), block a multiple of head_dim threads, at most
// AC_THREADS: slice k of head_dim threads takes splits k, k + slices, ...
// With chunk > 0 (attend_split's partials) the splits are those att_chunk
// gives the row's length; with chunk = 0 (the pruned attention's) all
// n_split, those that saw nothing holding m = -inf. Row r of the launch is
// batch row row_base + r (slots, out); rows skipped by only_decode are left
// as they are. The weights of the splits are computed once into shared
// memory. A long row has hundreds of splits, and a sum that waits on each
// split's loads before the next costs an L2 round trip per split: so each
// thread keeps AC_BATCH independent sums (its i-th split goes to sum
// i % AC_BATCH) and issues a batch's loads before its first product; the
// sums are added in order, then slice 0 adds the slices in order. With one
// split the output is the bits of acc / l, as the short form writes.
#define AC_THREADS 512
#define AC_BATCH 8
__device__ void attend_combine_body(const float* __restrict__ part, const int* __restrict__ slots, int n_head,
                                    int head_dim, int n_split, int chunk, int only_decode, int n_rows, int row_base,
                                    float* __restrict__ out) {
    __shared__ float w[AS_MAX_SPLITS];
    __shared__ float s32[32];
    __shared__ float ared[AC_THREADS];
    __shared__ float lred[AC_THREADS];
    const int row = row_base + blockIdx.x, head = blockIdx.y, t = threadIdx.x;
    if (!pruned_row(slots, row, n_rows, only_decode)) return;
    const int slices = blockDim.x / head_dim, slice = t / head_dim, d = t % head_dim;
    int ns = min(n_split, AS_MAX_SPLITS);
    if (chunk > 0) {
        const int n = slots[2 * row + 1] + 1, c = att_chunk(n, n_split, chunk);
        ns = min(ns, (n + c - 1) / c);
    }
    const long stride = head_dim + 2;
    const float* P = part + ((long)blockIdx.x * n_head + head) * n_split * stride;
    float M = -MIRAGE_INF;
    for (int s = t; s < ns; s += blockDim.x) M = fmaxf(M, P[(long)s * stride]);
    M = warp_max(M);
    if ((t & 31) == 0) s32[t >> 5] = M;
    __syncthreads();
    M = -MIRAGE_INF;
    for (int i = 0; i < (int)(blockDim.x + 31) / 32; i++) M = fmaxf(M, s32[i]);
    for (int s = t; s < ns; s += blockDim.x) {
        const float m = P[(long)s * stride];
        w[s] = m == -MIRAGE_INF ? 0.f : expf(m - M);
    }
    __syncthreads();
    float Lb[AC_BATCH], ab[AC_BATCH];
#pragma unroll
    for (int b = 0; b < AC_BATCH; b++) Lb[b] = ab[b] = 0.f;
    if (slice < slices)
        for (int s0 = slice; s0 < ns; s0 += slices * AC_BATCH) {
            float pl[AC_BATCH], pa[AC_BATCH], ws[AC_BATCH];
#pragma unroll
            for (int b = 0; b < AC_BATCH; b++) {
                const int s = s0 + b * slices;
                const float* ps = P + (long)min(s, ns - 1) * stride;  // clamped: a read split
                pl[b] = __ldcg(ps + 1);
                pa[b] = __ldcg(ps + 2 + d);
                ws[b] = s < ns ? w[s] : 0.f;
            }
#pragma unroll
            for (int b = 0; b < AC_BATCH; b++) {
                Lb[b] += ws[b] * pl[b];
                ab[b] += ws[b] * pa[b];
            }
        }
    float L = 0.f, a = 0.f;
#pragma unroll
    for (int b = 0; b < AC_BATCH; b++) {
        L += Lb[b];
        a += ab[b];
    }
    if (slice > 0 && slice < slices) {
        ared[t] = a;
        lred[t] = L;
    }
    __syncthreads();
    if (slice == 0) {
        for (int k = 1; k < slices; k++) {
            a += ared[k * head_dim + d];
            L += lred[k * head_dim + d];
        }
        out[((long)row * n_head + head) * head_dim + d] = L > 0.f ? a / L : 0.f;
    }
}

// f16 tensor-core helpers of the prefill attention (attention_prefill.cu)
// and the split decode attention (attention_mma.cu): two floats as an f16
// pair, an f16 pair from memory, and one m16n8k16 product.
__device__ __forceinline__ u32 fa_pack(float lo, float hi) { return (u32)f2h(lo) | ((u32)f2h(hi) << 16); }
__device__ __forceinline__ u32 fa_word(const u16* p) { return *(const u32*)p; }

// c += a (16 x 16, row) * b (16 x 8, col), f16 inputs, f32 accumulators.
// Fragments per the PTX ISA (g = lane / 4, t = lane % 4): a[0] = A[g][2t,
// 2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..];
// b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]; c[0], c[1] = C[g][2t,
// 2t+1], c[2], c[3] = C[g+8][2t, 2t+1]. The lower half of each register is
// the lower index.
__device__ __forceinline__ void mma_f16_k16(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The kernels over the cache, per cache type (the prefill attention's are
// attention_prefill.cu's): NAME in the kernel name, KV
// the element type of the cache arguments. A q8_0 cache's kernels take
// the scales of the keys and values as two more arguments, last
// (KV_SCALES); KV_CACHE makes the cache argument the templates take.
#define KV_SCALES_f32
#define KV_SCALES_f16
#define KV_SCALES_q8_0 , const u16 *kd, const u16 *vd
#define KV_CACHE_f32(P, D) (P)
#define KV_CACHE_f16(P, D) (P)
#define KV_CACHE_q8_0(P, D) (KvQ8{(i8*)(P), (u16*)(D), 0})

#define ROPE_STORE_INSTANCE(NAME, KV)                                                                               \
    extern "C" __global__ void rope_store_##NAME(float* q, float* k, const float* v, const int* slots, int n_head,  \
                                                 int n_head_kv, int head_dim, int neox, const float* rope,          \
                                                 const float* qn, const float* kn, float norm_eps, KV* kc, KV* vc,  \
                                                 int n_ctx KV_SCALES_##NAME) {                                      \
        PDL_ENTRY();                                                                                                \
        rope_store(q, k, v, slots, n_head, n_head_kv, head_dim, neox, rope, qn, kn, norm_eps,                      \
                   KV_CACHE_##NAME(kc, kd), KV_CACHE_##NAME(vc, vd), n_ctx);                                        \
    }

ROPE_STORE_INSTANCE(f32, float)
ROPE_STORE_INSTANCE(f16, u16)
ROPE_STORE_INSTANCE(q8_0, i8)

// attend_split and attend_split_rope per cache type and head size (one
// kernel per head size: the shared arrays are sized by it).
#define SPLIT_INSTANCE(NAME, KV, HD)                                                                                \
    extern "C" __global__ void __launch_bounds__(AS_THREADS)                                                       \
        attend_split_##NAME##_d##HD(const float* q, const KV* kc, const KV* vc, const int* slots, int n_head,      \
                                    int n_head_kv, int n_ctx, int chunk, int hpb, float scale, float* part,        \
                                    float* out KV_SCALES_##NAME) {                                                  \
        split_prefetch_kv<HD>(KV_CACHE_##NAME(kc, kd), KV_CACHE_##NAME(vc, vd), slots, n_head, n_head_kv, n_ctx,    \
                              chunk, hpb);                                                                          \
        PDL_ENTRY();                                                                                                \
        attend_split<HD>(q, KV_CACHE_##NAME(kc, kd), KV_CACHE_##NAME(vc, vd), slots, n_head, n_head_kv, n_ctx,      \
                         chunk, hpb, scale, part, out);                                                             \
    }                                                                                                               \
    /* attend_split's arguments, then the rows' unrotated k and v and the RoPE's mode and base. */             \
    extern "C" __global__ void __launch_bounds__(AS_THREADS)                                                       \
        attend_split_rope_##NAME##_d##HD(const float* q, KV* kc, KV* vc, const int* slots, int n_head,             \
                                         int n_head_kv, int n_ctx, int chunk, int hpb, float scale, float* part,   \
                                         float* out, const float* k, const float* v, int neox,                      \
                                         const float* rope KV_SCALES_##NAME) {                                      \
        split_prefetch_kv<HD>(KV_CACHE_##NAME(kc, kd), KV_CACHE_##NAME(vc, vd), slots, n_head, n_head_kv, n_ctx,    \
                              chunk, hpb);                                                                          \
        PDL_ENTRY();                                                                                                \
        attend_split_rope<HD>(q, k, v, KV_CACHE_##NAME(kc, kd), KV_CACHE_##NAME(vc, vd), slots, n_head, n_head_kv,  \
                              n_ctx, chunk, hpb, scale, neox, rope, part, out);                                     \
    }
SPLIT_INSTANCE(f32, float, 64)
SPLIT_INSTANCE(f32, float, 128)
SPLIT_INSTANCE(f32, float, 256)
SPLIT_INSTANCE(f16, u16, 64)
SPLIT_INSTANCE(f16, u16, 128)
SPLIT_INSTANCE(f16, u16, 256)
SPLIT_INSTANCE(q8_0, i8, 64)
SPLIT_INSTANCE(q8_0, i8, 128)
SPLIT_INSTANCE(q8_0, i8, 256)

extern "C" __global__ void rope_table(float* rope, int n_pos, int head_dim, float freq_base) {
    PDL_ENTRY();
    rope_table_body(rope, n_pos, head_dim, freq_base);
}

// (AC_THREADS, 1): told one block an SM is enough, ptxas issues a batch's
// 16 loads before its first product; with AC_THREADS alone it sank each
// load to its product, four loads in flight (sm_90, CUDA 13.0).
extern "C" __global__ void __launch_bounds__(AC_THREADS, 1)
    attend_combine(const float* part, const int* slots, int n_head, int head_dim, int n_split, int chunk,
                   int only_decode, int n_rows, int row_base, float* out) {
    PDL_ENTRY();
    attend_combine_body(part, slots, n_head, head_dim, n_split, chunk, only_decode, n_rows, row_base, out);
}
