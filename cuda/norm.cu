// MIRAGE CUDA kernels: the RMSNorm of one row, shared by the dense module
// (elementwise.cu) and the sparse one (superblock.cu); self-contained (its own
// reductions), included right after pdl.cu in both.

__device__ __forceinline__ float norm_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block-wide sum over blockDim.x (a multiple of 32, at most 1024) threads;
// shared32 holds 32 floats. Every thread gets the sum.
__device__ __forceinline__ float norm_block_sum(float v, float* shared32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = norm_warp_sum(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    const float t = lane < nw ? shared32[lane] : 0.f;
    return norm_warp_sum(t);
}

// RMSNorm of one row xr[0..cols) with weights w by every thread of the
// block (a block-wide reduction: all threads must call it); emit(i, v) gets
// each output element once. The one definition of the norm's arithmetic,
// shared by elementwise.cu's `rms_norm` kernel, its prologue that folds the norm
// into a mat-vec (norm_prologue) and the sparse FFN's phase 1 with the norm
// folded in (superblock.cu), so all of them give the same bits at the same
// block size.
//
// Latency, not bandwidth, is what a norm costs in a decode step (one row of
// a few thousand floats; a scalar loop measured ~10 us a launch for 3584
// wide on the H200, and the same again inside every block of a folded
// mat-vec). The vector path issues all of a
// thread's 16-byte loads of x (up to NORM_VEC per round) before using any,
// and loads the weights together with x's second read, so a row costs two
// memory round trips and one block reduction. Rows not made of 16-byte
// aligned float4s take the scalar loop.
//
// rms_norm_row_by(T, ...): the same with only threads 0..T-1 of a larger
// block taking part (the others load nothing, emit nothing, and add zeros
// to the reduction, which leaves every bit as it is): a 512-thread kernel
// (route.cu) gets the 256-thread kernel's bits.
#define NORM_VEC 4
template <class Emit>
__device__ __forceinline__ void rms_norm_row_by(int T, const float* __restrict__ xr, const float* __restrict__ w,
                                                float eps, int cols, float* s32, Emit emit) {
    const int t = threadIdx.x;
    const bool on = t < T;
    const int n4 = on ? cols >> 2 : 0;
    const bool vec = (cols & 3) == 0 && ((((unsigned long long)xr) | ((unsigned long long)w)) & 15) == 0;
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float ss = 0.f;
        for (int base = 0; base < n4; base += NORM_VEC * T) {
            float4 xv[NORM_VEC];
#pragma unroll
            for (int k = 0; k < NORM_VEC; k++) {
                const int v = base + k * T + t;
                xv[k] = v < n4 ? x4[v] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int k = 0; k < NORM_VEC; k++) {
                ss += xv[k].x * xv[k].x;
                ss += xv[k].y * xv[k].y;
                ss += xv[k].z * xv[k].z;
                ss += xv[k].w * xv[k].w;
            }
        }
        ss = norm_block_sum(ss, s32);
        const float scale = rsqrtf(ss / (float)cols + eps);
        for (int base = 0; base < n4; base += NORM_VEC * T) {
            float4 xv[NORM_VEC], wv[NORM_VEC];
#pragma unroll
            for (int k = 0; k < NORM_VEC; k++) {
                const int v = base + k * T + t;
                if (v < n4) {
                    xv[k] = x4[v];
                    wv[k] = __ldg(&w4[v]);
                }
            }
#pragma unroll
            for (int k = 0; k < NORM_VEC; k++) {
                const int v = base + k * T + t;
                if (v < n4) {
                    emit(4 * v, xv[k].x * scale * wv[k].x);
                    emit(4 * v + 1, xv[k].y * scale * wv[k].y);
                    emit(4 * v + 2, xv[k].z * scale * wv[k].z);
                    emit(4 * v + 3, xv[k].w * scale * wv[k].w);
                }
            }
        }
    } else {
        const int end = on ? cols : 0;
        float ss = 0.f;
        for (int i = t; i < end; i += T) ss += xr[i] * xr[i];
        ss = norm_block_sum(ss, s32);
        const float scale = rsqrtf(ss / (float)cols + eps);
        for (int i = t; i < end; i += T) emit(i, xr[i] * scale * w[i]);
    }
}
template <class Emit>
__device__ __forceinline__ void rms_norm_row(const float* __restrict__ xr, const float* __restrict__ w, float eps,
                                             int cols, float* s32, Emit emit) {
    rms_norm_row_by(blockDim.x, xr, w, eps, cols, s32, emit);
}

