//! Page routing through the Vulkan ray-tracing router with no host copy:
//! CUDA–Vulkan interop over exported memory and timeline semaphores
//! (feature `vulkan-interop`; issue #7 item 2).
//!
//! One routing of `q` queries (rows of `x`, on the device) by
//! [`VkInteropRouter::route`], all enqueued, nothing waited for on the host:
//! 1. CUDA, `vki_project` (cuda/vk_interop.cu): slice points `P x` into the
//!    Vulkan-exported points buffer (imported with `cuImportExternalMemory` +
//!    `cuExternalMemoryGetMappedBuffer`);
//! 2. CUDA signals the `ready` timeline semaphore to `v`
//!    (`cuSignalExternalSemaphoresAsync`) on its stream;
//! 3. Vulkan: one queued submission waits for `ready >= v`, traces the AABB
//!    scene, thresholds into the exported bitset buffer and signals `done = v`
//!    ([`VulkanRtRouter::submit_interop`], queued before CUDA's signal ran,
//!    which timeline semaphores allow);
//! 4. CUDA waits for `done >= v` on its stream (`cuWaitExternalSemaphoresAsync`)
//!    and `vki_compact` turns the bitsets into route.cu's active list format
//!    (ascending ids + count per query, trunk pages first), which the fused
//!    FFN of cuda/superblock.cu reads as it is.
//!
//! [`VkInteropRouter::route_host`] is the same routing with host copies
//! (points to the host, [`Router::route`] on the Vulkan router with its own
//! uploads, fence and readback, bits back to the device), and
//! [`CudaBvhRouter`] is route.cu's `route_bvh` (the sparse backend's routed
//! mode kernel) on the same context, for the comparison.
//!
//! The importing rules (checked against the CUDA driver API docs and the
//! `simpleVulkan` sample): the whole allocation is imported with its
//! allocation size, `CUDA_EXTERNAL_MEMORY_DEDICATED` when Vulkan made a
//! dedicated allocation, the fds are handed to CUDA (it owns them after a
//! successful import; on failure they are closed here), the mapped pointer is
//! freed with `cuMemFree` before `cuDestroyExternalMemory`, the semaphores are
//! `CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_TIMELINE_SEMAPHORE_FD`, and the Vulkan
//! device is chosen by the CUDA device's UUID.

use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use mirage_route::{
    Bvh, ExportedMemory, InteropRequest, RouteError, Router, RouterData, VulkanRtRouter,
};

use crate::backend::sparse_backend::{
    as_bytes_nodes, as_bytes_prims, route_smem_bytes, RouteTraversal, ROUTE_THREADS,
};
use crate::{module, CudaError};

/// The module: route.cu (the sparse backend's router, with norm.cu for its
/// folded RMSNorm) and the interop kernels.
pub(crate) const SOURCE: &str = concat!(
    include_str!("../../../cuda/pdl.cu"),
    "\n",
    include_str!("../../../cuda/norm.cu"),
    "\n",
    include_str!("../../../cuda/route.cu"),
    "\n",
    include_str!("../../../cuda/vk_interop.cu")
);
const THREADS: u32 = 256;

/// Why an interop routing could not be set up or run.
#[derive(Debug, thiserror::Error)]
pub enum InteropError {
    /// CUDA is missing or failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The Vulkan router is unavailable or failed.
    #[error("Vulkan RT router: {0}")]
    Vulkan(#[from] RouteError),
    /// A CUDA external-resource call failed.
    #[error("CUDA interop: {call}: {message}")]
    Import {
        /// The driver call.
        call: &'static str,
        /// The driver's error.
        message: String,
    },
    /// Bad shapes or arguments.
    #[error("interop routing: {0}")]
    Invalid(String),
    /// Vulkan did not signal `done` in time (a lost signal would otherwise
    /// hang the CUDA stream).
    #[error("Vulkan did not reach done = {0} within the timeout")]
    Timeout(u64),
}

impl InteropError {
    /// Whether this only says that the Vulkan RT path cannot run here (no
    /// loader, no ray-tracing device, no interop support, feature off).
    pub fn is_vulkan_unavailable(&self) -> bool {
        matches!(self, InteropError::Vulkan(RouteError::Unavailable { .. }))
    }
}

type Result<T> = std::result::Result<T, InteropError>;

fn drv(e: cudarc::driver::DriverError) -> InteropError {
    InteropError::Cuda(CudaError::Driver(e.to_string()))
}

fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(InteropError::Import {
            call,
            message: format!("{r:?}"),
        })
    }
}

