//! The descriptor set (the bindings of shaders/route_common.glsl), the
//! shader modules, the ray-tracing pipeline (raygen, miss, procedural hit
//! group), the threshold compute pipeline and the shader binding table.

use ash::vk;

use super::{align_up, spirv, unavailable, vkerr, VulkanRtRouter, RGEN, RINT, RMISS, THRESHOLD};
use crate::{RouteError, Unavailable};

impl VulkanRtRouter {
    /// The descriptor set layout, pool and set, the shader modules and both
    /// pipelines over one pipeline layout.
    pub(super) fn build_pipelines(&mut self) -> Result<(), RouteError> {
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
        }
        self.desc_pool = self.create_descriptor_pool("")?;
        self.desc_set = self.allocate_descriptor_set(self.desc_pool, "")?;

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
        Ok(())
    }

    /// The shader binding table: one region each for raygen, miss and the
    /// hit group, in a device buffer whose start is shifted to the base
    /// alignment.
    pub(super) fn build_shader_binding_table(
        &mut self,
        rt_props: &vk::PhysicalDeviceRayTracingPipelinePropertiesKHR<'_>,
    ) -> Result<(), RouteError> {
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

    /// A pool for one descriptor set of the router's layout (the TLAS and
    /// six storage buffers); `what` labels its errors. The caller destroys it.
    pub(super) fn create_descriptor_pool(
        &self,
        what: &str,
    ) -> Result<vk::DescriptorPool, RouteError> {
        let sizes = [
            vk::DescriptorPoolSize::default()
                .ty(vk::DescriptorType::ACCELERATION_STRUCTURE_KHR)
                .descriptor_count(1),
            vk::DescriptorPoolSize::default()
                .ty(vk::DescriptorType::STORAGE_BUFFER)
                .descriptor_count(6),
        ];
        // SAFETY: valid create info.
        unsafe {
            self.device.create_descriptor_pool(
                &vk::DescriptorPoolCreateInfo::default()
                    .max_sets(1)
                    .pool_sizes(&sizes),
                None,
            )
        }
        .map_err(vkerr(&format!("vkCreateDescriptorPool{what}")))
    }

    /// The one descriptor set of the router's layout from `pool`; `what`
    /// labels its errors.
    pub(super) fn allocate_descriptor_set(
        &self,
        pool: vk::DescriptorPool,
        what: &str,
    ) -> Result<vk::DescriptorSet, RouteError> {
        let layouts = [self.set_layout];
        // SAFETY: `pool` has room for one set of this layout.
        unsafe {
            self.device.allocate_descriptor_sets(
                &vk::DescriptorSetAllocateInfo::default()
                    .descriptor_pool(pool)
                    .set_layouts(&layouts),
            )
        }
        .map(|sets| sets[0])
        .map_err(vkerr(&format!("vkAllocateDescriptorSets{what}")))
    }
}
