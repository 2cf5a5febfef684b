// ===========================================================================
// Activation-sparse decode mat-vecs of Q8_0, Q4_K, Q4_1, Q5_0 and Q6_K
// matrices
// over a channel-major GPU layout. Compiled after pdl.cu and norm.cu (the
// module's source is the three files in that order; NVRTC, --std=c++17, no
// headers).
//
// Per input vector x (one decode token), the input channels with
// |x_i| >= thr_i are "active"; the product reads the weight bytes of the
// active channels only. Two kernels:
//   asp_select  per group of 32 channels (one warp): which pass, and their
//               int8 codes. Written once per input vector into a list that
//               every block of every matrix reading that input uses (Q/K/V
//               share one, gate/up one). It may take the RMSNorm of its
//               input row first (norm.cu's row function, so the same bits
//               as the norm kernel), saving the norm's launch.
//   asp_mv_*    the product over the listed channels. Two optional
//               epilogues, each saving a launch of a decode step: for gate
//               and up in one launch, h = SiLU(gate) * up of a tile and
//               down's list of it, by the block that completes the tile's
//               second matrix; for one matrix, y = product + y (the
//               residual add).
//
// Layout of a rows x cols matrix (cols a multiple of 32; of 256 for Q4_K
// and Q6_K), for a tile width TW = 512, 1024 or 2048 outputs. Tiles of TW
// outputs (the last one r = rows - TW t outputs, padded to rp = r rounded up
// to 16 with zero codes and scales); tile t starts at byte TW t * R, R the
// bytes of an output row: cols + cols / 16 (Q8_0), cols / 2 + cols / 16
// (Q4_K), 5 cols / 8 (Q4_1), 11 cols / 16 (Q5_0), 105 cols / 128 (Q6_K). A
// lane's outputs are 16 l .. 16 l + 15. A tile holds
//   codes:  per channel c, its run: the codes of the tile's rp outputs at
//           c * run. Q8_0: run = rp, byte o = code of output o (ggml's
//           int8, as stored). The others: run = rp / 2 bytes of the
//           codes' low 4 bits, byte 8 l + b = output 16 l + b (low nibble)
//           and output 16 l + 8 + b (high nibble), b < 8.
//   high bits (Q5_0, Q6_K), after the codes (at cols * rp / 2): per channel
//           c, its run of hrun = rp / 8 (Q5_0) or rp / 4 (Q6_K) bytes at
//           c * hrun. Q5_0: lane l's u16 at 2 l, bit 4 m + i = bit 4 of
//           output 16 l + 4 i + m's code (m, i < 4). Q6_K: lane l's 4 bytes
//           at 4 l, bits 2 i .. 2 i + 1 of byte m = bits 4..5 of output
//           16 l + 4 i + m's code.
//   scales, after the codes and high bits:
//           Q8_0 and Q5_0, per group g: ggml's f16 d of each output, 2 rp
//           bytes at 2 rp g.
//           Q4_1, per group g, 4 rp bytes at 4 rp g: per output (d, m) as two
//           f16.
//           Q4_K, per super-block s (256 channels), 16 rp bytes: per output
//           (d, dmin) as two f16 (4 rp bytes), then eight planes lo_j of rp
//           bytes (sub-block j's 6-bit scale sc and min m: low 4 bits of
//           each, sc | m << 4), then four planes hi_k (the high 2 bits of
//           sub-blocks 2k and 2k + 1: sc_2k | m_2k << 2 | sc_2k+1 << 4 |
//           m_2k+1 << 6). Byte o of a plane is output o.
//           Q6_K, per super-block s, 18 rp bytes: the f16 d of each output
//           (2 rp bytes), then per group j < 8 of the super-block a plane of
//           2 rp bytes: output o's int8 scales of sub-blocks 2 j and 2 j + 1
//           (16 channels each) at bytes 2 o and 2 o + 1.
// Codes are ggml's: Q8_0 signed, weight d q; Q4_K d sc q - dmin m; Q4_1
// d q + m; Q5_0 (0..31) d (q - 16); Q6_K (0..63) d sc (q - 32). Every code
// and scale bit of the ggml blocks, moved: Q8_0 34 bytes per 32 weights,
// Q4_1 20, Q5_0 22, Q4_K 144 per 256, Q6_K 210, as the source (plus the
// padding of the last tile).
//
// List (asp_select's output): one 128-byte record per group g, 32 words:
//   0: active channels k; 1: dx (f32 bits; the group's active inputs are
//   x_i ~ dx * xq_i, dx = max |x_i| / 127, xq_i = round(x_i / dx) as the CPU
//   path's ActiveChannels); 2: dx * sum of the xq_i (f32 bits); 3: 0;
//   4..11: the positions (0..31) of the active channels in the group, a byte
//   each in order, 255 past k; 12..19: their xq_i (int8), 0 past k; 20..31: 0.
// Words 4 + b and 12 + b are "batch" b: four channels and their codes.
//
// Product (asp_matvec). A warp owns 512 outputs of a tile (H = TW / 512
// warps side by side cover it, so that the bytes of an active channel's run
// are read together), lane l outputs 16 l .. 16 l + 15 of them, and walks
// groups; per group it loads, for every active channel, the lane's 16 B
// (Q8_0) or 8 B (the others) of the channel's run and its 2 B (Q5_0) or
// 4 B (Q6_K) of high bits, in rounds of up to CH channels. Four channels'
// words are transposed with 8 byte permutes (word k of the result: byte k
// of each channel) so that one dp4a multiplies 4 channels of one output by
// the batch's 4 int8 codes (Q4_K: the low and the high nibbles masked
// apart, the high ones 16x; Q5_0 and Q6_K: the nibbles shifted apart and
// their high bits, transposed the same way, shifted in): exact int32 sums
// per (output, group). Per 4 channels x 16 outputs a lane runs 16 dp4a, 16
// permutes and 16 masks (Q4_K) or 32 permutes (Q8_0), and 4 loads with
// their addresses: about 1.2 instructions a weight (Q5_0 about 2; Q6_K,
// whose two sub-blocks of a group have their own scales, two dp4a an
// output: about 2.5). At the group's end its scales enter once per
// output, in f32 (about 14 instructions for Q4_K, 5 for Q8_0):
//   Q8_0: y += d * dx * acc;
//   Q4_K: y += d * sc * dx * acc - dmin * m * dx * sum(xq);
//   Q4_1: y += d * dx * acc + m * dx * sum(xq);
//   Q5_0: y += d * dx * (acc - 16 sum(xq));
//   Q6_K: y += d * dx * (sc_a (acc_a - 32 sum_a(xq)) + sc_b (acc_b - ...)),
//         a and b the channels of the group's two sub-blocks.
// The serial variant waits for each round before it multiplies; the
// pipelined one keeps the next round's loads in flight while it multiplies.
// A block (NW warps) owns one tile and NW / H * gpw consecutive groups, gpw
// per warp; its warps' outputs are summed in shared memory in warp order. With
// several blocks per tile ("splits") each writes a partial row and the last
// block to finish (an integer counter) adds the partials in split order:
// the same bits on every run.
// ===========================================================================

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

