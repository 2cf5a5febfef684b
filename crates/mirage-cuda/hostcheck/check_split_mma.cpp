// Host check of attention_mma.cu's split decode attention on f16 tensor
// cores (no GPU; extract.py -> split_mma_extract.h), the mma instruction
// emulated by the PTX ISA's fragment layout (mma_emu.h), the cp.async copies
// landing at issue and, again, as late as their waits allow (cp_async_emu.h),
// the f16x2 arithmetic of the q8_0 dequantization rounded once per half
// (att_emu.h), blocks run as fibers (block_emu.h), over f16 and q8_0 caches
// (kv_caches.h: a q8_0 cache's arrays end where an unreadable page begins):
//   attend_split_mma<HD> + attend_combine against an f64 softmax attention
//   over the cache as the kernel multiplies it (f16; q8_0: each code times
//   its scale rounded once to f16), head sizes 64 and 128, GQA groups of 1,
//   7, 12 and 16 query heads, two rows of other sequences and lengths (not
//   multiples of a step, a split or the warps' share), one split to many,
//   the dynamic shared memory poisoned; every copy issued lands, and both
//   timings give the same bits;
//   with RoPE and the store folded in, against rope_store then the kernel
//   without: the same partial bits and cache bits (q8_0: codes and scales;
//   the new slots poisoned, the splits run last to first), both pairings.
// Build and run: hostcheck/run.sh.
#include <cstdint>
#include <cstdio>
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
#include "ptx_emu.h"
#include "att_emu.h"
#include "mma_emu.h"
#include "cp_async_emu.h"
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float block_sum(float, float*) { abort(); }  // rope_store's q/k norm: not used here
#include "split_mma_extract.h"
#include "kv_caches.h"
#include "mma_smem.h"

static int fails = 0;

// Slots of a new position poisoned: f16 NaN, q8_0 Q8::poison.
static void poison_row(F16& c, size_t at, int n, bool) {
    for (int i = 0; i < n; i++) c.v[at + i] = 0x7e00;
}
static void poison_row(Q8& c, size_t at, int n, bool key) { c.poison(at, n, key); }

