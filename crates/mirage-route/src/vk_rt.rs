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

use std::ffi::{c_char, CStr};

use ash::vk;

use crate::bvh::Bvh;
use crate::data::RouterData;
use crate::{CandidateSet, RouteError, Router, RouterKind, Unavailable};

// CUDA interop (exported buffers and timeline semaphores): a child module so
// it can reach the router's private state.
#[path = "vk_export.rs"]
mod export;
pub use export::{ExportedMemory, InteropExports, InteropRequest};

const RGEN: &[u8] = include_bytes!("../../../shaders/route.rgen.spv");
const RMISS: &[u8] = include_bytes!("../../../shaders/route.rmiss.spv");
const RINT: &[u8] = include_bytes!("../../../shaders/route.rint.spv");
const THRESHOLD: &[u8] = include_bytes!("../../../shaders/route_threshold.comp.spv");

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

/// Pads a translated AABB coordinate outward, wider than the BVH's own pad,
/// so the hardware's conservative test never misses a box holding the point.
fn rt_pad(v: f32, up: bool) -> f32 {
    let d = v.abs() * 1e-4 + 1e-4;
    if up {
        v + d
    } else {
        v - d
    }
}

impl VulkanRtRouter {
    /// Loads Vulkan, picks the first device with `VK_KHR_ray_tracing_pipeline`,
    /// builds the acceleration structures, pipelines and shader binding table.
    pub fn new(data: &RouterData) -> Result<Self, RouteError> {
        Self::new_inner(data, None)
    }

