// Host check of matvec_imma.cu's split-Q4_K and split-Q6_K decode mat-vecs (no GPU;
// extract.py -> imma_extract.h), the mma instruction emulated by the PTX
// ISA's fragment layout (mma_emu.h), warps run as fibers (block_emu.h):
//   1. imma_quantize_x: every element is s * (256 hi + lo) with s =
//      max|x| / 32639 of its block of 32 and 256 hi + lo = round(x / s),
//      and the block's sum is the f32 sum of x;
//   2. imma_q4k_dot and imma_q6k_dot (through imma_dot), one matrix (Q4_K
//      with two super-blocks in flight) and two
//      matrices (gate and up) with one, at every column split S
//      (imma_slice), over a partly filled last row group: each row equals
//      an f64 dot of the layout's accessor (q4ks_elem, q6ks_elem, checked against
//      ggml's dequantizer in check_matvec) with x, within the planes'
//      rounding (half a step per element) and f32 summing.
//   3. imma_xsplit (mvx_q4_ks_xS, the split across blocks): the grid's
//      blocks run one by one in two shuffled orders, two activation rows;
//      each output equals the f64 dot plus its bias within the same bound,
//      the residual gets exactly the stored value added, both orders give
//      the same bits (the slices are summed in slice order whichever block
//      completes the tile), and every tile counter is back at 0.
// Build and run: hostcheck/run.sh.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include "block_emu.h"
#include "ptx_emu.h"
#include "mma_emu.h"
inline int __float2int_rn(float v) { return (int)std::nearbyint(v); }
// One block runs at a time: the device-wide fences are no-ops, the atomic
// a plain add, the L2 load a load.
inline u32 atomicAdd(u32* p, u32 v) {
    const u32 old = *p;
    *p = old + v;
    return old;
}
#include "imma_extract.h"

static std::mt19937 gen(5);
static int fails = 0;

static void check(bool ok, const char* what) {
    if (!ok) {
        if (fails < 10) fprintf(stderr, "FAIL: %s\n", what);
        fails++;
    }
}

// A random normal f16 of magnitude 2^-6 .. 2^-1, either sign.
static u16 rand_half() {
    std::uniform_int_distribution<int> e(9, 13), m(0, 1023), s(0, 1);
    return (u16)((s(gen) << 15) | (e(gen) << 10) | m(gen));
}

// Random split-Q6_K bytes (ql, qh, int8 scales, then f16 d) with valid d.
static std::vector<uint4> random_q6ks(int rows, int cols) {
    const long n = (long)rows * cols, body = n / 2 + n / 4 + n / 16, dbytes = n / 128;
    std::vector<uint4> buf((body + dbytes + 15) / 16);
    u8* p = (u8*)buf.data();
    std::uniform_int_distribution<int> byte(0, 255);
    for (long i = 0; i < body; i++) p[i] = (u8)byte(gen);
    for (long i = 0; i < dbytes / 2; i++) {
        const u16 v = rand_half();
        memcpy(p + body + 2 * i, &v, 2);
    }
    return buf;
}

// Random split-Q4_K bytes (quants, then 16-byte headers) with valid d, dmin.
static std::vector<uint4> random_q4ks(int rows, int cols) {
    const long qbytes = (long)rows * cols / 2, hbytes = (long)rows * cols / 16;
    std::vector<uint4> buf((qbytes + hbytes) / 16);
    u8* p = (u8*)buf.data();
    std::uniform_int_distribution<int> byte(0, 255);
    for (long i = 0; i < qbytes + hbytes; i++) p[i] = (u8)byte(gen);
    for (long h = 0; h < hbytes / 16; h++)
        for (int f = 0; f < 2; f++) {
            u16 v = rand_half();
            memcpy(p + qbytes + 16 * h + 2 * f, &v, 2);
        }
    return buf;
}

struct Planes {
    std::vector<uint4> hi, lo;
    std::vector<float> sc, sum;
    ImmaX view() const { return ImmaX{(const i8*)hi.data(), (const i8*)lo.data(), sc.data(), sum.data()}; }
};

static Planes quantize(const std::vector<float>& x) {
    const int cols = (int)x.size();
    Planes p{std::vector<uint4>(cols / 16), std::vector<uint4>(cols / 16), std::vector<float>(cols / 32),
             std::vector<float>(cols / 32)};
    run_block(256, dim3_{0, 0, 0}, [&] {
        imma_quantize_x(x.data(), cols, (i8*)p.hi.data(), (i8*)p.lo.data(), p.sc.data(), p.sum.data());
    });
    const i8 *hi = (const i8*)p.hi.data(), *lo = (const i8*)p.lo.data();
    for (int b = 0; b < cols / 32; b++) {
        float amax = 0, sum = 0;
        for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(x[b * 32 + i]));
        for (int i = 0; i < 32; i++) sum += x[b * 32 + i];
        check(p.sc[b] == amax / 32639.f, "plane scale");
        check(std::fabs(p.sum[b] - sum) <= 1e-5f * (std::fabs(sum) + amax), "plane sum");
        for (int i = 0; i < 32; i++) {
            const int want = amax == 0 ? 0 : (int)std::nearbyint(x[b * 32 + i] * (32639.f / amax));
            check(256 * hi[b * 32 + i] + lo[b * 32 + i] == want, "plane value");
        }
    }
    return p;
}

