// Host check of the pruned decode attention on f16 tensor cores (no GPU;
// extract.py -> split_mma_extract.h, union_extract.h): union_pages
// (attention_pruned.cu) and attend_split_mma<HD, true> (attention_mma.cu)
// with attend_combine (chunk 0), blocks run as fibers (block_emu.h), the
// mma instruction emulated by the PTX ISA's fragment layout (mma_emu.h),
// the cp.async copies landing at issue and, again, as late as their waits
// allow (cp_async_emu.h):
//   1. union_pages writes per (launch row, KV head) exactly the union of
//      the group's chosen pages in increasing order, per page the bitmask
//      of the heads that chose it, and the count: hand-made choices
//      (overlapping, disjoint and identical pages, heads with no page, a
//      group with none), random ones over up to 1500 pages (several
//      chunks of the block's scan), groups of 1, 4, 7 and 16, row_base > 0,
//      and rows that share a sequence with another row of the batch given
//      count 0 under only_decode;
//   2. attend_split_mma<HD, true> + attend_combine_body (chunk 0) against
//      an f64 softmax of each query head over the positions of its own
//      chosen pages below its row's length (the cache as the kernel
//      multiplies it: f16; q8_0 (kv_caches.h, arrays ending at an
//      unreadable page): each code times its scale rounded once to f16),
//      head sizes 64 and 128, groups of 1, 7 and 16, pages of 16 and 64
//      positions, partial last pages, one split to more splits than the
//      union has pages (empty splits write m = -inf, l = 0); both copy
//      timings give the same partial and output bits, every copy issued
//      lands, rows skipped by only_decode (and rows outside the launch)
//      are left unwritten, the dynamic shared memory poisoned;
//   3. a head that chose every page gives the output of the unpruned
//      attend_split_mma<HD> of its row.
// Build and run: hostcheck/run.sh.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <type_traits>
#include <vector>
#include "block_emu.h"

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
#define MIRAGE_INF INFINITY
#define __align__(n) __attribute__((aligned(n)))
#define __global__
// Programmatic dependent launch (cuda/pdl.cu) orders kernels on the device;
// here kernels run one after another anyway.
#define PDL_ENTRY()
#include "ptx_emu.h"
#include "att_emu.h"
#include "mma_emu.h"
#include "cp_async_emu.h"
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float block_sum(float, float*) { abort(); }  // rope_store's q/k norm: not used here
#include "split_mma_extract.h"
#include "union_extract.h"
#include "kv_caches.h"
#include "mma_smem.h"

static int fails = 0;
#define CHECK(c, ...)                          \
    do {                                       \
        if (!(c)) {                            \
            fails++;                           \
            printf("FAIL: " __VA_ARGS__);      \
            printf("\n");                      \
        }                                      \
    } while (0)

// A launch of the pruned attention: n_rows batch rows (slots), of which
// launch row r is batch row row_base + r; chosen[r * n_head + h] the pages
// query head h of launch row r chose (increasing), as select_pages writes
// them into sel / nsel.
struct Launch {
    int n_head, n_head_kv, page, max_pages, only_decode, n_rows, row_base, rows;
    std::vector<int> slots;
    std::vector<std::vector<int>> chosen;
    int max_sel = 1;
    std::vector<int> sel, nsel;
    int G() const { return n_head / n_head_kv; }
    int n(int r) const { return slots[2 * (row_base + r) + 1] + 1; }
    int n_pages(int r) const { return std::min((n(r) + page - 1) / page, max_pages); }
    // Batch row row alone in its sequence (or only_decode off).
    bool runs(int r) const {
        if (!only_decode) return true;
        const int row = row_base + r;
        for (int x = 0; x < n_rows; x++)
            if (x != row && slots[2 * x] == slots[2 * row]) return false;
        return true;
    }
    void pack() {
        for (auto& c : chosen) max_sel = std::max<int>(max_sel, (int)c.size());
        sel.assign((size_t)rows * n_head * max_sel, -1);
        nsel.assign((size_t)rows * n_head, 0);
        for (size_t i = 0; i < chosen.size(); i++) {
            std::copy(chosen[i].begin(), chosen[i].end(), sel.begin() + i * max_sel);
            nsel[i] = (int)chosen[i].size();
        }
    }
};

