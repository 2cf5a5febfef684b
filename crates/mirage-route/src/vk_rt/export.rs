//! CUDA–Vulkan interop of the ray-tracing router (a child of `vk_rt`, so it
//! reaches the router's private state).
//!
//! [`VulkanRtRouter::new_interop`] creates the device with
//! `VK_KHR_external_memory(_fd)` and `VK_KHR_external_semaphore(_fd)` and
//! timeline semaphores, then allocates, next to the router's own state:
//! - `points`: device-local, exportable (`OPAQUE_FD`), `max_queries * slices`
//!   slice points (3 f32 each, query-major) that CUDA writes;
//! - `bits`: device-local, exportable, `max_queries * words` u32 candidate
//!   bitsets that the threshold pass writes and CUDA reads;
//! - `ready` and `done`: two exportable timeline semaphores. CUDA signals
//!   `ready` when it has written the points; [`VulkanRtRouter::submit_interop`]
//!   queues (without waiting on the host) one command buffer that waits for
//!   `ready`, traces, thresholds into `bits` and signals `done`, which CUDA
//!   waits for on its stream before reading the bits.
//!
//! Vendor rules followed here: the exported buffers carry
//! `VkExternalMemoryBufferCreateInfo` and their memory
//! `VkExportMemoryAllocateInfo` (dedicated when the driver asks for it; the
//! importer must then pass `CUDA_EXTERNAL_MEMORY_DEDICATED`), CUDA imports the
//! whole allocation (`allocation_size`, not the buffer size), the semaphores
//! are `VK_SEMAPHORE_TYPE_TIMELINE` exported as `OPAQUE_FD` and imported by
//! CUDA as `CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_TIMELINE_SEMAPHORE_FD`, every fd
//! from `vkGet*FdKHR` is a new one whose ownership goes to CUDA on a
//! successful import, and the Vulkan device is matched to the CUDA device by
//! UUID (`VkPhysicalDeviceIDProperties::deviceUUID` = `cuDeviceGetUuid`). Each
//! submission acquires `points` from `VK_QUEUE_FAMILY_EXTERNAL` and releases
//! `bits` to it (queue-family ownership transfer of exclusive external buffers).

use std::ffi::CStr;
use std::os::fd::{FromRawFd, OwnedFd};

use ash::vk;

use super::{unavailable, vkerr, Buf, VulkanRtRouter};
use crate::data::RouterData;
use crate::{RouteError, Unavailable};

/// Device extensions enabled only when interop is asked for.
pub(super) const INTEROP_EXTENSIONS: [&CStr; 4] = [
    ash::khr::external_memory::NAME,
    ash::khr::external_memory_fd::NAME,
    ash::khr::external_semaphore::NAME,
    ash::khr::external_semaphore_fd::NAME,
];

const MEM_HANDLE: vk::ExternalMemoryHandleTypeFlags = vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD;
const SEM_HANDLE: vk::ExternalSemaphoreHandleTypeFlags =
    vk::ExternalSemaphoreHandleTypeFlags::OPAQUE_FD;

/// What the importing (CUDA) side asks of the Vulkan router.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InteropRequest {
    /// Most queries one interop submission routes (the exported buffers are
    /// sized for it); at least 1.
    pub max_queries: usize,
    /// Use only the Vulkan device with this UUID (the CUDA device's
    /// `cuDeviceGetUuid`): memory and semaphores can only be shared within
    /// one physical GPU.
    pub device_uuid: Option<[u8; 16]>,
}

/// One exported device-local allocation.
#[derive(Debug)]
pub struct ExportedMemory {
    /// Opaque fd of the whole allocation (import with
    /// `CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD`; CUDA owns it after a
    /// successful import, so hand it over with `into_raw_fd`).
    pub fd: OwnedFd,
    /// Size of the allocation: the `size` of the CUDA import.
    pub allocation_size: u64,
    /// Bytes the buffer uses, from offset 0 of the allocation.
    pub buffer_size: u64,
    /// A dedicated allocation: the import must pass `CUDA_EXTERNAL_MEMORY_DEDICATED`.
    pub dedicated: bool,
}

