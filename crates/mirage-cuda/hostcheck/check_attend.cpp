// Host check of attention.cu's attend_part (no GPU): the kernel body cut out
// of the source (extract.py -> attend_extract.h) and a plain form that
// loads each key and value as it uses it (attend_part_plain below), both
// run block by block (block_emu.h), f32 and f16 caches, head_dim 64 to 256,
// GQA, several split sizes and positions: the partials (max, sum, V sums)
// must be the same bits, since the kernel's batched loads only reorder
// loads, not arithmetic. Then attend_rope_part against rope_store +
// attend_part (check_rope below).
// Build and run: hostcheck/run.sh.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include "block_emu.h"

typedef unsigned short u16;
typedef unsigned int u32;
#define MIRAGE_INF INFINITY
inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
using std::max;
inline float h2f(u16 h) {
    u32 s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? INFINITY : std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
#include "att_emu.h"
inline float block_sum(float, float*) { abort(); }  // rope_store's q/k norm: not used here
#include "attend_extract.h"

template <typename KV>
__device__ void attend_part_plain(const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
                            const int* __restrict__ slots, int n_head, int n_head_kv, int head_dim, int n_ctx,
                            int chunk, float scale, float* __restrict__ part) {
    __shared__ float qs[ATT_THREADS];
    __shared__ float sc[ATT_TILE];
    __shared__ float red[ATT_THREADS];
    __shared__ float lred[ATT_THREADS / 64];
    int row = blockIdx.x, head = blockIdx.y, split = blockIdx.z, n_split = gridDim.z;
    int seq = slots[2 * row], n = slots[2 * row + 1] + 1;
    int j0 = split * chunk, j1 = min(n, j0 + chunk);
    if (j0 >= j1) return;  // the combine step skips splits past the position
    int kvh = head / (n_head / n_head_kv);
    const float* qh = q + ((long)row * n_head + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qh[d];
    const KV* K = kc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    const KV* V = vc + ((long)seq * n_head_kv + kvh) * n_ctx * head_dim;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int groups = blockDim.x / head_dim, g = threadIdx.x / head_dim, d = threadIdx.x % head_dim;
    float m = -MIRAGE_INF, l = 0.f, acc = 0.f;
    __syncthreads();
    for (int t0 = j0; t0 < j1; t0 += ATT_TILE) {
        int cnt = min(ATT_TILE, j1 - t0);
        for (int jj = warp; jj < cnt; jj += nw) {
            long kr = (long)(t0 + jj) * head_dim;
            float s = 0.f;
            for (int e = lane; e < head_dim; e += 32) s += qs[e] * kv_load(K, kr + e);
            s = warp_sum(s);
            if (lane == 0) sc[jj] = s * scale;
        }
        __syncthreads();
        float tm = -MIRAGE_INF;
        for (int jj = 0; jj < cnt; jj++) tm = fmaxf(tm, sc[jj]);
        att_rescale(sc, cnt, fmaxf(m, tm), m, l, acc);
        if (g < groups) {
            for (int jj = g; jj < cnt; jj += groups) {
                float p = sc[jj];
                acc += p * kv_load(V, (long)(t0 + jj) * head_dim + d);
                l += p;
            }
        }
        __syncthreads();  // before the next tile overwrites sc
    }
    att_store_partial(acc, l, m, g, groups, d, head_dim, red, lred,
                      part + (((long)row * n_head + head) * n_split + split) * (head_dim + 2));
}

// Runs every block of the grid (rows, n_head, n_split) of f, 256 threads.
template <class F>
static void run_grid(int rows, int n_head, int n_split, F f) {
    gridDim.z = n_split;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < n_head; h++)
            for (int s = 0; s < n_split; s++) run_block(256, dim3_{(unsigned)r, (unsigned)h, (unsigned)s}, f);
}

template <class KV>
static int check(std::mt19937& rng, int head_dim, int chunk, int n_pos0, int n_pos1, const char* ty,
                 KV (*conv)(float)) {
    const int rows = 2, n_head = 2, n_head_kv = 1, n_ctx = 160, n_seq = 2;
    const int n_split = (n_ctx + chunk - 1) / chunk;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> q(rows * n_head * head_dim);
    for (auto& v : q) v = nd(rng);
    std::vector<KV> kc(n_seq * n_head_kv * n_ctx * head_dim), vc(kc.size());
    for (auto& v : kc) v = conv(nd(rng));
    for (auto& v : vc) v = conv(nd(rng));
    int slots[4] = {0, n_pos0 - 1, 1, n_pos1 - 1};
    const size_t np = (size_t)rows * n_head * n_split * (head_dim + 2);
    std::vector<float> a(np, 7.f), b(np, 7.f);
    const float scale = 1.f / std::sqrt((float)head_dim);
    run_grid(rows, n_head, n_split, [&] {
        attend_part<KV>(q.data(), kc.data(), vc.data(), slots, n_head, n_head_kv, head_dim, n_ctx, chunk, scale, a.data());
    });
    // The plain form takes a fixed chunk: each row's blocks run with the
    // chunk att_chunk gives that row.
    gridDim.z = n_split;
    for (int r = 0; r < rows; r++) {
        const int row_chunk = att_chunk(slots[2 * r + 1] + 1, n_split, chunk);
        for (int h = 0; h < n_head; h++)
            for (int s = 0; s < n_split; s++)
                run_block(256, dim3_{(unsigned)r, (unsigned)h, (unsigned)s}, [&] {
                    attend_part_plain<KV>(q.data(), kc.data(), vc.data(), slots, n_head, n_head_kv, head_dim, n_ctx,
                                       row_chunk, scale, b.data());
                });
    }
    int differ = 0;
    for (size_t i = 0; i < np; i++) differ += memcmp(&a[i], &b[i], 4) != 0;
    printf("attend_part %s head_dim %3d chunk %3d positions %3d/%3d: %s (%d of %zu partial floats differ)\n", ty,
           head_dim, chunk, n_pos0, n_pos1, differ ? "FAIL" : "ok", differ, np);
    return differ != 0;
}

static float keep(float f) { return f; }

// attend_rope_part (RoPE and KV store folded into the attention) against
// rope_store then attend_part: the same partials and the same cache bits.
// Two rows in two sequences, GQA (4 query heads, 2 KV heads); before the
// folded run the new position's cache slots hold a poison value, and its
// blocks run in reverse order, so a block that read the slot instead of its
// staged copy, or a store by the wrong block, would show.
template <class KV>
static int check_rope(std::mt19937& rng, int head_dim, int chunk, int neox, int n_pos0, int n_pos1, const char* ty,
                      KV (*conv)(float)) {
    const int rows = 2, n_head = 4, n_head_kv = 2, n_ctx = 160, n_seq = 2;
    const int n_split = (n_ctx + chunk - 1) / chunk;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> q(rows * n_head * head_dim), k(rows * n_head_kv * head_dim), v(k.size());
    for (auto* x : {&q, &k, &v})
        for (auto& e : *x) e = nd(rng);
    std::vector<KV> kc(n_seq * n_head_kv * n_ctx * head_dim), vc(kc.size());
    for (auto& e : kc) e = conv(nd(rng));
    for (auto& e : vc) e = conv(nd(rng));
    int slots[4] = {1, n_pos0 - 1, 0, n_pos1 - 1};
    std::vector<KV> kc2 = kc, vc2 = vc;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < n_head_kv; h++)
            for (int d = 0; d < head_dim; d++) {
                long at = (((long)slots[2 * r] * n_head_kv + h) * n_ctx + slots[2 * r + 1]) * head_dim + d;
                kc2[at] = conv(300.f);
                vc2[at] = conv(-300.f);
            }
    const size_t np = (size_t)rows * n_head * n_split * (head_dim + 2);
    std::vector<float> a(np, 7.f), b(np, 7.f);
    const float scale = 1.f / std::sqrt((float)head_dim), base = 10000.f;
    std::vector<float> q1 = q, k1 = k;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < n_head + n_head_kv; h++)
            run_block(head_dim / 2, dim3_{(unsigned)r, (unsigned)h, 0}, [&] {
                rope_store<KV>(q1.data(), k1.data(), v.data(), slots, n_head, n_head_kv, head_dim, neox, base,
                               (const float*)0, (const float*)0, 1e-6f, kc.data(), vc.data(), n_ctx);
            });
    run_grid(rows, n_head, n_split, [&] {
        attend_part<KV>(q1.data(), kc.data(), vc.data(), slots, n_head, n_head_kv, head_dim, n_ctx, chunk, scale,
                        a.data());
    });
    gridDim.z = n_split;
    for (int r = rows - 1; r >= 0; r--)
        for (int h = n_head - 1; h >= 0; h--)
            for (int sp = n_split - 1; sp >= 0; sp--) {
                const int n = slots[2 * r + 1] + 1;
                if (sp * att_chunk(n, n_split, chunk) >= n) continue;  // attend_then_merge's empty splits
                run_block(256, dim3_{(unsigned)r, (unsigned)h, (unsigned)sp}, [&] {
                    attend_rope_part<KV>(q.data(), k.data(), v.data(), kc2.data(), vc2.data(), slots, n_head,
                                         n_head_kv, head_dim, n_ctx, chunk, scale, neox, base, b.data());
                });
            }
    int differ = 0, cache_differ = 0;
    for (size_t i = 0; i < np; i++) differ += memcmp(&a[i], &b[i], 4) != 0;
    for (size_t i = 0; i < kc.size(); i++)
        cache_differ += memcmp(&kc[i], &kc2[i], sizeof(KV)) != 0 || memcmp(&vc[i], &vc2[i], sizeof(KV)) != 0;
    const bool bad = differ || cache_differ;
    printf("attend_rope_part %s head_dim %3d chunk %3d neox %d positions %3d/%3d: %s (%d of %zu partial floats, %d "
           "cache entries differ)\n", ty, head_dim, chunk, neox, n_pos0, n_pos1, bad ? "FAIL" : "ok", differ, np,
           cache_differ);
    return bad;
}

int main() {
    std::mt19937 rng(11);
    int fails = 0, cases = 0;
    for (int hd : {64, 80, 96, 128, 256})
        for (int chunk : {64, 160})
            for (auto [p0, p1] : {std::pair{37, 150}}) {
                fails += check<float>(rng, hd, chunk, p0, p1, "f32", keep);
                fails += check<u16>(rng, hd, chunk, p0, p1, "f16", f2h);
                cases += 2;
            }
    for (int hd : {64, 128})
        for (int chunk : {64, 160})
            for (int neox : {0, 1}) {
                fails += check_rope<float>(rng, hd, chunk, neox, 37, 150, "f32", keep);
                fails += check_rope<u16>(rng, hd, chunk, neox, 64, 129, "f16", f2h);
                cases += 2;
            }
    printf("attend_part / attend_rope_part: %d of %d cases ok\n", cases - fails, cases);
    return fails ? 1 : 0;
}