// The union of a group's pages, written out plainly: pages in increasing
// order, per page the heads that chose it.
struct Union {
    std::vector<int> pages;
    std::vector<u32> mask;
};
static Union cpu_union(const Launch& L, int r, int kvh) {
    Union u;
    if (!L.runs(r)) return u;
    std::map<int, u32> by_page;
    for (int g = 0; g < L.G(); g++)
        for (int p : L.chosen[(size_t)r * L.n_head + kvh * L.G() + g]) by_page[p] |= 1u << g;
    for (auto& [p, m] : by_page) {
        u.pages.push_back(p);
        u.mask.push_back(m);
    }
    return u;
}

// union_pages over L (outputs poisoned first), checked against cpu_union.
struct UnionOut {
    std::vector<int> upages, ucount;
    std::vector<u32> umask;
};
static UnionOut run_union(const Launch& L, const char* what) {
    UnionOut o;
    o.upages.assign((size_t)L.rows * L.n_head_kv * L.max_pages, -7);
    o.umask.assign(o.upages.size(), 0xdeadbeefu);
    o.ucount.assign((size_t)L.rows * L.n_head_kv, -7);
    gridDim = dim3_{(unsigned)L.rows, (unsigned)L.n_head_kv, 1};
    for (unsigned y = 0; y < gridDim.y; y++)
        for (unsigned x = 0; x < gridDim.x; x++)
            run_block(SEL_THREADS, dim3_{x, y, 0}, [&] {
                union_pages(L.sel.data(), L.nsel.data(), L.slots.data(), L.n_head, L.n_head_kv, L.page, L.max_pages,
                            L.max_sel, L.only_decode, L.n_rows, L.row_base, o.upages.data(), o.umask.data(),
                            o.ucount.data());
            });
    for (int r = 0; r < L.rows; r++)
        for (int kvh = 0; kvh < L.n_head_kv; kvh++) {
            const Union want = cpu_union(L, r, kvh);
            const int at = r * L.n_head_kv + kvh, count = o.ucount[at];
            const size_t u = (size_t)at * L.max_pages;
            bool same = count == (int)want.pages.size();
            for (int i = 0; same && i < count; i++)
                same = o.upages[u + i] == want.pages[i] && o.umask[u + i] == want.mask[i];
            CHECK(same, "union_pages (%s) launch row %d KV head %d (G %d, only_decode %d): count %d want %zu", what, r,
                  kvh, L.G(), L.only_decode, count, want.pages.size());
        }
    return o;
}

// Hand-made choices: batch rows 0..4 (rows 1 and 3 of one sequence),
// launch rows 1..4, two KV heads of 4 query heads.
static void check_union_hand(int only_decode) {
    Launch L{8, 2, 16, 24, only_decode, 5, 1, 4, {}, {}};
    // (seq, pos): 20 pages exactly, 10 (partial), 7 (partial), 1 (partial).
    L.slots = {0, 40, 1, 16 * 20 - 1, 2, 16 * 9 + 3, 1, 100, 3, 15};
    auto range = [](int a, int b) {
        std::vector<int> v;
        for (int p = a; p < b; p++) v.push_back(p);
        return v;
    };
    L.chosen = {
        // launch row 0 (batch row 1): overlapping, a head with none,
        // disjoint; every page, the first, the last, none.
        {0, 1, 2}, {1, 2, 3}, {}, {5, 6}, range(0, 20), {0}, {19}, {},
        // launch row 1: one page for the whole group; a group with none.
        {9}, {9}, {9}, {9}, {}, {}, {}, {},
        // launch row 2 (batch row 3, seq 1 again): interleaved and all.
        {0, 2, 4, 6}, {1, 3, 5}, range(0, 7), {}, {3}, {}, {}, {6},
        // launch row 3: the one page.
        {0}, {0}, {0}, {0}, {0}, {}, {0}, {},
    };
    L.pack();
    run_union(L, "hand-made");
}

