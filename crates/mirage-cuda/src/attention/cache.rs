//! The KV cache on the device: per-layer keys and values (f32, f16 or q8_0), the
//! RoPE tables its attention reads (one per frequency base), and, for a
//! pruned cache, the page key boxes its decode attention selects pages by.

use cudarc::driver::CudaSlice;
use mirage_runtime::kv_cache::{KvDtype, KvSpec, Q8_0_BLOCK};
use mirage_runtime::kv_pages::KvPruning;
use mirage_runtime::Result;

use crate::backend::{bad, drv, CudaBackend, MemKind};
use crate::launch::{Arg, Launch, Work};

/// The KV cache on the device: per layer, `[n_seq, n_head_kv, n_ctx,
/// head_dim]` keys and values, f32, f16 or q8_0 (`spec.dtype`; q8_0 keeps
/// the codes there, one signed byte an element, and one f16 scale per 32 of
/// them in `k_scale` / `v_scale`, `[n_seq, n_head_kv, n_ctx, head_dim /
/// 32]`: ggml's q8_0 blocks, split so that the kernels read aligned
/// 16-byte units of codes), and, for a cache made by
/// `new_kv_cache_pruned(spec, Some(..))`, the page key boxes its decode
/// attention chooses pages by.
#[derive(Debug)]
pub struct CudaKvCache {
    pub(crate) spec: KvSpec,
    pub(crate) k: Vec<CudaSlice<u8>>,
    pub(crate) v: Vec<CudaSlice<u8>>,
    /// q8_0 only (else empty): the scales of `k` and `v`, per layer.
    pub(crate) k_scale: Vec<CudaSlice<u8>>,
    pub(crate) v_scale: Vec<CudaSlice<u8>>,
    pub(crate) pages: Option<KvPageBoxes>,
    /// RoPE tables by frequency base (f32 bits): per position of the cache
    /// and rotated pair, the cosine and sine (`rope_table`), made on the
    /// first attention at that base.
    rope: Vec<(u32, CudaSlice<f32>)>,
}

impl CudaKvCache {
    /// The page selection its decode attention uses, if any (`None` also
    /// while `Backend::kv_set_pruning` has switched it off).
    pub fn kv_pruning(&self) -> Option<&KvPruning> {
        self.pages.as_ref().filter(|p| p.active).map(|p| &p.cfg)
    }
}

/// Per-layer page boxes of a pruned cache: kmin / kmax `[n_seq, n_head_kv,
/// max_pages, head_dim]` f32 (attention_pruned.cu). A box is rewritten from
/// the cached keys every time a step writes a position of its page, so it
/// always covers exactly the positions `0..=pos` of the row that reads it
/// (the CPU's `PageSummaries` after the same writes and truncations).
/// Boxes are refreshed whether or not the selection is `active`, so
/// switching it back on (`Backend::kv_set_pruning`) is exact.
#[derive(Debug)]
pub(crate) struct KvPageBoxes {
    pub(crate) cfg: KvPruning,
    /// Whether decode rows attend the selected pages (`false`: every
    /// position, boxes still maintained).
    pub(super) active: bool,
    pub(crate) max_pages: usize,
    pub(crate) kmin: Vec<CudaSlice<f32>>,
    pub(crate) kmax: Vec<CudaSlice<f32>>,
}

impl CudaBackend {
    /// The device addresses of `layer`'s keys, values, key scales and value
    /// scales (the scales 0 unless the cache is q8_0).
    pub(crate) fn layer_cache(&self, cache: &CudaKvCache, layer: usize) -> [u64; 4] {
        let scale = |s: &[CudaSlice<u8>]| s.get(layer).map_or(0, |x| self.ptr(x));
        [
            self.ptr(&cache.k[layer]),
            self.ptr(&cache.v[layer]),
            scale(&cache.k_scale),
            scale(&cache.v_scale),
        ]
    }

    /// The RoPE table of `cache` at `freq_base` (made now if it has none:
    /// one launch of `rope_table`, outside any recorded step, whose values
    /// are `rope_angle`'s, so the kernels that read it rotate with the same
    /// bits as computing the angles themselves).
    pub(super) fn rope_table(&self, cache: &mut CudaKvCache, freq_base: f32) -> Result<u64> {
        let key = freq_base.to_bits();
        if let Some((_, t)) = cache.rope.iter().find(|(b, _)| *b == key) {
            return Ok(self.ptr(t));
        }
        let (n_pos, hd) = (cache.spec.n_ctx, cache.spec.head_dim);
        let n = n_pos
            .checked_mul(hd)
            .filter(|&n| n <= i32::MAX as usize)
            .ok_or_else(|| bad(format!("RoPE table of {n_pos} x {hd} overflows")))?;
        let table = self.stream.alloc_zeros::<f32>(n.max(1)).map_err(drv)?;
        self.account(MemKind::Kv, 4 * n);
        let pairs = n / 2;
        self.launch_now(&Launch {
            kernel: self.kernels.index("rope_table")?,
            grid: (pairs.div_ceil(256).max(1) as u32, 1, 1),
            block: (256, 1, 1),
            smem: 0,
            work: Work::Plain(vec![
                Arg::Ptr(self.ptr(&table)),
                Arg::I32(n_pos as i32),
                Arg::I32(hd as i32),
                Arg::F32(freq_base),
            ]),
        })?;
        let p = self.ptr(&table);
        cache.rope.push((key, table));
        Ok(p)
    }

