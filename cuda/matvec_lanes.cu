// Decode mat-vecs of the repacked layouts whose lanes each read one 32-bit
// word of a 128-byte line per row (nvfp4, q5_0s): `mv3_<suffix>`,
// its column splits `_k2/_k4/_k8` and `ffn_<suffix>`, FAST_ROWS rows per
// warp.
//
// NVFP4 ("nvfp4"): the CPU codec's NVFP4 (mirage_gguf::quant::nvfp4): packed E2M1
// codes [rows][cols/2], then E4M3 scales [rows][cols/16]; the f32 tensor
// scale is a kernel argument. Lane l reads word l of each 256-element chunk
// (128 bytes per row per warp load).

// This lane's share of NR NVFP4 rows (codes q[k] as words, scales s[k]) dotted
// with xa, in units of (E2M1 doubled) x (E4M3 scale): the caller multiplies
// by tensor_scale / 2.
template <int NR>
__device__ __forceinline__ void nvfp4_dot(const u32* const* q, const u8* const* s, const float* __restrict__ xa,
                                          int cols, int lane, float* acc) {
    const int n_chunks = (cols + 255) >> 8;
    for (int c = 0; c < n_chunks; c += 2) {
        u32 w[2][NR], sc[2][NR];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int e = ((c + h) << 8) + (lane << 3);
            bool ok = e < cols;
#pragma unroll
            for (int k = 0; k < NR; k++) {
                w[h][k] = ok ? __ldg(q[k] + (e >> 3)) : 0u;
                sc[h][k] = ok ? (u32)__ldg(s[k] + (e >> 4)) : 0u;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int e = ((c + h) << 8) + (lane << 3);
            if (e >= cols) continue;
            float4 xa4 = *(const float4*)(xa + e), xb4 = *(const float4*)(xa + e + 4);
#pragma unroll
            for (int k = 0; k < NR; k++) {
                float lo[4], hi[4];
                sb_e2m1x4_doubled(w[h][k], lo);
                sb_e2m1x4_doubled(w[h][k] >> 16, hi);
                float d = lo[0] * xa4.x + lo[1] * xa4.y + lo[2] * xa4.z + lo[3] * xa4.w + hi[0] * xb4.x +
                          hi[1] * xb4.y + hi[2] * xb4.z + hi[3] * xb4.w;
                acc[k] += d * sb_e4m3(sc[h][k]);
            }
        }
    }
}
// ---------------------------------------------------------------------------
// Split Q5_0 ("q5_0s"): the 16 quant bytes of every block [rows][cols/2],
// then the 32-bit high-bit words [rows][cols/32], then the f16 scales
// [rows][cols/32]. Same bytes as ggml. Lane l reads the 32-bit word l of a
// 128-byte line of quants (8 blocks, 256 elements): block l/4, bytes
// j = 4(l%4)..+3, i.e. elements j (low nibbles, high bit j of qh) and j + 16
// (high nibbles, high bit j + 16).
template <int NR>
__device__ __forceinline__ void q5s_dot(const u8* const* q, const u32* const* qh, const u16* const* s,
                                        const float* __restrict__ xa, int cols, int lane, float* acc) {
    const int n_chunks = (cols + 255) >> 8;
    const int blk = lane >> 2, t = lane & 3;
    for (int c = 0; c < n_chunks; c += 2) {
        u32 w[2][NR], hb[2][NR];
        u16 sc[2][NR];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int b = ((c + h) << 3) + blk;  // block index in the row
            bool ok = (b << 5) < cols;
#pragma unroll
            for (int k = 0; k < NR; k++) {
                w[h][k] = ok ? __ldg((const u32*)(q[k] + ((c + h) << 7) + (lane << 2))) : 0u;
                hb[h][k] = ok ? __ldg(qh[k] + b) : 0u;
                sc[h][k] = ok ? __ldg(s[k] + b) : (u16)0;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int b = ((c + h) << 3) + blk;
            if ((b << 5) >= cols) continue;
            const float* xs = xa + (b << 5) + (t << 2);
            float4 xl = *(const float4*)xs, xh = *(const float4*)(xs + 16);
#pragma unroll
            for (int k = 0; k < NR; k++) {
                u32 hl = hb[h][k] >> (t << 2), hh = hb[h][k] >> ((t << 2) + 16);
                u32 lo = w[h][k] & 0x0f0f0f0fu, hi = (w[h][k] >> 4) & 0x0f0f0f0fu;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    lo |= ((hl >> i) & 1u) << (8 * i + 4);
                    hi |= ((hh >> i) & 1u) << (8 * i + 4);
                }
                float ql[4], qv[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    ql[i] = sb_byte_f32(lo, i, 8388624.0f);  // 2^23 + 16: q - 16
                    qv[i] = sb_byte_f32(hi, i, 8388624.0f);
                }
                float dsum = ql[0] * xl.x + ql[1] * xl.y + ql[2] * xl.z + ql[3] * xl.w + qv[0] * xh.x + qv[1] * xh.y +
                             qv[2] * xh.z + qv[3] * xh.w;
                acc[k] += h2f(sc[h][k]) * dsum;
            }
        }
    }
}
// ---------------------------------------------------------------------------
// Row pointers of the FAST_ROWS rows a warp dots, one struct per layout:
// set(k, W, rows, cols, r, c) points slot k at row r of the rows x cols
// matrix W from column c on (c a multiple of 256, the split granule), dot()
// adds this lane's share of the slots' rows over n columns of xa into acc,
// scale(ts) is what the sums are multiplied by.
struct Nvfp4Rows {
    const u32* q[FAST_ROWS];
    const u8* s[FAST_ROWS];
    __device__ __forceinline__ void set(int k, const u8* W, int rows, int cols, int r, int c) {
        q[k] = (const u32*)(W + (long)r * (cols >> 1) + (c >> 1));
        s[k] = W + (long)rows * (cols >> 1) + (long)r * (cols >> 4) + (c >> 4);
    }
    __device__ __forceinline__ void dot(const float* xa, int n, int lane, float* acc) const {
        nvfp4_dot<FAST_ROWS>(q, s, xa, n, lane, acc);
    }
    __device__ __forceinline__ static float scale(float ts) { return 0.5f * ts; }
};

