// Host check of mmq.cu's prefill products (no GPU; extract.py ->
// mmq_extract.h), the mma instructions emulated by the PTX ISA's fragment
// layout (mma_emu.h), blocks run as fibers (block_emu.h):
//   1. quantize_q8_block: every quant is round(x / d) with d = max|x| /
//      127, and the block's scale is d;
//   2. mmq_tile of both layouts (q8_0s, q5_0s) and both tiles (64 and 128)
//      on random split-layout bytes with valid f16 scales, against an f64
//      product of the layout's element accessors (q8s_elem, q5s_elem) and
//      the dequantized 8-bit activations: a second, partly filled tile of
//      weight rows and of activation rows, more column stages than the
//      ring has buffers and fewer; the asynchronous copies landing when
//      issued and, again, as late as their waits allow (cp_async_emu.h),
//      and none still in flight when a block ends.
// Build and run: hostcheck/run.sh.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>
#include "block_emu.h"
#include "ptx_emu.h"
#include "mma_emu.h"
#include "cp_async_emu.h"
#include "mmq_extract.h"

static std::mt19937 gen(11);
static int fails = 0;

// A random normal f16 of magnitude 2^-6 .. 2^-1, either sign.
static u16 rand_half() {
    std::uniform_int_distribution<int> e(9, 13), m(0, 1023), s(0, 1);
    return (u16)((s(gen) << 15) | (e(gen) << 10) | m(gen));
}

// Random bytes of a split-layout matrix, its f16 fields made valid.
static std::vector<uint4> random_matrix(int fmt, int rows, int cols) {
    long bytes = fmt == MMQ_Q8_0 ? (long)rows * cols + (long)rows * cols / 16
                                 : (long)rows * cols / 2 + (long)rows * cols / 8 + (long)rows * cols / 16;
    std::vector<uint4> buf((bytes + 15) / 16 + 1);
    u8* p = (u8*)buf.data();
    std::uniform_int_distribution<int> byte(0, 255);
    for (long i = 0; i < bytes; i++) p[i] = (u8)byte(gen);
    auto halves = [&](long at, long n, long stride) {
        for (long i = 0; i < n; i++) {
            u16 h = rand_half();
            memcpy(p + at + i * stride, &h, 2);
        }
    };
    const long rc = (long)rows * cols;
    if (fmt == MMQ_Q8_0) halves(rc, rc / 32, 2);
    if (fmt == MMQ_Q5_0) halves(rc / 2 + rc / 8, rc / 32, 2);
    return buf;
}

static float elem(int fmt, const u8* W, int rows, int cols, int r, int i) {
    return fmt == MMQ_Q8_0 ? q8s_elem(W, rows, cols, r, i) : q5s_elem(W, rows, cols, r, i);
}

static void check(bool ok, const char* what) {
    if (!ok) {
        fprintf(stderr, "FAIL: %s\n", what);
        fails++;
    }
}

