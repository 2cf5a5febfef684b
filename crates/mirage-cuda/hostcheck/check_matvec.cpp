// Host check of the decode mat-vecs' device helpers (no GPU; extract.py ->
// matvec_extract.h):
//   1. the element accessors of the repacked layouts (q8s_elem, q4ks_elem,
//      q5s_elem, q6ks_elem) equal ggml's dequant_unit<T> on the same blocks,
//      bit for bit, after the field split the upload does (weights.rs's
//      split_fields); nvfp4_elem equals code x scale x tensor scale;
//   2. the lane dots of matvec_lanes.cu (Nvfp4Rows, Q5sRows) and
//      of matvec_split.cu (q8s_dot16 over MvvRows, a warp run
//      as 32 fibers for its shuffles), summed over the warp, equal an f64
//      dot over the accessors, at every column split S (mv3_slice), with the
//      last row repeated past the matrix end, and in the FFN kernels' row
//      arrangement (gate rows, then up rows);
//   3. pick3's matrix choice.
// Build and run: hostcheck/run.sh.
#include <cstdint>
#include <random>
#include "block_emu.h"
#include "ptx_emu.h"
inline u16 ld16(const u8* p) { u16 v; memcpy(&v, p, 2); return v; }
template <int T> void dequant_unit(const u8* row, int u, float* w);
#include "matvec_extract.h"

static std::mt19937 g(7);
static std::uniform_real_distribution<float> U(-1, 1);
static double worst = 0;
static int fails = 0;

// ggml blocks of `bytes` bytes split field by field: field f of every block
// into plane order[f] (the planes one after another in that numbering).
static std::vector<u8> split_fields(const std::vector<u8>& ggml, int bytes, std::vector<int> fields,
                                    std::vector<int> order) {
    const long n = ggml.size() / bytes;
    std::vector<long> plane(fields.size(), 0);
    for (size_t p = 0; p < fields.size(); p++)
        for (size_t f = 0; f < fields.size(); f++)
            if (order[f] < (int)p) plane[p] += n * fields[f];
    std::vector<u8> out(ggml.size());
    for (long b = 0; b < n; b++)
        for (size_t f = 0, at = 0; f < fields.size(); at += fields[f], f++)
            memcpy(&out[plane[order[f]] + b * fields[f]], &ggml[b * bytes + at], fields[f]);
    return out;
}

// A repacked type: its ggml block, the split, the f16 fields given sane
// values, and the accessor.
struct Repacked {
    const char* name;
    int ty, bytes, elems;
    std::vector<int> fields, order, f16_at;
    float (*elem)(const u8*, int, int, long, int);
};
static const Repacked REPACKED[] = {
    {"q8_0s", TY_Q8_0, 34, 32, {2, 32}, {1, 0}, {0}, q8s_elem},
    {"q4_ks", TY_Q4_K, 144, 256, {16, 128}, {1, 0}, {0, 2}, q4ks_elem},
    {"q5_0s", TY_Q5_0, 22, 32, {2, 4, 16}, {2, 1, 0}, {0}, q5s_elem},
    {"q6_ks", TY_Q6_K, 210, 256, {128, 64, 16, 2}, {0, 1, 2, 3}, {208}, q6ks_elem},
};

static void dequant(int ty, const u8* row, int u, float* w) {
    switch (ty) {
        case TY_Q8_0: return dequant_unit<TY_Q8_0>(row, u, w);
        case TY_Q4_K: return dequant_unit<TY_Q4_K>(row, u, w);
        case TY_Q5_0: return dequant_unit<TY_Q5_0>(row, u, w);
        default: return dequant_unit<TY_Q6_K>(row, u, w);
    }
}

