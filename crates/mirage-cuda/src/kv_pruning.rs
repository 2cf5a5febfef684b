//! Decode attention over selected KV pages on the GPU (issue 10): page key
//! boxes kept on the device, the exact `q·k` upper bound of every page and
//! the choice of pages made on the device, split-K attention over the chosen
//! pages only (`cuda/attention_pruned.cu`).
//!
//! The kernels are part of [`crate::module::DENSE_SOURCE`], so
//! [`crate::CudaBackend`] runs them inside its decode graph: a cache from
//! `Backend::new_kv_cache_pruned(spec, Some(pruning))` keeps per-layer page
//! boxes on the device, refreshed for every page a step writes, and its
//! decode rows attend the pages the rule chooses (see the backend's
//! `attention`). The choice: the bound of every page as an order-preserving
//! key (`page_keys`, many blocks per head), then a radix select of the K-th
//! largest key and a scan that lists the chosen pages in increasing order
//! (`select_pages`, one block per head, O(pages / threads) per pass).
//!
//! [`PrunedAttention`] drives the same kernels as a stand-alone device (its
//! own context and stream, full attention — dense.cu's
//! `attend_part`/`attend_combine` — beside it) for kernel tests and for
//! `pruned-attention-bench`. It works on one layer's cache in the backend's
//! layout, `[n_seq, n_head_kv, n_ctx, head_dim]` of f32 or f16, with the
//! selection rule of the CPU path ([`mirage_runtime::kv_pages::KvPruning`]:
//! sinks, recent window, top pages by bound, ties to the lower page index).

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use half::f16;
use mirage_runtime::kv_cache::KvDtype;
use mirage_runtime::kv_pages::KvPruning;

use crate::{module, CudaError};

/// The kernels: nvfp4.cu and dense.cu (helpers and the full attention), then
/// attention_pruned.cu — the backend's module.
pub const PRUNED_SOURCE: &str = module::DENSE_SOURCE;

/// `ATT_THREADS` of dense.cu.
const ATT_THREADS: u32 = 256;
/// `SEL_THREADS` and `KEY_THREADS` of attention_pruned.cu.
pub(crate) const SEL_THREADS: u32 = 512;
pub(crate) const KEY_THREADS: u32 = 128;
/// Blocks the split-K grids aim for (a couple of waves on an H200's 132 SMs).
const TARGET_BLOCKS: usize = 264;
/// Fewest positions per split of full attention (the backend's rule).
const MIN_CHUNK: usize = 256;

fn drv(e: cudarc::driver::DriverError) -> CudaError {
    CudaError::Driver(e.to_string())
}

fn bad(msg: String) -> CudaError {
    CudaError::Driver(format!("invalid argument: {msg}"))
}

/// Shape of one layer's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerKvShape {
    /// Sequence slots.
    pub n_seq: usize,
    /// KV heads.
    pub n_head_kv: usize,
    /// Positions per sequence.
    pub n_ctx: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Element type (f32 or f16).
    pub dtype: KvDtype,
    /// Positions per page.
    pub page: usize,
}

impl LayerKvShape {
    /// Pages per sequence and head.
    pub fn max_pages(&self) -> usize {
        self.n_ctx.div_ceil(self.page)
    }
    fn elements(&self) -> usize {
        self.n_seq * self.n_head_kv * self.n_ctx * self.head_dim
    }
}

/// One layer's KV cache on the device with its page boxes.
pub struct DeviceLayerKv {
    shape: LayerKvShape,
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    kmin: CudaSlice<f32>,
    kmax: CudaSlice<f32>,
}

impl DeviceLayerKv {
    /// Its shape.
    pub fn shape(&self) -> &LayerKvShape {
        &self.shape
    }
}

