// Host check of the mat-vec variants' dot helpers (q8s_dot16, q4ks_dot16,
// MvvRows; run.sh): 32 lanes run as 32 threads so that __shfl_sync is real
// (a barrier per shuffle), summed over the warp, against f64 references on
// the element accessors q8s_elem / q4ks_elem (themselves checked against
// dequant_unit in the other checks), for every variant's NR / U / PF, the FFN's
// two-matrix row split (NH = NR / 2), rows past the matrix end, and
// column slices (split-K offsets as mv3_variant computes them).
#include "prelude.h"
#include <barrier>
#include <thread>
#include <functional>
static std::barrier<>* g_bar;
static u32 g_slot[32];
static thread_local int t_lane;
inline u32 __shfl_sync(u32, u32 v, int src) {
    g_slot[t_lane] = v; g_bar->arrive_and_wait();
    u32 r = g_slot[src & 31]; g_bar->arrive_and_wait();
    return r;
}
#include "mvv_extract.h"

// Runs f(lane, acc) on 32 threads; returns the per-row sums over lanes.
template <int NR, class F> void warp_run(F f, double* tot) {
    std::barrier<> bar(32); g_bar = &bar;
    float acc[32][NR] = {};
    std::vector<std::thread> th;
    for (int l = 0; l < 32; l++) th.emplace_back([&, l] { t_lane = l; f(l, acc[l]); });
    for (auto& t : th) t.join();
    for (int k = 0; k < NR; k++) { tot[k] = 0; for (int l = 0; l < 32; l++) tot[k] += acc[l][k]; }
}

static double worst = 0;
static long preload_checked = 0;
// Layout L (0 = split Q8_0, 1 = split Q4_K), NR rows per warp, NH rows from
// matrix a (the rest from matrix b), U chunks; S column slices.
template <int L, int NR, int NH, int U, bool PF = false>
void check(const std::vector<u8>& A, const std::vector<u8>& B, int rows, int cols, const std::vector<float>& x, int S) {
    int qs = L == 0 ? cols : cols / 2, ms = cols / 16, G = L == 0 ? 128 : 256;
    auto el = [&](const std::vector<u8>& W, int r, int i) {
        return L == 0 ? q8s_elem(W.data(), rows, cols, r, i) : q4ks_elem(W.data(), rows, cols, r, i);
    };
    int per_warp_rows = NH;  // rows of each matrix per warp
    for (int r0 = 0; r0 < rows; r0 += per_warp_rows) {
        int n_gran = (cols + G - 1) / G, per_slice = (n_gran + S - 1) / S;
        double tot[NR] = {};
        for (int slice = 0; slice < S; slice++) {
            int c_lo = std::min(cols, slice * per_slice * G), c_n = std::min(cols, c_lo + per_slice * G) - c_lo;
            if (c_n <= 0) continue;
            MvvRows R;
            R.qa = A.data() + (long)r0 * qs + (L == 0 ? c_lo : c_lo >> 1);
            R.qb = B.data() + (long)r0 * qs + (L == 0 ? c_lo : c_lo >> 1);
            R.ma = A.data() + (long)rows * qs + (long)r0 * ms + (c_lo >> 4);
            R.mb = B.data() + (long)rows * qs + (long)r0 * ms + (c_lo >> 4);
            R.qs = qs; R.ms = ms; R.last = rows - 1 - r0;
            double t[NR];
            warp_run<NR>([&](int lane, float* acc) {
                if (L == 0) q8s_dot16<NR, NH, U, PF>(R, x.data() + c_lo, c_n, lane, acc);
                else q4ks_dot16<NR, NH, U, PF>(R, x.data() + c_lo, c_n, lane, acc);
            }, t);
            for (int k = 0; k < NR; k++) tot[k] += t[k];
            if (L == 0 && !PF) {
                // mv3_preload / ffn_preload's order: chunks 0..U loaded (before
                // the PDL wait on the device), then computed, then the rest as
                // q8s_dot16: every lane's sum must be the same bits.
                float a0[32][NR] = {}, a1[32][NR] = {};
                std::barrier<> bar(32); g_bar = &bar;
                std::vector<std::thread> th;
                for (int l = 0; l < 32; l++) th.emplace_back([&, l] {
                    t_lane = l;
                    q8s_dot16<NR, NH, U, false>(R, x.data() + c_lo, c_n, l, a0[l]);
                    uint4 w[U][NR];
                    u32 sc[U][NR];
                    q8s_load16<NR, NH, U>(R, c_n, l, w, sc, 0);
                    q8s_compute16<NR, U>(x.data() + c_lo, c_n, l, w, sc, 0, a1[l]);
                    for (int c = U; c < (c_n + 511) / 512; c += U) {
                        q8s_load16<NR, NH, U>(R, c_n, l, w, sc, c);
                        q8s_compute16<NR, U>(x.data() + c_lo, c_n, l, w, sc, c, a1[l]);
                    }
                });
                for (auto& tt : th) tt.join();
                if (memcmp(a0, a1, sizeof a0) != 0) {
                    printf("L0 NR%d NH%d U%d S%d %dx%d rows %d..: preload order differs from q8s_dot16\n", NR, NH, U, S, rows, cols, r0);
                    exit(1);
                }
                preload_checked++;
            }
        }
        for (int k = 0; k < NR; k++) {
            int kk = k < NH ? k : k - NH;
            if (r0 + kk >= rows) continue;
            const auto& W = k < NH ? A : B;
            double want = 0, mag = 0;
            for (int i = 0; i < cols; i++) { double v = (double)el(W, r0 + kk, i) * x[i]; want += v; mag += std::fabs(v); }
            double e = std::fabs(tot[k] - want) / mag;
            if (e > worst) worst = e;
            if (e > 1e-5) { printf("L%d NR%d NH%d U%d PF%d S%d %dx%d row %d: rel err %g\n", L, NR, NH, U, (int)PF, S, rows, cols, r0 + kk, e); exit(1); }
        }
    }
}

