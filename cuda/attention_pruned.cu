// Decode attention over selected KV pages only, the last file of the dense
// module (module::DENSE_SOURCE; it uses warp_sum, kv_load, MIRAGE_INF and
// the ATT_THREADS / ATT_TILE constants of ggml.cu and attention.cu).
//
// KV cache layout per layer as attention.cu: [n_seq, n_head_kv, n_ctx, head_dim].
// Page summaries per layer: kmin / kmax [n_seq, n_head_kv, max_pages,
// head_dim] f32, the per-dimension min and max of the keys of each page of
// `page` positions (an axis-aligned box). For a query q the exact upper bound
// of q.k over the box is sum_d max(q_d min_d, q_d max_d), summed in d order
// as the CPU's kv_pages::page_upper_bound does (bit-equal bounds).
//
// Kernels per decode step and layer (every grid depends on the batch and
// the cache size only; positions come from `slots` in device memory):
//   page_bounds_rows_* refresh the box of the page each row wrote (after
//                      rope_store), or page_bounds_* for a range of pages;
//   page_keys          the bound of every page as an order-preserving u32
//                      key, many blocks per (row, head);
//   select_pages       per (row, query head): radix select of the K-th
//                      largest key, then the chosen pages in increasing
//                      order (sinks, recent window, top pages by bound;
//                      ties by the lower page index);
//   attend_pages_part_* / attend_combine
//                      split-K over the selected pages (online softmax per
//                      split), combined by attention.cu's attend_combine
//                      (chunk 0: every split, the empty ones skipped).
//
// Row r of a launch is batch row row_base + r (slots, q, out); the scratch
// (keys, sel, nsel, part) is indexed by the launch's own row r, so a host
// can launch for single rows of a large batch.
//
// `only_decode` (the backend's mixed batches): rows that share their
// sequence with another row of the batch (prefill) are skipped by the
// selection and attention kernels; they attend every position through
// attention.cu's kernels instead, as the CPU path does (attention_pruned::decode_rows).

