// MIRAGE CUDA kernels: activation-sparse mat-vecs over channel-major
// matrices (the activation module; crates/mirage-cuda/src/activation.rs).
//
// A channel-major matrix (mirage_gguf::quant::channel_major; the layout is
// documented there and not repeated) stores, per tile of at most 2048
// outputs, the codes one input channel multiplies as one contiguous run,
// and per (output, scale group of 16 or 32 channels) an affine map
// w = a * q + c. One decode row's product over the channels that pass the
// matrix's per-channel thresholds (|x_i| >= thr_i; the CPU path's rule)
// is, per output j:
//   y_j = sum over groups g of (a_jg * acc_jg + c_jg * S_g),
//   acc_jg = sum over active i in g of x_i * q_ji,  S_g = sum of those x_i
// (types whose c is a multiple of a fold it into the code instead, which
// keeps the sum free of cancellation: Q4_0, Q5_0, Q8_0, Q6_K).
//
// One launch: grid (tiles, splits, matrices). A block owns one tile of one
// matrix and one range of scale groups; it
//   1. scores its channels (x, or silu(gate) * up for the down projection,
//      against the thresholds) and compacts the active ones per group into
//      shared memory: a warp ballot per 32 channels and a popcount prefix
//      give each active channel its slot (no host round trip, no global
//      list: the count per group is what the loop below reads);
//   2. streams the runs of the active channels: thread u owns base-plane
//      bytes [u * bw, (u + 1) * bw) of every run (bw = 4, or 8 for 8-bit
//      codes: always 8 outputs), so a warp reads 128 or 256 contiguous
//      bytes per channel, four channels in flight per thread; at the end
//      of each group it applies the group's scales to its 8 outputs;
//   3. writes its partial outputs; the last block of the tile to finish
//      (an atomic counter, reset by that block) adds the splits' partials
//      in split order (deterministic) and writes y.
// Every offset below is the layout's (ChannelMajorLayout::record_offset,
// channel_offset, code_position); the host check
// (crates/mirage-cuda/hostcheck/check_activation.cpp) holds the kernel to a
// scalar reference over that layout.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Outputs per code block (ChannelMajorLayout's BLOCK).
#define ACT_BLOCK 128
// Most channels one block scores (its shared-memory list).
#define ACT_MAX_CH 2048
// Active channels streamed per step of a thread (loads in flight).
#define ACT_UNROLL 4

#ifndef ACT_HOST
__device__ __forceinline__ float act_h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u32 act_ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
__device__ __forceinline__ float act_ldcg(const float* p) { return __ldcg(p); }
#endif

// The source types by ggml id, and what the kernels need of each: channels
// per scale group and per super-block, bits per code, bytes per output of a
// scale record and of a super-block header (channel_major.rs's `scheme`).
template <int TY> struct CmType;
#define ACT_TYPE(T, ID, GROUP, SB, BITS, REC, HDR) \
    template <> struct CmType<ID> {               \
        enum { group = GROUP, sb = SB, bits = BITS, rec = REC, hdr = HDR }; \
    };
ACT_TYPE(Q4_0, 2, 32, 32, 4, 2, 0)
ACT_TYPE(Q4_1, 3, 32, 32, 4, 4, 0)
ACT_TYPE(Q5_0, 6, 32, 32, 5, 2, 0)
ACT_TYPE(Q5_1, 7, 32, 32, 5, 4, 0)
ACT_TYPE(Q8_0, 8, 32, 32, 8, 2, 0)
ACT_TYPE(Q4_K, 12, 32, 256, 4, 2, 4)
ACT_TYPE(Q5_K, 13, 32, 256, 5, 2, 4)
ACT_TYPE(Q6_K, 14, 16, 256, 6, 1, 2)

