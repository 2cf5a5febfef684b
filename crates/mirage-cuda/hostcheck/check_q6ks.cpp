// Host check of q6ks_dot / q6ks_elem vs dequant_unit<Q6_K> (run.sh).
#include "prelude.h"
#define TY_Q6_K 14
inline u16 ld16(const u8* p) { u16 v; memcpy(&v, p, 2); return v; }
#include "q6k_extract.h"
int main() {
    std::mt19937 g(4); std::uniform_real_distribution<float> U(-1, 1);
    int shapes[][2] = {{1, 256}, {5, 512}, {37, 768}, {9, 4864}, {3, 4096}};
    double worst = 0; long mism = 0;
    for (auto& sh : shapes) {
        int rows = sh[0], cols = sh[1], nsb = cols / 256;
        long n = (long)rows * nsb;
        std::vector<u8> ggml(n * 210);
        for (auto& b : ggml) b = g() & 255;
        for (long i = 0; i < n; i++) { u16 d = 0x1800 + (g() % 0x1000); memcpy(&ggml[i * 210 + 208], &d, 2); }
        std::vector<u8> W(ggml.size());
        for (long i = 0; i < n; i++) {
            memcpy(&W[i * 128], &ggml[i * 210], 128);
            memcpy(&W[n * 128 + i * 64], &ggml[i * 210 + 128], 64);
            memcpy(&W[n * 192 + i * 16], &ggml[i * 210 + 192], 16);
            memcpy(&W[n * 208 + i * 2], &ggml[i * 210 + 208], 2);
        }
        std::vector<float> ref(rows * cols);
        for (int r = 0; r < rows; r++) for (int u = 0; u < cols / 32; u++) dequant_unit<TY_Q6_K>(&ggml[(long)r * nsb * 210], u, &ref[r * cols + u * 32]);
        for (int r = 0; r < rows; r++) for (int i = 0; i < cols; i++) if (q6ks_elem(W.data(), rows, cols, r, i) != ref[r * cols + i]) mism++;
        std::vector<float> x(cols); for (auto& v : x) v = U(g);
        for (int r0 = 0; r0 < rows; r0 += 4) {
            const u8* ql[4]; const u8* qh[4]; const i8* sc[4]; const u16* dd[4];
            for (int k = 0; k < 4; k++) { int r = min(r0 + k, rows - 1); Q6S_ROW_PTRS(W.data(), rows, r, k) }
            double tot[4] = {0, 0, 0, 0};
            for (int lane = 0; lane < 32; lane++) { float acc[4] = {0, 0, 0, 0}; q6ks_dot<4>(ql, qh, sc, dd, x.data(), cols, lane, acc); for (int k = 0; k < 4; k++) tot[k] += acc[k]; }
            for (int k = 0; k < 4 && r0 + k < rows; k++) {
                double want = 0, mag = 0; for (int i = 0; i < cols; i++) { want += (double)ref[(r0 + k) * cols + i] * x[i]; mag += std::fabs(ref[(r0 + k) * cols + i] * x[i]); }
                double e = std::fabs(tot[k] - want) / mag; if (e > worst) worst = e;
            }
        }
    }
    printf("q6ks_elem mismatches %ld; q6ks_dot worst rel err %.3g\n", mism, worst);
    return (mism == 0 && worst < 1e-5) ? 0 : 1;
}
