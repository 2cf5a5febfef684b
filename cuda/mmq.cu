// ===========================================================================
// Prefill products on int8 tensor cores, reading the quantized weights in
// their split layouts (after matvec.cu, whose f16 helpers it uses, and
// matvec_imma.cu, whose mma_s8_k32_from it issues).
//
//   quantize_q8      : the activations, once per product, to 8-bit blocks of
//                      32: int8 quants, and per block the f32 scale d.
//   mmq_<layout>_t<T>: y[a, r] = W[r, :] . x[a, :] for a tile of T weight
//                      rows x T activation rows per block (T = 64: 4 warps;
//                      T = 128: 16 warps), every warp a 32 x 32 sub-tile
//                      multiplied with mma.sync m16n8k32 (s8 x s8 -> s32),
//                      the scales of each 32-column block applied in f32:
//                        d_w * d_x * dot(q_w, q_x)
// for the two layouts read here, Q8_0 and Q5_0. (Int8 tiles of Q4_K and
// Q6_K measured slower than cuBLAS on f16 tiles at 7B, so those types
// multiply there.)
//
// Stages of MMQ_K columns flow through a ring of MMQ_STAGES(T) buffers in
// dynamic shared memory: while the warps multiply stage s, the copies of
// stage s + MMQ_STAGES - 1 are in flight. Q8_0's quants and scales and the
// 8-bit activations are plain rows, so they go global -> shared with
// cp.async (16-byte copies; 8 for a row's four f16 scales) and never pass
// through registers. Q5_0's weights need unpacking: each thread loads its
// part of that stage into registers before it multiplies and unpacks them
// into the ring after. One __syncthreads per stage: after it every thread's
// copies of stage s have landed and every warp has finished stage s - 1,
// whose buffer the next copies reuse.
//
// Grid (n_act / T, rows / T), rounded up: the activation tiles of one
// weight tile are neighbouring blocks, so they run together and read that
// weight tile from L2 rather than each from DRAM (at 7B an FFN matrix is
// larger than L2). No dequantized copy of a weight exists anywhere; the
// int8 tile lives only in shared memory. cols must be a multiple of MMQ_K
// (checked on the host).
//
// The s32 dot products become f32 without a conversion instruction (those
// issue at a quarter of the FMA rate on sm_90 and bounded the tile): the
// mma starts its accumulators at MMQ_BIAS, the bits of 1.5 * 2^23, so that
// MMQ_BIAS + dot (|dot| <= 32 * 128 * 127 < 2^22) read as an f32 is
// exactly 1.5 * 2^23 + dot; then d_w * dot = fma(that, d_w, -1.5 * 2^23 *
// d_w), rounded once, as a conversion and a product would be.
// ===========================================================================

#define MMQ_K 128
// Shared-memory row stride in bytes: 16 bytes of padding make the fragment
// loads (8 rows x 4 words per instruction) hit 32 distinct banks.
#define MMQ_LD (MMQ_K + 16)
// Bytes of one stage of a T x T tile: weight quants [T][MMQ_LD], activation
// quants [T][MMQ_LD], weight scales [T][MMQ_K / 32] f16, activation scales
// [T][MMQ_K / 32] f32.
#define MMQ_STAGE_BYTES(T) ((T) * (2 * MMQ_LD + 2 * (MMQ_K / 32) + 4 * (MMQ_K / 32)))
// Stages in the ring: two for the 64 tile (several blocks share an SM and
// hide each other's waits), three for the 128 tile (one block per SM).
#define MMQ_STAGES(T) ((T) == 64 ? 2 : 3)
// Blocks an SM holds at once, for the register budget: four of the 64 tile
// (as many as its shared memory allows, given two stages), one of the 128.
#define MMQ_MIN_BLOCKS(T) ((T) == 64 ? 4 : 1)
#define MMQ_BIAS 0x4B400000
#define MMQ_BIAS_F 12582912.f

#define MMQ_Q8_0 0
#define MMQ_Q5_0 1

// Asynchronous global -> shared copies (sm_80+): 16 bytes bypassing L1, 8
// or 4 bytes through it; a thread's copies since its last commit form a group,
// and wait<N> returns once at most N of its groups are still in flight.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// One warp per block of 32 values of x ([n_act][cols], cols % 32 == 0): q =
// round(x / d) with d = max|x| / 127, written as xq (same shape, int8) and
// xd[block] = d. (No sum of the quants, as ggml's q8_1 carries: the weights
// read here are symmetric, q * d, so nothing needs it.)
__device__ __forceinline__ void quantize_q8_block(const float* __restrict__ x, i8* __restrict__ xq,
                                                  float* __restrict__ xd, long b, int lane) {
    float v = x[b * 32 + lane];
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float d = amax / 127.f;
    int q = amax == 0.f ? 0 : (int)rintf(v / d);
    xq[b * 32 + lane] = (i8)q;
    if (lane == 0) xd[b] = d;
}

