// Host check of cuda/attention_pruned.cu (no GPU): the kernels compiled as
// C++ and run block by block (block_emu.h; shared atomics = plain adds).
//   1. page_keys + select_pages choose exactly the pages of the CPU rule
//      (kv_pages::PageSummaries::select with ties to the lower page index:
//      a stable sort by bound) on random boxes, with forced duplicates of
//      bounds (ties), NaN queries, every K from 0 to all pages, page counts
//      on both sides of the shared-memory key limit, only_decode/row_base;
//   2. attend_pages_part + attend_combine (attention.cu) over a chosen list equal an
//      f64 softmax over the same positions (partial last page, empty splits,
//      an empty list), over f32 and q8_0 caches (kv_caches.h; q8_0: the
//      codes times their f16 scales).
// union_pages and the tensor-core attention over its union are checked by
// check_pruned_mma.cpp.
// Build and run: hostcheck/run.sh.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <type_traits>
#include "block_emu.h"

typedef unsigned short u16;
typedef unsigned int u32;
#define __global__
#define MIRAGE_INF INFINITY
#define ATT_THREADS 256
#define ATT_TILE 64
// Programmatic dependent launch (cuda/pdl.cu) orders kernels on the device;
// here kernels run one after another anyway.
#define PDL_ENTRY()
inline float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
inline u32 __float_as_uint(float f) { u32 u; memcpy(&u, &f, 4); return u; }
inline long min(long a, long b) { return a < b ? a : b; }
inline u32 min(u32 a, u32 b) { return a < b ? a : b; }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }

typedef signed char i8;
inline float h2f(u16 h) {
    u32 s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? INFINITY : std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
#include "att_emu.h"  // kv_load of f32 and f16 caches, f2h

#include "att_partial_extract.h"
#include "attention_pruned.cu"
#include "kv_caches.h"

// Runs `f` over the grid, one block at a time, `threads` threads each.
static void launch(dim3_ grid, unsigned threads, const std::function<void()>& f) {
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) run_block(threads, dim3_{x, y, z}, f);
}

static int failures = 0;
#define CHECK(c, ...)                         \
    do {                                      \
        if (!(c)) {                           \
            failures++;                       \
            fprintf(stderr, "FAIL: " __VA_ARGS__); \
            fprintf(stderr, "\n");            \
        }                                     \
    } while (0)

// The CPU rule (kv_pages.rs), ties to the lower index (stable sort).
static std::vector<int> cpu_select(int n_pages, int sinks, int recent, int top, int top_percent,
                                   const std::vector<float>& bound) {
    long long grown = ((long long)n_pages * top_percent + 99) / 100;
    long long top_eff = std::max<long long>(grown, top);
    std::vector<int> out;
    if ((long long)n_pages <= (long long)sinks + recent + top_eff) {
        for (int p = 0; p < n_pages; p++) out.push_back(p);
        return out;
    }
    int s = std::min(sinks, n_pages);
    int recent_from = std::max(n_pages - recent, s);
    std::vector<std::pair<float, int>> b;
    for (int p = s; p < recent_from; p++) b.push_back({bound[p], p});
    std::stable_sort(b.begin(), b.end(), [](auto& x, auto& y) {
        // total_cmp descending, NaN as -inf (the device's mapping).
        float a = std::isnan(x.first) ? -INFINITY : x.first, c = std::isnan(y.first) ? -INFINITY : y.first;
        u32 ua = __float_as_uint(a), uc = __float_as_uint(c);
        ua = (ua & 0x80000000u) ? ~ua : (ua | 0x80000000u);
        uc = (uc & 0x80000000u) ? ~uc : (uc | 0x80000000u);
        return ua > uc;
    });
    long long t = std::min<long long>(top_eff, (long long)b.size());
    for (int p = 0; p < s; p++) out.push_back(p);
    for (long long i = 0; i < t; i++) out.push_back(b[i].second);
    for (int p = recent_from; p < n_pages; p++) out.push_back(p);
    std::sort(out.begin(), out.end());
    return out;
}

