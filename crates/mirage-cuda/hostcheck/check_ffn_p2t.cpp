// Host check of phase 2 of the fused Q8_0 FFN over the tiled down slice
// (superblock.cu's sb_ffn_q8s_phase2_tiled, variant v14; cut out by
// extract.py -> ffn_p2t_extract.h; no GPU): every block of a grid run in
// turn, each an emulated block of 256 threads (block_emu.h), the copy
// engine's transaction barriers and bulk copies replaced by stand-ins that
// keep their contract (below), over d 96 / 864 / 896 (row blocks of 8),
// 2048 (16) and 3584 (32), lists of every page, a subset with a repeated
// page and ids past n_pages, a list of five batches (buffer reuse, barrier
// parity wrapping), an empty list and (d 96) one longer than the ids the
// kernel stages in shared memory, with rings of 8 batch buffers on grids
// of 1, 5 and 40 blocks (40 > the row blocks at d 96: idle blocks) and of 1
// and 2 buffers on 5,
// with and without accumulate:
//   - every output equals an f64 sum over the active pages of h times the
//     split layout's down weights (quant times scale) to 2e-6 of the terms'
//     magnitude, plus y when accumulating; nothing past d is written;
//   - at blocks of 256 and of 1024 threads (superblock_ffn_q8s_t2's: 32
//     warps, so page groups at row blocks of 16 and 8), the values depend on
//     neither the grid nor the ring (bit for bit);
//   - the copies match the bytes each batch's barrier was told to expect
//     (no more: the count would go negative; no fewer: a wait would never
//     end), are 16-byte aligned multiples of 16 bytes, and read only inside
//     the pages and the list's hbuf values;
//   - with a ring smaller than one batch every output is NaN.
// The pages are tiled here by a transpose of its own (the Rust
// tile_q8s_down has its own test against the split layout).
// Build and run: hostcheck/run.sh.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "block_emu.h"
#include "ptx_emu.h"

#define __align__(n) __attribute__((aligned(n)))
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }

// The memory the copies may read: [lo, hi) of the pages and of hbuf.
static const unsigned char *g_pages_lo, *g_pages_hi, *g_h_lo, *g_h_hi;
static std::atomic<int> g_bad{0};

static bool tx_src_ok(const unsigned char* s, sb_u32 bytes) {
    return (s >= g_pages_lo && s + bytes <= g_pages_hi) || (s >= g_h_lo && s + bytes <= g_h_hi);
}
#include "tx_emu.h"

#include "ffn_p2t_extract.h"

#include "split_pages.h"

// The split pages and the same pages tiled for the kernel.
struct Pages {
    SplitPages split;
    std::vector<sb_u8> tiled;
    int d, n;
    long page_bytes;
};

static Pages make_pages(std::mt19937& g, int d, int n) {
    Pages p{random_split_pages(g, d, n), {}, d, n, 408L * d};
    // Tiled: down quants [d][128], down scales [d/32][128].
    p.tiled = p.split.bytes;
    const long q = (long)SB_PAGE_CH * d, sm = (long)SB_PAGE_CH * (d / 32);
    for (int page = 0; page < n; page++) {
        const sb_u8* a = p.split.bytes.data() + page * p.page_bytes;
        sb_u8* b = p.tiled.data() + page * p.page_bytes;
        for (int c = 0; c < SB_PAGE_CH; c++)
            for (int o = 0; o < d; o++) b[2 * q + (long)o * SB_PAGE_CH + c] = a[2 * q + (long)c * d + o];
        const sb_u16* sa = (const sb_u16*)(a + 3 * q) + 2 * sm;
        sb_u16* sb = (sb_u16*)(b + 3 * q) + 2 * sm;
        for (int c = 0; c < SB_PAGE_CH; c++)
            for (int gi = 0; gi < d / 32; gi++) sb[(long)gi * SB_PAGE_CH + c] = sa[(long)c * (d / 32) + gi];
    }
    return p;
}

static int failures = 0;
static double worst = 0;