// Byte offsets of one matrix's layout (channel_major.rs's ChannelMajorLayout).
template <int TY> struct CmLayout {
    typedef CmType<TY> S;
    int rows, cols, tile;
    __device__ __forceinline__ int tile_rows(int t) const { return min(tile, rows - t * tile); }
    __device__ __forceinline__ static long run_bytes(int r) { return (long)r * S::bits / 8; }
    __device__ __forceinline__ static long rec_bytes(int r) { return (long)r * S::rec; }
    __device__ __forceinline__ static long hdr_bytes(int r) { return (long)r * S::hdr; }
    __device__ __forceinline__ static long group_bytes(int r) { return rec_bytes(r) + S::group * run_bytes(r); }
    __device__ __forceinline__ static long sb_bytes(int r) {
        return hdr_bytes(r) + (S::sb / S::group) * group_bytes(r);
    }
    __device__ __forceinline__ long tile_offset(int t) const { return (long)t * (cols / S::sb) * sb_bytes(tile); }
    __device__ __forceinline__ long header_offset(int t, int sb) const {
        return tile_offset(t) + (long)sb * sb_bytes(tile_rows(t));
    }
    __device__ __forceinline__ long record_offset(int t, int g) const {
        const int gps = S::sb / S::group;
        const int r = tile_rows(t);
        return header_offset(t, g / gps) + hdr_bytes(r) + (long)(g % gps) * group_bytes(r);
    }
};

// Output (within a tile of r outputs) of base-plane byte `at` of a run,
// low (z = 0) or high (z = 1) nibble; 8-bit codes: the output of byte `at`
// (z unused). The inverse of code_position's first half.
template <int BITS> __device__ __forceinline__ int act_output_of(int r, int at, int z) {
    int b, k, w, zz;
    if (BITS == 8) {
        b = at / ACT_BLOCK;
        w = min(ACT_BLOCK, r - b * ACT_BLOCK);
        const int rem = at % ACT_BLOCK;
        zz = rem / (w / 2);
        k = rem % (w / 2);
    } else {
        b = at / (ACT_BLOCK / 2);
        w = min(ACT_BLOCK, r - b * ACT_BLOCK);
        k = at % (ACT_BLOCK / 2);
        zz = z;
    }
    const int nl = w / 32;
    const int l = k / 16, q = (k % 16) / 4, m = k % 4;
    return b * ACT_BLOCK + zz * (w / 2) + q * (4 * nl) + 4 * l + m;
}

// Byte and bit of the high bits of output o (5- and 6-bit codes), in a run
// of a tile of r outputs: code_position's second half.
template <int BITS> __device__ __forceinline__ void act_high_of(int r, int o, int* byte, int* shift) {
    const int b = o / ACT_BLOCK, ob = o % ACT_BLOCK;
    if (BITS == 5) {
        *byte = r / 2 + 16 * b + ob % 16;
        *shift = ob / 16;
    } else {
        const int v = ob / 16, lane = ob % 16;
        const int i = v / 4, f = v % 4;
        const int h = lane / 8, l2 = (lane % 8) / 4, m2 = lane % 4;
        *byte = r / 2 + 32 * b + 16 * l2 + 8 * i + 4 * h + m2;
        *shift = 2 * f;
    }
}