// Random rows of `t` in its split layout; the accessors checked against
// dequant_unit on the ggml blocks.
static std::vector<u8> random_split(const Repacked& t, int rows, int cols) {
    const long n = (long)rows * cols / t.elems;
    std::vector<u8> ggml(n * t.bytes);
    for (auto& b : ggml) b = g() & 255;
    for (long b = 0; b < n; b++)
        for (int at : t.f16_at) {
            u16 h = 0x1c00 + g() % 0x1000;
            memcpy(&ggml[b * t.bytes + at], &h, 2);
        }
    auto W = split_fields(ggml, t.bytes, t.fields, t.order);
    const long row_bytes = (long)cols / t.elems * t.bytes;
    long bad = 0;
    for (int r = 0; r < rows; r++)
        for (int u = 0; u < cols / 32; u++) {
            float w[32];
            dequant(t.ty, &ggml[r * row_bytes], u, w);
            for (int i = 0; i < 32; i++) bad += t.elem(W.data(), rows, cols, r, u * 32 + i) != w[i];
        }
    if (bad) {
        printf("FAIL %s_elem: %ld of %d x %d elements differ from dequant_unit\n", t.name, bad, rows, cols);
        fails++;
    }
    return W;
}

// The f64 dot of row r (element accessor el) with x, and its magnitude.
template <class El> static double ref_dot(El el, int r, int cols, const std::vector<float>& x, double* mag) {
    double want = 0;
    *mag = 0;
    for (int i = 0; i < cols; i++) {
        double v = (double)el(r, i) * x[i];
        want += v;
        *mag += std::fabs(v);
    }
    return want;
}

static void expect(const char* what, int S, int rows, int cols, int r, double got, double want, double mag) {
    double e = std::fabs(got - want) / mag;
    if (e > worst) worst = e;
    if (e > 1e-5) {
        printf("FAIL %s S %d %d x %d row %d: rel err %g\n", what, S, rows, cols, r, e);
        fails++;
    }
}

// matvec_lanes.cu's layout R over A (and B for the FFN arrangement): every
// row group of FAST_ROWS rows at every split S, then gate/up slots.
template <class R, class El>
static void check_lanes(const char* what, const u8* A, const u8* B, int rows, int cols, float ts, El el_a, El el_b,
                        const std::vector<float>& x) {
    for (int S : {1, 2, 4, 8})
        for (int r0 = 0; r0 < rows; r0 += FAST_ROWS) {
            double tot[FAST_ROWS] = {};
            for (int slice = 0; slice < S; slice++) {
                int c_lo, c_n;
                switch (S) {
                    case 1: mv3_slice<256, 1>(cols, slice, c_lo, c_n); break;
                    case 2: mv3_slice<256, 2>(cols, slice, c_lo, c_n); break;
                    case 4: mv3_slice<256, 4>(cols, slice, c_lo, c_n); break;
                    default: mv3_slice<256, 8>(cols, slice, c_lo, c_n); break;
                }
                if (c_n <= 0) continue;
                R p;
                for (int k = 0; k < FAST_ROWS; k++) p.set(k, A, rows, cols, min(r0 + k, rows - 1), c_lo);
                for (int lane = 0; lane < 32; lane++) {
                    float acc[FAST_ROWS] = {};
                    p.dot(x.data() + c_lo, c_n, lane, acc);
                    for (int k = 0; k < FAST_ROWS; k++) tot[k] += acc[k];
                }
            }
            for (int k = 0; k < FAST_ROWS && r0 + k < rows; k++) {
                double mag, want = ref_dot(el_a, r0 + k, cols, x, &mag);
                expect(what, S, rows, cols, r0 + k, tot[k] * R::scale(ts), want, mag);
            }
        }
    const int NC = FAST_ROWS / 2;
    for (int r0 = 0; r0 < rows; r0 += NC) {
        R p;
        for (int k = 0; k < NC; k++) {
            p.set(k, A, rows, cols, min(r0 + k, rows - 1), 0);
            p.set(NC + k, B, rows, cols, min(r0 + k, rows - 1), 0);
        }
        double tot[FAST_ROWS] = {};
        for (int lane = 0; lane < 32; lane++) {
            float acc[FAST_ROWS] = {};
            p.dot(x.data(), cols, lane, acc);
            for (int k = 0; k < FAST_ROWS; k++) tot[k] += acc[k];
        }
        for (int k = 0; k < NC && r0 + k < rows; k++) {
            double mag, want = ref_dot(el_a, r0 + k, cols, x, &mag);
            expect(what, 0, rows, cols, r0 + k, tot[k] * R::scale(ts), want, mag);
            want = ref_dot(el_b, r0 + k, cols, x, &mag);
            expect(what, 0, rows, cols, r0 + k, tot[NC + k] * R::scale(ts), want, mag);
        }
    }
}

