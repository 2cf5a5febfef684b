//! A route call on the device: per-batch buffers grown on demand, the
//! descriptor writes that bind them, and one command buffer per chunk of
//! queries (upload points, clear masks, trace, threshold, copy back).

use ash::vk;

use super::{f32_bytes, Batch, VulkanRtRouter};
use crate::RouteError;

impl VulkanRtRouter {
    fn ensure_batch(&mut self, queries: usize) -> Result<(), RouteError> {
        if self
            .batch
            .as_ref()
            .is_some_and(|b| b.capacity_queries >= queries)
        {
            return Ok(());
        }
        if let Some(old) = self.batch.take() {
            for b in old.buffers() {
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
    pub(super) fn chunk_queries(&self) -> usize {
        let per_query = (self.pages.max(1) * 4) as u64;
        ((512u64 << 20) / per_query).clamp(1, self.max_launch_width as u64) as usize
    }

    pub(super) fn route_chunk(
        &mut self,
        points: &[[f32; 3]],
        out: &mut [u32],
    ) -> Result<(), RouteError> {
        let queries = points.len() / self.slices;
        let words = self.pages.div_ceil(32);
        self.ensure_batch(queries)?;
        let b = self.batch.as_ref().expect("ensured");
        let bytes = f32_bytes(points.iter().flatten().copied());
        // SAFETY: the host buffer holds capacity_queries * slices * 12 >= bytes.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.points_host.mapped, bytes.len()) };
        let out_bytes = (queries * words * 4) as u64;
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
            self.record_trace_and_threshold(
                cmd,
                self.desc_set,
                queries,
                self.pages > 0 && queries > 0,
            );
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

    /// Records the route of `queries` queries over descriptor set `set`:
    /// the push constants, the trace (with `trace`) and a barrier, then the
    /// threshold pass; for the batch and the interop command buffers.
    ///
    /// # Safety
    /// `cmd` must be recording and `set` hold buffers for `queries` queries.
    pub(super) unsafe fn record_trace_and_threshold(
        &self,
        cmd: vk::CommandBuffer,
        set: vk::DescriptorSet,
        queries: usize,
        trace: bool,
    ) {
        let words = self.pages.div_ceil(32);
        let push: Vec<u8> = [
            queries as u32,
            self.slices as u32,
            self.pages as u32,
            words as u32,
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
        let groups = (queries * words).div_ceil(64).max(1) as u32;
        let (gx, gy) = (groups.min(65535), groups.div_ceil(65535));
        let d = &self.device;
        // SAFETY: the caller's contract; the pipelines, layout and regions are the router's own.
        unsafe {
            d.cmd_push_constants(
                cmd,
                self.pipeline_layout,
                vk::ShaderStageFlags::ALL,
                0,
                &push,
            );
            if trace {
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
                    &[set],
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
                &[set],
                &[],
            );
            d.cmd_dispatch(cmd, gx, gy, 1);
        }
    }
}
