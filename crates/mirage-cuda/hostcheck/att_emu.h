// Host stand-ins for the decode attention's cache and rounding helpers
// (attention.cu's f2h, kv_load, kv_widen, __fmul_rn, ...), shared by the checks
// that run the attention code (check_attend.cpp, check_attn_block.cpp).
// Needs u16, u32 and h2f declared first.
#pragma once
#include <cstring>
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