/// The pruned-attention kernels on one device.
pub struct PrunedAttention {
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    device_name: String,
    page_bounds: [CudaFunction; 2],
    page_keys: CudaFunction,
    select_pages: CudaFunction,
    attend_pages_part: [CudaFunction; 2],
    attend_pages_combine: CudaFunction,
    attend_part: [CudaFunction; 2],
    attend_combine: CudaFunction,
    part: Option<CudaSlice<f32>>,
    keys: Option<CudaSlice<u32>>,
    sel: Option<CudaSlice<i32>>,
    nsel: Option<CudaSlice<i32>>,
}

fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    n: usize,
) -> Result<u64, CudaError> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = Some(stream.alloc_zeros::<T>(n.max(1)).map_err(drv)?);
    }
    let s = slot.as_ref().expect("allocated above");
    let (p, _guard) = cudarc::driver::DevicePtr::device_ptr(s, stream);
    Ok(p)
}

impl PrunedAttention {
    /// Opens device `ordinal` and compiles (or loads from the PTX cache) the
    /// kernels. Typed errors when the driver, NVRTC or the device is missing.
    pub fn new(ordinal: usize) -> Result<PrunedAttention, CudaError> {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::DriverNotFound);
        }
        cudarc::driver::result::init().map_err(drv)?;
        let count = CudaContext::device_count().map_err(drv)?.max(0) as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        // SAFETY: nothing has been allocated through this handle yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let device_name = ctx.name().map_err(drv)?;
        let cc = ctx.compute_capability().map_err(drv)?;
        // The backend's module: the same PTX cache entry as `CudaBackend`.
        let (ptx, _) = module::ptx_for("dense", PRUNED_SOURCE, cc.0, cc.1)?;
        let m = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(drv)?;
        let load = |n: &str| m.load_function(n).map_err(drv);
        Ok(PrunedAttention {
            page_bounds: [load("page_bounds_f32")?, load("page_bounds_f16")?],
            page_keys: load("page_keys")?,
            select_pages: load("select_pages")?,
            attend_pages_part: [
                load("attend_pages_part_f32")?,
                load("attend_pages_part_f16")?,
            ],
            attend_pages_combine: load("attend_pages_combine")?,
            attend_part: [load("attend_part_f32")?, load("attend_part_f16")?],
            attend_combine: load("attend_combine")?,
            _ctx: ctx,
            stream,
            device_name,
            part: None,
            keys: None,
            sel: None,
            nsel: None,
        })
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Waits for every launched kernel.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(drv)
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        // Event tracking is off (one stream), so the guard has nothing to do.
        let (p, _guard) = cudarc::driver::DevicePtr::device_ptr(s, &self.stream);
        p
    }

    /// Uploads f32 rows.
    pub fn upload_f32(&self, v: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        self.stream.clone_htod(v).map_err(drv)
    }

    /// Uploads i32 values (token slots: seq, pos pairs).
    pub fn upload_i32(&self, v: &[i32]) -> Result<CudaSlice<i32>, CudaError> {
        self.stream.clone_htod(v).map_err(drv)
    }

    /// Reads f32 values back.
    pub fn download_f32(&self, v: &CudaSlice<f32>) -> Result<Vec<f32>, CudaError> {
        self.stream.clone_dtoh(v).map_err(drv)
    }

    /// A layer cache filled from host keys and values (`shape.elements()`
    /// f32 each, the device layout), stored as `shape.dtype`; page boxes
    /// zeroed (call [`PrunedAttention::refresh_bounds`]).
    pub fn upload_kv(
        &self,
        shape: LayerKvShape,
        k: &[f32],
        v: &[f32],
    ) -> Result<DeviceLayerKv, CudaError> {
        if shape.page == 0
            || shape.head_dim == 0
            || shape.head_dim > 256
            || shape.head_dim % 32 != 0
        {
            return Err(bad(format!(
                "unsupported page {} / head_dim {}",
                shape.page, shape.head_dim
            )));
        }
        if !matches!(shape.dtype, KvDtype::F32 | KvDtype::F16) {
            return Err(bad(format!(
                "KV dtype {:?} has no CUDA kernel",
                shape.dtype
            )));
        }
        let n = shape.elements();
        if k.len() != n || v.len() != n {
            return Err(bad(format!(
                "KV of {} / {} values for shape {shape:?} ({n})",
                k.len(),
                v.len()
            )));
        }
        let bytes = |x: &[f32]| -> Vec<u8> {
            match shape.dtype {
                KvDtype::F16 => x
                    .iter()
                    .flat_map(|&f| f16::from_f32(f).to_bits().to_le_bytes())
                    .collect(),
                _ => x.iter().flat_map(|f| f.to_le_bytes()).collect(),
            }
        };
        let boxes = shape.n_seq * shape.n_head_kv * shape.max_pages() * shape.head_dim;
        Ok(DeviceLayerKv {
            shape,
            k: self.stream.clone_htod(&bytes(k)).map_err(drv)?,
            v: self.stream.clone_htod(&bytes(v)).map_err(drv)?,
            kmin: self.stream.alloc_zeros::<f32>(boxes).map_err(drv)?,
            kmax: self.stream.alloc_zeros::<f32>(boxes).map_err(drv)?,
        })
    }

    /// Recomputes the boxes of pages `first_page..` of `seq` that hold
    /// positions `< n` (after a prefill: 0; after a decode step: the page of
    /// the new position).
    pub fn refresh_bounds(
        &self,
        kv: &mut DeviceLayerKv,
        seq: usize,
        first_page: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        let s = kv.shape;
        if seq >= s.n_seq || n > s.n_ctx {
            return Err(bad(format!("seq {seq} / {n} positions outside {s:?}")));
        }
        let last = n.div_ceil(s.page);
        if first_page >= last {
            return Ok(());
        }
        let f = &self.page_bounds[(s.dtype == KvDtype::F16) as usize];
        let cfg = LaunchConfig {
            grid_dim: ((last - first_page) as u32, s.n_head_kv as u32, 1),
            block_dim: (s.head_dim as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (pk, pmin, pmax) = (self.ptr(&kv.k), self.ptr(&kv.kmin), self.ptr(&kv.kmax));
        let ints = [
            seq,
            s.n_head_kv,
            s.head_dim,
            s.n_ctx,
            s.page,
            first_page,
            n,
            s.max_pages(),
        ]
        .map(|x| x as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(&pk);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&pmin).arg(&pmax);
        // SAFETY: the buffers have the sizes `s` implies; pages past `n` are
        // not read.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    fn check_rows(
        &self,
        kv: &DeviceLayerKv,
        q: &CudaSlice<f32>,
        slots: &CudaSlice<i32>,
        rows: usize,
        n_head: usize,
    ) -> Result<(), CudaError> {
        let s = kv.shape;
        if rows == 0 || n_head == 0 || n_head % s.n_head_kv != 0 {
            return Err(bad(format!(
                "{rows} rows, {n_head} heads over {} KV heads",
                s.n_head_kv
            )));
        }
        if q.len() < rows * n_head * s.head_dim || slots.len() < 2 * rows {
            return Err(bad("query or slot buffer too small".into()));
        }
        Ok(())
    }

    /// Full causal attention of `rows` query rows (`q`: `[rows, n_head,
    /// head_dim]`; `slots`: seq, pos pairs on the device; row r attends
    /// positions `0..=pos`) with dense.cu's split-K kernels, into `out`
    /// (`[rows, n_head, head_dim]`).
    pub fn attend_full(
        &mut self,
        kv: &DeviceLayerKv,
        q: &CudaSlice<f32>,
        slots: &CudaSlice<i32>,
        rows: usize,
        n_head: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.check_rows(kv, q, slots, rows, n_head)?;
        let s = kv.shape;
        let n_split = s
            .n_ctx
            .div_ceil(MIN_CHUNK)
            .min((TARGET_BLOCKS / (rows * n_head)).max(1))
            .max(1);
        let chunk = s.n_ctx.div_ceil(n_split);
        let ppart = grow(
            &self.stream,
            &mut self.part,
            rows * n_head * n_split * (s.head_dim + 2),
        )?;
        let (pq, pk, pv, pslots, pout) = (
            self.ptr(q),
            self.ptr(&kv.k),
            self.ptr(&kv.v),
            self.ptr(slots),
            self.ptr(out),
        );
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let (nh, nkv, hd, n_ctx, chunk_i, ns) = (
            n_head as i32,
            s.n_head_kv as i32,
            s.head_dim as i32,
            s.n_ctx as i32,
            chunk as i32,
            n_split as i32,
        );
        let f = &self.attend_part[(s.dtype == KvDtype::F16) as usize];
        let mut b = self.stream.launch_builder(f);
        b.arg(&pq)
            .arg(&pk)
            .arg(&pv)
            .arg(&pslots)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&n_ctx)
            .arg(&chunk_i)
            .arg(&scale)
            .arg(&ppart);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, n_head as u32, n_split as u32),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: buffers sized by check_rows and the shape.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        let mut b = self.stream.launch_builder(&self.attend_combine);
        b.arg(&ppart)
            .arg(&pslots)
            .arg(&nh)
            .arg(&hd)
            .arg(&ns)
            .arg(&chunk_i)
            .arg(&pout);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, n_head as u32, 1),
            block_dim: (s.head_dim as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    /// Attention of the same rows over the pages `cfg` selects, the pages
    /// chosen on the device from the boxes (which must be current). Layers
    /// below `cfg.dense_layers` are the caller's business (it calls
    /// [`PrunedAttention::attend_full`] for them).
    #[allow(clippy::too_many_arguments)]
    pub fn attend_pruned(
        &mut self,
        kv: &DeviceLayerKv,
        q: &CudaSlice<f32>,
        slots: &CudaSlice<i32>,
        rows: usize,
        n_head: usize,
        cfg: &KvPruning,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.pruned(kv, q, slots, rows, n_head, cfg, Some(out))
    }

    /// Only the page choice of [`PrunedAttention::attend_pruned`] (bounds
    /// and selection, no attention): for timing its share.
    pub fn select_only(
        &mut self,
        kv: &DeviceLayerKv,
        q: &CudaSlice<f32>,
        slots: &CudaSlice<i32>,
        rows: usize,
        n_head: usize,
        cfg: &KvPruning,
    ) -> Result<(), CudaError> {
        self.pruned(kv, q, slots, rows, n_head, cfg, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn pruned(
        &mut self,
        kv: &DeviceLayerKv,
        q: &CudaSlice<f32>,
        slots: &CudaSlice<i32>,
        rows: usize,
        n_head: usize,
        cfg: &KvPruning,
        out: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), CudaError> {
        self.check_rows(kv, q, slots, rows, n_head)?;
        let s = kv.shape;
        if cfg.page != s.page {
            return Err(bad(format!(
                "pruning page {} differs from the cache's {}",
                cfg.page, s.page
            )));
        }
        let max_sel = cfg
            .max_selected_for(s.max_pages())
            .min(s.max_pages())
            .max(1);
        let n_split = max_sel.min((TARGET_BLOCKS / (rows * n_head)).max(1)).max(1);
        let ppart = grow(
            &self.stream,
            &mut self.part,
            rows * n_head * n_split * (s.head_dim + 2),
        )?;
        let pkeys = grow(&self.stream, &mut self.keys, rows * n_head * s.max_pages())?;
        let psel = grow(&self.stream, &mut self.sel, rows * n_head * max_sel)?;
        let pnsel = grow(&self.stream, &mut self.nsel, rows * n_head)?;
        let (pq, pk, pv, pslots, pout) = (
            self.ptr(q),
            self.ptr(&kv.k),
            self.ptr(&kv.v),
            self.ptr(slots),
            out.as_ref().map_or(0, |o| self.ptr(&**o)),
        );
        let (pmin, pmax) = (self.ptr(&kv.kmin), self.ptr(&kv.kmax));
        let clamp = |x: usize| x.min(i32::MAX as usize) as i32;
        let (nh, nkv, hd, n_ctx, page, maxp) = (
            n_head as i32,
            s.n_head_kv as i32,
            s.head_dim as i32,
            s.n_ctx as i32,
            s.page as i32,
            s.max_pages() as i32,
        );
        let (sinks, recent, top, msel, ns) = (
            clamp(cfg.sink_pages),
            clamp(cfg.recent_pages),
            clamp(cfg.top_pages),
            max_sel as i32,
            n_split as i32,
        );
        // Every row is pruned here (no decode-row check), `n_rows` unused.
        let (only_decode, n_rows, row_base) = (0i32, rows as i32, 0i32);
        let mut b = self.stream.launch_builder(&self.page_keys);
        b.arg(&pq)
            .arg(&pslots)
            .arg(&pmin)
            .arg(&pmax)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&page)
            .arg(&maxp);
        b.arg(&sinks)
            .arg(&recent)
            .arg(&only_decode)
            .arg(&n_rows)
            .arg(&row_base)
            .arg(&pkeys);
        let lc = LaunchConfig {
            grid_dim: (
                rows as u32,
                n_head as u32,
                s.max_pages().div_ceil(KEY_THREADS as usize) as u32,
            ),
            block_dim: (KEY_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: keys holds max_pages entries per (row, head).
        unsafe { b.launch(lc) }.map_err(drv)?;
        let top_percent = clamp(cfg.top_percent);
        let mut b = self.stream.launch_builder(&self.select_pages);
        b.arg(&pkeys)
            .arg(&pslots)
            .arg(&nh)
            .arg(&page)
            .arg(&maxp)
            .arg(&sinks)
            .arg(&recent)
            .arg(&top)
            .arg(&top_percent)
            .arg(&msel)
            .arg(&only_decode)
            .arg(&n_rows)
            .arg(&row_base)
            .arg(&psel)
            .arg(&pnsel);
        let lc = LaunchConfig {
            grid_dim: (rows as u32, n_head as u32, 1),
            block_dim: (SEL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: buffers sized above; the kernel writes at most max_sel
        // entries per (row, head).
        unsafe { b.launch(lc) }.map_err(drv)?;
        if out.is_none() {
            return Ok(());
        }
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let f = &self.attend_pages_part[(s.dtype == KvDtype::F16) as usize];
        let mut b = self.stream.launch_builder(f);
        b.arg(&pq)
            .arg(&pk)
            .arg(&pv)
            .arg(&pslots)
            .arg(&psel)
            .arg(&pnsel)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&n_ctx);
        b.arg(&page)
            .arg(&msel)
            .arg(&only_decode)
            .arg(&n_rows)
            .arg(&row_base)
            .arg(&scale)
            .arg(&ppart);
        let lc = LaunchConfig {
            grid_dim: (rows as u32, n_head as u32, n_split as u32),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above.
        unsafe { b.launch(lc) }.map_err(drv)?;
        let mut b = self.stream.launch_builder(&self.attend_pages_combine);
        b.arg(&ppart)
            .arg(&pslots)
            .arg(&nh)
            .arg(&hd)
            .arg(&ns)
            .arg(&only_decode)
            .arg(&n_rows)
            .arg(&row_base)
            .arg(&pout);
        let lc = LaunchConfig {
            grid_dim: (rows as u32, n_head as u32, 1),
            block_dim: (s.head_dim as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above.
        unsafe { b.launch(lc) }.map_err(drv)?;
        Ok(())
    }

    /// The page boxes of `seq`, KV head `head`, page `page` read back
    /// (min, max), for tests.
    pub fn read_bounds(
        &self,
        kv: &DeviceLayerKv,
        seq: usize,
        head: usize,
        page: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
        let s = kv.shape;
        let at = ((seq * s.n_head_kv + head) * s.max_pages() + page) * s.head_dim;
        let lo = self
            .stream
            .clone_dtoh(&kv.kmin.slice(at..at + s.head_dim))
            .map_err(drv)?;
        let hi = self
            .stream
            .clone_dtoh(&kv.kmax.slice(at..at + s.head_dim))
            .map_err(drv)?;
        Ok((lo, hi))
    }
}