static void check_selection(std::mt19937& rng, int n_pages, int sinks, int recent, int top, int top_percent,
                            int ties, bool nan_q, int only_decode, int row_base) {
    const int n_head = 2, n_head_kv = 1, head_dim = 32, page = 16, n_rows = 3;
    int max_pages = n_pages + 3;
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    // Rows: (seq 0, pos) for the checked row, the others sharing seq 0 or not.
    std::vector<int> slots(2 * n_rows);
    int pos = n_pages * page - 1 - (int)(rng() % page);
    for (int r = 0; r < n_rows; r++) {
        slots[2 * r] = r + 1;
        slots[2 * r + 1] = 5;
    }
    int row = row_base;  // the row the launch (one row) looks at
    slots[2 * row] = 0;
    slots[2 * row + 1] = pos;
    std::vector<float> q((size_t)n_rows * n_head * head_dim), kmin((size_t)max_pages * head_dim),
        kmax((size_t)max_pages * head_dim);
    for (auto& x : q) x = u(rng);
    if (nan_q) q[(size_t)(row * n_head + 1) * head_dim + 3] = NAN;
    for (int p = 0; p < max_pages; p++)
        for (int d = 0; d < head_dim; d++) {
            float a = u(rng) + 0.3f * std::sin(p * 0.7f), b = u(rng) + 0.3f * std::sin(p * 0.7f);
            kmin[(size_t)p * head_dim + d] = std::min(a, b);
            kmax[(size_t)p * head_dim + d] = std::max(a, b);
        }
    // Ties: copy boxes of page 1 into `ties` other pages (equal bounds).
    for (int i = 0; i < ties && n_pages > 2; i++) {
        int p = 2 + (int)(rng() % (n_pages - 2));
        memcpy(&kmin[(size_t)p * head_dim], &kmin[head_dim], head_dim * 4);
        memcpy(&kmax[(size_t)p * head_dim], &kmax[head_dim], head_dim * 4);
    }
    long long grown = ((long long)max_pages * top_percent + 99) / 100;
    long long total = (long long)sinks + recent + std::max<long long>(grown, top);
    int max_sel = (int)std::max<long long>(1, std::min<long long>(total, max_pages));
    std::vector<u32> keys((size_t)n_head * max_pages, 0xdeadbeefu);
    std::vector<int> sel((size_t)n_head * max_sel, -7), nsel(n_head, -7);
    launch({1, (unsigned)n_head, (unsigned)((max_pages + KEY_THREADS - 1) / KEY_THREADS)}, KEY_THREADS, [&] {
        page_keys(q.data(), slots.data(), kmin.data(), kmax.data(), n_head, n_head_kv, head_dim, page, max_pages,
                  sinks, recent, only_decode, n_rows, row_base, keys.data());
    });
    launch({1, (unsigned)n_head, 1}, SEL_THREADS, [&] {
        select_pages(keys.data(), slots.data(), n_head, page, max_pages, sinks, recent, top, top_percent, max_sel,
                     only_decode, n_rows, row_base, sel.data(), nsel.data());
    });
    int n_pg = (pos + 1 + page - 1) / page;
    for (int h = 0; h < n_head; h++) {
        const float* qh = &q[(size_t)(row * n_head + h) * head_dim];
        std::vector<float> bound(n_pg);
        for (int p = 0; p < n_pg; p++) {
            float b = 0.f;
            for (int d = 0; d < head_dim; d++)
                b += std::max(qh[d] * kmin[(size_t)p * head_dim + d], qh[d] * kmax[(size_t)p * head_dim + d]);
            bound[p] = b;
        }
        std::vector<int> want = cpu_select(n_pg, sinks, recent, top, top_percent, bound);
        if ((long long)want.size() > max_sel) want.resize(max_sel);  // cannot happen (max_sel >= total)
        std::vector<int> got(sel.begin() + (size_t)h * max_sel, sel.begin() + (size_t)h * max_sel + std::max(0, nsel[h]));
        bool same = got == want;
        CHECK(same, "selection differs: pages %d sinks %d recent %d top %d top%% %d ties %d nan %d head %d: got %zu want %zu pages",
              n_pg, sinks, recent, top, top_percent, ties, (int)nan_q, h, got.size(), want.size());
        if (!same && got.size() == want.size())
            for (size_t i = 0; i < got.size(); i++)
                if (got[i] != want[i]) {
                    fprintf(stderr, "  first difference at %zu: got %d want %d\n", i, got[i], want[i]);
                    break;
                }
    }
}