// Box of page p of KV head kvh of `seq` over positions [p * page, min(n,
// (p + 1) * page)); block head_dim threads. An empty page gets the empty box
// (+inf, -inf).
template <typename KP>
__device__ void page_box(KP kc, int seq, int kvh, int n_head_kv, int head_dim, int n_ctx, int page,
                         int p, int n, int max_pages, float* __restrict__ kmin, float* __restrict__ kmax) {
    int d = threadIdx.x;
    if (p < 0 || p >= max_pages || d >= head_dim) return;
    const KP K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    int j0 = p * page, j1 = min(min(n, n_ctx), j0 + page);
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

// Boxes of pages p0 .. p0 + gridDim.x of KV head blockIdx.y of `seq` over
// positions < n. Grid (pages, n_head_kv), block head_dim.
template <typename KP>
__device__ void page_bounds(KP kc, int seq, int n_head_kv, int head_dim, int n_ctx, int page,
                            int p0, int n, int max_pages, float* __restrict__ kmin, float* __restrict__ kmax) {
    page_box(kc, seq, blockIdx.y, n_head_kv, head_dim, n_ctx, page, p0 + blockIdx.x, n, max_pages, kmin, kmax);
}

// The box of the page row blockIdx.x wrote, over the positions of its
// sequence up to the last one any row of the batch wrote (rows of one
// sequence in one page write the same box). Grid (n_rows, n_head_kv), block
// head_dim. Every write recomputes its page from the cache, so boxes never
// need work on truncation.
template <typename KP>
__device__ void page_bounds_rows(KP kc, const int* __restrict__ slots, int n_rows, int n_head_kv,
                                 int head_dim, int n_ctx, int page, int max_pages, float* __restrict__ kmin,
                                 float* __restrict__ kmax) {
    int row = blockIdx.x;
    int seq = slots[2 * row], pos = slots[2 * row + 1];
    int n = pos + 1;
    for (int r = 0; r < n_rows; r++)
        if (slots[2 * r] == seq) n = max(n, slots[2 * r + 1] + 1);
    page_box(kc, seq, blockIdx.y, n_head_kv, head_dim, n_ctx, page, pos / page, n, max_pages, kmin, kmax);
}

// Order-preserving key of a bound (larger bound, larger key; -0 below +0
// as total_cmp; NaN as -inf). Forced pages (sinks, recent) get SEL_FORCED,
// above every bound's key.
#define SEL_FORCED 0xffffffffu
__device__ __forceinline__ unsigned int bound_key(float b) {
    if (b != b) b = -MIRAGE_INF;
    unsigned int u = __float_as_uint(b);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return min(u, SEL_FORCED - 1u);
}

// Pages of a row and the number it attends: K = min(sinks + recent +
// max(top, ceil(pages * top_percent / 100)), pages, max_sel)
// (KvPruning::top_for), in 64-bit (settings may be near INT_MAX).
__device__ __forceinline__ int sel_count(int n_pages, int sinks, int recent, int top, int top_percent, int max_sel) {
    long long grown = ((long long)n_pages * top_percent + 99) / 100;
    long long top_eff = grown > top ? grown : (long long)top;
    long long total = (long long)sinks + recent + top_eff;
    int cap = min(n_pages, max_sel);
    return total < cap ? (int)total : cap;
}

// Bound keys. Grid (rows, n_head, ceil(max_pages / blockDim.x)), block
// KEY_THREADS: one thread per page. keys[(row * n_head + head) * max_pages
// + p] for p < the row's page count.
#define KEY_THREADS 128
extern "C" __global__ void page_keys(const float* __restrict__ q, const int* __restrict__ slots,
                                     const float* __restrict__ kmin, const float* __restrict__ kmax, int n_head,
                                     int n_head_kv, int head_dim, int page, int max_pages, int sinks, int recent,
                                     int only_decode, int n_rows, int row_base, unsigned int* __restrict__ keys) {
    PDL_ENTRY();
    __shared__ float qs[256];
    int row = row_base + blockIdx.x, head = blockIdx.y;
    int seq = slots[2 * row], n = slots[2 * row + 1] + 1;
    int n_pages = min((n + page - 1) / page, max_pages);
    int p0 = blockIdx.z * blockDim.x;
    if (p0 >= n_pages || !pruned_row(slots, row, n_rows, only_decode)) return;
    int kvh = head / (n_head / n_head_kv);
    const float* qh = q + ((long)row * n_head + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qh[d];
    __syncthreads();
    int p = p0 + threadIdx.x;
    if (p >= n_pages) return;
    int recent_from = max(n_pages - recent, min(sinks, n_pages));
    unsigned int key;
    if (p < sinks || p >= recent_from) {
        key = SEL_FORCED;
    } else {
        const float* lo = kmin + (((long)seq * n_head_kv + kvh) * max_pages + p) * head_dim;
        const float* hi = kmax + (((long)seq * n_head_kv + kvh) * max_pages + p) * head_dim;
        float b = 0.f;
        for (int d = 0; d < head_dim; d++) b += fmaxf(qs[d] * lo[d], qs[d] * hi[d]);
        key = bound_key(b);
    }
    keys[((long)blockIdx.x * n_head + head) * max_pages + p] = key;
}

// Inclusive block scan of 64-bit counters (blockDim a multiple of 32, at
// most 1024); `wsum` has 32 entries. Returns the exclusive prefix and sets
// *total to the block's sum.
__device__ __forceinline__ unsigned long long block_scan_excl(unsigned long long v, unsigned long long* wsum,
                                                              unsigned long long* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    unsigned long long x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        unsigned long long t = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += t;
    }
    if (lane == 31) wsum[warp] = x;
    __syncthreads();
    if (warp == 0) {
        unsigned long long w = lane < nw ? wsum[lane] : 0ull;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            unsigned long long t = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += t;
        }
        if (lane < nw) wsum[lane] = w;
    }
    __syncthreads();
    unsigned long long before = (warp > 0 ? wsum[warp - 1] : 0ull) + x - v;
    *total = wsum[nw - 1];
    __syncthreads();  // wsum is reused by the next call
    return before;
}

