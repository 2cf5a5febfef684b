//! wgpu compute router: the BVH traversal of [`crate::bvh`] in WGSL
//! (shaders/route_traverse.wgsl), Vulkan backend only.
//!
//! The tree, primitives, slice offsets and thresholds are uploaded once in
//! [`WgpuRouter::new`]; each [`Router::route`] call uploads the points, clears
//! the per-(query, page) slice masks, runs the `traverse` and `threshold`
//! passes and reads back one bitset per query. Batches too large for one
//! storage binding are split into chunks.

use crate::bvh::Bvh;
use crate::data::RouterData;
use crate::{CandidateSet, RouteError, Router, RouterKind, Unavailable};

const SHADER: &str = include_str!("../../../shaders/route_traverse.wgsl");
const WORKGROUP: u32 = 64;
/// Most workgroups per dispatch dimension (WebGPU's guaranteed minimum).
const MAX_GROUPS_X: u32 = 65535;

/// Options of the wgpu router.
#[derive(Clone, Copy, Debug, Default)]
pub struct WgpuOptions {
    /// Accept software adapters (Mesa lavapipe); tests do, [`crate::best_available`] does not.
    pub allow_software: bool,
}

/// Per-batch buffers, grown on demand and reused.
struct BatchBuffers {
    capacity_queries: usize,
    points: wgpu::Buffer,
    masks: wgpu::Buffer,
    out_bits: wgpu::Buffer,
    readback: wgpu::Buffer,
    bind_group: wgpu::BindGroup,
}

/// The wgpu compute router.
pub struct WgpuRouter {
    device: wgpu::Device,
    queue: wgpu::Queue,
    adapter_name: String,
    slices: usize,
    pages: usize,
    node_count: u32,
    max_binding: u64,
    params: wgpu::Buffer,
    nodes: wgpu::Buffer,
    prims: wgpu::Buffer,
    offsets: wgpu::Buffer,
    thresholds: wgpu::Buffer,
    layout: wgpu::BindGroupLayout,
    traverse: wgpu::ComputePipeline,
    threshold: wgpu::ComputePipeline,
    batch: Option<BatchBuffers>,
}

impl std::fmt::Debug for WgpuRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuRouter")
            .field("adapter", &self.adapter_name)
            .field("pages", &self.pages)
            .finish()
    }
}

fn unavailable(reason: Unavailable) -> RouteError {
    RouteError::Unavailable {
        kind: RouterKind::Wgpu,
        reason,
    }
}

fn device_err(message: impl std::fmt::Display) -> RouteError {
    RouteError::Device {
        kind: RouterKind::Wgpu,
        message: message.to_string(),
    }
}

fn bind(binding: u32, b: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: b.as_entire_binding(),
    }
}

fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn record_bytes(records: impl Iterator<Item = ([f32; 3], u32, [f32; 3], u32)>) -> Vec<u8> {
    let mut out = Vec::new();
    for (min, a, max, b) in records {
        out.extend(f32_bytes(min));
        out.extend(a.to_le_bytes());
        out.extend(f32_bytes(max));
        out.extend(b.to_le_bytes());
    }
    out
}

