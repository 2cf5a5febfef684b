// Host check of attention.cu's split decode attention (no GPU): the kernel
// bodies cut out of the source (extract.py -> split_extract.h), run block by
// block (block_emu.h), over f32, f16 and q8_0 caches (kv_caches.h: a q8_0
// cache's two arrays end where an unreadable page begins, so a read past
// them faults).
//   1. attend_split + attend_combine against an f64 softmax attention over
//      the cache as stored (q8_0: the codes times their f16 scales), head
//      sizes 64, 128 and 256, GQA groups of 1, 7 and 12 query heads (12: two
//      blocks per group), lengths 1 to 300 (not multiples of the split or
//      the tile) and rows of thousands of keys (more splits than one combine
//      batch) or at the cache's last position, one split (several tiles per
//      block) to many;
//   2. attend_split_rope (RoPE and KV store folded in) against rope_store
//      then attend_split: the same partials and the same cache bits (q8_0:
//      codes and scales), with the new position's cache slots poisoned and
//      the blocks run in reverse order (a block that read the slot instead
//      of its staged copy, or a store by the wrong block, would show);
//   3. the short-context form (one split, one query head per block, the
//      output written by the split kernel, with and without RoPE folded in)
//      against the split form's one split and attend_combine, bit for bit,
//      cache included;
//   4. rope_store into a q8_0 cache, both pairings, head sizes 64, 128 and
//      256: the rows' codes and scales equal ggml's q8_0 quantizer
//      (kv_caches.h) applied to the rotated keys and the values (among them
//      blocks of zeros, of ties at .5, of f16-subnormal scales), and nothing
//      else is written.
// Build and run: hostcheck/run.sh.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <type_traits>
#include "block_emu.h"

typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
#define MIRAGE_INF INFINITY
// An L2 prefetch changes no value.
inline void l2_prefetch_block(const void*, long) {}
struct uint4 { u32 x, y, z, w; };
struct uint2 { u32 x, y; };
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
using std::max;
inline float h2f(u16 h) {
    u32 s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? INFINITY : std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
#include "att_emu.h"
inline float block_sum(float, float*) { abort(); }  // rope_store's q/k norm: not used here
#include "split_extract.h"
#include "kv_caches.h"

// Every block of attend_split's grid (rows, n_head_kv * hg, n_split) running
// f, in reverse order when `reverse`.
template <class F>
static void run_split_grid(int rows, int head_blocks, int n_split, bool reverse, F f) {
    gridDim = dim3_{(unsigned)rows, (unsigned)head_blocks, (unsigned)n_split};
    const int total = rows * head_blocks * n_split;
    for (int i = 0; i < total; i++) {
        const int b = reverse ? total - 1 - i : i;
        const int r = b / (head_blocks * n_split), y = b / n_split % head_blocks, s = b % n_split;
        run_block(AS_THREADS, dim3_{(unsigned)r, (unsigned)y, (unsigned)s}, f);
    }
}

// The RoPE table of a cache of n_ctx positions (rope_table's blocks).
template <int HD>
static std::vector<float> rope_table(int n_ctx, float base) {
    std::vector<float> t((size_t)n_ctx * HD);
    const int blocks = (n_ctx * HD / 2 + 255) / 256;
    for (int b = 0; b < blocks; b++)
        run_block(256, dim3_{(unsigned)b, 0, 0}, [&] { rope_table_body(t.data(), n_ctx, HD, base); });
    return t;
}

static int head_blocks(int n_head, int n_head_kv) {
    const int G = n_head / n_head_kv;
    return n_head_kv * ((G + AS_MAX_G - 1) / AS_MAX_G);
}

// attend_combine over every (row, head) of rows decode rows: the splits'
// partials in part to out, in blocks of the host's size (whole slices of hd
// threads, at most AC_THREADS).
static void run_combine(int rows, int n_head, int hd, const float* part, const int* slots, int n_split, int chunk,
                        float* out) {
    gridDim = dim3_{(unsigned)rows, (unsigned)n_head, 1};
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < n_head; h++)
            run_block(AC_THREADS / hd * hd, dim3_{(unsigned)r, (unsigned)h, 0}, [&] {
                attend_combine_body(part, slots, n_head, hd, n_split, chunk, 0, rows, 0, out);
            });
}

