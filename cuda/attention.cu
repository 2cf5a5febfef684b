// Decode and prefill attention of the dense module over the KV cache:
// RoPE and the cache store, the split-K decode attention with its merge in
// the same launch, and the tiled prefill attention.

// KV-cache element access: f32 or f16 (stored as raw u16 bits).
__device__ __forceinline__ float kv_load(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float kv_load(const u16* p, long i) { return h2f(p[i]); }
__device__ __forceinline__ void kv_store(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void kv_store(u16* p, long i, float v) { p[i] = f2h(v); }
// kv_load in two steps, for loads that must all be in flight before the
// first value is used (att_load_keys): the element as stored, then as f32.
__device__ __forceinline__ float kv_widen(float v) { return v; }
__device__ __forceinline__ float kv_widen(u16 v) { return h2f(v); }
// What kv_load returns after kv_store(p, i, v): v as the cache holds it.
__device__ __forceinline__ float kv_round(const float*, float v) { return v; }
__device__ __forceinline__ float kv_round(const u16*, float v) { return h2f(f2h(v)); }

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
__device__ __forceinline__ void rope_rotate(float a, float b, int i, int pos, int head_dim, float freq_base, float* ra,
                                            float* rb) {
    float c, s;
    rope_angle(i, pos, head_dim, freq_base, &c, &s);
    rope_turn(a, b, c, s, ra, rb);
}

// Optional per-head RMSNorm (qwen3) and RoPE of every q and k head of every
// row, then the k and v heads are stored into the cache at the row's slot.
// slots[2 * row] = seq, slots[2 * row + 1] = pos (read from device memory, so
// a recorded step replays for any position). Grid (rows, n_head +
// n_head_kv), block head_dim / 2 (one thread per rotated pair).
// Cache layout per layer: [n_seq, n_head_kv, n_ctx, head_dim] of KV.
template <typename KV>
__device__ void rope_store(float* q, float* k, const float* __restrict__ v, const int* __restrict__ slots, int n_head,
                           int n_head_kv, int head_dim, int neox, float freq_base, const float* qn, const float* kn,
                           float norm_eps, KV* kc, KV* vc, int n_ctx) {
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
    float ra, rb;
    rope_rotate(a, b, i, pos, head_dim, freq_base, &ra, &rb);
    x[ia] = ra;
    x[ib] = rb;
    if (!is_q) {
        long at = (((long)seq * n_head_kv + head) * n_ctx + pos) * head_dim;
        kv_store(kc, at + ia, ra);
        kv_store(kc, at + ib, rb);
        const float* vr = v + ((long)row * n_head_kv + head) * head_dim;
        kv_store(vc, at + ia, vr[ia]);
        kv_store(vc, at + ib, vr[ib]);
    }
}

// Split-K ("flash-decoding") causal attention, part 1. Grid (rows, n_head,
// n_split), block ATT_THREADS. Block (row, head, s) attends the query head
// over positions [s * c, min((s + 1) * c, pos + 1)) of the row's
// sequence, c = att_chunk(pos + 1, n_split, chunk) (below), with an online softmax in tiles of ATT_TILE keys, and writes its
// running max m, its sum l and its unnormalised V sum to
// part[((row * n_head + head) * n_split + s) * (head_dim + 2) + {0, 1, 2..}].
// The grid depends only on the batch and the cache size, never on the
// position (read from device memory): a recorded step replays at any length.
// Scores: one warp per key. V sum: blockDim / head_dim groups of head_dim
// threads take every G-th key of a tile; groups are added at the end.
#define ATT_THREADS 256
#define ATT_TILE 64
// Keys per warp batch of the scores, elements of a key per lane (head_dim
// <= ATT_THREADS), V rows per batch of the weighted sum (attend_part).
#define ATT_KB 4
#define ATT_HD_LANE (ATT_THREADS / 32)
#define ATT_VB 8
// Keys of a row's split blocks, chosen on the device from the row's length
// n (the grid is fixed for graph replay; n comes from `slots`): the least
// chunk that covers n with the launch's n_split blocks, at least
// ATT_MIN_KEYS and at most the host's chunk = ceil(n_ctx / n_split).
// Why: with the host's chunk alone, a short sequence (a decode at position
// 80 of a 4096-position cache: chunk 114) is ONE block per head walking every
// key in dependent load batches (the 7B ncu table: 13.5 us a layer for ~80
// positions); at 16 keys a block every split block does one batch of keys
// and one of values, in parallel. Long sequences spread evenly over all the
// splits instead of filling the first ones. Every
// decode-attention kernel (attend_part, attend_rope, attend_merge, the
// fused merge) uses this one function, so they agree on the split of each
// row and stay bit-equal to one another.
#define ATT_MIN_KEYS 16
__device__ __forceinline__ int att_chunk(int n, int n_split, int chunk) {
    return min(chunk, max(ATT_MIN_KEYS, (n + n_split - 1) / n_split));
}
// This lane's ATT_HD_LANE elements of the ATT_KB keys of warp batch jb of
// the tile at t0 (tile rows jb, jb + nw, ...; zeros past the tile's cnt
// rows or the head), every load issued before any product. cnt >= 1; every
// lane of the warp calls it with the same jb (the key loop is warp-uniform).
// How the loads stay in flight together (SASS read with nvdisasm, sm_90):
// written as `jj < cnt && e < head_dim ? kv_load(..) : 0`, ptxas issued
// them one to three at a time, each f16 key's conversion (and the reuse of
// its register) waiting for the load before the next went out: a chain of
// round trips per batch. So the raw elements are loaded unconditionally at
// clamped (in-range, already-read) addresses (only a warp-uniform test skips
// the elements past a short head), a __syncwarp separates them from their
// uses, and the conversion and the zeroing follow: the same values (host
// check: hostcheck/check_attend.cpp). In the SASS of that form 29-31 key
// loads go out before the first conversion; the fence steers ptxas, it does
// not bind it (a version with per-lane predicates left 15 loads after it),
// so read the SASS again after changing this code (on the H200 this form
// took attend_rope_f16 of the 7B shape from 11.9 to 10.1 us against the
// predicated loads).
template <typename KV>
__device__ __forceinline__ void att_load_keys(const KV* K, int t0, int jb, int cnt, int nw, int lane, int head_dim,
                                              float (&kx)[ATT_KB][ATT_HD_LANE]) {
    KV raw[ATT_KB][ATT_HD_LANE];
#pragma unroll
    for (int u = 0; u < ATT_KB; u++) {
        const long kr = (long)(t0 + min(jb + u * nw, cnt - 1)) * head_dim;
#pragma unroll
        for (int t = 0; t < ATT_HD_LANE; t++)  // (a warp-uniform test: no loads past a short head)
            raw[u][t] = 32 * t < head_dim ? K[kr + min(lane + 32 * t, head_dim - 1)] : KV(0);
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < ATT_KB; u++)
#pragma unroll
        for (int t = 0; t < ATT_HD_LANE; t++)
            kx[u][t] = jb + u * nw < cnt && lane + 32 * t < head_dim ? kv_widen(raw[u][t]) : 0.f;
}

// This thread's element d of the ATT_VB values of batch jb of the tile at
// t0 (tile rows jb, jb + groups, ...; zeros past cnt), as att_load_keys
// (cnt >= 1). The warp fence only where every warp lies in one group of
// head_dim threads (head_dim % 32 == 0: then the warp's lanes share jb and
// the loop's trip count); otherwise the loads are left to ptxas.
template <typename KV>
__device__ __forceinline__ void att_load_values(const KV* V, int t0, int jb, int cnt, int groups, int d, int head_dim,
                                                float (&vx)[ATT_VB]) {
    KV raw[ATT_VB];
#pragma unroll
    for (int u = 0; u < ATT_VB; u++) raw[u] = V[(long)(t0 + min(jb + u * groups, cnt - 1)) * head_dim + d];
    if (head_dim % 32 == 0) __syncwarp();
#pragma unroll
    for (int u = 0; u < ATT_VB; u++) vx[u] = jb + u * groups < cnt ? kv_widen(raw[u]) : 0.f;
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

// attend_part_with: the same, with the query head staged by load_q(qs) (a
// copy from q, or attend_rope's rotated copy) and, when psub >= 0, the key
// and value of position psub taken from ksub / vsub (shared memory, as the
// cache will hold them) instead of the cache, which the same launch writes.
template <typename KV, typename LoadQ>
__device__ void attend_part_with(LoadQ load_q, const KV* __restrict__ kc, const KV* __restrict__ vc,
                                 const int* __restrict__ slots, int n_head, int n_head_kv, int head_dim, int n_ctx,
                                 int chunk, float scale, const float* ksub, const float* vsub, int psub,
                                 float* __restrict__ part) {
    __shared__ float qs[ATT_THREADS];
    __shared__ float sc[ATT_TILE];
    __shared__ float red[ATT_THREADS];
    __shared__ float lred[ATT_THREADS / 64];
    int row = blockIdx.x, head = blockIdx.y, split = blockIdx.z, n_split = gridDim.z;
    int seq = slots[2 * row], n = slots[2 * row + 1] + 1;
    chunk = att_chunk(n, n_split, chunk);
    int j0 = split * chunk, j1 = min(n, j0 + chunk);
    if (j0 >= j1) return;  // the combine step skips splits past the position
    int kvh = head / (n_head / n_head_kv);
    load_q(qs);
    const KV* K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    const KV* V = vc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int groups = blockDim.x / head_dim, g = threadIdx.x / head_dim, d = threadIdx.x % head_dim;
    float m = -MIRAGE_INF, l = 0.f, acc = 0.f;
    __syncthreads();
    for (int t0 = j0; t0 < j1; t0 += ATT_TILE) {
        int cnt = min(ATT_TILE, j1 - t0);
        // Warp w scores keys w, w + nw, ... as before, ATT_KB of them per
        // batch with every load of the batch issued before the first
        // product: one memory round trip per ATT_KB keys, not per key (a
        // decode step's attention is a chain of such round trips). Same
        // products and sums per key, in the same order: the same bits.
        for (int jb = warp; jb < cnt; jb += ATT_KB * nw) {
            float kx[ATT_KB][ATT_HD_LANE];
            att_load_keys(K, t0, jb, cnt, nw, lane, head_dim, kx);
#pragma unroll
            for (int u = 0; u < ATT_KB; u++)
#pragma unroll
                for (int t = 0; t < ATT_HD_LANE; t++)
                    if (t0 + jb + u * nw == psub && lane + 32 * t < head_dim) kx[u][t] = ksub[lane + 32 * t];
#pragma unroll
            for (int u = 0; u < ATT_KB; u++) {
                const int jj = jb + u * nw;
                float s = 0.f;
#pragma unroll
                for (int t = 0; t < ATT_HD_LANE; t++) {
                    const int e = lane + 32 * t;
                    if (e < head_dim) s += qs[e] * kx[u][t];
                }
                s = warp_sum(s);
                if (lane == 0 && jj < cnt) sc[jj] = s * scale;
            }
        }
        __syncthreads();
        // The tile's max by every warp at once (lanes, then shuffles), not
        // one thread reading every score in turn: the same value (max does
        // not depend on the order).
        float tm = -MIRAGE_INF;
        for (int jj = lane; jj < cnt; jj += 32) tm = fmaxf(tm, sc[jj]);
        tm = warp_max(tm);
        att_rescale(sc, cnt, fmaxf(m, tm), m, l, acc);
        if (g < groups) {
            // Keys g, g + groups, ... in batches of ATT_VB loads (as the
            // scores above; same order of the sums).
            for (int jb = g; jb < cnt; jb += ATT_VB * groups) {
                float vx[ATT_VB];
                att_load_values(V, t0, jb, cnt, groups, d, head_dim, vx);
#pragma unroll
                for (int u = 0; u < ATT_VB; u++)
                    if (t0 + jb + u * groups == psub) vx[u] = vsub[d];
#pragma unroll
                for (int u = 0; u < ATT_VB; u++) {
                    const int jj = jb + u * groups;
                    if (jj < cnt) {
                        const float p = sc[jj];
                        acc += p * vx[u];
                        l += p;
                    }
                }
            }
        }
        __syncthreads();  // before the next tile overwrites sc
    }
    att_store_partial(acc, l, m, g, groups, d, head_dim, red, lred,
                      part + (((long)row * n_head + head) * n_split + split) * (head_dim + 2));
}

template <typename KV>
__device__ void attend_part(const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
                            const int* __restrict__ slots, int n_head, int n_head_kv, int head_dim, int n_ctx,
                            int chunk, float scale, float* __restrict__ part) {
    const float* qh = q + ((long)blockIdx.x * n_head + blockIdx.y) * head_dim;
    attend_part_with<KV>(
        [&](float* qs) {
            for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qh[d];
        },
        kc, vc, slots, n_head, n_head_kv, head_dim, n_ctx, chunk, scale, (const float*)0, (const float*)0, -1, part);
}

// Decode rows' RoPE and KV store folded into the split attention (one
// launch fewer per layer than rope_store, which prefill keeps): block
// (row, head, split) rotates its query head itself, and the block of the
// last split (the one holding position pos, the row's new key) rotates the
// row's key head and stages it and the value head, rounded as the cache
// stores them, in shared memory; it attends position pos from there, since
// the cache slot is written in the same launch (by the block of the first
// query head of the KV group). Everything else is attend_part's. The same
// bits as rope_store then attend_part: the same rotation (rope_rotate) and
// the same values per key. Only for batches whose rows are in different
// sequences (a row never attends another row's new key) and without the
// per-head q/k norm (the host checks both). Grid and block as attend_part;
// head_dim <= ATT_THREADS.
template <typename KV>
__device__ void attend_rope_part(const float* __restrict__ q, const float* __restrict__ k,
                                 const float* __restrict__ v, KV* kc, KV* vc, const int* __restrict__ slots,
                                 int n_head, int n_head_kv, int head_dim, int n_ctx, int chunk, float scale, int neox,
                                 float freq_base, float* __restrict__ part) {
    __shared__ float qr[ATT_THREADS], kr[ATT_THREADS], vr[ATT_THREADS];
    const int row = blockIdx.x, head = blockIdx.y, half = head_dim >> 1;
    const int seq = slots[2 * row], pos = slots[2 * row + 1];
    const int kvh = head / (n_head / n_head_kv);
    // The split of position pos is the last one with positions.
    const bool has_new = (int)blockIdx.z == pos / att_chunk(pos + 1, gridDim.z, chunk);
    const bool stores = has_new && head % (n_head / n_head_kv) == 0;
    const float* qh = q + ((long)row * n_head + head) * head_dim;
    const float* kh = k + ((long)row * n_head_kv + kvh) * head_dim;
    const float* vh = v + ((long)row * n_head_kv + kvh) * head_dim;
    const long at = (((long)seq * n_head_kv + kvh) * n_ctx + pos) * head_dim;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        float c, s, ra, rb;
        rope_angle(i, pos, head_dim, freq_base, &c, &s);
        rope_turn(qh[ia], qh[ib], c, s, &ra, &rb);
        qr[ia] = ra;
        qr[ib] = rb;
        if (has_new) {
            rope_turn(kh[ia], kh[ib], c, s, &ra, &rb);
            const float va = vh[ia], vb = vh[ib];
            kr[ia] = kv_round(kc, ra);
            kr[ib] = kv_round(kc, rb);
            vr[ia] = kv_round(vc, va);
            vr[ib] = kv_round(vc, vb);
            if (stores) {
                kv_store(kc, at + ia, ra);
                kv_store(kc, at + ib, rb);
                kv_store(vc, at + ia, va);
                kv_store(vc, at + ib, vb);
            }
        }
    }
    __syncthreads();
    auto load_q = [&](float* qs) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qr[d];
    };
    attend_part_with<KV>(load_q, kc, vc, slots, n_head, n_head_kv, head_dim, n_ctx, chunk, scale, kr, vr,
                         has_new ? pos : -1, part);
}

// Split-K attention, part 2: out[row, head, :] = sum_s e^(m_s - M) acc_s /
// sum_s e^(m_s - M) l_s over the splits that hold positions of the row.
// Grid (rows, n_head), block head_dim.
// Output element d of (row, head) from the ns splits' partials P (__ldcg:
// other blocks of the same grid wrote P).
// The loops are unrolled so that their independent loads go out together
// (a decode merges up to n_split partials); the sums keep their order.
__device__ __forceinline__ float attend_merge(const float* P, int ns, int head_dim, int d) {
    float M = -MIRAGE_INF;
#pragma unroll 8
    for (int s = 0; s < ns; s++) M = fmaxf(M, __ldcg(P + s * (head_dim + 2)));
    float L = 0.f, a = 0.f;
#pragma unroll 8
    for (int s = 0; s < ns; s++) {
        const float* ps = P + s * (head_dim + 2);
        float w = expf(__ldcg(ps) - M);
        L += w * __ldcg(ps + 1);
        a += w * __ldcg(ps + 2 + d);
    }
    return a / L;
}

// attend_part, then the combine in the same launch: the last of the ns
// splits of (row, head) to finish (per-(row, head) arrival counter, reset by
// that block, so it is zero again for the next launch) merges the partials
// (attend_merge): one dependent launch fewer per layer than a separate
// combine. count: rows * n_head u32, zero at first
// use. Grid and block as attend_part. part_fn() runs the block's split
// (attend_part, or attend_rope_part for attend_rope). Returns whether this
// block merged (wrote out for its (row, head)); every thread gets the same.
template <typename PartFn>
__device__ bool attend_then_merge(PartFn part_fn, const int* slots, int n_head, int head_dim, int chunk, float* part,
                                  unsigned* count, float* out) {
    __shared__ int last;
    const int row = blockIdx.x, head = blockIdx.y, n_split = gridDim.z;
    const int n = slots[2 * row + 1] + 1;
    chunk = att_chunk(n, n_split, chunk);
    const int ns = min(n_split, (n + chunk - 1) / chunk);
    if ((int)blockIdx.z >= ns) return false;  // attend_part's empty splits
    part_fn();
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* c = count + (long)row * n_head + head;
        last = atomicAdd(c, 1u) == (unsigned)ns - 1;
        if (last) *c = 0u;  // every split of this (row, head) has arrived
    }
    __syncthreads();
    if (!last) return false;
    __threadfence();
    const float* P = part + ((long)row * n_head + head) * n_split * (head_dim + 2);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
        out[((long)row * n_head + head) * head_dim + d] = attend_merge(P, ns, head_dim, d);
    return true;
}


