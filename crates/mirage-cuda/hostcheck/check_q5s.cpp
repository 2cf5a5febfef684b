// Host check of q5s_dot / q5s_elem vs dequant_unit<Q5_0> (run.sh).
#include "prelude.h"
#define TY_Q5_0 6
inline u16 ld16(const u8* p) { u16 v; memcpy(&v, p, 2); return v; }
#include "q5_extract.h"
int main() {
    std::mt19937 g(3); std::uniform_real_distribution<float> U(-1, 1);
    int shapes[][2] = {{1, 32}, {5, 96}, {37, 896}, {9, 4864}, {3, 288}, {130, 256}};
    double worst = 0; long mism = 0;
    for (auto& sh : shapes) {
        int rows = sh[0], cols = sh[1], nb = cols / 32;
        std::vector<u8> ggml(rows * nb * 22);
        for (auto& b : ggml) b = g() & 255;
        for (int i = 0; i < rows * nb; i++) { u16 d = 0x2000 + (g() % 0x1000); memcpy(&ggml[i * 22], &d, 2); }
        std::vector<u8> W(ggml.size());
        long n = rows * nb;
        for (long i = 0; i < n; i++) { memcpy(&W[i * 16], &ggml[i * 22 + 6], 16); memcpy(&W[n * 16 + i * 4], &ggml[i * 22 + 2], 4); memcpy(&W[n * 20 + i * 2], &ggml[i * 22], 2); }
        std::vector<float> ref(rows * cols);
        for (int r = 0; r < rows; r++) for (int u = 0; u < nb; u++) dequant_unit<TY_Q5_0>(&ggml[r * nb * 22], u, &ref[r * cols + u * 32]);
        for (int r = 0; r < rows; r++) for (int i = 0; i < cols; i++) if (q5s_elem(W.data(), rows, cols, r, i) != ref[r * cols + i]) mism++;
        std::vector<float> x(cols); for (auto& v : x) v = U(g);
        for (int r0 = 0; r0 < rows; r0 += 4) {
            const u8* q[4]; const u32* qh[4]; const u16* s[4];
            for (int k = 0; k < 4; k++) { int r = min(r0 + k, rows - 1); Q5S_ROW_PTRS(W.data(), rows, r, k, q, qh, s) }
            double tot[4] = {0, 0, 0, 0};
            for (int lane = 0; lane < 32; lane++) { float acc[4] = {0, 0, 0, 0}; q5s_dot<4>(q, qh, s, x.data(), cols, lane, acc); for (int k = 0; k < 4; k++) tot[k] += acc[k]; }
            for (int k = 0; k < 4 && r0 + k < rows; k++) {
                double want = 0, mag = 0; for (int i = 0; i < cols; i++) { want += (double)ref[(r0 + k) * cols + i] * x[i]; mag += std::fabs(ref[(r0 + k) * cols + i] * x[i]); }
                double e = std::fabs(tot[k] - want) / mag; if (e > worst) worst = e;
            }
        }
    }
    printf("q5s_elem mismatches %ld; q5s_dot worst rel err %.3g\n", mism, worst);
    return (mism == 0 && worst < 1e-5) ? 0 : 1;
}