// Per (output, group): w = a * q + c with q the code as the loop
// accumulates it (offset types and Q6_K: the signed code, c = 0).
template <int TY> struct CmScale {
    // Offset subtracted from the code before it is accumulated.
    enum { off = TY == 2 ? 8 : TY == 6 ? 16 : TY == 8 ? 128 : TY == 14 ? 32 : 0 };
    // Whether the group's input sum S enters (c != 0).
    enum { has_min = TY == 3 || TY == 7 || TY == 12 || TY == 13 };
    // a and c of 4 consecutive outputs p .. p + 3 (p a multiple of 4) of
    // group record `rec`, super-block header `hdr`, tile of r outputs.
    __device__ __forceinline__ static void quad(const u8* rec, const u8* hdr, int r, int p, float a[4], float c[4]) {
        if (TY == 2 || TY == 6 || TY == 8) {
            const uint2 d = *(const uint2*)(rec + 2 * p);
            a[0] = act_h2f((u16)d.x), a[1] = act_h2f((u16)(d.x >> 16));
            a[2] = act_h2f((u16)d.y), a[3] = act_h2f((u16)(d.y >> 16));
            c[0] = c[1] = c[2] = c[3] = 0.f;
        } else if (TY == 3 || TY == 7) {
            const uint2 d = *(const uint2*)(rec + 2 * p);
            const uint2 m = *(const uint2*)(rec + 2 * r + 2 * p);
            a[0] = act_h2f((u16)d.x), a[1] = act_h2f((u16)(d.x >> 16));
            a[2] = act_h2f((u16)d.y), a[3] = act_h2f((u16)(d.y >> 16));
            c[0] = act_h2f((u16)m.x), c[1] = act_h2f((u16)(m.x >> 16));
            c[2] = act_h2f((u16)m.y), c[3] = act_h2f((u16)(m.y >> 16));
        } else if (TY == 12 || TY == 13) {
            const u32 sc = *(const u32*)(rec + p);
            const u32 mn = *(const u32*)(rec + r + p);
            const uint2 d = *(const uint2*)(hdr + 2 * p);
            const uint2 dm = *(const uint2*)(hdr + 2 * r + 2 * p);
            const float dd[4] = {act_h2f((u16)d.x), act_h2f((u16)(d.x >> 16)), act_h2f((u16)d.y),
                                 act_h2f((u16)(d.y >> 16))};
            const float dmin[4] = {act_h2f((u16)dm.x), act_h2f((u16)(dm.x >> 16)), act_h2f((u16)dm.y),
                                   act_h2f((u16)(dm.y >> 16))};
#pragma unroll
            for (int m = 0; m < 4; m++) {
                a[m] = dd[m] * (float)((sc >> (8 * m)) & 255);
                c[m] = -(dmin[m] * (float)((mn >> (8 * m)) & 255));
            }
        } else {  // Q6_K
            const u32 sc = *(const u32*)(rec + p);
            const uint2 d = *(const uint2*)(hdr + 2 * p);
            const float dd[4] = {act_h2f((u16)d.x), act_h2f((u16)(d.x >> 16)), act_h2f((u16)d.y),
                                 act_h2f((u16)(d.y >> 16))};
#pragma unroll
            for (int m = 0; m < 4; m++) {
                a[m] = dd[m] * (float)(i8)((sc >> (8 * m)) & 255);
                c[m] = 0.f;
            }
        }
    }
};

// Up to three matrices of one input and one type per launch (Q, K and V;
// gate and up).
struct ActMats {
    const u8* data[3];
    const float* thr[3];
    float* y[3];
    int rows[3];
    int tile[3];
    const float* bias[3];  // added to the outputs (null: none)
};

// What the launch folds in besides the product (null pointers: nothing):
// res += y after y is written (the residual add that follows a projection,
// single-matrix launches only); and the RMSNorm that precedes it: the input
// is then rms_norm(nx) * nw (eps neps), computed by every block for its
// channels from the whole row, and block (0, 0, 0) writes the normalized
// row to nout as the unfused norm would.
struct ActFold {
    float* res;
    const float* nx;
    const float* nw;
    float neps;
    float* nout;
};

