// Host check of phase 2 of the fused Q8_0 FFN (superblock.cu's
// sb_ffn_q8s_phase2 with sb_q8s_p2_quads and sb_finish_item, cut out by
// extract.py -> ffn_p2_extract.h; no GPU): every block of a grid run in
// turn, each an emulated block of 256 threads (block_emu.h), the partials
// and arrival counters in host memory, over d 96 (one output chunk), 864
// (7, the last narrower than 128) and 3584 (28), lists of every page, a
// subset with a repeated page and ids past n_pages, and no page, on grids of
// 1 and 13 blocks with part_ch 0 and 128 (d 96, 864) and of 56 blocks with
// part_ch 0 (d 3584: 2 parts a chunk), with and without accumulate:
//   - every output equals an f64 sum over the active pages of h times the
//     split layout's down weights (quant times scale) to 2e-6 of the terms'
//     magnitude (plus y when accumulating); nothing past d is written;
//   - the arrival counters are zero again after the launch (the next launch
//     reuses them);
//   - the same grid and list give the same bits whatever order the blocks
//     run in (first to last, or last to first; part_ch 0).
// Build and run: hostcheck/run.sh.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "block_emu.h"
#include "ptx_emu.h"

inline sb_u32 atomicAdd(sb_u32* p, sb_u32 v) { return std::atomic_ref<sb_u32>(*p).fetch_add(v); }

#include "ffn_p2_extract.h"

#include "split_pages.h"

// Runs the phase over a grid of `grid` blocks, one after another (reversed:
// last block first).
static std::vector<float> run(const SplitPages& p, const std::vector<float>& h, const std::vector<sb_u32>& active,
                              int part_ch, bool accumulate, const std::vector<float>& y0, int grid, bool reversed,
                              bool& counters_reset) {
    std::vector<float> y(y0);
    y.push_back(NAN);  // a guard past the end
    const int n_ch = (int)active.size() * SB_PAGE_CH;
    const int n_chunks = (p.d + 127) / 128;
    std::vector<float> partials((size_t)std::max(grid / n_chunks, 1) * p.d, NAN);
    std::vector<sb_u32> counters(n_chunks, 0);
    gridDim.x = grid;
    for (int i = 0; i < grid; i++) {
        const int b = reversed ? grid - 1 - i : i;
        run_block(SB_THREADS, dim3_{(unsigned)b, 0, 0}, [&] {
            sb_ffn_q8s_phase2(p.bytes.data(), p.page_bytes, p.n, p.d, active.data(), n_ch, part_ch, accumulate,
                              (float*)h.data(), partials.data(), counters.data(), y.data());
        });
    }
    counters_reset = true;
    for (sb_u32 c : counters) counters_reset = counters_reset && c == 0;
    return y;
}

static int failures = 0;
static double worst = 0;

// y against the f64 sum (plus y0 when accumulating); false on a mismatch.
static bool matches(const SplitPages& p, const std::vector<float>& h, const std::vector<sb_u32>& active,
                    const std::vector<float>& y, const std::vector<float>* y0) {
    if (!std::isnan(y[p.d])) {
        printf("  the guard past d was written\n");
        return false;
    }
    for (int o = 0; o < p.d; o++) {
        double mag;
        const double want = p.reference(active, h.data(), o, y0 ? (*y0)[o] : 0.0, mag);
        const double e = std::isnan(y[o]) ? INFINITY : std::fabs(y[o] - want) / (mag + 1e-30);
        if (e > worst && mag > 0) worst = e;
        if (!(e < 2e-6) && !(mag == 0 && y[o] == want)) {
            printf("  output %d: got %.9g, want %.9g (err %.3g)\n", o, y[o], want, e);
            return false;
        }
    }
    return true;
}

int main() {
    setvbuf(stdout, nullptr, _IOLBF, 0);
    std::mt19937 g(29);
    std::uniform_real_distribution<float> U(-1, 1);
    for (int d : {96, 864, 3584}) {
        const int n = d >= 3584 ? 3 : 5;
        const SplitPages p = random_split_pages(g, d, n);
        std::vector<sb_u32> all(n), subset = {(sb_u32)(n - 1), (sb_u32)n, 0u, (sb_u32)(n + 1000), 0u}, none;
        for (int i = 0; i < n; i++) all[i] = i;
        std::vector<float> y0(d);
        for (auto& v : y0) v = U(g);
        for (const auto* l : {&all, &subset, &none}) {
            const char* name = l == &all ? "all" : l == &subset ? "subset" : "empty";
            std::vector<float> h(std::max<size_t>(l->size(), 1) * SB_PAGE_CH);
            for (auto& v : h) v = U(g);
            for (int grid : {1, 13, 56}) {
                for (int part_ch : {0, 128}) {
                    if ((grid == 56) != (d == 3584) || (part_ch > 0 && d > 1024)) continue;
                    const std::vector<float> nan(d, NAN);
                    bool reset[3] = {true, true, true};
                    const auto ordered = run(p, h, *l, part_ch, false, nan, grid, false, reset[0]);
                    const auto acc = run(p, h, *l, part_ch, true, y0, grid, false, reset[1]);
                    const auto reversed =
                        part_ch == 0 ? run(p, h, *l, part_ch, false, nan, grid, true, reset[2]) : ordered;
                    bool ok = matches(p, h, *l, ordered, nullptr) && matches(p, h, *l, acc, &y0);
                    if (!(reset[0] && reset[1] && reset[2])) {
                        printf("  arrival counters not zero after the launch\n");
                        ok = false;
                    }
                    for (int o = 0; o < d && ok; o++)
                        if (memcmp(&ordered[o], &reversed[o], 4) != 0) {
                            printf("  output %d bits differ with the blocks reversed (%.9g vs %.9g)\n", o,
                                   ordered[o], reversed[o]);
                            ok = false;
                        }
                    printf("phase 2 d %4d %-6s grid %2d part_ch %3d: %s\n", d, name, grid, part_ch,
                           ok ? "ok" : "FAILED");
                    if (!ok) failures++;
                }
            }
        }
    }
    printf("fused FFN phase 2: worst error %.3g of the terms' magnitude; %s\n", worst,
           failures ? "FAILED" : "all cases ok");
    return failures ? 1 : 0;
}