// Floats of a and b whose bits differ.
static int differ_bits(const std::vector<float>& a, const std::vector<float>& b) {
    int n = 0;
    for (size_t i = 0; i < a.size(); i++) n += memcmp(&a[i], &b[i], 4) != 0;
    return n;
}

template <class S, int HD>
static int check(std::mt19937& rng, int n_head, int n_head_kv, int n_split, int len0, int len1, int n_ctx = 320) {
    const int rows = 2, n_seq = 2;
    const int chunk = (n_ctx + n_split - 1) / n_split;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> q((size_t)rows * n_head * HD);
    for (auto& v : q) v = 1.5f * nd(rng);
    S kc((size_t)n_seq * n_head_kv * n_ctx * HD), vc(kc.size());
    kc.fill(rng, nd);
    vc.fill(rng, nd);
    int slots[4] = {1, len0 - 1, 0, len1 - 1};
    std::vector<float> part((size_t)rows * n_head * n_split * (HD + 2), NAN), out((size_t)rows * n_head * HD, -99.f);
    const float scale = 1.f / std::sqrt((float)HD);
    run_split_grid(rows, head_blocks(n_head, n_head_kv), n_split, false, [&] {
        attend_split<HD>(q.data(), kc.ptr(), vc.ptr(), slots, n_head, n_head_kv, n_ctx, chunk, AS_MAX_G, scale,
                         part.data(), (float*)0);
    });
    run_combine(rows, n_head, HD, part.data(), slots, n_split, chunk, out.data());
    double worst = 0;
    for (int r = 0; r < rows; r++) {
        const int seq = slots[2 * r], n = slots[2 * r + 1] + 1;
        for (int h = 0; h < n_head; h++) {
            const int kvh = h / (n_head / n_head_kv);
            const float* qh = &q[((size_t)r * n_head + h) * HD];
            const size_t K = ((size_t)seq * n_head_kv + kvh) * n_ctx * HD, V = K;
            std::vector<double> s(n);
            double m = -INFINITY, l = 0;
            for (int j = 0; j < n; j++) {
                double a = 0;
                for (int d = 0; d < HD; d++) a += (double)qh[d] * kc.get(K + (size_t)j * HD + d);
                s[j] = a * scale;
                m = std::max(m, s[j]);
            }
            for (auto& x : s) l += (x = std::exp(x - m));
            for (int d = 0; d < HD; d++) {
                double a = 0;
                for (int j = 0; j < n; j++) a += s[j] * vc.get(V + (size_t)j * HD + d);
                worst = std::max(worst, std::fabs(a / l - out[((size_t)r * n_head + h) * HD + d]));
            }
        }
    }
    const bool bad = !(worst < 2e-5);
    printf("attend_split %s head_dim %3d heads %2d/%d splits %2d lengths %3d/%3d: %s (max abs err %.2e)\n", S::name,
           HD, n_head, n_head_kv, n_split, len0, len1, bad ? "FAIL" : "ok", worst);
    return bad;
}

// Two decode rows (sequence 1 at position len0 - 1, sequence 0 at len1 - 1)
// over a random cache: the unrotated q, k and v (v with q8_edge_rows when
// edge); the cache kc / vc after
// rope_store, with q1 / k1 its rotated q and k; and kc2 / vc2, the cache
// before it with the rows' new slots poisoned (what attend_split_rope must
// write itself, reading its staged copy); rope, the cache's RoPE table.
template <class S, int HD>
struct RopeCase {
    static constexpr int rows = 2, n_seq = 2;
    static constexpr float base = 10000.f;
    int n_head, n_head_kv, n_ctx, neox;
    int slots[4];
    std::vector<float> q, k, v, q1, k1, rope;
    S kc, vc, kc2, vc2;