static void check_case(const Pages& p, const std::vector<float>& h, const std::vector<sb_u32>& active,
                       const char* list, const std::vector<float>& y0, bool accumulate) {
    const int d = p.d, n_act = (int)active.size();
    g_pages_lo = p.tiled.data();
    g_pages_hi = p.tiled.data() + p.tiled.size();
    g_h_lo = (const unsigned char*)h.data();
    g_h_hi = (const unsigned char*)(h.data() + (size_t)n_act * SB_PAGE_CH);
    for (int threads : {256, SB_T2_THREADS}) {
    std::vector<float> first;
    for (int buffers : {8, 2, 1, 0})
        for (int grid : {1, 5, 40}) {
            if (buffers != 8 && grid != 5) continue;  // the small rings on one grid
            // 1024 emulated threads are slow: their page groups (d 96: 4 of
            // them, 2048: 2) on one grid, the 5-batch list with 2 buffers.
            if (threads > 256 && (grid != 5 || buffers == 1 || (d != 96 && d != 2048) || n_act == 0)) continue;
            const sb_u32 ring_bytes = buffers * SB_T2_BATCH_BYTES + (buffers ? 16 : SB_T2_BATCH_BYTES - 16);
            std::vector<uint4> ring(ring_bytes / 16 + 1);
            std::vector<float> y(y0);
            y.push_back(NAN);  // a guard past the end
            gridDim.x = grid;
            g_bad = 0;
            for (int b = 0; b < grid; b++)
                run_block(threads, dim3_{(unsigned)b, 0, 0}, [&] {
                    sb_ffn_q8s_phase2_tiled(p.tiled.data(), p.page_bytes, p.n, d, active.data(), n_act, accumulate,
                                            h.data(), y.data(), (sb_u8*)ring.data(), ring_bytes);
                });
            bool ok = g_bad == 0 && std::isnan(y[d]);
            if (buffers == 0) {  // no room for one batch: NaN everywhere
                for (int o = 0; o < d && ok; o++)
                    if (!std::isnan(y[o])) {
                        printf("  output %d: %g without a ring, want NaN\n", o, y[o]);
                        ok = false;
                    }
            }
            for (int o = 0; o < d && ok && buffers; o++) {
                double mag;
                const double want = p.split.reference(active, h.data(), o, accumulate ? y0[o] : 0.0, mag);
                const double e = std::isnan(y[o]) ? INFINITY : std::fabs(y[o] - want) / (mag + 1e-30);
                if (e > worst && mag > 0) worst = e;
                if (!(e < 2e-6) && !(mag == 0 && y[o] == want)) {
                    printf("  output %d: got %.9g, want %.9g (err %.3g)\n", o, y[o], want, e);
                    ok = false;
                }
            }
            if (ok && buffers && first.empty()) first = y;
            else if (ok && buffers)
                for (int o = 0; o < d && ok; o++)
                    if (memcmp(&y[o], &first[o], 4) != 0) {
                        printf("  output %d bits differ from the first grid and ring (%.9g vs %.9g)\n", o, y[o],
                               first[o]);
                        ok = false;
                    }
            printf("phase 2 tiled %4d threads d %4d %-7s %2d pages%s ring %d grid %2d: %s\n", threads, d, list, n_act,
                   accumulate ? " +acc" : "", buffers, grid, ok ? "ok" : "FAILED");
            if (!ok) failures++;
        }
    }
}

int main() {
    setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a pipe before an abort
    std::mt19937 g(23);
    std::uniform_real_distribution<float> U(-1, 1);
    for (int d : {96, 864, 896, 2048, 3584}) {
        const int n = d >= 3584 ? 3 : 6;
        const Pages p = make_pages(g, d, n);
        std::vector<sb_u32> all(n), subset = {(sb_u32)(n - 1), (sb_u32)n, 0u, (sb_u32)(n + 1000), 0u}, none;
        for (int i = 0; i < n; i++) all[i] = i;
        // 19 entries: five batches of 4 (buffers reused, barrier parities
        // wrapping with rings of 1 and 2), ids past n_pages among them.
        std::vector<sb_u32> long_list;
        for (int i = 0; i < 19; i++) long_list.push_back(i % 7 == 3 ? (sb_u32)(n + i) : (sb_u32)(i * 5 % n));
        std::vector<float> y0(d);
        for (auto& v : y0) v = U(g);
        // Past the SB_T2_IDS ids the kernel stages in shared memory (d 96).
        std::vector<sb_u32> huge;
        for (int i = 0; d == 96 && i < SB_T2_IDS + 9; i++) huge.push_back(i % 11 == 4 ? (sb_u32)(n + 3) : (sb_u32)(i % n));
        for (const auto* l : {&all, &subset, &long_list, &none, &huge}) {
            if (l->empty() && l != &none) continue;
            const char* name = l == &all      ? "all"
                               : l == &subset ? "subset"
                               : l == &none   ? "empty"
                               : l == &huge   ? "huge"
                                              : "long";
            std::vector<float> h(std::max<size_t>(l->size(), 1) * SB_PAGE_CH);
            for (auto& v : h) v = U(g);
            check_case(p, h, *l, name, y0, false);
            if (l == &subset || l == &none) check_case(p, h, *l, name, y0, true);
        }
    }
    printf("fused FFN phase 2 (tiled): worst error %.3g of the terms' magnitude; %s\n", worst,
           failures ? "FAILED" : "all cases ok");
    return failures ? 1 : 0;
}