/// Everything the CUDA side imports (fresh fds on every export).
#[derive(Debug)]
pub struct InteropExports {
    /// Query points written by CUDA: `max_queries * slices` points of 3 f32,
    /// query-major (`points[(q * slices + s) * 3 + a]`), slice-local (the
    /// router adds the slice offsets itself).
    pub points: ExportedMemory,
    /// Candidate bitsets written by Vulkan: `max_queries * words` u32, bit
    /// `p % 32` of word `q * words + p / 32` set for candidate page `p`.
    pub bits: ExportedMemory,
    /// Timeline semaphore CUDA signals once the points are written.
    pub ready: OwnedFd,
    /// Timeline semaphore Vulkan signals once the bits are written.
    pub done: OwnedFd,
    /// UUID of the Vulkan physical device.
    pub device_uuid: [u8; 16],
    /// Queries the buffers hold.
    pub max_queries: usize,
    /// Slices (points per query).
    pub slices: usize,
    /// Router pages.
    pub pages: usize,
    /// u32 words per query in `bits`.
    pub words: usize,
}

/// An exportable device-local buffer.
struct ExtBuf {
    buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    size: u64,
    alloc_size: u64,
    dedicated: bool,
}

/// The router's interop state (destroyed by the router's Drop).
pub(super) struct InteropState {
    max_queries: usize,
    points: ExtBuf,
    bits: ExtBuf,
    masks: Buf,
    ready: vk::Semaphore,
    done: vk::Semaphore,
    desc_pool: vk::DescriptorPool,
    desc_set: vk::DescriptorSet,
    pool: vk::CommandPool,
    /// Recorded command buffer per query count (`cmds[n - 1]`), null until first use.
    cmds: Vec<vk::CommandBuffer>,
    mem_fd: ash::khr::external_memory_fd::Device,
    sem_fd: ash::khr::external_semaphore_fd::Device,
    uuid: [u8; 16],
}

fn no_interop(msg: impl Into<String>) -> RouteError {
    unavailable(Unavailable::NoInterop(msg.into()))
}

fn device_uuid(instance: &ash::Instance, pd: vk::PhysicalDevice) -> [u8; 16] {
    let mut id = vk::PhysicalDeviceIDProperties::default();
    let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut id);
    // SAFETY: plain query on a live instance (Vulkan 1.1 core).
    unsafe { instance.get_physical_device_properties2(pd, &mut props2) };
    id.device_uuid
}

/// Whether `pd` can serve `req`: Vulkan 1.2 with timeline semaphores, and the
/// requested UUID (extensions are checked by the caller).
pub(super) fn device_fits(
    instance: &ash::Instance,
    pd: vk::PhysicalDevice,
    req: &InteropRequest,
) -> bool {
    // SAFETY: plain queries on a live instance.
    let api = unsafe { instance.get_physical_device_properties(pd) }.api_version;
    if api < vk::API_VERSION_1_2 {
        return false;
    }
    if req
        .device_uuid
        .is_some_and(|u| u != device_uuid(instance, pd))
    {
        return false;
    }
    let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
    let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut f12);
    // SAFETY: the device reports Vulkan 1.2, so the 1.2 feature struct is valid.
    unsafe { instance.get_physical_device_features2(pd, &mut f2) };
    f12.timeline_semaphore == vk::TRUE
}

impl VulkanRtRouter {
    /// A router on the device with `req.device_uuid` (any ray-tracing device
    /// when `None`) that CUDA can feed directly: builds the router as
    /// [`VulkanRtRouter::new`] does, then the exported buffers and semaphores
    /// (see the module docs), and returns their fds.
    pub fn new_interop(
        data: &RouterData,
        req: &InteropRequest,
    ) -> Result<(Self, InteropExports), RouteError> {
        if req.max_queries == 0 {
            return Err(RouteError::InvalidInput(
                "interop max_queries must be at least 1".into(),
            ));
        }
        let mut r = Self::new_inner(data, Some(req))?;
        r.setup_interop(req)?;
        let ex = r.export_interop()?;
        Ok((r, ex))
    }