struct Q5sRows {
    const u8* q[FAST_ROWS];
    const u32* qh[FAST_ROWS];
    const u16* s[FAST_ROWS];
    __device__ __forceinline__ void set(int k, const u8* W, int rows, int cols, int r, int c) {
        q[k] = W + (long)r * (cols >> 1) + (c >> 1);
        qh[k] = (const u32*)(W + (long)rows * (cols >> 1)) + (long)r * (cols >> 5) + (c >> 5);
        s[k] = (const u16*)(W + (long)rows * (cols >> 1) + (long)rows * (cols >> 3)) + (long)r * (cols >> 5) + (c >> 5);
    }
    __device__ __forceinline__ void dot(const float* xa, int n, int lane, float* acc) const {
        q5s_dot<FAST_ROWS>(q, qh, s, xa, n, lane, acc);
    }
    __device__ __forceinline__ static float scale(float) { return 1.f; }
};

// mv3 of layout R: S warps per group of FAST_ROWS rows (S = 1: no split),
// each over one column slice of whole 256-element granules (mv3_slice);
// the last row is repeated past the matrix end (never stored).
template <class R, int S>
__device__ __forceinline__ void mv3_lanes(MV3_PARAMS) {
    PDL_ENTRY();
    MV3_PICK((FAST_WARPS / S) * FAST_ROWS)
    __shared__ float part[S > 1 ? FAST_WARPS : 1][FAST_ROWS];
    const int slice = warp % S;
    const int r0 = (bx * (FAST_WARPS / S) + warp / S) * FAST_ROWS;
    int c_lo, c_n;
    mv3_slice<256, S>(cols, slice, c_lo, c_n);
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    if (r0 < rows && c_n > 0) {
        R p;
#pragma unroll
        for (int k = 0; k < FAST_ROWS; k++) p.set(k, W, rows, cols, min(r0 + k, rows - 1), c_lo);
        p.dot(xa + c_lo, c_n, lane, acc);
    }
    mv3_store<FAST_ROWS, S>(acc, part, warp, lane, slice, r0, y, bias, rs, a, rows, R::scale(ts));
}

// Gate/up/SwiGLU of layout R: FAST_ROWS / 2 channels per warp (their gate
// rows, then their up rows, are the warp's rows).
template <class R>
__device__ __forceinline__ void ffn_lanes(FFN_PARAMS) {
    PDL_ENTRY();
    const int NC = FAST_ROWS / 2;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    FAST_INPUT
    int r0 = (blockIdx.x * FAST_WARPS + warp) * NC;
    if (r0 >= rows) return;
    R p;
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int r = min(r0 + k, rows - 1);
        p.set(k, Wg, rows, cols, r, 0);
        p.set(NC + k, Wu, rows, cols, r, 0);
    }
    float acc[FAST_ROWS];
#pragma unroll
    for (int k = 0; k < FAST_ROWS; k++) acc[k] = 0.f;
    p.dot(xa, cols, lane, acc);
#pragma unroll
    for (int k = 0; k < NC; k++) {
        float g = warp_sum(acc[k]) * R::scale(ts_g), u = warp_sum(acc[NC + k]) * R::scale(ts_u);
        if (lane == 0 && r0 + k < rows) h[(long)a * rows + r0 + k] = silu_mul(g, u);
    }
}

#define LANE_KERNELS(NAME, R)                                                                                        \
    MV3_KERNELS(NAME, mv3_lanes, R)                                                                                  \
    extern "C" __global__ void __launch_bounds__(FAST_WARPS * 32) ffn_##NAME(FFN_PARAMS) {                          \
        ffn_lanes<R>(Wg, Wu, rows, row_bytes, cols, x, h, ts_g, ts_u, nx, nw, neps, nout);                           \
    }
LANE_KERNELS(nvfp4, Nvfp4Rows)
LANE_KERNELS(q5_0s, Q5sRows)