    RopeCase(std::mt19937& rng, int n_head, int n_head_kv, int n_ctx, int neox, int len0, int len1, bool edge = false)
        : n_head(n_head), n_head_kv(n_head_kv), n_ctx(n_ctx), neox(neox), slots{1, len0 - 1, 0, len1 - 1},
          kc((size_t)n_seq * n_head_kv * n_ctx * HD), vc(kc.size()), kc2(kc.size()), vc2(kc.size()) {
        std::normal_distribution<float> nd(0.f, 1.f);
        q.resize((size_t)rows * n_head * HD);
        k.resize((size_t)rows * n_head_kv * HD);
        v.resize(k.size());
        for (auto* x : {&q, &k, &v})
            for (auto& e : *x) e = nd(rng);
        if (edge) q8_edge_rows<HD>(v, rows * n_head_kv, rng);
        kc.fill(rng, nd);
        vc.fill(rng, nd);
        kc2 = kc;
        vc2 = vc;
        for (int r = 0; r < rows; r++)
            for (int h = 0; h < n_head_kv; h++) {
                const long at = (((long)slots[2 * r] * n_head_kv + h) * n_ctx + slots[2 * r + 1]) * HD;
                kc2.poison(at, HD, true);
                vc2.poison(at, HD, false);
            }
        rope = rope_table<HD>(n_ctx, base);
        q1 = q;
        k1 = k;
        for (int r = 0; r < rows; r++)
            for (int h = 0; h < n_head + n_head_kv; h++)
                run_block(HD / 2, dim3_{(unsigned)r, (unsigned)h, 0}, [&] {
                    rope_store(q1.data(), k1.data(), v.data(), slots, n_head, n_head_kv, HD, neox, rope.data(),
                               (const float*)0, (const float*)0, 1e-6f, kc.ptr(), vc.ptr(), n_ctx);
                });
    }

    // Cache entries (f32 or f16 elements, q8_0 codes and scales) where kc2 /
    // vc2 differ from kc / vc.
    int cache_differ() const { return kc.differ(kc2) + vc.differ(vc2); }
};

template <class S, int HD>
static int check_rope(std::mt19937& rng, int n_head, int n_head_kv, int n_split, int neox, int len0, int len1,
                      bool edge = false) {
    RopeCase<S, HD> c(rng, n_head, n_head_kv, 160, neox, len0, len1, edge);
    const int rows = c.rows, n_ctx = c.n_ctx;
    const int chunk = (n_ctx + n_split - 1) / n_split;
    const size_t np = (size_t)rows * n_head * n_split * (HD + 2);
    std::vector<float> a(np, 7.f), b(np, 7.f);
    const float scale = 1.f / std::sqrt((float)HD);
    const int hb = head_blocks(n_head, n_head_kv);
    run_split_grid(rows, hb, n_split, false, [&] {
        attend_split<HD>(c.q1.data(), c.kc.ptr(), c.vc.ptr(), c.slots, n_head, n_head_kv, n_ctx, chunk, AS_MAX_G,
                         scale, a.data(), (float*)0);
    });
    run_split_grid(rows, hb, n_split, true, [&] {
        attend_split_rope<HD>(c.q.data(), c.k.data(), c.v.data(), c.kc2.ptr(), c.vc2.ptr(), c.slots, n_head,
                              n_head_kv, n_ctx, chunk, AS_MAX_G, scale, neox, c.rope.data(), b.data(), (float*)0);
    });
    const int differ = differ_bits(a, b), cache_differ = c.cache_differ();
    const bool bad = differ || cache_differ;
    printf("attend_split_rope %s head_dim %3d heads %2d/%d splits %2d neox %d lengths %3d/%3d: %s (%d of %zu partial "
           "floats, %d cache entries differ)\n", S::name, HD, n_head, n_head_kv, n_split, neox, len0, len1,
           bad ? "FAIL" : "ok", differ, np, cache_differ);
    return bad;
}