#define ASP_WARP_OUT 512          // outputs of one warp: 32 lanes x 16
#define ASP_GROUP 32              // channels per scale group
#define ASP_REC_WORDS 32          // words of one group's list record
#define ASP_REC_IDX 4             // word of batch 0's channel positions
#define ASP_REC_XQ 12             // word of batch 0's codes
#define ASP_NONE 255u             // channel position past the active ones
#define ASP_MAX_BLOCK_GROUPS 64   // groups of one block (NW / H * gpw)
#define ASP_Q4_1 3                // ggml type ids
#define ASP_Q5_0 6
#define ASP_Q8_0 8
#define ASP_Q4_K 12
#define ASP_Q6_K 14

#ifndef ASP_HOST
__device__ __forceinline__ u32 asp_prmt(u32 a, u32 b, u32 s) { return __byte_perm(a, b, s); }
// sum of the byte products (a, b signed) + c
__device__ __forceinline__ int asp_dp4a_ss(u32 a, u32 b, int c) { return __dp4a((int)a, (int)b, c); }
// sum of the byte products (a unsigned, b signed) + c
__device__ __forceinline__ int asp_dp4a_us(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ float asp_h2f(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)h));
    return f;
}
__device__ __forceinline__ u32 asp_ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
__device__ __forceinline__ float4 asp_ldcg4(const float4* p) { return __ldcg(p); }
__device__ __forceinline__ float asp_ldcg1(const float* p) { return __ldcg(p); }
__device__ __forceinline__ uint4 asp_ld16(const u8* p) { return __ldg((const uint4*)p); }
__device__ __forceinline__ uint2 asp_ld8(const u8* p) { return __ldg((const uint2*)p); }
__device__ __forceinline__ u32 asp_ld4(const u8* p) { return __ldg((const u32*)p); }
__device__ __forceinline__ u32 asp_ld2(const u8* p) { return __ldg((const u16*)p); }
#endif

