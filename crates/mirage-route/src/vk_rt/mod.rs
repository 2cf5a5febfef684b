//! Vulkan ray-tracing router (ash): one AABB bottom-level acceleration
//! structure holding every page box of every slice (slice-major primitive ids,
//! translated by the slice offsets and padded), one top-level structure with a
//! single instance, a ray-generation shader that casts one short ray per
//! (query, slice), an intersection shader that does the exact closed
//! point-in-box test and ORs the slice bit into the page's mask (it never
//! reports a hit, so traversal visits every overlapping box), then a compute
//! pass that thresholds the masks into one bitset per query.
//!
//! The acceleration structures, pipelines and shader binding table are built
//! once in [`VulkanRtRouter::new`]; a [`Router::route`] call records one
//! command buffer per chunk of queries: upload points, clear masks, trace,
//! threshold, copy back. SPIR-V comes from shaders/*.spv (`cargo xtask shaders`).
//!
//! This module holds the router's state, its teardown and the helpers every
//! part shares; the parts, each an `impl VulkanRtRouter` block:
//! - `device`: instance and device selection, the router's assembly;
//! - `memory`: buffers, their memory, uploads and the one-shot submit;
//! - `accel`: the bottom- and top-level acceleration structures;
//! - `pipeline`: descriptors, shader modules, the ray-tracing and threshold
//!   pipelines and the shader binding table;
//! - `dispatch`: per-batch buffers and a route call's command buffer;
//! - `export`: CUDA interop (exported buffers and timeline semaphores).

use std::ffi::CStr;

use ash::vk;

use crate::{CandidateSet, RouteError, Router, RouterKind, Unavailable};

mod accel;
mod device;
mod dispatch;
mod memory;
mod pipeline;

// CUDA interop (exported buffers and timeline semaphores): a child module so
// it can reach the router's private state.
mod export;
pub use export::{ExportedMemory, InteropExports, InteropRequest};

const RGEN: &[u8] = include_bytes!("../../../../shaders/route.rgen.spv");
const RMISS: &[u8] = include_bytes!("../../../../shaders/route.rmiss.spv");
const RINT: &[u8] = include_bytes!("../../../../shaders/route.rint.spv");
const THRESHOLD: &[u8] = include_bytes!("../../../../shaders/route_threshold.comp.spv");

const REQUIRED_EXTENSIONS: [&CStr; 3] = [
    ash::khr::acceleration_structure::NAME,
    ash::khr::ray_tracing_pipeline::NAME,
    ash::khr::deferred_host_operations::NAME,
];

fn unavailable(reason: Unavailable) -> RouteError {
    RouteError::Unavailable {
        kind: RouterKind::VulkanRt,
        reason,
    }
}

fn vkerr(what: &str) -> impl Fn(vk::Result) -> RouteError + '_ {
    move |e| RouteError::Device {
        kind: RouterKind::VulkanRt,
        message: format!("{what}: {e}"),
    }
}

/// A buffer with its own memory.
struct Buf {
    buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    size: u64,
    mapped: *mut u8,
}

/// Per-batch buffers, grown on demand.
struct Batch {
    capacity_queries: usize,
    points_host: Buf,
    points: Buf,
    masks: Buf,
    out_bits: Buf,
    readback: Buf,
}

impl Batch {
    /// Every buffer of the batch (to destroy them).
    fn buffers(&self) -> [&Buf; 5] {
        [
            &self.points_host,
            &self.points,
            &self.masks,
            &self.out_bits,
            &self.readback,
        ]
    }
}

/// The Vulkan ray-tracing router.
pub struct VulkanRtRouter {
    _entry: ash::Entry,
    instance: ash::Instance,
    device: ash::Device,
    as_fn: ash::khr::acceleration_structure::Device,
    rt_fn: ash::khr::ray_tracing_pipeline::Device,
    device_name: String,
    mem_props: vk::PhysicalDeviceMemoryProperties,
    queue: vk::Queue,
    pool: vk::CommandPool,
    cmd: vk::CommandBuffer,
    fence: vk::Fence,
    slices: usize,
    pages: usize,
    static_bufs: Vec<Buf>,
    offsets: vk::Buffer,
    prim_boxes: vk::Buffer,
    thresholds: vk::Buffer,
    blas: vk::AccelerationStructureKHR,
    tlas: vk::AccelerationStructureKHR,
    set_layout: vk::DescriptorSetLayout,
    pipeline_layout: vk::PipelineLayout,
    rt_pipeline: vk::Pipeline,
    comp_pipeline: vk::Pipeline,
    shader_modules: Vec<vk::ShaderModule>,
    desc_pool: vk::DescriptorPool,
    desc_set: vk::DescriptorSet,
    regions: [vk::StridedDeviceAddressRegionKHR; 4],
    max_launch_width: u32,
    batch: Option<Batch>,
    physical: vk::PhysicalDevice,
    queue_family: u32,
    /// Whether the device was created with the external memory/semaphore
    /// extensions and timeline semaphores ([`VulkanRtRouter::new_interop`]).
    interop_enabled: bool,
    interop: Option<export::InteropState>,
}

// The raw pointers are persistent mappings owned by this router; Vulkan
// handles may move between threads when externally synchronized (&mut self).
unsafe impl Send for VulkanRtRouter {}

impl std::fmt::Debug for VulkanRtRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VulkanRtRouter")
            .field("device", &self.device_name)
            .field("pages", &self.pages)
            .finish()
    }
}

fn spirv(bytes: &[u8]) -> Result<Vec<u32>, RouteError> {
    ash::util::read_spv(&mut std::io::Cursor::new(bytes))
        .map_err(|e| unavailable(Unavailable::Shader(e.to_string())))
}

fn f32_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn align_up(v: u64, a: u64) -> u64 {
    if a <= 1 {
        v
    } else {
        v.div_ceil(a) * a
    }
}

impl VulkanRtRouter {
    /// The chosen device's name.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }
}

impl Router for VulkanRtRouter {
    fn kind(&self) -> RouterKind {
        RouterKind::VulkanRt
    }

    fn route(&mut self, points: &[[f32; 3]]) -> Result<CandidateSet, RouteError> {
        let (slices, pages, chunk) = (self.slices, self.pages, self.chunk_queries());
        crate::route_in_chunks(points, slices, pages, chunk, |pts, bits| {
            self.route_chunk(pts, bits)
        })
    }
}

impl Drop for VulkanRtRouter {
    fn drop(&mut self) {
        // SAFETY: waits for the device, then destroys what this router created; null handles are ignored by Vulkan.
        unsafe {
            let _ = self.device.device_wait_idle();
            if let Some(st) = self.interop.take() {
                self.destroy_interop(st);
            }
            if let Some(b) = self.batch.take() {
                for x in b.buffers() {
                    self.destroy_buf(x);
                }
            }
            self.device.destroy_pipeline(self.rt_pipeline, None);
            self.device.destroy_pipeline(self.comp_pipeline, None);
            for m in self.shader_modules.drain(..) {
                self.device.destroy_shader_module(m, None);
            }
            self.device.destroy_descriptor_pool(self.desc_pool, None);
            self.device
                .destroy_pipeline_layout(self.pipeline_layout, None);
            self.device
                .destroy_descriptor_set_layout(self.set_layout, None);
            self.as_fn.destroy_acceleration_structure(self.tlas, None);
            self.as_fn.destroy_acceleration_structure(self.blas, None);
            for b in std::mem::take(&mut self.static_bufs) {
                self.destroy_buf(&b);
            }
            self.device.destroy_fence(self.fence, None);
            self.device.destroy_command_pool(self.pool, None);
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}
