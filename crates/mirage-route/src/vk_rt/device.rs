//! Instance and device setup: the first device with ray-tracing pipelines
//! (and, for interop, external memory and semaphores), its command pool,
//! command buffer and fence, then the router assembled around them.

use std::ffi::{c_char, CStr};

use ash::vk;

use super::{export, unavailable, vkerr, InteropRequest, VulkanRtRouter, REQUIRED_EXTENSIONS};
use crate::data::RouterData;
use crate::{RouteError, Unavailable};

impl VulkanRtRouter {
    /// Loads Vulkan, picks the first device with `VK_KHR_ray_tracing_pipeline`,
    /// builds the acceleration structures, pipelines and shader binding table.
    pub fn new(data: &RouterData) -> Result<Self, RouteError> {
        Self::new_inner(data, None)
    }

    pub(super) fn new_inner(
        data: &RouterData,
        interop: Option<&InteropRequest>,
    ) -> Result<Self, RouteError> {
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

    /// Everything a route call binds, built once: the acceleration
    /// structures, then the pipelines, then the shader binding table.
    fn build_static(
        &mut self,
        data: &RouterData,
        rt_props: &vk::PhysicalDeviceRayTracingPipelinePropertiesKHR<'_>,
        as_props: &vk::PhysicalDeviceAccelerationStructurePropertiesKHR<'_>,
    ) -> Result<(), RouteError> {
        self.build_scene(data, as_props)?;
        self.build_pipelines()?;
        self.build_shader_binding_table(rt_props)
    }
}
