//! Buffers with their own memory (device-local or host-mapped), uploads
//! through a staging buffer, and the one-shot submit every build and route
//! call records into.

use ash::vk;

use super::{vkerr, Buf, VulkanRtRouter};
use crate::{RouteError, RouterKind};

impl VulkanRtRouter {
    pub(super) fn memory_type(&self, bits: u32, want: vk::MemoryPropertyFlags) -> Option<u32> {
        (0..self.mem_props.memory_type_count).find(|&i| {
            bits & (1 << i) != 0
                && self.mem_props.memory_types[i as usize]
                    .property_flags
                    .contains(want)
        })
    }

    pub(super) fn create_buf(
        &self,
        size: u64,
        usage: vk::BufferUsageFlags,
        host: bool,
    ) -> Result<Buf, RouteError> {
        self.create_buf_cached(size, usage, host, false)
    }

    /// `cached`: prefer host-cached memory (fast CPU reads of results).
    pub(super) fn create_buf_cached(
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

    pub(super) fn destroy_buf(&self, b: &Buf) {
        // SAFETY: the buffer is idle (every submit is waited for) and owned by us.
        unsafe {
            self.device.destroy_buffer(b.buffer, None);
            self.device.free_memory(b.memory, None);
        }
    }

    pub(super) fn address(&self, b: &Buf) -> vk::DeviceAddress {
        // SAFETY: the buffer was created with SHADER_DEVICE_ADDRESS.
        unsafe {
            self.device
                .get_buffer_device_address(&vk::BufferDeviceAddressInfo::default().buffer(b.buffer))
        }
    }

    /// Records into the router's command buffer, submits and waits.
    pub(super) fn submit(&self, record: impl FnOnce(vk::CommandBuffer)) -> Result<(), RouteError> {
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

    pub(super) fn barrier(&self, cmd: vk::CommandBuffer) {
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
    pub(super) fn upload(
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

    pub(super) fn static_address(&self, b: vk::Buffer) -> vk::DeviceAddress {
        let buf = self
            .static_bufs
            .iter()
            .find(|x| x.buffer == b)
            .expect("static buffer");
        self.address(buf)
    }
}
