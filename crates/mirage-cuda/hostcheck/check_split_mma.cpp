// Host check of attention_mma.cu's split decode attention on f16 tensor
// cores (no GPU; extract.py -> split_mma_extract.h), the mma instruction
// emulated by the PTX ISA's fragment layout (mma_emu.h), the cp.async copies
// landing at issue and, again, as late as their waits allow (cp_async_emu.h),
// blocks run as fibers (block_emu.h):
//   attend_split_mma<HD> + attend_combine against an f64 softmax attention
//   over the f16 cache as stored, head sizes 64 and 128, GQA groups of 1, 7,
//   12 and 16 query heads, two rows of other sequences and lengths (not
//   multiples of a step, a split or the warps' share), one split to many;
//   every copy issued lands, and both timings give the same bits;
//   with RoPE and the store folded in, against rope_store then the kernel
//   without: the same partial bits and cache bits (the new slots poisoned,
//   the splits run last to first), both pairings.
// Build and run: hostcheck/run.sh.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>
#include "block_emu.h"

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
#define MIRAGE_INF INFINITY
#define __align__(n) __attribute__((aligned(n)))
#include "ptx_emu.h"
#include "att_emu.h"
#include "mma_emu.h"
#include "cp_async_emu.h"
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float block_sum(float, float*) { abort(); }  // rope_store's q/k norm: not used here
#include "split_mma_extract.h"

static int fails = 0;

template <int HD>
static void check(std::mt19937& rng, int n_head, int n_head_kv, int n_split, int len0, int len1) {
    const int rows = 2, n_seq = 2, n_ctx = std::max(len0, len1) + 9, G = n_head / n_head_kv;
    const int chunk = (n_ctx + n_split - 1) / n_split;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> q((size_t)rows * n_head * HD);
    for (auto& v : q) v = 1.5f * nd(rng);
    std::vector<u16> kc((size_t)n_seq * n_head_kv * n_ctx * HD), vc(kc.size());
    for (auto& v : kc) v = f2h(nd(rng));
    for (auto& v : vc) v = f2h(nd(rng));
    const int slots[4] = {1, len0 - 1, 0, len1 - 1};
    const float scale = 1.f / std::sqrt((float)HD);
    const size_t smem_halves = (size_t)tm_warps(HD) * tm_stages(HD) * TM_STAGE_HALVES(HD);
    std::vector<float> out_eager;
    for (cp_async_emu::Mode mode : {cp_async_emu::Eager, cp_async_emu::Deferred}) {
        cp_async_emu::mode = mode;
        std::vector<float> part((size_t)rows * n_head * n_split * (HD + 2), NAN);
        std::vector<float> out((size_t)rows * n_head * HD, -99.f);
        // Poisoned: a read of a stage before its copies landed shows.
        std::vector<u16> smem(smem_halves, 0x7e00);
        gridDim = dim3_{(unsigned)rows, (unsigned)n_head_kv, (unsigned)n_split};
        for (unsigned z = 0; z < gridDim.z; z++)
            for (unsigned y = 0; y < gridDim.y; y++)
                for (unsigned x = 0; x < gridDim.x; x++) {
                    cp_async_emu::start_block(tm_warps(HD) * 32);
                    run_block(tm_warps(HD) * 32, dim3_{x, y, z}, [&] {
                        attend_split_mma<HD>(q.data(), kc.data(), vc.data(), slots, n_head, n_head_kv, n_ctx, chunk,
                                             scale, part.data(), nullptr, nullptr, 0, nullptr, smem.data());
                    });
                    if (!cp_async_emu::block_drained()) {
                        printf("FAIL: cp.async copies still in flight at a block's end\n");
                        fails++;
                    }
                }
        gridDim = dim3_{(unsigned)rows, (unsigned)n_head, 1};
        for (unsigned r = 0; r < (unsigned)rows; r++)
            for (unsigned h = 0; h < (unsigned)n_head; h++)
                run_block(AC_THREADS / HD * HD, dim3_{r, h, 0}, [&] {
                    attend_combine_body(part.data(), slots, n_head, HD, n_split, chunk, 0, rows, 0, out.data());
                });
        if (mode == cp_async_emu::Eager) {
            out_eager = out;
            continue;
        }
        if (memcmp(out.data(), out_eager.data(), out.size() * 4) != 0) {
            printf("FAIL: the copies' timing changed the output\n");
            fails++;
        }
    }
    double worst = 0;
    for (int r = 0; r < rows; r++) {
        const int seq = slots[2 * r], n = slots[2 * r + 1] + 1;
        for (int h = 0; h < n_head; h++) {
            const int kvh = h / G;
            const float* qh = &q[((size_t)r * n_head + h) * HD];
            const u16* K = &kc[((size_t)seq * n_head_kv + kvh) * n_ctx * HD];
            const u16* V = &vc[((size_t)seq * n_head_kv + kvh) * n_ctx * HD];
            std::vector<double> s(n);
            double m = -INFINITY, l = 0;
            for (int j = 0; j < n; j++) {
                double a = 0;
                for (int d = 0; d < HD; d++) a += (double)qh[d] * h2f(K[(size_t)j * HD + d]);
                s[j] = a * scale;
                m = std::max(m, s[j]);
            }
            for (int j = 0; j < n; j++) l += std::exp(s[j] - m);
            for (int d = 0; d < HD; d++) {
                double o = 0;
                for (int j = 0; j < n; j++) o += std::exp(s[j] - m) * h2f(V[(size_t)j * HD + d]);
                const double got = out_eager[((size_t)r * n_head + h) * HD + d];
                const double err = std::fabs(got - o / l);
                worst = std::isnan(got) ? INFINITY : std::max(worst, err);
            }
        }
    }
    // Q and P as f16 hi + lo parts: about 2^-22 of each; one f16 rounding
    // of either gives 1e-4 and more here.
    const bool ok = worst < 1e-5;
    fails += !ok;
    printf("attend_split_mma head_dim %3d heads %2d/%d splits %2d lengths %4d/%4d: %s (max abs err %.2e)\n", HD,
           n_head, n_head_kv, n_split, len0, len1, ok ? "ok" : "FAIL", worst);
}