// Component w (compile-time after unrolling) of a uint4.
__device__ __forceinline__ u32 asp_word(const uint4& v, int w) {
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// Bytes per output row of a matrix of `cols` channels in this layout.
template <int TY>
__device__ __forceinline__ long asp_row_bytes(int cols) {
    return TY == ASP_Q8_0   ? (long)cols + cols / 16
           : TY == ASP_Q4_K ? (long)cols / 2 + cols / 16
           : TY == ASP_Q4_1 ? (long)cols / 2 + cols / 8
           : TY == ASP_Q5_0 ? (long)cols / 2 + cols / 8 + cols / 16
                            : (long)cols / 2 + cols / 4 + 9L * cols / 128;
}

// Bytes of one channel's high-bit run in a tile of rp outputs (0: none).
template <int TY>
__device__ __forceinline__ int asp_hrun(int rp) {
    return TY == ASP_Q5_0 ? rp / 8 : TY == ASP_Q6_K ? rp / 4 : 0;
}

// One lane's view of one tile of one matrix.
struct AspTile {
    const u8* codes;   // this lane's bytes of channel 0's run
    const u8* hcodes;  // this lane's bytes of channel 0's high-bit run
    const u8* scales;  // the tile's scale region
    int rp;            // outputs of the tile, padded to 16
    int run;           // bytes of one channel's run
    int hrun;          // bytes of one channel's high-bit run
    int lane;          // the lane's 16 outputs: 16 lane .. of the tile
    bool on;           // whether the lane has outputs in the tile
};

// Tile t (of tw outputs) as lane `lane` (0 .. tw / 16) sees it.
template <int TY>
__device__ __forceinline__ AspTile asp_tile(const u8* W, int rows, int cols, int tw, int t, int lane) {
    AspTile T;
    const int r = min(tw, rows - t * tw);
    T.rp = (r + 15) & ~15;
    T.run = TY == ASP_Q8_0 ? T.rp : T.rp / 2;
    T.hrun = asp_hrun<TY>(T.rp);
    const u8* base = W + (long)t * tw * asp_row_bytes<TY>(cols);
    T.codes = base + lane * (TY == ASP_Q8_0 ? 16 : 8);
    T.hcodes = base + (long)cols * T.run + lane * (TY == ASP_Q5_0 ? 2 : 4);
    T.scales = base + (long)cols * (T.run + T.hrun);
    T.lane = lane;
    T.on = lane * 16 < T.rp;
    return T;
}

// A round: channels [c0, c0 + n) of the active ones of group g (g < 0:
// none), the group's last round or not.
struct AspRound {
    int g, c0, n;
    bool last;
};

// The round after r in a warp's groups [.., gw1) (the first: r = {gw0 - 1,
// 0, 0, true}); groups without active channels are skipped. lst: the
// block's records from group gb0 on.
__device__ __forceinline__ AspRound asp_next(const u32* lst, int gb0, int gw1, int ch, AspRound r) {
    if (!r.last) {
        const int cnt = (int)lst[(r.g - gb0) * ASP_REC_WORDS];
        const int c0 = r.c0 + ch, n = min(ch, cnt - c0);
        return AspRound{r.g, c0, n, c0 + n == cnt};
    }
    int g = r.g + 1;
    while (g < gw1 && lst[(g - gb0) * ASP_REC_WORDS] == 0u) g++;
    if (g >= gw1) return AspRound{-1, 0, 0, true};
    const int cnt = (int)lst[(g - gb0) * ASP_REC_WORDS];
    const int n = min(ch, cnt);
    return AspRound{g, 0, n, n == cnt};
}

// One round's loads: per channel this lane's bytes of its run; with the
// group's last round, the group's scales.
template <int TY, int CH> struct AspBuf;
template <int CH> struct AspBuf<ASP_Q8_0, CH> {
    uint4 c[CH];
    uint4 d[2];  // d of the lane's 16 outputs (f16)
};
template <int CH> struct AspBuf<ASP_Q4_K, CH> {
    uint2 c[CH];
    uint4 lo, hi;  // planes lo_j and hi_(j/2), the lane's 16 bytes
    uint4 dd[4];   // (d, dmin) of the lane's 16 outputs (f16 pairs)
};

template <int CH> struct AspBuf<ASP_Q4_1, CH> {
    uint2 c[CH];
    uint4 dd[4];  // (d, m) of the lane's 16 outputs (f16 pairs)
};
template <int CH> struct AspBuf<ASP_Q5_0, CH> {
    uint2 c[CH];
    u32 h[CH];   // the lane's 16 high bits of each channel
    uint4 d[2];  // d of the lane's 16 outputs (f16)
};
template <int CH> struct AspBuf<ASP_Q6_K, CH> {
    uint2 c[CH];
    u32 h[CH];    // the lane's 32 high bits of each channel
    uint4 d[2];   // d of the lane's 16 outputs (f16)
    uint4 sc[2];  // the group's two sub-block scales of each output (int8)
};

template <int TY, int CH>
__device__ __forceinline__ void asp_clear(AspBuf<TY, CH>& B) {
    if constexpr (TY == ASP_Q8_0) {
#pragma unroll
        for (int i = 0; i < CH; i++) B.c[i] = make_uint4(0u, 0u, 0u, 0u);
        B.d[0] = B.d[1] = make_uint4(0u, 0u, 0u, 0u);
    } else if constexpr (TY == ASP_Q5_0 || TY == ASP_Q6_K) {
#pragma unroll
        for (int i = 0; i < CH; i++) {
            B.c[i] = make_uint2(0u, 0u);
            B.h[i] = 0u;
        }
        B.d[0] = B.d[1] = make_uint4(0u, 0u, 0u, 0u);
        if constexpr (TY == ASP_Q6_K) B.sc[0] = B.sc[1] = make_uint4(0u, 0u, 0u, 0u);
    } else if constexpr (TY == ASP_Q4_1) {
#pragma unroll
        for (int i = 0; i < CH; i++) B.c[i] = make_uint2(0u, 0u);
#pragma unroll
        for (int i = 0; i < 4; i++) B.dd[i] = make_uint4(0u, 0u, 0u, 0u);
    } else {
#pragma unroll
        for (int i = 0; i < CH; i++) B.c[i] = make_uint2(0u, 0u);
        B.lo = B.hi = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int i = 0; i < 4; i++) B.dd[i] = make_uint4(0u, 0u, 0u, 0u);
    }
}

template <int TY, int CH>
__device__ __forceinline__ void asp_load(AspBuf<TY, CH>& B, const AspRound& r, const AspTile& T, const u32* rec) {
    const u8* gc = T.codes + (long)r.g * ASP_GROUP * T.run;
    const u8* gh = T.hcodes + (long)r.g * ASP_GROUP * T.hrun;
#pragma unroll
    for (int b = 0; b < CH / 4; b++) {
        if (4 * b < r.n) {
            const u32 idx4 = rec[ASP_REC_IDX + r.c0 / 4 + b];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u32 ch = (idx4 >> (8 * i)) & 255u;
                if (ch != ASP_NONE && T.on) {
                    if constexpr (TY == ASP_Q8_0) {
                        B.c[4 * b + i] = asp_ld16(gc + ch * (u32)T.run);
                    } else {
                        B.c[4 * b + i] = asp_ld8(gc + ch * (u32)T.run);
                    }
                    if constexpr (TY == ASP_Q5_0) B.h[4 * b + i] = asp_ld2(gh + ch * (u32)T.hrun);
                    if constexpr (TY == ASP_Q6_K) B.h[4 * b + i] = asp_ld4(gh + ch * (u32)T.hrun);
                }
            }
        }
    }
    if (r.last && T.on) {
        if constexpr (TY == ASP_Q8_0 || TY == ASP_Q5_0) {
            const u8* s = T.scales + (long)r.g * 2 * T.rp + 32 * T.lane;
            B.d[0] = asp_ld16(s);
            B.d[1] = asp_ld16(s + 16);
        } else if constexpr (TY == ASP_Q4_1) {
            const u8* s = T.scales + (long)r.g * 4 * T.rp + 64 * T.lane;
#pragma unroll
            for (int q = 0; q < 4; q++) B.dd[q] = asp_ld16(s + 16 * q);
        } else if constexpr (TY == ASP_Q6_K) {
            const u8* s = T.scales + (long)(r.g >> 3) * 18 * T.rp + 32 * T.lane;
            B.d[0] = asp_ld16(s);
            B.d[1] = asp_ld16(s + 16);
            const u8* p = s + (long)(1 + (r.g & 7)) * 2 * T.rp;
            B.sc[0] = asp_ld16(p);
            B.sc[1] = asp_ld16(p + 16);
        } else {
            const int j = r.g & 7;
            const u8* s = T.scales + (long)(r.g >> 3) * 16 * T.rp;
            B.lo = asp_ld16(s + (4 + j) * T.rp + 16 * T.lane);
            B.hi = asp_ld16(s + (12 + (j >> 1)) * T.rp + 16 * T.lane);
#pragma unroll
            for (int q = 0; q < 4; q++) B.dd[q] = asp_ld16(s + 64 * T.lane + 16 * q);
        }
    }
}