// Page choice. Grid (rows, n_head), block SEL_THREADS. The K largest keys
// (page_keys; ties by the lower page index) are found by a radix select
// (four 8-bit passes over the keys, a histogram each) and written in
// increasing page order to sel[(r * n_head + h) * max_sel ..], their count
// to nsel[r * n_head + h]. Cost O(pages / threads) per pass, whatever K.
#define SEL_THREADS 512
#define SEL_SMEM_KEYS 8192
extern "C" __global__ void select_pages(const unsigned int* __restrict__ keys, const int* __restrict__ slots,
                                        int n_head, int page, int max_pages, int sinks, int recent, int top,
                                        int top_percent, int max_sel, int only_decode, int n_rows, int row_base,
                                        int* __restrict__ sel, int* __restrict__ nsel) {
    PDL_ENTRY();
    __shared__ unsigned int skeys[SEL_SMEM_KEYS];
    __shared__ int hist[256];
    __shared__ unsigned int s_prefix;
    __shared__ int s_remaining;
    __shared__ unsigned long long wsum[32];
    int row = row_base + blockIdx.x, head = blockIdx.y, at = blockIdx.x * n_head + head;
    int n = slots[2 * row + 1] + 1;
    int n_pages = min((n + page - 1) / page, max_pages);
    int* out = sel + (long)at * max_sel;
    if (!pruned_row(slots, row, n_rows, only_decode)) {
        if (threadIdx.x == 0) nsel[at] = 0;
        return;
    }
    int k = sel_count(n_pages, sinks, recent, top, top_percent, max_sel);
    if (k >= n_pages) {
        for (int p = threadIdx.x; p < n_pages; p += blockDim.x) out[p] = p;
        if (threadIdx.x == 0) nsel[at] = n_pages;
        return;
    }
    if (k <= 0) {
        if (threadIdx.x == 0) nsel[at] = 0;
        return;
    }
    const unsigned int* gk = keys + (long)at * max_pages;
    const unsigned int* K = gk;
    if (n_pages <= SEL_SMEM_KEYS) {
        for (int p = threadIdx.x; p < n_pages; p += blockDim.x) skeys[p] = gk[p];
        K = skeys;
    }
    if (threadIdx.x == 0) {
        s_prefix = 0u;
        s_remaining = k;
    }
    unsigned int mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        unsigned int prefix = s_prefix;
        for (int p = threadIdx.x; p < n_pages; p += blockDim.x) {
            unsigned int u = K[p];
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l owns digits 8l .. 8l + 7; counts from the top digit down.
            int lane = threadIdx.x, rem = s_remaining;
            int own = 0;
            for (int b = 0; b < 8; b++) own += hist[8 * lane + b];
            int suffix = own;  // sum over lanes >= lane
            for (int o = 1; o < 32; o <<= 1) {
                int t = __shfl_down_sync(0xffffffffu, suffix, o);
                if (lane + o < 32) suffix += t;
            }
            int above = suffix - own;
            if (above < rem && rem <= suffix) {
                int cum = above;
                for (int b = 7; b >= 0; b--) {
                    int h = hist[8 * lane + b];
                    if (cum + h >= rem) {
                        s_prefix = prefix | ((unsigned int)(8 * lane + b) << shift);
                        s_remaining = rem - cum;
                        break;
                    }
                    cum += h;
                }
            }
        }
        __syncthreads();
        mask |= 255u << shift;
    }
    // The K-th largest key is T = s_prefix; every key above it is chosen and
    // the first s_remaining pages (by index) whose key equals it.
    unsigned int T = s_prefix;
    unsigned long long take_eq = (unsigned long long)s_remaining;
    unsigned long long base = 0ull;  // (equal << 32) | above, before this chunk
    for (int c0 = 0; c0 < n_pages; c0 += blockDim.x) {
        int p = c0 + threadIdx.x;
        unsigned int u = p < n_pages ? K[p] : 0u;
        bool gt = p < n_pages && u > T, eq = p < n_pages && u == T;
        unsigned long long v = (unsigned long long)gt | ((unsigned long long)eq << 32);
        unsigned long long total;
        unsigned long long before = base + block_scan_excl(v, wsum, &total);
        unsigned long long gt_before = before & 0xffffffffull, eq_before = before >> 32;
        unsigned long long at = gt_before + (eq_before < take_eq ? eq_before : take_eq);
        if (gt || (eq && eq_before < take_eq)) out[at] = p;
        base += total;
    }
    if (threadIdx.x == 0) nsel[at] = k;
}