    pub(crate) fn new_cache(&self, spec: KvSpec) -> Result<CudaKvCache> {
        if spec.head_dim == 0 || spec.n_ctx == 0 || spec.n_seq == 0 {
            return Err(bad(format!("empty KV cache shape {spec:?}")));
        }
        if spec.dtype == KvDtype::Q8_0 && !spec.head_dim.is_multiple_of(Q8_0_BLOCK) {
            return Err(bad(format!(
                "a q8_0 KV cache needs head_dim divisible by {Q8_0_BLOCK}, not {}",
                spec.head_dim
            )));
        }
        let elem = match spec.dtype {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
            KvDtype::Q8_0 => 1,
        };
        let per_layer = spec
            .n_seq
            .checked_mul(spec.n_head_kv)
            .and_then(|x| x.checked_mul(spec.n_ctx))
            .and_then(|x| x.checked_mul(spec.head_dim))
            .and_then(|x| x.checked_mul(elem))
            .ok_or_else(|| bad("KV cache size overflows"))?;
        // q8_0: one f16 scale per 32 codes.
        let scales_per_layer = if spec.dtype == KvDtype::Q8_0 {
            per_layer / Q8_0_BLOCK * 2
        } else {
            0
        };
        // Refused with both sizes named, before the first of 2 x n_layer
        // allocations (a failed one would say only "out of memory").
        let needed =
            ((per_layer + scales_per_layer) as u64).saturating_mul(2 * spec.n_layer as u64);
        let (free, _) = self.device_memory()?;
        if needed > free as u64 {
            return Err(mirage_runtime::RuntimeError::OutOfMemory {
                what: format!("{} on the GPU", spec.describe()),
                needed,
                available: free as u64,
            });
        }
        let mut k = Vec::with_capacity(spec.n_layer);
        let mut v = Vec::with_capacity(spec.n_layer);
        let (mut k_scale, mut v_scale) = (Vec::new(), Vec::new());
        let alloc = |n: usize| self.stream.alloc_zeros::<u8>(n).map_err(drv);
        for _ in 0..spec.n_layer {
            k.push(alloc(per_layer)?);
            v.push(alloc(per_layer)?);
            if scales_per_layer > 0 {
                k_scale.push(alloc(scales_per_layer)?);
                v_scale.push(alloc(scales_per_layer)?);
            }
        }
        self.account(
            MemKind::Kv,
            2 * spec.n_layer * (per_layer + scales_per_layer),
        );
        Ok(CudaKvCache {
            spec,
            k,
            v,
            k_scale,
            v_scale,
            pages: None,
            rope: Vec::new(),
        })
    }

    pub(crate) fn new_cache_pruned(
        &self,
        spec: KvSpec,
        pruning: Option<KvPruning>,
    ) -> Result<CudaKvCache> {
        let mut cache = self.new_cache(spec)?;
        let Some(cfg) = pruning else {
            return Ok(cache);
        };
        cfg.validate()?;
        let max_pages = spec.n_ctx.div_ceil(cfg.page);
        let per_layer = spec
            .n_seq
            .checked_mul(spec.n_head_kv)
            .and_then(|x| x.checked_mul(max_pages))
            .and_then(|x| x.checked_mul(spec.head_dim))
            .filter(|&x| x <= i32::MAX as usize)
            .ok_or_else(|| bad("KV page boxes size overflows"))?;
        let (mut kmin, mut kmax) = (Vec::new(), Vec::new());
        for _ in 0..spec.n_layer {
            let alloc = || {
                self.stream
                    .alloc_zeros::<f32>(per_layer.max(1))
                    .map_err(drv)
            };
            kmin.push(alloc()?);
            kmax.push(alloc()?);
        }
        self.account(MemKind::Kv, 2 * spec.n_layer * per_layer * 4);
        cache.pages = Some(KvPageBoxes {
            cfg,
            active: true,
            max_pages,
            kmin,
            kmax,
        });
        Ok(cache)
    }

    pub(crate) fn set_cache_pruning(
        &self,
        cache: &mut CudaKvCache,
        pruning: Option<KvPruning>,
    ) -> Result<()> {
        let Some(cfg) = pruning else {
            // Full attention from the next step; the boxes keep being
            // refreshed on every write.
            if let Some(pages) = &mut cache.pages {
                pages.active = false;
            }
            return Ok(());
        };
        cfg.validate()?;
        let Some(pages) = &mut cache.pages else {
            return Err(bad(
                "this CUDA KV cache keeps no page boxes: make it with new_kv_cache_pruned(spec, Some(..)) to switch pruning on",
            ));
        };
        if cfg.page != pages.cfg.page {
            return Err(bad(format!(
                "KV page size {} differs from the {} the cache's page boxes were made with",
                cfg.page, pages.cfg.page
            )));
        }
        // Same page size, so the same boxes and max_pages. The other fields
        // only enter the selection kernels' arguments and the scratch sizes,
        // both computed from `cfg` at every launch; a changed launch list
        // is recorded as another graph.
        pages.cfg = cfg;
        pages.active = true;
        Ok(())
    }
}