// Random choices: per head a density (none to every page), rows of
// 1 .. 1500 pages, rows 1 and 3 of the batch in one sequence.
static void check_union_random(std::mt19937& rng, int n_head, int n_head_kv, int page, int only_decode) {
    const int n_rows = 5, rows = 3, row_base = 2;
    std::uniform_int_distribution<int> len(1, 1500 * page);
    Launch L{n_head, n_head_kv, page, 1500, only_decode, n_rows, row_base, rows, {}, {}};
    for (int x = 0; x < n_rows; x++) {
        L.slots.push_back(x == 3 ? 1 : x);
        L.slots.push_back(len(rng) - 1);
    }
    const double dens[] = {0.0, 0.002, 0.05, 0.5, 1.0};
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < n_head; h++) {
            const double d = dens[rng() % 5];
            std::vector<int> c;
            for (int p = 0; p < L.n_pages(r); p++)
                if (u(rng) < d) c.push_back(p);
            L.chosen.push_back(c);
        }
    L.pack();
    run_union(L, "random");
}

static bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

static double worst_ref = 0, worst_full = 0;

// The pruned attention of launch rows 0..2 = batch rows 1..3 of a batch of
// 4: batch row 0 (seq 1, not launched), 1 (seq 0, len0), 2 (seq 2, len2:
// the cache's last sequence) and 3 (seq 1, len1: skipped under
// only_decode, as it shares seq 1 with row 0).
template <class S, int HD>
static void check_att(std::mt19937& rng, int n_head, int n_head_kv, int page, int n_split, int len0, int len1,
                      int len2, int only_decode, int spare) {
    const int n_rows = 4, rows = 3, row_base = 1, n_seq = 3, G = n_head / n_head_kv;
    const int n_ctx = std::max({len0, len1, len2}) + spare, max_pages = (n_ctx + page - 1) / page;
    Launch L{n_head, n_head_kv, page, max_pages, only_decode, n_rows, row_base, rows, {}, {}};
    L.slots = {1, len1 / 2, 0, len0 - 1, 2, len2 - 1, 1, len1 - 1};
    // Per head a kind of choice: every page; about a quarter and the
    // (partial) last page; a stripe (disjoint within the group); a core the
    // group shares; none; about 60% without the last page.
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::vector<char> every((size_t)rows * n_head, 0);
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < n_head; h++) {
            const int np = L.n_pages(r), g = h % G, stripe = std::max(G, 3);
            std::vector<int> c;
            for (int p = 0; p < np; p++) {
                bool take = false;
                switch ((h + r) % 6) {
                    case 0: take = true; break;
                    case 1: take = p == np - 1 || u(rng) < 0.25; break;
                    case 2: take = p % stripe == g % stripe; break;
                    case 3: take = p == 0 || (p * 7 + r) % 5 == 0; break;
                    case 4: take = false; break;
                    case 5: take = p != np - 1 && u(rng) < 0.6; break;
                }
                if (take) c.push_back(p);
            }
            every[(size_t)r * n_head + h] = (int)c.size() == np;
            L.chosen.push_back(c);
        }
    L.pack();
    const UnionOut U = run_union(L, S::name);

    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> q((size_t)n_rows * n_head * HD);
    for (auto& v : q) v = 1.5f * nd(rng);
    S kc((size_t)n_seq * n_head_kv * n_ctx * HD), vc(kc.size());
    kc.fill(rng, nd);
    vc.fill(rng, nd);
    const float scale = 1.f / std::sqrt((float)HD);
    const MmaPages pg{U.upages.data(), U.umask.data(), U.ucount.data(), max_pages, page, only_decode, n_rows,
                      row_base};
    std::vector<float> part_eager, out_eager;
    for (cp_async_emu::Mode mode : {cp_async_emu::Eager, cp_async_emu::Deferred}) {
        cp_async_emu::mode = mode;
        std::vector<float> part((size_t)rows * n_head * n_split * (HD + 2), NAN);
        std::vector<float> out((size_t)n_rows * n_head * HD, -99.f);
        Smem<S, HD> smem(0x7e00);  // a read of a stage before its copies landed shows
        const int undrained = run_mma_grid<HD>(rows, n_head_kv, n_split, [&] {
            attend_split_mma<HD, true>(q.data(), kc.ptr(), vc.ptr(), L.slots.data(), n_head, n_head_kv, n_ctx, 0,
                                       scale, part.data(), nullptr, nullptr, 0, nullptr, smem.data(), pg);
        });
        CHECK(undrained == 0, "cp.async copies still in flight at a block's end");
        gridDim = dim3_{(unsigned)rows, (unsigned)n_head, 1};
        for (unsigned r = 0; r < (unsigned)rows; r++)
            for (unsigned h = 0; h < (unsigned)n_head; h++)
                run_block(AC_THREADS / HD * HD, dim3_{r, h, 0}, [&] {
                    attend_combine_body(part.data(), L.slots.data(), n_head, HD, n_split, 0, only_decode, n_rows,
                                        row_base, out.data());
                });
        if (mode == cp_async_emu::Eager) {
            part_eager = part;
            out_eager = out;
        } else {
            CHECK(same_bits(part, part_eager) && same_bits(out, out_eager),
                  "the copies' timing changed the partials or the output");
        }
    }
    // The partials: every split of a launched row written (an empty one
    // m = -inf, l = 0, sums 0), the skipped rows' untouched; the output of
    // rows outside the launch or skipped untouched.
    int unwritten = 0, bad_empty = 0, touched = 0, empty = 0;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < n_head; h++) {
            const int kvh = h / G, count = U.ucount[r * n_head_kv + kvh], per = (count + n_split - 1) / n_split;
            for (int z = 0; z < n_split; z++) {
                const float* P = &part_eager[(((size_t)r * n_head + h) * n_split + z) * (HD + 2)];
                const int e0 = std::min(count, z * per), e1 = std::min(count, e0 + per);
                for (int i = 0; i < HD + 2; i++) {
                    if (L.runs(r))
                        unwritten += std::isnan(P[i]);
                    else
                        touched += !std::isnan(P[i]);
                }
                if (L.runs(r) && e0 == e1) {
                    empty++;
                    for (int i = 0; i < HD + 2; i++) bad_empty += P[i] != (i == 0 ? -INFINITY : 0.f);
                }
            }
        }
    for (int x = 0; x < n_rows; x++)
        if (x < row_base || !L.runs(x - row_base))
            for (int i = 0; i < n_head * HD; i++) touched += out_eager[(size_t)x * n_head * HD + i] != -99.f;
    CHECK(!unwritten && !bad_empty && !touched,
          "%d partial floats unwritten, %d floats of empty splits not (-inf, 0, 0..), %d floats of skipped rows "
          "written", unwritten,
          bad_empty, touched);

    // The unpruned attention of every batch row (its own splits).
    std::vector<float> out_full((size_t)n_rows * n_head * HD, -99.f);
    {
        cp_async_emu::mode = cp_async_emu::Eager;
        const int chunk = (n_ctx + n_split - 1) / n_split;
        std::vector<float> part((size_t)n_rows * n_head * n_split * (HD + 2), NAN);
        Smem<S, HD> smem(0x7e00);
        run_mma_grid<HD>(n_rows, n_head_kv, n_split, [&] {
            attend_split_mma<HD>(q.data(), kc.ptr(), vc.ptr(), L.slots.data(), n_head, n_head_kv, n_ctx, chunk, scale,
                                 part.data(), nullptr, nullptr, 0, nullptr, smem.data());
        });
        gridDim = dim3_{(unsigned)n_rows, (unsigned)n_head, 1};
        for (unsigned r = 0; r < (unsigned)n_rows; r++)
            for (unsigned h = 0; h < (unsigned)n_head; h++)
                run_block(AC_THREADS / HD * HD, dim3_{r, h, 0}, [&] {
                    attend_combine_body(part.data(), L.slots.data(), n_head, HD, n_split, chunk, 0, n_rows, 0,
                                        out_full.data());
                });
    }

    // Each head against f64 over its own pages; the heads that chose every
    // page against the unpruned output.
    double worst = 0, worst_f = 0;
    int n_every = 0;
    for (int r = 0; r < rows; r++) {
        if (!L.runs(r)) continue;
        const int row = row_base + r, seq = L.slots[2 * row], n = L.n(r);
        for (int h = 0; h < n_head; h++) {
            const float* qh = &q[((size_t)row * n_head + h) * HD];
            const size_t K = ((size_t)seq * n_head_kv + h / G) * n_ctx * HD, V = K;
            std::vector<int> ps;
            for (int p : L.chosen[(size_t)r * n_head + h])
                for (int j = p * page; j < std::min((p + 1) * page, n); j++) ps.push_back(j);
            std::vector<double> s(ps.size());
            double m = -INFINITY, l = 0;
            for (size_t i = 0; i < ps.size(); i++) {
                double a = 0;
                for (int d = 0; d < HD; d++) a += (double)qh[d] * kc.get_f16(K + (size_t)ps[i] * HD + d);
                s[i] = a * scale;
                m = std::max(m, s[i]);
            }
            for (auto& x : s) l += (x = std::exp(x - m));
            const bool all = every[(size_t)r * n_head + h];
            n_every += all;
            for (int d = 0; d < HD; d++) {
                double o = 0;
                for (size_t i = 0; i < ps.size(); i++) o += s[i] * vc.get_f16(V + (size_t)ps[i] * HD + d);
                const double want = ps.empty() ? 0.0 : o / l;
                const float got = out_eager[((size_t)row * n_head + h) * HD + d];
                worst = std::isnan(got) ? INFINITY : std::max(worst, std::fabs(got - want));
                if (all) {
                    const float full = out_full[((size_t)row * n_head + h) * HD + d];
                    worst_f = std::isnan(full) ? INFINITY : std::max(worst_f, (double)std::fabs(got - full));
                }
            }
        }
    }
    worst_ref = std::max(worst_ref, worst);
    worst_full = std::max(worst_full, worst_f);
    // As check_split_mma.cpp: Q and P as f16 hi + lo parts, about 2^-22 of
    // each; one f16 rounding of either gives 1e-4 and more.
    const bool ok = worst < 1e-5 && worst_f < 1e-5;
    fails += !ok;
    printf("attend_pages_mma%s head_dim %3d heads %2d/%d page %2d splits %2d lengths %4d/%4d/%4d only_decode %d: %s "
           "(max abs err %.2e; %d heads of every page off the unpruned by %.2e; %d empty head splits)\n",
           std::is_same_v<S, Q8> ? " q8_0" : "", HD, n_head, n_head_kv, page, n_split, len0, len1, len2, only_decode,
           ok ? "ok" : "FAIL", worst, n_every, worst_f, empty);
}