    fn new_inner(data: &RouterData, interop: Option<&InteropRequest>) -> Result<Self, RouteError> {
        data.validate()?;
        // SAFETY: loading the system Vulkan loader; failure is reported, not fatal.
        let entry = unsafe { ash::Entry::load() }
            .map_err(|e| unavailable(Unavailable::NoVulkan(e.to_string())))?;
        let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_2);
        // SAFETY: valid create info; the instance is destroyed in Drop (or below on error).
        let instance = unsafe {
            entry.create_instance(
                &vk::InstanceCreateInfo::default().application_info(&app),
                None,
            )
        }
        .map_err(|e| unavailable(Unavailable::NoVulkan(format!("vkCreateInstance: {e}"))))?;
        // with_instance owns the instance from here: it destroys it on every error path.
        Self::with_instance(entry, instance, data, interop)
    }

    fn with_instance(
        entry: ash::Entry,
        instance: ash::Instance,
        data: &RouterData,
        interop: Option<&InteropRequest>,
    ) -> Result<Self, RouteError> {
        let (device, qf, device_name, pd) = match Self::pick_device(&instance, interop) {
            Ok(x) => x,
            Err(e) => {
                // SAFETY: nothing else refers to the instance.
                unsafe { instance.destroy_instance(None) };
                return Err(e);
            }
        };
        let objects = (|| unsafe {
            let pool = device
                .create_command_pool(
                    &vk::CommandPoolCreateInfo::default()
                        .queue_family_index(qf)
                        .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER),
                    None,
                )
                .map_err(vkerr("vkCreateCommandPool"))?;
            let cmd = device
                .allocate_command_buffers(
                    &vk::CommandBufferAllocateInfo::default()
                        .command_pool(pool)
                        .command_buffer_count(1),
                )
                .map_err(vkerr("vkAllocateCommandBuffers"))?[0];
            let fence = device
                .create_fence(&vk::FenceCreateInfo::default(), None)
                .map_err(vkerr("vkCreateFence"))?;
            Ok::<_, RouteError>((pool, cmd, fence))
        })();
        let (pool, cmd, fence) = match objects {
            Ok(x) => x,
            Err(e) => {
                // SAFETY: the device is idle and owned here (a pool that was created dies with it).
                unsafe {
                    device.destroy_device(None);
                    instance.destroy_instance(None);
                }
                return Err(e);
            }
        };
        let mut r = Self::assemble(
            entry,
            instance,
            device,
            pd,
            qf,
            device_name,
            pool,
            cmd,
            fence,
            data,
        )?;
        r.interop_enabled = interop.is_some();
        Ok(r)
    }

    fn pick_device(
        instance: &ash::Instance,
        interop: Option<&InteropRequest>,
    ) -> Result<(ash::Device, u32, String, vk::PhysicalDevice), RouteError> {
        // SAFETY: plain queries on a live instance.
        let physicals = unsafe { instance.enumerate_physical_devices() }.map_err(|e| {
            unavailable(Unavailable::NoAdapter(format!(
                "vkEnumeratePhysicalDevices: {e}"
            )))
        })?;
        if physicals.is_empty() {
            return Err(unavailable(Unavailable::NoAdapter(
                "no Vulkan physical device".into(),
            )));
        }
        let mut seen = Vec::new();
        let mut chosen = None;
        let mut rt_without_interop = Vec::new();
        for pd in physicals {
            // SAFETY: pd comes from this instance.
            let props = unsafe { instance.get_physical_device_properties(pd) };
            let name = props
                .device_name_as_c_str()
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
            let exts =
                unsafe { instance.enumerate_device_extension_properties(pd) }.unwrap_or_default();
            let has = |want: &CStr| exts.iter().any(|e| e.extension_name_as_c_str() == Ok(want));
            let qf = unsafe { instance.get_physical_device_queue_family_properties(pd) }
                .iter()
                .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE));
            let interop_ok = match interop {
                None => true,
                Some(req) => {
                    export::INTEROP_EXTENSIONS.iter().all(|e| has(e))
                        && export::device_fits(instance, pd, req)
                }
            };
            let rt_ok = qf.is_some()
                && REQUIRED_EXTENSIONS.iter().all(|e| has(e))
                && props.api_version >= vk::API_VERSION_1_2;
            if let Some(qf) = qf.filter(|_| rt_ok && interop_ok) {
                chosen = Some((pd, name, qf as u32));
                break;
            }
            if rt_ok {
                rt_without_interop.push(name.clone());
            }
            seen.push(name);
        }
        let Some((pd, device_name, qf)) = chosen else {
            if !rt_without_interop.is_empty() {
                return Err(unavailable(Unavailable::NoInterop(format!(
                    "ray-tracing devices without external fd memory/semaphores, timeline semaphores or the CUDA device's UUID: {}",
                    rt_without_interop.join(", ")
                ))));
            }
            return Err(unavailable(Unavailable::NoRayTracing(seen.join(", "))));
        };

        let prios = [1.0f32];
        let queue_info = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(qf)
            .queue_priorities(&prios)];
        let mut ext_names: Vec<*const c_char> =
            REQUIRED_EXTENSIONS.iter().map(|e| e.as_ptr()).collect();
        if interop.is_some() {
            ext_names.extend(export::INTEROP_EXTENSIONS.iter().map(|e| e.as_ptr()));
        }
        let mut f12 = vk::PhysicalDeviceVulkan12Features::default()
            .buffer_device_address(true)
            .timeline_semaphore(interop.is_some());
        let mut f_as = vk::PhysicalDeviceAccelerationStructureFeaturesKHR::default()
            .acceleration_structure(true);
        let mut f_rt =
            vk::PhysicalDeviceRayTracingPipelineFeaturesKHR::default().ray_tracing_pipeline(true);
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queue_info)
            .enabled_extension_names(&ext_names)
            .push_next(&mut f12)
            .push_next(&mut f_as)
            .push_next(&mut f_rt);
        // SAFETY: extensions and features were checked above (features: the device create fails cleanly if not).
        let device = unsafe { instance.create_device(pd, &info, None) }.map_err(|e| {
            unavailable(Unavailable::NoRayTracing(format!(
                "{device_name}: vkCreateDevice: {e}"
            )))
        })?;
        Ok((device, qf, device_name, pd))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        entry: ash::Entry,
        instance: ash::Instance,
        device: ash::Device,
        pd: vk::PhysicalDevice,
        qf: u32,
        device_name: String,
        pool: vk::CommandPool,
        cmd: vk::CommandBuffer,
        fence: vk::Fence,
        data: &RouterData,
    ) -> Result<Self, RouteError> {
        let mut rt_props = vk::PhysicalDeviceRayTracingPipelinePropertiesKHR::default();
        let mut as_props = vk::PhysicalDeviceAccelerationStructurePropertiesKHR::default();
        let mut props2 = vk::PhysicalDeviceProperties2::default()
            .push_next(&mut rt_props)
            .push_next(&mut as_props);
        // SAFETY: live instance and device.
        unsafe { instance.get_physical_device_properties2(pd, &mut props2) };
        let limits = props2.properties.limits;
        let mem_props = unsafe { instance.get_physical_device_memory_properties(pd) };
        let queue = unsafe { device.get_device_queue(qf, 0) };
        let as_fn = ash::khr::acceleration_structure::Device::new(&instance, &device);
        let rt_fn = ash::khr::ray_tracing_pipeline::Device::new(&instance, &device);

        let mut r = Self {
            _entry: entry,
            instance,
            device,
            as_fn,
            rt_fn,
            device_name,
            mem_props,
            queue,
            pool,
            cmd,
            fence,
            slices: data.slices,
            pages: data.pages(),
            static_bufs: Vec::new(),
            offsets: vk::Buffer::null(),
            prim_boxes: vk::Buffer::null(),
            thresholds: vk::Buffer::null(),
            blas: vk::AccelerationStructureKHR::null(),
            tlas: vk::AccelerationStructureKHR::null(),
            set_layout: vk::DescriptorSetLayout::null(),
            pipeline_layout: vk::PipelineLayout::null(),
            rt_pipeline: vk::Pipeline::null(),
            comp_pipeline: vk::Pipeline::null(),
            shader_modules: Vec::new(),
            desc_pool: vk::DescriptorPool::null(),
            desc_set: vk::DescriptorSet::null(),
            regions: [vk::StridedDeviceAddressRegionKHR::default(); 4],
            max_launch_width: limits.max_compute_work_group_count[0].min(1 << 20),
            batch: None,
            physical: pd,
            queue_family: qf,
            interop_enabled: false,
            interop: None,
        };
        // From here on, Drop cleans up whatever was created (null handles are skipped).
        r.build_static(data, &rt_props, &as_props)?;
        Ok(r)
    }

    /// The chosen device's name.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    fn memory_type(&self, bits: u32, want: vk::MemoryPropertyFlags) -> Option<u32> {
        (0..self.mem_props.memory_type_count).find(|&i| {
            bits & (1 << i) != 0
                && self.mem_props.memory_types[i as usize]
                    .property_flags
                    .contains(want)
        })
    }

    fn create_buf(
        &self,
        size: u64,
        usage: vk::BufferUsageFlags,
        host: bool,
    ) -> Result<Buf, RouteError> {
        self.create_buf_cached(size, usage, host, false)
    }

    /// `cached`: prefer host-cached memory (fast CPU reads of results).
    fn create_buf_cached(
        &self,
        size: u64,
        usage: vk::BufferUsageFlags,
        host: bool,
        cached: bool,
    ) -> Result<Buf, RouteError> {
        let size = size.max(64);
        let usage = usage | vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS;
        // SAFETY: valid create infos; the buffer and memory are freed by destroy_buf.
        unsafe {
            let buffer = self
                .device
                .create_buffer(
                    &vk::BufferCreateInfo::default().size(size).usage(usage),
                    None,
                )
                .map_err(vkerr("vkCreateBuffer"))?;
            let req = self.device.get_buffer_memory_requirements(buffer);
            let want = if host {
                vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT
            } else {
                vk::MemoryPropertyFlags::DEVICE_LOCAL
            };
            let cached_type = if cached {
                self.memory_type(
                    req.memory_type_bits,
                    want | vk::MemoryPropertyFlags::HOST_CACHED,
                )
            } else {
                None
            };
            let Some(mt) = cached_type.or_else(|| self.memory_type(req.memory_type_bits, want))
            else {
                self.device.destroy_buffer(buffer, None);
                return Err(RouteError::Device {
                    kind: RouterKind::VulkanRt,
                    message: format!("no memory type {want:?}"),
                });
            };
            let mut flags = vk::MemoryAllocateFlagsInfo::default()
                .flags(vk::MemoryAllocateFlags::DEVICE_ADDRESS);
            let alloc = vk::MemoryAllocateInfo::default()
                .allocation_size(req.size)
                .memory_type_index(mt)
                .push_next(&mut flags);
            let memory = match self.device.allocate_memory(&alloc, None) {
                Ok(m) => m,
                Err(e) => {
                    self.device.destroy_buffer(buffer, None);
                    return Err(vkerr("vkAllocateMemory")(e));
                }
            };
            self.device
                .bind_buffer_memory(buffer, memory, 0)
                .map_err(vkerr("vkBindBufferMemory"))?;
            let mapped = if host {
                self.device
                    .map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty())
                    .map_err(vkerr("vkMapMemory"))? as *mut u8
            } else {
                std::ptr::null_mut()
            };
            Ok(Buf {
                buffer,
                memory,
                size,
                mapped,
            })
        }
    }

    fn destroy_buf(&self, b: &Buf) {
        // SAFETY: the buffer is idle (every submit is waited for) and owned by us.
        unsafe {
            self.device.destroy_buffer(b.buffer, None);
            self.device.free_memory(b.memory, None);
        }
    }

    fn address(&self, b: &Buf) -> vk::DeviceAddress {
        // SAFETY: the buffer was created with SHADER_DEVICE_ADDRESS.
        unsafe {
            self.device
                .get_buffer_device_address(&vk::BufferDeviceAddressInfo::default().buffer(b.buffer))
        }
    }

    /// Records into the router's command buffer, submits and waits.
    fn submit(&self, record: impl FnOnce(vk::CommandBuffer)) -> Result<(), RouteError> {
        // SAFETY: the command buffer is idle (we always wait on the fence).
        unsafe {
            self.device
                .reset_command_buffer(self.cmd, vk::CommandBufferResetFlags::empty())
                .map_err(vkerr("vkResetCommandBuffer"))?;
            self.device
                .begin_command_buffer(
                    self.cmd,
                    &vk::CommandBufferBeginInfo::default()
                        .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
                )
                .map_err(vkerr("vkBeginCommandBuffer"))?;
            // Device writes of earlier submissions (AS builds, uploads) become
            // visible here; the fence wait alone only orders them for the host.
            self.barrier(self.cmd);
            record(self.cmd);
            self.device
                .end_command_buffer(self.cmd)
                .map_err(vkerr("vkEndCommandBuffer"))?;
            let cmds = [self.cmd];
            self.device
                .queue_submit(
                    self.queue,
                    &[vk::SubmitInfo::default().command_buffers(&cmds)],
                    self.fence,
                )
                .map_err(vkerr("vkQueueSubmit"))?;
            self.device
                .wait_for_fences(&[self.fence], true, u64::MAX)
                .map_err(vkerr("vkWaitForFences"))?;
            self.device
                .reset_fences(&[self.fence])
                .map_err(vkerr("vkResetFences"))?;
        }
        Ok(())
    }

    fn barrier(&self, cmd: vk::CommandBuffer) {
        let mb = [vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::MEMORY_WRITE)
            .dst_access_mask(vk::AccessFlags::MEMORY_READ | vk::AccessFlags::MEMORY_WRITE)];
        // SAFETY: recording state.
        unsafe {
            self.device.cmd_pipeline_barrier(
                cmd,
                vk::PipelineStageFlags::ALL_COMMANDS,
                vk::PipelineStageFlags::ALL_COMMANDS,
                vk::DependencyFlags::empty(),
                &mb,
                &[],
                &[],
            )
        };
    }

    /// A device-local buffer holding `bytes` (uploaded through a staging buffer).
    fn upload(
        &mut self,
        bytes: &[u8],
        usage: vk::BufferUsageFlags,
    ) -> Result<vk::Buffer, RouteError> {
        let staging =
            self.create_buf(bytes.len() as u64, vk::BufferUsageFlags::TRANSFER_SRC, true)?;
        // SAFETY: mapped host-coherent memory of at least bytes.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), staging.mapped, bytes.len()) };
        let dst = self.create_buf(
            bytes.len() as u64,
            usage | vk::BufferUsageFlags::TRANSFER_DST,
            false,
        )?;
        let size = staging.size;
        let res = self.submit(|cmd| unsafe {
            self.device.cmd_copy_buffer(
                cmd,
                staging.buffer,
                dst.buffer,
                &[vk::BufferCopy::default().size(size)],
            );
        });
        self.destroy_buf(&staging);
        let handle = dst.buffer;
        self.static_bufs.push(dst);
        res.map(|_| handle)
    }

    fn static_address(&self, b: vk::Buffer) -> vk::DeviceAddress {
        let buf = self
            .static_bufs
            .iter()
            .find(|x| x.buffer == b)
            .expect("static buffer");
        self.address(buf)
    }

    fn build_as(
        &mut self,
        ty: vk::AccelerationStructureTypeKHR,
        geometry: vk::AccelerationStructureGeometryKHR<'_>,
        count: u32,
        scratch_align: u64,
    ) -> Result<vk::AccelerationStructureKHR, RouteError> {
        let geometries = [geometry];
        let mut build = vk::AccelerationStructureBuildGeometryInfoKHR::default()
            .ty(ty)
            .flags(vk::BuildAccelerationStructureFlagsKHR::PREFER_FAST_TRACE)
            .mode(vk::BuildAccelerationStructureModeKHR::BUILD)
            .geometries(&geometries);
        let mut sizes = vk::AccelerationStructureBuildSizesInfoKHR::default();
        // SAFETY: valid build info.
        unsafe {
            self.as_fn.get_acceleration_structure_build_sizes(
                vk::AccelerationStructureBuildTypeKHR::DEVICE,
                &build,
                &[count],
                &mut sizes,
            )
        };
        let storage = self.create_buf(
            sizes.acceleration_structure_size,
            vk::BufferUsageFlags::ACCELERATION_STRUCTURE_STORAGE_KHR,
            false,
        )?;
        let scratch = self.create_buf(
            sizes.build_scratch_size + scratch_align,
            vk::BufferUsageFlags::STORAGE_BUFFER,
            false,
        )?;
        // SAFETY: storage buffer is large enough per the size query.
        let accel = unsafe {
            self.as_fn.create_acceleration_structure(
                &vk::AccelerationStructureCreateInfoKHR::default()
                    .buffer(storage.buffer)
                    .size(sizes.acceleration_structure_size)
                    .ty(ty),
                None,
            )
        };
        let accel = match accel {
            Ok(a) => a,
            Err(e) => {
                self.destroy_buf(&scratch);
                self.destroy_buf(&storage);
                return Err(vkerr("vkCreateAccelerationStructureKHR")(e));
            }
        };
        build = build
            .dst_acceleration_structure(accel)
            .scratch_data(vk::DeviceOrHostAddressKHR {
                device_address: align_up(self.address(&scratch), scratch_align),
            });
        let range = [vk::AccelerationStructureBuildRangeInfoKHR::default().primitive_count(count)];
        let res = self.submit(|cmd| unsafe {
            self.as_fn.cmd_build_acceleration_structures(
                cmd,
                std::slice::from_ref(&build),
                &[&range],
            );
        });
        self.destroy_buf(&scratch);
        self.static_bufs.push(storage);
        res.map(|_| accel)
    }

    fn build_static(
        &mut self,
        data: &RouterData,
        rt_props: &vk::PhysicalDeviceRayTracingPipelinePropertiesKHR<'_>,
        as_props: &vk::PhysicalDeviceAccelerationStructurePropertiesKHR<'_>,
    ) -> Result<(), RouteError> {
        // The BVH module decides the slice offsets; the RT scene uses the same ones.
        let offsets = Bvh::build(data)?.slice_offsets;
        let (slices, pages) = (self.slices, self.pages);
        let mut boxes = Vec::with_capacity(pages * slices * 6);
        let mut aabbs = Vec::with_capacity(pages * slices * 6);
        for (s, off) in offsets.iter().enumerate() {
            for p in 0..pages {
                let b = data.page_box(p, s);
                boxes.extend(b.min.iter().chain(b.max.iter()).copied());
                let mut t = *b;
                t.min[0] += off;
                t.max[0] += off;
                aabbs.extend(
                    t.min
                        .map(|v| rt_pad(v, false))
                        .into_iter()
                        .chain(t.max.map(|v| rt_pad(v, true))),
                );
            }
        }
        let ro = vk::BufferUsageFlags::STORAGE_BUFFER;
        self.offsets = self.upload(&f32_bytes(offsets.iter().copied()), ro)?;
        self.prim_boxes = self.upload(&f32_bytes(boxes), ro)?;
        self.thresholds = self.upload(
            &data
                .thresholds
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect::<Vec<u8>>(),
            ro,
        )?;

        let scratch_align = as_props.min_acceleration_structure_scratch_offset_alignment as u64;
        let n_prims = (pages * slices) as u32;
        if n_prims > 0 {
            let aabb_buf = self.upload(
                &f32_bytes(aabbs),
                vk::BufferUsageFlags::ACCELERATION_STRUCTURE_BUILD_INPUT_READ_ONLY_KHR,
            )?;
            let geometry = vk::AccelerationStructureGeometryKHR::default()
                .geometry_type(vk::GeometryTypeKHR::AABBS)
                .flags(vk::GeometryFlagsKHR::NO_DUPLICATE_ANY_HIT_INVOCATION)
                .geometry(vk::AccelerationStructureGeometryDataKHR {
                    aabbs: vk::AccelerationStructureGeometryAabbsDataKHR::default()
                        .data(vk::DeviceOrHostAddressConstKHR {
                            device_address: self.static_address(aabb_buf),
                        })
                        .stride(24),
                });
            self.blas = self.build_as(
                vk::AccelerationStructureTypeKHR::BOTTOM_LEVEL,
                geometry,
                n_prims,
                scratch_align,
            )?;
        }
        // One instance, identity transform; with no pages the TLAS is empty.
        let mut instance = Vec::with_capacity(64);
        if n_prims > 0 {
            let blas_addr = unsafe {
                self.as_fn.get_acceleration_structure_device_address(
                    &vk::AccelerationStructureDeviceAddressInfoKHR::default()
                        .acceleration_structure(self.blas),
                )
            };
            instance.extend(f32_bytes([
                1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0,
            ]));
            instance.extend((0xFFu32 << 24).to_le_bytes()); // custom index 0, mask 0xFF
            let flags = vk::GeometryInstanceFlagsKHR::TRIANGLE_FACING_CULL_DISABLE.as_raw();
            instance.extend((flags << 24).to_le_bytes()); // SBT offset 0
            instance.extend(blas_addr.to_le_bytes());
        } else {
            instance.resize(64, 0);
        }
        let inst_buf = self.upload(
            &instance,
            vk::BufferUsageFlags::ACCELERATION_STRUCTURE_BUILD_INPUT_READ_ONLY_KHR,
        )?;
        let geometry = vk::AccelerationStructureGeometryKHR::default()
            .geometry_type(vk::GeometryTypeKHR::INSTANCES)
            .geometry(vk::AccelerationStructureGeometryDataKHR {
                instances: vk::AccelerationStructureGeometryInstancesDataKHR::default()
                    .array_of_pointers(false)
                    .data(vk::DeviceOrHostAddressConstKHR {
                        device_address: self.static_address(inst_buf),
                    }),
            });
        self.tlas = self.build_as(
            vk::AccelerationStructureTypeKHR::TOP_LEVEL,
            geometry,
            u32::from(n_prims > 0),
            scratch_align,
        )?;

        // Descriptor set layout: 0 = TLAS, 1..=6 = storage buffers (see shaders/route_common.glsl).
        let mut bindings = vec![vk::DescriptorSetLayoutBinding::default()
            .binding(0)
            .descriptor_type(vk::DescriptorType::ACCELERATION_STRUCTURE_KHR)
            .descriptor_count(1)
            .stage_flags(vk::ShaderStageFlags::ALL)];
        for b in 1..=6 {
            bindings.push(
                vk::DescriptorSetLayoutBinding::default()
                    .binding(b)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::ALL),
            );
        }
        let push = [vk::PushConstantRange::default()
            .stage_flags(vk::ShaderStageFlags::ALL)
            .size(16)];
        // SAFETY: valid create infos; handles are destroyed in Drop.
        unsafe {
            self.set_layout = self
                .device
                .create_descriptor_set_layout(
                    &vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings),
                    None,
                )
                .map_err(vkerr("vkCreateDescriptorSetLayout"))?;
            let layouts = [self.set_layout];
            self.pipeline_layout = self
                .device
                .create_pipeline_layout(
                    &vk::PipelineLayoutCreateInfo::default()
                        .set_layouts(&layouts)
                        .push_constant_ranges(&push),
                    None,
                )
                .map_err(vkerr("vkCreatePipelineLayout"))?;
            let sizes = [
                vk::DescriptorPoolSize::default()
                    .ty(vk::DescriptorType::ACCELERATION_STRUCTURE_KHR)
                    .descriptor_count(1),
                vk::DescriptorPoolSize::default()
                    .ty(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(6),
            ];
            self.desc_pool = self
                .device
                .create_descriptor_pool(
                    &vk::DescriptorPoolCreateInfo::default()
                        .max_sets(1)
                        .pool_sizes(&sizes),
                    None,
                )
                .map_err(vkerr("vkCreateDescriptorPool"))?;
            self.desc_set = self
                .device
                .allocate_descriptor_sets(
                    &vk::DescriptorSetAllocateInfo::default()
                        .descriptor_pool(self.desc_pool)
                        .set_layouts(&layouts),
                )
                .map_err(vkerr("vkAllocateDescriptorSets"))?[0];
        }

        let mut module = |bytes: &[u8]| -> Result<vk::ShaderModule, RouteError> {
            let code = spirv(bytes)?;
            // SAFETY: SPIR-V words from the committed shaders.
            let m = unsafe {
                self.device
                    .create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&code), None)
            }
            .map_err(|e| unavailable(Unavailable::Shader(format!("vkCreateShaderModule: {e}"))))?;
            self.shader_modules.push(m);
            Ok(m)
        };
        let (rgen, rmiss, rint, comp) = (
            module(RGEN)?,
            module(RMISS)?,
            module(RINT)?,
            module(THRESHOLD)?,
        );
        let main = c"main";
        let stages = [
            vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::RAYGEN_KHR)
                .module(rgen)
                .name(main),
            vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::MISS_KHR)
                .module(rmiss)
                .name(main),
            vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::INTERSECTION_KHR)
                .module(rint)
                .name(main),
        ];
        let general = |i: u32| {
            vk::RayTracingShaderGroupCreateInfoKHR::default()
                .ty(vk::RayTracingShaderGroupTypeKHR::GENERAL)
                .general_shader(i)
                .closest_hit_shader(vk::SHADER_UNUSED_KHR)
                .any_hit_shader(vk::SHADER_UNUSED_KHR)
                .intersection_shader(vk::SHADER_UNUSED_KHR)
        };
        let groups = [
            general(0),
            general(1),
            vk::RayTracingShaderGroupCreateInfoKHR::default()
                .ty(vk::RayTracingShaderGroupTypeKHR::PROCEDURAL_HIT_GROUP)
                .general_shader(vk::SHADER_UNUSED_KHR)
                .closest_hit_shader(vk::SHADER_UNUSED_KHR)
                .any_hit_shader(vk::SHADER_UNUSED_KHR)
                .intersection_shader(2),
        ];
        let rt_info = vk::RayTracingPipelineCreateInfoKHR::default()
            .stages(&stages)
            .groups(&groups)
            .max_pipeline_ray_recursion_depth(1)
            .layout(self.pipeline_layout);
        // SAFETY: valid create infos.
        unsafe {
            self.rt_pipeline = self
                .rt_fn
                .create_ray_tracing_pipelines(
                    vk::DeferredOperationKHR::null(),
                    vk::PipelineCache::null(),
                    &[rt_info],
                    None,
                )
                .map_err(|(_, e)| {
                    unavailable(Unavailable::Shader(format!(
                        "vkCreateRayTracingPipelinesKHR: {e}"
                    )))
                })?[0];
            let cs = vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::COMPUTE)
                .module(comp)
                .name(main);
            self.comp_pipeline = self
                .device
                .create_compute_pipelines(
                    vk::PipelineCache::null(),
                    &[vk::ComputePipelineCreateInfo::default()
                        .stage(cs)
                        .layout(self.pipeline_layout)],
                    None,
                )
                .map_err(|(_, e)| {
                    unavailable(Unavailable::Shader(format!(
                        "vkCreateComputePipelines: {e}"
                    )))
                })?[0];
        }

        // Shader binding table: raygen | miss | hit, each region aligned to the base alignment.
        let handle_size = rt_props.shader_group_handle_size as u64;
        let stride = align_up(handle_size, rt_props.shader_group_handle_alignment as u64);
        let base = (rt_props.shader_group_base_alignment as u64).max(1);
        let region = align_up(stride, base);
        // SAFETY: the pipeline has 3 groups.
        let handles = unsafe {
            self.rt_fn.get_ray_tracing_shader_group_handles(
                self.rt_pipeline,
                0,
                3,
                3 * handle_size as usize,
            )
        }
        .map_err(vkerr("vkGetRayTracingShaderGroupHandlesKHR"))?;
        let mut sbt = vec![0u8; (3 * region + base) as usize];
        for g in 0..3 {
            let h = &handles[g * handle_size as usize..][..handle_size as usize];
            sbt[g * region as usize..][..handle_size as usize].copy_from_slice(h);
        }
        // The buffer may start at any device address: leave `base` bytes of slack and
        // shift the table to an aligned start by uploading it at that offset.
        let sbt_buf = self.create_buf(
            sbt.len() as u64,
            vk::BufferUsageFlags::SHADER_BINDING_TABLE_KHR | vk::BufferUsageFlags::TRANSFER_DST,
            false,
        )?;
        let addr = self.address(&sbt_buf);
        let start = align_up(addr, base);
        let shift = (start - addr) as usize;
        let mut shifted = vec![0u8; sbt.len()];
        shifted[shift..].copy_from_slice(&sbt[..sbt.len() - shift]);
        let staging = self.create_buf(
            shifted.len() as u64,
            vk::BufferUsageFlags::TRANSFER_SRC,
            true,
        )?;
        unsafe { std::ptr::copy_nonoverlapping(shifted.as_ptr(), staging.mapped, shifted.len()) };
        let len = shifted.len() as u64;
        let res = self.submit(|cmd| unsafe {
            self.device.cmd_copy_buffer(
                cmd,
                staging.buffer,
                sbt_buf.buffer,
                &[vk::BufferCopy::default().size(len)],
            );
        });
        self.destroy_buf(&staging);
        self.static_bufs.push(sbt_buf);
        res?;
        let reg = |i: u64, size: u64| {
            vk::StridedDeviceAddressRegionKHR::default()
                .device_address(start + i * region)
                .stride(if i == 0 { region } else { stride })
                .size(size)
        };
        self.regions = [
            reg(0, region),
            reg(1, stride),
            reg(2, stride),
            vk::StridedDeviceAddressRegionKHR::default(),
        ];
        Ok(())
    }

    fn ensure_batch(&mut self, queries: usize) -> Result<(), RouteError> {
        if self
            .batch
            .as_ref()
            .is_some_and(|b| b.capacity_queries >= queries)
        {
            return Ok(());
        }
        if let Some(old) = self.batch.take() {
            for b in [
                &old.points_host,
                &old.points,
                &old.masks,
                &old.out_bits,
                &old.readback,
            ] {
                self.destroy_buf(b);
            }
        }
        let words = self.pages.div_ceil(32) as u64;
        let q = queries as u64;
        use vk::BufferUsageFlags as U;
        let points_bytes = q * self.slices as u64 * 12;
        let batch = Batch {
            capacity_queries: queries,
            points_host: self.create_buf(points_bytes, U::TRANSFER_SRC, true)?,
            points: self.create_buf(points_bytes, U::STORAGE_BUFFER | U::TRANSFER_DST, false)?,
            masks: self.create_buf(
                q * self.pages as u64 * 4,
                U::STORAGE_BUFFER | U::TRANSFER_DST,
                false,
            )?,
            out_bits: self.create_buf(q * words * 4, U::STORAGE_BUFFER | U::TRANSFER_SRC, false)?,
            readback: self.create_buf_cached(q * words * 4, U::TRANSFER_DST, true, true)?,
        };
        // SAFETY: the set is not in use (every submit is waited for).
        unsafe {
            self.write_descriptors(
                self.desc_set,
                batch.points.buffer,
                batch.masks.buffer,
                batch.out_bits.buffer,
            )
        };
        self.batch = Some(batch);
        Ok(())
    }

    /// Points `set` at the TLAS, the router's buffers and the given points,
    /// masks and output-bits buffers (the bindings of
    /// shaders/route_common.glsl), for the batch and the interop paths.
    ///
    /// # Safety
    /// `set` must not be in use by a pending command buffer.
    pub(crate) unsafe fn write_descriptors(
        &self,
        set: vk::DescriptorSet,
        points: vk::Buffer,
        masks: vk::Buffer,
        bits: vk::Buffer,
    ) {
        let tlas = [self.tlas];
        let mut as_write = vk::WriteDescriptorSetAccelerationStructureKHR::default()
            .acceleration_structures(&tlas);
        let infos: Vec<[vk::DescriptorBufferInfo; 1]> = [
            points,
            self.offsets,
            self.prim_boxes,
            masks,
            self.thresholds,
            bits,
        ]
        .iter()
        .map(|&b| {
            [vk::DescriptorBufferInfo::default()
                .buffer(b)
                .range(vk::WHOLE_SIZE)]
        })
        .collect();
        let mut writes = vec![vk::WriteDescriptorSet::default()
            .dst_set(set)
            .dst_binding(0)
            .descriptor_type(vk::DescriptorType::ACCELERATION_STRUCTURE_KHR)
            .descriptor_count(1)
            .push_next(&mut as_write)];
        for (i, info) in infos.iter().enumerate() {
            writes.push(
                vk::WriteDescriptorSet::default()
                    .dst_set(set)
                    .dst_binding(i as u32 + 1)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .buffer_info(info),
            );
        }
        // SAFETY: the caller guarantees the set is idle; every info outlives the call.
        unsafe { self.device.update_descriptor_sets(&writes, &[]) };
    }

    /// Most queries per chunk: masks of at most 512 MiB, launch width within limits.
    fn chunk_queries(&self) -> usize {
        let per_query = (self.pages.max(1) * 4) as u64;
        ((512u64 << 20) / per_query).clamp(1, self.max_launch_width as u64) as usize
    }

    fn route_chunk(&mut self, points: &[[f32; 3]], out: &mut [u32]) -> Result<(), RouteError> {
        let queries = points.len() / self.slices;
        let words = self.pages.div_ceil(32);
        self.ensure_batch(queries)?;
        let b = self.batch.as_ref().expect("ensured");
        let bytes = f32_bytes(points.iter().flatten().copied());
        // SAFETY: the host buffer holds capacity_queries * slices * 12 >= bytes.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.points_host.mapped, bytes.len()) };
        let push: Vec<u8> = [
            queries as u32,
            self.slices as u32,
            self.pages as u32,
            words as u32,
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
        let out_bytes = (queries * words * 4) as u64;
        let groups = (queries * words).div_ceil(64).max(1) as u32;
        let (gx, gy) = (groups.min(65535), groups.div_ceil(65535));
        self.submit(|cmd| unsafe {
            let d = &self.device;
            if !bytes.is_empty() {
                d.cmd_copy_buffer(
                    cmd,
                    b.points_host.buffer,
                    b.points.buffer,
                    &[vk::BufferCopy::default().size(bytes.len() as u64)],
                );
            }
            d.cmd_fill_buffer(cmd, b.masks.buffer, 0, vk::WHOLE_SIZE, 0);
            self.barrier(cmd);
            d.cmd_push_constants(
                cmd,
                self.pipeline_layout,
                vk::ShaderStageFlags::ALL,
                0,
                &push,
            );
            if self.pages > 0 && queries > 0 {
                d.cmd_bind_pipeline(
                    cmd,
                    vk::PipelineBindPoint::RAY_TRACING_KHR,
                    self.rt_pipeline,
                );
                d.cmd_bind_descriptor_sets(
                    cmd,
                    vk::PipelineBindPoint::RAY_TRACING_KHR,
                    self.pipeline_layout,
                    0,
                    &[self.desc_set],
                    &[],
                );
                let r = &self.regions;
                self.rt_fn.cmd_trace_rays(
                    cmd,
                    &r[0],
                    &r[1],
                    &r[2],
                    &r[3],
                    queries as u32,
                    self.slices as u32,
                    1,
                );
                self.barrier(cmd);
            }
            d.cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, self.comp_pipeline);
            d.cmd_bind_descriptor_sets(
                cmd,
                vk::PipelineBindPoint::COMPUTE,
                self.pipeline_layout,
                0,
                &[self.desc_set],
                &[],
            );
            d.cmd_dispatch(cmd, gx, gy, 1);
            self.barrier(cmd);
            if out_bytes > 0 {
                d.cmd_copy_buffer(
                    cmd,
                    b.out_bits.buffer,
                    b.readback.buffer,
                    &[vk::BufferCopy::default().size(out_bytes)],
                );
            }
            // Make the transfer visible to the host read below.
            let mb = [vk::MemoryBarrier::default()
                .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                .dst_access_mask(vk::AccessFlags::HOST_READ)];
            d.cmd_pipeline_barrier(
                cmd,
                vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::HOST,
                vk::DependencyFlags::empty(),
                &mb,
                &[],
                &[],
            );
        })?;
        // SAFETY: host-coherent mapping, the fence was waited for.
        let view = unsafe { std::slice::from_raw_parts(b.readback.mapped, out_bytes as usize) };
        for (o, c) in out.iter_mut().zip(view.chunks_exact(4)) {
            *o = u32::from_le_bytes(c.try_into().expect("4 bytes"));
        }
        Ok(())
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
                for x in [
                    &b.points_host,
                    &b.points,
                    &b.masks,
                    &b.out_bits,
                    &b.readback,
                ] {
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