static u16 f2h_host(float f) {
    u32 u; memcpy(&u, &f, 4); u32 s = (u >> 16) & 0x8000; int e = ((u >> 23) & 255) - 127 + 15; u32 m = u & 0x7fffff;
    if (e <= 0) return s; return s | (e << 10) | (m >> 13);
}
int main() {
    std::mt19937 g(11); std::uniform_real_distribution<float> Ud(-1, 1);
    int shapes[][2] = {{1, 256}, {5, 768}, {7, 1280}, {3, 3584}, {6, 2304}, {2, 4864}, {3, 2560}};
    for (auto& sh : shapes) {
        int rows = sh[0], cols = sh[1];
        std::vector<float> x(cols); for (auto& v : x) v = Ud(g);
        // Split Q8_0: random quants, f16 scales.
        auto mk8 = [&] {
            std::vector<u8> W(rows * cols + rows * cols / 16);
            for (int i = 0; i < rows * cols; i++) W[i] = g() & 255;
            u16* sc = (u16*)(W.data() + rows * cols);
            for (int i = 0; i < rows * cols / 32; i++) sc[i] = f2h_host(0.01f + 0.02f * (Ud(g) + 1));
            return W;
        };
        // Split Q4_K: random quants and packed scales, sane d / dmin.
        auto mk4 = [&] {
            int nsb = rows * cols / 256;
            std::vector<u8> W(rows * cols / 2 + nsb * 16);
            for (auto& b : W) b = g() & 255;
            for (int i = 0; i < nsb; i++) {
                u16 d = 0x2000 + (g() % 0x1000), dm = 0x1c00 + (g() % 0x1000);
                memcpy(&W[rows * cols / 2 + i * 16], &d, 2); memcpy(&W[rows * cols / 2 + i * 16 + 2], &dm, 2);
            }
            return W;
        };
        auto a8 = mk8(), b8 = mk8(), a4 = mk4(), b4 = mk4();
        for (int S : {1, 2, 4, 8}) {
            check<0, 4, 4, 2>(a8, b8, rows, cols, x, S);  // v2
            check<0, 2, 2, 4>(a8, b8, rows, cols, x, S);  // v3
            check<0, 2, 2, 2>(a8, b8, rows, cols, x, S);  // v4
            check<1, 4, 4, 1>(a4, b4, rows, cols, x, S);
            check<1, 2, 2, 2>(a4, b4, rows, cols, x, S);
            check<1, 2, 2, 1>(a4, b4, rows, cols, x, S);
            check<0, 2, 2, 1, true>(a8, b8, rows, cols, x, S);  // v5 (pipelined)
            check<1, 2, 2, 1, true>(a4, b4, rows, cols, x, S);
            check<0, 2, 2, 2, true>(a8, b8, rows, cols, x, S);  // pipelined, U 2
            check<1, 4, 4, 2, true>(a4, b4, rows, cols, x, S);
        }
        // FFN: gate rows then up rows (NH = NR / 2), no split.
        check<0, 4, 2, 2>(a8, b8, rows, cols, x, 1);
        check<0, 2, 1, 4>(a8, b8, rows, cols, x, 1);
        check<0, 2, 1, 2>(a8, b8, rows, cols, x, 1);
        check<1, 4, 2, 1>(a4, b4, rows, cols, x, 1);
        check<1, 2, 1, 2>(a4, b4, rows, cols, x, 1);
        check<1, 2, 1, 1>(a4, b4, rows, cols, x, 1);
        check<0, 2, 1, 1, true>(a8, b8, rows, cols, x, 1);
        check<1, 2, 1, 1, true>(a4, b4, rows, cols, x, 1);
    }
    printf("mat-vec variants (q8s_dot16, q4ks_dot16): worst dot rel err %.3g over all shapes/variants/splits\n", worst);
    printf("preload order (q8s_load16 + q8s_compute16) == q8s_dot16 bit for bit over %ld warp slices\n", preload_checked);
    return worst < 1e-5 ? 0 : 1;
}