template <int FMT, int T> void check_layout(const char* name, int rows, int cols, int n_act) {
    std::vector<float> y_eager;
    std::vector<uint4> wbuf = random_matrix(FMT, rows, cols);
    const u8* W = (const u8*)wbuf.data();
    std::normal_distribution<float> N(0.f, 1.f);
    std::vector<float> x((size_t)n_act * cols);
    for (auto& v : x) v = N(gen);
    for (int i = 0; i < cols; i++) x[i] = 0.f;  // an all-zero activation row
    const long n_blocks = (long)n_act * cols / 32;
    std::vector<uint4> qbuf(((size_t)n_act * cols + 15) / 16);
    i8* xq = (i8*)qbuf.data();
    // 16-byte aligned, as the device buffers are (cp.async reads 16 bytes).
    std::vector<uint4> xd_buf((n_blocks + 3) / 4);
    float* xd = (float*)xd_buf.data();
    // 1. Quantization: one warp per block, 8 warps a block.
    gridDim = dim3_{(unsigned)((n_blocks + 7) / 8), 1, 1};
    for (unsigned bx = 0; bx < gridDim.x; bx++)
        run_block(256, dim3_{bx, 0, 0}, [&] {
            long b = (long)blockIdx.x * 8 + (threadIdx.x >> 5);
            if (b < n_blocks) quantize_q8_block(x.data(), xq, xd, b, threadIdx.x & 31);
        });
    for (long b = 0; b < n_blocks; b++) {
        float amax = 0;
        for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(x[b * 32 + i]));
        float d = amax / 127.f;
        for (int i = 0; i < 32; i++) {
            int want = amax == 0 ? 0 : (int)std::nearbyint(x[b * 32 + i] / d);
            check(xq[b * 32 + i] == want, "q8 quant");
        }
        check(xd[b] == d, "q8 scale");
    }
    // 2. The product, blocks in reverse order, the copies landing early
    // and late.
    std::vector<uint4> ring_buf(MMQ_STAGES(T) * MMQ_STAGE_BYTES(T) / 16);
    u8* ring = (u8*)ring_buf.data();
    std::vector<float> y((size_t)n_act * rows, NAN);
    for (cp_async_emu::Mode mode : {cp_async_emu::Eager, cp_async_emu::Deferred}) {
        cp_async_emu::mode = mode;
        std::fill(y.begin(), y.end(), NAN);
        gridDim = dim3_{(unsigned)((n_act + T - 1) / T), (unsigned)((rows + T - 1) / T), 1};
        for (int by = gridDim.y - 1; by >= 0; by--)
            for (int bx = gridDim.x - 1; bx >= 0; bx--) {
                memset(ring, 0x5a, ring_buf.size() * 16);  // stale bytes, not zeros
                cp_async_emu::start_block(T * T / 32);
                run_block(T * T / 32, dim3_{(unsigned)bx, (unsigned)by, 0},
                          [&] { mmq_tile<FMT, T>(W, rows, cols, xq, xd, n_act, y.data(), ring); });
                check(cp_async_emu::block_drained(), "cp.async copies still in flight at the block's end");
            }
        if (mode == cp_async_emu::Eager) y_eager = y;
    }
    check(cp_async_emu::copies_landed == cp_async_emu::copies_issued, "cp.async copies lost");
    for (size_t i = 0; i < y.size(); i++)
        if (memcmp(&y[i], &y_eager[i], 4) != 0) {
            check(false, "early and late copies gave different bits");
            break;
        }
    double worst = 0, scale = 0;
    for (int a = 0; a < n_act; a++)
        for (int r = 0; r < rows; r++) {
            double want = 0, mag = 0;
            for (int i = 0; i < cols; i++) {
                double t = (double)elem(FMT, W, rows, cols, r, i) * ((double)xq[(long)a * cols + i] *
                                                                     xd[((long)a * cols + i) / 32]);
                want += t;
                mag += std::fabs(t);
            }
            double got = y[(long)a * rows + r];
            if (!(std::fabs(got - want) <= 1e-5 * mag + 1e-30)) {
                if (fails < 10) fprintf(stderr, "%s: y[%d][%d] = %g, want %g\n", name, a, r, got, want);
                fails++;
            }
            worst = std::max(worst, std::fabs(got - want) / (mag + 1e-30));
            scale = std::max(scale, mag);
        }
    printf("mmq %s, tile %d: %d x %d times %d rows: worst error %.2e of the sum of |terms|\n", name, T, rows, cols, n_act, worst);
}

int main() {
    // 3 stages of columns (the 64 tile's ring has 2 buffers), 5 (the 128
    // tile's has 3).
    check_layout<MMQ_Q8_0, 64>("q8_0s", 72, 384, 70);
    check_layout<MMQ_Q5_0, 64>("q5_0s", 72, 384, 70);
    check_layout<MMQ_Q8_0, 128>("q8_0s", 136, 640, 140);
    check_layout<MMQ_Q5_0, 128>("q5_0s", 136, 640, 140);
    // Fewer stages than the ring has buffers, in one partial tile.
    check_layout<MMQ_Q8_0, 128>("q8_0s", 72, 128, 50);
    check_layout<MMQ_Q5_0, 128>("q5_0s", 72, 256, 50);
    check_layout<MMQ_Q8_0, 64>("q8_0s", 40, 128, 20);
    if (fails) {
        fprintf(stderr, "check_mmq: %d failures\n", fails);
        return 1;
    }
    printf("check_mmq: ok\n");
    return 0;
}