// One warp's rows r0.. of the NM matrices over super-blocks [lo, hi):
// out[m][row - r0] from lane t = 0 of each quad.
template <int TY, int NM, int US>
static void warp_rows(const u8* const (&Ws)[NM], int rows, int cols, int r0, int lo, int hi, const ImmaX& X,
                      double (&out)[NM][16]) {
    float got[32][NM][2] = {};
    run_block(32, dim3_{0, 0, 0}, [&] {
        float acc[NM][2] = {};
        imma_dot<TY, NM, US>(Ws, rows, cols, r0, lo, hi, X, (int)threadIdx.x, acc);
        for (int m = 0; m < NM; m++)
            for (int k = 0; k < 2; k++) got[threadIdx.x][m][k] = acc[m][k];
    });
    for (int m = 0; m < NM; m++)
        for (int g = 0; g < 8; g++) {
            out[m][g] = got[4 * g][m][0];
            out[m][g + 8] = got[4 * g][m][1];
        }
}

template <int S>
static void slice_of(int ns, int s, int& lo, int& hi) {
    imma_slice<S>(ns, s, lo, hi);
}

// Random bytes of a matrix of TY, and element i of its row r.
static std::vector<uint4> random_mat(int ty, int rows, int cols) {
    return ty == IMMA_Q6K ? random_q6ks(rows, cols) : random_q4ks(rows, cols);
}
static double elem(int ty, const u8* W, int rows, int cols, int r, int i) {
    return ty == IMMA_Q6K ? q6ks_elem(W, rows, cols, r, i) : q4ks_elem(W, rows, cols, r, i);
}
static const char* ty_name(int ty) { return ty == IMMA_Q6K ? "q6_ks" : "q4_ks"; }

template <int TY, int NM, int US>
static void check_dot(int rows, int cols) {
    std::normal_distribution<float> N(0.f, 1.f);
    std::vector<float> x(cols);
    for (auto& v : x) v = N(gen);
    x[3] *= 80.f;  // an outlier channel: its block's other values get coarser steps
    for (int i = 64; i < 96; i++) x[i] = 0.f;  // an all-zero block
    const Planes P = quantize(x);
    std::vector<std::vector<uint4>> mats;
    for (int m = 0; m < NM; m++) mats.push_back(random_mat(TY, rows, cols));
    const u8* Ws[NM];
    for (int m = 0; m < NM; m++) Ws[m] = (const u8*)mats[m].data();
    const int ns = cols / 256;
    double worst = 0;
    for (int S : {1, 2, 4, 8})
        for (int r0 = 0; r0 < rows; r0 += 16) {
            double tot[NM][16] = {};
            for (int s = 0; s < S; s++) {
                int lo, hi;
                switch (S) {
                    case 1: slice_of<1>(ns, s, lo, hi); break;
                    case 2: slice_of<2>(ns, s, lo, hi); break;
                    case 4: slice_of<4>(ns, s, lo, hi); break;
                    default: slice_of<8>(ns, s, lo, hi); break;
                }
                if (lo >= hi) continue;
                double part[NM][16];
                warp_rows<TY, NM, US>(Ws, rows, cols, r0, lo, hi, P.view(), part);
                for (int m = 0; m < NM; m++)
                    for (int k = 0; k < 16; k++) tot[m][k] += part[m][k];
            }
            for (int m = 0; m < NM; m++)
                for (int k = 0; k < 16 && r0 + k < rows; k++) {
                    const int r = r0 + k;
                    double want = 0, mag = 0, step = 0;
                    for (int i = 0; i < cols; i++) {
                        const double w = elem(TY, Ws[m], rows, cols, r, i);
                        want += w * x[i];
                        mag += std::fabs(w * x[i]);
                        step += std::fabs(w) * 0.5 * P.sc[i / 32];
                    }
                    const double err = std::fabs(tot[m][k] - want);
                    worst = std::max(worst, err / (mag + 1e-30));
                    if (!(err <= 1.01 * step + 2e-6 * mag)) {
                        if (fails < 10)
                            fprintf(stderr, "imma %s NM=%d S=%d %dx%d row %d: got %.9g want %.9g (bound %.3g)\n",
                                    ty_name(TY), NM, S, rows, cols, r, tot[m][k], want, step + 2e-6 * mag);
                        fails++;
                    }
                }
        }
    printf("imma %s, %d matrices, %d x %d: worst error %.2e of the sum of |terms|\n", ty_name(TY), NM, rows, cols,
           worst);
}