// One stage of a T x T tile in the ring (byte offsets from its start).
template <int T> struct MmqStage {
    static constexpr int W = 0;                              // i8 [T][MMQ_LD]
    static constexpr int X = T * MMQ_LD;                     // i8 [T][MMQ_LD]
    static constexpr int WD = 2 * T * MMQ_LD;                // u16 [T][MMQ_K / 32]
    static constexpr int XD = WD + T * 2 * (MMQ_K / 32);     // f32 [T][MMQ_K / 32]
};

// Q5_0 blocks of one stage that one thread unpacks (T rows x MMQ_K / 32
// blocks over the block's threads), held in registers between the loads
// and the unpacking.
template <int T> struct MmqQ5Held {
    static constexpr int N = T * (MMQ_K / 32) / (T * T / 32);
    uint4 q[N];
    u32 h[N];
    u16 d[N];
};

// Copies (cp.async) of rows [r0, r0 + T) (clamped to the last of n rows;
// the clamped rows' outputs are not stored), columns [k0, k0 + MMQ_K), of an
// int8 matrix src ([n][cols]) into the stage's tile at dst (rows MMQ_LD
// bytes apart): T rows of MMQ_K / 16 copies, a whole number of rounds of the
// block's threads.
template <int T>
__device__ __forceinline__ void mmq_fetch_rows(u8* dst, const u8* __restrict__ src, int n, int cols, int r0, int k0) {
    constexpr int NT = T * T / 32;
#pragma unroll
    for (int j = 0; j < T * MMQ_K / 16 / NT; j++) {
        const int i = threadIdx.x + j * NT;
        const int r = i / (MMQ_K / 16), c = i % (MMQ_K / 16);
        const long g = min(r0 + r, n - 1);
        cp_async16(dst + r * MMQ_LD + 16 * c, src + g * cols + k0 + 16 * c);
    }
}

// Copies (cp.async) of the activation stage: rows [t0, t0 + T) of xq
// (clamped), columns [k0, k0 + MMQ_K), then one copy of scales a row.
template <int T>
__device__ __forceinline__ void mmq_fetch_x(u8* st, const i8* __restrict__ xq, const float* __restrict__ xd,
                                            int n_act, int cols, int t0, int k0) {
    mmq_fetch_rows<T>(st + MmqStage<T>::X, (const u8*)xq, n_act, cols, t0, k0);
    if (threadIdx.x < T) {
        const int t = threadIdx.x;
        const long ga = min(t0 + t, n_act - 1);
        cp_async16(st + MmqStage<T>::XD + t * 16, xd + ga * (cols >> 5) + (k0 >> 5));
    }
}

// Q8_0 (quants [rows][cols] int8, then f16 scales [rows][cols / 32]):
// copies (cp.async) of rows [r0, r0 + T) (clamped), columns [k0, k0 + MMQ_K).
template <int T>
__device__ __forceinline__ void mmq_fetch_w_q8(u8* st, const u8* __restrict__ W, int rows, int cols, int r0, int k0) {
    mmq_fetch_rows<T>(st + MmqStage<T>::W, W, rows, cols, r0, k0);
    if (threadIdx.x < T) {
        const int r = threadIdx.x;
        const long gr = min(r0 + r, rows - 1);
        cp_async8(st + MmqStage<T>::WD + r * 8, W + (long)rows * cols + 2 * (gr * (cols >> 5) + (k0 >> 5)));
    }
}

