// Host check of phase 1 of the fused Q8_0 FFN (superblock.cu's
// sb_ffn_q8s_phase1, cut out by extract.py -> ffn_p1_extract.h; no GPU):
// every block of a grid run in turn, each an emulated block of 256 threads
// (block_emu.h), over d 96 / 896 / 3584 / 4096, with every page active, a
// subset with a repeated page and ids past n_pages, and an empty list, on
// grids of 1 and 13 blocks:
//   - every active channel's hbuf entry is written, and equals an f64
//     silu(gate . x) * (up . x) of the same page bytes (0 for an id past
//     n_pages) to 2e-5 of the terms' magnitude;
//   - the values do not depend on the grid (bit for bit): each channel's
//     dots are summed in a fixed order whatever block owns it, so the
//     decode's bits do not change with the GPU's SM count;
//   - with the RMSNorm folded in (nw != null) the same against an f64 norm,
//     and block 0 writes the norm's output.
// Build and run: hostcheck/run.sh.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "block_emu.h"
#include "ptx_emu.h"

struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
#include "ffn_p1_extract.h"

struct Pages {
    int d, n;
    long page_bytes;
    std::vector<sb_u8> bytes;
    // Page layout (superblock.cu): [gate q 128 x d][up q][down_t q][gate
    // scales 128 x d/32 f16][up scales][down_t scales].
    double w(int page, int mat, int ch, int j) const {
        const sb_u8* base = bytes.data() + (long)page * page_bytes;
        const sb_u16* sc = (const sb_u16*)(base + 3L * SB_PAGE_CH * d) + (long)mat * SB_PAGE_CH * (d / 32);
        return (double)(signed char)base[(long)mat * SB_PAGE_CH * d + (long)ch * d + j] *
               h2f(sc[(long)ch * (d / 32) + j / 32]);
    }
};

static Pages make_pages(std::mt19937& g, int d, int n) {
    Pages p{d, n, 408L * d, {}};
    p.bytes.resize(p.page_bytes * n);
    for (long i = 0; i < (long)p.bytes.size(); i++) p.bytes[i] = (sb_u8)(g() & 255);
    for (int page = 0; page < n; page++) {  // scales: f16 in [2^-9, 2^-5), positive
        sb_u16* sc = (sb_u16*)(p.bytes.data() + page * p.page_bytes + 3L * SB_PAGE_CH * d);
        for (long i = 0; i < 3L * SB_PAGE_CH * (d / 32); i++) sc[i] = (sb_u16)(((6 + g() % 4) << 10) | (g() & 1023));
    }
    return p;
}

// hbuf after running phase 1 on a grid of `grid` blocks, one after another.
static std::vector<float> run_phase1(const Pages& p, const std::vector<float>& x, const std::vector<sb_u32>& active,
                                     int grid, const float* nw, std::vector<float>* nout) {
    const int n_ch = (int)active.size() * SB_PAGE_CH;
    std::vector<float> hbuf(n_ch + 1, NAN);  // + 1: a guard past the end
    std::vector<float4> xs(p.d / 4);
    gridDim.x = grid;
    for (int b = 0; b < grid; b++) {
        run_block(SB_THREADS, dim3_{(unsigned)b, 0, 0}, [&] {
            sb_ffn_q8s_phase1(p.bytes.data(), p.page_bytes, p.n, p.d, x.data(), active.data(), n_ch, hbuf.data(),
                              xs.data(), nw, 1e-6f, nout ? nout->data() : nullptr);
        });
    }
    return hbuf;
}

static int failures = 0;
static double worst = 0;

