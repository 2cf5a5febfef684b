// Decode attention over selected KV pages only (issue 10), appended to
// dense.cu's source (it uses warp_sum, kv_load, h2f, MIRAGE_INF and the
// ATT_THREADS / ATT_TILE constants from there).
//
// KV cache layout per layer as dense.cu: [n_seq, n_head_kv, n_ctx, head_dim].
// Page summaries per layer: kmin / kmax [n_seq, n_head_kv, max_pages,
// head_dim] f32, the per-dimension min and max of the keys of each page of
// `page` positions (an axis-aligned box). For a query q the exact upper bound
// of q.k over the box is sum_d max(q_d min_d, q_d max_d).
//
// Three kernels per decode step and layer:
//   page_bounds_*      refresh the boxes of the pages that changed;
//   select_pages       per (row, query head): the bound of every page, then
//                      the sinks, the recent window and the top pages by
//                      bound, chosen on the device;
//   attend_pages_part_* / attend_pages_combine
//                      split-K over the selected pages (online softmax per
//                      split, combined as dense.cu's attend_combine does).

// Boxes of pages p0 .. p0 + gridDim.x of KV head blockIdx.y of `seq` over
// positions < n. Grid (pages, n_head_kv), block head_dim. An empty page gets
// the empty box (+inf, -inf).
template <typename KV>
__device__ void page_bounds(const KV* __restrict__ kc, int seq, int n_head_kv, int head_dim, int n_ctx, int page,
                            int p0, int n, int max_pages, float* __restrict__ kmin, float* __restrict__ kmax) {
    int p = p0 + blockIdx.x, kvh = blockIdx.y, d = threadIdx.x;
    if (p >= max_pages || d >= head_dim) return;
    const KV* K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    int j0 = p * page, j1 = min(n, j0 + page);
    float lo = MIRAGE_INF, hi = -MIRAGE_INF;
    for (int j = j0; j < j1; j++) {
        float x = kv_load(K, (long)j * head_dim + d);
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
    }
    long at = (((long)seq * n_head_kv + kvh) * max_pages + p) * head_dim + d;
    kmin[at] = lo;
    kmax[at] = hi;
}

