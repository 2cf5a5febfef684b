// Host check of phase 2 of the fused Q8_0 FFN with the cluster finish
// (superblock.cu's sb_ffn_q8s_phase2_cluster, variant v15's
// superblock_ffn_q8s_c2; cut out by extract.py -> ffn_p2c_extract.h; no
// GPU): each cluster's K blocks of 256 threads run at once (block_emu.h's
// run_cluster), the clusters in turn; the cluster registers are the
// emulated launch's, the cluster barrier is one std::barrier over every
// thread of the cluster, and a distributed shared-memory load reads the
// other block's own copy of the array (every block has its own red[] and
// cpart[]). Over d 96 (one output chunk), 864 (7, the last narrower than
// 128) and 3584 (28), lists of every page, a subset with a repeated page
// and ids past n_pages, and no page, at cluster sizes 1, 2, 3, 8, 14 and 16
// (16 only at d 96; 14 alone at d 3584) with one cluster and, up to 24
// blocks in all, one a chunk (d 3584: one and two clusters):
//   - ordered: every output equals an f64 sum over the active pages of h
//     times the split layout's down weights (quant times scale) to 2e-6 of
//     the terms' magnitude (plus y when accumulating); nothing past d is
//     written; the bits depend on the cluster size alone, not on how many
//     clusters loop over the chunks;
//   - atomic (mode 0) onto y: the same sums to the same tolerance;
//   - a cluster larger than SB_C2_MAX_CLUSTER is the kernel's to refuse
//     (its NaN guard), not this function's: not run here.
// A dropped first cluster barrier (mutation tried by hand) reads partials
// not yet written: the check fails.
// Build and run: hostcheck/run.sh.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "block_emu.h"
#include "ptx_emu.h"

template <class T> T __ldcg(const T* p) { return *p; }
inline void atomicAdd(float* p, float v) { std::atomic_ref<float>(*p).fetch_add(v); }

// The emulated cluster launch: size, index, count, barrier, and each block's
// cpart (for the distributed shared-memory loads).
static unsigned g_cs = 1, g_cluster = 0, g_clusters = 1;
static std::barrier<>* g_cluster_bar = nullptr;
static std::vector<float*> g_cpart;
unsigned sb_cluster_rank() { return t_cluster_rank; }
unsigned sb_cluster_size() { return g_cs; }
unsigned sb_cluster_id() { return g_cluster; }
unsigned sb_cluster_count() { return g_clusters; }
void sb_cluster_sync() { g_cluster_bar->arrive_and_wait(); }
// p lies in this block's cpart: the same element of block `rank`'s.
float sb_dsmem_load(const float* p, unsigned rank) {
    const long i = p - g_cpart[t_cluster_rank];
    if (rank >= g_cs || i < 0 || i >= 128) {
        printf("  bad distributed shared-memory load: rank %u of %u, element %ld\n", rank, g_cs, i);
        abort();
    }
    return g_cpart[rank][i];
}

#include "ffn_p2c_extract.h"

#include "split_pages.h"

// Runs the phase over the whole grid: `clusters` clusters of `cs` blocks.
static std::vector<float> run(const SplitPages& p, const std::vector<float>& h, const std::vector<sb_u32>& active,
                              int mode, bool accumulate, const std::vector<float>& y0, unsigned cs, unsigned clusters) {
    std::vector<float> y(y0);
    y.push_back(NAN);  // a guard past the end
    g_cs = cs;
    g_clusters = clusters;
    gridDim.x = cs * clusters;
    const int n_ch = (int)active.size() * SB_PAGE_CH;
    for (unsigned c = 0; c < clusters; c++) {
        g_cluster = c;
        std::vector<std::vector<float>> red(cs, std::vector<float>(SB_WARPS * 128)), cpart(cs, std::vector<float>(128));
        g_cpart.clear();
        for (auto& v : cpart) g_cpart.push_back(v.data());
        std::barrier<> bar(cs * SB_THREADS);
        g_cluster_bar = &bar;
        run_cluster(cs, SB_THREADS, c * cs, [&] {
            const unsigned r = t_cluster_rank;
            sb_ffn_q8s_phase2_cluster<4>(p.bytes.data(), p.page_bytes, p.n, p.d, active.data(), n_ch, mode,
                                         accumulate, (float*)h.data(), y.data(), (float(*)[128])red[r].data(),
                                         cpart[r].data());
        });
    }
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
        const unsigned n_chunks = (d + 127) / 128;
        std::vector<sb_u32> all(n), subset = {(sb_u32)(n - 1), (sb_u32)n, 0u, (sb_u32)(n + 1000), 0u}, none;
        for (int i = 0; i < n; i++) all[i] = i;
        std::vector<float> y0(d);
        for (auto& v : y0) v = U(g);
        for (const auto* l : {&all, &subset, &none}) {
            const char* name = l == &all ? "all" : l == &subset ? "subset" : "empty";
            std::vector<float> h(std::max<size_t>(l->size(), 1) * SB_PAGE_CH);
            for (auto& v : h) v = U(g);
            for (unsigned cs : {1u, 2u, 3u, 8u, 14u, 16u}) {
                if (cs == 16 && d != 96) continue;  // 4096 emulated threads: once
                if (d == 3584 && cs != 14) continue;  // the 7B shape: v10's K
                std::vector<float> first;
                // Every emulated thread is an std::thread (28 clusters of 14
                // blocks are ~100k a run): one cluster a chunk only where
                // that stays small; at d 3584 one and two clusters (each
                // loops over its chunks).
                for (unsigned clusters : {1u, 2u, n_chunks}) {
                    if (clusters > n_chunks || (clusters == 2) != (d == 3584)) continue;
                    if (clusters == n_chunks && clusters > 1 && cs * clusters > 24) continue;
                    const std::vector<float> nan(d, NAN);
                    const auto ordered = run(p, h, *l, 1, false, nan, cs, clusters);
                    const auto ordered_acc = run(p, h, *l, 1, true, y0, cs, clusters);
                    const auto atomic = run(p, h, *l, 0, true, y0, cs, clusters);
                    bool ok = matches(p, h, *l, ordered, nullptr) && matches(p, h, *l, ordered_acc, &y0) &&
                              matches(p, h, *l, atomic, &y0);
                    if (ok && first.empty()) first = ordered;
                    else if (ok)
                        for (int o = 0; o < d && ok; o++)
                            if (memcmp(&ordered[o], &first[o], 4) != 0) {
                                printf("  output %d bits differ from 1 cluster's (%.9g vs %.9g)\n", o, ordered[o],
                                       first[o]);
                                ok = false;
                            }
                    printf("phase 2 cluster finish d %4d %-6s clusters of %2u x %2u: %s\n", d, name, cs, clusters,
                           ok ? "ok" : "FAILED");
                    if (!ok) failures++;
                }
            }
        }
    }
    printf("fused FFN phase 2 (cluster finish): worst error %.3g of the terms' magnitude; %s\n", worst,
           failures ? "FAILED" : "all cases ok");
    return failures ? 1 : 0;
}
