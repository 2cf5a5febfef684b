// Host check of matvec_imma.cu's split-Q4_K decode mat-vecs (no GPU;
// extract.py -> imma_extract.h), the mma instruction emulated by the PTX
// ISA's fragment layout (mma_emu.h), warps run as fibers (block_emu.h):
//   1. imma_quantize_x: every element is s * (256 hi + lo) with s =
//      max|x| / 32639 of its block of 32 and 256 hi + lo = round(x / s),
//      and the block's sum is the f32 sum of x;
//   2. imma_q4k_dot, one matrix with two super-blocks in flight and two
//      matrices (gate and up) with one, at every column split S
//      (imma_slice), over a partly filled last row group: each row equals
//      an f64 dot of the layout's accessor (q4ks_elem, checked against
//      ggml's dequantizer in check_matvec) with x, within the planes'
//      rounding (half a step per element) and f32 summing.
// Build and run: hostcheck/run.sh.
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
template <int NM, int US>
static void warp_rows(const u8* const (&Ws)[NM], int rows, int cols, int r0, int lo, int hi, const ImmaX& X,
                      double (&out)[NM][16]) {
    float got[32][NM][2] = {};
    run_block(32, dim3_{0, 0, 0}, [&] {
        float acc[NM][2] = {};
        imma_q4k_dot<NM, US>(Ws, rows, cols, r0, lo, hi, X, (int)threadIdx.x, acc);
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

template <int NM, int US>
static void check_dot(int rows, int cols) {
    std::normal_distribution<float> N(0.f, 1.f);
    std::vector<float> x(cols);
    for (auto& v : x) v = N(gen);
    x[3] *= 80.f;  // an outlier channel: its block's other values get coarser steps
    for (int i = 64; i < 96; i++) x[i] = 0.f;  // an all-zero block
    const Planes P = quantize(x);
    std::vector<std::vector<uint4>> mats;
    for (int m = 0; m < NM; m++) mats.push_back(random_q4ks(rows, cols));
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
                warp_rows<NM, US>(Ws, rows, cols, r0, lo, hi, P.view(), part);
                for (int m = 0; m < NM; m++)
                    for (int k = 0; k < 16; k++) tot[m][k] += part[m][k];
            }
            for (int m = 0; m < NM; m++)
                for (int k = 0; k < 16 && r0 + k < rows; k++) {
                    const int r = r0 + k;
                    double want = 0, mag = 0, step = 0;
                    for (int i = 0; i < cols; i++) {
                        const double w = q4ks_elem(Ws[m], rows, cols, r, i);
                        want += w * x[i];
                        mag += std::fabs(w * x[i]);
                        step += std::fabs(w) * 0.5 * P.sc[i / 32];
                    }
                    const double err = std::fabs(tot[m][k] - want);
                    worst = std::max(worst, err / (mag + 1e-30));
                    if (!(err <= 1.01 * step + 2e-6 * mag)) {
                        if (fails < 10)
                            fprintf(stderr, "imma NM=%d S=%d %dx%d row %d: got %.9g want %.9g (bound %.3g)\n", NM, S,
                                    rows, cols, r, tot[m][k], want, step + 2e-6 * mag);
                        fails++;
                    }
                }
        }
    printf("imma q4_ks, %d matrices, %d x %d: worst error %.2e of the sum of |terms|\n", NM, rows, cols, worst);
}

int main() {
    check_dot<1, 2>(40, 1024);
    check_dot<1, 2>(40, 2304);
    check_dot<2, 1>(40, 2304);
    if (fails) {
        fprintf(stderr, "check_imma: %d failures\n", fails);
        return 1;
    }
    printf("check_imma: ok\n");
    return 0;
}