// A warp of dot(lane, acc) run as 32 fibers (the split dots shuffle);
// returns the per-row sums over the lanes.
template <class F> static void warp_sums(F dot, double* tot) {
    float acc[32][MV_NR] = {};
    run_block(32, dim3_{0, 0, 0}, [&] { dot((int)threadIdx.x, acc[threadIdx.x]); });
    for (int k = 0; k < MV_NR; k++) {
        tot[k] = 0;
        for (int l = 0; l < 32; l++) tot[k] += acc[l][k];
    }
}

// matvec_split.cu's split Q8_0 (U chunks in flight) over A at every split S
// (mv3_rows), then gate rows of A and up rows of B (ffn_rows).
template <int U, class El>
static void check_split(const char* what, const u8* A, const u8* B, int rows, int cols, El el_a, El el_b,
                        const std::vector<float>& x) {
    constexpr int G = 128;
    const int qs = cols, ms = cols >> 4;
    for (int S : {1, 2, 4, 8})
        for (int r0 = 0; r0 < rows; r0 += MV_NR) {
            double tot[MV_NR] = {};
            for (int slice = 0; slice < S; slice++) {
                int c_lo, c_n;
                switch (S) {
                    case 1: mv3_slice<G, 1>(cols, slice, c_lo, c_n); break;
                    case 2: mv3_slice<G, 2>(cols, slice, c_lo, c_n); break;
                    case 4: mv3_slice<G, 4>(cols, slice, c_lo, c_n); break;
                    default: mv3_slice<G, 8>(cols, slice, c_lo, c_n); break;
                }
                if (c_n <= 0) continue;
                const MvvRows R = mv3_rows(A, rows, r0, c_lo, qs, ms);
                double t[MV_NR];
                warp_sums([&](int lane, float* acc) { q8s_dot16<MV_NR, MV_NR, U>(R, x.data() + c_lo, c_n, lane, acc); },
                          t);
                for (int k = 0; k < MV_NR; k++) tot[k] += t[k];
            }
            for (int k = 0; k < MV_NR && r0 + k < rows; k++) {
                double mag, want = ref_dot(el_a, r0 + k, cols, x, &mag);
                expect(what, S, rows, cols, r0 + k, tot[k], want, mag);
            }
        }
    const int NC = MV_NR / 2;
    for (int r0 = 0; r0 < rows; r0 += NC) {
        const MvvRows R = ffn_rows(A, B, rows, r0, qs, ms);
        double tot[MV_NR];
        warp_sums([&](int lane, float* acc) { q8s_dot16<MV_NR, MV_NR / 2, U>(R, x.data(), cols, lane, acc); }, tot);
        for (int k = 0; k < NC && r0 + k < rows; k++) {
            double mag, want = ref_dot(el_a, r0 + k, cols, x, &mag);
            expect(what, 0, rows, cols, r0 + k, tot[k], want, mag);
            want = ref_dot(el_b, r0 + k, cols, x, &mag);
            expect(what, 0, rows, cols, r0 + k, tot[NC + k], want, mag);
        }
    }
}