// Page selection. Grid (rows, n_head), block SEL_THREADS. Row r attends
// positions 0..pos (slots[2r + 1] = pos, slots[2r] = seq). Writes the chosen
// page indices to sel[(r * n_head + h) * max_sel ..] (highest rank first)
// and their count to nsel[r * n_head + h]. Forced pages (the first `sinks`
// and the last `recent`) rank as +inf, ties broken by the lower index, a
// NaN bound as -inf; a page is chosen when fewer than K pages outrank it,
// K = min(sinks + recent + max(top, ceil(pages * top_percent / 100)), pages,
// max_sel) (KvPruning::top_for). Rank counting is O(pages^2 /
// threads): ~1k comparisons per thread at 1k pages (64k positions at 64).
#define SEL_THREADS 512
#define SEL_MAX_PAGES 4096
extern "C" __global__ void select_pages(const float* __restrict__ q, const int* __restrict__ slots,
                                        const float* __restrict__ kmin, const float* __restrict__ kmax, int n_head,
                                        int n_head_kv, int head_dim, int page, int max_pages, int sinks, int recent,
                                        int top, int top_percent, int max_sel, int* __restrict__ sel,
                                        int* __restrict__ nsel) {
    __shared__ float bound[SEL_MAX_PAGES];
    __shared__ float qs[256];
    int row = blockIdx.x, head = blockIdx.y;
    int seq = slots[2 * row], n = slots[2 * row + 1] + 1;
    int n_pages = min((n + page - 1) / page, min(max_pages, SEL_MAX_PAGES));
    int kvh = head / (n_head / n_head_kv);
    const float* qh = q + ((long)row * n_head + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qh[d];
    __syncthreads();
    int recent_from = max(n_pages - recent, min(sinks, n_pages));
    for (int p = threadIdx.x; p < n_pages; p += blockDim.x) {
        float b;
        if (p < sinks || p >= recent_from) {
            b = MIRAGE_INF;
        } else {
            const float* lo = kmin + (((long)seq * n_head_kv + kvh) * max_pages + p) * head_dim;
            const float* hi = kmax + (((long)seq * n_head_kv + kvh) * max_pages + p) * head_dim;
            b = 0.f;
            for (int d = 0; d < head_dim; d++) b += fmaxf(qs[d] * lo[d], qs[d] * hi[d]);
            if (b != b) b = -MIRAGE_INF;
        }
        bound[p] = b;
    }
    __syncthreads();
    // In 64-bit without min/max overloads (settings may be near INT_MAX).
    long long grown = ((long long)n_pages * top_percent + 99) / 100;
    long long top_eff = grown > top ? grown : (long long)top;
    long long total = (long long)sinks + recent + top_eff;
    int cap = min(n_pages, max_sel);
    int k = total < cap ? (int)total : cap;
    int* out = sel + ((long)row * n_head + head) * max_sel;
    for (int p = threadIdx.x; p < n_pages; p += blockDim.x) {
        float b = bound[p];
        int rank = 0;
        for (int j = 0; j < n_pages && rank < k; j++) {
            float c = bound[j];
            rank += (c > b) || (c == b && j < p);
        }
        if (rank < k) out[rank] = p;
    }
    if (threadIdx.x == 0) nsel[row * n_head + head] = k;
}

// Split-K attention over the selected pages, part 1. Grid (rows, n_head,
// n_split), block ATT_THREADS. Split s takes selected entries [s * per_split,
// (s + 1) * per_split) and writes (m, l, unnormalised V sum) to part as
// dense.cu's attend_part does; a split with no page writes (-inf, 0, 0).
template <typename KV>
__device__ void attend_pages_part(const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
                                  const int* __restrict__ slots, const int* __restrict__ sel,
                                  const int* __restrict__ nsel, int n_head, int n_head_kv, int head_dim, int n_ctx,
                                  int page, int max_sel, int per_split, float scale, float* __restrict__ part) {
    __shared__ float qs[ATT_THREADS];
    __shared__ float sc[ATT_TILE];
    __shared__ float red[ATT_THREADS];
    __shared__ float lred[ATT_THREADS / 64];
    int row = blockIdx.x, head = blockIdx.y, split = blockIdx.z, n_split = gridDim.z;
    int seq = slots[2 * row], n = slots[2 * row + 1] + 1;
    const int* pages = sel + ((long)row * n_head + head) * max_sel;
    int count = nsel[row * n_head + head];
    int e0 = split * per_split, e1 = min(count, e0 + per_split);
    int kvh = head / (n_head / n_head_kv);
    const float* qh = q + ((long)row * n_head + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qh[d];
    const KV* K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    const KV* V = vc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int groups = blockDim.x / head_dim, g = threadIdx.x / head_dim, d = threadIdx.x % head_dim;
    float m = -MIRAGE_INF, l = 0.f, acc = 0.f;
    __syncthreads();
    for (int e = e0; e < e1; e++) {
        int j0 = pages[e] * page, j1 = min(n, j0 + page);
        for (int t0 = j0; t0 < j1; t0 += ATT_TILE) {
            int cnt = min(ATT_TILE, j1 - t0);
            for (int jj = warp; jj < cnt; jj += nw) {
                long kr = (long)(t0 + jj) * head_dim;
                float s = 0.f;
                for (int x = lane; x < head_dim; x += 32) s += qs[x] * kv_load(K, kr + x);
                s = warp_sum(s);
                if (lane == 0) sc[jj] = s * scale;
            }
            __syncthreads();
            float tm = -MIRAGE_INF;
            for (int jj = 0; jj < cnt; jj++) tm = fmaxf(tm, sc[jj]);
            float nm = fmaxf(m, tm);
            float f = expf(m - nm);
            __syncthreads();
            if (threadIdx.x < cnt) sc[threadIdx.x] = expf(sc[threadIdx.x] - nm);
            __syncthreads();
            acc *= f;
            l *= f;
            m = nm;
            if (g < groups) {
                for (int jj = g; jj < cnt; jj += groups) {
                    float p = sc[jj];
                    acc += p * kv_load(V, (long)(t0 + jj) * head_dim + d);
                    l += p;
                }
            }
            __syncthreads();
        }
    }
    if (g < groups) {
        red[g * head_dim + d] = acc;
        if (d == 0) lred[g] = l;
    }
    __syncthreads();
    float* P = part + (((long)row * n_head + head) * n_split + split) * (head_dim + 2);
    for (int x = threadIdx.x; x < head_dim; x += blockDim.x) {
        float a = 0.f;
        for (int k = 0; k < groups; k++) a += red[k * head_dim + x];
        P[2 + x] = a;
    }
    if (threadIdx.x == 0) {
        float ls = 0.f;
        for (int k = 0; k < groups; k++) ls += lred[k];
        P[0] = m;
        P[1] = ls;
    }
}

// Part 2: out[row, head, :] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
// over the splits that saw a page. Grid (rows, n_head), block head_dim.
extern "C" __global__ void attend_pages_combine(const float* __restrict__ part, int n_head, int head_dim,
                                                int n_split, float* __restrict__ out) {
    int row = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    const float* P = part + ((long)row * n_head + head) * n_split * (head_dim + 2);
    float M = -MIRAGE_INF;
    for (int s = 0; s < n_split; s++) M = fmaxf(M, P[s * (head_dim + 2)]);
    float L = 0.f, a = 0.f;
    for (int s = 0; s < n_split; s++) {
        const float* ps = P + s * (head_dim + 2);
        if (ps[0] == -MIRAGE_INF) continue;
        float w = expf(ps[0] - M);
        L += w * ps[1];
        a += w * ps[2 + d];
    }
    out[((long)row * n_head + head) * head_dim + d] = a / L;
}

#define PRUNED_INSTANCE(NAME, KV)                                                                                  \
    extern "C" __global__ void page_bounds_##NAME(const KV* kc, int seq, int n_head_kv, int head_dim, int n_ctx,   \
                                                  int page, int p0, int n, int max_pages, float* kmin,             \
                                                  float* kmax) {                                                   \
        page_bounds<KV>(kc, seq, n_head_kv, head_dim, n_ctx, page, p0, n, max_pages, kmin, kmax);                  \
    }                                                                                                              \
    extern "C" __global__ void attend_pages_part_##NAME(const float* q, const KV* kc, const KV* vc,               \
                                                        const int* slots, const int* sel, const int* nsel,         \
                                                        int n_head, int n_head_kv, int head_dim, int n_ctx,        \
                                                        int page, int max_sel, int per_split, float scale,         \
                                                        float* part) {                                             \
        attend_pages_part<KV>(q, kc, vc, slots, sel, nsel, n_head, n_head_kv, head_dim, n_ctx, page, max_sel,      \
                              per_split, scale, part);                                                             \
    }

PRUNED_INSTANCE(f32, float)
PRUNED_INSTANCE(f16, u16)