// 4x4 byte transpose: t[k] holds byte k of a, b, c, d (in that order).
__device__ __forceinline__ void asp_transpose(u32 a, u32 b, u32 c, u32 d, u32 (&t)[4]) {
    const u32 ab0 = asp_prmt(a, b, 0x5140u), ab1 = asp_prmt(a, b, 0x7362u);
    const u32 cd0 = asp_prmt(c, d, 0x5140u), cd1 = asp_prmt(c, d, 0x7362u);
    t[0] = asp_prmt(ab0, cd0, 0x5410u);
    t[1] = asp_prmt(ab0, cd0, 0x7632u);
    t[2] = asp_prmt(ab1, cd1, 0x5410u);
    t[3] = asp_prmt(ab1, cd1, 0x7632u);
}

// asp_transpose of word p (0: .x, 1: .y) of batch b's four 8-byte loads.
__device__ __forceinline__ void asp_transpose_half(const uint2* c, int b, int p, u32 (&t)[4]) {
    asp_transpose(p ? c[4 * b].y : c[4 * b].x, p ? c[4 * b + 1].y : c[4 * b + 1].x, p ? c[4 * b + 2].y : c[4 * b + 2].x,
                  p ? c[4 * b + 3].y : c[4 * b + 3].x, t);
}

// A lane's integer sums over a group: a[k] for output 16 l + k (Q4_K and
// Q4_1: a[8..16) 16x). Q6_K keeps the channels of the group's first sub-block
// (positions < 16) in a and the others in b; Q5_0 and Q6_K also sum the
// codes xq (their offset term: s, or sa and sb per sub-block).
template <int TY> struct AspAcc {
    int a[16];
};
template <> struct AspAcc<ASP_Q5_0> {
    int a[16];
    int s;
};
template <> struct AspAcc<ASP_Q6_K> {
    int a[16], b[16];
    int sa, sb;
};

template <int TY>
__device__ __forceinline__ void asp_acc_clear(AspAcc<TY>& A) {
#pragma unroll
    for (int k = 0; k < 16; k++) A.a[k] = 0;
    if constexpr (TY == ASP_Q5_0) A.s = 0;
    if constexpr (TY == ASP_Q6_K) {
#pragma unroll
        for (int k = 0; k < 16; k++) A.b[k] = 0;
        A.sa = A.sb = 0;
    }
}

// w << n for n >= 0, w >> -n otherwise (n known at compile time).
__device__ __forceinline__ u32 asp_shift(u32 w, int n) { return n >= 0 ? w << n : w >> -n; }