// Tiled causal attention for a prefill batch: the batch rows are consecutive
// positions of one sequence (the host checks), so a block takes PF_ROWS of
// them for one query head and streams the keys and values once for all of
// them through shared memory (the split-K decode kernel reads every key once
// per row: at 32k positions and 512-row chunks that is the prefill's cost).
// Grid (ceil(n / PF_ROWS), n_head), block PF_THREADS = 16 x PF_ROWS threads;
// thread t serves row t / 16 and, of that row, keys t % 16 and t % 16 + 16
// of a PF_KEYS-key tile and output dims t % 16 + 16 i. Online softmax per row
// (rows beyond a row's position are masked; key 0 is in every row's range, so
// the first tile makes each row's running max finite). head_dim <= PF_MAX_HD,
// a multiple of 16. Exact arithmetic differs from attend_part only in the
// order of the sums.
#define PF_ROWS 16
#define PF_KEYS 32
#define PF_THREADS (16 * PF_ROWS)
#define PF_MAX_HD 128
template <typename KV>
__device__ void attend_prefill(const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
                               const int* __restrict__ slots, int n, int n_head, int n_head_kv, int head_dim,
                               int n_ctx, float scale, float* __restrict__ out) {
    __shared__ float qs[PF_ROWS][PF_MAX_HD];
    __shared__ float ks[PF_KEYS][PF_MAX_HD + 1];
    __shared__ float vs[PF_KEYS][PF_MAX_HD];
    __shared__ float ps[PF_ROWS][PF_KEYS];
    int r0 = blockIdx.x * PF_ROWS, head = blockIdx.y;
    int t = threadIdx.x, r = t >> 4, c = t & 15;
    int rows = min(PF_ROWS, n - r0);
    int seq = slots[2 * r0];
    int my_pos = r < rows ? slots[2 * (r0 + r) + 1] : -1;
    int last = slots[2 * (r0 + rows - 1) + 1];  // the tile's largest position
    int kvh = head / (n_head / n_head_kv);
    for (int i = t; i < PF_ROWS * head_dim; i += PF_THREADS) {
        int rr = i / head_dim, d = i % head_dim;
        qs[rr][d] = rr < rows ? q[((long)(r0 + rr) * n_head + head) * head_dim + d] : 0.f;
    }
    const KV* K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    const KV* V = vc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    float acc[PF_MAX_HD / 16];
#pragma unroll
    for (int i = 0; i < PF_MAX_HD / 16; i++) acc[i] = 0.f;
    float m = -MIRAGE_INF, l = 0.f;
    int nd = head_dim >> 4;
    for (int k0 = 0; k0 <= last; k0 += PF_KEYS) {
        int cnt = min(PF_KEYS, last + 1 - k0);
        __syncthreads();  // the previous tile is consumed (and qs is written)
        for (int i = t; i < cnt * head_dim; i += PF_THREADS) {
            int kk = i / head_dim, d = i % head_dim;
            long at = (long)(k0 + kk) * head_dim + d;
            ks[kk][d] = kv_load(K, at);
            vs[kk][d] = kv_load(V, at);
        }
        __syncthreads();
        float s[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int kk = c + 16 * h;
            float a = 0.f;
            if (kk < cnt && k0 + kk <= my_pos) {
                for (int e = 0; e < head_dim; e++) a += qs[r][e] * ks[kk][e];
                s[h] = a * scale;
            } else {
                s[h] = -MIRAGE_INF;
            }
        }
        float tm = fmaxf(s[0], s[1]);
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o, 16));
        float nm = fmaxf(m, tm);
        // nm is finite for a live row from the first tile on (key 0); padding
        // rows (my_pos = -1) keep -inf and are never written.
        float f = nm == -MIRAGE_INF ? 1.f : expf(m - nm);
        float p0 = s[0] == -MIRAGE_INF ? 0.f : expf(s[0] - nm);
        float p1 = s[1] == -MIRAGE_INF ? 0.f : expf(s[1] - nm);
        float ts = p0 + p1;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) ts += __shfl_xor_sync(0xffffffffu, ts, o, 16);
        l = l * f + ts;
        m = nm;
        ps[r][c] = p0;
        ps[r][c + 16] = p1;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < PF_MAX_HD / 16; i++) {
            if (i < nd) {
                int d = c + 16 * i;
                float a = acc[i] * f;
                for (int kk = 0; kk < cnt; kk++) a += ps[r][kk] * vs[kk][d];
                acc[i] = a;
            }
        }
    }
    if (r < rows) {
        float* o = out + ((long)(r0 + r) * n_head + head) * head_dim;
#pragma unroll
        for (int i = 0; i < PF_MAX_HD / 16; i++)
            if (i < nd) o[c + 16 * i] = acc[i] / l;
    }
}