static void check_case(const Pages& p, const std::vector<float>& x, const std::vector<sb_u32>& active,
                       const char* list, const float* nw) {
    const int d = p.d, n_ch = (int)active.size() * SB_PAGE_CH;
    // x as the kernel sees it: the f64 RMSNorm when folded.
    std::vector<double> xin(x.begin(), x.end());
    if (nw) {
        double ss = 0;
        for (float v : x) ss += (double)v * v;
        const double r = 1.0 / std::sqrt(ss / d + 1e-6);
        for (int j = 0; j < d; j++) xin[j] = x[j] * r * nw[j];
    }
    std::vector<float> first;
    for (int grid : {1, 13}) {
        std::vector<float> nout(d, NAN);
        const std::vector<float> h = run_phase1(p, x, active, grid, nw, &nout);
        bool ok = std::isnan(h[n_ch]);  // nothing written past the channels
        for (int c = 0; c < n_ch && ok; c++) {
            const sb_u32 page = active[c / SB_PAGE_CH];
            const int ch = c % SB_PAGE_CH;
            double g = 0, u = 0, mag = 0;
            if (page < (sb_u32)p.n)
                for (int j = 0; j < d; j++) {
                    g += p.w(page, 0, ch, j) * xin[j];
                    u += p.w(page, 1, ch, j) * xin[j];
                    mag += std::fabs(p.w(page, 0, ch, j) * xin[j]) + std::fabs(p.w(page, 1, ch, j) * xin[j]);
                }
            const double want = g / (1 + std::exp(-g)) * u;
            // silu(g) u moves by about (|u| + |g|) per unit change of g or u.
            const double scale = (std::fabs(u) + std::fabs(g) + 1) * (mag + 1e-30);
            const double e = std::isnan(h[c]) ? INFINITY : std::fabs(h[c] - want) / scale;
            if (e > worst) worst = e;
            if (!(e < 2e-5)) {
                printf("  channel %d (page %u): got %g, want %g (err %.3g)\n", c, page, h[c], want, e);
                ok = false;
            }
        }
        if (nw && n_ch > 0)  // block 0 writes the norm's output (rms_norm_row's values)
            for (int j = 0; j < d && ok; j++)
                if (!(std::fabs(nout[j] - xin[j]) <= 2e-6 * (std::fabs(xin[j]) + 1e-3))) {
                    printf("  nout[%d] = %g, want %g\n", j, nout[j], xin[j]);
                    ok = false;
                }
        if (ok && grid == 1) first = h;
        if (ok && grid != 1)
            for (int c = 0; c < n_ch && ok; c++)
                if (memcmp(&h[c], &first[c], 4) != 0) {
                    printf("  grid %d: channel %d bits differ from grid 1 (%g vs %g)\n", grid, c, h[c], first[c]);
                    ok = false;
                }
        printf("phase 1 d %4d %-6s%s grid %2d: %s\n", d, list, nw ? " +norm" : "", grid, ok ? "ok" : "FAILED");
        if (!ok) failures++;
    }
}

static void check_all(std::mt19937& g) {
    std::uniform_real_distribution<float> U(-1, 1);
    for (int d : {96, 896, 3584, 4096}) {
        const int n = d >= 3584 ? 2 : 5;
        const Pages p = make_pages(g, d, n);
        std::vector<float> x(d), nw(d);
        for (auto& v : x) v = U(g);
        for (auto& v : nw) v = 0.5f + 0.5f * U(g);
        std::vector<sb_u32> all(n), subset = {(sb_u32)(n - 1), (sb_u32)n, 0u, (sb_u32)(n + 1000), 0u}, none;
        for (int i = 0; i < n; i++) all[i] = i;
        check_case(p, x, all, "all", nullptr);
        check_case(p, x, subset, "subset", nullptr);
        check_case(p, x, none, "empty", nullptr);
        if (d == 896) check_case(p, x, all, "all", nw.data());
    }
}

int main() {
    std::mt19937 g(11);
    check_all(g);
    printf("fused FFN phase 1: worst error %.3g of the terms' magnitude; %s\n", worst,
           failures ? "FAILED" : "all cases ok");
    return failures ? 1 : 0;
}
