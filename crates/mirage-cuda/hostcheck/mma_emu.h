// Host stand-ins for the warp-wide int8 tensor-core instructions mmq.cu and
// matvec_imma.cu issue (mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32,
// every accumulator starting from one value),
// on the fibers of block_emu.h: every lane of the warp deposits its
// fragment registers, the warp meets at a barrier, and the whole A, B and C
// matrices are built from the deposits by the PTX ISA's fragment layout
// (written out here element by element, as the ISA states it, and
// independently of how the kernel indexes its tiles); each lane then takes
// its own accumulators back.
#pragma once
#include "block_emu.h"

namespace mma_emu {
constexpr int MAX_WARPS = 32;
inline unsigned a_regs[MAX_WARPS][32][4], b_regs[MAX_WARPS][32][2];
inline int byte_of(unsigned reg, int i) { return (int)(signed char)((reg >> (8 * i)) & 255u); }
// The warp's A and B of its latest mma, built by the first of its lanes to
// get there (every lane of a warp issues the same sequence of mmas): the
// count of mmas each lane has issued, and the count A and B were built for.
inline long issued[MAX_WARPS][32], built[MAX_WARPS];
inline int A_of[MAX_WARPS][16][32], B_of[MAX_WARPS][32][8];

// A (16 x 32) from a_regs, B (32 x 8) from b_regs, D = A B + C for this
// lane's four accumulators.
inline void mma_k32(int* c) {
    const int w = threadIdx.x >> 5, me = threadIdx.x & 31;
    const long n = ++issued[w][me];
    if (built[w] != n) {
        int (&A)[16][32] = A_of[w];
        int (&B)[32][8] = B_of[w];
        for (int lane = 0; lane < 32; lane++) {
            const int group = lane >> 2, tig = lane & 3;
            // A: 16 s8 elements a0..a15 in 4 registers (4 a register).
            for (int i = 0; i < 16; i++) {
                const int row = (i < 4 || (i >= 8 && i < 12)) ? group : group + 8;
                const int col = i < 8 ? tig * 4 + (i & 3) : tig * 4 + (i & 3) + 16;
                A[row][col] = byte_of(a_regs[w][lane][i >> 2], i & 3);
            }
            // B: 8 s8 elements b0..b7 in 2 registers.
            for (int i = 0; i < 8; i++) {
                const int row = i < 4 ? tig * 4 + (i & 3) : tig * 4 + (i & 3) + 16;
                B[row][group] = byte_of(b_regs[w][lane][i >> 2], i & 3);
            }
        }
        built[w] = n;
    }
    // C/D: c0..c3, row group (c0, c1) or group + 8, column 2 tig + (i & 1).
    const int group = me >> 2, tig = me & 3;
    for (int i = 0; i < 4; i++) {
        const int row = i < 2 ? group : group + 8, col = tig * 2 + (i & 1);
        int s = 0;
        for (int k = 0; k < 32; k++) s += A_of[w][row][k] * B_of[w][k][col];
        c[i] += s;
    }
}
}  // namespace mma_emu

// d = A B + (c, c, c, c).
inline void mma_s8_k32_from(int* d, const unsigned* a, const unsigned* b, int c) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = 0; i < 4; i++) mma_emu::a_regs[w][lane][i] = a[i];
    for (int i = 0; i < 2; i++) mma_emu::b_regs[w][lane][i] = b[i];
    __syncwarp();
    for (int i = 0; i < 4; i++) d[i] = c;
    mma_emu::mma_k32(d);
    __syncwarp();
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: A 16 x 16 and B 16 x 8
// in f16 (two per register, the lower index in the lower half), f32
// accumulators; products exact in f32 (as the hardware's), summed in f64
// here, then rounded once.
namespace mma_emu {
inline unsigned h_a[MAX_WARPS][32][4], h_b[MAX_WARPS][32][2];
}  // namespace mma_emu
inline void mma_f16_k16(float* c, const unsigned* a, const unsigned* b) {
    const int w = threadIdx.x >> 5, me = threadIdx.x & 31;
    for (int i = 0; i < 4; i++) mma_emu::h_a[w][me][i] = a[i];
    for (int i = 0; i < 2; i++) mma_emu::h_b[w][me][i] = b[i];
    __syncwarp();
    float A[16][16], B[16][8];
    for (int lane = 0; lane < 32; lane++) {
        const int group = lane >> 2, tig = lane & 3;
        // A: a0..a7 (two per register): row group for a0, a1, a4, a5, else
        // group + 8; column tig * 2 + (i & 1), plus 8 for i >= 4.
        for (int i = 0; i < 8; i++) {
            const int row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
            const int col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
            A[row][col] = h2f((u16)(mma_emu::h_a[w][lane][i >> 1] >> (16 * (i & 1))));
        }
        // B: b0..b3: row tig * 2 + (i & 1), plus 8 for i >= 2; column group.
        for (int i = 0; i < 4; i++) {
            const int row = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
            B[row][group] = h2f((u16)(mma_emu::h_b[w][lane][i >> 1] >> (16 * (i & 1))));
        }
    }
    const int group = me >> 2, tig = me & 3;
    for (int i = 0; i < 4; i++) {
        const int row = i < 2 ? group : group + 8, col = tig * 2 + (i & 1);
        double s = c[i];
        for (int k = 0; k < 16; k++) s += (double)A[row][k] * B[k][col];
        c[i] = (float)s;
    }
    __syncwarp();
}