// A.a[k] += sum over the batch's 4 channels (positions idx4, codes xq4) of
// code(output 16 l + k) * xq (Q4_K and Q4_1: a[8..16) 16x).
template <int TY, int CH>
__device__ __forceinline__ void asp_batch(const AspBuf<TY, CH>& B, int b, u32 xq4, u32 idx4, AspAcc<TY>& A) {
    if constexpr (TY == ASP_Q8_0) {
#pragma unroll
        for (int w = 0; w < 4; w++) {
            u32 t[4];
            asp_transpose(asp_word(B.c[4 * b], w), asp_word(B.c[4 * b + 1], w), asp_word(B.c[4 * b + 2], w),
                          asp_word(B.c[4 * b + 3], w), t);
#pragma unroll
            for (int k = 0; k < 4; k++) A.a[4 * w + k] = asp_dp4a_ss(t[k], xq4, A.a[4 * w + k]);
        }
    } else if constexpr (TY == ASP_Q4_K || TY == ASP_Q4_1) {
#pragma unroll
        for (int p = 0; p < 2; p++) {
            u32 t[4];
            asp_transpose_half(B.c, b, p, t);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                A.a[4 * p + k] = asp_dp4a_us(t[k] & 0x0f0f0f0fu, xq4, A.a[4 * p + k]);
                A.a[8 + 4 * p + k] = asp_dp4a_us(t[k] & 0xf0f0f0f0u, xq4, A.a[8 + 4 * p + k]);
            }
        }
    } else {
        // The 4 channels' high bits transposed so that byte c of a word is
        // channel c's. Q5_0: hw[j] holds byte j of each u16, so output
        // 4 i + m's bit is bit 4 (m & 1) + i of hw[m >> 1]; Q6_K: hw[m] holds
        // byte m of each word, output 4 i + m's bits at 2 i.
        u32 hw[4];
        u32 xa = xq4, xb = 0u;
        if constexpr (TY == ASP_Q5_0) {
            const u32 x01 = asp_prmt(B.h[4 * b], B.h[4 * b + 1], 0x5410u);
            const u32 x23 = asp_prmt(B.h[4 * b + 2], B.h[4 * b + 3], 0x5410u);
            hw[0] = asp_prmt(x01, x23, 0x6420u);
            hw[1] = asp_prmt(x01, x23, 0x7531u);
            hw[2] = hw[3] = 0u;
            A.s = asp_dp4a_ss(xq4, 0x01010101u, A.s);
        } else {
            asp_transpose(B.h[4 * b], B.h[4 * b + 1], B.h[4 * b + 2], B.h[4 * b + 3], hw);
            // The first sub-block's channels into a, the rest into b
            // (padding, position 255, has code 0).
            u32 ma = 0u;
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (((idx4 >> (8 * i)) & 255u) < 16u) ma |= 0xffu << (8 * i);
            xa = xq4 & ma;
            xb = xq4 & ~ma;
            A.sa = asp_dp4a_ss(xa, 0x01010101u, A.sa);
            A.sb = asp_dp4a_ss(xb, 0x01010101u, A.sb);
        }
#pragma unroll
        for (int p = 0; p < 2; p++) {
            u32 t[4];
            asp_transpose_half(B.c, b, p, t);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                // Outputs 4 p + k (low nibbles: i = p) and 8 + 4 p + k (high
                // nibbles: i = 2 + p), m = k; the high bits to bit 4.
                u32 qlo = t[k] & 0x0f0f0f0fu, qhi = (t[k] >> 4) & 0x0f0f0f0fu;
                if constexpr (TY == ASP_Q5_0) {
                    const int at = 4 * (k & 1) + p;
                    qlo |= asp_shift(hw[k >> 1], 4 - at) & 0x10101010u;
                    qhi |= asp_shift(hw[k >> 1], 2 - at) & 0x10101010u;
                } else {
                    qlo |= asp_shift(hw[k], 4 - 2 * p) & 0x30303030u;
                    qhi |= asp_shift(hw[k], -2 * p) & 0x30303030u;
                }
                A.a[4 * p + k] = asp_dp4a_us(qlo, xa, A.a[4 * p + k]);
                A.a[8 + 4 * p + k] = asp_dp4a_us(qhi, xa, A.a[8 + 4 * p + k]);
                if constexpr (TY == ASP_Q6_K) {
                    A.b[4 * p + k] = asp_dp4a_us(qlo, xb, A.b[4 * p + k]);
                    A.b[8 + 4 * p + k] = asp_dp4a_us(qhi, xb, A.b[8 + 4 * p + k]);
                }
            }
        }
    }
}

// The group's scales into the lane's outputs: ys[q * 32 + lane] holds
// outputs 16 lane + 4 q .. + 3 of this warp's 512.
template <int TY, int CH>
__device__ __forceinline__ void asp_flush(const AspBuf<TY, CH>& B, int g, const u32* rec, const AspAcc<TY>& A,
                                          float4* ys, int lane) {
    const float dx = __uint_as_float(rec[1]);
#pragma unroll
    for (int q = 0; q < 4; q++) {
        float4 y4 = ys[q * 32 + lane];
        float y[4] = {y4.x, y4.y, y4.z, y4.w};
        if constexpr (TY == ASP_Q4_K) {
            // y += d * (dx * sc * acc) - dmin * (dx * sum(xq) * m); a[8..16)
            // is 16x: its dx / 16.
            const float dxk = q < 2 ? dx : dx * 0.0625f, dxs = __uint_as_float(rec[2]);
            const u32 sh = 4u * (u32)(g & 1);
            const u32 L = asp_word(B.lo, q), H = asp_word(B.hi, q) >> sh;
            const u32 sc4 = (L & 0x0f0f0f0fu) | ((H << 4) & 0x30303030u);
            const u32 m4 = ((L >> 4) & 0x0f0f0f0fu) | ((H << 2) & 0x30303030u);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int k = 4 * q + i;
                const u32 dd = asp_word(B.dd[k >> 2], k & 3);
                // byte i of sc4 and m4 (prmt: bytes 1..3 from the zero word)
                const int sc = (int)asp_prmt(sc4, 0u, 0x4440u | (u32)i);
                const int mn = (int)asp_prmt(m4, 0u, 0x4440u | (u32)i);
                y[i] = fmaf(asp_h2f(dd & 0xffffu), dxk * (float)(sc * A.a[k]), y[i]);
                y[i] = fmaf(-asp_h2f(dd >> 16), dxs * (float)mn, y[i]);
            }
        } else if constexpr (TY == ASP_Q4_1) {
            // y += d * dx * acc + m * (dx * sum(xq)); a[8..16) is 16x.
            const float dxk = q < 2 ? dx : dx * 0.0625f, dxs = __uint_as_float(rec[2]);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int k = 4 * q + i;
                const u32 dm = asp_word(B.dd[k >> 2], k & 3);
                y[i] = fmaf(asp_h2f(dm & 0xffffu) * dxk, (float)A.a[k], y[i]);
                y[i] = fmaf(asp_h2f(dm >> 16), dxs, y[i]);
            }
        } else {
            // d of the four outputs (f16)
            const uint4 dw = B.d[q >> 1];
            const u32 w0 = asp_word(dw, 2 * (q & 1)), w1 = asp_word(dw, 2 * (q & 1) + 1);
            const u32 h[4] = {w0 & 0xffffu, w0 >> 16, w1 & 0xffffu, w1 >> 16};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int k = 4 * q + i;
                int v;
                if constexpr (TY == ASP_Q8_0) {
                    v = A.a[k];
                } else if constexpr (TY == ASP_Q5_0) {
                    v = A.a[k] - 16 * A.s;  // codes 0..31 stand for q - 16
                } else {
                    // codes 0..63 stand for q - 32; the sub-blocks' scales
                    // sit at bytes 2 k and 2 k + 1 of B.sc
                    const u32 sw = asp_word(B.sc[q >> 1], 2 * (q & 1) + (i >> 1)) >> (16 * (i & 1));
                    const int sca = (int)(i8)(sw & 0xffu), scb = (int)(i8)((sw >> 8) & 0xffu);
                    v = sca * (A.a[k] - 32 * A.sa) + scb * (A.b[k] - 32 * A.sb);
                }
                y[i] = fmaf(dx * asp_h2f(h[i]), (float)v, y[i]);
            }
        }
        ys[q * 32 + lane] = make_float4(y[0], y[1], y[2], y[3]);
    }
}

