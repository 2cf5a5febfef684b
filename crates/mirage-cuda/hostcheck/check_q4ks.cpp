// Host check of q4ks_dot / q4ks_elem vs dequant_unit<Q4_K> (run.sh).
#include "prelude.h"
#define TY_Q4_K 12
inline u16 ld16(const u8* p) { u16 v; memcpy(&v, p, 2); return v; }
#include "q4k_extract.h"
int main() {
    std::mt19937 g(9); std::uniform_real_distribution<float> U(-1, 1);
    int shapes[][2] = {{1, 256}, {5, 512}, {37, 768}, {9, 4096}, {3, 4864}};
    double worst = 0; long mism = 0;
    for (auto& sh : shapes) {
        int rows = sh[0], cols = sh[1], nsb = cols / 256;
        std::vector<u8> ggml(rows * nsb * 144);
        for (auto& b : ggml) b = g() & 255;
        for (int i = 0; i < rows * nsb; i++) { u16 d = 0x2000 + (g() % 0x1000), dm = 0x1c00 + (g() % 0x1000); memcpy(&ggml[i * 144], &d, 2); memcpy(&ggml[i * 144 + 2], &dm, 2); }
        std::vector<u8> W(ggml.size());
        for (int i = 0; i < rows * nsb; i++) { memcpy(&W[i * 128], &ggml[i * 144 + 16], 128); memcpy(&W[rows * nsb * 128 + i * 16], &ggml[i * 144], 16); }
        std::vector<float> ref(rows * cols);
        for (int r = 0; r < rows; r++) for (int u = 0; u < cols / 32; u++) dequant_unit<TY_Q4_K>(&ggml[r * nsb * 144], u, &ref[r * cols + u * 32]);
        for (int r = 0; r < rows; r++) for (int i = 0; i < cols; i++) if (q4ks_elem(W.data(), rows, cols, r, i) != ref[r * cols + i]) mism++;
        std::vector<float> x(cols); for (auto& v : x) v = U(g);
        for (int r0 = 0; r0 < rows; r0 += 4) {
            const u8* q[4]; const u8* mt[4];
            for (int k = 0; k < 4; k++) { int r = min(r0 + k, rows - 1); q[k] = W.data() + (long)r * (cols >> 1); mt[k] = W.data() + (long)rows * (cols >> 1) + (long)r * (cols >> 4); }
            double tot[4] = {0, 0, 0, 0};
            for (int lane = 0; lane < 32; lane++) { float acc[4] = {0, 0, 0, 0}; q4ks_dot<4>(q, mt, x.data(), cols, lane, acc); for (int k = 0; k < 4; k++) tot[k] += acc[k]; }
            for (int k = 0; k < 4 && r0 + k < rows; k++) {
                double want = 0, mag = 0; for (int i = 0; i < cols; i++) { want += (double)ref[(r0 + k) * cols + i] * x[i]; mag += std::fabs(ref[(r0 + k) * cols + i] * x[i]); }
                double e = std::fabs(tot[k] - want) / mag; if (e > worst) worst = e;
            }
        }
    }
    printf("q4ks_elem mismatches %ld; q4ks_dot worst rel err %.3g\n", mism, worst);
    return (mism == 0 && worst < 1e-5) ? 0 : 1;
}