// The thread's 8 outputs in its tile and where their codes lie.
template <int TY> struct ActLane {
    typedef CmType<TY> S;
    int p[2];       // first output of each quad (4 consecutive outputs)
    int base;       // byte of the run where its base-plane bytes start
    int hi[2];      // 5/6-bit: the word of each quad's high bits
    int hs[8];      // 5/6-bit: shift of each output's high bits in that word
    __device__ __forceinline__ void init(int r, int u) {
        const int bw = S::bits == 8 ? 8 : 4;
        base = u * bw;
#pragma unroll
        for (int qd = 0; qd < 2; qd++) {
            // 8-bit: quad qd is bytes 4 qd .. 4 qd + 3; else nibble qd of bytes 0..3.
            const int at = S::bits == 8 ? base + 4 * qd : base;
            p[qd] = act_output_of<S::bits>(r, at, qd);
            hi[qd] = 0;
        }
        if (S::bits == 5 || S::bits == 6) {
#pragma unroll
            for (int qd = 0; qd < 2; qd++) {
                int byte0, sh0;
                act_high_of<S::bits>(r, p[qd], &byte0, &sh0);
                hi[qd] = byte0 & ~3;
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    int byte, sh;
                    act_high_of<S::bits>(r, p[qd] + m, &byte, &sh);
                    hs[4 * qd + m] = 8 * (byte - hi[qd]) + sh;
                }
            }
        }
    }
    // The 8 codes of one run (outputs p[0] .. p[0] + 3, p[1] .. p[1] + 3),
    // minus the type's offset.
    __device__ __forceinline__ void codes(const u8* run, float q[8]) const {
        const int off = CmScale<TY>::off;
        if (S::bits == 8) {
            const uint2 w = *(const uint2*)(run + base);
#pragma unroll
            for (int m = 0; m < 4; m++) {
                q[m] = (float)((int)((w.x >> (8 * m)) & 255) - off);
                q[4 + m] = (float)((int)((w.y >> (8 * m)) & 255) - off);
            }
        } else {
            const u32 w = *(const u32*)(run + base);
            u32 h0 = 0, h1 = 0;
            if (S::bits == 5 || S::bits == 6) {
                h0 = *(const u32*)(run + hi[0]);
                h1 = *(const u32*)(run + hi[1]);
            }
            const u32 hm = S::bits == 5 ? 1 : 3;
#pragma unroll
            for (int m = 0; m < 4; m++) {
                int c0 = (w >> (8 * m)) & 15, c1 = (w >> (8 * m + 4)) & 15;
                if (S::bits == 5 || S::bits == 6) {
                    c0 |= ((h0 >> hs[m]) & hm) << 4;
                    c1 |= ((h1 >> hs[4 + m]) & hm) << 4;
                }
                q[m] = (float)(c0 - off);
                q[4 + m] = (float)(c1 - off);
            }
        }
    }
};

__device__ __forceinline__ float act_silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

