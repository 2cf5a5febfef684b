//! Decode attention over selected KV pages, driven on its own: one layer's
//! cache filled from host keys and values, its page boxes, the choice of
//! pages and the attention over them (or over every position), each the
//! backend's own launch ([`crate::CudaBackend`]'s attention code: the same
//! kernels it runs inside a decode graph). For the kernels' tests, where
//! the keys must be known on the host to check the choice against the CPU
//! rule ([`mirage_runtime::kv_pages::KvPruning`]: sinks, recent window, top
//! pages by bound, ties to the lower page index).

use cudarc::driver::CudaSlice;
use half::f16;
use mirage_runtime::backend::TokenSlot;
use mirage_runtime::kv_cache::{quantize_q8_0, KvDtype, KvSpec, Q8_0_BLOCK};
use mirage_runtime::kv_pages::KvPruning;

use crate::attention::{kv_name, CacheAttention, CudaKvCache};
use crate::{CudaBackend, CudaError};

fn rt(e: mirage_runtime::RuntimeError) -> CudaError {
    CudaError::Driver(e.to_string())
}

fn bad(msg: String) -> CudaError {
    CudaError::Setting(msg)
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
    /// Element type (f32, f16 or q8_0).
    pub dtype: KvDtype,
    /// Positions per page.
    pub page: usize,
}

impl LayerKvShape {
    /// Pages per sequence and head.
    pub fn max_pages(&self) -> usize {
        self.n_ctx.div_ceil(self.page)
    }
    fn spec(&self) -> KvSpec {
        KvSpec {
            n_layer: 1,
            n_seq: self.n_seq,
            n_head_kv: self.n_head_kv,
            n_ctx: self.n_ctx,
            head_dim: self.head_dim,
            dtype: self.dtype,
        }
    }
}

/// One layer's KV cache on the device with its page boxes.
pub struct DeviceLayerKv {
    shape: LayerKvShape,
    cache: CudaKvCache,
}

impl DeviceLayerKv {
    /// Its shape.
    pub fn shape(&self) -> &LayerKvShape {
        &self.shape
    }
}

/// The pruned-attention kernels on one device.
pub struct PrunedAttention {
    backend: CudaBackend,
}

impl PrunedAttention {
    /// Opens device `ordinal` and compiles (or loads from the PTX cache) the
    /// kernels. Typed errors when the driver, NVRTC or the device is missing.
    pub fn new(ordinal: usize) -> Result<PrunedAttention, CudaError> {
        Ok(PrunedAttention {
            backend: CudaBackend::new(ordinal)?,
        })
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.backend.device_name()
    }

    /// Uploads f32 values.
    pub fn upload_f32(&self, v: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        self.backend.stream.clone_htod(v).map_err(drv)
    }

    /// Uploads i32 values (token slots: seq, pos pairs).
    pub fn upload_i32(&self, v: &[i32]) -> Result<CudaSlice<i32>, CudaError> {
        self.backend.stream.clone_htod(v).map_err(drv)
    }

    /// Reads f32 values back.
    pub fn download_f32(&self, v: &CudaSlice<f32>) -> Result<Vec<f32>, CudaError> {
        self.backend.stream.clone_dtoh(v).map_err(drv)
    }

    /// A layer cache filled from host keys and values (`shape.elements`
    /// f32 each, the device layout `[n_seq, n_head_kv, n_ctx, head_dim]`),
    /// stored as `shape.dtype` (q8_0: quantized per 32 values as the CPU's
    /// cache, `mirage_runtime::kv_cache::quantize_q8_0`); page boxes zeroed
    /// (call [`PrunedAttention::refresh_bounds`]).
    pub fn upload_kv(
        &self,
        shape: LayerKvShape,
        k: &[f32],
        v: &[f32],
    ) -> Result<DeviceLayerKv, CudaError> {
        let n = shape.n_seq * shape.n_head_kv * shape.n_ctx * shape.head_dim;
        if k.len() != n || v.len() != n || shape.page == 0 {
            return Err(bad(format!(
                "KV of {} / {} values for shape {shape:?} ({n})",
                k.len(),
                v.len()
            )));
        }
        let pruning = KvPruning::all_pages(shape.page);
        let mut cache = self
            .backend
            .new_cache_pruned(shape.spec(), Some(pruning))
            .map_err(rt)?;
        // The cache's bytes and, for q8_0, the scales' bytes.
        let bytes = |x: &[f32]| -> (Vec<u8>, Vec<u8>) {
            match shape.dtype {
                KvDtype::F16 => (
                    x.iter()
                        .flat_map(|&f| f16::from_f32(f).to_bits().to_le_bytes())
                        .collect(),
                    Vec::new(),
                ),
                KvDtype::F32 => (x.iter().flat_map(|f| f.to_le_bytes()).collect(), Vec::new()),
                KvDtype::Q8_0 => {
                    let (mut q, mut d) =
                        (vec![0i8; x.len()], vec![f16::ZERO; x.len() / Q8_0_BLOCK]);
                    quantize_q8_0(x, &mut q, &mut d);
                    (
                        q.iter().map(|&c| c as u8).collect(),
                        d.iter().flat_map(|s| s.to_bits().to_le_bytes()).collect(),
                    )
                }
            }
        };
        let s = &self.backend.stream;
        let ((kb, kd), (vb, vd)) = (bytes(k), bytes(v));
        s.memcpy_htod(&kb, &mut cache.k[0]).map_err(drv)?;
        s.memcpy_htod(&vb, &mut cache.v[0]).map_err(drv)?;
        if shape.dtype == KvDtype::Q8_0 {
            s.memcpy_htod(&kd, &mut cache.k_scale[0]).map_err(drv)?;
            s.memcpy_htod(&vd, &mut cache.v_scale[0]).map_err(drv)?;
        }
        Ok(DeviceLayerKv { shape, cache })
    }

