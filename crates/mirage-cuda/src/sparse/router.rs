//! The page router on the device (`route_bvh` in `cuda/route.cu`): one
//! layer's BVH router uploaded from the artifact's router data, and the
//! launch that turns the layer's FFN input into its active page list with
//! no host round trip (so the routed decode step stays one CUDA graph).

use cudarc::driver::CudaSlice;
use mirage_route::{Bvh, BvhNode, BvhPrim, RouterData};
use mirage_runtime::Result;

use crate::backend::{drv, CudaBackend, MemKind};
use crate::launch::{Arg, Launch, Route, Work};
use crate::options::{RouteTraversal, ROUTE_SCAN_MAX_PRIMS};

/// Threads of a `route_bvh` block (`RT_THREADS`).
pub(crate) const ROUTE_THREADS: u32 = 512;

/// Arguments of `route_bvh` (the router's 16, then the folded norm's
/// weights, eps and output); `checks::nvrtc_check` holds the kernel's PTX
/// parameter list to it.
#[cfg(test)]
pub(crate) const ROUTE_ARGS: usize = 19;

impl RouteTraversal {
    /// Whether a router of `n_prims` leaf primitives is scanned (else walked).
    pub(crate) fn scans(self, n_prims: usize) -> bool {
        match self {
            RouteTraversal::Auto => n_prims <= ROUTE_SCAN_MAX_PRIMS,
            RouteTraversal::Scan => true,
            RouteTraversal::Bvh => false,
        }
    }
}

/// One layer's BVH router on the device.
pub(crate) struct DeviceRouter {
    slices: usize,
    pages: usize,
    n_nodes: usize,
    n_prims: usize,
    proj: CudaSlice<f32>,
    offsets: CudaSlice<f32>,
    nodes: CudaSlice<u8>,
    prims: CudaSlice<u8>,
    thresholds: CudaSlice<u32>,
}

/// Dynamic shared memory for one `route_bvh` launch: the hit masks (rounded
/// up to 16 bytes), then, while the total stays under the 48 KiB a launch
/// gets without opting in, a copy of `x` and then of the BVH nodes (32 bytes
/// each). The kernel reads the size it was given and stages what fits; the
/// result is the same either way.
fn route_smem_bytes(n_pages: usize, d_model: usize, n_nodes: usize) -> u32 {
    const LIMIT: usize = 47 * 1024; // 48 KiB less the kernel's static arrays
    let masks = (4 * n_pages).div_ceil(16) * 16;
    let with_x = masks + 4 * d_model;
    let with_nodes = with_x + 32 * n_nodes;
    let bytes = if with_nodes <= LIMIT {
        with_nodes
    } else if with_x <= LIMIT {
        with_x
    } else {
        masks
    };
    bytes as u32
}

/// The BVH's nodes as the kernel reads them (`RtNode`: min, left_or_first,
/// max, count; 32 bytes each).
fn node_bytes(v: &[BvhNode]) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 * v.len());
    for n in v {
        n.min.iter().for_each(|x| out.extend(x.to_le_bytes()));
        out.extend(n.left_or_first.to_le_bytes());
        n.max.iter().for_each(|x| out.extend(x.to_le_bytes()));
        out.extend(n.count.to_le_bytes());
    }
    out
}

/// The BVH's leaf primitives as the kernel reads them (`RtPrim`: min, page,
/// max, slice; 32 bytes each).
fn prim_bytes(v: &[BvhPrim]) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 * v.len());
    for n in v {
        n.min.iter().for_each(|x| out.extend(x.to_le_bytes()));
        out.extend(n.page.to_le_bytes());
        n.max.iter().for_each(|x| out.extend(x.to_le_bytes()));
        out.extend(n.slice.to_le_bytes());
    }
    out
}

/// A layer's active page list on the device and its shape: the ids, their
/// count, the pages stored and the trunk (always active) ones.
pub(crate) struct LayerList<'a> {
    pub ids: &'a CudaSlice<u32>,
    pub count: &'a CudaSlice<i32>,
    pub n_pages: usize,
    pub n_trunk: usize,
}

impl CudaBackend {
    /// Uploads `data` (a router of layers `d_model` wide) with its BVH.
    pub(crate) fn upload_router(&self, data: &RouterData, d_model: usize) -> Result<DeviceRouter> {
        if data.d_model != d_model {
            return Err(crate::backend::bad(format!(
                "router projects d_model {}, the layer has {d_model}",
                data.d_model
            )));
        }
        let bvh = Bvh::build(data).map_err(|e| crate::backend::bad(e.to_string()))?;
        let s = &self.stream;
        let up_u8 = |v: &[u8]| -> Result<CudaSlice<u8>> {
            if v.is_empty() {
                s.alloc_zeros::<u8>(32).map_err(drv)
            } else {
                s.clone_htod(v).map_err(drv)
            }
        };
        let r = DeviceRouter {
            slices: data.slices,
            pages: data.pages(),
            n_nodes: bvh.nodes.len(),
            n_prims: bvh.prims.len(),
            proj: s.clone_htod(&data.projection).map_err(drv)?,
            offsets: s.clone_htod(&bvh.slice_offsets).map_err(drv)?,
            nodes: up_u8(&node_bytes(&bvh.nodes))?,
            prims: up_u8(&prim_bytes(&bvh.prims))?,
            thresholds: s.clone_htod(&data.thresholds).map_err(drv)?,
        };
        self.account(
            MemKind::Weights,
            4 * data.projection.len() + 32 * (bvh.nodes.len() + bvh.prims.len()),
        );
        Ok(r)
    }

    /// Routes the row at `px` (`d_model` wide) with `r` into `list`. A
    /// pending RMSNorm of a recorded step folds into this launch (the router
    /// reads the norm's output first).
    pub(crate) fn launch_route(
        &self,
        r: &DeviceRouter,
        list: LayerList<'_>,
        px: u64,
        d_model: usize,
        traversal: RouteTraversal,
    ) -> Result<()> {
        let scan = traversal.scans(r.n_prims);
        let tables = vec![
            Arg::Ptr(self.ptr(&r.proj)),
            Arg::I32(r.slices as i32),
            Arg::Ptr(self.ptr(&r.offsets)),
            Arg::Ptr(self.ptr(&r.nodes)),
            Arg::I32(r.n_nodes as i32),
            Arg::Ptr(self.ptr(&r.prims)),
            Arg::I32(r.n_prims as i32),
            Arg::I32(scan as i32),
            Arg::Ptr(self.ptr(&r.thresholds)),
            Arg::I32(r.pages as i32),
            Arg::I32(list.n_pages as i32),
            Arg::I32(list.n_trunk as i32),
            Arg::Ptr(self.ptr(list.ids)),
            Arg::Ptr(self.ptr(list.count)),
        ];
        self.push_launch(Launch {
            kernel: self.kernels.index("route_bvh")?,
            grid: (1, 1, 1),
            block: (ROUTE_THREADS, 1, 1),
            smem: route_smem_bytes(list.n_pages, d_model, if scan { 0 } else { r.n_nodes }),
            work: Work::Route(Route {
                x: px,
                d: d_model as i32,
                tables,
                norm: None,
            }),
        })
    }
}