// The kernel body (see the file's head). x: the input row (`up`: when not
// null, the input is silu(x) * up, the SwiGLU output). Groups
// [s * gpb, (s + 1) * gpb) of split s = blockIdx.y. partials: per matrix
// and split a row of `prow` floats; counters: per matrix `ctr_stride`
// tile counters, zero between launches. stats (may be null): per matrix
// (active channels, active groups), summed over the launches.
template <int TY>
__device__ void act_matvec(ActMats mats, int cols, const float* __restrict__ x, const float* __restrict__ up,
                           int gpb, float* __restrict__ partials, int prow, u32* __restrict__ counters,
                           int ctr_stride, u64* __restrict__ stats, ActFold fold) {
    typedef CmType<TY> S;
    __shared__ float sx[ACT_MAX_CH];
    __shared__ u8 sid[ACT_MAX_CH];
    __shared__ int scount[ACT_MAX_CH / 16 + 2];
    __shared__ int last;
    __shared__ float s32[32];
    const int mi = blockIdx.z, t = blockIdx.x, s = blockIdx.y, n_split = gridDim.y;
    CmLayout<TY> L;
    L.rows = mats.rows[mi];
    L.cols = cols;
    L.tile = mats.tile[mi];
    const int n_tiles = (L.rows + L.tile - 1) / L.tile;
    if (t >= n_tiles) return;  // another matrix of the launch has more tiles
    const int n_groups = cols / S::group;
    const int g0 = s * gpb, g1 = min(n_groups, g0 + gpb);
    const int c0 = g0 * S::group, nch = max(0, g1 - g0) * S::group;
    const float* thr = mats.thr[mi];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = (blockDim.x + 31) / 32;

    // 0. A folded norm: the row's scale (every block the same sum, in the
    // same order), and the normalized row for the norm's other readers.
    float nscale = 0.f;
    if (fold.nw) {
        float ss = 0.f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) ss = fmaf(fold.nx[c], fold.nx[c], ss);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) s32[warp] = ss;
        __syncthreads();
        ss = 0.f;
        for (int k = 0; k < n_warps; k++) ss += s32[k];
        nscale = rsqrtf(ss / (float)cols + fold.neps);
        if (t == 0 && s == 0 && mi == 0)
            for (int c = threadIdx.x; c < cols; c += blockDim.x) fold.nout[c] = fold.nx[c] * nscale * fold.nw[c];
    }

    // 1. Score and compact this block's channels, one warp per 32.
    for (int b = warp * 32; b < nch; b += n_warps * 32) {
        const int c = b + lane;
        float v = 0.f;
        bool keep = false;
        if (c < nch) {
            v = fold.nw ? fold.nx[c0 + c] * nscale * fold.nw[c0 + c]
                : up    ? act_silu_mul(x[c0 + c], up[c0 + c])
                        : x[c0 + c];
            keep = fabsf(v) >= thr[c0 + c];
        }
        const u32 mask = act_ballot(keep);
        if (S::group == 32) {
            const int pos = __popc(mask & ((1u << lane) - 1u));
            if (keep) sx[b + pos] = v, sid[b + pos] = (u8)lane;
            if (lane == 0) scount[b / 32] = __popc(mask);
        } else {
            const int half = lane / 16, hl = lane % 16;
            const u32 hmask = (mask >> (16 * half)) & 0xffffu;
            const int pos = __popc(hmask & ((1u << hl) - 1u));
            if (keep) sx[b + 16 * half + pos] = v, sid[b + 16 * half + pos] = (u8)hl;
            if (hl == 0) scount[b / 16 + half] = __popc(hmask);
        }
    }
    __syncthreads();
    if (stats && t == 0 && threadIdx.x == 0) {
        u64 act = 0, grp = 0;
        for (int g = 0; g < g1 - g0; g++) act += scount[g], grp += scount[g] > 0;
        atomicAdd(stats + 2 * mi, act);
        atomicAdd(stats + 2 * mi + 1, grp);
    }

    // 2. Stream the active channels' runs.
    const int r = L.tile_rows(t);
    const int u = threadIdx.x;
    const bool owns = u < r / 8;
    float y[8];
#pragma unroll
    for (int k = 0; k < 8; k++) y[k] = 0.f;
    ActLane<TY> ln;
    if (owns) {
        ln.init(r, u);
        const long rb = CmLayout<TY>::run_bytes(r);
        for (int g = g0; g < g1; g++) {
            const int n = scount[g - g0];
            if (n == 0) continue;
            const int at = (g - g0) * S::group;
            const u8* grp = mats.data[mi] + L.record_offset(t, g);
            const u8* runs = grp + CmLayout<TY>::rec_bytes(r);
            float acc[8], sum = 0.f;
#pragma unroll
            for (int k = 0; k < 8; k++) acc[k] = 0.f;
            for (int k = 0; k < n; k += ACT_UNROLL) {
                float q[ACT_UNROLL][8], xv[ACT_UNROLL];
#pragma unroll
                for (int j = 0; j < ACT_UNROLL; j++) {
                    const bool valid = k + j < n;
                    const int slot = at + (valid ? k + j : k);
                    xv[j] = valid ? sx[slot] : 0.f;
                    ln.codes(runs + sid[slot] * rb, q[j]);
                }
#pragma unroll
                for (int j = 0; j < ACT_UNROLL; j++) {
                    sum += xv[j];
#pragma unroll
                    for (int m = 0; m < 8; m++) acc[m] = fmaf(xv[j], q[j][m], acc[m]);
                }
            }
            const u8* hdr = mats.data[mi] + L.header_offset(t, g / (S::sb / S::group));
#pragma unroll
            for (int qd = 0; qd < 2; qd++) {
                float a[4], c[4];
                CmScale<TY>::quad(grp, hdr, r, ln.p[qd], a, c);
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    y[4 * qd + m] = fmaf(a[m], acc[4 * qd + m], y[4 * qd + m]);
                    if (CmScale<TY>::has_min) y[4 * qd + m] = fmaf(c[m], sum, y[4 * qd + m]);
                }
            }
        }
    }

    // 3. One split: the outputs. Else partials, and the tile's last block adds them.
    float* yout = mats.y[mi] + (long)t * L.tile;
    const float* bias = mats.bias[mi] ? mats.bias[mi] + (long)t * L.tile : 0;
    float* res = fold.res ? fold.res + (long)t * L.tile : 0;
    if (n_split == 1) {
        if (owns) {
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int o = ln.p[k / 4] + k % 4;
                const float v = bias ? y[k] + bias[o] : y[k];
                yout[o] = v;
                if (res) res[o] += v;
            }
        }
        return;
    }
    float* part = partials + ((long)mi * n_split) * prow + (long)t * L.tile;
    if (owns) {
#pragma unroll
        for (int k = 0; k < 8; k++) part[(long)s * prow + ln.p[k / 4] + k % 4] = y[k];
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* ctr = counters + (long)mi * ctr_stride + t;
        last = atomicAdd(ctr, 1u) == (u32)(n_split - 1);
        if (last) *ctr = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int o = threadIdx.x; o < r; o += blockDim.x) {
        float v = 0.f;
        for (int k = 0; k < n_split; k++) v += act_ldcg(part + (long)k * prow + o);
        if (bias) v += bias[o];
        yout[o] = v;
        if (res) res[o] += v;
    }
}