static double e4m3_ref(u32 b) {
    b &= 0x7f;
    int e = b >> 3, m = b & 7;
    return e == 0 ? std::ldexp((double)m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
}
static double e2m1_ref(u32 c) {
    static const double t[8] = {0, .5, 1, 1.5, 2, 3, 4, 6};
    double v = t[c & 7];
    return (c & 8) ? -v : v;
}

// Random NVFP4 rows (codes, then E4M3 scales below 0x7f); nvfp4_elem checked
// against the codec's arithmetic in f64.
static std::vector<u8> random_nvfp4(int rows, int cols, float ts) {
    std::vector<u8> W(rows * cols / 2 + rows * cols / 16);
    for (int i = 0; i < rows * cols / 2; i++) W[i] = g() & 255;
    for (int j = 0; j < rows * cols / 16; j++) W[rows * cols / 2 + j] = g() % 0x7f;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < cols; i++) {
            u32 code = (W[(r * cols + i) / 2] >> (4 * (i & 1))) & 15, sc = W[rows * cols / 2 + (r * cols + i) / 16];
            double want = e2m1_ref(code) * e4m3_ref(sc) * ts, got = nvfp4_elem(W.data(), rows, cols, ts, r, i);
            if (std::fabs(got - want) > 1e-6 * std::fabs(want)) {
                printf("FAIL nvfp4_elem r %d i %d: %g, want %g\n", r, i, got, want);
                fails++;
                return W;
            }
        }
    return W;
}

int main() {
    const int legacy[][2] = {{1, 32}, {5, 96}, {37, 896}, {3, 288}, {9, 4864}};
    const int kquant[][2] = {{1, 256}, {5, 768}, {6, 2304}, {3, 4096}, {2, 4864}};
    for (const Repacked& t : REPACKED) {
        const bool k = t.elems == 256;
        for (int s = 0; s < 5; s++) {
            const int rows = k ? kquant[s][0] : legacy[s][0], cols = k ? kquant[s][1] : legacy[s][1];
            std::vector<float> x(cols);
            for (auto& v : x) v = U(g);
            auto A = random_split(t, rows, cols), B = random_split(t, rows, cols);
            auto el = [&](const std::vector<u8>& W) {
                return [&W, &t, rows, cols](int r, int i) { return t.elem(W.data(), rows, cols, r, i); };
            };
            auto ea = el(A), eb = el(B);
            if (t.ty == TY_Q5_0) check_lanes<Q5sRows>(t.name, A.data(), B.data(), rows, cols, 0.f, ea, eb, x);
            if (t.ty == TY_Q8_0 && cols % 128 == 0)
                check_split<MV_U_Q8>(t.name, A.data(), B.data(), rows, cols, ea, eb, x);
        }
    }
    for (auto& sh : legacy) {
        const int rows = sh[0], cols = sh[1];
        const float ts = 0.37f;
        std::vector<float> x(cols);
        for (auto& v : x) v = U(g);
        auto A = random_nvfp4(rows, cols, ts), B = random_nvfp4(rows, cols, ts);
        auto el = [&](const std::vector<u8>& W) {
            return [&W, rows, cols, ts](int r, int i) { return nvfp4_elem(W.data(), rows, cols, ts, r, i); };
        };
        auto ea = el(A), eb = el(B);
        check_lanes<Nvfp4Rows>("nvfp4", A.data(), B.data(), rows, cols, ts, ea, eb, x);
    }
    const int want_m[6] = {0, 0, 0, 1, 1, 2}, want_l[6] = {0, 1, 2, 0, 1, 0};
    for (int bx = 0; bx < 6; bx++) {
        int m, l = pick3(bx, 32, 70, 33, &m);
        if (m != want_m[bx] || l != want_l[bx]) {
            printf("FAIL pick3(%d) = (%d, %d)\n", bx, m, l);
            fails++;
        }
    }
    printf("mat-vec helpers: accessors equal dequant_unit, worst dot rel err %.3g: %s\n", worst,
           fails ? "FAIL" : "ok");
    return fails ? 1 : 0;
}
