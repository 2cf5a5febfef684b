// Element-wise and row kernels of the dense module: the RMSNorm launch,
// bias and residual adds, SwiGLU, row gathers, f16 conversion, argmax.

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w; grid (rows), block 256.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float eps, int width,
                                    float* __restrict__ out) {
    PDL_ENTRY();
    __shared__ float s32[32];
    float* o = out + (long)blockIdx.x * width;
    rms_norm_row(x + (long)blockIdx.x * width, w, eps, width, s32, [&](int i, float v) { o[i] = v; });
}

// x[i] += b[i % width]
extern "C" __global__ void add_bias(float* x, const float* __restrict__ b, int width, long n) {
    PDL_ENTRY();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % width];
}

// acc[i] += x[i]
extern "C" __global__ void add_inplace(float* acc, const float* __restrict__ x, long n) {
    PDL_ENTRY();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += x[i];
}

// h[i] = silu(g[i]) * u[i]
extern "C" __global__ void swiglu(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ h,
                                  long n) {
    PDL_ENTRY();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = g[i];
        h[i] = v / (1.f + expf(-v)) * u[i];
    }
}

// out[i, :] = x[idx[i], :]; grid (n_out), block 256.
extern "C" __global__ void gather_rows(const float* __restrict__ x, const u32* __restrict__ idx, int width,
                                       float* __restrict__ out) {
    PDL_ENTRY();
    const float* src = x + (long)idx[blockIdx.x] * width;
    float* dst = out + (long)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

// y[i] = f16(x[i])
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, u16* __restrict__ y, long n) {
    PDL_ENTRY();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2h(x[i]);
}

// idx[r] = argmax(x[r, :]) (first maximum); grid (rows), block 1024.
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int width, u32* __restrict__ idx) {
    PDL_ENTRY();
    __shared__ float bv[32];
    __shared__ int bi[32];
    const float* xr = x + (long)blockIdx.x * width;
    float best = -MIRAGE_INF;
    int besti = 0x7fffffff;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = xr[i];
        if (v > best) { best = v; besti = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, besti, o);
        if (ov > best || (ov == best && oi < besti)) { best = ov; besti = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { bv[warp] = best; bi[warp] = besti; }
    __syncthreads();
    if (warp == 0) {
        best = lane < nw ? bv[lane] : -MIRAGE_INF;
        besti = lane < nw ? bi[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, besti, o);
            if (ov > best || (ov == best && oi < besti)) { best = ov; besti = oi; }
        }
        if (lane == 0) idx[blockIdx.x] = (u32)besti;
    }
}