// RoPE and the KV store folded into attend_split_mma against rope_store
// then attend_split_mma without: the same partials and cache, bit for bit.
template <int HD>
static void check_rope(std::mt19937& rng, int n_head, int n_head_kv, int n_split, int neox, int len0, int len1) {
    const int rows = 2, n_seq = 2, n_ctx = std::max(len0, len1) + 9, half = HD / 2;
    const int chunk = (n_ctx + n_split - 1) / n_split;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_real_distribution<float> ang(0.f, 6.283f);
    std::vector<float> q((size_t)rows * n_head * HD), k((size_t)rows * n_head_kv * HD), v(k.size());
    for (auto* a : {&q, &k, &v})
        for (auto& x : *a) x = 1.5f * nd(rng);
    std::vector<float> rope((size_t)n_ctx * half * 2);
    for (size_t i = 0; i < rope.size(); i += 2) {
        const float t = ang(rng);
        rope[i] = std::cos(t);
        rope[i + 1] = std::sin(t);
    }
    std::vector<u16> kc((size_t)n_seq * n_head_kv * n_ctx * HD), vc(kc.size());
    for (auto& x : kc) x = f2h(nd(rng));
    for (auto& x : vc) x = f2h(nd(rng));
    const int slots[4] = {1, len0 - 1, 0, len1 - 1};
    const float scale = 1.f / std::sqrt((float)HD);
    std::vector<u16> smem((size_t)tm_warps(HD) * tm_stages(HD) * TM_STAGE_HALVES(HD));
    auto grid = [&](bool reverse, const std::function<void()>& f) {
        gridDim = dim3_{(unsigned)rows, (unsigned)n_head_kv, (unsigned)n_split};
        for (unsigned zz = 0; zz < gridDim.z; zz++)
            for (unsigned y = 0; y < gridDim.y; y++)
                for (unsigned x = 0; x < gridDim.x; x++) {
                    cp_async_emu::start_block(tm_warps(HD) * 32);
                    run_block(tm_warps(HD) * 32, dim3_{x, y, reverse ? gridDim.z - 1 - zz : zz}, f);
                }
    };
    // rope_store (q rotated in place, k and v into the cache), then the
    // kernel without RoPE.
    std::vector<float> qa = q, ka = k, pa((size_t)rows * n_head * n_split * (HD + 2), NAN);
    std::vector<u16> kca = kc, vca = vc;
    gridDim = dim3_{(unsigned)rows, (unsigned)(n_head + n_head_kv), 1};
    for (unsigned r = 0; r < (unsigned)rows; r++)
        for (unsigned h = 0; h < (unsigned)(n_head + n_head_kv); h++)
            run_block(half, dim3_{r, h, 0}, [&] {
                rope_store<u16>(qa.data(), ka.data(), v.data(), slots, n_head, n_head_kv, HD, neox, rope.data(),
                                nullptr, nullptr, 0.f, kca.data(), vca.data(), n_ctx);
            });
    grid(false, [&] {
        attend_split_mma<HD>(qa.data(), kca.data(), vca.data(), slots, n_head, n_head_kv, n_ctx, chunk, scale,
                             pa.data(), nullptr, nullptr, 0, nullptr, smem.data());
    });
    // Folded: the new slots poisoned, the splits last to first.
    std::vector<u16> kcb = kc, vcb = vc;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < n_head_kv; h++)
            for (int d = 0; d < HD; d++) {
                const size_t at = (((size_t)slots[2 * r] * n_head_kv + h) * n_ctx + slots[2 * r + 1]) * HD + d;
                kcb[at] = vcb[at] = 0x7e00;
            }
    std::vector<float> pb(pa.size(), NAN);
    grid(true, [&] {
        attend_split_mma<HD>(q.data(), kcb.data(), vcb.data(), slots, n_head, n_head_kv, n_ctx, chunk, scale,
                             pb.data(), k.data(), v.data(), neox, rope.data(), smem.data());
    });
    int differ = 0, cache_differ = 0;
    for (size_t i = 0; i < pa.size(); i++) differ += memcmp(&pa[i], &pb[i], 4) != 0;
    for (size_t i = 0; i < kca.size(); i++) cache_differ += (kca[i] != kcb[i]) + (vca[i] != vcb[i]);
    const bool bad = differ || cache_differ;
    fails += bad;
    printf("attend_split_mma + rope head_dim %3d heads %2d/%d splits %2d neox %d lengths %4d/%4d: %s (%d of %zu "
           "partial floats, %d cache entries differ)\n", HD, n_head, n_head_kv, n_split, neox, len0, len1,
           bad ? "FAIL" : "ok", differ, pa.size(), cache_differ);
}

int main() {
    std::mt19937 rng(5);
    check<64>(rng, 14, 2, 1, 300, 129);
    check<64>(rng, 14, 2, 9, 1000, 700);
    check<64>(rng, 4, 4, 5, 777, 130);
    check<128>(rng, 28, 4, 3, 640, 200);
    check<128>(rng, 12, 1, 7, 901, 517);
    check<128>(rng, 16, 1, 2, 150, 333);
    check_rope<64>(rng, 14, 2, 5, 1, 600, 133);
    check_rope<128>(rng, 28, 4, 3, 0, 300, 451);
    printf("attend_split_mma: %s\n", fails ? "FAILED" : "ok");
    return fails ? 1 : 0;
}
