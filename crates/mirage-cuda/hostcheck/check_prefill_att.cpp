// Host check of attention.cu's prefill attention on f16 tensor cores (no
// GPU; extract.py -> fa_extract.h), the mma instruction emulated by the PTX
// ISA's fragment layout (mma_emu.h), blocks run as fibers (block_emu.h):
// attend_prefill<HD> against an f64 causal softmax attention over the
// cache as stored, for f32, f16 and q8_0 caches (kv_caches.h; q8_0: the
// codes times their f16 scales, the arrays ending where an unreadable page
// begins), head sizes 64 and 128, GQA groups of 1, 2, 4 and 7 query heads,
// and batches that start at position 0 or after 70 and more cached
// positions, with lengths that leave partial row and key tiles or end at
// the cache's last position; the keys in one block or split over several
// (attend_prefill_merge).
// Build and run: hostcheck/run.sh.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>
#include "block_emu.h"
#include "ptx_emu.h"
#include "att_emu.h"
#define MIRAGE_INF INFINITY
#define __align__(n) __attribute__((aligned(n)))
#include "mma_emu.h"
#include "fa_extract.h"
#include "kv_caches.h"

static int fails = 0;

template <class S, int HD>
void check(std::mt19937& rng, int n_head_kv, int group, int pos0, int n, int n_split, int spare = 5) {
    const int n_head = n_head_kv * group, n_ctx = pos0 + n + spare;
    std::normal_distribution<float> N(0.f, 1.f);
    std::vector<float> q((size_t)n * n_head * HD);
    for (auto& v : q) v = N(rng);
    // Cache [seq 0 .. 1][kv head][n_ctx][HD]; the batch is sequence 1.
    const long per_seq = (long)n_head_kv * n_ctx * HD;
    S kc(2 * per_seq), vc(2 * per_seq);
    kc.fill(rng, N);
    vc.fill(rng, N);
    const char* kv_name = S::name;
    std::vector<int> slots(2 * n);
    for (int i = 0; i < n; i++) slots[2 * i] = 1, slots[2 * i + 1] = pos0 + i;
    std::vector<float> out((size_t)n * n_head * HD, NAN);
    const float scale = 1.f / std::sqrt((float)HD);
    const int rows = n * group;
    // Keys per split: a multiple of the key tile, n_split splits cover them.
    const int keys = pos0 + n, tiles = (keys + FA_KEYS - 1) / FA_KEYS;
    const int chunk = FA_KEYS * ((tiles + n_split - 1) / n_split);
    std::vector<float> part(n_split > 1 ? (size_t)n_split * n * n_head * (HD + 2) : 0, NAN);
    gridDim = dim3_{(unsigned)((rows + FA_ROWS - 1) / FA_ROWS), (unsigned)n_head_kv, (unsigned)n_split};
    for (unsigned bz = 0; bz < gridDim.z; bz++)
        for (unsigned by = 0; by < gridDim.y; by++)
            for (unsigned bx = 0; bx < gridDim.x; bx++)
                run_block(FA_WARPS * 32, dim3_{bx, by, bz}, [&] {
                    attend_prefill<HD>(q.data(), kc.cptr(), vc.cptr(), slots.data(), n, n_head, n_head_kv, n_ctx,
                                       scale, chunk, n_split > 1 ? part.data() : nullptr, out.data());
                });
    if (n_split > 1)
        for (long row = 0; row < (long)n * n_head; row++)
            for (int d = 0; d < HD; d++)
                out[row * HD + d] = attend_prefill_merge(part.data(), row, (long)n * n_head, HD, n_split, d);
    double worst = 0, num = 0, den = 0;
    for (int i = 0; i < n; i++)
        for (int h = 0; h < n_head; h++) {
            const int kvh = h / group, pos = pos0 + i;
            const long K = per_seq + (long)kvh * n_ctx * HD, V = K;
            const float* qr = q.data() + ((long)i * n_head + h) * HD;
            std::vector<double> s(pos + 1);
            double mx = -1e300;
            for (int k = 0; k <= pos; k++) {
                double a = 0;
                for (int d = 0; d < HD; d++) a += (double)qr[d] * kc.get(K + (long)k * HD + d);
                s[k] = a * scale;
                mx = std::max(mx, s[k]);
            }
            double sum = 0;
            for (int k = 0; k <= pos; k++) sum += (s[k] = std::exp(s[k] - mx));
            for (int d = 0; d < HD; d++) {
                double want = 0;
                for (int k = 0; k <= pos; k++) want += s[k] * vc.get(V + (long)k * HD + d);
                want /= sum;
                double got = out[((long)i * n_head + h) * HD + d];
                double err = std::fabs(got - want);
                worst = std::max(worst, err);
                num += err * err;
                den += want * want;
                // f16 queries (times scale) and probabilities: ~1e-3 of |v| ~ 1.
                if (!(err <= 4e-3)) {
                    if (fails < 10)
                        fprintf(stderr, "%s d%d group %d pos0 %d n %d: out[%d][%d][%d] = %g, want %g\n", kv_name, HD,
                                group, pos0, n, i, h, d, got, want);
                    fails++;
                }
            }
        }
    printf("prefill attention %s d%d, %d KV heads x group %d, positions %d..%d, %d splits of %d keys: max abs err "
           "%.2e, rel err %.2e\n",
           kv_name, HD, n_head_kv, group, pos0, pos0 + n - 1, n_split, chunk, worst, std::sqrt(num / den));
}

int main() {
    std::mt19937 rng(5);
    check<F32, 64>(rng, 2, 7, 0, 37, 1);
    check<F16, 64>(rng, 2, 7, 70, 37, 1);
    check<F16, 64>(rng, 1, 1, 0, 130, 1);
    check<F16, 128>(rng, 2, 2, 70, 45, 1);
    check<F32, 128>(rng, 1, 7, 3, 20, 1);
    // Split keys: rows whose positions end before a split, a last split
    // that is partly past the batch.
    check<F16, 64>(rng, 2, 7, 200, 37, 3);
    check<F16, 128>(rng, 2, 4, 300, 64, 4);  // a long context's chunk
    check<F32, 64>(rng, 1, 2, 0, 150, 2);
    // The q8_0 cache (its own generator: the cases above keep their data);
    // the last two end at the cache's last position.
    std::mt19937 rq(19);
    check<Q8, 64>(rq, 2, 7, 70, 37, 1);
    check<Q8, 64>(rq, 1, 1, 0, 130, 1);
    check<Q8, 128>(rq, 2, 2, 70, 45, 1);
    check<Q8, 64>(rq, 2, 7, 200, 37, 3);
    check<Q8, 128>(rq, 2, 4, 300, 64, 4);
    check<Q8, 64>(rq, 1, 2, 0, 150, 2, 0);
    check<Q8, 128>(rq, 2, 4, 100, 29, 1, 0);
    if (fails) {
        fprintf(stderr, "check_prefill_att: %d failures\n", fails);
        return 1;
    }
    printf("check_prefill_att: ok\n");
    return 0;
}
