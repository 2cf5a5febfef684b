// Host check of cuda/activation_sparse.cu (no GPU): the file included whole,
// every block of a launch run in turn, its threads as fibers (block_emu.h);
// byte permutes, dp4a and the warp ballot emulated per the PTX ISA.
//   1. asp_select's list equals the CPU rule (ActiveChannels::fill in
//      mirage-gguf: channels in order, dx = max |x| / 127, codes rounded
//      half to even and clamped to +-127, padding past the count) for
//      threshold vectors giving 0, ~25, ~50, ~75 and 100 % skipped
//      channels, none (every channel), and a vector where one group alone
//      has active channels;
//   2. the product kernels (the serial and pipelined variants at the
//      device's round sizes and at rounds of 4 channels; tiles of 512, 1024
//      and 2048 outputs; 4 and 8 warps) at
//      several groups per warp (one block per tile, and up to 18 blocks
//      whose partials the last one adds) over matrices packed from random ggml
//      blocks (Q8_0 codes -128..127, Q4_K with random 6-bit scales and mins,
//      Q4_1, Q5_0 and Q6_K with random codes, high bits and Q6_K's int8
//      scales)
//      of row counts that leave a partial last tile (16 rows, and a tile of
//      lanes without outputs), gate and up in one launch with different
//      lists: each output equals an f64 sum over the active channels of
//      ggml's dequantized weight (dequant_unit, ggml.cu) times the list's
//      dx * xq (within f32 rounding), and times x (within the int8 codes'
//      rounding); all channels skipped gives exactly 0; the counters are
//      zero after every launch; and the weight bytes read are exactly those
//      the list needs: every byte of an active channel's run once, the
//      scales of groups with an active channel, nothing else.
//   3. the epilogues: gate and up with down's list of SiLU(gate) * up
//      (records equal the CPU rule on h from the launch's outputs), one
//      matrix accumulating into a residual (bit for bit the plain output
//      plus it), and the list kernel with the RMSNorm folded in (the same
//      records and normed row as norm.cu's row function then the plain
//      list kernel).
// Build and run: hostcheck/run.sh.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "block_emu.h"
#include "ptx_emu.h"

#define ASP_HOST
#define __global__
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
inline u32 asp_prmt(u32 a, u32 b, u32 s) { return sb_prmt(a, b, s); }
inline int asp_dp4a_ss(u32 a, u32 b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(i8)(a >> (8 * i)) * (int)(i8)(b >> (8 * i));
    return c;
}
inline int asp_dp4a_us(u32 a, u32 b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(u8)(a >> (8 * i)) * (int)(i8)(b >> (8 * i));
    return c;
}
inline float asp_h2f(u32 h) { return half_to_float((u16)h); }
// Every lane of the warp deposits its predicate; the warp meets; each reads all.
inline u32 asp_ballot(bool p) {
    const int t = threadIdx.x, w = t >> 5;
    emu::slots[t] = p;
    emu::wait(emu::warp_bars[w]);
    u32 m = 0;
    for (int i = 0; i < 32 && w * 32 + i < (int)blockDim.x; i++)
        if (emu::slots[w * 32 + i]) m |= 1u << i;
    emu::wait(emu::warp_bars[w]);
    return m;
}
inline float4 asp_ldcg4(const float4* p) { return *p; }
inline float asp_ldcg1(const float* p) { return *p; }
// Weight loads counted per byte: the matrices of the launch under test
// (`watch`), a count per byte each.
struct Watched {
    const u8* base;
    size_t n;
    std::vector<int> reads;
};
static std::vector<Watched> watch;
inline void count_read(const u8* p, int n) {
    for (auto& w : watch)
        if (p >= w.base && p + n <= w.base + w.n)
            for (int i = 0; i < n; i++) w.reads[p - w.base + i]++;
}
template <class T> inline T counted_load(const u8* p) {
    count_read(p, sizeof(T));
    T v;
    memcpy(&v, p, sizeof(T));
    return v;
}
inline uint4 asp_ld16(const u8* p) { return counted_load<uint4>(p); }
inline uint2 asp_ld8(const u8* p) { return counted_load<uint2>(p); }
inline u32 asp_ld4(const u8* p) { return counted_load<u32>(p); }
inline u32 asp_ld2(const u8* p) { return counted_load<u16>(p); }
inline int __popc(u32 v) { return __builtin_popcount(v); }
inline int __float2int_rn(float v) { return (int)std::nearbyint(v); }
inline u32 __float_as_uint(float f) {
    u32 u;
    memcpy(&u, &f, 4);
    return u;
}
inline void __trap() { abort(); }
inline u32 atomicAdd(u32* p, u32 v) {
    const u32 old = *p;
    *p = old + v;
    return old;
}
#include "norm.cu"
#include "activation_sparse.cu"

inline u16 ld16(const u8* p) {
    u16 v;
    memcpy(&v, p, 2);
    return v;
}
template <int T> void dequant_unit(const u8* row, int u, float* w);
#include "dequant_extract.h"