// The union of the pages a KV head's query heads chose (select_pages), for
// the tensor-core pruned attention (attend_pages_mma in attention_mma.cu):
// upages[u + i] for i < ucount[r * n_head_kv + kvh] the pages in increasing
// order and umask[u + i] the heads of the group that chose page upages[i]
// (bit g: query head kvh * G + g), u = (r * n_head_kv + kvh) * max_pages.
// umask is the per-page bitmap while it is built (compacted in place: each
// chunk's reads end before its block scan, and a page moves only down).
// Grid (rows, n_head_kv), block SEL_THREADS; a row the pruned attention
// skips (only_decode) gets count 0.
extern "C" __global__ void union_pages(const int* __restrict__ sel, const int* __restrict__ nsel,
                                       const int* __restrict__ slots, int n_head, int n_head_kv, int page,
                                       int max_pages, int max_sel, int only_decode, int n_rows, int row_base,
                                       int* __restrict__ upages, unsigned* __restrict__ umask,
                                       int* __restrict__ ucount) {
    PDL_ENTRY();
    __shared__ unsigned long long wsum[32];
    const int row = row_base + blockIdx.x, kvh = blockIdx.y, at = blockIdx.x * n_head_kv + kvh;
    if (!pruned_row(slots, row, n_rows, only_decode)) {
        if (threadIdx.x == 0) ucount[at] = 0;
        return;
    }
    const int n = slots[2 * row + 1] + 1, n_pages = min((n + page - 1) / page, max_pages);
    const int G = n_head / n_head_kv;
    const long u = (long)at * max_pages;
    unsigned* bits = umask + u;
    for (int p = threadIdx.x; p < n_pages; p += blockDim.x) bits[p] = 0u;
    __syncthreads();
    for (int g = 0; g < G; g++) {
        const long h = (long)blockIdx.x * n_head + kvh * G + g;
        const int* list = sel + h * max_sel;
        for (int i = threadIdx.x; i < nsel[h]; i += blockDim.x) atomicOr(&bits[list[i]], 1u << g);
    }
    __syncthreads();
    unsigned long long base = 0ull;
    for (int c0 = 0; c0 < n_pages; c0 += blockDim.x) {
        const int p = c0 + threadIdx.x;
        const unsigned m = p < n_pages ? bits[p] : 0u;
        unsigned long long total;
        const unsigned long long at_out = base + block_scan_excl(m != 0u, wsum, &total);
        if (m != 0u) {
            upages[u + at_out] = p;
            bits[at_out] = m;
        }
        base += total;
    }
    if (threadIdx.x == 0) ucount[at] = (int)base;
}