template <class S, int HD>
static void check(std::mt19937& rng, int n_head, int n_head_kv, int n_split, int len0, int len1, int spare = 9) {
    const int rows = 2, n_seq = 2, n_ctx = std::max(len0, len1) + spare, G = n_head / n_head_kv;
    const int chunk = (n_ctx + n_split - 1) / n_split;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> q((size_t)rows * n_head * HD);
    for (auto& v : q) v = 1.5f * nd(rng);
    S kc((size_t)n_seq * n_head_kv * n_ctx * HD), vc(kc.size());
    kc.fill(rng, nd);
    vc.fill(rng, nd);
    const int slots[4] = {1, len0 - 1, 0, len1 - 1};
    const float scale = 1.f / std::sqrt((float)HD);
    std::vector<float> out_eager;
    for (cp_async_emu::Mode mode : {cp_async_emu::Eager, cp_async_emu::Deferred}) {
        cp_async_emu::mode = mode;
        std::vector<float> part((size_t)rows * n_head * n_split * (HD + 2), NAN);
        std::vector<float> out((size_t)rows * n_head * HD, -99.f);
        // Poisoned: a read of a stage before its copies landed shows.
        Smem<S, HD> smem(0x7e00);
        if (run_mma_grid<HD>(rows, n_head_kv, n_split, [&] {
                attend_split_mma<HD>(q.data(), kc.ptr(), vc.ptr(), slots, n_head, n_head_kv, n_ctx, chunk, scale,
                                     part.data(), nullptr, nullptr, 0, nullptr, smem.data());
            })) {
            printf("FAIL: cp.async copies still in flight at a block's end\n");
            fails++;
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
            const size_t K = ((size_t)seq * n_head_kv + kvh) * n_ctx * HD, V = K;
            std::vector<double> s(n);
            double m = -INFINITY, l = 0;
            for (int j = 0; j < n; j++) {
                double a = 0;
                for (int d = 0; d < HD; d++) a += (double)qh[d] * kc.get_f16(K + (size_t)j * HD + d);
                s[j] = a * scale;
                m = std::max(m, s[j]);
            }
            for (int j = 0; j < n; j++) l += std::exp(s[j] - m);
            for (int d = 0; d < HD; d++) {
                double o = 0;
                for (int j = 0; j < n; j++) o += std::exp(s[j] - m) * vc.get_f16(V + (size_t)j * HD + d);
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
    printf("attend_split_mma%s head_dim %3d heads %2d/%d splits %2d lengths %4d/%4d: %s (max abs err %.2e)\n",
           std::is_same_v<S, Q8> ? " q8_0" : "", HD, n_head, n_head_kv, n_split, len0, len1, ok ? "ok" : "FAIL",
           worst);
}

// RoPE and the KV store folded into attend_split_mma against rope_store
// then attend_split_mma without: the same partials and cache, bit for bit.
template <class S, int HD>
static void check_rope(std::mt19937& rng, int n_head, int n_head_kv, int n_split, int neox, int len0, int len1) {
    constexpr bool q8 = std::is_same_v<S, Q8>;
    const int rows = 2, n_seq = 2, n_ctx = std::max(len0, len1) + 9, half = HD / 2;
    const int chunk = (n_ctx + n_split - 1) / n_split;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_real_distribution<float> ang(0.f, 6.283f);
    std::vector<float> q((size_t)rows * n_head * HD), k((size_t)rows * n_head_kv * HD), v(k.size());
    for (auto* a : {&q, &k, &v})
        for (auto& x : *a) x = 1.5f * nd(rng);
    if (q8) q8_edge_rows<HD>(v, rows * n_head_kv, rng);
    std::vector<float> rope((size_t)n_ctx * half * 2);
    for (size_t i = 0; i < rope.size(); i += 2) {
        const float t = ang(rng);
        rope[i] = std::cos(t);
        rope[i + 1] = std::sin(t);
    }
    S kc((size_t)n_seq * n_head_kv * n_ctx * HD), vc(kc.size());
    kc.fill(rng, nd);
    vc.fill(rng, nd);
    const int slots[4] = {1, len0 - 1, 0, len1 - 1};
    const float scale = 1.f / std::sqrt((float)HD);
    // f16: zeros, as the kernel's rings start (the q8_0 ones poisoned).
    Smem<S, HD> smem(q8 ? 0x7e7e : 0);
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
    S kca = kc, vca = vc;
    gridDim = dim3_{(unsigned)rows, (unsigned)(n_head + n_head_kv), 1};
    for (unsigned r = 0; r < (unsigned)rows; r++)
        for (unsigned h = 0; h < (unsigned)(n_head + n_head_kv); h++)
            run_block(half, dim3_{r, h, 0}, [&] {
                rope_store(qa.data(), ka.data(), v.data(), slots, n_head, n_head_kv, HD, neox, rope.data(), nullptr,
                           nullptr, 0.f, kca.ptr(), vca.ptr(), n_ctx);
            });
    grid(false, [&] {
        attend_split_mma<HD>(qa.data(), kca.ptr(), vca.ptr(), slots, n_head, n_head_kv, n_ctx, chunk, scale,
                             pa.data(), nullptr, nullptr, 0, nullptr, smem.data());
    });
    // Folded: the new slots poisoned, the splits last to first.
    S kcb = kc, vcb = vc;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < n_head_kv; h++) {
            const size_t at = (((size_t)slots[2 * r] * n_head_kv + h) * n_ctx + slots[2 * r + 1]) * HD;
            poison_row(kcb, at, HD, true);
            poison_row(vcb, at, HD, false);
        }
    std::vector<float> pb(pa.size(), NAN);
    grid(true, [&] {
        attend_split_mma<HD>(q.data(), kcb.ptr(), vcb.ptr(), slots, n_head, n_head_kv, n_ctx, chunk, scale,
                             pb.data(), k.data(), v.data(), neox, rope.data(), smem.data());
    });
    int differ = 0;
    for (size_t i = 0; i < pa.size(); i++) differ += memcmp(&pa[i], &pb[i], 4) != 0;
    const int cache_differ = kca.differ(kcb) + vca.differ(vcb);
    const bool bad = differ || cache_differ;
    fails += bad;
    printf("attend_split_mma + rope%s head_dim %3d heads %2d/%d splits %2d neox %d lengths %4d/%4d: %s (%d of %zu "
           "partial floats, %d cache entries differ)\n", q8 ? " q8_0" : "", HD, n_head, n_head_kv, n_split, neox,
           len0, len1, bad ? "FAIL" : "ok", differ, pa.size(), cache_differ);
}

int main() {
    std::mt19937 rng(5);
    check<F16, 64>(rng, 14, 2, 1, 300, 129);
    check<F16, 64>(rng, 14, 2, 9, 1000, 700);
    check<F16, 64>(rng, 4, 4, 5, 777, 130);
    check<F16, 128>(rng, 28, 4, 3, 640, 200);
    check<F16, 128>(rng, 12, 1, 7, 901, 517);
    check<F16, 128>(rng, 16, 1, 2, 150, 333);
    check_rope<F16, 64>(rng, 14, 2, 5, 1, 600, 133);
    check_rope<F16, 128>(rng, 28, 4, 3, 0, 300, 451);
    // The q8_0 cache (its own generator: the cases above keep their data);
    // the last two with a row at the cache's last position.
    std::mt19937 rq(17);
    check<Q8, 64>(rq, 14, 2, 1, 300, 129);
    check<Q8, 64>(rq, 14, 2, 9, 1000, 700);
    check<Q8, 64>(rq, 4, 4, 5, 777, 130);
    check<Q8, 128>(rq, 28, 4, 3, 640, 200);
    check<Q8, 128>(rq, 12, 1, 7, 901, 517);
    check<Q8, 128>(rq, 16, 1, 2, 150, 333);
    check<Q8, 64>(rq, 7, 1, 4, 515, 77, 0);
    check<Q8, 128>(rq, 8, 2, 1, 200, 31, 0);
    for (int neox = 0; neox < 2; neox++) {
        check_rope<Q8, 64>(rq, 14, 2, 5, neox, 600, 133);
        check_rope<Q8, 128>(rq, 28, 4, 3, neox, 300, 451);
    }
    printf("attend_split_mma: %s\n", fails ? "FAILED" : "ok");
    return fails ? 1 : 0;
}