template <int TY, int CH>
__device__ __forceinline__ void asp_compute(const AspBuf<TY, CH>& B, const AspRound& r, const u32* rec,
                                            AspAcc<TY>& A, float4* ys, int lane) {
    if (r.c0 == 0) asp_acc_clear(A);
#pragma unroll
    for (int b = 0; b < CH / 4; b++)
        if (4 * b < r.n)
            asp_batch<TY, CH>(B, b, rec[ASP_REC_XQ + r.c0 / 4 + b], rec[ASP_REC_IDX + r.c0 / 4 + b], A);
    if (r.last) asp_flush<TY, CH>(B, r.g, rec, A, ys, lane);
}

// One group's list record (see the file's head) by one warp: v is this
// lane's channel 32 g + lane, held against thr (null: every channel active).
__device__ __forceinline__ void asp_select_value(float v, const float* __restrict__ thr, int g,
                                                 u8* __restrict__ out, int lane, u8* sidx, u8* sxq) {
    const int c = g * ASP_GROUP + lane;
    const bool on = thr ? fabsf(v) >= thr[c] : true;
    const u32 mask = asp_ballot(on);
    const int k = __popc(mask), pos = __popc(mask & ((1u << lane) - 1u));
    float amax = on ? fabsf(v) : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float dx = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    const int q = on ? max(-127, min(127, __float2int_rn(v * id))) : 0;
    int sum = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (on) {
        sidx[pos] = (u8)lane;
        sxq[pos] = (u8)q;
    }
    if (lane >= k) {
        sidx[lane] = (u8)ASP_NONE;
        sxq[lane] = 0;
    }
    __syncwarp();
    u32 word = 0u;
    if (lane == 0) word = (u32)k;
    if (lane == 1) word = __float_as_uint(dx);
    if (lane == 2) word = __float_as_uint(dx * (float)sum);
    if (lane >= ASP_REC_IDX && lane < ASP_REC_IDX + 8) word = ((const u32*)sidx)[lane - ASP_REC_IDX];
    if (lane >= ASP_REC_XQ && lane < ASP_REC_XQ + 8) word = ((const u32*)sxq)[lane - ASP_REC_XQ];
    ((u32*)(out + (long)g * ASP_REC_WORDS * 4))[lane] = word;
    __syncwarp();
}

// The same for channels 32 g .. 32 g + 31 of x.
__device__ __forceinline__ void asp_select_group(const float* __restrict__ x, const float* __restrict__ thr, int g,
                                                 u8* __restrict__ out, int lane, u8* sidx, u8* sxq) {
    asp_select_value(x[g * ASP_GROUP + lane], thr, g, out, lane, sidx, sxq);
}

// asp_select's body (256 threads): with norm_w, x is the raw row and every
// block first takes its RMSNorm into xs (cols floats of shared memory) with
// norm.cu's row function, the norm kernel's bits (block (0, 0) writes it to
// norm_out as well, as a folded norm does); the lists are then made from
// the normed row.
__device__ __forceinline__ void asp_select_block(const float* __restrict__ x, int cols,
                                                 const float* __restrict__ norm_w, float eps, float* norm_out,
                                                 const float* thr0,
                                                 const float* thr1, const float* thr2, u8* list0, u8* list1,
                                                 u8* list2, float* xs, float* s32, u8 (*sidx)[ASP_GROUP],
                                                 u8 (*sxq)[ASP_GROUP]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* src = x;
    if (norm_w) {
        const bool first = blockIdx.x == 0 && blockIdx.y == 0;
        rms_norm_row(x, norm_w, eps, cols, s32, [&](int i, float v) {
            xs[i] = v;
            if (first) norm_out[i] = v;
        });
        __syncthreads();
        src = xs;
    }
    const int g = blockIdx.x * 8 + warp;
    if (g >= cols / ASP_GROUP) return;
    const int n = blockIdx.y;
    const float* thr = n == 0 ? thr0 : n == 1 ? thr1 : thr2;
    u8* out = n == 0 ? list0 : n == 1 ? list1 : list2;
    asp_select_group(src, thr, g, out, lane, sidx[warp], sxq[warp]);
}

