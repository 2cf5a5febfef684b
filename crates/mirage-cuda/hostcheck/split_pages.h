// Random split-Q8_0 FFN pages and the f64 reference of phase 2 (the down
// products) over them, for the host checks of the fused Q8_0 FFN's phase 2
// (check_ffn_p2.cpp). Include after the extracted
// kernel header (SB_PAGE_CH) and ptx_emu.h (h2f).
#pragma once
#include <cmath>
#include <random>
#include <vector>

struct SplitPages {
    int d, n;
    long page_bytes;
    std::vector<sb_u8> bytes;
    // The split layout (superblock.cu): [gate q 128 x d][up q][down_t q]
    // [gate scales 128 x d/32 f16][up scales][down_t scales]; the down
    // weight of channel ch for output o.
    double down(int page, int ch, int o) const {
        const sb_u8* base = bytes.data() + (long)page * page_bytes;
        const sb_u16* sc = (const sb_u16*)(base + 3L * SB_PAGE_CH * d) + 2L * SB_PAGE_CH * (d / 32);
        return (double)(signed char)base[2L * SB_PAGE_CH * d + (long)ch * d + o] * h2f(sc[(long)ch * (d / 32) + o / 32]);
    }
    // Output o of phase 2 in f64 over the active list (ids >= n skipped),
    // h: 128 values per list entry, starting from `init`; `mag` gets the
    // sum of the terms' magnitudes (the scale of the error bound).
    double reference(const std::vector<sb_u32>& active, const float* h, int o, double init, double& mag) const {
        double want = init;
        mag = std::fabs(init);
        for (size_t i = 0; i < active.size(); i++) {
            if (active[i] >= (sb_u32)n) continue;
            for (int c = 0; c < SB_PAGE_CH; c++) {
                const double t = (double)h[i * SB_PAGE_CH + c] * down(active[i], c, o);
                want += t;
                mag += std::fabs(t);
            }
        }
        return want;
    }
};

// n random pages of width d: random quants, positive f16 scales in
// [2^-9, 2^-5).
inline SplitPages random_split_pages(std::mt19937& g, int d, int n) {
    SplitPages p{d, n, 408L * d, {}};
    p.bytes.resize(p.page_bytes * n);
    for (auto& b : p.bytes) b = (sb_u8)(g() & 255);
    for (int page = 0; page < n; page++) {
        sb_u16* sc = (sb_u16*)(p.bytes.data() + page * p.page_bytes + 3L * SB_PAGE_CH * d);
        for (long i = 0; i < 3L * SB_PAGE_CH * (d / 32); i++) sc[i] = (sb_u16)(((6 + g() % 4) << 10) | (g() & 1023));
    }
    return p;
}
