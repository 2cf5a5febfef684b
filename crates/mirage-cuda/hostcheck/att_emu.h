// Host stand-ins for the decode attention's cache and rounding helpers
// (attention.cu's f2h, kv_load, kv_widen, __fmul_rn, ...; attention_mma.cu's
// f16x2 h2_sub and h2_mul; attention_pruned.cu's atomicOr), shared by the
// checks that run the attention code.
// Needs u16, u32 and h2f declared first.
#pragma once
#include <cstring>
// As the device's atomicOr (relaxed).
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
// cvt.rn.f16.f32: round to nearest even, subnormals kept (g++'s _Float16).
inline u16 f2h(float f) {
    const _Float16 h = (_Float16)f;
    u16 u;
    memcpy(&u, &h, 2);
    return u;
}
inline float kv_load(const float* p, long i) { return p[i]; }
inline float kv_load(const u16* p, long i) { return h2f(p[i]); }
inline float kv_widen(float v) { return v; }
inline float kv_widen(u16 v) { return h2f(v); }
inline float __fmul_rn(float a, float b) { return a * b; }  // g++ -O1 does not contract across statements
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
// sub.rn.f16x2 / mul.rn.f16x2: per half, the exact result of the two f16
// operands (a difference or product of f16 values is exact in f32) rounded
// once to f16, subnormals kept.
inline u32 h2_op(u32 a, u32 b, bool mul) {
    u32 r = 0;
    for (int i = 0; i < 2; i++) {
        const float x = h2f((u16)(a >> (16 * i))), y = h2f((u16)(b >> (16 * i)));
        r |= (u32)f2h(mul ? x * y : x - y) << (16 * i);
    }
    return r;
}
inline u32 h2_sub(u32 a, u32 b) { return h2_op(a, b, false); }
inline u32 h2_mul(u32 a, u32 b) { return h2_op(a, b, true); }