// The product (see the file's head), tiles of H * 512 outputs. Matrix m =
// blockIdx.y (w0/l0/y0 or w1/l1/y1: gate and up in one launch); blockIdx.x
// = tile * splits + split. part: per matrix `splits` rows of n_tiles * TW
// floats; ctr: per matrix n_tiles counters and n_tiles more for the SwiGLU
// epilogue, zero before the first launch (each launch leaves them zero).
// Epilogues (see the file's head): hlist (gate and up in one launch):
// down's list of h = SiLU(y0) * y1 against hthr (null: every channel),
// y0 and y1 written as well; accumulate (one matrix): y = product + y.
template <int TY, int NW, int CH, bool PIPE, int H>
__device__ __forceinline__ void asp_matvec(const u8* __restrict__ w0, const u8* __restrict__ w1,
                                           const u8* __restrict__ l0, const u8* __restrict__ l1, float* y0,
                                           float* y1, int rows, int cols, int gpw, int splits, float* part,
                                           u32* ctr, const float* __restrict__ hthr, u8* hlist, int accumulate) {
    static_assert(CH % 4 == 0 && CH >= 4 && CH <= 32, "rounds of whole batches");
    static_assert(NW % H == 0, "whole tiles of warps");
    constexpr int TW = H * ASP_WARP_OUT, NS = NW / H;  // tile width, warps on one output range
    __shared__ uint4 lst4[ASP_MAX_BLOCK_GROUPS * ASP_REC_WORDS / 4];
    __shared__ float4 ys4[NW * ASP_WARP_OUT / 4];
    __shared__ int is_last;
    __shared__ u32 hidx[NW][ASP_GROUP / 4];  // asp_select_value's bytes, word-aligned
    __shared__ u32 hxq[NW][ASP_GROUP / 4];
    const int m = blockIdx.y;
    const u8* W = m ? w1 : w0;
    const u8* L = m ? l1 : l0;
    float* y = m ? y1 : y0;
    const int n_tiles = (rows + TW - 1) / TW;
    const int t = blockIdx.x / splits, s = blockIdx.x % splits;
    const int n_groups = cols / ASP_GROUP;
    if (NS * gpw > ASP_MAX_BLOCK_GROUPS) __trap();
    const int gb0 = min(n_groups, s * NS * gpw), gb1 = min(n_groups, gb0 + NS * gpw);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    for (int i = tid; i < (gb1 - gb0) * (ASP_REC_WORDS / 4); i += NW * 32)
        lst4[i] = __ldg((const uint4*)(L + (long)gb0 * ASP_REC_WORDS * 4) + i);
    for (int i = tid; i < NW * ASP_WARP_OUT / 4; i += NW * 32) ys4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    __syncthreads();

    const u32* lst = (const u32*)lst4;
    // Warp w: outputs 512 (w % H) .. of the tile, groups of subset w / H.
    const int gw0 = min(gb1, gb0 + (warp / H) * gpw), gw1 = min(gb1, gw0 + gpw);
    const AspTile T = asp_tile<TY>(W, rows, cols, TW, t, 32 * (warp % H) + lane);
    float4* ys = ys4 + warp * (ASP_WARP_OUT / 4);
    AspAcc<TY> acc;
    asp_acc_clear(acc);
    auto rec_of = [&](const AspRound& r) { return lst + (r.g - gb0) * ASP_REC_WORDS; };
    AspBuf<TY, CH> A;
    asp_clear(A);
    AspRound ra = asp_next(lst, gb0, gw1, CH, AspRound{gw0 - 1, 0, 0, true});
    if (!PIPE) {
        for (; ra.g >= 0; ra = asp_next(lst, gb0, gw1, CH, ra)) {
            asp_load(A, ra, T, rec_of(ra));
            asp_compute(A, ra, rec_of(ra), acc, ys, lane);
        }
    } else {
        AspBuf<TY, CH> B;
        asp_clear(B);
        if (ra.g >= 0) asp_load(A, ra, T, rec_of(ra));
        while (ra.g >= 0) {
            const AspRound rb = asp_next(lst, gb0, gw1, CH, ra);
            if (rb.g >= 0) asp_load(B, rb, T, rec_of(rb));
            asp_compute(A, ra, rec_of(ra), acc, ys, lane);
            if (rb.g < 0) break;
            ra = asp_next(lst, gb0, gw1, CH, rb);
            if (ra.g >= 0) asp_load(A, ra, T, rec_of(ra));
            asp_compute(B, rb, rec_of(rb), acc, ys, lane);
        }
    }
    __syncthreads();

    // The block's outputs (padded ones included, zero): the warps' rows
    // added in warp order.
    const float* ysf = (const float*)ys4;
    const int r = min(TW, rows - t * TW), rp = (r + 15) & ~15;
    const long prow = (long)n_tiles * TW;
    for (int o = tid; o < rp; o += NW * 32) {
        const int h = o / ASP_WARP_OUT, oo = o % ASP_WARP_OUT;
        const int at = ((oo & 15) >> 2) * 128 + (oo >> 4) * 4 + (oo & 3);
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < NS; w++) v += ysf[(w * H + h) * ASP_WARP_OUT + at];
        if (splits == 1) {
            if (o < r) {
                float* yo = y + (long)t * TW + o;
                *yo = accumulate ? v + *yo : v;
            }
        } else {
            part[((long)m * splits + s) * prow + (long)t * TW + o] = v;
        }
    }
    if (splits > 1) {
        // Several blocks per tile: the last one to finish adds the
        // partials, in split order, four outputs a thread and 16 partials in
        // flight.
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            u32* c = ctr + (long)m * n_tiles + t;
            is_last = atomicAdd(c, 1u) == (u32)(splits - 1);
            if (is_last) *c = 0u;
        }
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        const float4* first = (const float4*)(part + (long)m * splits * prow + (long)t * TW);
        const long prow4 = prow / 4;
        for (int j = tid; j < rp / 4; j += NW * 32) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            int k = 0;
            for (; k + 16 <= splits; k += 16) {
                float4 p[16];
#pragma unroll
                for (int u = 0; u < 16; u++) p[u] = asp_ldcg4(first + (k + u) * prow4 + j);
#pragma unroll
                for (int u = 0; u < 16; u++) v.x += p[u].x, v.y += p[u].y, v.z += p[u].z, v.w += p[u].w;
            }
            for (; k < splits; k++) {
                const float4 p = asp_ldcg4(first + k * prow4 + j);
                v.x += p.x, v.y += p.y, v.z += p.z, v.w += p.w;
            }
            float* out = y + (long)t * TW + 4 * j;
            const float vs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (4 * j + i < r) out[i] = accumulate ? vs[i] + out[i] : vs[i];
        }
    }
    if (!hlist) return;

    // The tile of this matrix is complete; the block that completes the
    // tile's second matrix makes h of the tile (swiglu's arithmetic) and
    // down's records of its groups (r is a multiple of 32: down's channels).
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        u32* c = ctr + 2L * n_tiles + t;
        is_last = atomicAdd(c, 1u) == 1u;
        if (is_last) *c = 0u;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int gi = warp; gi < r / ASP_GROUP; gi += NW) {
        const long c = (long)t * TW + gi * ASP_GROUP + lane;
        const float gv = asp_ldcg1(y0 + c), uv = asp_ldcg1(y1 + c);
        const float h = gv / (1.f + expf(-gv)) * uv;
        asp_select_value(h, hthr, (int)(c / ASP_GROUP), hlist, lane, (u8*)hidx[warp], (u8*)hxq[warp]);
    }
}