// y[a] (and rs[a] += y[a]) of every block of an S-slice grid over `rows`
// rows, the blocks run in `order` (indices into the grid, a-major).
template <int TY, int S>
static void run_xsplit(const u8* W, int rows, int cols, const std::vector<float>& x, const std::vector<float>& bias,
                       std::vector<float>& y, std::vector<float>& rs, std::vector<u32>& ctr,
                       const std::vector<int>& order) {
    const int tiles = (rows + 127) / 128, n_act = (int)x.size() / cols;
    std::vector<float> part((size_t)n_act * S * rows, NAN);
    std::vector<uint4> smem(cols / 8 + 16);  // a slice's planes fit a whole row's
    gridDim = dim3_{(unsigned)(tiles * S), (unsigned)n_act, 1};
    for (int i : order) {
        const int a = i / (tiles * S), bx = i % (tiles * S);
        run_block(256, dim3_{(unsigned)bx, (unsigned)a, 0}, [&] {
            imma_xsplit<TY, S>(W, rows, cols, x.data() + (long)a * cols, y.data(), bias.data(), rs.data(), part.data(),
                           ctr.data(), a, bx / S, bx % S, tiles, (u8*)smem.data());
        });
    }
}

template <int TY, int S>
static void check_xsplit(int rows, int cols) {
    std::normal_distribution<float> N(0.f, 1.f);
    const int n_act = 2, tiles = (rows + 127) / 128, ns = cols / 256;
    std::vector<float> x((size_t)n_act * cols), bias(rows), rs0((size_t)n_act * rows);
    for (auto& v : x) v = N(gen);
    x[5] *= 60.f;
    for (auto& v : bias) v = N(gen);
    for (auto& v : rs0) v = N(gen);
    const auto mat = random_mat(TY, rows, cols);
    const u8* W = (const u8*)mat.data();
    std::vector<int> order(n_act * tiles * S);
    for (int i = 0; i < (int)order.size(); i++) order[i] = i;
    std::vector<float> y1((size_t)n_act * rows, NAN), y2 = y1, rs1 = rs0, rs2 = rs0;
    std::vector<u32> ctr((size_t)n_act * tiles, 0u);
    std::shuffle(order.begin(), order.end(), gen);
    run_xsplit<TY, S>(W, rows, cols, x, bias, y1, rs1, ctr, order);
    check(std::all_of(ctr.begin(), ctr.end(), [](u32 c) { return c == 0; }), "xsplit counters reset");
    std::shuffle(order.begin(), order.end(), gen);
    run_xsplit<TY, S>(W, rows, cols, x, bias, y2, rs2, ctr, order);
    check(memcmp(y1.data(), y2.data(), y1.size() * 4) == 0, "xsplit: the same bits in another block order");
    double worst = 0;
    for (int a = 0; a < n_act; a++) {
        std::vector<float> xa(x.begin() + (long)a * cols, x.begin() + (long)(a + 1) * cols);
        const Planes P = quantize(xa);
        for (int r = 0; r < rows; r++) {
            double want = bias[r], mag = std::fabs(bias[r]), step = 0;
            for (int i = 0; i < cols; i++) {
                const double w = elem(TY, W, rows, cols, r, i);
                want += w * xa[i];
                mag += std::fabs(w * xa[i]);
                step += std::fabs(w) * 0.5 * P.sc[i / 32];
            }
            const long k = (long)a * rows + r;
            const double err = std::fabs(y1[k] - want);
            worst = std::max(worst, err / (mag + 1e-30));
            if (!(err <= 1.01 * step + 2e-6 * mag)) {
                if (fails < 10)
                    fprintf(stderr, "xsplit S=%d %dx%d a %d row %d: got %.9g want %.9g\n", S, rows, cols, a, r, y1[k],
                            want);
                fails++;
            }
            check(rs1[k] == rs0[k] + y1[k], "xsplit residual gets the stored value");
        }
    }
    printf("imma %s split across %d blocks (%d super-blocks), %d x %d: worst error %.2e of the sum of |terms|\n",
           ty_name(TY), S, ns, rows, cols, worst);
}

int main() {
    for (int ty : {IMMA_Q4K, IMMA_Q6K}) {
        if (ty == IMMA_Q4K) {
            check_xsplit<IMMA_Q4K, 4>(136, 2304);
            check_xsplit<IMMA_Q4K, 16>(136, 2304);  // 9 super-blocks: some slices are empty
            check_dot<IMMA_Q4K, 1, 2>(40, 1024);
            check_dot<IMMA_Q4K, 1, 2>(40, 2304);
            check_dot<IMMA_Q4K, 2, 1>(40, 2304);
        } else {
            check_xsplit<IMMA_Q6K, 4>(136, 2304);
            check_xsplit<IMMA_Q6K, 16>(136, 2304);
            check_dot<IMMA_Q6K, 1, 2>(40, 1024);
            check_dot<IMMA_Q6K, 1, 2>(40, 2304);
            check_dot<IMMA_Q6K, 2, 1>(40, 2304);
        }
    }
    if (fails) {
        fprintf(stderr, "check_imma: %d failures\n", fails);
        return 1;
    }
    printf("check_imma: ok\n");
    return 0;
}