// The short-context form of rows of len0 and len1 keys (at most one tile)
// against rope_store, attend_split with AS_MAX_G heads per block over one
// split, and attend_combine: the same output bits and cache bits. With
// rope, the short form folds RoPE and the store in (attend_split_rope,
// blocks in reverse order, the new slots poisoned), else it reads the
// rotated cache (attend_split).
template <class S, int HD>
static int check_short(std::mt19937& rng, int n_head, int n_head_kv, bool rope, int len0, int len1, int neox = 1,
                       bool edge = false) {
    RopeCase<S, HD> c(rng, n_head, n_head_kv, 200, neox, len0, len1, edge);
    const int rows = c.rows, n_ctx = c.n_ctx;
    if (!rope) {
        c.kc2 = c.kc;
        c.vc2 = c.vc;
    }
    const float scale = 1.f / std::sqrt((float)HD);
    // The split form: one split, then the combine.
    std::vector<float> part((size_t)rows * n_head * (HD + 2), NAN), want((size_t)rows * n_head * HD, -99.f);
    run_split_grid(rows, head_blocks(n_head, n_head_kv), 1, false, [&] {
        attend_split<HD>(c.q1.data(), c.kc.ptr(), c.vc.ptr(), c.slots, n_head, n_head_kv, n_ctx, n_ctx, AS_MAX_G,
                         scale, part.data(), (float*)0);
    });
    run_combine(rows, n_head, HD, part.data(), c.slots, 1, n_ctx, want.data());
    // The short form: one head per block, writing the output.
    std::vector<float> got(want.size(), -77.f);
    run_split_grid(rows, n_head, 1, true, [&] {
        if (rope)
            attend_split_rope<HD>(c.q.data(), c.k.data(), c.v.data(), c.kc2.ptr(), c.vc2.ptr(), c.slots, n_head,
                                  n_head_kv, n_ctx, n_ctx, 1, scale, c.neox, c.rope.data(), (float*)0, got.data());
        else
            attend_split<HD>(c.q1.data(), c.kc2.ptr(), c.vc2.ptr(), c.slots, n_head, n_head_kv, n_ctx, n_ctx, 1,
                             scale, (float*)0, got.data());
    });
    const int differ = differ_bits(want, got), cache_differ = c.cache_differ();
    const bool bad = differ || cache_differ;
    printf("short form%s %s head_dim %3d heads %2d/%d lengths %3d/%3d: %s (%d of %zu outputs, %d cache entries "
           "differ)\n", rope ? " + rope" : "", S::name, HD, n_head, n_head_kv, len0, len1, bad ? "FAIL" : "ok", differ,
           want.size(), cache_differ);
    return bad;
}

// rope_store into a q8_0 cache against ggml's quantizer: the cache before it
// with the rows' slots quantized by q8_ref_block from the rotated keys
// (rope_store's k, rotated in place) and the values, bit for bit, codes and
// scales (so nothing else was written either). Row 0 at the cache's last
// position.
template <int HD>
static int check_q8_store(std::mt19937& rng, int n_head, int n_head_kv, int neox) {
    const int n_ctx = 96;
    RopeCase<Q8, HD> c(rng, n_head, n_head_kv, n_ctx, neox, n_ctx, 33, true);
    Q8 kw = c.kc2, vw = c.vc2;
    for (int r = 0; r < c.rows; r++)
        for (int h = 0; h < n_head_kv; h++) {
            const long at = (((long)c.slots[2 * r] * n_head_kv + h) * n_ctx + c.slots[2 * r + 1]) * HD;
            kw.quantize(at, &c.k1[((size_t)r * n_head_kv + h) * HD], HD);
            vw.quantize(at, &c.v[((size_t)r * n_head_kv + h) * HD], HD);
        }
    const int differ = c.kc.differ(kw) + c.vc.differ(vw);
    const size_t total = 2 * (c.kc.q.size() + c.kc.d.size());
    // The values' edge cases among the stored scales.
    int zero = 0, subnormal = 0;
    for (int r = 0; r < c.rows; r++)
        for (int h = 0; h < n_head_kv; h++)
            for (int b = 0; b < HD / 32; b++) {
                const long at = (((long)c.slots[2 * r] * n_head_kv + h) * n_ctx + c.slots[2 * r + 1]) * HD + 32 * b;
                const u16 d = vw.d[at >> 5];
                zero += d == 0;
                subnormal += d != 0 && (d & 0x7c00) == 0;
            }
    printf("rope_store q8_0 head_dim %3d heads %2d/%d neox %d: %s (%d of %zu codes and scales differ from the "
           "reference quantizer; %d zero and %d subnormal value scales)\n", HD, n_head, n_head_kv, neox,
           differ ? "FAIL" : "ok", differ, total, zero, subnormal);
    return differ != 0;
}