#ifndef ACT_HOST
// Arguments: per matrix slot 0..2 data, thresholds, y, rows, tile (slots
// past gridDim.z unused), then cols, x, up, gpb, partials, prow, counters,
// ctr_stride, stats, the biases of slots 0..2, res, nx, nw, neps, nout
// (`ACT_ARGS` in activation.rs; launch.rs's ActMatVec writes them).
#define ACT_KERNEL(NAME, ID)                                                                                     \
    extern "C" __global__ void act_mv_##NAME(                                                                  \
        const u8* d0, const u8* d1, const u8* d2, const float* t0, const float* t1, const float* t2, float* y0, \
        float* y1, float* y2, int r0, int r1, int r2, int tl0, int tl1, int tl2, int cols, const float* x,      \
        const float* up, int gpb, float* partials, int prow, u32* counters, int ctr_stride, u64* stats,        \
        const float* b0, const float* b1, const float* b2, float* res, const float* nx, const float* nw,        \
        float neps, float* nout) {                                                                             \
        PDL_ENTRY();                                                                                             \
        ActMats m = {{d0, d1, d2}, {t0, t1, t2}, {y0, y1, y2}, {r0, r1, r2}, {tl0, tl1, tl2}, {b0, b1, b2}};   \
        ActFold f = {res, nx, nw, neps, nout};                                                                   \
        act_matvec<ID>(m, cols, x, up, gpb, partials, prow, counters, ctr_stride, stats, f);                    \
    }
ACT_KERNEL(q4_0, 2)
ACT_KERNEL(q4_1, 3)
ACT_KERNEL(q5_0, 6)
ACT_KERNEL(q5_1, 7)
ACT_KERNEL(q8_0, 8)
ACT_KERNEL(q4_k, 12)
ACT_KERNEL(q5_k, 13)
ACT_KERNEL(q6_k, 14)

// out[i, c] = x[i, c] where |x[i, c]| >= thr[c], else 0 (prompt batches:
// the dense kernels on the masked input, as the CPU path runs them).
// Arguments in `CudaBackend::elementwise`'s order: pointers, width, count.
extern "C" __global__ void act_mask(const float* __restrict__ x, const float* __restrict__ thr,
                                    float* __restrict__ out, int width, long n) {
    PDL_ENTRY();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float v = x[i];
        out[i] = fabsf(v) >= thr[i % width] ? v : 0.f;
    }
}
#endif
