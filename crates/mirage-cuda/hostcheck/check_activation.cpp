// Host check of cuda/activation.cu (no GPU): the activation-sparse mat-vec
// compiled as C++ and run block by block (block_emu.h; a warp ballot from
// shuffles, global atomics as plain adds: blocks run one after another).
//   1. the compaction: the kernel's per-matrix count of active channels
//      equals the count of |x_i| >= thr_i (x, or silu(gate) * up);
//   2. the product over the active channels equals a scalar reference: the
//      channel-major matrix dequantized element by element from the layout
//      as mirage_gguf::quant::channel_major documents it (code_position,
//      the scale records, the headers; written here independently of the
//      kernel's inverse mapping), times the masked input, in f64;
// for every channel-major type, tiles with a short last tile and a last
// block of 64 outputs, one split and many, up to three matrices of one
// launch with different row counts, thresholds that keep none, some and
// all channels.
// Build and run: hostcheck/run.sh.
#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include "block_emu.h"

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;
#define __global__
#define ACT_HOST
struct uint2 { u32 x, y; };
inline float act_h2f(unsigned short h) {
    u32 s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? INFINITY : std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
inline int __popc(u32 v) { return __builtin_popcount(v); }
inline u32 act_ballot(bool p) {
    u32 m = 0;
    for (int l = 0; l < 32; l++) m |= (u32)(__shfl_sync(0xffffffffu, (int)p, l) != 0) << l;
    return m;
}
inline float act_ldcg(const float* p) { return *p; }
inline void __threadfence() {}
inline u32 atomicAdd(u32* p, u32 v) { u32 o = *p; *p += v; return o; }
inline u64 atomicAdd(u64* p, u64 v) { u64 o = *p; *p += v; return o; }
#include "activation.cu"

static std::mt19937 rng(11);
static int fails = 0;
static double worst = 0;

// Half of a float in the normal range (round to nearest).
static unsigned short f2h(float f) {
    u32 b;
    memcpy(&b, &f, 4);
    u32 s = (b >> 16) & 0x8000;
    int e = (int)((b >> 23) & 255) - 127 + 15;
    u32 m = (b >> 13) & 1023;
    if ((b >> 12) & 1) m++;
    if (m == 1024) m = 0, e++;
    return (unsigned short)(s | (e << 10) | m);
}

struct Scheme { int id, group, sb, bits, rec, hdr; const char* name; };
static const Scheme TYPES[] = {
    {2, 32, 32, 4, 2, 0, "q4_0"},  {3, 32, 32, 4, 4, 0, "q4_1"}, {6, 32, 32, 5, 2, 0, "q5_0"},
    {7, 32, 32, 5, 4, 0, "q5_1"},  {8, 32, 32, 8, 2, 0, "q8_0"}, {12, 32, 256, 4, 2, 4, "q4_k"},
    {13, 32, 256, 5, 2, 4, "q5_k"}, {14, 16, 256, 6, 1, 2, "q6_k"},
};

// The layout (channel_major.rs's ChannelMajorLayout), in longs.
struct Ref {
    Scheme s;
    int rows, cols, tile;
    int tile_rows(int t) const { return std::min(tile, rows - t * tile); }
    long run(int r) const { return (long)r * s.bits / 8; }
    long recb(int r) const { return (long)r * s.rec; }
    long hdrb(int r) const { return (long)r * s.hdr; }
    long groupb(int r) const { return recb(r) + s.group * run(r); }
    long sbb(int r) const { return hdrb(r) + (s.sb / s.group) * groupb(r); }
    long tileb(int r) const { return (long)(cols / s.sb) * sbb(r); }
    long bytes() const {
        long n = 0;
        for (int t = 0; t * tile < rows; t++) n += tileb(tile_rows(t));
        return n;
    }
    long tile_off(int t) const { return t * tileb(tile); }
    long hdr_off(int t, int sb) const { return tile_off(t) + sb * sbb(tile_rows(t)); }
    long rec_off(int t, int g) const {
        int gps = s.sb / s.group;
        return hdr_off(t, g / gps) + hdrb(tile_rows(t)) + (g % gps) * groupb(tile_rows(t));
    }
    long chan_off(int t, int i) const { return rec_off(t, i / s.group) + recb(tile_rows(t)) + (i % s.group) * run(tile_rows(t)); }
};

// code_position (channel_major.rs), as written there.
static void code_position(int bits, int r, int o, int* lo, int* lsh, int* hi, int* hsh) {
    int b = o / 128, ob = o % 128;
    int w = std::min(128, r - b * 128);
    int nl = w / 32, half = w / 2;
    int z = ob / half, o2 = ob % half;
    int q = o2 / (4 * nl), l = (o2 % (4 * nl)) / 4, m = o2 % 4;
    int k = 16 * l + 4 * q + m;
    *hi = -1;
    if (bits == 8) {
        *lo = b * 128 + z * half + k, *lsh = 0;
        return;
    }
    *lo = b * 64 + k, *lsh = 4 * z;
    if (bits == 5) *hi = r / 2 + 16 * b + ob % 16, *hsh = ob / 16;
    if (bits == 6) {
        int v = ob / 16, lane = ob % 16, i = v / 4, f = v % 4, h = lane / 8, l2 = (lane % 8) / 4, m2 = lane % 4;
        *hi = r / 2 + 32 * b + 16 * l2 + 8 * i + 4 * h + m2, *hsh = 2 * f;
    }
}

static float f16at(const std::vector<u8>& d, long at) { return act_h2f((unsigned short)(d[at] | d[at + 1] << 8)); }

// W[j][i] of the channel-major bytes (channel_major.rs's `dequantize`).
static std::vector<double> dequant(const Ref& L, const std::vector<u8>& d) {
    std::vector<double> w((size_t)L.rows * L.cols);
    int id = L.s.id;
    for (int t = 0; t * L.tile < L.rows; t++) {
        int r = L.tile_rows(t);
        for (int i = 0; i < L.cols; i++) {
            int g = i / L.s.group;
            long run = L.chan_off(t, i), rec = L.rec_off(t, g), hdr = L.hdr_off(t, g / (L.s.sb / L.s.group));
            for (int p = 0; p < r; p++) {
                int lo, lsh, hi, hsh;
                code_position(L.s.bits, r, p, &lo, &lsh, &hi, &hsh);
                int q = L.s.bits == 8 ? d[run + lo] : (d[run + lo] >> lsh) & 15;
                if (hi >= 0) q |= ((d[run + hi] >> hsh) & (L.s.bits == 5 ? 1 : 3)) << 4;
                double v;
                if (id == 2 || id == 6 || id == 8) v = (double)(q - (id == 2 ? 8 : id == 6 ? 16 : 128)) * f16at(d, rec + 2 * p);
                else if (id == 3 || id == 7) v = (double)q * f16at(d, rec + 2 * p) + f16at(d, rec + 2 * r + 2 * p);
                else if (id == 12 || id == 13)
                    v = (double)(f16at(d, hdr + 2 * p) * (float)d[rec + p]) * q - (double)f16at(d, hdr + 2 * r + 2 * p) * d[rec + r + p];
                else v = (double)f16at(d, hdr + 2 * p) * (double)(signed char)d[rec + p] * (q - 32);
                w[(size_t)(t * L.tile + p) * L.cols + i] = v;
            }
        }
    }
    return w;
}

// Random codes; scale records and headers with sane values.
static std::vector<u8> random_matrix(const Ref& L) {
    std::vector<u8> d(L.bytes());
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> sc(0.002f, 0.05f);
    for (auto& b : d) b = (u8)byte(rng);
    auto put16 = [&](long at, float v) { unsigned short h = f2h(v); d[at] = h & 255, d[at + 1] = h >> 8; };
    int gps = L.s.sb / L.s.group;
    for (int t = 0; t * L.tile < L.rows; t++) {
        int r = L.tile_rows(t);
        for (int sb = 0; sb < L.cols / L.s.sb; sb++) {
            long h = L.hdr_off(t, sb);
            for (int p = 0; p < r * L.s.hdr / 2; p++) put16(h + 2 * p, sc(rng));
            for (int g = sb * gps; g < (sb + 1) * gps; g++) {
                long rc = L.rec_off(t, g);
                if (L.s.id == 2 || L.s.id == 6 || L.s.id == 8 || L.s.id == 3 || L.s.id == 7)
                    for (int p = 0; p < r * L.s.rec / 2; p++) put16(rc + 2 * p, (p >= r ? -1.f : 1.f) * sc(rng));
            }
        }
    }
    return d;
}

static float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

// ACT_KERNEL's dispatch by type, for the host: act_matvec<0> calls the
// template of the current type.
static int cur_type;
template <> void act_matvec<0>(ActMats m, int cols, const float* x, const float* up, int gpb, float* partials, int prow,
                               u32* counters, int ctr_stride, u64* stats, ActFold f) {
    switch (cur_type) {
#define T(ID) \
    case ID: return act_matvec<ID>(m, cols, x, up, gpb, partials, prow, counters, ctr_stride, stats, f);
        T(2) T(3) T(6) T(7) T(8) T(12) T(13) T(14)
#undef T
    }
}

// One launch of `mats` (1..3 matrices of type s, `cols` inputs) against the
// reference; keep: the share of channels the thresholds keep.
// Folded into the launch: biases, a residual add (one matrix), a norm.
enum { F_BIAS = 1, F_RES = 2, F_NORM = 4 };
static void check(const Scheme& s, std::vector<std::array<int, 2>> shapes, int cols, double keep, bool swiglu, int sms,
                  int folds = 0) {
    int nm = shapes.size();
    std::vector<Ref> L(nm);
    std::vector<std::vector<u8>> data(nm);
    std::vector<std::vector<float>> thr(nm), y(nm);
    std::normal_distribution<float> N(0, 1);
    std::vector<float> x(cols), up(cols), in(cols);
    std::vector<float> nw(cols), nout(cols, NAN);
    for (int i = 0; i < cols; i++) x[i] = N(rng), up[i] = N(rng), nw[i] = 0.5f + 0.05f * N(rng);
    double ss = 0;
    for (int i = 0; i < cols; i++) ss += (double)x[i] * x[i];
    const double scale = 1 / std::sqrt(ss / cols + 1e-6);
    for (int i = 0; i < cols; i++)
        in[i] = (folds & F_NORM) ? (float)(x[i] * scale * nw[i]) : swiglu ? silu_mul(x[i], up[i]) : x[i];
    ActMats m{};
    ActFold fold{};
    std::vector<std::vector<float>> bias(nm);
    std::vector<float> res, res0;
    int max_tiles = 0, prow = 0, threads = 32, sum_tiles = 0;
    for (int k = 0; k < nm; k++) {
        L[k] = {s, shapes[k][0], cols, shapes[k][1]};
        data[k] = random_matrix(L[k]);
        thr[k].resize(cols);
        // Per-channel thresholds: a cut at the keep share of |in|, scaled per channel (as WINA's are).
        std::vector<float> a(cols);
        for (int i = 0; i < cols; i++) a[i] = std::fabs(in[i]);
        std::sort(a.begin(), a.end());
        float cut = keep >= 1 ? 0.f : keep <= 0 ? INFINITY : a[(size_t)((1 - keep) * cols)];
        for (int i = 0; i < cols; i++) thr[k][i] = cut * (0.8f + 0.4f * (float)((i * 7 + k) % 5) / 4.f);
        y[k].assign(L[k].rows, NAN);
        int tiles = (L[k].rows + L[k].tile - 1) / L[k].tile;
        max_tiles = std::max(max_tiles, tiles), sum_tiles += tiles;
        prow = std::max(prow, L[k].rows);
        threads = std::max(threads, (L[k].tile / 8 + 31) / 32 * 32);
        m.data[k] = data[k].data(), m.thr[k] = thr[k].data(), m.y[k] = y[k].data();
        m.rows[k] = L[k].rows, m.tile[k] = L[k].tile;
        if (folds & F_BIAS) {
            bias[k].resize(L[k].rows);
            for (auto& b : bias[k]) b = N(rng);
            m.bias[k] = bias[k].data();
        }
    }
    if (folds & F_RES) {
        res.resize(L[0].rows);
        for (auto& r : res) r = N(rng);
        res0 = res;
        fold.res = res.data();
    }
    if (folds & F_NORM) fold.nx = x.data(), fold.nw = nw.data(), fold.neps = 1e-6f, fold.nout = nout.data();
    // split_for (activation.rs).
    int n_groups = cols / s.group;
    int min_split = std::max(1, (cols + ACT_MAX_CH - 1) / ACT_MAX_CH);
    int want = (2 * sms + sum_tiles - 1) / sum_tiles;
    int split = std::min(std::max(want, min_split), n_groups);
    int gpb = (n_groups + split - 1) / split;
    split = (n_groups + gpb - 1) / gpb;
    std::vector<float> partials((size_t)nm * split * prow, NAN);
    std::vector<u32> counters(3 * 64, 0);
    std::vector<u64> stats(2 * nm, 0);
    gridDim.x = max_tiles, gridDim.y = split, gridDim.z = nm;
    for (int z = 0; z < nm; z++)
        for (int sp = 0; sp < split; sp++)
            for (int t = 0; t < max_tiles; t++)
                run_block(threads, {(unsigned)t, (unsigned)sp, (unsigned)z}, [&] {
                    act_matvec<0>(m, cols, x.data(), swiglu ? up.data() : nullptr, gpb, partials.data(), prow,
                                  counters.data(), 64, stats.data(), fold);
                });
    if (folds & F_NORM) {
        // The norm against f64; the product then against the kernel's own
        // normalized row (a channel at its threshold may flip with the
        // rounding of the row's scale).
        double nerr = 0;
        for (int i = 0; i < cols; i++) nerr = std::max(nerr, std::fabs(nout[i] - in[i]) / (std::fabs(in[i]) + 1e-3));
        if (!(nerr < 1e-5)) printf("FAIL %s: folded norm rel err %.3g\n", s.name, nerr), fails++;
        in = nout;
    }
    for (int k = 0; k < nm; k++) {
        std::vector<double> w = dequant(L[k], data[k]);
        long active = 0;
        for (int i = 0; i < cols; i++) active += std::fabs(in[i]) >= thr[k][i];
        if ((long)stats[2 * k] != active) {
            printf("FAIL %s matrix %d: %llu active channels counted, %ld expected\n", s.name, k, stats[2 * k], active);
            fails++;
        }
        double amax = 1e-30, err = 0;
        std::vector<double> ref(L[k].rows);
        for (int j = 0; j < L[k].rows; j++) {
            double acc = 0;
            for (int i = 0; i < cols; i++)
                if (std::fabs(in[i]) >= thr[k][i]) acc += w[(size_t)j * cols + i] * in[i];
            if (folds & F_BIAS) acc += bias[k][j];
            ref[j] = acc, amax = std::max(amax, std::fabs(acc));
        }
        for (int j = 0; j < L[k].rows; j++) {
            err = std::max(err, std::fabs(y[k][j] - ref[j]) / amax);
            if (k == 0 && (folds & F_RES)) err = std::max(err, std::fabs(res[j] - (res0[j] + ref[j])) / amax);
        }
        if (!(err < 2e-5) || (active == 0 && amax > 1e-30)) {
            printf("FAIL %s %dx%d tile %d (matrix %d of %d, split %d, keep %.2f%s): rel err %.3g\n", s.name, L[k].rows,
                   cols, L[k].tile, k, nm, split, keep, swiglu ? ", swiglu" : "", err);
            fails++;
        }
        worst = std::max(worst, err);
    }
    for (u32 c : counters)
        if (c) {
            printf("FAIL %s: a tile counter was left at %u\n", s.name, c);
            fails++;
            break;
        }
}

int main() {
    int n = 0;
    for (const Scheme& s : TYPES) {
        cur_type = s.id;
        bool half = s.id == 2 || s.id == 3 || s.id == 8;
        for (double keep : {0.5, 0.0, 1.0, 0.25}) {
            // One matrix, several tiles with a short last one; one split and many.
            check(s, {{384, 256}}, 512, keep, false, 1), n++;
            check(s, {{640, 256}}, 512, keep, false, 64), n++;
            // Q, K, V shaped: three matrices, different rows, one launch.
            check(s, {{256, 256}, {128, 128}, {128, 128}}, 256, keep, false, 8), n++;
            if (half) check(s, {{192, 128}, {576, 256}}, 256, keep, false, 4), n++;
        }
        // Down: the input is silu(gate) * up, computed by the kernel.
        check(s, {{256, 256}}, 768, 0.4, true, 16), n++;
        // Folded epilogues and prologue: biases (Q, K, V), the residual add
        // (one matrix, one split and many), the norm before it.
        check(s, {{256, 256}, {128, 128}, {128, 128}}, 512, 0.5, false, 8, F_BIAS | F_NORM), n++;
        check(s, {{384, 256}}, 512, 0.5, false, 1, F_RES), n++;
        check(s, {{384, 256}}, 512, 0.6, false, 64, F_RES | F_BIAS | F_NORM), n++;
    }
    printf("activation: %d launches, worst relative error %.3g, %d failures\n", n, worst, fails);
    return fails ? 1 : 0;
}