static std::mt19937 gen(11);
static int fails = 0;
static double worst_q = 0, worst_x = 0;

static void check(bool ok, const char* what, int a = 0, int b = 0) {
    if (!ok) {
        if (fails < 12) fprintf(stderr, "FAIL: %s (%d, %d)\n", what, a, b);
        fails++;
    }
}

static void launch(dim3_ grid, unsigned threads, const std::function<void()>& f) {
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) run_block(threads, dim3_{x, y, z}, f);
}

// A random normal f16 of magnitude 2^-9 .. 2^-3.
static u16 rand_half() {
    std::uniform_int_distribution<int> e(6, 12), m(0, 1023);
    return (u16)((e(gen) << 10) | m(gen));
}

// Bytes and elements of one ggml block of ty, and where its f16 scales sit.
struct BlockShape {
    int bytes, elems;
    std::vector<int> halves;
};
static BlockShape block_shape(int ty) {
    switch (ty) {
        case ASP_Q8_0: return {34, 32, {0}};
        case ASP_Q5_0: return {22, 32, {0}};
        case ASP_Q4_1: return {20, 32, {0, 2}};
        case ASP_Q4_K: return {144, 256, {0, 2}};
        default: return {210, 256, {208}};  // Q6_K
    }
}

// ggml blocks of a random rows x cols matrix of type ty.
static std::vector<u8> random_ggml(int ty, int rows, int cols) {
    std::uniform_int_distribution<int> byte(0, 255);
    const BlockShape b = block_shape(ty);
    std::vector<u8> v((size_t)rows * (cols / b.elems) * b.bytes);
    for (auto& x : v) x = (u8)byte(gen);
    for (size_t at = 0; at < v.size(); at += b.bytes)
        for (int f : b.halves) {
            const u16 h = rand_half();
            memcpy(&v[at + f], &h, 2);
        }
    return v;
}

// Bytes per output row in the layout, and per channel run (low codes, high
// bits) in a tile of rp outputs.
static long layout_row_bytes(int ty, int cols) {
    switch (ty) {
        case ASP_Q8_0: return cols + cols / 16;
        case ASP_Q4_K: return cols / 2 + cols / 16;
        case ASP_Q4_1: return cols / 2 + cols / 8;
        case ASP_Q5_0: return cols / 2 + cols / 8 + cols / 16;
        default: return cols / 2 + cols / 4 + 9L * cols / 128;
    }
}
static int layout_run(int ty, int rp) { return ty == ASP_Q8_0 ? rp : rp / 2; }
static int layout_hrun(int ty, int rp) { return ty == ASP_Q5_0 ? rp / 8 : ty == ASP_Q6_K ? rp / 4 : 0; }

