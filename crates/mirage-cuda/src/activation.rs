//! [`ActivationCudaBackend`]: activation sparsity on CUDA for the FFN.
//! Every op but the FFN is the inner [`CudaBackend`]'s (Q/K/V/O and the lm
//! head stay dense: on an H100, with their list kernel, their sparse
//! products ran 0.7-1.3x the dense kernels at half the channels skipped,
//! the FFN's 1.4-2.3x).
//!
//! Per FFN and decode row (`cuda/activation_sparse.cu`, inside the step's
//! CUDA graph, nothing read back), three launches where the dense FFN takes
//! two:
//! 1. `asp_select` on the normed row: gate's and up's lists (their own
//!    thresholds) in one launch, the FFN's RMSNorm folded in
//!    (`fusion::fold_norm`: each of its few blocks normalizes the row
//!    itself; the product's many blocks read only the lists);
//! 2. the gate and up products in one `asp_mv_*` launch, whose epilogue
//!    makes h = SiLU(gate) * up and down's list of it, tile by tile;
//! 3. the down product, the runtime's residual add folded in
//!    (`fusion::fold_epilogue`: `y = product + y`).
//!
//! The active channels of a matrix are those with `|x_i| >= thr_i` (the
//! CPU `ActivationBackend`'s rule and its int8 rounding of the active
//! inputs per group of 32); a matrix without thresholds reads every
//! channel through the same kernels; a layer whose three matrices have none
//! runs the dense FFN. Prompt batches run the dense kernels on inputs with
//! the inactive channels zeroed (`asp_mask`), as the CPU path does.
//!
//! The module's kernels start by waiting on their prerequisite grid
//! (`cuda/pdl.cu`), so they launch with programmatic serialization like the
//! dense ones.
//!
//! Device memory: the dense weights (prompt batches, layers without
//! thresholds) and the GPU channel-major copies of gate, up and down
//! ([`crate::asp_layout`], built from the artifact's channel-major
//! matrices).

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::CudaSlice;
use mirage_artifact::activation::format::ActivationArtifact;
use mirage_artifact::activation::{matrix_index, Proj};
use mirage_gguf::GgmlType;
use mirage_runtime::backend::{Backend, HostMatrix};
use mirage_runtime::Result;

use crate::asp_layout::{from_channel_major, AspLayout, GROUP, RECORD_BYTES, WARP_OUTPUTS};
use crate::backend::{bad, drv, CudaActivations, CudaBackend, MemKind};
use crate::launch::{AspProduct, AspSelect, Launch, Work};
use crate::{module, CudaError, CudaFfn, CudaKvCache, CudaMatrix, CudaVector};

/// Warps of an `asp_mv_*` block.
const WARPS: usize = 8;

/// Most groups of 32 channels one block takes (`ASP_MAX_BLOCK_GROUPS`).
const MAX_BLOCK_GROUPS: usize = 64;

/// The default tile width (outputs a block owns).
pub const DEFAULT_TILE: usize = 512;

/// `asp_select`'s parameters, and `asp_mv_*`'s.
#[cfg(test)]
pub(crate) const SELECT_ARGS: usize = 11;
#[cfg(test)]
pub(crate) const MATVEC_ARGS: usize = 15;

/// The product kernel of `ty` for tiles of `tile` outputs.
fn matvec_kernel(ty: GgmlType, tile: usize) -> String {
    let variant = match ty {
        GgmlType::Q8_0 => "q8_0_serial_c8",
        GgmlType::Q4_1 => "q4_1_serial_c16",
        GgmlType::Q5_0 => "q5_0_pipelined_c8",
        GgmlType::Q6_K => "q6_k_serial_c8",
        // Q4_K; the layout refuses every other type before a launch.
        _ => "q4_k_serial_c16",
    };
    format!("asp_mv_{variant}_w{WARPS}_t{tile}")
}

/// Every kernel the backend loads from the activation-sparse module.
pub(crate) fn kernel_names() -> Vec<String> {
    let mut v = vec!["asp_select".to_string(), "asp_mask".to_string()];
    for ty in crate::asp_layout::TYPES {
        for tile in [512, 1024, 2048] {
            v.push(matvec_kernel(ty, tile));
        }
    }
    v
}