#ifndef ASP_HOST
// Lists of x for up to three threshold vectors (gridDim.y of them; thr
// null: every channel), one warp per group: grid (ceil(groups / 8), n), 256
// threads; with norm_w (the norm folded in) cols * 4 bytes of dynamic
// shared memory.
extern "C" __global__ void __launch_bounds__(256)
    asp_select(const float* __restrict__ x, int cols, const float* __restrict__ norm_w, float eps, float* norm_out,
               const float* thr0, const float* thr1, const float* thr2, u8* list0, u8* list1, u8* list2) {
    PDL_ENTRY();
    extern __shared__ float asp_xs[];
    __shared__ float s32[32];
    __shared__ __align__(4) u8 sidx[8][ASP_GROUP];
    __shared__ __align__(4) u8 sxq[8][ASP_GROUP];
    asp_select_block(x, cols, norm_w, eps, norm_out, thr0, thr1, thr2, list0, list1, list2, asp_xs, s32, sidx,
                     sxq);
}

#define ASP_MV_PARAMS                                                                                               \
    const u8 *__restrict__ w0, const u8 *__restrict__ w1, const u8 *__restrict__ l0, const u8 *__restrict__ l1, \
        float *y0, float *y1, int rows, int cols, int gpw, int splits, float *part, u32 *ctr,                      \
        const float *__restrict__ hthr, u8 *hlist, int accumulate
#define ASP_MV_ARGS w0, w1, l0, l1, y0, y1, rows, cols, gpw, splits, part, ctr, hthr, hlist, accumulate
// asp_mv_<type>_<serial|pipelined>_c<CH>_w<NW>_t<TW>: grid (tiles *
// splits, matrices), NW * 32 threads, tiles of TW = 512 H outputs.
#define ASP_MV(TYNAME, TY, VARIANT, PIPE, CH, NW, H, TW)                                            \
    extern "C" __global__ void __launch_bounds__(NW * 32, 16 / NW)                                \
        asp_mv_##TYNAME##_##VARIANT##_c##CH##_w##NW##_t##TW(ASP_MV_PARAMS) {                      \
        PDL_ENTRY();                                                                                \
        asp_matvec<TY, NW, CH, PIPE, H>(ASP_MV_ARGS);                                               \
    }
#define ASP_MV_SHAPES(TYNAME, TY, VARIANT, PIPE, CH)    \
    ASP_MV(TYNAME, TY, VARIANT, PIPE, CH, 4, 1, 512)   \
    ASP_MV(TYNAME, TY, VARIANT, PIPE, CH, 8, 1, 512)   \
    ASP_MV(TYNAME, TY, VARIANT, PIPE, CH, 4, 2, 1024)  \
    ASP_MV(TYNAME, TY, VARIANT, PIPE, CH, 8, 2, 1024)  \
    ASP_MV(TYNAME, TY, VARIANT, PIPE, CH, 8, 4, 2048)
ASP_MV_SHAPES(q8_0, ASP_Q8_0, serial, false, 8)
ASP_MV_SHAPES(q8_0, ASP_Q8_0, pipelined, true, 8)
ASP_MV_SHAPES(q4_k, ASP_Q4_K, serial, false, 16)
ASP_MV_SHAPES(q4_k, ASP_Q4_K, pipelined, true, 8)
ASP_MV_SHAPES(q4_1, ASP_Q4_1, serial, false, 16)
ASP_MV_SHAPES(q4_1, ASP_Q4_1, pipelined, true, 8)
ASP_MV_SHAPES(q5_0, ASP_Q5_0, serial, false, 8)
ASP_MV_SHAPES(q5_0, ASP_Q5_0, pipelined, true, 8)
ASP_MV_SHAPES(q6_k, ASP_Q6_K, serial, false, 8)
ASP_MV_SHAPES(q6_k, ASP_Q6_K, pipelined, true, 4)
#endif

#ifndef ASP_HOST
// A prompt batch's input with its inactive channels zeroed (the CPU path
// runs batches as the dense product of that): out[i] = x[i] where
// |x[i]| >= thr[i % width], else 0.
extern "C" __global__ void asp_mask(const float* __restrict__ x, const float* __restrict__ thr, float* __restrict__ out,
                                    int width, long n) {
    PDL_ENTRY();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = fabsf(x[i]) >= thr[i % width] ? x[i] : 0.f;
}
#endif
