//! Extended kernel launches (`cuLaunchKernelEx`): thread-block clusters and
//! programmatic stream serialization (PDL), which cudarc's launch builder
//! does not take, and cooperative launches; every launch of `CudaBackend`
//! (and so of the sparse backend) and of the sparse harness goes through
//! [`launch_ex`]. Also the shape of the cluster-finished
//! fused FFN phase 2 (`superblock_ffn_q8s_c2`) on a device.

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaStream, DriverError};

use crate::superblock::{q8s_c2_cluster, Q8S_C2_MAX_CLUSTER};

/// How [`launch_ex`] launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchMode {
    /// Blocks per cluster along x (1: no cluster).
    pub cluster: u32,
    /// Programmatic stream serialization (PDL).
    pub programmatic: bool,
    /// A cooperative launch (every block resident; a grid barrier may wait
    /// on them all).
    pub cooperative: bool,
}

impl LaunchMode {
    /// A plain launch.
    pub const PLAIN: LaunchMode = LaunchMode {
        cluster: 1,
        programmatic: false,
        cooperative: false,
    };
}

/// Launches `f` on `stream` with `params` (pointers to the argument
/// values, in the kernel's order) as `mode` says.
///
/// # Safety
/// `params` must match `f`'s signature and the values must outlive the
/// call; `f` must belong to `stream`'s context; `grid.0` must be a multiple
/// of `mode.cluster`; a cooperative grid must fit the device at once.
pub unsafe fn launch_ex(
    f: &CudaFunction,
    stream: &CudaStream,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    params: &mut [*mut c_void],
    mode: LaunchMode,
) -> Result<(), DriverError> {
    // As cudarc's own launches do: the stream's context current on this
    // thread (a no-op when it already is).
    stream.context().bind_to_thread()?;
    let mut attrs = attributes(mode);
    let cfg = config(stream, grid, block, smem, &mut attrs);
    // SAFETY: the caller's contract; `attrs` outlives the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// The launch configuration of `grid` x `block` on `stream` with `attrs`
/// (which must outlive its use).
fn config(
    stream: &CudaStream,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    attrs: &mut [sys::CUlaunchAttribute],
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: attrs.len() as u32,
    }
}

fn attributes(mode: LaunchMode) -> Vec<sys::CUlaunchAttribute> {
    use sys::CUlaunchAttributeID as Id;
    let mut attrs = Vec::with_capacity(3);
    let mut push = |id: Id, set: &dyn Fn(&mut sys::CUlaunchAttributeValue)| {
        // SAFETY: a plain C union of integers; zero is a valid value of
        // every member.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        set(&mut value);
        attrs.push(sys::CUlaunchAttribute {
            id,
            pad: [0; 4],
            value,
        });
    };
    if mode.cluster > 1 {
        push(Id::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, &|v| {
            v.clusterDim.x = mode.cluster;
            v.clusterDim.y = 1;
            v.clusterDim.z = 1;
        });
    }
    if mode.programmatic {
        push(
            Id::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            &|v| v.programmaticStreamSerializationAllowed = 1,
        );
    }
    if mode.cooperative {
        push(Id::CU_LAUNCH_ATTRIBUTE_COOPERATIVE, &|v| v.cooperative = 1);
    }
    attrs
}

/// Grid and cluster size of `superblock_ffn_q8s_c2` (`f`, blocks of
/// `block` threads, no dynamic shared memory) at `d_model` on a device of
/// `multiprocessors` SMs: K = [`q8s_c2_cluster`] of the resident blocks and
/// the largest cluster the device takes for `f` (`MIRAGE_SPARSE_CLUSTER=K`
/// overrides it, still capped there), then as many clusters as output chunks,
/// at most as many as fit at once. Lets `f` use clusters past the portable
/// 8 blocks first (where the device allows it).
pub(crate) fn q8s_c2_shape(
    f: &CudaFunction,
    stream: &CudaStream,
    d_model: usize,
    block: u32,
    multiprocessors: u32,
) -> Result<(u32, u32), DriverError> {
    // Refused on devices without clusters past 8: the potential size says so.
    let _ = f.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
        1,
    );
    let n_chunks = d_model.div_ceil(128).max(1) as u32;
    let per_sm = f
        .occupancy_max_active_blocks_per_multiprocessor(block, 0, None)?
        .max(1);
    let cfg = |grid: u32| cudarc::driver::LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let max_k = f
        .occupancy_max_potential_cluster_size(cfg(n_chunks * Q8S_C2_MAX_CLUSTER), stream)
        .unwrap_or(1)
        .clamp(1, Q8S_C2_MAX_CLUSTER);
    let want = std::env::var("MIRAGE_SPARSE_CLUSTER")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|&k| k >= 1);
    let k = match want {
        Some(k) => k.min(max_k),
        None => q8s_c2_cluster(d_model, per_sm * multiprocessors, max_k),
    };
    if k == 1 {
        return Ok((n_chunks.min(per_sm * multiprocessors), 1));
    }
    // How many clusters of k fit at once (at least one runs at a time).
    let mut attrs = attributes(LaunchMode {
        cluster: k,
        ..LaunchMode::PLAIN
    });
    let launch = config(stream, (n_chunks * k, 1, 1), (block, 1, 1), 0, &mut attrs);
    let mut fit: std::ffi::c_int = 0;
    // SAFETY: `launch` and `attrs` outlive the call; `f` is a loaded function.
    let asked =
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut fit, f.cu_function(), &launch) }.result();
    // Unanswered: one cluster a chunk (they queue if they do not all fit;
    // the shape is computed at every upload, for any variant, so it must
    // not fail where the cluster kernel never runs).
    let clusters = match asked {
        Ok(()) => n_chunks.min(fit.max(1) as u32),
        Err(_) => n_chunks,
    };
    Ok((clusters * k, k))
}