impl WgpuRouter {
    /// Builds the BVH, picks a Vulkan adapter (hardware first) and uploads the tree.
    pub fn new(data: &RouterData, options: WgpuOptions) -> Result<Self, RouteError> {
        let bvh = Bvh::build(data)?;
        let instance = wgpu::Instance::new(&wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN,
            ..Default::default()
        });
        let mut adapters = instance.enumerate_adapters(wgpu::Backends::VULKAN);
        if adapters.is_empty() {
            return Err(unavailable(Unavailable::NoAdapter(
                "no Vulkan adapter (is libvulkan1 and a driver such as mesa-vulkan-drivers installed?)".into(),
            )));
        }
        // Hardware before software.
        adapters.sort_by_key(|a| match a.get_info().device_type {
            wgpu::DeviceType::DiscreteGpu => 0,
            wgpu::DeviceType::IntegratedGpu => 1,
            wgpu::DeviceType::VirtualGpu => 2,
            wgpu::DeviceType::Other => 3,
            wgpu::DeviceType::Cpu => 4,
        });
        let adapter = adapters.swap_remove(0);
        let info = adapter.get_info();
        if info.device_type == wgpu::DeviceType::Cpu && !options.allow_software {
            return Err(unavailable(Unavailable::SoftwareAdapterOnly(info.name)));
        }
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("mirage-route"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| unavailable(Unavailable::NoAdapter(format!("{}: {e}", info.name))))?;
        let max_binding =
            (limits.max_storage_buffer_binding_size as u64).min(limits.max_buffer_size);