    /// Recomputes the boxes of pages `first_page..` of `seq` that hold
    /// positions `< n` (after a prefill: 0; after a decode step: the page of
    /// the new position), as the backend does after writing those positions.
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
        let slots: Vec<TokenSlot> = (first_page * s.page..n)
            .map(|pos| TokenSlot { seq, pos })
            .collect();
        let b = &self.backend;
        let pslots = b.slots_ptr(&mut b.scratch(), &slots).map_err(rt)?;
        let pages = kv.cache.pages.as_ref().expect("made with page boxes");
        let [pkc, _, pkd, _] = b.layer_cache(&kv.cache, 0);
        b.refresh_page_boxes(
            pages,
            0,
            &slots,
            pslots,
            [pkc, pkd],
            kv_name(s.dtype),
            &s.spec(),
        )
        .map_err(rt)
    }

    /// The split attention of `rows` query rows (`q`: `[rows, n_head,
    /// head_dim]`; `slots`: seq, pos pairs on the device; row r attends
    /// positions `0..=pos`) into `out` (`[rows, n_head, head_dim]`): over
    /// every position (`pruning` `None`) or over the pages `pruning`
    /// chooses from the boxes (which must be current; its page size must be
    /// the cache's).
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &mut self,
        kv: &mut DeviceLayerKv,
        q: &CudaSlice<f32>,
        slots: &CudaSlice<i32>,
        rows: usize,
        n_head: usize,
        pruning: Option<&KvPruning>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let s = kv.shape;
        if rows == 0 || n_head == 0 || !n_head.is_multiple_of(s.n_head_kv) {
            return Err(bad(format!(
                "{rows} rows, {n_head} heads over {} KV heads",
                s.n_head_kv
            )));
        }
        if q.len() < rows * n_head * s.head_dim
            || out.len() < rows * n_head * s.head_dim
            || slots.len() < 2 * rows
        {
            return Err(bad("query, output or slot buffer too small".into()));
        }
        let b = &self.backend;
        let [kc, vc, kd, vd] = b.layer_cache(&kv.cache, 0);
        let at = CacheAttention {
            q: b.ptr(q),
            kc,
            vc,
            kd,
            vd,
            slots: b.ptr(slots),
            out: b.ptr(out),
            rows,
            n_head,
            n_head_kv: s.n_head_kv,
            head_dim: s.head_dim,
            n_ctx: s.n_ctx,
            // The positions are on the device only: any up to the cache size.
            max_keys: s.n_ctx,
            kv: kv_name(s.dtype),
        };
        match pruning {
            None => b.attend_cache(&at, None),
            Some(cfg) => b
                .set_cache_pruning(&mut kv.cache, Some(*cfg))
                .and_then(|()| {
                    let pages = kv.cache.pages.as_ref().expect("made with page boxes");
                    b.attend_pages(pages, 0, &at, 0, rows, false)
                }),
        }
        .map_err(rt)
    }

    /// The page boxes of `seq`, KV head `head`, page `page` read back
    /// (min, max).
    pub fn read_bounds(
        &self,
        kv: &DeviceLayerKv,
        seq: usize,
        head: usize,
        page: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
        let s = kv.shape;
        let pages = kv.cache.pages.as_ref().expect("made with page boxes");
        let at = ((seq * s.n_head_kv + head) * pages.max_pages + page) * s.head_dim;
        let read = |b: &CudaSlice<f32>| {
            self.backend
                .stream
                .clone_dtoh(&b.slice(at..at + s.head_dim))
                .map_err(drv)
        };
        Ok((read(&pages.kmin[0])?, read(&pages.kmax[0])?))
    }
}

fn drv(e: cudarc::driver::DriverError) -> CudaError {
    CudaError::Driver(e.to_string())
}
