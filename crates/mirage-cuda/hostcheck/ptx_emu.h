// Host stand-ins for the PTX the device helpers use (prmt, __byte_perm,
// cvt.f32.f16) and the integer and vector types of the kernel sources;
// shared by prelude.h and the checks that run whole blocks (block_emu.h).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
typedef unsigned char u8; typedef signed char i8; typedef unsigned short u16; typedef unsigned int u32;
typedef unsigned char sb_u8; typedef unsigned short sb_u16; typedef unsigned int sb_u32;
struct uint4 { u32 x, y, z, w; };
inline uint4 make_uint4(u32 a, u32 b, u32 c, u32 d) { return {a, b, c, d}; }
struct uint2 { u32 x, y; };
inline uint2 make_uint2(u32 a, u32 b) { return {a, b}; }
inline float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
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
// CUDA's __byte_perm: prmt.b32 with the selector's low 3 bits of each
// nibble (no sign replication).
inline u32 __byte_perm(u32 x, u32 y, u32 s) { return sb_prmt(x, y, s & 0x7777u); }