/// Launch shape of a product: groups a warp walks and splits of the
/// channels. The most groups a warp (fewest partial rows) that still gives
/// two blocks per SM (a block of 8 warps takes half an SM's threads).
pub(crate) fn launch_shape(l: &AspLayout, mats: usize, sm_count: usize) -> (usize, usize) {
    let subsets = WARPS / (l.tile / WARP_OUTPUTS);
    let n_groups = l.cols / GROUP;
    let splits = |gpw: usize| n_groups.div_ceil(subsets * gpw);
    for gpw in [8, 4, 2] {
        if subsets * gpw <= MAX_BLOCK_GROUPS && l.n_tiles() * mats * splits(gpw) >= 2 * sm_count {
            return (gpw, splits(gpw));
        }
    }
    (1, splits(1))
}

/// A matrix in the GPU channel-major layout.
#[derive(Debug)]
struct AspMatrix {
    layout: AspLayout,
    data: CudaSlice<u8>,
}

/// One layer's layouts, lists and whether a decode row wrote the lists.
type LayerLists = ([AspLayout; 3], [CudaSlice<u8>; 3], bool);

/// One layer's FFN: the dense op and the GPU channel-major copies.
#[derive(Debug)]
pub struct AspFfn {
    layer: usize,
    dense: CudaFfn,
    gate: AspMatrix,
    up: AspMatrix,
    down: AspMatrix,
    /// Device addresses of the layer's lists (gate, up, down).
    lists: [u64; 3],
}

/// Device buffers the sparse FFN shares across layers (one stream: used in
/// order). Sized at upload, before any step records pointers to them; a
/// buffer that grows keeps its old allocation in `retired`.
#[derive(Default)]
struct AspScratch {
    gate: Option<CudaSlice<f32>>,
    up: Option<CudaSlice<f32>>,
    part: Option<CudaSlice<f32>>,
    ctr: Option<CudaSlice<u32>>,
    masked: CudaActivations,
    batch: [CudaActivations; 3],
    retired: Vec<CudaSlice<f32>>,
    retired_ctr: Vec<CudaSlice<u32>>,
}

/// Weight bytes of the FFN products of one decode row
/// ([`ActivationCudaBackend::last_row_ffn_bytes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FfnBytes {
    /// What the sparse kernels read: runs of active channels and the
    /// scales of groups with one.
    pub sparse: u64,
    /// The whole FFN matrices (what the dense path reads).
    pub dense: u64,
    /// Active channels over the channels of every FFN product.
    pub kept: f64,
}

/// The activation-sparse CUDA backend. See the module doc.
pub struct ActivationCudaBackend {
    inner: CudaBackend,
    artifact: Arc<ActivationArtifact>,
    n_layer: usize,
    tile: usize,
    /// Per matrix index (`layer * 7 + proj`, the head last): the device
    /// thresholds; only gate, up and down are read.
    thresholds: Mutex<Vec<Option<CudaSlice<f32>>>>,
    scratch: Mutex<AspScratch>,
    /// Per layer: the layouts of gate, up and down, their channel lists
    /// (gate's and up's of the FFN input, down's of h; the backend owns
    /// them, the layer's [`AspFfn`] holds their addresses), and whether a
    /// decode row wrote them.
    layers: Mutex<Vec<Option<LayerLists>>>,
}

impl std::fmt::Debug for ActivationCudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ActivationCudaBackend {{ {:?}, tile {} }}",
            self.inner, self.tile
        )
    }
}

impl ActivationCudaBackend {
    /// Wraps `inner` (its context, stream and step recorder) and loads the
    /// activation-sparse kernels into it; FFN decode rows read `artifact`'s
    /// matrices in tiles of [`DEFAULT_TILE`] outputs.
    pub fn new(
        inner: CudaBackend,
        artifact: Arc<ActivationArtifact>,
    ) -> std::result::Result<ActivationCudaBackend, CudaError> {
        Self::with_tile(inner, artifact, DEFAULT_TILE)
    }