template <class S, int HD>
static void check_head_dim(std::mt19937& rng, int& fails, int& cases) {
    const int heads[3][2] = {{14, 2}, {12, 1}, {4, 4}};
    // One split of several tiles; many splits, one of them of one key (length
    // 1) or a partial last one (300 = 18 * 16 + 12); a split count between.
    const int splits[3][3] = {{1, 17, 300}, {20, 1, 300}, {5, 129, 77}};
    for (auto& hk : heads)
        for (auto& sp : splits) {
            if constexpr (std::is_same_v<S, Q8>) {
                fails += check<Q8, HD>(rng, hk[0], hk[1], sp[0], sp[1], sp[2]);
                cases++;
            } else {
                fails += check<F32, HD>(rng, hk[0], hk[1], sp[0], sp[1], sp[2]);
                fails += check<F16, HD>(rng, hk[0], hk[1], sp[0], sp[1], sp[2]);
                cases += 2;
            }
        }
}

int main() {
    std::mt19937 rng(11);
    int fails = 0, cases = 0;
    check_head_dim<F32, 64>(rng, fails, cases);
    check_head_dim<F32, 128>(rng, fails, cases);
    check_head_dim<F32, 256>(rng, fails, cases);
    // Long rows: more splits than a combine block's slices take in one batch
    // (80 and 71 splits against 8 slices x AC_BATCH at head size 64).
    fails += check<F16, 64>(rng, 14, 2, 80, 5100, 4500, 5120);
    fails += check<F32, 128>(rng, 7, 1, 80, 5120, 3000, 5120);
    cases += 2;
    for (auto [nh, nkv] : {std::pair{14, 2}, std::pair{12, 1}})
        for (int n_split : {1, 7})
            for (int neox = 0; neox < 2; neox++) {
                if ((n_split == 1) != (neox == 0)) continue;  // both splits, both pairings, fewer runs
                fails += check_rope<F32, 64>(rng, nh, nkv, n_split, neox, 37, 150);
                fails += check_rope<F16, 128>(rng, nh, nkv, n_split, neox, 64, 129);
                cases += 2;
            }
    for (auto [nh, nkv] : {std::pair{14, 2}, std::pair{12, 1}, std::pair{4, 4}})
        for (bool rope : {false, true}) {
            fails += check_short<F32, 64>(rng, nh, nkv, rope, 1, 37);
            fails += check_short<F16, 128>(rng, nh, nkv, rope, 128, 64);
            fails += check_short<F16, 256>(rng, nh, nkv, rope, 100, 2);
            cases += 3;
        }
    // The q8_0 cache (its own generator: the cases above keep their data).
    std::mt19937 rq(13);
    for (int neox = 0; neox < 2; neox++) {
        fails += check_q8_store<64>(rq, 6, 2, neox);
        fails += check_q8_store<128>(rq, 6, 2, neox);
        fails += check_q8_store<256>(rq, 4, 2, neox);
        cases += 3;
    }
    check_head_dim<Q8, 64>(rq, fails, cases);
    check_head_dim<Q8, 128>(rq, fails, cases);
    check_head_dim<Q8, 256>(rq, fails, cases);
    // A row at the cache's last position (the tiles past it unread).
    fails += check<Q8, 64>(rq, 14, 2, 80, 5120, 4500, 5120);
    fails += check<Q8, 128>(rq, 7, 1, 3, 320, 300);
    cases += 2;
    for (auto [nh, nkv] : {std::pair{14, 2}, std::pair{12, 1}})
        for (int n_split : {1, 7})
            for (int neox = 0; neox < 2; neox++) {
                fails += check_rope<Q8, 64>(rq, nh, nkv, n_split, neox, 160, 37, true);
                fails += check_rope<Q8, 128>(rq, nh, nkv, n_split, neox, 64, 129, true);
                cases += 2;
            }
    fails += check_rope<Q8, 256>(rq, 8, 2, 3, 1, 150, 160, true);
    fails += check_rope<Q8, 256>(rq, 8, 2, 1, 0, 5, 77, true);
    cases += 2;
    for (auto [nh, nkv] : {std::pair{14, 2}, std::pair{12, 1}, std::pair{4, 4}})
        for (bool rope : {false, true}) {
            fails += check_short<Q8, 64>(rq, nh, nkv, rope, 1, 37, 0, true);
            fails += check_short<Q8, 128>(rq, nh, nkv, rope, 128, 64, 1, true);
            fails += check_short<Q8, 256>(rq, nh, nkv, rope, 100, 2, rope ? 0 : 1, true);
            cases += 3;
        }
    printf("attend_split / attend_combine / attend_split_rope / short form / rope_store q8_0: %d of %d cases ok\n",
           cases - fails, cases);
    return fails ? 1 : 0;
}
