// ===========================================================================
// Prefill products on int8 tensor cores, reading the quantized weights in
// their split layouts (after matvec.cu, whose f16 helpers it uses, and
// matvec_imma.cu, whose mma_s8_k32 it issues).
//
//   quantize_q8_1 : the activations, once per product, to 8-bit blocks of 32
//                   (q8_1: quants, and per block the scale d and d * sum(q)).
//   mmq_<layout>  : y[a, r] = W[r, :] . x[a, :] for a tile of MMQ_ROWS
//                   weight rows x MMQ_TOKS activation rows per block. Each
//                   stage stages MMQ_K columns of both in shared memory as
//                   int8 (weights unpacked from their blocks, with their
//                   per-block scales in f32), then every warp multiplies its
//                   32 x 32 sub-tile with mma.sync m16n8k32 (s8 x s8 -> s32)
//                   and applies the scales of that 32-column block in f32:
//                     d_w * d_x * dot(q_w, q_x)
// for the two layouts read here, Q8_0 and Q5_0. (Int8 tiles of Q4_K and
// Q6_K measured slower than cuBLAS on f16 tiles at 7B, so those types
// multiply there.)
// No dequantized copy of a weight exists anywhere; the int8 tile lives only
// in shared memory. Grid (rows / MMQ_ROWS, n_act / MMQ_TOKS), rounded up;
// block MMQ_WARPS warps. cols must be a multiple of MMQ_K (checked on the
// host).
// ===========================================================================

#define MMQ_ROWS 64
#define MMQ_TOKS 64
#define MMQ_K 128
#define MMQ_WARPS 4
// Shared-memory row stride in bytes: 16 bytes of padding make the fragment
// loads (8 rows x 4 words per instruction) hit 32 distinct banks.
#define MMQ_LD (MMQ_K + 16)

struct MmqTile {
    i8 w[MMQ_ROWS][MMQ_LD];
    i8 x[MMQ_TOKS][MMQ_LD];
    float wd[MMQ_ROWS][MMQ_K / 32];  // weight scale per 32 columns
    float xd[MMQ_TOKS][MMQ_K / 32];  // activation scale
};

#define MMQ_Q8_0 0
#define MMQ_Q5_0 1

// One warp per block of 32 values of x ([n_act][cols], cols % 32 == 0): q =
// round(x / d) with d = max|x| / 127, written as xq (same shape, int8) and
// xds[block] = (d, d * sum(q)).
__device__ __forceinline__ void quantize_q8_1_block(const float* __restrict__ x, i8* __restrict__ xq,
                                                    float2* __restrict__ xds, long b, int lane) {
    float v = x[b * 32 + lane];
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float d = amax / 127.f;
    int q = amax == 0.f ? 0 : (int)rintf(v / d);
    xq[b * 32 + lane] = (i8)q;
    int s = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) xds[b] = make_float2(d, d * (float)s);
}

// Stage of the weight tile: rows [r0, r0 + MMQ_ROWS) (clamped to the last
// row; the clamped rows' outputs are not stored), columns [k0, k0 + MMQ_K).
template <int FMT>
__device__ __forceinline__ void mmq_load_w(MmqTile& s, const u8* __restrict__ W, int rows, int cols, int r0, int k0) {
    const int tid = threadIdx.x, nt = MMQ_WARPS * 32;
    if (FMT == MMQ_Q8_0) {
        // quants [rows][cols] int8, then f16 scales [rows][cols / 32].
        for (int i = tid; i < MMQ_ROWS * MMQ_K / 16; i += nt) {
            int r = i / (MMQ_K / 16), c = i % (MMQ_K / 16);
            long gr = min(r0 + r, rows - 1);
            *(uint4*)&s.w[r][16 * c] = *(const uint4*)(W + gr * cols + k0 + 16 * c);
        }
        const u16* sc = (const u16*)(W + (long)rows * cols);
        for (int i = tid; i < MMQ_ROWS * (MMQ_K / 32); i += nt) {
            int r = i / (MMQ_K / 32), b = i % (MMQ_K / 32);
            long gr = min(r0 + r, rows - 1);
            s.wd[r][b] = h2f(sc[gr * (cols >> 5) + (k0 >> 5) + b]);
        }
    } else {
        // quants [rows][cols / 2] (16 bytes a block: low nibbles values
        // 0..15, high nibbles 16..31), then u32 high bits [rows][cols / 32],
        // then f16 scales [rows][cols / 32]; value = d * (q - 16).
        const u32* qh = (const u32*)(W + (long)rows * (cols >> 1));
        const u16* sc = (const u16*)(W + (long)rows * (cols >> 1) + (long)rows * (cols >> 3));
        for (int i = tid; i < MMQ_ROWS * (MMQ_K / 32); i += nt) {
            int r = i / (MMQ_K / 32), b = i % (MMQ_K / 32);
            long gr = min(r0 + r, rows - 1);
            long blk = gr * (cols >> 5) + (k0 >> 5) + b;
            uint4 v = *(const uint4*)(W + gr * (cols >> 1) + ((long)((k0 >> 5) + b) << 4));
            u32 h = qh[blk];
            u32 q[4] = {v.x, v.y, v.z, v.w}, lo[4], hi[4];
#pragma unroll
            for (int w = 0; w < 4; w++) {
                u32 l = 0, u = 0;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    int j = 4 * w + k;
                    u32 byte = (q[w] >> (8 * k)) & 255u;
                    u32 ql = (byte & 15u) | (((h >> j) & 1u) << 4), qu = (byte >> 4) | (((h >> (j + 16)) & 1u) << 4);
                    l |= ((ql - 16u) & 255u) << (8 * k);
                    u |= ((qu - 16u) & 255u) << (8 * k);
                }
                lo[w] = l;
                hi[w] = u;
            }
            *(uint4*)&s.w[r][32 * b] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
            *(uint4*)&s.w[r][32 * b + 16] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
            s.wd[r][b] = h2f(sc[blk]);
        }
    }
}