    /// Fresh fds of the exported buffers and semaphores (each call exports new
    /// ones; the caller owns them until CUDA imports them).
    pub fn export_interop(&self) -> Result<InteropExports, RouteError> {
        let st = self
            .interop
            .as_ref()
            .ok_or_else(|| no_interop("the router was not created by new_interop"))?;
        let mem = |b: &ExtBuf| -> Result<ExportedMemory, RouteError> {
            let info = vk::MemoryGetFdInfoKHR::default()
                .memory(b.memory)
                .handle_type(MEM_HANDLE);
            // SAFETY: the memory was allocated exportable as OPAQUE_FD.
            let fd =
                unsafe { st.mem_fd.get_memory_fd(&info) }.map_err(vkerr("vkGetMemoryFdKHR"))?;
            if fd < 0 {
                return Err(no_interop(format!("vkGetMemoryFdKHR returned fd {fd}")));
            }
            Ok(ExportedMemory {
                // SAFETY: vkGetMemoryFdKHR returns a new fd the application owns.
                fd: unsafe { OwnedFd::from_raw_fd(fd) },
                allocation_size: b.alloc_size,
                buffer_size: b.size,
                dedicated: b.dedicated,
            })
        };
        let sem = |s: vk::Semaphore| -> Result<OwnedFd, RouteError> {
            let info = vk::SemaphoreGetFdInfoKHR::default()
                .semaphore(s)
                .handle_type(SEM_HANDLE);
            // SAFETY: the semaphore was created exportable as OPAQUE_FD.
            let fd = unsafe { st.sem_fd.get_semaphore_fd(&info) }
                .map_err(vkerr("vkGetSemaphoreFdKHR"))?;
            if fd < 0 {
                return Err(no_interop(format!("vkGetSemaphoreFdKHR returned fd {fd}")));
            }
            // SAFETY: a new fd the application owns.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        };
        Ok(InteropExports {
            points: mem(&st.points)?,
            bits: mem(&st.bits)?,
            ready: sem(st.ready)?,
            done: sem(st.done)?,
            device_uuid: st.uuid,
            max_queries: st.max_queries,
            slices: self.slices,
            pages: self.pages,
            words: self.pages.div_ceil(32),
        })
    }

    /// Queues one interop routing of `queries` queries (1..=max_queries) and
    /// returns at once: the device waits until `ready` reaches `wait_value`,
    /// reads the points CUDA wrote, writes the bitsets and signals `done` to
    /// `signal_value` (which must exceed every value signalled before).
    /// Timeline semaphores allow this submission before CUDA's signal.
    pub fn submit_interop(
        &mut self,
        queries: usize,
        wait_value: u64,
        signal_value: u64,
    ) -> Result<(), RouteError> {
        let cmd = self.interop_cmd(queries)?;
        let st = self
            .interop
            .as_ref()
            .ok_or_else(|| no_interop("not an interop router"))?;
        let waits = [st.ready];
        let stages = [vk::PipelineStageFlags::ALL_COMMANDS];
        let signals = [st.done];
        let (wv, sv) = ([wait_value], [signal_value]);
        let mut tl = vk::TimelineSemaphoreSubmitInfo::default()
            .wait_semaphore_values(&wv)
            .signal_semaphore_values(&sv);
        let cmds = [cmd];
        let submit = vk::SubmitInfo::default()
            .wait_semaphores(&waits)
            .wait_dst_stage_mask(&stages)
            .command_buffers(&cmds)
            .signal_semaphores(&signals)
            .push_next(&mut tl);
        // SAFETY: &mut self serializes queue access; the command buffer was
        // recorded with SIMULTANEOUS_USE and only touches interop state.
        unsafe {
            self.device
                .queue_submit(self.queue, &[submit], vk::Fence::null())
        }
        .map_err(vkerr("vkQueueSubmit (interop)"))
    }

    /// Sets `ready` to `value` from the host (tests, or a host-written query).
    pub fn host_signal_ready(&self, value: u64) -> Result<(), RouteError> {
        let st = self
            .interop
            .as_ref()
            .ok_or_else(|| no_interop("not an interop router"))?;
        let info = vk::SemaphoreSignalInfo::default()
            .semaphore(st.ready)
            .value(value);
        // SAFETY: a timeline semaphore of this device.
        unsafe { self.device.signal_semaphore(&info) }.map_err(vkerr("vkSignalSemaphore"))
    }

    /// Waits on the host until `done` reaches `value`; `Ok(false)` on timeout
    /// (a watchdog for callers: a lost signal would otherwise hang CUDA).
    pub fn host_wait_done(&self, value: u64, timeout_ns: u64) -> Result<bool, RouteError> {
        let st = self
            .interop
            .as_ref()
            .ok_or_else(|| no_interop("not an interop router"))?;
        let sems = [st.done];
        let vals = [value];
        let info = vk::SemaphoreWaitInfo::default()
            .semaphores(&sems)
            .values(&vals);
        // SAFETY: a timeline semaphore of this device.
        match unsafe { self.device.wait_semaphores(&info, timeout_ns) } {
            Ok(()) => Ok(true),
            Err(vk::Result::TIMEOUT) => Ok(false),
            Err(e) => Err(vkerr("vkWaitSemaphores")(e)),
        }
    }

    /// Current value of `done`.
    pub fn done_value(&self) -> Result<u64, RouteError> {
        let st = self
            .interop
            .as_ref()
            .ok_or_else(|| no_interop("not an interop router"))?;
        // SAFETY: a timeline semaphore of this device.
        unsafe { self.device.get_semaphore_counter_value(st.done) }
            .map_err(vkerr("vkGetSemaphoreCounterValue"))
    }

    fn interop_cmd(&mut self, queries: usize) -> Result<vk::CommandBuffer, RouteError> {
        let st = self
            .interop
            .as_ref()
            .ok_or_else(|| no_interop("not an interop router"))?;
        if queries == 0 || queries > st.max_queries {
            return Err(RouteError::InvalidInput(format!(
                "{queries} queries for an interop router of at most {}",
                st.max_queries
            )));
        }
        let have = st.cmds[queries - 1];
        if have != vk::CommandBuffer::null() {
            return Ok(have);
        }
        let cmd = self.record_interop(st, queries)?;
        if let Some(st) = self.interop.as_mut() {
            st.cmds[queries - 1] = cmd;
        }
        Ok(cmd)
    }

    fn record_interop(
        &self,
        st: &InteropState,
        queries: usize,
    ) -> Result<vk::CommandBuffer, RouteError> {
        let d = &self.device;
        // SAFETY: the pool is ours; recording state is checked by the calls' results.
        unsafe {
            let cmd = d
                .allocate_command_buffers(
                    &vk::CommandBufferAllocateInfo::default()
                        .command_pool(st.pool)
                        .command_buffer_count(1),
                )
                .map_err(vkerr("vkAllocateCommandBuffers (interop)"))?[0];
            d.begin_command_buffer(
                cmd,
                &vk::CommandBufferBeginInfo::default()
                    .flags(vk::CommandBufferUsageFlags::SIMULTANEOUS_USE),
            )
            .map_err(vkerr("vkBeginCommandBuffer (interop)"))?;
            // Acquire the points CUDA wrote (ownership from the external queue family).
            let acquire = [vk::BufferMemoryBarrier::default()
                .src_access_mask(vk::AccessFlags::empty())
                .dst_access_mask(vk::AccessFlags::SHADER_READ)
                .src_queue_family_index(vk::QUEUE_FAMILY_EXTERNAL)
                .dst_queue_family_index(self.queue_family)
                .buffer(st.points.buffer)
                .offset(0)
                .size(vk::WHOLE_SIZE)];
            d.cmd_pipeline_barrier(
                cmd,
                vk::PipelineStageFlags::TOP_OF_PIPE,
                vk::PipelineStageFlags::ALL_COMMANDS,
                vk::DependencyFlags::empty(),
                &[],
                &acquire,
                &[],
            );
            let mask_bytes = (queries * self.pages * 4) as u64;
            if mask_bytes > 0 {
                d.cmd_fill_buffer(cmd, st.masks.buffer, 0, mask_bytes, 0);
            }
            self.barrier(cmd);
            self.record_trace_and_threshold(cmd, st.desc_set, queries, self.pages > 0);
            // Release the bits to CUDA.
            let release = [vk::BufferMemoryBarrier::default()
                .src_access_mask(vk::AccessFlags::SHADER_WRITE)
                .dst_access_mask(vk::AccessFlags::empty())
                .src_queue_family_index(self.queue_family)
                .dst_queue_family_index(vk::QUEUE_FAMILY_EXTERNAL)
                .buffer(st.bits.buffer)
                .offset(0)
                .size(vk::WHOLE_SIZE)];
            d.cmd_pipeline_barrier(
                cmd,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                vk::DependencyFlags::empty(),
                &[],
                &release,
                &[],
            );
            d.end_command_buffer(cmd)
                .map_err(vkerr("vkEndCommandBuffer (interop)"))?;
            Ok(cmd)
        }
    }

    fn setup_interop(&mut self, req: &InteropRequest) -> Result<(), RouteError> {
        if !self.interop_enabled {
            return Err(no_interop(
                "the device was created without the external memory extensions",
            ));
        }
        if req.max_queries > self.chunk_queries() {
            return Err(RouteError::InvalidInput(format!(
                "interop max_queries {} exceeds the launch limit {}",
                req.max_queries,
                self.chunk_queries()
            )));
        }
        self.check_semaphore_export()?;
        let q = req.max_queries as u64;
        let words = self.pages.div_ceil(32) as u64;
        use vk::BufferUsageFlags as U;
        let mut st = InteropState {
            max_queries: req.max_queries,
            points: ExtBuf::null(),
            bits: ExtBuf::null(),
            masks: Buf {
                buffer: vk::Buffer::null(),
                memory: vk::DeviceMemory::null(),
                size: 0,
                mapped: std::ptr::null_mut(),
            },
            ready: vk::Semaphore::null(),
            done: vk::Semaphore::null(),
            desc_pool: vk::DescriptorPool::null(),
            desc_set: vk::DescriptorSet::null(),
            pool: vk::CommandPool::null(),
            cmds: vec![vk::CommandBuffer::null(); req.max_queries],
            mem_fd: ash::khr::external_memory_fd::Device::new(&self.instance, &self.device),
            sem_fd: ash::khr::external_semaphore_fd::Device::new(&self.instance, &self.device),
            uuid: device_uuid(&self.instance, self.physical),
        };
        // Every step stores its handle in `st` at once, so one cleanup covers every error.
        let res = self.fill_interop(
            &mut st,
            q,
            words,
            U::STORAGE_BUFFER | U::TRANSFER_DST | U::TRANSFER_SRC,
        );
        match res {
            Ok(()) => {
                self.interop = Some(st);
                Ok(())
            }
            Err(e) => {
                self.destroy_interop(st);
                Err(e)
            }
        }
    }

    fn fill_interop(
        &self,
        st: &mut InteropState,
        q: u64,
        words: u64,
        usage: vk::BufferUsageFlags,
    ) -> Result<(), RouteError> {
        self.create_ext_buf(q * self.slices as u64 * 12, usage, &mut st.points)?;
        self.create_ext_buf(q * words * 4, usage, &mut st.bits)?;
        st.masks = self.create_buf(
            q * self.pages as u64 * 4,
            vk::BufferUsageFlags::STORAGE_BUFFER | vk::BufferUsageFlags::TRANSFER_DST,
            false,
        )?;
        st.ready = self.create_ext_semaphore()?;
        st.done = self.create_ext_semaphore()?;
        // SAFETY: valid create infos; handles are stored in `st` and destroyed by destroy_interop.
        unsafe {
            st.pool = self
                .device
                .create_command_pool(
                    &vk::CommandPoolCreateInfo::default().queue_family_index(self.queue_family),
                    None,
                )
                .map_err(vkerr("vkCreateCommandPool (interop)"))?;
        }
        st.desc_pool = self.create_descriptor_pool(" (interop)")?;
        st.desc_set = self.allocate_descriptor_set(st.desc_pool, " (interop)")?;
        // Same bindings as the batch path, with the exported buffers for the
        // points and the bits.
        // SAFETY: the set is new and not in use.
        unsafe {
            self.write_descriptors(
                st.desc_set,
                st.points.buffer,
                st.masks.buffer,
                st.bits.buffer,
            )
        };
        // Defined contents before anything reads them (no NaN ray origins
        // from uninitialized memory if a trace runs before CUDA wrote points).
        let (pb, bb) = (st.points.buffer, st.bits.buffer);
        // SAFETY: recording into the router's idle command buffer; submit waits.
        self.submit(|cmd| unsafe {
            self.device.cmd_fill_buffer(cmd, pb, 0, vk::WHOLE_SIZE, 0);
            self.device.cmd_fill_buffer(cmd, bb, 0, vk::WHOLE_SIZE, 0);
        })
    }

    /// Fails with a typed reason when the driver cannot export timeline semaphores as opaque fds.
    fn check_semaphore_export(&self) -> Result<(), RouteError> {
        let mut ty =
            vk::SemaphoreTypeCreateInfo::default().semaphore_type(vk::SemaphoreType::TIMELINE);
        let info = vk::PhysicalDeviceExternalSemaphoreInfo::default()
            .handle_type(SEM_HANDLE)
            .push_next(&mut ty);
        let mut props = vk::ExternalSemaphoreProperties::default();
        // SAFETY: plain query (Vulkan 1.1 core).
        unsafe {
            self.instance
                .get_physical_device_external_semaphore_properties(self.physical, &info, &mut props)
        };
        if !props
            .external_semaphore_features
            .contains(vk::ExternalSemaphoreFeatureFlags::EXPORTABLE)
        {
            return Err(no_interop(format!(
                "{}: timeline semaphores are not exportable as opaque fds ({:?})",
                self.device_name, props.external_semaphore_features
            )));
        }
        Ok(())
    }

    fn create_ext_semaphore(&self) -> Result<vk::Semaphore, RouteError> {
        let mut ty = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let mut export = vk::ExportSemaphoreCreateInfo::default().handle_types(SEM_HANDLE);
        let info = vk::SemaphoreCreateInfo::default()
            .push_next(&mut ty)
            .push_next(&mut export);
        // SAFETY: valid create info; destroyed by destroy_interop.
        unsafe { self.device.create_semaphore(&info, None) }
            .map_err(vkerr("vkCreateSemaphore (exportable timeline)"))
    }

    /// An exportable device-local buffer into `slot`, which receives each
    /// handle as soon as it exists, so the caller's cleanup frees them on error.
    fn create_ext_buf(
        &self,
        size: u64,
        usage: vk::BufferUsageFlags,
        slot: &mut ExtBuf,
    ) -> Result<(), RouteError> {
        let size = size.max(64);
        let mut props = vk::ExternalBufferProperties::default();
        let query = vk::PhysicalDeviceExternalBufferInfo::default()
            .usage(usage)
            .handle_type(MEM_HANDLE);
        // SAFETY: plain query (Vulkan 1.1 core).
        unsafe {
            self.instance
                .get_physical_device_external_buffer_properties(self.physical, &query, &mut props)
        };
        let features = props.external_memory_properties.external_memory_features;
        if !features.contains(vk::ExternalMemoryFeatureFlags::EXPORTABLE) {
            return Err(no_interop(format!(
                "{}: buffers are not exportable as opaque fds ({features:?})",
                self.device_name
            )));
        }
        let dedicated_only = features.contains(vk::ExternalMemoryFeatureFlags::DEDICATED_ONLY);
        let mut ext = vk::ExternalMemoryBufferCreateInfo::default().handle_types(MEM_HANDLE);
        // SAFETY: valid create infos; handles go to `slot` at once.
        unsafe {
            slot.buffer = self
                .device
                .create_buffer(
                    &vk::BufferCreateInfo::default()
                        .size(size)
                        .usage(usage)
                        .sharing_mode(vk::SharingMode::EXCLUSIVE)
                        .push_next(&mut ext),
                    None,
                )
                .map_err(vkerr("vkCreateBuffer (exportable)"))?;
            slot.size = size;
            let mut ded_req = vk::MemoryDedicatedRequirements::default();
            let mut req2 = vk::MemoryRequirements2::default().push_next(&mut ded_req);
            self.device.get_buffer_memory_requirements2(
                &vk::BufferMemoryRequirementsInfo2::default().buffer(slot.buffer),
                &mut req2,
            );
            let req = req2.memory_requirements;
            let dedicated = dedicated_only
                || ded_req.requires_dedicated_allocation == vk::TRUE
                || ded_req.prefers_dedicated_allocation == vk::TRUE;
            let Some(mt) =
                self.memory_type(req.memory_type_bits, vk::MemoryPropertyFlags::DEVICE_LOCAL)
            else {
                return Err(no_interop(format!(
                    "{}: no device-local memory type for an exportable buffer",
                    self.device_name
                )));
            };
            let mut export = vk::ExportMemoryAllocateInfo::default().handle_types(MEM_HANDLE);
            let mut ded = vk::MemoryDedicatedAllocateInfo::default().buffer(slot.buffer);
            let mut alloc = vk::MemoryAllocateInfo::default()
                .allocation_size(req.size)
                .memory_type_index(mt)
                .push_next(&mut export);
            if dedicated {
                alloc = alloc.push_next(&mut ded);
            }
            slot.memory = self
                .device
                .allocate_memory(&alloc, None)
                .map_err(vkerr("vkAllocateMemory (exportable)"))?;
            slot.alloc_size = req.size;
            slot.dedicated = dedicated;
            self.device
                .bind_buffer_memory(slot.buffer, slot.memory, 0)
                .map_err(vkerr("vkBindBufferMemory (exportable)"))?;
        }
        Ok(())
    }

    /// Destroys interop state (the device must be idle or the state unused).
    pub(super) fn destroy_interop(&self, st: InteropState) {
        // SAFETY: the caller waited for the device (Drop) or nothing was submitted
        // (setup error); null handles are ignored by Vulkan.
        unsafe {
            let _ = self.device.device_wait_idle();
            self.device.destroy_command_pool(st.pool, None); // frees the recorded buffers
            self.device.destroy_descriptor_pool(st.desc_pool, None);
            self.device.destroy_semaphore(st.ready, None);
            self.device.destroy_semaphore(st.done, None);
            for b in [&st.points, &st.bits] {
                self.device.destroy_buffer(b.buffer, None);
                self.device.free_memory(b.memory, None);
            }
            self.device.destroy_buffer(st.masks.buffer, None);
            self.device.free_memory(st.masks.memory, None);
        }
    }
}

impl ExtBuf {
    fn null() -> Self {
        Self {
            buffer: vk::Buffer::null(),
            memory: vk::DeviceMemory::null(),
            size: 0,
            alloc_size: 0,
            dedicated: false,
        }
    }
}
