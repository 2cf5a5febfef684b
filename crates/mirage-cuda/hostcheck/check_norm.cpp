// Host check of norm.cu's rms_norm_row (no GPU): the function cut out of the
// kernel source (extract.py -> norm_extract.h) and run as one emulated
// block (block_emu.h). For row widths that take the vector path in one round,
// in several rounds and with a partial last round, and widths / misaligned
// rows that take the scalar loop, at 256 threads (the backend's launch):
// every element is emitted exactly once, the values equal an f64 RMSNorm to
// 2e-6 relative, and the vector path equals the scalar loop on the same row
// to the same bound (they sum in different orders). Then superblock.cu's
// sb_stage_x, phase 1 of the sparse FFN with the norm folded in: the
// shared-memory x it stages holds rms_norm_row's values in the layout of
// the unfolded staging (interleaved), bit
// for bit, and block 0 writes the norm's output row.
// Build and run: hostcheck/run.sh.
#include <cstdio>
#include <cstdlib>
#include <random>
#include "block_emu.h"
#define SB_THREADS 256
#include "norm_extract.h"

// Runs rms_norm_row over xr on one block of `threads`; out[i] gets emit's
// value, hits[i] how many times element i was emitted.
// by > 0: rms_norm_row_by(by, ...) instead, threads >= by idle.
static void norm_block(const float* xr, const float* w, int cols, int threads, std::vector<float>& out,
                       std::vector<int>& hits, int by = 0) {
    out.assign(cols, NAN);
    hits.assign(cols, 0);
    static float s32[32];
    run_block(threads, dim3_{0, 0, 0}, [&] {
        auto emit = [&](int i, float v) {
            out[i] = v;
            __atomic_fetch_add(&hits[i], 1, __ATOMIC_RELAXED);
        };
        if (by > 0)
            rms_norm_row_by(by, xr, w, 1e-6f, cols, s32, emit);
        else
            rms_norm_row(xr, w, 1e-6f, cols, s32, emit);
    });
}

int main() {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    int fails = 0, cases = 0;
    // 4 * 256 * NORM_VEC floats per round of the vector path.
    const int widths[] = {896, 1024, 3584, 4096, 5120, 4100, 8192 + 16, 90, 6, 2};
    for (int cols : widths) {
        for (int misalign = 0; misalign < 2; misalign++) {
            // 16-byte aligned storage; misalign = 1 shifts the row by one float (scalar path).
            std::vector<float4> xs(cols / 4 + 2), ws(cols / 4 + 2);
            float* x = reinterpret_cast<float*>(xs.data()) + misalign;
            float* w = reinterpret_cast<float*>(ws.data());
            for (int i = 0; i < cols; i++) x[i] = 3.f * nd(rng), w[i] = 1.f + 0.5f * nd(rng);
            double ss = 0;
            for (int i = 0; i < cols; i++) ss += (double)x[i] * x[i];
            double scale = 1.0 / std::sqrt(ss / cols + 1e-6);
            std::vector<float> out, scalar_out;
            std::vector<int> hits, scalar_hits;
            norm_block(x, w, cols, 256, out, hits);
            // The scalar loop on the same values: copy x to a row one float off alignment.
            std::vector<float4> xs2(cols / 4 + 2);
            float* x2 = reinterpret_cast<float*>(xs2.data()) + 1;
            memcpy(x2, x, cols * sizeof(float));
            norm_block(x2, w, cols, 256, scalar_out, scalar_hits);
            double worst = 0, worst_sc = 0;
            int bad_hits = 0;
            for (int i = 0; i < cols; i++) {
                double ref = x[i] * scale * w[i];
                worst = std::max(worst, std::fabs(out[i] - ref) / (std::fabs(ref) + 1e-3));
                worst_sc = std::max(worst_sc, std::fabs((double)out[i] - scalar_out[i]) / (std::fabs(ref) + 1e-3));
                bad_hits += hits[i] != 1 || scalar_hits[i] != 1;
            }
            // 256 of 512 threads (route.cu's folded norm): the same bits.
            std::vector<float> by_out;
            std::vector<int> by_hits;
            norm_block(x, w, cols, 512, by_out, by_hits, 256);
            int by_differ = memcmp(by_out.data(), out.data(), cols * sizeof(float)) != 0;
            for (int i = 0; i < cols; i++) by_differ += by_hits[i] != 1;
            bool vec = cols % 4 == 0 && misalign == 0;
            bool ok = bad_hits == 0 && worst < 2e-6 && worst_sc < 2e-6 && by_differ == 0;
            cases++;
            fails += !ok;
            printf("rms_norm_row cols %5d %s: %s (elements not emitted once: %d, vs f64 %.2e, vs scalar loop %.2e, "
                   "256 of 512 threads differ: %d)\n", cols, vec ? "vector" : "scalar", ok ? "ok" : "FAIL", bad_hits, worst,
                   worst_sc, by_differ);
        }
    }
    printf("rms_norm_row: %d of %d cases ok\n", cases - fails, cases);
    for (int d : {256, 896, 3584, 5120}) {
        {
            std::vector<float4> xs(d / 4), ws(d / 4), staged(d / 4), plain(d / 4);
            float* x = reinterpret_cast<float*>(xs.data());
            float* w = reinterpret_cast<float*>(ws.data());
            for (int i = 0; i < d; i++) x[i] = 2.f * nd(rng), w[i] = 1.f + 0.3f * nd(rng);
            std::vector<float> ref, nout(d, NAN);
            std::vector<int> hits;
            norm_block(x, w, d, 256, ref, hits);
            // The unfolded staging of the normalized row (interleaved).
            std::vector<float4> want(d / 4);
            const int nv = d >> 4;
            for (int t = 0; t < d / 4; t++) {
                float4 v{ref[4 * t], ref[4 * t + 1], ref[4 * t + 2], ref[4 * t + 3]};
                want[(t & 3) * nv + (t >> 2)] = v;
            }
            run_block(256, dim3_{0, 0, 0}, [&] { sb_stage_x(staged.data(), x, d, w, 1e-6f, nout.data()); });
            int differ = 0;
            for (int t = 0; t < d / 4; t++)
                differ += memcmp(&staged[t], &want[t], sizeof(float4)) != 0;
            for (int i = 0; i < d; i++) differ += memcmp(&nout[i], &ref[i], 4) != 0;
            cases++;
            fails += differ != 0;
            printf("sb_stage_x d %4d: %s (%d float4s or outputs differ)\n", d, differ ? "FAIL" : "ok", differ);
        }
    }
    printf("norm checks: %d of %d cases ok\n", cases - fails, cases);
    return fails ? 1 : 0;
}