// The cache S holding the values x (q8_0: quantized by q8_ref_block).
static void hold(F32& c, const std::vector<float>& x) { c.v = x; }
static void hold(Q8& c, const std::vector<float>& x) { c.quantize(0, x.data(), (int)x.size()); }

template <class S>
static void check_attention(std::mt19937& rng, int n_split, int count_pages, int partial) {
    const int n_head = 4, n_head_kv = 2, head_dim = 64, page = 16, n_ctx = 40 * page + 5, n_rows = 2, max_sel = 40;
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    int pos = (n_ctx / page - 1) * page + partial;  // the last page holds partial + 1 positions
    if (pos >= n_ctx) pos = n_ctx - 1;
    std::vector<int> slots = {1, 7, 0, pos};
    std::vector<float> q((size_t)n_rows * n_head * head_dim), k((size_t)2 * n_head_kv * n_ctx * head_dim),
        v(k.size());
    for (auto& x : q) x = 2.f * u(rng);
    for (auto& x : k) x = u(rng);
    for (auto& x : v) x = u(rng);
    int n_pg = pos / page + 1;
    std::vector<int> sel((size_t)n_rows * n_head * max_sel, -1), nsel(n_rows * n_head, 0);
    std::vector<std::vector<int>> chosen(n_head);
    for (int h = 0; h < n_head; h++) {
        std::vector<int> all(n_pg);
        for (int p = 0; p < n_pg; p++) all[p] = p;
        std::shuffle(all.begin(), all.end() - 1, rng);
        int c = std::min(count_pages, n_pg);
        std::vector<int> pick(all.begin(), all.begin() + std::max(0, c - 1));
        if (c > 0) pick.push_back(n_pg - 1);  // the partial last page
        std::sort(pick.begin(), pick.end());
        chosen[h] = pick;
        int at = 1 * n_head + h;  // row 1 in a launch of rows 0..1
        for (size_t i = 0; i < pick.size(); i++) sel[(size_t)at * max_sel + i] = pick[i];
        nsel[at] = (int)pick.size();
    }
    S kc(k.size()), vc(v.size());
    hold(kc, k);
    hold(vc, v);
    std::vector<float> part((size_t)n_rows * n_head * n_split * (head_dim + 2), NAN),
        out((size_t)n_rows * n_head * head_dim, -99.f);
    float scale = 1.f / std::sqrt((float)head_dim);
    // only_decode on: row 1 (seq 0) is alone, row 0 (seq 1) too; both run.
    launch({(unsigned)n_rows, (unsigned)n_head, (unsigned)n_split}, ATT_THREADS, [&] {
        attend_pages_part(q.data(), kc.cptr(), vc.cptr(), slots.data(), sel.data(), nsel.data(), n_head, n_head_kv,
                          head_dim, n_ctx, page, max_sel, 1, n_rows, 0, scale, part.data());
    });
    launch({(unsigned)n_rows, (unsigned)n_head, 1}, AC_THREADS / head_dim * head_dim, [&] {
        attend_combine_body(part.data(), slots.data(), n_head, head_dim, n_split, 0, 1, n_rows, 0, out.data());
    });
    double worst = 0;
    for (int h = 0; h < n_head; h++) {
        int kvh = h / (n_head / n_head_kv);
        const float* qh = &q[(size_t)(1 * n_head + h) * head_dim];
        const size_t K = (size_t)(0 * n_head_kv + kvh) * n_ctx * head_dim, V = K;
        std::vector<int> ps;
        for (int p : chosen[h])
            for (int j = p * page; j < std::min((p + 1) * page, pos + 1); j++) ps.push_back(j);
        std::vector<double> s(ps.size());
        double m = -INFINITY;
        for (size_t i = 0; i < ps.size(); i++) {
            double acc = 0;
            for (int d = 0; d < head_dim; d++) acc += (double)qh[d] * kc.get(K + (size_t)ps[i] * head_dim + d);
            s[i] = acc * scale;
            m = std::max(m, s[i]);
        }
        double l = 0;
        for (auto& x : s) l += (x = std::exp(x - m));
        for (int d = 0; d < head_dim; d++) {
            double a = 0;
            for (size_t i = 0; i < ps.size(); i++) a += s[i] * vc.get(V + (size_t)ps[i] * head_dim + d);
            double want = ps.empty() ? 0.0 : a / l;
            worst = std::max(worst, std::fabs(want - out[(size_t)(1 * n_head + h) * head_dim + d]));
        }
    }
    const char* ty = std::is_same_v<S, Q8> ? " q8_0" : "";
    CHECK(worst < 2e-5, "attention over pages%s off f64 by %g (n_split %d, pages %d, partial %d)", ty, worst,
          n_split, count_pages, partial);
    printf("attend_pages%s n_split %2d pages %2d partial %2d: max abs err %.2e\n", ty, n_split, count_pages, partial,
           worst);
}