int main() {
    check_union_hand(0);
    check_union_hand(1);
    std::mt19937 ru(3);
    check_union_random(ru, 16, 1, 16, 1);
    check_union_random(ru, 14, 2, 16, 0);
    check_union_random(ru, 4, 4, 64, 1);
    check_union_random(ru, 12, 3, 16, 0);
    printf("union_pages: %s\n", fails ? "FAILED" : "ok");

    std::mt19937 rng(11);
    check_att<F16, 64>(rng, 4, 4, 16, 1, 300, 129, 213, 1, 9);
    check_att<F16, 64>(rng, 14, 2, 16, 5, 200, 333, 257, 0, 9);
    check_att<F16, 64>(rng, 16, 1, 64, 12, 450, 301, 517, 1, 9);
    check_att<F16, 128>(rng, 14, 2, 64, 3, 700, 150, 389, 1, 9);
    check_att<F16, 128>(rng, 16, 1, 16, 30, 150, 99, 221, 0, 9);
    check_att<F16, 128>(rng, 2, 2, 64, 9, 333, 321, 200, 1, 9);
    // The q8_0 cache (its own generator: the cases above keep their data);
    // spare 0: batch row 2 reads up to the end of the cache's arrays.
    std::mt19937 rq(19);
    check_att<Q8, 64>(rq, 4, 4, 16, 1, 300, 129, 213, 1, 9);
    check_att<Q8, 64>(rq, 14, 2, 16, 7, 200, 333, 357, 0, 0);
    check_att<Q8, 64>(rq, 16, 1, 64, 12, 450, 301, 517, 1, 0);
    check_att<Q8, 128>(rq, 14, 2, 64, 3, 700, 150, 389, 1, 9);
    check_att<Q8, 128>(rq, 16, 1, 16, 30, 150, 99, 221, 0, 0);
    check_att<Q8, 128>(rq, 2, 2, 64, 9, 333, 321, 200, 1, 9);
    CHECK(cp_async_emu::copies_issued == cp_async_emu::copies_landed, "%ld cp.async copies issued, %ld landed",
          cp_async_emu::copies_issued, cp_async_emu::copies_landed);
    printf("attend_pages_mma: worst abs err %.2e against f64, %.2e against the unpruned kernel\n", worst_ref,
           worst_full);
    printf("pruned tensor-core attention: %s\n", fails ? "FAILED" : "ok");
    return fails ? 1 : 0;
}
