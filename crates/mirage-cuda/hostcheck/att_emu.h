// Host stand-ins for the decode attention's cache and rounding helpers
// (attention.cu's f2h, kv_load, kv_widen, __fmul_rn, ...), shared by the checks
// that run the attention code (check_attend.cpp, check_attn_block.cpp).
// Needs u16, u32 and h2f declared first.
#pragma once
#include <cstring>
inline u16 f2h(float f) {  // round to nearest (normal range only, enough for test data)
    u32 u; memcpy(&u, &f, 4);
    u32 s = (u >> 16) & 0x8000; int e = ((u >> 23) & 255) - 127 + 15; u32 m = u & 0x7fffff;
    if (e <= 0) return (u16)s;
    u32 h = s | (e << 10) | (m >> 13);
    if ((m >> 12) & 1) h++;
    return (u16)h;
}
inline float kv_load(const float* p, long i) { return p[i]; }
inline float kv_load(const u16* p, long i) { return h2f(p[i]); }
inline float kv_widen(float v) { return v; }
inline float kv_widen(u16 v) { return h2f(v); }
inline float __fmul_rn(float a, float b) { return a * b; }  // g++ -O1 does not contract across statements
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
