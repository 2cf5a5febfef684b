// Host check of q8s_dot / nvfp4_dot / q8s_elem / nvfp4_elem / pick3 (run.sh).
#include "prelude.h"
#include "kernels_extract.h"
static u16 f2h_host(float f) { // simple round-to-nearest for normal range
    u32 u; memcpy(&u, &f, 4); u32 s = (u >> 16) & 0x8000; int e = ((u >> 23) & 255) - 127 + 15; u32 m = u & 0x7fffff;
    if (e <= 0) return s; return s | (e << 10) | (m >> 13);
}
static double e4m3_ref(u32 b) { b &= 0x7f; int e = b >> 3, m = b & 7; return e == 0 ? std::ldexp((double)m, -9) : std::ldexp(1.0 + m / 8.0, e - 7); }
static double e2m1_ref(u32 c) { static const double t[8] = {0, .5, 1, 1.5, 2, 3, 4, 6}; double v = t[c & 7]; return (c & 8) ? -v : v; }
int main() {
    std::mt19937 g(5); std::uniform_real_distribution<float> U(-1, 1);
    int shapes[][2] = {{1, 256}, {5, 288}, {37, 96}, {130, 512}, {67, 1056}, {9, 4096}};
    double worst = 0;
    for (auto& sh : shapes) {
        int rows = sh[0], cols = sh[1];
        // split q8: quants then scales
        std::vector<u8> W(rows * cols + rows * cols / 32 * 2);
        std::vector<double> ref(rows * cols);
        u16* sc = (u16*)(W.data() + rows * cols);
        for (int r = 0; r < rows; r++) for (int b = 0; b < cols / 32; b++) {
            u16 h = f2h_host(0.01f + 0.02f * (U(g) + 1)); sc[r * (cols / 32) + b] = h;
            for (int i = 0; i < 32; i++) { int8_t q = (int8_t)(g() % 255 - 127); W[r * cols + b * 32 + i] = (u8)q; ref[r * cols + b * 32 + i] = h2f(h) * q; }
        }
        std::vector<float> x(cols); for (auto& v : x) v = U(g);
        for (int r0 = 0; r0 < rows; r0 += 4) {
            const u8* q[4]; const u16* s[4];
            for (int k = 0; k < 4; k++) { int r = min(r0 + k, rows - 1); q[k] = W.data() + (long)r * cols; s[k] = sc + (long)r * (cols >> 5); }
            double tot[4] = {0, 0, 0, 0};
            for (int lane = 0; lane < 32; lane++) { float acc[4] = {0, 0, 0, 0}; q8s_dot<4>(q, s, x.data(), cols, lane, acc); for (int k = 0; k < 4; k++) tot[k] += acc[k]; }
            for (int k = 0; k < 4 && r0 + k < rows; k++) {
                double want = 0, mag = 0; for (int i = 0; i < cols; i++) { want += ref[(r0 + k) * cols + i] * x[i]; mag += std::fabs(ref[(r0 + k) * cols + i] * x[i]); }
                double e = std::fabs(tot[k] - want) / mag; if (e > worst) worst = e;
                // element accessor
                for (int i = 0; i < cols; i += 7) if (q8s_elem(W.data(), rows, cols, r0 + k, i) != (float)ref[(r0 + k) * cols + i]) { printf("q8s_elem mismatch\n"); return 1; }
            }
        }
    }
    printf("q8s_dot worst rel err %.3g\n", worst);
    if (worst > 1e-6) return 1;
    worst = 0;
    for (auto& sh : shapes) {
        int rows = sh[0], cols = sh[1];
        std::vector<u8> W(rows * cols / 2 + rows * cols / 16);
        std::vector<double> ref(rows * cols);
        float ts = 0.37f;
        for (int r = 0; r < rows; r++) for (int i = 0; i < cols; i += 2) W[(r * cols + i) / 2] = g() & 255;
        for (int j = 0; j < rows * cols / 16; j++) W[rows * cols / 2 + j] = g() % 0x7f;
        for (int r = 0; r < rows; r++) for (int i = 0; i < cols; i++) {
            u32 code = (W[(r * cols + i) / 2] >> (4 * (i & 1))) & 15; u32 scb = W[rows * cols / 2 + (r * cols + i) / 16];
            ref[r * cols + i] = e2m1_ref(code) * e4m3_ref(scb) * ts;
            float got = nvfp4_elem(W.data(), rows, cols, ts, r, i);
            if (std::fabs(got - ref[r * cols + i]) > 1e-6 * std::fabs(ref[r * cols + i])) { printf("nvfp4_elem mismatch r %d i %d %g %g\n", r, i, got, ref[r*cols+i]); return 1; }
        }
        std::vector<float> x(cols); for (auto& v : x) v = U(g);
        for (int r0 = 0; r0 < rows; r0 += 4) {
            const u32* q[4]; const u8* s[4];
            for (int k = 0; k < 4; k++) { int r = min(r0 + k, rows - 1); q[k] = (const u32*)(W.data() + (long)r * (cols >> 1)); s[k] = W.data() + rows * cols / 2 + (long)r * (cols >> 4); }
            double tot[4] = {0, 0, 0, 0};
            for (int lane = 0; lane < 32; lane++) { float acc[4] = {0, 0, 0, 0}; nvfp4_dot<4>(q, s, x.data(), cols, lane, acc); for (int k = 0; k < 4; k++) tot[k] += acc[k]; }
            for (int k = 0; k < 4 && r0 + k < rows; k++) {
                double want = 0, mag = 0; for (int i = 0; i < cols; i++) { want += ref[(r0 + k) * cols + i] * x[i]; mag += std::fabs(ref[(r0 + k) * cols + i] * x[i]); }
                double got = tot[k] * 0.5 * ts;
                double e = std::fabs(got - want) / mag; if (e > worst) worst = e;
            }
        }
    }
    printf("nvfp4_dot worst rel err %.3g\n", worst);
    if (worst > 1e-6) return 1;
    // pick3
    int rows0 = 70, rows1 = 33, rows2 = 5, pb = 32, b0 = 3, b1 = 2, b2 = 1;
    const int want_m[6] = {0, 0, 0, 1, 1, 2}, want_l[6] = {0, 1, 2, 0, 1, 0};
    (void)rows2;
    for (int bx = 0; bx < b0 + b1 + b2; bx++) {
        int m; int l = pick3(bx, pb, rows0, rows1, &m);
        if (m != want_m[bx] || l != want_l[bx]) { printf("pick3(%d) = (%d, %d)\n", bx, m, l); return 1; }
    }
    printf("OK\n");
}