int main() {
    std::mt19937 rng(7);
    int cases = 0;
    // Every K from nothing to all pages, small page counts.
    for (int top = 0; top <= 12; top++) {
        check_selection(rng, 12, 1, 2, top, 0, 0, false, 0, 0);
        cases++;
    }
    struct C { int pages, sinks, recent, top, pct, ties; bool nan; int only_decode, row_base; };
    C cs[] = {
        {1, 4, 8, 32, 0, 0, false, 0, 0},       {40, 4, 8, 3, 0, 5, false, 0, 0},
        {200, 1, 2, 8, 0, 30, false, 0, 0},     {200, 0, 0, 17, 0, 0, false, 1, 2},
        {300, 4, 8, 32, 20, 10, false, 0, 1},   {300, 1, 2, 8, 0, 0, true, 0, 0},
        {2051, 4, 8, 32, 20, 50, false, 0, 0},  {2051, 1, 2, 8, 0, 0, false, 1, 0},
        {2051, 0, 0, 0, 10, 300, false, 0, 0},  {9000, 4, 8, 32, 20, 40, false, 0, 0},
        {9000, 1, 1, 100, 0, 0, false, 0, 2},   {777, 1000000000, 8, 2000000000, 0, 0, false, 0, 0},
    };
    for (auto& c : cs) {
        check_selection(rng, c.pages, c.sinks, c.recent, c.top, c.pct, c.ties, c.nan, c.only_decode, c.row_base);
        cases++;
    }
    printf("selection: %d cases x 2 heads checked against the CPU rule\n", cases);
    for (int n_split : {1, 3, 8, 50})
        for (int pages : {0, 1, 5, 40})
            for (int partial : {0, 15}) check_attention<F32>(rng, n_split, pages, partial);
    // The q8_0 cache (its own generator: the cases above keep their data).
    std::mt19937 rq(23);
    for (int n_split : {1, 8})
        for (int pages : {1, 40})
            for (int partial : {0, 15}) check_attention<Q8>(rq, n_split, pages, partial);
    if (failures) {
        printf("%d FAILURES\n", failures);
        return 1;
    }
    printf("all pruned-attention host checks passed\n");
    return 0;
}