// Stage of the activation tile: rows [t0, t0 + MMQ_TOKS) of xq (clamped),
// columns [k0, k0 + MMQ_K), with their block scales.
__device__ __forceinline__ void mmq_load_x(MmqTile& s, const i8* __restrict__ xq, const float2* __restrict__ xds,
                                           int n_act, int cols, int t0, int k0) {
    const int tid = threadIdx.x, nt = MMQ_WARPS * 32;
    for (int i = tid; i < MMQ_TOKS * MMQ_K / 16; i += nt) {
        int t = i / (MMQ_K / 16), c = i % (MMQ_K / 16);
        long ga = min(t0 + t, n_act - 1);
        *(uint4*)&s.x[t][16 * c] = *(const uint4*)(xq + ga * cols + k0 + 16 * c);
    }
    for (int i = tid; i < MMQ_TOKS * (MMQ_K / 32); i += nt) {
        int t = i / (MMQ_K / 32), b = i % (MMQ_K / 32);
        long ga = min(t0 + t, n_act - 1);
        s.xd[t][b] = xds[ga * (cols >> 5) + (k0 >> 5) + b].x;
    }
}

__device__ __forceinline__ u32 mmq_word(const i8* p) { return *(const u32*)p; }

// One block's tile: weight rows [blockIdx.x * MMQ_ROWS, ...) x activation
// rows [blockIdx.y * MMQ_TOKS, ...). Warp w takes rows 32 (w & 1).. and
// activation rows 32 (w >> 1)..: 2 x 4 mma tiles of 16 x 8.
template <int FMT>
__device__ void mmq_tile(const u8* __restrict__ W, int rows, int cols, const i8* __restrict__ xq,
                         const float2* __restrict__ xds, int n_act, float* __restrict__ y) {
    __shared__ MmqTile s;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.x * MMQ_ROWS, a0 = blockIdx.y * MMQ_TOKS;
    const int wr = 32 * (warp & 1), wa = 32 * (warp >> 1);
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
    for (int k0 = 0; k0 < cols; k0 += MMQ_K) {
        mmq_load_w<FMT>(s, W, rows, cols, r0, k0);
        mmq_load_x(s, xq, xds, n_act, cols, a0, k0);
        __syncthreads();
#pragma unroll
        for (int kb = 0; kb < MMQ_K / 32; kb++) {
            const int c = 32 * kb + 4 * t;
            u32 a[2][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int r = wr + 16 * i + g;
                a[i][0] = mmq_word(&s.w[r][c]);
                a[i][1] = mmq_word(&s.w[r + 8][c]);
                a[i][2] = mmq_word(&s.w[r][c + 16]);
                a[i][3] = mmq_word(&s.w[r + 8][c + 16]);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int n = wa + 8 * j + g;
                b[j][0] = mmq_word(&s.x[n][c]);
                b[j][1] = mmq_word(&s.x[n][c + 16]);
            }
            float xd[4][2];
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) xd[j][e] = s.xd[wa + 8 * j + 2 * t + e][kb];
            // Weight scales of this thread's rows g and g + 8 of each m tile.
            float wd[2][2];
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int h = 0; h < 2; h++) wd[i][h] = s.wd[wr + 16 * i + g + 8 * h][kb];
#pragma unroll
            for (int i = 0; i < 2; i++) {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    int ci[4] = {0, 0, 0, 0};
                    mma_s8_k32(ci, a[i], b[j]);
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[i][j][e] += wd[i][e >> 1] * xd[j][e & 1] * (float)ci[e];
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = r0 + wr + 16 * i + g + 8 * (e >> 1), a = a0 + wa + 8 * j + 2 * t + (e & 1);
                if (r < rows && a < n_act) y[(long)a * rows + r] = acc[i][j][e];
            }
}

extern "C" __global__ void __launch_bounds__(256) quantize_q8_1(const float* x, long n_blocks, i8* xq, float2* xds) {
    PDL_ENTRY();
    long b = (long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (b < n_blocks) quantize_q8_1_block(x, xq, xds, b, threadIdx.x & 31);
}

#define MMQ_KERNEL(NAME, FMT)                                                                                        \
    extern "C" __global__ void __launch_bounds__(MMQ_WARPS * 32)                                                     \
        mmq_##NAME(const u8* W, int rows, int cols, const i8* xq, const float2* xds, int n_act, float* y) {          \
        PDL_ENTRY();                                                                                                 \
        mmq_tile<FMT>(W, rows, cols, xq, xds, n_act, y);                                                             \
    }
MMQ_KERNEL(q8_0s, MMQ_Q8_0)
MMQ_KERNEL(q5_0s, MMQ_Q5_0)