    /// As [`ActivationCudaBackend::new`], tiles of `tile` (512, 1024 or
    /// 2048) outputs.
    pub fn with_tile(
        mut inner: CudaBackend,
        artifact: Arc<ActivationArtifact>,
        tile: usize,
    ) -> std::result::Result<ActivationCudaBackend, CudaError> {
        if ![512, 1024, 2048].contains(&tile) {
            return Err(CudaError::Driver(format!(
                "activation-sparse tiles of {tile} outputs: 512, 1024 or 2048"
            )));
        }
        let cc = inner.compute_capability();
        let (ptx, _) = module::ptx_for(
            "activation_sparse",
            module::ACTIVATION_SPARSE_SOURCE,
            cc.0,
            cc.1,
        )?;
        let m = inner
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.clone()))
            .map_err(|e| CudaError::Driver(e.to_string()))?;
        inner.kernels.load(&m, &ptx, &kernel_names())?;
        let n_layer = artifact.meta().n_layer;
        Ok(ActivationCudaBackend {
            inner,
            artifact,
            n_layer,
            tile,
            thresholds: Mutex::new((0..n_layer * Proj::ALL.len() + 1).map(|_| None).collect()),
            scratch: Mutex::new(AspScratch::default()),
            layers: Mutex::new((0..n_layer).map(|_| None).collect()),
        })
    }

    /// The dense backend every other op runs on.
    pub fn inner(&self) -> &CudaBackend {
        &self.inner
    }

    /// The artifact the FFN matrices come from.
    pub fn artifact(&self) -> &Arc<ActivationArtifact> {
        &self.artifact
    }

    fn scratch(&self) -> MutexGuard<'_, AspScratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the thresholds (`None`: every channel), indexed by
    /// `matrix_index`, the head last, as the CPU backend's
    /// `set_thresholds`; only gate, up and down take theirs (the other
    /// matrices run dense on CUDA). Not inside a step.
    pub fn set_thresholds(&self, thresholds: Vec<Option<Vec<f32>>>) -> Result<()> {
        let n_mat = self.n_layer * Proj::ALL.len() + 1;
        if thresholds.len() != n_mat {
            return Err(bad(format!(
                "{} threshold entries for {} layers and the head",
                thresholds.len(),
                self.n_layer
            )));
        }
        let (d, n_ff) = (self.artifact.meta().d_model, self.artifact.meta().n_ff);
        let mut dev: Vec<Option<CudaSlice<f32>>> = (0..n_mat).map(|_| None).collect();
        for (m, t) in thresholds.into_iter().enumerate() {
            let p = Proj::ALL[m % Proj::ALL.len()];
            let Some(v) = t else { continue };
            if m >= self.n_layer * Proj::ALL.len()
                || !matches!(p, Proj::Gate | Proj::Up | Proj::Down)
            {
                continue;
            }
            let want = if p == Proj::Down { n_ff } else { d };
            if v.len() != want {
                return Err(bad(format!(
                    "layer {} {}: {} thresholds for {want} channels",
                    m / Proj::ALL.len(),
                    p.name(),
                    v.len()
                )));
            }
            dev[m] = Some(self.inner.stream.clone_htod(&v).map_err(drv)?);
        }
        // Let queued work that reads the old thresholds finish first.
        self.inner.synchronize()?;
        *self.thresholds.lock().unwrap_or_else(|e| e.into_inner()) = dev;
        // The lists were written under the old thresholds: until a decode
        // row rewrites them, `last_row_ffn_bytes` must not count them.
        for l in self
            .layers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
            .flatten()
        {
            l.2 = false;
        }
        Ok(())
    }

    /// The FFN weight bytes of the last decode row each layer ran through
    /// the sparse kernels, summed over those layers (reads the lists back:
    /// waits for the device; outside a step).
    pub fn last_row_ffn_bytes(&self) -> Result<FfnBytes> {
        self.inner.synchronize()?;
        let layers = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = FfnBytes::default();
        let (mut kept, mut total) = (0u64, 0u64);
        for (layouts, lists) in layers
            .iter()
            .flatten()
            .filter(|(_, _, ran)| *ran)
            .map(|(l, s, _)| (l, s))
        {
            for (l, list) in layouts.iter().zip(lists.iter()) {
                let mut host = vec![0u8; list.len()];
                self.inner
                    .stream
                    .memcpy_dtoh(list, host.as_mut_slice())
                    .map_err(drv)?;
                self.inner.synchronize()?;
                // Word 0 of a group's record: its active channels.
                let (active, groups) =
                    host.chunks(RECORD_BYTES)
                        .fold((0usize, 0usize), |(a, g), r| {
                            let k = u32::from_le_bytes([r[0], r[1], r[2], r[3]]) as usize;
                            (a + k, g + (k > 0) as usize)
                        });
                out.sparse += l.bytes_read(active, groups) as u64;
                out.dense += l.bytes() as u64;
                kept += active as u64;
                total += l.cols as u64;
            }
        }
        out.kept = if total > 0 {
            kept as f64 / total as f64
        } else {
            0.0
        };
        Ok(out)
    }

    fn upload_asp(&self, m: &HostMatrix, layer: usize, p: Proj) -> Result<AspMatrix> {
        let a = &self.artifact;
        let e = a
            .matrix(layer, p)
            .ok_or_else(|| bad(format!("{}: not in the activation artifact", m.name)))?;
        let cm = e.layout;
        if cm.rows() != m.rows || cm.cols() != m.cols || cm.ty() != m.ty {
            return Err(bad(format!(
                "{}: the artifact holds a {}x{} {} matrix, the model a {}x{} {}: an artifact of another model",
                m.name,
                cm.rows(),
                cm.cols(),
                cm.ty(),
                m.rows,
                m.cols,
                m.ty
            )));
        }
        let bytes = a
            .bytes()
            .get(e.offset..e.offset + cm.bytes())
            .ok_or_else(|| bad(format!("{}: outside the activation artifact", m.name)))?;
        let (layout, gpu) = from_channel_major(&cm, bytes, self.tile)
            .map_err(|e| bad(format!("{} on CUDA: {e}", m.name)))?;
        let data = self.inner.stream.clone_htod(&gpu).map_err(drv)?;
        self.inner.account(MemKind::Weights, gpu.len());
        Ok(AspMatrix { layout, data })
    }

    /// Grows `slot` to `n` elements, keeping the old buffer alive.
    fn grow_f32(
        &self,
        s: &mut Vec<CudaSlice<f32>>,
        slot: &mut Option<CudaSlice<f32>>,
        n: usize,
    ) -> Result<()> {
        if slot.as_ref().is_none_or(|b| b.len() < n.max(1)) {
            let new = self
                .inner
                .stream
                .alloc_zeros::<f32>(n.max(1))
                .map_err(drv)?;
            self.inner.account(MemKind::Workspace, 4 * n.max(1));
            if let Some(old) = slot.replace(new) {
                s.push(old);
            }
        }
        Ok(())
    }

    fn size_scratch(&self, f: &AspFfn) -> Result<()> {
        let n_ff = f.gate.layout.rows;
        let sm = self.inner.sm_count;
        let (_, s_gu) = launch_shape(&f.gate.layout, 2, sm);
        let (_, s_d) = launch_shape(&f.down.layout, 1, sm);
        let part = (2 * s_gu * f.gate.layout.n_tiles() * self.tile)
            .max(s_d * f.down.layout.n_tiles() * self.tile);
        // Gate's and up's tile counters, then the SwiGLU epilogue's; down
        // uses the first of them.
        let ctr = (3 * f.gate.layout.n_tiles()).max(f.down.layout.n_tiles());
        let mut guard = self.scratch();
        let s = &mut *guard;
        let mut retired = std::mem::take(&mut s.retired);
        self.grow_f32(&mut retired, &mut s.gate, n_ff)?;
        self.grow_f32(&mut retired, &mut s.up, n_ff)?;
        self.grow_f32(&mut retired, &mut s.part, part)?;
        s.retired = retired;
        if s.ctr.as_ref().is_none_or(|c| c.len() < ctr) {
            // Zero at start; every launch leaves them zero. A replaced
            // buffer is kept: launches recorded earlier may point at it.
            let new = self.inner.stream.alloc_zeros::<u32>(ctr).map_err(drv)?;
            self.inner.account(MemKind::Workspace, 4 * ctr);
            if let Some(old) = s.ctr.replace(new) {
                s.retired_ctr.push(old);
            }
        }
        Ok(())
    }

    fn thr(&self, layer: usize, p: Proj) -> u64 {
        let t = self.thresholds.lock().unwrap_or_else(|e| e.into_inner());
        t.get(matrix_index(layer, p))
            .and_then(|s| s.as_ref())
            .map_or(0, |s| self.inner.ptr(s))
    }

    fn select(&self, x: u64, cols: usize, thr: [u64; 3], lists: [u64; 3], n: usize) -> Result<()> {
        let groups = (cols / GROUP) as u32;
        self.inner.push_launch(Launch {
            kernel: self.inner.kernels.index("asp_select")?,
            grid: (groups.div_ceil(8), n as u32, 1),
            block: (256, 1, 1),
            smem: 0,
            work: Work::AspSelect(AspSelect {
                x,
                cols,
                thr,
                lists,
                norm: None,
            }),
        })
    }

    /// The product of `ms` (one, or gate and up with down's list of h made
    /// against `hthr` into `hlist`).
    fn product(
        &self,
        ms: &[&AspMatrix],
        lists: [u64; 2],
        y: [u64; 2],
        hthr: u64,
        hlist: u64,
    ) -> Result<()> {
        let l = ms[0].layout;
        let (gpw, splits) = launch_shape(&l, ms.len(), self.inner.sm_count);
        let (part, ctr) = {
            let s = self.scratch();
            (
                self.inner
                    .ptr(s.part.as_ref().ok_or_else(|| bad("no partial rows"))?),
                self.inner
                    .ptr(s.ctr.as_ref().ok_or_else(|| bad("no tile counters"))?),
            )
        };
        let p = AspProduct {
            w: [
                self.inner.ptr(&ms[0].data),
                ms.get(1).map_or(0, |m| self.inner.ptr(&m.data)),
            ],
            lists,
            y,
            rows: l.rows,
            cols: l.cols,
            gpw,
            splits,
            part,
            ctr,
            hthr,
            hlist,
            accumulate: false,
        };
        self.inner.push_launch(Launch {
            kernel: self.inner.kernels.index(&matvec_kernel(l.ty, l.tile))?,
            grid: ((l.n_tiles() * splits) as u32, ms.len() as u32, 1),
            block: ((WARPS * 32) as u32, 1, 1),
            smem: 0,
            work: Work::AspMv(p),
        })
    }

    /// One decode row through the sparse kernels (see the module doc).
    fn ffn_row(&self, f: &AspFfn, px: u64, po: u64, thr: [u64; 3]) -> Result<()> {
        let d = f.gate.layout.cols;
        let (pg, pu) = {
            let s = self.scratch();
            let p = |b: &Option<CudaSlice<f32>>| b.as_ref().map(|b| self.inner.ptr(b));
            (p(&s.gate), p(&s.up))
        };
        let (Some(pg), Some(pu)) = (pg, pu) else {
            return Err(bad("sparse FFN buffers missing"));
        };
        let [lg, lu, ld] = f.lists;
        self.select(px, d, [thr[0], thr[1], 0], [lg, lu, 0], 2)?;
        self.product(&[&f.gate, &f.up], [lg, lu], [pg, pu], thr[2], ld)?;
        self.product(&[&f.down], [ld, 0], [po, 0], 0, 0)
    }

    /// `out = W (x with its inactive channels zeroed)`, or `W x` without
    /// thresholds (a prompt batch, as the CPU path runs it).
    fn masked(
        &self,
        w: &CudaMatrix,
        thr: u64,
        x: &CudaActivations,
        out: &mut CudaActivations,
    ) -> Result<()> {
        if thr == 0 {
            return self.inner.matmul(w, x, out);
        }
        let mut m = std::mem::take(&mut self.scratch().masked);
        let r = (|| -> Result<()> {
            let px = self.inner.act_ptr(x)?;
            let pm = self.inner.reshape(&mut m, x.rows, x.width)?;
            self.inner.elementwise(
                "asp_mask",
                x.rows * x.width,
                &[px, thr, pm],
                Some(x.width as i32),
            )?;
            self.inner.matmul(w, &m, out)
        })();
        self.scratch().masked = m;
        r
    }
}