// The unsigned code of channel c of a Q4_1, Q5_0 or Q6_K row (ggml's bit
// layout).
static int code_of(int ty, const u8* row, int c) {
    if (ty == ASP_Q4_1) {
        const u8* b = row + (size_t)(c / 32) * 20;
        const int j = c % 32;
        return j < 16 ? b[4 + j] & 15 : b[4 + j - 16] >> 4;
    }
    if (ty == ASP_Q5_0) {
        const u8* b = row + (size_t)(c / 32) * 22;
        const int j = c % 32;
        u32 qh;
        memcpy(&qh, b + 2, 4);
        const int nib = j < 16 ? b[6 + j] & 15 : b[6 + j - 16] >> 4;
        return nib | (int)((qh >> j) & 1) << 4;
    }
    const u8* b = row + (size_t)(c / 256) * 210;
    const int e = c % 256, h = e / 128, k = (e % 128) / 32, l = e % 32;
    const int nib = (b[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 15;
    const int hb = (b[128 + 32 * h + l] >> (2 * k)) & 3;
    return nib | hb << 4;
}

// The layout of activation_sparse.cu's head for tiles of tw outputs,
// element by element.
static std::vector<u8> pack(int ty, const std::vector<u8>& src, int rows, int cols, int tw) {
    const long row_bytes = layout_row_bytes(ty, cols);
    const BlockShape bsh = block_shape(ty);
    const size_t src_row = (size_t)(cols / bsh.elems) * bsh.bytes;
    const int n_tiles = (rows + tw - 1) / tw;
    const int rp_total = (rows + 15) / 16 * 16;
    std::vector<u8> out((size_t)rp_total * row_bytes, 0);
    for (int t = 0; t < n_tiles; t++) {
        const int r = std::min(tw, rows - tw * t), rp = (r + 15) / 16 * 16;
        const int run = layout_run(ty, rp), hrun = layout_hrun(ty, rp);
        u8* base = out.data() + (size_t)t * tw * row_bytes;
        u8* hbase = base + (size_t)cols * run;
        u8* sc = hbase + (size_t)cols * hrun;
        for (int o = 0; o < r; o++) {
            const int row = tw * t + o;
            const int l = o / 16, k = o % 16;
            if (ty == ASP_Q8_0) {
                for (int c = 0; c < cols; c++) {
                    const u8* blk = &src[((size_t)row * (cols / 32) + c / 32) * 34];
                    base[(size_t)c * run + o] = blk[2 + c % 32];
                    if (c % 32 == 0) memcpy(sc + (size_t)(c / 32) * 2 * rp + 2 * o, blk, 2);
                }
            } else if (ty == ASP_Q4_1 || ty == ASP_Q5_0 || ty == ASP_Q6_K) {
                const u8* srow = &src[(size_t)row * src_row];
                for (int c = 0; c < cols; c++) {
                    const int q = code_of(ty, srow, c);
                    base[(size_t)c * run + 8 * l + k % 8] |= (u8)(k >= 8 ? (q & 15) << 4 : q & 15);
                    // output 16 l + 4 i + m
                    const int i = k / 4, m = k % 4;
                    u8* hb = hbase + (size_t)c * hrun;
                    if (ty == ASP_Q4_1) {
                    } else if (ty == ASP_Q5_0) {
                        const int bit = 4 * m + i;
                        hb[2 * l + bit / 8] |= (u8)(((q >> 4) & 1) << (bit % 8));
                    } else {
                        hb[4 * l + m] |= (u8)(((q >> 4) & 3) << (2 * i));
                    }
                }
                if (ty == ASP_Q4_1) {
                    for (int g = 0; g < cols / 32; g++) memcpy(sc + (size_t)g * 4 * rp + 4 * o, srow + g * 20, 4);
                } else if (ty == ASP_Q5_0) {
                    for (int g = 0; g < cols / 32; g++) memcpy(sc + (size_t)g * 2 * rp + 2 * o, srow + g * 22, 2);
                } else {
                    for (int s = 0; s < cols / 256; s++) {
                        const u8* blk = srow + (size_t)s * 210;
                        u8* sp = sc + (size_t)s * 18 * rp;
                        memcpy(sp + 2 * o, blk + 208, 2);
                        for (int j = 0; j < 8; j++) memcpy(sp + (size_t)(1 + j) * 2 * rp + 2 * o, blk + 192 + 2 * j, 2);
                    }
                }
            } else {
                for (int c = 0; c < cols; c++) {
                    const u8* blk = &src[((size_t)row * (cols / 256) + c / 256) * 144];
                    const int e = c % 256;
                    const u8 qb = blk[16 + 32 * (e / 64) + e % 32];
                    const int q = (e % 64) >= 32 ? qb >> 4 : qb & 15;
                    const int l = o / 16, k = o % 16;
                    u8& dst = base[(size_t)c * run + 8 * l + k % 8];
                    dst |= (u8)(k >= 8 ? q << 4 : q);
                }
                for (int s = 0; s < cols / 256; s++) {
                    const u8* blk = &src[((size_t)row * (cols / 256) + s) * 144];
                    u8* sp = sc + (size_t)s * 16 * rp;
                    memcpy(sp + 4 * o, blk, 4);  // d, dmin
                    int scj[8], mj[8];
                    const u8* q = blk + 4;
                    for (int j = 0; j < 8; j++) {
                        if (j < 4) {
                            scj[j] = q[j] & 63;
                            mj[j] = q[j + 4] & 63;
                        } else {
                            scj[j] = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
                            mj[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
                        }
                    }
                    for (int j = 0; j < 8; j++) sp[(4 + j) * rp + o] = (u8)((scj[j] & 15) | ((mj[j] & 15) << 4));
                    for (int k = 0; k < 4; k++)
                        sp[(12 + k) * rp + o] = (u8)((scj[2 * k] >> 4) | ((mj[2 * k] >> 4) << 2) |
                                                     ((scj[2 * k + 1] >> 4) << 4) | ((mj[2 * k + 1] >> 4) << 6));
                }
            }
        }
    }
    return out;
}

// Bytes a product over `list` must read of a matrix in the layout: 1 for
// the runs of active channels (read exactly once), 2 for the scales of
// groups with an active channel (read at least once), 0 for all others
// (never read).
static std::vector<u8> needed(int ty, int rows, int cols, const std::vector<u8>& list, int tw) {
    const long row_bytes = layout_row_bytes(ty, cols);
    const int n_tiles = (rows + tw - 1) / tw;
    std::vector<u8> need((size_t)((rows + 15) / 16 * 16) * row_bytes, 0);
    for (int t = 0; t < n_tiles; t++) {
        const int r = std::min(tw, rows - tw * t), rp = (r + 15) / 16 * 16;
        const int run = layout_run(ty, rp), hrun = layout_hrun(ty, rp);
        const size_t base = (size_t)t * tw * row_bytes, hbase = base + (size_t)cols * run;
        const size_t sc = hbase + (size_t)cols * hrun;
        for (int g = 0; g < cols / 32; g++) {
            const u32* rec = (const u32*)&list[(size_t)g * 128];
            const u8* idx = (const u8*)&rec[4];
            for (u32 i = 0; i < rec[0]; i++) {
                memset(&need[base + (size_t)(32 * g + idx[i]) * run], 1, run);
                if (hrun) memset(&need[hbase + (size_t)(32 * g + idx[i]) * hrun], 1, hrun);
            }
            if (rec[0] == 0) continue;
            if (ty == ASP_Q8_0 || ty == ASP_Q5_0) {
                memset(&need[sc + (size_t)g * 2 * rp], 2, 2 * rp);
            } else if (ty == ASP_Q4_1) {
                memset(&need[sc + (size_t)g * 4 * rp], 2, 4 * rp);
            } else if (ty == ASP_Q6_K) {
                const size_t s = sc + (size_t)(g / 8) * 18 * rp;
                memset(&need[s], 2, 2 * rp);
                memset(&need[s + (size_t)(1 + g % 8) * 2 * rp], 2, 2 * rp);
            } else {
                const size_t s = sc + (size_t)(g / 8) * 16 * rp;
                memset(&need[s], 2, 4 * rp);
                memset(&need[s + (4 + g % 8) * rp], 2, rp);
                memset(&need[s + (12 + g % 8 / 2) * rp], 2, rp);
            }
        }
    }
    return need;
}

// The CPU rule for one group (ActiveChannels::fill), and the record it makes.
static std::vector<u32> cpu_record(const float* x, const float* thr, int g) {
    std::vector<u32> rec(32, 0);
    u8 idx[32], xq[32];
    float val[32];
    int k = 0;
    float amax = 0;
    for (int j = 0; j < 32; j++) {
        const float v = x[32 * g + j];
        const bool on = thr ? std::fabs(v) >= thr[32 * g + j] : true;
        if (on) {
            idx[k] = (u8)j;
            val[k++] = v;
            amax = std::max(amax, std::fabs(v));
        }
    }
    const float dx = amax / 127.f, id = amax > 0 ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        if (j < k) {
            // round_i8: the f32 magic-number rounding (half to even), clamped.
            const float m = val[j] * id + 12582912.0f;
            u32 bits;
            memcpy(&bits, &m, 4);
            const int q = std::clamp((int)bits - 0x4B400000, -127, 127);
            xq[j] = (u8)(i8)q;
            sum += q;
        } else {
            idx[j] = 255;
            xq[j] = 0;
        }
    }
    rec[0] = (u32)k;
    memcpy(&rec[1], &dx, 4);
    const float dxs = dx * (float)sum;
    memcpy(&rec[2], &dxs, 4);
    memcpy(&rec[4], idx, 32);
    memcpy(&rec[12], xq, 32);
    return rec;
}

static std::vector<u8> run_select(const std::vector<float>& x, const float* thr) {
    const int cols = (int)x.size(), G = cols / 32;
    std::vector<u8> list((size_t)G * 128, 0xcd);
    launch(dim3_{(unsigned)((G + 7) / 8), 1, 1}, 256, [&] {
        alignas(4) static u8 sidx[8][32], sxq[8][32];
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int g = blockIdx.x * 8 + warp;
        if (g >= G) return;
        asp_select_group(x.data(), thr, g, list.data(), lane, sidx[warp], sxq[warp]);
    });
    for (int g = 0; g < G; g++) {
        const std::vector<u32> want = cpu_record(x.data(), thr, g);
        check(memcmp(want.data(), &list[(size_t)g * 128], 128) == 0, "list record", g, cols);
    }
    return list;
}

// f64 products over the active channels: with the list's dx * xq (q) and
// with x itself.
static void reference(int ty, const std::vector<u8>& src, int rows, int cols, const std::vector<float>& x,
                      const std::vector<u8>& list, std::vector<double>& ref_q, std::vector<double>& ref_x) {
    const int units = cols / 32;
    const BlockShape bsh = block_shape(ty);
    const size_t row_bytes = (size_t)(cols / bsh.elems) * bsh.bytes;
    ref_q.assign(rows, 0);
    ref_x.assign(rows, 0);
    for (int o = 0; o < rows; o++) {
        const u8* row = &src[o * row_bytes];
        for (int u = 0; u < units; u++) {
            const u32* rec = (const u32*)&list[(size_t)u * 128];
            const int k = (int)rec[0];
            if (k == 0) continue;
            float w[32];
            if (ty == ASP_Q8_0)
                dequant_unit<TY_Q8_0>(row, u, w);
            else if (ty == ASP_Q4_K)
                dequant_unit<TY_Q4_K>(row, u, w);
            else if (ty == ASP_Q5_0)
                dequant_unit<TY_Q5_0>(row, u, w);
            else if (ty == ASP_Q4_1)
                dequant_unit<TY_Q4_1>(row, u, w);
            else
                dequant_unit<TY_Q6_K>(row, u, w);
            float dx;
            memcpy(&dx, &rec[1], 4);
            const u8* idx = (const u8*)&rec[4];
            const i8* xq = (const i8*)&rec[12];
            for (int i = 0; i < k; i++) {
                const int c = idx[i];
                ref_q[o] += (double)w[c] * ((double)dx * xq[i]);
                ref_x[o] += (double)w[c] * x[32 * u + c];
            }
        }
    }
}

typedef void (*MatVec)(const u8*, const u8*, const u8*, const u8*, float*, float*, int, int, int, int, float*,
                       u32*, const float*, u8*, int);
struct Kernel {
    const char* name;
    int ty, nw, h;
    MatVec f;
};
template <int TY, int NW, int CH, bool PIPE, int H>
static void body(const u8* w0, const u8* w1, const u8* l0, const u8* l1, float* y0, float* y1, int rows, int cols,
                 int gpw, int splits, float* part, u32* ctr, const float* hthr, u8* hlist, int accumulate) {
    asp_matvec<TY, NW, CH, PIPE, H>(w0, w1, l0, l1, y0, y1, rows, cols, gpw, splits, part, ctr, hthr, hlist,
                                    accumulate);
}
// The device's round sizes at every block shape, and rounds of 4 channels.
static const Kernel KERNELS[] = {
    {"q8_0 serial c8 w4 t512", ASP_Q8_0, 4, 1, body<ASP_Q8_0, 4, 8, false, 1>},
    {"q8_0 serial c8 w8 t1024", ASP_Q8_0, 8, 2, body<ASP_Q8_0, 8, 8, false, 2>},
    {"q8_0 pipelined c8 w8 t512", ASP_Q8_0, 8, 1, body<ASP_Q8_0, 8, 8, true, 1>},
    {"q8_0 pipelined c8 w4 t1024", ASP_Q8_0, 4, 2, body<ASP_Q8_0, 4, 8, true, 2>},
    {"q8_0 pipelined c8 w8 t2048", ASP_Q8_0, 8, 4, body<ASP_Q8_0, 8, 8, true, 4>},
    {"q8_0 serial c4 w8 t2048", ASP_Q8_0, 8, 4, body<ASP_Q8_0, 8, 4, false, 4>},
    {"q8_0 pipelined c4 w4 t512", ASP_Q8_0, 4, 1, body<ASP_Q8_0, 4, 4, true, 1>},
    {"q4_k serial c16 w8 t512", ASP_Q4_K, 8, 1, body<ASP_Q4_K, 8, 16, false, 1>},
    {"q4_k serial c16 w4 t1024", ASP_Q4_K, 4, 2, body<ASP_Q4_K, 4, 16, false, 2>},
    {"q4_k serial c16 w8 t2048", ASP_Q4_K, 8, 4, body<ASP_Q4_K, 8, 16, false, 4>},
    {"q4_k pipelined c8 w4 t512", ASP_Q4_K, 4, 1, body<ASP_Q4_K, 4, 8, true, 1>},
    {"q4_k pipelined c8 w8 t1024", ASP_Q4_K, 8, 2, body<ASP_Q4_K, 8, 8, true, 2>},
    {"q4_k serial c4 w4 t512", ASP_Q4_K, 4, 1, body<ASP_Q4_K, 4, 4, false, 1>},
    {"q4_k pipelined c4 w8 t2048", ASP_Q4_K, 8, 4, body<ASP_Q4_K, 8, 4, true, 4>},
    {"q4_1 pipelined c8 w8 t512", ASP_Q4_1, 8, 1, body<ASP_Q4_1, 8, 8, true, 1>},
    {"q4_1 serial c16 w4 t1024", ASP_Q4_1, 4, 2, body<ASP_Q4_1, 4, 16, false, 2>},
    {"q4_1 pipelined c8 w8 t2048", ASP_Q4_1, 8, 4, body<ASP_Q4_1, 8, 8, true, 4>},
    {"q4_1 serial c4 w4 t512", ASP_Q4_1, 4, 1, body<ASP_Q4_1, 4, 4, false, 1>},
    {"q5_0 pipelined c8 w8 t512", ASP_Q5_0, 8, 1, body<ASP_Q5_0, 8, 8, true, 1>},
    {"q5_0 serial c8 w4 t1024", ASP_Q5_0, 4, 2, body<ASP_Q5_0, 4, 8, false, 2>},
    {"q5_0 pipelined c8 w8 t2048", ASP_Q5_0, 8, 4, body<ASP_Q5_0, 8, 8, true, 4>},
    {"q5_0 pipelined c4 w4 t512", ASP_Q5_0, 4, 1, body<ASP_Q5_0, 4, 4, true, 1>},
    {"q6_k pipelined c4 w8 t512", ASP_Q6_K, 8, 1, body<ASP_Q6_K, 8, 4, true, 1>},
    {"q6_k serial c8 w4 t1024", ASP_Q6_K, 4, 2, body<ASP_Q6_K, 4, 8, false, 2>},
    {"q6_k pipelined c4 w8 t2048", ASP_Q6_K, 8, 4, body<ASP_Q6_K, 8, 4, true, 4>},
    {"q6_k serial c4 w4 t512", ASP_Q6_K, 4, 1, body<ASP_Q6_K, 4, 4, false, 1>},
};

// Thresholds skipping about `share` of x's channels (1: all; < 0: a null
// vector, every channel), or keeping only group `only`'s.
static std::vector<float> thresholds(const std::vector<float>& x, double share, int only = -1) {
    std::vector<float> t(x.size());
    if (only >= 0) {
        for (size_t c = 0; c < x.size(); c++) t[c] = (int)(c / 32) == only ? 0.f : INFINITY;
        return t;
    }
    if (share >= 1) return std::vector<float>(x.size(), INFINITY);
    std::vector<float> a(x.size());
    for (size_t c = 0; c < x.size(); c++) a[c] = std::fabs(x[c]);
    std::sort(a.begin(), a.end());
    const float cut = share <= 0 ? 0.f : a[(size_t)(share * (a.size() - 1))];
    // Per-channel thresholds around the cut.
    std::uniform_real_distribution<float> jitter(0.8f, 1.2f);
    for (auto& v : t) v = cut * jitter(gen);
    return t;
}

// every: every kernel at every group count; else the first two kernels of
// the type at one group a warp (many blocks a tile).
static void run_shape(int ty, int rows, int cols, bool every = true) {
    std::normal_distribution<float> N(0, 1);
    const auto src0 = random_ggml(ty, rows, cols), src1 = random_ggml(ty, rows, cols);
    std::vector<u8> packed[3][2];  // tiles of 512, 1024, 2048
    for (int h = 0; h < 3; h++)
        for (int m = 0; m < 2; m++) packed[h][m] = pack(ty, m ? src1 : src0, rows, cols, 512 << h);
    std::vector<float> x(cols);
    for (auto& v : x) v = N(gen);
    x[3] = 0.f;
    const int G = cols / 32;
    struct Case {
        double share0, share1;
        int only;
    };
    const Case cases[] = {{-1, 0, -1}, {0.25, 0.5, -1}, {0.75, 0.5, -1}, {1, 1, -1}, {0, 0, G - 1}};
    for (const Case& cs : cases) {
        const auto t0 = thresholds(x, cs.share0, cs.only), t1 = thresholds(x, cs.share1, cs.only);
        const auto l0 = run_select(x, cs.share0 < 0 ? nullptr : t0.data());
        const auto l1 = run_select(x, t1.data());
        std::vector<double> rq0, rx0, rq1, rx1;
        reference(ty, src0, rows, cols, x, l0, rq0, rx0);
        reference(ty, src1, rows, cols, x, l1, rq1, rx1);
        double scale0 = 0, scale1 = 0;
        for (int o = 0; o < rows; o++) scale0 = std::max(scale0, std::fabs(rq0[o]));
        for (int o = 0; o < rows; o++) scale1 = std::max(scale1, std::fabs(rq1[o]));
        const bool none = cs.share0 >= 1;
        int tried = 0;
        for (const Kernel& k : KERNELS) {
            if (k.ty != ty || (!every && tried == 2)) continue;
            tried++;
            const int tw = 512 * k.h, hi = k.h == 1 ? 0 : k.h == 2 ? 1 : 2, ns = k.nw / k.h;
            const int n_tiles = (rows + tw - 1) / tw;
            const auto& w0 = packed[hi][0];
            const auto& w1 = packed[hi][1];
            const auto need0 = needed(ty, rows, cols, l0, tw), need1 = needed(ty, rows, cols, l1, tw);
            // One group a warp (many blocks a tile), 3 (the last warp's
            // range cut short), the most a block stages (one or two blocks).
            for (int gpw : {1, 3, 64 / ns}) {
                if ((gpw == 3 && k.h != 2) || (!every && gpw != 1)) continue;
                const int splits = (G + ns * gpw - 1) / (ns * gpw);
                std::vector<float> y0(rows, NAN), y1(rows, NAN);
                std::vector<float> part((size_t)2 * splits * n_tiles * tw, NAN);
                std::vector<u32> ctr(2 * n_tiles, 0);
                watch = {{w0.data(), w0.size(), std::vector<int>(w0.size(), 0)},
                         {w1.data(), w1.size(), std::vector<int>(w1.size(), 0)}};
                launch(dim3_{(unsigned)(n_tiles * splits), 2, 1}, 32 * k.nw, [&] {
                    k.f(w0.data(), w1.data(), l0.data(), l1.data(), y0.data(), y1.data(), rows, cols, gpw, splits,
                        splits > 1 ? part.data() : nullptr, ctr.data(), nullptr, nullptr, 0);
                });
                for (u32 c : ctr) check(c == 0, "counter left non-zero", gpw, splits);
                for (int m = 0; m < 2; m++) {
                    const auto& need = m ? need1 : need0;
                    const auto& reads = watch[m].reads;
                    long bad = 0;
                    for (size_t i = 0; i < need.size(); i++)
                        bad += need[i] == 0 ? reads[i] != 0 : need[i] == 1 ? reads[i] != 1 : reads[i] < 1;
                    if (bad) {
                        fprintf(stderr, "FAIL: %s rows %d cols %d shares %.2f/%.2f gpw %d: %ld bytes read wrongly\n",
                                k.name, rows, cols, cs.share0, cs.share1, gpw, bad);
                        fails++;
                    }
                }
                watch.clear();
                double eq = 0, ex = 0;
                for (int o = 0; o < rows; o++) {
                    if (none) check(y0[o] == 0.f && y1[o] == 0.f, "all skipped: not zero", o, gpw);
                    eq = std::max(eq, std::fabs(y0[o] - rq0[o]) / std::max(scale0, 1e-30));
                    eq = std::max(eq, std::fabs(y1[o] - rq1[o]) / std::max(scale1, 1e-30));
                    ex = std::max(ex, std::fabs(y0[o] - rx0[o]) / std::max(scale0, 1e-30));
                    ex = std::max(ex, std::fabs(y1[o] - rx1[o]) / std::max(scale1, 1e-30));
                    if (std::isnan(y0[o]) || std::isnan(y1[o])) eq = INFINITY;
                }
                worst_q = std::max(worst_q, eq);
                worst_x = std::max(worst_x, ex);
                if (eq > 2e-6 || ex > 2e-2) {
                    fprintf(stderr, "FAIL: %s rows %d cols %d shares %.2f/%.2f gpw %d splits %d: error %.3g (codes) %.3g (x)\n",
                            k.name, rows, cols, cs.share0, cs.share1, gpw, splits, eq, ex);
                    fails++;
                }
            }
        }
    }
}

// The epilogues, per kernel and at one group a warp (many blocks a tile) and
// the most a block stages: (1) gate and up with down's list of h =
// SiLU(gate) * up: every record equals the CPU rule on h computed from the
// launch's own outputs (rows a multiple of 32, as down's channels are), the
// outputs themselves unchanged by it, counters left zero; (2) one matrix
// with accumulate: y = (the plain launch's output) + y, bit for bit.
static void run_epilogues(int ty, int rows, int cols) {
    std::normal_distribution<float> N(0, 1);
    const auto src0 = random_ggml(ty, rows, cols), src1 = random_ggml(ty, rows, cols);
    std::vector<float> x(cols);
    for (auto& v : x) v = N(gen);
    const auto t0 = thresholds(x, 0.4), t1 = thresholds(x, 0.6);
    const auto l0 = run_select(x, t0.data()), l1 = run_select(x, t1.data());
    const int G = cols / 32;
    for (const Kernel& k : KERNELS) {
        if (k.ty != ty) continue;
        const int tw = 512 * k.h, ns = k.nw / k.h, n_tiles = (rows + tw - 1) / tw;
        const auto w0 = pack(ty, src0, rows, cols, tw), w1 = pack(ty, src1, rows, cols, tw);
        for (int gpw : {1, 64 / ns}) {
            const int splits = (G + ns * gpw - 1) / (ns * gpw);
            std::vector<float> part((size_t)2 * splits * n_tiles * tw, NAN);
            std::vector<u32> ctr(3 * n_tiles, 0);
            auto run = [&](int mats, float* y0, float* y1, const float* hthr, u8* hlist, int acc) {
                launch(dim3_{(unsigned)(n_tiles * splits), (unsigned)mats, 1}, 32 * k.nw, [&] {
                    k.f(w0.data(), w1.data(), l0.data(), l1.data(), y0, y1, rows, cols, gpw, splits,
                        splits > 1 ? part.data() : nullptr, ctr.data(), hthr, hlist, acc);
                });
                for (u32 c : ctr) check(c == 0, "counter left non-zero", gpw, splits);
            };
            // Plain outputs, then the same launch with the SwiGLU epilogue.
            std::vector<float> g(rows, NAN), u(rows, NAN), g2(rows, NAN), u2(rows, NAN);
            run(2, g.data(), u.data(), nullptr, nullptr, 0);
            std::vector<float> h(rows);
            for (int o = 0; o < rows; o++) h[o] = g[o] / (1.f + expf(-g[o])) * u[o];
            for (int every = 0; every < 2; every++) {
                const auto th = thresholds(h, 0.5);
                const float* hthr = every ? nullptr : th.data();
                std::vector<u8> hlist((size_t)rows / 32 * 128, 0xcd);
                run(2, g2.data(), u2.data(), hthr, hlist.data(), 0);
                check(memcmp(g.data(), g2.data(), 4 * rows) == 0 && memcmp(u.data(), u2.data(), 4 * rows) == 0,
                      "outputs changed by the SwiGLU epilogue", gpw, splits);
                for (int gi = 0; gi < rows / 32; gi++) {
                    const auto want = cpu_record(h.data(), hthr, gi);
                    check(memcmp(want.data(), &hlist[(size_t)gi * 128], 128) == 0, "h record", gi, gpw);
                }
            }
            // One matrix, accumulating into a residual.
            std::vector<float> res(rows), y(rows);
            for (auto& v : res) v = N(gen);
            y = res;
            run(1, y.data(), nullptr, nullptr, nullptr, 1);
            for (int o = 0; o < rows; o++) check(y[o] == g[o] + res[o], "accumulate", o, gpw);
        }
    }
}

// asp_select_block with the norm folded in against the norm kernel's row
// (rms_norm_row by 256 threads) then the plain select: the same records,
// and the normed row written by block (0, 0).
static void run_norm_select(int cols) {
    std::normal_distribution<float> N(0, 1);
    std::vector<float> x(cols), w(cols), normed(cols), out(cols, NAN);
    for (auto& v : x) v = 3.f * N(gen);
    for (auto& v : w) v = 1.f + 0.2f * N(gen);
    const float eps = 1e-6f;
    launch(dim3_{1, 1, 1}, 256, [&] {
        static float s32[32];
        rms_norm_row(x.data(), w.data(), eps, cols, s32, [&](int i, float v) { normed[i] = v; });
    });
    const auto ta = thresholds(normed, 0.3), tb = thresholds(normed, 0.7);
    const int G = cols / 32;
    std::vector<u8> fa((size_t)G * 128, 0xcd), fb = fa, pa = fa, pb = fa;
    for (int fold = 0; fold < 2; fold++) {
        launch(dim3_{(unsigned)((G + 7) / 8), 2, 1}, 256, [&] {
            static std::vector<float> xs;
            static float s32[32];
            alignas(4) static u8 sidx[8][32], sxq[8][32];
            xs.resize(cols);
            if (fold)
                asp_select_block(x.data(), cols, w.data(), eps, out.data(), ta.data(), tb.data(), nullptr, fa.data(),
                                 fb.data(), nullptr, xs.data(), s32, sidx, sxq);
            else
                asp_select_block(normed.data(), cols, nullptr, 0.f, nullptr, ta.data(), tb.data(), nullptr,
                                 pa.data(), pb.data(), nullptr, xs.data(), s32, sidx, sxq);
        });
    }
    check(fa == pa && fb == pb, "folded-norm select records", cols);
    check(memcmp(out.data(), normed.data(), 4 * cols) == 0, "folded norm's output row", cols);
}

int main() {
    run_shape(ASP_Q8_0, 2100, 96);   // tiles of 512 x 4 + 52, 1024 x 2 + 52, 2048 + 52
    run_shape(ASP_Q8_0, 528, 224);   // 7 groups
    run_shape(ASP_Q8_0, 72, 96);     // one tile, lanes 5.. without outputs
    run_shape(ASP_Q4_K, 1040, 512);  // tiles of 512 x 2 + 16, 1024 + 16, 1040; 2 super-blocks
    run_shape(ASP_Q4_K, 200, 768);   // one tile of 208 padded outputs
    run_shape(ASP_Q8_0, 40, 2240, false);  // 70 groups: 18 blocks a tile at 4 warps of one group
    run_shape(ASP_Q4_K, 24, 2304, false);  // 72 groups
    run_epilogues(ASP_Q8_0, 1056, 320);    // tiles of 512 x 2 + 32; 10 groups
    run_epilogues(ASP_Q4_K, 544, 512);     // tiles of 512 + 32; 2 super-blocks
    run_shape(ASP_Q4_1, 2100, 96);
    run_shape(ASP_Q4_1, 72, 224);
    run_shape(ASP_Q4_1, 40, 2240, false);
    run_epilogues(ASP_Q4_1, 1056, 320);
    run_shape(ASP_Q5_0, 2100, 96);
    run_shape(ASP_Q5_0, 72, 224);
    run_shape(ASP_Q6_K, 1040, 512);
    run_shape(ASP_Q6_K, 200, 768);
    run_shape(ASP_Q5_0, 40, 2240, false);
    run_shape(ASP_Q6_K, 24, 2304, false);
    run_epilogues(ASP_Q5_0, 1056, 320);
    run_epilogues(ASP_Q6_K, 544, 512);
    run_norm_select(896);                  // 28 groups: 4 blocks of 8 warps
    run_norm_select(200 * 32 + 96);        // not a whole round of float4s per thread
    printf("activation-sparse products: lists equal the CPU rule, worst error %.3g (list codes) %.3g (x); "
           "SwiGLU lists, residual add and folded norm exact: %s\n",
           worst_q, worst_x, fails ? "FAILED" : "ok");
    return fails ? 1 : 0;
}