// Q5_0 (quants [rows][cols / 2], 16 bytes a block: low nibbles values
// 0..15, high nibbles 16..31; then u32 high bits [rows][cols / 32]; then f16
// scales [rows][cols / 32]; value = d * (q - 16)): this thread's blocks of
// the stage into registers.
template <int T>
__device__ __forceinline__ void mmq_load_w_q5(MmqQ5Held<T>& held, const u8* __restrict__ W, int rows, int cols, int r0,
                                              int k0) {
    const u32* qh = (const u32*)(W + (long)rows * (cols >> 1));
    const u16* sc = (const u16*)(W + (long)rows * (cols >> 1) + (long)rows * (cols >> 3));
#pragma unroll
    for (int n = 0; n < MmqQ5Held<T>::N; n++) {
        const int i = threadIdx.x + n * (T * T / 32);
        const int r = i / (MMQ_K / 32), b = i % (MMQ_K / 32);
        const long gr = min(r0 + r, rows - 1);
        const long blk = gr * (cols >> 5) + (k0 >> 5) + b;
        held.q[n] = *(const uint4*)(W + gr * (cols >> 1) + ((long)((k0 >> 5) + b) << 4));
        held.h[n] = qh[blk];
        held.d[n] = sc[blk];
    }
}

// The held Q5_0 blocks unpacked to int8 (q - 16) in the stage.
template <int T> __device__ __forceinline__ void mmq_store_w_q5(u8* st, const MmqQ5Held<T>& held) {
#pragma unroll
    for (int n = 0; n < MmqQ5Held<T>::N; n++) {
        const int i = threadIdx.x + n * (T * T / 32);
        const int r = i / (MMQ_K / 32), b = i % (MMQ_K / 32);
        const u32 h = held.h[n];
        const u32 q[4] = {held.q[n].x, held.q[n].y, held.q[n].z, held.q[n].w};
        u32 lo[4], hi[4];
#pragma unroll
        for (int w = 0; w < 4; w++) {
            u32 l = 0, u = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int j = 4 * w + k;
                const u32 byte = (q[w] >> (8 * k)) & 255u;
                const u32 ql = (byte & 15u) | (((h >> j) & 1u) << 4), qu = (byte >> 4) | (((h >> (j + 16)) & 1u) << 4);
                l |= ((ql - 16u) & 255u) << (8 * k);
                u |= ((qu - 16u) & 255u) << (8 * k);
            }
            lo[w] = l;
            hi[w] = u;
        }
        *(uint4*)(st + MmqStage<T>::W + r * MMQ_LD + 32 * b) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        *(uint4*)(st + MmqStage<T>::W + r * MMQ_LD + 32 * b + 16) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        ((u16*)(st + MmqStage<T>::WD))[r * (MMQ_K / 32) + b] = held.d[n];
    }
}

__device__ __forceinline__ u32 mmq_word(const u8* p) { return *(const u32*)p; }

// One stage of a warp's 32 x 32 sub-tile (weight rows wr.., activation rows
// wa.. of the block's tile): 2 x 4 mma tiles of 16 x 8 per 32 columns.
template <int T>
__device__ __forceinline__ void mmq_stage_product(const u8* st, int wr, int wa, float (&acc)[2][4][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u8* sw = st + MmqStage<T>::W;
    const u8* sx = st + MmqStage<T>::X;
    const u16* swd = (const u16*)(st + MmqStage<T>::WD);
    const float* sxd = (const float*)(st + MmqStage<T>::XD);
#pragma unroll
    for (int kb = 0; kb < MMQ_K / 32; kb++) {
        const int c = 32 * kb + 4 * t;
        u32 a[2][4], b[4][2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int r = wr + 16 * i + g;
            a[i][0] = mmq_word(sw + r * MMQ_LD + c);
            a[i][1] = mmq_word(sw + (r + 8) * MMQ_LD + c);
            a[i][2] = mmq_word(sw + r * MMQ_LD + c + 16);
            a[i][3] = mmq_word(sw + (r + 8) * MMQ_LD + c + 16);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int n = wa + 8 * j + g;
            b[j][0] = mmq_word(sx + n * MMQ_LD + c);
            b[j][1] = mmq_word(sx + n * MMQ_LD + c + 16);
        }
        float xd[4][2];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) xd[j][e] = sxd[(wa + 8 * j + 2 * t + e) * (MMQ_K / 32) + kb];
        // Weight scales of this thread's rows g and g + 8 of each m tile,
        // and the bias's share of them.
        float wd[2][2], wb[2][2];
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                wd[i][h] = h2f(swd[(wr + 16 * i + g + 8 * h) * (MMQ_K / 32) + kb]);
                wb[i][h] = -MMQ_BIAS_F * wd[i][h];
            }
#pragma unroll
        for (int i = 0; i < 2; i++) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int ci[4];
                mma_s8_k32_from(ci, a[i], b[j], MMQ_BIAS);
#pragma unroll
                for (int e = 0; e < 4; e++)
                    acc[i][j][e] =
                        fmaf(fmaf(__int_as_float(ci[e]), wd[i][e >> 1], wb[i][e >> 1]), xd[j][e & 1], acc[i][j][e]);
            }
        }
    }
}