impl Backend for ActivationCudaBackend {
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type Ffn = AspFfn;
    type Activations = CudaActivations;
    type KvCache = CudaKvCache;

    fn name(&self) -> String {
        "activation-sparse-cuda".into()
    }

    fn upload_ffn(
        &self,
        layer: usize,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> Result<AspFfn> {
        if layer >= self.n_layer {
            return Err(bad(format!(
                "FFN of layer {layer} beyond the activation artifact's {} layers: an artifact of another model",
                self.n_layer
            )));
        }
        let list = |cols: usize| -> Result<CudaSlice<u8>> {
            let n = cols / GROUP * RECORD_BYTES;
            self.inner.account(MemKind::Workspace, n);
            self.inner.stream.alloc_zeros::<u8>(n).map_err(drv)
        };
        let lists = [list(gate.cols)?, list(up.cols)?, list(down.cols)?];
        let f = AspFfn {
            layer,
            dense: self.inner.upload_ffn(layer, gate, up, down)?,
            gate: self.upload_asp(gate, layer, Proj::Gate)?,
            up: self.upload_asp(up, layer, Proj::Up)?,
            down: self.upload_asp(down, layer, Proj::Down)?,
            lists: [0, 1, 2].map(|k| self.inner.ptr(&lists[k])),
        };
        if f.gate.layout.cols != f.down.layout.rows || f.gate.layout.rows != f.down.layout.cols {
            return Err(bad(format!("layer {layer}: FFN shapes disagree")));
        }
        self.size_scratch(&f)?;
        self.layers.lock().unwrap_or_else(|e| e.into_inner())[layer] =
            Some(([f.gate.layout, f.up.layout, f.down.layout], lists, false));
        Ok(f)
    }

    mirage_runtime::forward_backend_ops!(inner, matrices);

    fn ffn(&self, f: &AspFfn, x: &CudaActivations, out: &mut CudaActivations) -> Result<()> {
        let (d, n_ff) = (f.gate.layout.cols, f.gate.layout.rows);
        if x.width != d {
            return Err(bad(format!("ffn input width {} != {d}", x.width)));
        }
        let thr = [Proj::Gate, Proj::Up, Proj::Down].map(|p| self.thr(f.layer, p));
        if thr == [0; 3] {
            return self.inner.ffn(&f.dense, x, out);
        }
        if x.rows == 1 {
            let px = self.inner.act_ptr(x)?;
            let po = self.inner.reshape(out, 1, d)?;
            self.ffn_row(f, px, po, thr)?;
            if let Some(Some(l)) = self
                .layers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_mut(f.layer)
            {
                l.2 = true;
            }
            return Ok(());
        }
        let mut b = std::mem::take(&mut self.scratch().batch);
        let r = (|| -> Result<()> {
            let [g, u, h] = &mut b;
            self.masked(&f.dense.gate, thr[0], x, g)?;
            self.masked(&f.dense.up, thr[1], x, u)?;
            let n = x.rows * n_ff;
            let ph = self.inner.reshape(h, x.rows, n_ff)?;
            let (pg, pu) = (self.inner.act_ptr(g)?, self.inner.act_ptr(u)?);
            self.inner.elementwise("swiglu", n, &[pg, pu, ph], None)?;
            self.masked(&f.dense.down, thr[2], h, out)
        })();
        self.scratch().batch = b;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every type the GPU layout takes has its product kernel, named for
    /// the type, among those the backend loads (the NVRTC check holds the
    /// loaded names to the module's PTX).
    #[test]
    fn every_layout_type_has_a_loaded_product_kernel() {
        let loaded = kernel_names();
        let mut types = 0;
        for ty in GgmlType::ALL {
            if AspLayout::new(ty, 512, 256, DEFAULT_TILE).is_err() {
                continue;
            }
            types += 1;
            let suffix = ty.to_string().to_lowercase();
            for tile in [512, 1024, 2048] {
                let k = matvec_kernel(ty, tile);
                assert!(k.starts_with(&format!("asp_mv_{suffix}_")), "{ty}: {k}");
                assert!(loaded.contains(&k), "{ty}: {k} is not loaded");
            }
        }
        assert_eq!(types, crate::asp_layout::TYPES.len());
    }
}
