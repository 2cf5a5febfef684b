#version 460
#extension GL_EXT_ray_tracing : require
// Nothing to do on a miss; present so the shader binding table is complete.
layout(location = 0) rayPayloadInEXT uint unused_payload;

void main() {}