// One block's tile: activation rows [blockIdx.x * T, ...) x weight rows
// [blockIdx.y * T, ...), the ring at `ring` (MMQ_STAGES(T) stages of
// MMQ_STAGE_BYTES(T)). Warp w takes weight rows 32 (w % (T / 32)).. and
// activation rows 32 (w / (T / 32))...
template <int FMT, int T>
__device__ void mmq_tile(const u8* __restrict__ W, int rows, int cols, const i8* __restrict__ xq,
                         const float* __restrict__ xd, int n_act, float* __restrict__ y, u8* ring) {
    constexpr int STAGES = MMQ_STAGES(T);
    static_assert((T * MMQ_K / 16) % (T * T / 32) == 0 && T <= T * T / 32, "copies per thread");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int a0 = blockIdx.x * T, r0 = blockIdx.y * T;
    const int wr = 32 * (warp % (T / 32)), wa = 32 * (warp / (T / 32));
    const int n_stages = cols / MMQ_K;
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
    MmqQ5Held<T> held;
    // The first STAGES - 1 stages; one commit each, so that the group of
    // stage s is always the s-th.
#pragma unroll
    for (int p = 0; p < STAGES - 1; p++) {
        if (p < n_stages) {
            u8* st = ring + p * MMQ_STAGE_BYTES(T);
            mmq_fetch_x<T>(st, xq, xd, n_act, cols, a0, p * MMQ_K);
            if (FMT == MMQ_Q8_0) {
                mmq_fetch_w_q8<T>(st, W, rows, cols, r0, p * MMQ_K);
            } else {
                mmq_load_w_q5<T>(held, W, rows, cols, r0, p * MMQ_K);
                mmq_store_w_q5<T>(st, held);
            }
        }
        cp_async_commit();
    }
    for (int s = 0; s < n_stages; s++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        // Stage f goes to the buffer of stage s - 1, which every warp has
        // finished with (the barrier above).
        const int f = s + STAGES - 1;
        u8* fst = ring + (f % STAGES) * MMQ_STAGE_BYTES(T);
        if (f < n_stages) {
            mmq_fetch_x<T>(fst, xq, xd, n_act, cols, a0, f * MMQ_K);
            if (FMT == MMQ_Q8_0)
                mmq_fetch_w_q8<T>(fst, W, rows, cols, r0, f * MMQ_K);
            else
                mmq_load_w_q5<T>(held, W, rows, cols, r0, f * MMQ_K);
        }
        cp_async_commit();
        mmq_stage_product<T>(ring + (s % STAGES) * MMQ_STAGE_BYTES(T), wr, wa, acc);
        if (FMT == MMQ_Q5_0 && f < n_stages) mmq_store_w_q5<T>(fst, held);
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

extern "C" __global__ void __launch_bounds__(256) quantize_q8(const float* x, long n_blocks, i8* xq, float* xd) {
    PDL_ENTRY();
    long b = (long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (b < n_blocks) quantize_q8_block(x, xq, xd, b, threadIdx.x & 31);
}

__device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

// The ring is the launch's dynamic shared memory: MMQ_STAGES(T) *
// MMQ_STAGE_BYTES(T) bytes (the host's `mmq_shared_bytes`; a launch with
// less traps rather than write past it).
#define MMQ_KERNEL(NAME, FMT, T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(T * T / 32, MMQ_MIN_BLOCKS(T))                                      \
        mmq_##NAME##_t##T(const u8* W, int rows, int cols, const i8* xq, const float* xd, int n_act, float* y) {     \
        extern __shared__ __align__(16) u8 mmq_ring[];                                                               \
        PDL_ENTRY();                                                                                                 \
        if (dynamic_smem_bytes() < MMQ_STAGES(T) * MMQ_STAGE_BYTES(T)) __trap();                                    \
        mmq_tile<FMT, T>(W, rows, cols, xq, xd, n_act, y, mmq_ring);                                                 \
    }
MMQ_KERNEL(q8_0s, MMQ_Q8_0, 64)
MMQ_KERNEL(q5_0s, MMQ_Q5_0, 64)
MMQ_KERNEL(q8_0s, MMQ_Q8_0, 128)
MMQ_KERNEL(q5_0s, MMQ_Q5_0, 128)
