#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#define __device__
#define __forceinline__ inline
#define __restrict__
typedef unsigned char u8; typedef signed char i8; typedef unsigned short u16; typedef unsigned int u32;
typedef unsigned char sb_u8; typedef unsigned short sb_u16; typedef unsigned int sb_u32;
#define SB_MAGIC 0x4B000000u
#define Q8S_UNROLL 4
struct float4 { float x, y, z, w; };
template <class T> T __ldg(const T* p) { return *p; }
inline float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
inline int min(int a, int b) { return a < b ? a : b; }
inline float half_to_float(u16 h) {
    u32 s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? INFINITY : std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
inline float h2f(u16 h) { return half_to_float(h); }
inline float sb_h2f(u16 h) { return half_to_float(h); }
// PTX prmt.b32 default mode.
inline sb_u32 sb_prmt(sb_u32 a, sb_u32 b, sb_u32 sel) {
    uint64_t x = ((uint64_t)b << 32) | a; sb_u32 r = 0;
    for (int i = 0; i < 4; i++) {
        u32 s = (sel >> (4 * i)) & 15; u32 byte = (x >> (8 * (s & 7))) & 255;
        if (s & 8) byte = (byte & 0x80) ? 0xff : 0;
        r |= byte << (8 * i);
    }
    return r;
}