#define KV_INSTANCE(NAME, KV)                                                                                       \
    extern "C" __global__ void rope_store_##NAME(float* q, float* k, const float* v, const int* slots, int n_head,  \
                                                 int n_head_kv, int head_dim, int neox, float freq_base,            \
                                                 const float* qn, const float* kn, float norm_eps, KV* kc, KV* vc,  \
                                                 int n_ctx) { PDL_ENTRY();                                           \
        rope_store<KV>(q, k, v, slots, n_head, n_head_kv, head_dim, neox, freq_base, qn, kn, norm_eps, kc, vc,     \
                       n_ctx);                                                                                      \
    }                                                                                                               \
    extern "C" __global__ void attend_fused_##NAME(const float* q, const KV* kc, const KV* vc, const int* slots,    \
                                                   int n_head, int n_head_kv, int head_dim, int n_ctx, int chunk,   \
                                                   float scale, float* part, unsigned* count, float* out) {         \
        PDL_ENTRY();                                                                                                \
        attend_then_merge(                                                                                          \
            [&] { attend_part<KV>(q, kc, vc, slots, n_head, n_head_kv, head_dim, n_ctx, chunk, scale, part); },      \
            slots, n_head, head_dim, chunk, part, count, out);                                                      \
    }                                                                                                               \
    /* attend_fused's arguments, then the rows' unrotated k and v and the RoPE's mode and base. */             \
    extern "C" __global__ void attend_rope_##NAME(const float* q, KV* kc, KV* vc, const int* slots, int n_head,     \
                                                  int n_head_kv, int head_dim, int n_ctx, int chunk, float scale,   \
                                                  float* part, unsigned* count, float* out, const float* k,         \
                                                  const float* v, int neox, float freq_base) {                      \
        PDL_ENTRY();                                                                                                \
        attend_then_merge(                                                                                          \
            [&] {                                                                                                   \
                attend_rope_part<KV>(q, k, v, kc, vc, slots, n_head, n_head_kv, head_dim, n_ctx, chunk, scale,     \
                                     neox, freq_base, part);                                                        \
            },                                                                                                      \
            slots, n_head, head_dim, chunk, part, count, out);                                                      \
    }                                                                                                               \
    extern "C" __global__ void attend_prefill_##NAME(const float* q, const KV* kc, const KV* vc, const int* slots,  \
                                                     int n, int n_head, int n_head_kv, int head_dim, int n_ctx,     \
                                                     float scale, float* out) { PDL_ENTRY();                         \
        attend_prefill<KV>(q, kc, vc, slots, n, n_head, n_head_kv, head_dim, n_ctx, scale, out);                   \
    }

KV_INSTANCE(f32, float)
KV_INSTANCE(f16, u16)
