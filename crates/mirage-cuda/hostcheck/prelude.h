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
#include "ptx_emu.h"
#define SB_MAGIC 0x4B000000u
#define Q8S_UNROLL 4
struct float4 { float x, y, z, w; };
template <class T> T __ldg(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
