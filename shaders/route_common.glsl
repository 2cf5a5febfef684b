// Shared declarations of the Vulkan ray-tracing router (see crates/mirage-route/src/vk_rt/).
// Launch grid: x = query within the chunk, y = slice.
layout(push_constant) uniform Push {
    uint queries;
    uint slices;
    uint pages;
    uint words;
} pc;

layout(set = 0, binding = 1, std430) readonly buffer Points { float points[]; };
layout(set = 0, binding = 2, std430) readonly buffer Offsets { float offsets[]; };
// Exact (untranslated) page boxes, primitive order = slice-major: prim = slice * pages + page.
layout(set = 0, binding = 3, std430) readonly buffer PrimBoxes { float prim_boxes[]; };
layout(set = 0, binding = 4, std430) buffer Masks { uint masks[]; };
layout(set = 0, binding = 5, std430) readonly buffer Thresholds { uint thresholds[]; };
layout(set = 0, binding = 6, std430) writeonly buffer OutBits { uint out_bits[]; };