// Split-K attention over the selected pages, part 1. Grid (rows, n_head,
// n_split), block ATT_THREADS. The row's selected pages are cut into
// n_split runs of ceil(count / n_split) pages (in the kernel: the grid does
// not depend on the count); split s walks its run's positions as one
// stream in tiles of ATT_TILE (positions >= n of the partial last page are
// masked) and writes (m, l, unnormalised V sum) to part as attention.cu's
// attend_part does; a split with no page writes (-inf, 0, 0).
template <typename KP>
__device__ void attend_pages_part(const float* __restrict__ q, KP kc, KP vc,
                                  const int* __restrict__ slots, const int* __restrict__ sel,
                                  const int* __restrict__ nsel, int n_head, int n_head_kv, int head_dim, int n_ctx,
                                  int page, int max_sel, int only_decode, int n_rows, int row_base, float scale,
                                  float* __restrict__ part) {
    __shared__ float qs[ATT_THREADS];
    __shared__ float sc[ATT_TILE];
    __shared__ int spos[ATT_TILE];
    __shared__ float red[ATT_THREADS];
    __shared__ float lred[ATT_THREADS / 64];
    int row = row_base + blockIdx.x, head = blockIdx.y, split = blockIdx.z, n_split = gridDim.z;
    int at = blockIdx.x * n_head + head;
    if (!pruned_row(slots, row, n_rows, only_decode)) return;  // the combine skips the row too
    int seq = slots[2 * row], n = min(slots[2 * row + 1] + 1, n_ctx);
    const int* pages = sel + (long)at * max_sel;
    int count = nsel[at];
    int per_split = (count + n_split - 1) / n_split;
    int e0 = min(count, split * per_split), e1 = min(count, e0 + per_split);
    int kvh = head / (n_head / n_head_kv);
    const float* qh = q + ((long)row * n_head + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qh[d];
    const KP K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    const KP V = vc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int groups = blockDim.x / head_dim, g = threadIdx.x / head_dim, d = threadIdx.x % head_dim;
    float m = -MIRAGE_INF, l = 0.f, acc = 0.f;
    long total = (long)(e1 - e0) * page;
    __syncthreads();
    for (long t0 = 0; t0 < total; t0 += ATT_TILE) {
        int cnt = (int)min((long)ATT_TILE, total - t0);
        if (threadIdx.x < cnt) {
            long v = t0 + threadIdx.x;
            int j = pages[e0 + (int)(v / page)] * page + (int)(v % page);
            spos[threadIdx.x] = j < n ? j : -1;
        }
        __syncthreads();
        for (int jj = warp; jj < cnt; jj += nw) {
            int j = spos[jj];
            float s = -MIRAGE_INF;
            if (j >= 0) {
                long kr = (long)j * head_dim;
                s = 0.f;
                for (int x = lane; x < head_dim; x += 32) s += qs[x] * kv_load(K, kr + x);
                s = warp_sum(s) * scale;
            }
            if (lane == 0) sc[jj] = s;
        }
        __syncthreads();
        float tm = -MIRAGE_INF;
        for (int jj = 0; jj < cnt; jj++) tm = fmaxf(tm, sc[jj]);
        float nm = fmaxf(m, tm);
        if (nm == -MIRAGE_INF) {  // nothing valid yet (uniform over the block)
            __syncthreads();
            continue;
        }
        att_rescale(sc, cnt, nm, m, l, acc);
        if (g < groups) {
            for (int jj = g; jj < cnt; jj += groups) {
                int j = spos[jj];
                if (j < 0) continue;
                float p = sc[jj];
                acc += p * kv_load(V, (long)j * head_dim + d);
                l += p;
            }
        }
        __syncthreads();  // before the next tile overwrites sc / spos
    }
    att_store_partial(acc, l, m, g, groups, d, head_dim, red, lred,
                      part + ((long)at * n_split + split) * (head_dim + 2));
}


// Per cache type, as attention.cu's KV_INSTANCE (KV_SCALES, KV_CACHE): the
// page boxes read only the keys, so their q8_0 kernels take the key
// scales alone (KV_KSCALES).
#define KV_KSCALES_f32
#define KV_KSCALES_f16
#define KV_KSCALES_q8_0 , const u16 *kd
#define PRUNED_INSTANCE(NAME, KV)                                                                                  \
    extern "C" __global__ void page_bounds_##NAME(const KV* kc, int seq, int n_head_kv, int head_dim, int n_ctx,   \
                                                  int page, int p0, int n, int max_pages, float* kmin,             \
                                                  float* kmax KV_KSCALES_##NAME) {                                  \
        PDL_ENTRY();                                                                                               \
        page_bounds(KV_CACHE_##NAME(kc, kd), seq, n_head_kv, head_dim, n_ctx, page, p0, n, max_pages, kmin, kmax); \
    }                                                                                                              \
    extern "C" __global__ void page_bounds_rows_##NAME(const KV* kc, const int* slots, int n_rows, int n_head_kv,  \
                                                       int head_dim, int n_ctx, int page, int max_pages,           \
                                                       float* kmin, float* kmax KV_KSCALES_##NAME) {                \
        PDL_ENTRY();                                                                                               \
        page_bounds_rows(KV_CACHE_##NAME(kc, kd), slots, n_rows, n_head_kv, head_dim, n_ctx, page, max_pages,      \
                         kmin, kmax);                                                                              \
    }                                                                                                              \
    extern "C" __global__ void attend_pages_part_##NAME(const float* q, const KV* kc, const KV* vc,               \
                                                        const int* slots, const int* sel, const int* nsel,         \
                                                        int n_head, int n_head_kv, int head_dim, int n_ctx,        \
                                                        int page, int max_sel, int only_decode, int n_rows,        \
                                                        int row_base, float scale,                                 \
                                                        float* part KV_SCALES_##NAME) {                             \
        PDL_ENTRY();                                                                                               \
        attend_pages_part(q, KV_CACHE_##NAME(kc, kd), KV_CACHE_##NAME(vc, vd), slots, sel, nsel, n_head,          \
                          n_head_kv, head_dim, n_ctx, page, max_sel, only_decode, n_rows, row_base, scale, part);  \
    }

PRUNED_INSTANCE(f32, float)
PRUNED_INSTANCE(f16, u16)
PRUNED_INSTANCE(q8_0, i8)