/// A CUDA context, stream and the routing kernels.
pub struct RouteDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    f_route: CudaFunction,
    f_project: CudaFunction,
    f_compact: CudaFunction,
    name: String,
}

/// Active page lists of `queries` queries on the device, route.cu's format:
/// `ids[q * n_pages ..][..count[q]]` ascending.
pub struct ActiveLists {
    /// Page ids, `n_pages` slots per query.
    pub ids: CudaSlice<u32>,
    /// Active count per query.
    pub count: CudaSlice<i32>,
    /// Queries held.
    pub queries: usize,
    /// Slots per query.
    pub n_pages: usize,
}

impl RouteDevice {
    /// Opens device `ordinal` and compiles the kernels (NVRTC, cached). Typed
    /// errors when the driver, NVRTC or the device is missing.
    pub fn new(ordinal: usize) -> std::result::Result<Self, CudaError> {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::DriverNotFound);
        }
        let d = |e: cudarc::driver::DriverError| CudaError::Driver(e.to_string());
        cudarc::driver::result::init().map_err(d)?;
        let count = CudaContext::device_count().map_err(d)?.max(0) as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(d)?;
        // SAFETY: nothing is allocated on this context yet; one stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(d)?;
        Self::on_stream(ctx, stream)
    }

    /// The routing kernels on an existing context and stream (the sparse
    /// backend's), so that routings are ordered with that stream's launches.
    pub fn on_stream(
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
    ) -> std::result::Result<Self, CudaError> {
        let d = |e: cudarc::driver::DriverError| CudaError::Driver(e.to_string());
        let name = ctx.name().map_err(d)?;
        let cc = ctx.compute_capability().map_err(d)?;
        let (ptx, _) = module::ptx_for("vk_interop", SOURCE, cc.0, cc.1)?;
        let m = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(d)?;
        Ok(RouteDevice {
            f_route: m.load_function("route_bvh").map_err(d)?,
            f_project: m.load_function("vki_project").map_err(d)?,
            f_compact: m.load_function("vki_compact").map_err(d)?,
            ctx,
            stream,
            name,
        })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The stream every routing here runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device UUID (`cuDeviceGetUuid`), which the Vulkan device must share.
    pub fn uuid(&self) -> Result<[u8; 16]> {
        let u = self.ctx.uuid().map_err(drv)?;
        Ok(u.bytes.map(|b| b as u8))
    }

    /// Uploads `rows` rows of queries.
    pub fn upload(&self, xs: &[f32]) -> Result<CudaSlice<f32>> {
        if xs.is_empty() {
            return Err(InteropError::Invalid("no query values".into()));
        }
        self.stream.clone_htod(xs).map_err(drv)
    }

    /// Device active lists for `queries` queries of `n_pages` pages.
    pub fn active_lists(&self, queries: usize, n_pages: usize) -> Result<ActiveLists> {
        Ok(ActiveLists {
            ids: self
                .stream
                .alloc_zeros::<u32>((queries * n_pages).max(1))
                .map_err(drv)?,
            count: self
                .stream
                .alloc_zeros::<i32>(queries.max(1))
                .map_err(drv)?,
            queries,
            n_pages,
        })
    }

    /// Reads the first `queries` lists back (synchronizes the stream).
    pub fn read(&self, a: &ActiveLists, queries: usize) -> Result<Vec<Vec<u32>>> {
        let ids = self.stream.clone_dtoh(&a.ids).map_err(drv)?;
        let count = self.stream.clone_dtoh(&a.count).map_err(drv)?;
        Ok((0..queries.min(a.queries))
            .map(|q| {
                let n = (count[q].max(0) as usize).min(a.n_pages);
                ids[q * a.n_pages..][..n].to_vec()
            })
            .collect())
    }

    /// Waits for the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv)
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _g) = s.device_ptr(&self.stream);
        p
    }

    #[allow(clippy::too_many_arguments)]
    fn project(
        &self,
        x: u64,
        d: usize,
        proj: u64,
        slices: usize,
        points: u64,
        queries: usize,
    ) -> Result<()> {
        let (d, s) = (d as i32, slices as i32);
        let mut b = self.stream.launch_builder(&self.f_project);
        b.arg(&x).arg(&d).arg(&proj).arg(&s).arg(&points);
        let cfg = LaunchConfig {
            grid_dim: (queries as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches vki_project(const float*, int, const float*, int,
        // float*); x holds queries * d floats, points queries * slices * 3.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    /// `vki_compact` into `queries` lists at `ids` (`n_pages` slots each)
    /// and `count` (one i32 each).
    #[allow(clippy::too_many_arguments)]
    fn compact(
        &self,
        bits: u64,
        words: usize,
        router_pages: usize,
        n_trunk: usize,
        ids: u64,
        count: u64,
        n_pages: usize,
        queries: usize,
    ) -> Result<()> {
        let (w, rp, np, nt) = (
            words as i32,
            router_pages as i32,
            n_pages as i32,
            n_trunk as i32,
        );
        let mut b = self.stream.launch_builder(&self.f_compact);
        b.arg(&bits)
            .arg(&w)
            .arg(&rp)
            .arg(&np)
            .arg(&nt)
            .arg(&ids)
            .arg(&count);
        let cfg = LaunchConfig {
            grid_dim: (queries as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches vki_compact(const unsigned*, int, int, int, int,
        // unsigned*, int*); bits holds queries * words words, the callers
        // size ids / count (checked lists, or the backend's layer list).
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }
}

fn check_out(out: &ActiveLists, queries: usize, n_pages: usize) -> Result<()> {
    if queries == 0 || queries > out.queries || out.n_pages != n_pages {
        return Err(InteropError::Invalid(format!(
            "{queries} queries of {n_pages} pages into lists of {} x {}",
            out.queries, out.n_pages
        )));
    }
    Ok(())
}

fn check_x(x: &CudaSlice<f32>, queries: usize, d: usize) -> Result<()> {
    if x.len() < queries * d {
        return Err(InteropError::Invalid(format!(
            "x holds {} floats, {queries} queries of {d} need more",
            x.len()
        )));
    }
    Ok(())
}

fn check_pages(data: &RouterData, n_pages: usize, n_trunk: usize) -> Result<()> {
    data.validate()?;
    if data.d_model == 0 {
        return Err(InteropError::Invalid(
            "router data has no projection".into(),
        ));
    }
    if n_trunk > n_pages || n_pages == 0 {
        return Err(InteropError::Invalid(format!(
            "n_trunk {n_trunk} / n_pages {n_pages}"
        )));
    }
    Ok(())
}

/// route.cu's `route_bvh` on a [`RouteDevice`]: the sparse backend's device
/// router, one block per query.
pub struct CudaBvhRouter {
    slices: usize,
    pages: usize,
    d_model: usize,
    n_nodes: usize,
    n_prims: usize,
    n_pages: usize,
    n_trunk: usize,
    proj: CudaSlice<f32>,
    offsets: CudaSlice<f32>,
    nodes: CudaSlice<u8>,
    prims: CudaSlice<u8>,
    thresholds: CudaSlice<u32>,
}

impl CudaBvhRouter {
    /// Uploads `data`'s BVH; active lists have `n_pages` pages, the first
    /// `n_trunk` always on.
    pub fn new(
        dev: &RouteDevice,
        data: &RouterData,
        n_pages: usize,
        n_trunk: usize,
    ) -> Result<Self> {
        check_pages(data, n_pages, n_trunk)?;
        let bvh = Bvh::build(data)?;
        let s = &dev.stream;
        let up = |v: Vec<u8>| -> Result<CudaSlice<u8>> {
            if v.is_empty() {
                s.alloc_zeros::<u8>(32).map_err(drv)
            } else {
                s.clone_htod(&v).map_err(drv)
            }
        };
        let thresholds = if data.thresholds.is_empty() {
            s.alloc_zeros::<u32>(1).map_err(drv)?
        } else {
            s.clone_htod(&data.thresholds).map_err(drv)?
        };
        Ok(CudaBvhRouter {
            slices: data.slices,
            pages: data.pages(),
            d_model: data.d_model,
            n_nodes: bvh.nodes.len(),
            n_prims: bvh.prims.len(),
            n_pages,
            n_trunk,
            proj: s.clone_htod(&data.projection).map_err(drv)?,
            offsets: s.clone_htod(&bvh.slice_offsets).map_err(drv)?,
            nodes: up(as_bytes_nodes(&bvh.nodes))?,
            prims: up(as_bytes_prims(&bvh.prims))?,
            thresholds,
        })
    }

    /// Enqueues the routing of the first `queries` rows of `x` into `out`.
    pub fn route(
        &self,
        dev: &RouteDevice,
        x: &CudaSlice<f32>,
        queries: usize,
        traversal: RouteTraversal,
        out: &mut ActiveLists,
    ) -> Result<()> {
        check_out(out, queries, self.n_pages)?;
        check_x(x, queries, self.d_model)?;
        let px = dev.ptr(x);
        let (proj, offsets, nodes, prims, thr) = (
            dev.ptr(&self.proj),
            dev.ptr(&self.offsets),
            dev.ptr(&self.nodes),
            dev.ptr(&self.prims),
            dev.ptr(&self.thresholds),
        );
        let (ids, count) = (dev.ptr(&out.ids), dev.ptr(&out.count));
        let scan = traversal.scans(self.n_prims);
        let (d, sl, nn, npr, sc, rp, np, nt) = (
            self.d_model as i32,
            self.slices as i32,
            self.n_nodes as i32,
            self.n_prims as i32,
            scan as i32,
            self.pages as i32,
            self.n_pages as i32,
            self.n_trunk as i32,
        );
        // No folded norm: x is the router's input as it is.
        let (no_norm, no_eps) = (0u64, 0f32);
        for q in 0..queries {
            let xq = px + (q * self.d_model * 4) as u64;
            let iq = ids + (q * self.n_pages * 4) as u64;
            let cq = count + (q * 4) as u64;
            let mut b = dev.stream.launch_builder(&dev.f_route);
            b.arg(&xq)
                .arg(&d)
                .arg(&proj)
                .arg(&sl)
                .arg(&offsets)
                .arg(&nodes)
                .arg(&nn)
                .arg(&prims)
                .arg(&npr)
                .arg(&sc)
                .arg(&thr)
                .arg(&rp)
                .arg(&np)
                .arg(&nt)
                .arg(&iq)
                .arg(&cq)
                .arg(&no_norm)
                .arg(&no_eps)
                .arg(&no_norm);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (ROUTE_THREADS, 1, 1),
                shared_mem_bytes: route_smem_bytes(
                    self.n_pages,
                    self.d_model,
                    if scan { 0 } else { self.n_nodes },
                ),
            };
            // SAFETY: matches route_bvh's signature in cuda/route.cu (as the
            // sparse backend launches it); every buffer is sized above.
            unsafe { b.launch(cfg) }.map_err(drv)?;
        }
        Ok(())
    }
}

/// One imported Vulkan allocation, mapped as a linear buffer.
struct Imported {
    mem: sys::CUexternalMemory,
    ptr: sys::CUdeviceptr,
    size: u64,
}

/// Imports `m` (the fd goes to CUDA on success, is closed on failure).
fn import_memory(m: ExportedMemory) -> Result<Imported> {
    if m.buffer_size > m.allocation_size {
        return Err(InteropError::Invalid(format!(
            "exported buffer of {} bytes in an allocation of {}",
            m.buffer_size, m.allocation_size
        )));
    }
    let fd = m.fd.into_raw_fd();
    let desc = sys::CUDA_EXTERNAL_MEMORY_HANDLE_DESC {
        type_: sys::CUexternalMemoryHandleType::CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD,
        handle: sys::CUDA_EXTERNAL_MEMORY_HANDLE_DESC_st__bindgen_ty_1 { fd },
        size: m.allocation_size,
        flags: if m.dedicated {
            sys::CUDA_EXTERNAL_MEMORY_DEDICATED
        } else {
            0
        },
        reserved: [0; 16],
    };
    let mut mem: sys::CUexternalMemory = std::ptr::null_mut();
    // SAFETY: a valid descriptor of an opaque fd exported by Vulkan.
    let r = unsafe { sys::cuImportExternalMemory(&mut mem, &desc) };
    if r != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the import failed, so the fd is still ours.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
        return Err(InteropError::Import {
            call: "cuImportExternalMemory",
            message: format!("{r:?}"),
        });
    }
    let buf = sys::CUDA_EXTERNAL_MEMORY_BUFFER_DESC {
        offset: 0,
        size: m.buffer_size,
        flags: 0,
        reserved: [0; 16],
    };
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: mem is a live external memory of at least buffer_size bytes.
    let r = unsafe { sys::cuExternalMemoryGetMappedBuffer(&mut ptr, mem, &buf) };
    if r != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: mem was imported above and nothing maps it.
        unsafe { sys::cuDestroyExternalMemory(mem) };
        return Err(InteropError::Import {
            call: "cuExternalMemoryGetMappedBuffer",
            message: format!("{r:?}"),
        });
    }
    Ok(Imported {
        mem,
        ptr,
        size: m.buffer_size,
    })
}

/// Imports a Vulkan timeline semaphore (the fd goes to CUDA on success).
fn import_semaphore(fd: OwnedFd) -> Result<sys::CUexternalSemaphore> {
    let fd = fd.into_raw_fd();
    let desc = sys::CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC {
        type_: sys::CUexternalSemaphoreHandleType::CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_TIMELINE_SEMAPHORE_FD,
        handle: sys::CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC_st__bindgen_ty_1 { fd },
        flags: 0,
        reserved: [0; 16],
    };
    let mut sem: sys::CUexternalSemaphore = std::ptr::null_mut();
    // SAFETY: a valid descriptor of a timeline semaphore fd exported by Vulkan.
    let r = unsafe { sys::cuImportExternalSemaphore(&mut sem, &desc) };
    if r != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the import failed, so the fd is still ours.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
        return Err(InteropError::Import {
            call: "cuImportExternalSemaphore",
            message: format!("{r:?}"),
        });
    }
    Ok(sem)
}

/// The Vulkan RT router fed and read by CUDA (see the module docs).
pub struct VkInteropRouter {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    points: Option<Imported>,
    bits: Option<Imported>,
    ready: sys::CUexternalSemaphore,
    done: sys::CUexternalSemaphore,
    /// Last timeline value used on both semaphores.
    value: u64,
    slices: usize,
    pages: usize,
    words: usize,
    d_model: usize,
    n_pages: usize,
    n_trunk: usize,
    max_queries: usize,
    proj: CudaSlice<f32>,
    /// Host-copy path scratch.
    points_dev: CudaSlice<f32>,
    bits_dev: CudaSlice<u32>,
    host_points: Vec<[f32; 3]>,
    /// Declared last: dropped after the CUDA imports are released.
    vk: VulkanRtRouter,
}

// The raw CUDA handles are owned by this router and used under &mut self.
unsafe impl Send for VkInteropRouter {}

impl VkInteropRouter {
    /// Builds the Vulkan RT router for `data` on the Vulkan device with
    /// `dev`'s UUID, exports its buffers and semaphores and imports them into
    /// `dev`'s context. `max_queries`: most queries one routing handles.
    pub fn new(
        dev: &RouteDevice,
        data: &RouterData,
        n_pages: usize,
        n_trunk: usize,
        max_queries: usize,
    ) -> Result<Self> {
        check_pages(data, n_pages, n_trunk)?;
        let req = InteropRequest {
            max_queries,
            device_uuid: Some(dev.uuid()?),
        };
        let (vk, ex) = VulkanRtRouter::new_interop(data, &req)?;
        if ex.slices != data.slices || ex.pages != data.pages() || ex.max_queries != max_queries {
            return Err(InteropError::Invalid(
                "exported shapes differ from the router data".into(),
            ));
        }
        if ex.points.buffer_size < (max_queries * data.slices * 12) as u64
            || ex.bits.buffer_size < (max_queries * ex.words * 4) as u64
        {
            return Err(InteropError::Invalid("exported buffers too small".into()));
        }
        dev.ctx.bind_to_thread().map_err(drv)?;
        let s = &dev.stream;
        let proj = s.clone_htod(&data.projection).map_err(drv)?;
        let points_dev = s
            .alloc_zeros::<f32>(max_queries * data.slices * 3)
            .map_err(drv)?;
        let bits_dev = s
            .alloc_zeros::<u32>((max_queries * ex.words).max(1))
            .map_err(drv)?;
        let mut r = VkInteropRouter {
            ctx: dev.ctx.clone(),
            stream: dev.stream.clone(),
            points: None,
            bits: None,
            ready: std::ptr::null_mut(),
            done: std::ptr::null_mut(),
            value: 0,
            slices: data.slices,
            pages: data.pages(),
            words: ex.words,
            d_model: data.d_model,
            n_pages,
            n_trunk,
            max_queries,
            proj,
            points_dev,
            bits_dev,
            host_points: Vec::new(),
            vk,
        };
        // From here Drop releases whatever was imported.
        r.points = Some(import_memory(ex.points)?);
        r.bits = Some(import_memory(ex.bits)?);
        r.ready = import_semaphore(ex.ready)?;
        r.done = import_semaphore(ex.done)?;
        Ok(r)
    }

    /// The Vulkan device's name.
    pub fn vulkan_device(&self) -> &str {
        self.vk.device_name()
    }

    /// Most queries per routing.
    pub fn max_queries(&self) -> usize {
        self.max_queries
    }

    /// Last timeline value signalled (by both sides once the stream is idle).
    pub fn value(&self) -> u64 {
        self.value
    }

    /// Enqueues the interop routing of the first `queries` rows of `x` into
    /// `out` (see the module docs); returns without waiting on the host.
    pub fn route(
        &mut self,
        dev: &RouteDevice,
        x: &CudaSlice<f32>,
        queries: usize,
        out: &mut ActiveLists,
    ) -> Result<()> {
        self.check(dev, x, queries, out)?;
        let (ids, count) = (dev.ptr(&out.ids), dev.ptr(&out.count));
        self.enqueue(dev, dev.ptr(x), queries, ids, count)
    }

    /// [`Self::route`] of one query at raw device pointers: `x` holds
    /// `d_model` floats and the list `ids` (`n_pages` slots) / `count` (one
    /// i32) is written as route.cu writes it: the sparse backend's layer
    /// list, which its fused FFN reads.
    ///
    /// # Safety
    /// The pointers are live device allocations of `dev`'s context of at
    /// least those sizes, not freed before the stream has run the routing.
    pub unsafe fn route_one_raw(
        &mut self,
        dev: &RouteDevice,
        x: u64,
        ids: u64,
        count: u64,
    ) -> Result<()> {
        if !Arc::ptr_eq(&dev.ctx, &self.ctx) || !Arc::ptr_eq(&dev.stream, &self.stream) {
            return Err(InteropError::Invalid(
                "router imported into another RouteDevice".into(),
            ));
        }
        self.enqueue(dev, x, 1, ids, count)
    }

    /// Projection, the semaphore hand-offs around the Vulkan submission,
    /// compaction into `ids` / `count` (checked by the callers).
    fn enqueue(
        &mut self,
        dev: &RouteDevice,
        x: u64,
        queries: usize,
        ids: u64,
        count: u64,
    ) -> Result<()> {
        let (Some(points), Some(bits)) = (&self.points, &self.bits) else {
            return Err(InteropError::Invalid("interop buffers not imported".into()));
        };
        let (pp, pb) = (points.ptr, bits.ptr);
        dev.project(
            x,
            self.d_model,
            dev.ptr(&self.proj),
            self.slices,
            pp,
            queries,
        )?;
        let v = self.value + 1;
        // SAFETY: zero is a valid bit pattern of these plain C structs.
        let mut sig: sys::CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS = unsafe { std::mem::zeroed() };
        sig.params.fence.value = v;
        // SAFETY: ready is a live imported timeline semaphore; stream of this context.
        check("cuSignalExternalSemaphoresAsync", unsafe {
            sys::cuSignalExternalSemaphoresAsync(&self.ready, &sig, 1, self.stream.cu_stream())
        })?;
        // From here `ready` holds v once the stream gets there: keep the
        // values in step even if the Vulkan submission fails.
        self.value = v;
        self.vk.submit_interop(queries, v, v)?;
        // SAFETY: zero is a valid bit pattern.
        let mut wait: sys::CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS = unsafe { std::mem::zeroed() };
        wait.params.fence.value = v;
        // SAFETY: done is a live imported timeline semaphore.
        check("cuWaitExternalSemaphoresAsync", unsafe {
            sys::cuWaitExternalSemaphoresAsync(&self.done, &wait, 1, self.stream.cu_stream())
        })?;
        self.compact(dev, pb, ids, count, queries)
    }

    /// `vki_compact` of `queries` bitsets at `bits` (this router's shape)
    /// into the lists at `ids` / `count`.
    fn compact(
        &self,
        dev: &RouteDevice,
        bits: u64,
        ids: u64,
        count: u64,
        queries: usize,
    ) -> Result<()> {
        dev.compact(
            bits,
            self.words,
            self.pages,
            self.n_trunk,
            ids,
            count,
            self.n_pages,
            queries,
        )
    }

    /// The same routing with host copies: points to the host (synchronizes),
    /// the Vulkan router's own upload, trace, fence and readback, bits back to
    /// the device, then the same compaction (enqueued).
    pub fn route_host(
        &mut self,
        dev: &RouteDevice,
        x: &CudaSlice<f32>,
        queries: usize,
        out: &mut ActiveLists,
    ) -> Result<()> {
        self.check(dev, x, queries, out)?;
        let pd = dev.ptr(&self.points_dev);
        dev.project(
            dev.ptr(x),
            self.d_model,
            dev.ptr(&self.proj),
            self.slices,
            pd,
            queries,
        )?;
        let n = queries * self.slices;
        let host = self
            .stream
            .clone_dtoh(&self.points_dev.slice(0..n * 3))
            .map_err(drv)?;
        self.host_points.clear();
        self.host_points
            .extend(host.chunks_exact(3).map(|c| [c[0], c[1], c[2]]));
        let set = self.vk.route(&self.host_points)?;
        if set.words_per_query != self.words || set.queries != queries {
            return Err(InteropError::Invalid("candidate set shape".into()));
        }
        if !set.bits.is_empty() {
            self.stream
                .memcpy_htod(&set.bits, &mut self.bits_dev.slice_mut(0..set.bits.len()))
                .map_err(drv)?;
        }
        let pb = dev.ptr(&self.bits_dev);
        self.compact(dev, pb, dev.ptr(&out.ids), dev.ptr(&out.count), queries)
    }

    /// Waits on the host (Vulkan side) until the last routing's trace is
    /// done, at most `timeout`: a watchdog before synchronizing the CUDA
    /// stream, which would hang on a signal that never comes.
    pub fn wait_vulkan(&self, timeout: std::time::Duration) -> Result<()> {
        if self.value == 0 {
            return Ok(());
        }
        if self
            .vk
            .host_wait_done(self.value, timeout.as_nanos().min(u64::MAX as u128) as u64)?
        {
            Ok(())
        } else {
            Err(InteropError::Timeout(self.value))
        }
    }

    fn check(
        &self,
        dev: &RouteDevice,
        x: &CudaSlice<f32>,
        queries: usize,
        out: &ActiveLists,
    ) -> Result<()> {
        if !Arc::ptr_eq(&dev.ctx, &self.ctx) || !Arc::ptr_eq(&dev.stream, &self.stream) {
            return Err(InteropError::Invalid(
                "router imported into another RouteDevice".into(),
            ));
        }
        if queries > self.max_queries {
            return Err(InteropError::Invalid(format!(
                "{queries} queries, the router was built for {}",
                self.max_queries
            )));
        }
        check_out(out, queries, self.n_pages)?;
        check_x(x, queries, self.d_model)
    }
}

impl Drop for VkInteropRouter {
    fn drop(&mut self) {
        // Let Vulkan finish (bounded) so the stream's waits complete, then
        // release CUDA's side before the Vulkan router frees the memory.
        let _ = self.wait_vulkan(std::time::Duration::from_secs(10));
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: the stream is idle; each handle was imported once here.
        unsafe {
            for m in [self.points.take(), self.bits.take()].into_iter().flatten() {
                let _ = sys::cuMemFree_v2(m.ptr);
                let _ = sys::cuDestroyExternalMemory(m.mem);
                let _ = m.size;
            }
            if !self.ready.is_null() {
                let _ = sys::cuDestroyExternalSemaphore(self.ready);
            }
            if !self.done.is_null() {
                let _ = sys::cuDestroyExternalSemaphore(self.done);
            }
        }
    }
}

/// The CPU reference of one query: trunk pages, then the router's
/// candidates (the CPU BVH on the CPU-projected points), ascending.
pub fn cpu_active(
    router: &mut mirage_route::CpuBvh,
    data: &RouterData,
    x: &[f32],
    n_pages: usize,
    n_trunk: usize,
) -> Result<Vec<u32>> {
    let mut pts = Vec::with_capacity(data.slices);
    data.project_into(x, &mut pts)?;
    let set = router.route(&pts)?;
    Ok((0..n_pages)
        .filter(|&p| p < n_trunk || (p < data.pages() && set.contains(0, p)))
        .map(|p| p as u32)
        .collect())
}