        use wgpu::util::DeviceExt;
        let storage = |label: &str, contents: Vec<u8>| {
            // Bindings must not be empty.
            let mut contents = contents;
            if contents.len() < 32 {
                contents.resize(32, 0);
            }
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: &contents,
                usage: wgpu::BufferUsages::STORAGE,
            })
        };
        let nodes = storage(
            "bvh nodes",
            record_bytes(
                bvh.nodes
                    .iter()
                    .map(|n| (n.min, n.left_or_first, n.max, n.count)),
            ),
        );
        let prims = storage(
            "bvh prims",
            record_bytes(bvh.prims.iter().map(|p| (p.min, p.page, p.max, p.slice))),
        );
        let offsets = storage(
            "slice offsets",
            f32_bytes(bvh.slice_offsets.iter().copied()),
        );
        let thresholds = storage("thresholds", u32_bytes(&data.thresholds));
        let params = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params"),
            size: 32,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });

        let entry = |binding: u32, ty: wgpu::BufferBindingType| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty,
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let ro = wgpu::BufferBindingType::Storage { read_only: true };
        let rw = wgpu::BufferBindingType::Storage { read_only: false };
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("route"),
            entries: &[
                entry(0, wgpu::BufferBindingType::Uniform),
                entry(1, ro),
                entry(2, ro),
                entry(3, ro),
                entry(4, ro),
                entry(5, ro),
                entry(6, rw),
                entry(7, rw),
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("route"),
            bind_group_layouts: &[&layout],
            push_constant_ranges: &[],
        });
        device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("route_traverse.wgsl"),
            source: wgpu::ShaderSource::Wgsl(SHADER.into()),
        });
        let pipeline = |entry_point: &str| {
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry_point),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some(entry_point),
                compilation_options: Default::default(),
                cache: None,
            })
        };
        let traverse = pipeline("traverse");
        let threshold = pipeline("threshold");
        if let Some(e) = pollster::block_on(device.pop_error_scope()) {
            return Err(unavailable(Unavailable::Shader(e.to_string())));
        }
        Ok(Self {
            device,
            queue,
            adapter_name: format!(
                "{} ({:?}, {})",
                info.name, info.device_type, info.driver_info
            ),
            slices: data.slices,
            pages: data.pages(),
            node_count: bvh.nodes.len() as u32,
            max_binding,
            params,
            nodes,
            prims,
            offsets,
            thresholds,
            layout,
            traverse,
            threshold,
            batch: None,
        })
    }

    /// The adapter in use: name, type and driver.
    pub fn adapter_name(&self) -> &str {
        &self.adapter_name
    }

    /// Most queries per chunk, so that the masks fit one storage binding.
    fn chunk_queries(&self) -> usize {
        let per_query = (self.pages.max(1) * 4).max(self.slices * 12) as u64;
        ((self.max_binding.min(256 << 20) / per_query) as usize).clamp(1, 1 << 20)
    }

    fn ensure_batch(&mut self, queries: usize) {
        if self
            .batch
            .as_ref()
            .is_some_and(|b| b.capacity_queries >= queries)
        {
            return;
        }
        let words = self.pages.div_ceil(32);
        let buf = |label: &str, size: usize, usage: wgpu::BufferUsages| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: (size.max(32) as u64).next_multiple_of(4),
                usage,
                mapped_at_creation: false,
            })
        };
        use wgpu::BufferUsages as U;
        let points = buf(
            "points",
            queries * self.slices * 12,
            U::STORAGE | U::COPY_DST,
        );
        let masks = buf("masks", queries * self.pages * 4, U::STORAGE | U::COPY_DST);
        let out_bits = buf("out bits", queries * words * 4, U::STORAGE | U::COPY_SRC);
        let readback = buf("readback", queries * words * 4, U::MAP_READ | U::COPY_DST);
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("route"),
            layout: &self.layout,
            entries: &[
                bind(0, &self.params),
                bind(1, &self.nodes),
                bind(2, &self.prims),
                bind(3, &self.offsets),
                bind(4, &points),
                bind(5, &self.thresholds),
                bind(6, &masks),
                bind(7, &out_bits),
            ],
        });
        self.batch = Some(BatchBuffers {
            capacity_queries: queries,
            points,
            masks,
            out_bits,
            readback,
            bind_group,
        });
    }

    fn route_chunk(&mut self, points: &[[f32; 3]], out: &mut [u32]) -> Result<(), RouteError> {
        let queries = points.len() / self.slices;
        let words = self.pages.div_ceil(32);
        self.ensure_batch(queries);
        let b = self.batch.as_ref().expect("ensured");
        let params = u32_bytes(&[
            queries as u32,
            self.slices as u32,
            self.pages as u32,
            words as u32,
            self.node_count,
            0,
            0,
            0,
        ]);
        self.queue.write_buffer(&self.params, 0, &params);
        self.queue
            .write_buffer(&b.points, 0, &f32_bytes(points.iter().flatten().copied()));
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("route"),
            });
        enc.clear_buffer(
            &b.masks,
            0,
            Some(((queries * self.pages * 4).max(4) as u64).next_multiple_of(4)),
        );
        let groups = |n: usize| {
            let g = (n as u32).div_ceil(WORKGROUP).max(1);
            (g.min(MAX_GROUPS_X), g.div_ceil(MAX_GROUPS_X))
        };
        for (pipeline, n) in [
            (&self.traverse, queries * self.slices),
            (&self.threshold, queries * words),
        ] {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            });
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &b.bind_group, &[]);
            let (x, y) = groups(n);
            pass.dispatch_workgroups(x, y, 1);
        }
        let out_bytes = (queries * words * 4) as u64;
        if out_bytes > 0 {
            enc.copy_buffer_to_buffer(&b.out_bits, 0, &b.readback, 0, out_bytes);
        }
        self.queue.submit([enc.finish()]);
        if out_bytes == 0 {
            self.device.poll(wgpu::PollType::Wait).map_err(device_err)?;
            return Ok(());
        }
        let slice = b.readback.slice(..out_bytes);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device.poll(wgpu::PollType::Wait).map_err(device_err)?;
        rx.recv().map_err(device_err)?.map_err(device_err)?;
        {
            let view = slice.get_mapped_range();
            for (o, c) in out.iter_mut().zip(view.chunks_exact(4)) {
                *o = u32::from_le_bytes(c.try_into().expect("4 bytes"));
            }
        }
        b.readback.unmap();
        Ok(())
    }
}

impl Router for WgpuRouter {
    fn kind(&self) -> RouterKind {
        RouterKind::Wgpu
    }

    fn route(&mut self, points: &[[f32; 3]]) -> Result<CandidateSet, RouteError> {
        let (slices, pages, chunk) = (self.slices, self.pages, self.chunk_queries());
        crate::route_in_chunks(points, slices, pages, chunk, |pts, bits| {
            self.route_chunk(pts, bits)
        })
    }
}
