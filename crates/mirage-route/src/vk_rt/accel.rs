//! The acceleration structures: one AABB bottom-level structure holding
//! every page box of every slice (slice-major primitive ids, translated by
//! the BVH's slice offsets and padded outward), one top-level structure
//! with a single identity instance, and the storage buffers the shaders read
//! beside them (slice offsets, untranslated boxes, thresholds).

use ash::vk;

use super::{align_up, f32_bytes, vkerr, VulkanRtRouter};
use crate::bvh::Bvh;
use crate::data::RouterData;
use crate::RouteError;

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

    /// Uploads the slice offsets, page boxes and thresholds, then builds the
    /// bottom-level structure over the padded boxes and the top-level one
    /// over it.
    pub(super) fn build_scene(
        &mut self,
        data: &RouterData,
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
        Ok(())
    }
}
