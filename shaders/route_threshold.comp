#version 460
#extension GL_GOOGLE_include_directive : require
// One invocation per (query, 32-page word): a page is a candidate when the
// popcount of its slice mask reaches its threshold.
#include "route_common.glsl"

layout(local_size_x = 64) in;

void main() {
    uint idx = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * 64;
    if (idx >= pc.queries * pc.words) {
        return;
    }
    uint q = idx / pc.words;
    uint w = idx - q * pc.words;
    uint bits = 0u;
    for (uint b = 0u; b < 32u; b++) {
        uint page = w * 32u + b;
        if (page >= pc.pages) {
            break;
        }
        if (uint(bitCount(masks[q * pc.pages + page])) >= thresholds[page]) {
            bits |= 1u << b;
        }
    }
    out_bits[idx] = bits;
}
