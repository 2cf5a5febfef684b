//! The KV cache on the device and attention over it: RoPE and the KV store,
//! the split-K decode attention (`attend_split_*`: the query heads of a GQA
//! group in one block, so the cache is read once per KV head, split over the
//! context so that every length fills the device; RoPE and the KV store
//! folded in where it can; `attend_combine` merges the splits), the prefill
//! attention on f16 tensor cores (FlashAttention-2 style), and decode attention over selected KV pages (page
//! boxes kept on the device, chosen per head by `cuda/attention_pruned.cu`,
//! merged by the same `attend_combine`).

use cudarc::driver::CudaSlice;
use mirage_runtime::backend::{AttentionParams, QkNorm, TokenSlot};
use mirage_runtime::kv_cache::{KvDtype, KvSpec};
use mirage_runtime::kv_pages::KvPruning;
use mirage_runtime::ops::RopeMode;
use mirage_runtime::{Result, RuntimeError};

use crate::backend::{bad, drv, CudaActivations, CudaBackend, MemKind, Scratch};
use crate::graph::GRAPH_MAX_ROWS;
use crate::launch::{Arg, Launch, Work};
use crate::weights::CudaVector;

/// Threads of a pruned-attention block (`ATT_THREADS` in cuda/attention.cu):
/// the largest head_dim its kernels take.
pub(crate) const ATTEND_THREADS: u32 = 256;

/// Head sizes the split decode attention is compiled for (`attend_split_*_dN`).
pub(crate) const SPLIT_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Threads of an `attend_split` block and query heads it takes at most
/// (`AS_THREADS`, `AS_MAX_G`), and the most splits `attend_combine` merges
/// (`AS_MAX_SPLITS`), in cuda/attention.cu.
const SPLIT_THREADS: u32 = 128;
/// Parameters of `attend_split_*`, `attend_split_rope_*` and
/// `attend_combine` (checked against the PTX by `checks::nvrtc_check`).
pub(crate) const SPLIT_ARGS: usize = 12;
pub(crate) const SPLIT_ROPE_ARGS: usize = 16;
pub(crate) const COMBINE_ARGS: usize = 10;
/// Arguments of an `attend_prefill_*` launch and of `attend_prefill_combine`
/// (`CudaBackend::attend_prefill`).
#[cfg(test)]
pub(crate) const PREFILL_ARGS: usize = 12;
#[cfg(test)]
pub(crate) const PREFILL_COMBINE_ARGS: usize = 5;
const SPLIT_MAX_HEADS: usize = 8;
const SPLIT_MAX: usize = 1024;

/// Keys per attention split the host plans for at least: the splits of a
/// cache are at most `n_ctx / this`, and the kernels spread each row's
/// positions over them (`att_chunk`, whose floor `ATT_MIN_KEYS` is the same
/// number).
const ATTEND_MIN_CHUNK: usize = 64;

/// Split blocks per SM the decode attention's grid is sized for at long
/// context: enough loads in flight to read the cache at the copy rate.
const SPLIT_BLOCKS_PER_SM: usize = 4;

/// Rows of at most this many keys (one tile of `attend_split`, `AS_TILE`)
/// take the short-context form: one split, one query head per block, the
/// output written by the split kernel itself, no `attend_combine`. At that
/// length the split form has one split per KV head with keys, so the step
/// was a chain of two launches of a few blocks each; this is one launch of
/// `n_head` blocks per row. A recorded step on either side of the bound is
/// its own graph.
const SHORT_KEYS: usize = 128;

/// Attention splits of the pruned attention are added while its grid has
/// fewer blocks than this.
const ATTEND_TARGET_BLOCKS: usize = 1024;

/// Rows (position, query head pairs of one KV head's group) per block of
/// the prefill attention on tensor cores (`FA_ROWS`), its threads per block
/// (`FA_WARPS` warps) and the head sizes it is built for
/// (`attend_prefill_<kv>_d<HD>`), in cuda/attention.cu.
const PREFILL_ROWS: usize = 64;
const PREFILL_THREADS: u32 = 128;
pub(crate) const PREFILL_HEAD_DIMS: [usize; 2] = [64, 128];

/// Batches of fewer rows take the split attention (`attend_split_*`).
const PREFILL_MIN_ROWS: usize = 16;

/// Keys per tile of the prefill attention (`FA_KEYS`): its key splits are
/// whole tiles.
const PREFILL_KEYS: usize = 64;

/// The prefill attention splits its keys until the grid has this many
/// blocks (of 4 warps) per SM, e.g. the 0.5B shape's two KV heads at 512
/// rows give 112 blocks, fewer than an H100 has SMs ...
const PREFILL_BLOCKS_PER_SM: usize = 4;

/// ... with no split shorter than this many keys (each split costs a
/// partial row of head_dim + 2 floats per row and head, and the combine).
const PREFILL_MIN_SPLIT_KEYS: usize = 512;

/// Threads of `page_keys` and `select_pages` (`KEY_THREADS`, `SEL_THREADS` in
/// cuda/attention_pruned.cu).
pub(crate) const KEY_THREADS: u32 = 128;
pub(crate) const SEL_THREADS: u32 = 512;

/// The KV cache on the device: per layer, `[n_seq, n_head_kv, n_ctx,
/// head_dim]` keys and values, f32 or f16 (`spec.dtype`), and, for a cache
/// made by `new_kv_cache_pruned(spec, Some(..))`, the page key boxes its
/// decode attention chooses pages by.
#[derive(Debug)]
pub struct CudaKvCache {
    pub(crate) spec: KvSpec,
    pub(crate) k: Vec<CudaSlice<u8>>,
    pub(crate) v: Vec<CudaSlice<u8>>,
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
    active: bool,
    pub(crate) max_pages: usize,
    pub(crate) kmin: Vec<CudaSlice<f32>>,
    pub(crate) kmax: Vec<CudaSlice<f32>>,
}

/// One layer's attention over the cache as the kernels see it: device
/// addresses of the queries, the cache, the rows' (seq, pos) slots and the
/// output, and the shape.
pub(crate) struct CacheAttention {
    pub q: u64,
    pub kc: u64,
    pub vc: u64,
    pub slots: u64,
    pub out: u64,
    /// Query rows.
    pub rows: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ctx: usize,
    /// Keys the longest row attends (its position + 1).
    pub max_keys: usize,
    /// `f32` or `f16`: the cache's element type in kernel names.
    pub kv: &'static str,
}

impl CacheAttention {
    /// The query, the layer's K and V caches and the token slots: the
    /// first arguments of every attention kernel over the cache.
    fn cache_args(&self) -> Vec<Arg> {
        vec![
            Arg::Ptr(self.q),
            Arg::Ptr(self.kc),
            Arg::Ptr(self.vc),
            Arg::Ptr(self.slots),
        ]
    }

    /// Heads, KV heads, head size and cache positions.
    fn heads(&self) -> [Arg; 4] {
        [
            Arg::I32(self.n_head as i32),
            Arg::I32(self.n_head_kv as i32),
            Arg::I32(self.head_dim as i32),
            Arg::I32(self.n_ctx as i32),
        ]
    }
}

/// The RoPE a decode attention applies to its rows' q and k itself (and
/// stores k and v): the unrotated k and v, the pairing and the cache's
/// RoPE table (`CudaBackend::rope_table`).
pub(crate) struct RopeIn {
    pub k: u64,
    pub v: u64,
    pub neox: bool,
    pub table: u64,
}

pub(crate) fn kv_name(dtype: KvDtype) -> &'static str {
    match dtype {
        KvDtype::F32 => "f32",
        // new_kv_cache refuses q8_0.
        KvDtype::F16 | KvDtype::Q8_0 => "f16",
    }
}

/// The grid of `attend_split_*` for one attention over the cache.
#[derive(Debug, PartialEq)]
struct SplitPlan {
    /// The short form: one split whose chunk covers every row, output
    /// written by the split kernel, no combine.
    short: bool,
    /// Query heads of a GQA group per block (`hpb`).
    heads_per_block: usize,
    /// Blocks per row along y: `n_head_kv * ceil(group / heads_per_block)`.
    head_blocks: usize,
    n_split: usize,
    /// The host's chunk (`att_chunk`'s cap): `ceil(n_ctx / n_split)`.
    chunk: usize,
}

/// `attend_cache`'s grid: the short form for rows of at most `SHORT_KEYS`
/// keys, else splits that depend on the batch, the cache size and the SM
/// count only (so a recorded step replays at every longer position).
fn split_plan(at: &CacheAttention, sm_count: usize) -> SplitPlan {
    let group = at.n_head / at.n_head_kv;
    let short = at.max_keys <= SHORT_KEYS;
    let heads_per_block = if short { 1 } else { group.min(SPLIT_MAX_HEADS) };
    let head_blocks = at.n_head_kv * group.div_ceil(heads_per_block);
    let n_split = if short {
        1
    } else {
        (SPLIT_BLOCKS_PER_SM * sm_count)
            .div_ceil(at.rows * head_blocks)
            .min(at.n_ctx.div_ceil(ATTEND_MIN_CHUNK))
            .clamp(1, SPLIT_MAX)
    };
    SplitPlan {
        short,
        heads_per_block,
        head_blocks,
        n_split,
        chunk: at.n_ctx.div_ceil(n_split),
    }
}

impl CudaBackend {
    /// A launch no fusion changes.
    fn plain(
        &self,
        kernel: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: Vec<Arg>,
    ) -> Result<()> {
        self.push_launch(Launch {
            kernel: self.kernels.index(kernel)?,
            grid,
            block,
            smem: 0,
            work: Work::Plain(args),
        })
    }

    /// The RoPE table of `cache` at `freq_base` (made now if it has none:
    /// one launch of `rope_table`, outside any recorded step, whose values
    /// are `rope_angle`'s, so the kernels that read it rotate with the same
    /// bits as computing the angles themselves).
    fn rope_table(&self, cache: &mut CudaKvCache, freq_base: f32) -> Result<u64> {
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
        if spec.dtype == KvDtype::Q8_0 {
            return Err(bad("a q8_0 KV cache has no CUDA kernels (use f16)"));
        }
        let elem = if spec.dtype == KvDtype::F32 { 4 } else { 2 };
        let per_layer = spec
            .n_seq
            .checked_mul(spec.n_head_kv)
            .and_then(|x| x.checked_mul(spec.n_ctx))
            .and_then(|x| x.checked_mul(spec.head_dim))
            .and_then(|x| x.checked_mul(elem))
            .ok_or_else(|| bad("KV cache size overflows"))?;
        // Refused with both sizes named, before the first of 2 x n_layer
        // allocations (a failed one would say only "out of memory").
        let needed = (per_layer as u64).saturating_mul(2 * spec.n_layer as u64);
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
        for _ in 0..spec.n_layer {
            k.push(self.stream.alloc_zeros::<u8>(per_layer).map_err(drv)?);
            v.push(self.stream.alloc_zeros::<u8>(per_layer).map_err(drv)?);
        }
        self.account(MemKind::Kv, 2 * spec.n_layer * per_layer);
        Ok(CudaKvCache {
            spec,
            k,
            v,
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

    /// The device address of the batch's (seq, pos) slots: the step's
    /// staged copy, or one uploaded now.
    pub(crate) fn slots_ptr(&self, s: &mut Scratch, slots: &[TokenSlot]) -> Result<u64> {
        let host: Vec<i32> = slots
            .iter()
            .flat_map(|t| [t.seq as i32, t.pos as i32])
            .collect();
        let reuse = s.slots_dev.is_some() && s.slots_host == host;
        if !reuse {
            if s.slots_dev.as_ref().is_none_or(|d| d.len() < host.len()) {
                s.slots_dev = Some(
                    self.stream
                        .alloc_zeros::<i32>(host.len().next_power_of_two())
                        .map_err(drv)?,
                );
            }
            let d = s.slots_dev.as_mut().expect("allocated above");
            self.stream
                .memcpy_htod(&host, &mut d.slice_mut(0..host.len()))
                .map_err(drv)?;
            s.slots_host = host;
        }
        Ok(self.ptr(s.slots_dev.as_ref().expect("set above")))
    }

    /// `Backend::attention` (see the module doc).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend(
        &self,
        layer: usize,
        p: &AttentionParams,
        q: &CudaActivations,
        k: &CudaActivations,
        v: &CudaActivations,
        qk_norm: Option<QkNorm<'_, CudaVector>>,
        slots: &[TokenSlot],
        cache: &mut CudaKvCache,
        out: &mut CudaActivations,
    ) -> Result<()> {
        let hd = p.head_dim;
        let n = slots.len();
        if p.n_head_kv == 0 || p.n_head % p.n_head_kv != 0 || !SPLIT_HEAD_DIMS.contains(&hd) {
            return Err(bad(format!(
                "attention shape {p:?} (the cuda kernels take head_dim {SPLIT_HEAD_DIMS:?})"
            )));
        }
        if q.rows != n
            || k.rows != n
            || v.rows != n
            || q.width != p.n_head * hd
            || k.width != p.n_head_kv * hd
            || v.width != k.width
        {
            return Err(bad("attention inputs do not match the batch"));
        }
        let spec = cache.spec;
        if spec.head_dim != hd || spec.n_head_kv != p.n_head_kv || layer >= spec.n_layer {
            return Err(bad("KV cache shape does not match the layer"));
        }
        let max_pos = slots.iter().map(|s| s.pos).max().unwrap_or(0);
        if max_pos >= spec.n_ctx {
            return Err(RuntimeError::ContextFull { n_ctx: spec.n_ctx });
        }
        if let Some(s) = slots.iter().find(|s| s.seq >= spec.n_seq) {
            return Err(bad(format!("sequence slot {} >= {}", s.seq, spec.n_seq)));
        }
        if !p.rope_scaling.is_none() {
            // The RoPE table holds the unscaled angles.
            return Err(bad(format!(
                "RoPE scaling {:?} is not implemented on CUDA",
                p.rope_scaling.kind
            )));
        }
        let pslots = match self
            .staged(|s| (s.slots == slots).then_some(s.base + 4 * s.tokens.len() as u64))?
        {
            Some(p) => p,
            None => {
                let mut s = self.scratch();
                self.slots_ptr(&mut s, slots)?
            }
        };
        let (pq, pk, pv) = (self.act_ptr(q)?, self.act_ptr(k)?, self.act_ptr(v)?);
        let (pqn, pkn) = match &qk_norm {
            Some(nm) => (self.ptr(&nm.q.data), self.ptr(&nm.k.data)),
            None => (0u64, 0u64),
        };
        let (pkc, pvc) = (self.ptr(&cache.k[layer]), self.ptr(&cache.v[layer]));
        let prope = self.rope_table(cache, p.rope_freq_base)?;
        let kv = kv_name(spec.dtype);
        let (nh, nkv, hdi, n_ctx) = (
            p.n_head as i32,
            p.n_head_kv as i32,
            hd as i32,
            spec.n_ctx as i32,
        );
        let po = self.reshape(out, n, p.n_head * hd)?;
        let at = CacheAttention {
            q: pq,
            kc: pkc,
            vc: pvc,
            slots: pslots,
            out: po,
            rows: n,
            n_head: p.n_head,
            n_head_kv: p.n_head_kv,
            head_dim: hd,
            n_ctx: spec.n_ctx,
            max_keys: max_pos + 1,
            kv,
        };
        // The RoPE and KV store fold into the decode attention (the same
        // bits) when nothing else reads the cache in between (no page
        // boxes), there is no per-head q/k norm and no row attends another
        // row's new key (each row in its own sequence).
        let rope_in_attention = qk_norm.is_none()
            && cache.pages.is_none()
            && slots
                .iter()
                .enumerate()
                .all(|(i, a)| slots[..i].iter().all(|b| b.seq != a.seq));
        let neox = (p.rope_mode == RopeMode::Neox) as i32;
        if !rope_in_attention {
            self.plain(
                &format!("rope_store_{kv}"),
                (n as u32, (p.n_head + p.n_head_kv) as u32, 1),
                ((hd / 2) as u32, 1, 1),
                vec![
                    Arg::Ptr(pq),
                    Arg::Ptr(pk),
                    Arg::Ptr(pv),
                    Arg::Ptr(pslots),
                    Arg::I32(nh),
                    Arg::I32(nkv),
                    Arg::I32(hdi),
                    Arg::I32(neox),
                    Arg::Ptr(prope),
                    Arg::Ptr(pqn),
                    Arg::Ptr(pkn),
                    Arg::F32(p.norm_eps),
                    Arg::Ptr(pkc),
                    Arg::Ptr(pvc),
                    Arg::I32(n_ctx),
                ],
            )?;
        }
        let scale = 1.0 / (hd as f32).sqrt();
        // KV-page pruning: the boxes of the pages this batch wrote, then
        // which rows attend selected pages only — decode rows, the only row
        // of their sequence, as on the CPU (attention_pruned::decode_rows).
        // `Some(false)`: every row; `Some(true)`: a mixed batch, the kernels
        // skip rows that share their sequence; those attend every position.
        let mut pruned = None;
        if let Some(pages) = &cache.pages {
            // Refreshed even while the selection is off, so that switching
            // it back on finds exact boxes.
            self.refresh_page_boxes(pages, layer, slots, pslots, pkc, kv, &spec)?;
            if pages.active && layer >= pages.cfg.dense_layers {
                let decode = mirage_runtime::attention_pruned::decode_rows(slots);
                if decode.iter().all(|&d| d) {
                    pruned = Some(false);
                } else if decode.iter().any(|&d| d) {
                    pruned = Some(true);
                }
            }
        }
        // A prefill batch of one sequence's consecutive positions: the
        // tensor-core kernel stages each key and value tile once per 64 rows
        // of a KV head's query heads, not once per row.
        let tiled = pruned != Some(false)
            && n >= PREFILL_MIN_ROWS
            && PREFILL_HEAD_DIMS.contains(&hd)
            && p.n_head_kv > 0
            && p.n_head % p.n_head_kv == 0
            && slots
                .windows(2)
                .all(|w| w[1].seq == w[0].seq && w[1].pos == w[0].pos + 1);
        if tiled {
            self.attend_prefill(&at, p, slots[n - 1].pos + 1, scale, po)?;
        } else if pruned != Some(false) {
            let rope = rope_in_attention.then_some(RopeIn {
                k: pk,
                v: pv,
                neox: neox == 1,
                table: prope,
            });
            self.attend_cache(&at, rope)?;
        }
        if let (Some(only_decode), Some(pages)) = (pruned, &cache.pages) {
            if only_decode && n > GRAPH_MAX_ROWS {
                // A large mixed batch (never recorded): one launch per decode
                // row, so that the scratch is sized for one row, not the
                // whole prefill.
                let decode = mirage_runtime::attention_pruned::decode_rows(slots);
                for (row, _) in decode.iter().enumerate().filter(|(_, &d)| d) {
                    self.attend_pages(pages, layer, &at, row, 1, false)?;
                }
            } else {
                self.attend_pages(pages, layer, &at, 0, n, only_decode)?;
            }
        }
        Ok(())
    }

    /// A prefill batch (`at.rows` consecutive positions of one sequence, the
    /// last at `keys - 1`) on tensor cores: `attend_prefill_*`, its keys
    /// split so that the grid has `PREFILL_BLOCKS_PER_SM` blocks per SM (no
    /// split shorter than `PREFILL_MIN_SPLIT_KEYS`), then
    /// `attend_prefill_combine` when split.
    fn attend_prefill(
        &self,
        at: &CacheAttention,
        p: &AttentionParams,
        keys: usize,
        scale: f32,
        po: u64,
    ) -> Result<()> {
        let (n, hd, kv) = (at.rows, at.head_dim, at.kv);
        let row_blocks = (n * (p.n_head / p.n_head_kv)).div_ceil(PREFILL_ROWS);
        let base = row_blocks * p.n_head_kv;
        let want = (PREFILL_BLOCKS_PER_SM * self.sm_count).div_ceil(base);
        let tiles = keys.div_ceil(PREFILL_KEYS);
        let splits = want.min(keys.div_ceil(PREFILL_MIN_SPLIT_KEYS)).max(1);
        let chunk = PREFILL_KEYS * tiles.div_ceil(splits);
        let splits = keys.div_ceil(chunk);
        let part = if splits > 1 {
            let mut s = self.scratch();
            self.grow_scratch(&mut s.prefill_part, splits * n * p.n_head * (hd + 2))?
        } else {
            0
        };
        self.plain(
            &format!("attend_prefill_{kv}_d{hd}"),
            (row_blocks as u32, p.n_head_kv as u32, splits as u32),
            (PREFILL_THREADS, 1, 1),
            [
                at.cache_args(),
                vec![
                    Arg::I32(n as i32),
                    Arg::I32(p.n_head as i32),
                    Arg::I32(p.n_head_kv as i32),
                    Arg::I32(at.n_ctx as i32),
                    Arg::F32(scale),
                    Arg::I32(chunk as i32),
                    Arg::Ptr(part),
                    Arg::Ptr(po),
                ],
            ]
            .concat(),
        )?;
        if splits > 1 {
            self.plain(
                "attend_prefill_combine",
                ((n * p.n_head) as u32, 1, 1),
                (128, 1, 1),
                vec![
                    Arg::Ptr(part),
                    Arg::I64((n * p.n_head) as i64),
                    Arg::I32(hd as i32),
                    Arg::I32(splits as i32),
                    Arg::Ptr(po),
                ],
            )?;
        }
        Ok(())
    }

    /// Every row of `at` over positions `0..=pos` of its sequence: the split
    /// attention (`attend_split_*`, with the rows' RoPE and KV store folded
    /// in when `rope` is given) and the combine of its splits. The split
    /// count depends on the batch, the cache size and the device only, so a
    /// recorded decode step replays at every position: enough splits that
    /// the grid has `SPLIT_BLOCKS_PER_SM` blocks per SM, at most one per
    /// `ATTEND_MIN_CHUNK` positions of the cache. Rows of at most
    /// `SHORT_KEYS` keys take one split of one head per block instead,
    /// which writes the output itself.
    pub(crate) fn attend_cache(&self, at: &CacheAttention, rope: Option<RopeIn>) -> Result<()> {
        let (n, hd) = (at.rows, at.head_dim);
        if !SPLIT_HEAD_DIMS.contains(&hd) {
            return Err(bad(format!(
                "decode attention takes head_dim {SPLIT_HEAD_DIMS:?}, not {hd}"
            )));
        }
        let SplitPlan {
            short,
            heads_per_block,
            head_blocks,
            n_split,
            chunk,
        } = split_plan(at, self.sm_count);
        // The short form writes the output; the split form its partials.
        let (ppart, pout) = if short {
            (0, at.out)
        } else {
            let mut s = self.scratch();
            (
                self.reshape(&mut s.attn_part, n * at.n_head * n_split, hd + 2)?,
                0,
            )
        };
        let mut args = at.cache_args();
        args.extend([
            Arg::I32(at.n_head as i32),
            Arg::I32(at.n_head_kv as i32),
            Arg::I32(at.n_ctx as i32),
            Arg::I32(chunk as i32),
            Arg::I32(heads_per_block as i32),
            Arg::F32(1.0 / (hd as f32).sqrt()),
            Arg::Ptr(ppart),
            Arg::Ptr(pout),
        ]);
        let rope_args = rope.is_some();
        let kernel = match rope {
            // attend_split_rope: then the unrotated k and v, mode and base.
            Some(r) => {
                args.extend([
                    Arg::Ptr(r.k),
                    Arg::Ptr(r.v),
                    Arg::I32(r.neox as i32),
                    Arg::Ptr(r.table),
                ]);
                format!("attend_split_rope_{}_d{hd}", at.kv)
            }
            None => format!("attend_split_{}_d{hd}", at.kv),
        };
        debug_assert_eq!(
            args.len(),
            if rope_args {
                SPLIT_ROPE_ARGS
            } else {
                SPLIT_ARGS
            }
        );
        self.plain(
            &kernel,
            (n as u32, head_blocks as u32, n_split as u32),
            (SPLIT_THREADS, 1, 1),
            args,
        )?;
        if short {
            return Ok(());
        }
        self.combine(at, ppart, n_split, chunk, None)
    }

    /// `attend_combine`: rows `at` (or, with `pruned = Some((only_decode,
    /// row_base, rows))`, the launch's rows of the pruned attention) from
    /// their `n_split` partials at `ppart`; `chunk` 0 merges every split.
    fn combine(
        &self,
        at: &CacheAttention,
        ppart: u64,
        n_split: usize,
        chunk: usize,
        pruned: Option<(bool, usize, usize)>,
    ) -> Result<()> {
        let (only_decode, row_base, rows) = pruned.unwrap_or((false, 0, at.rows));
        let args = vec![
            Arg::Ptr(ppart),
            Arg::Ptr(at.slots),
            Arg::I32(at.n_head as i32),
            Arg::I32(at.head_dim as i32),
            Arg::I32(n_split as i32),
            Arg::I32(chunk as i32),
            Arg::I32(only_decode as i32),
            Arg::I32(at.rows as i32),
            Arg::I32(row_base as i32),
            Arg::Ptr(at.out),
        ];
        debug_assert_eq!(args.len(), COMBINE_ARGS);
        self.plain(
            "attend_combine",
            (rows as u32, at.n_head as u32, 1),
            (at.head_dim as u32, 1, 1),
            args,
        )
    }

    /// Rewrites the boxes of the pages the batch `slots` wrote in `layer`
    /// (after rope_store). Inside a recorded step (and for small batches)
    /// one launch reads the positions from device memory; a large eager
    /// batch (prefill) launches per sequence over its range of pages.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn refresh_page_boxes(
        &self,
        pages: &KvPageBoxes,
        layer: usize,
        slots: &[TokenSlot],
        pslots: u64,
        pkc: u64,
        kv: &str,
        spec: &KvSpec,
    ) -> Result<()> {
        let (pmin, pmax) = (self.ptr(&pages.kmin[layer]), self.ptr(&pages.kmax[layer]));
        let page = pages.cfg.page.min(spec.n_ctx) as i32;
        let (nkv, hd, n_ctx, maxp) = (
            spec.n_head_kv as i32,
            spec.head_dim as i32,
            spec.n_ctx as i32,
            pages.max_pages as i32,
        );
        let n = slots.len();
        if n == 0 {
            return Ok(());
        }
        if n <= GRAPH_MAX_ROWS || self.recording() {
            return self.plain(
                &format!("page_bounds_rows_{kv}"),
                (n as u32, spec.n_head_kv as u32, 1),
                (spec.head_dim as u32, 1, 1),
                vec![
                    Arg::Ptr(pkc),
                    Arg::Ptr(pslots),
                    Arg::I32(n as i32),
                    Arg::I32(nkv),
                    Arg::I32(hd),
                    Arg::I32(n_ctx),
                    Arg::I32(page),
                    Arg::I32(maxp),
                    Arg::Ptr(pmin),
                    Arg::Ptr(pmax),
                ],
            );
        }
        let mut ranges: std::collections::BTreeMap<usize, (usize, usize)> = Default::default();
        for s in slots {
            let r = ranges.entry(s.seq).or_insert((s.pos, s.pos));
            r.0 = r.0.min(s.pos);
            r.1 = r.1.max(s.pos);
        }
        let page = page as usize;
        for (seq, (lo, hi)) in ranges {
            let (p0, last) = (lo / page, hi / page);
            self.plain(
                &format!("page_bounds_{kv}"),
                ((last - p0 + 1) as u32, spec.n_head_kv as u32, 1),
                (spec.head_dim as u32, 1, 1),
                vec![
                    Arg::Ptr(pkc),
                    Arg::I32(seq as i32),
                    Arg::I32(nkv),
                    Arg::I32(hd),
                    Arg::I32(n_ctx),
                    Arg::I32(page as i32),
                    Arg::I32(p0 as i32),
                    Arg::I32(hi as i32 + 1),
                    Arg::I32(maxp),
                    Arg::Ptr(pmin),
                    Arg::Ptr(pmax),
                ],
            )?;
        }
        Ok(())
    }

    /// Attention of rows `row_base .. row_base + rows` of `at` over the
    /// pages the cache's rule selects: page keys, radix select, split-K over
    /// the chosen pages, combine (attention_pruned.cu). With
    /// `only_decode`, rows that share their sequence with another row of the
    /// batch are skipped (they attend every position). Every grid depends on
    /// the batch and the cache size only; the positions are read from
    /// `at.slots` on the device.
    pub(crate) fn attend_pages(
        &self,
        pages: &KvPageBoxes,
        layer: usize,
        at: &CacheAttention,
        row_base: usize,
        rows: usize,
        only_decode: bool,
    ) -> Result<()> {
        let cfg = &pages.cfg;
        let hd = at.head_dim;
        let n_rows = at.rows;
        let max_pages = pages.max_pages;
        let max_sel = cfg.max_selected_for(max_pages).min(max_pages).max(1);
        let n_split = max_sel
            .min((ATTEND_TARGET_BLOCKS / (rows * at.n_head)).max(1))
            .max(1);
        let heads = rows * at.n_head;
        let (pkeys, psel, pnsel, ppart) = {
            let mut s = self.scratch();
            let s = &mut *s;
            (
                self.grow_scratch(&mut s.prune_keys, heads * max_pages)?,
                self.grow_scratch(&mut s.prune_sel, heads * max_sel)?,
                self.grow_scratch(&mut s.prune_nsel, heads)?,
                self.grow_scratch(&mut s.prune_part, heads * n_split * (hd + 2))?,
            )
        };
        let clamp = |x: usize| x.min(i32::MAX as usize) as i32;
        let (pmin, pmax) = (self.ptr(&pages.kmin[layer]), self.ptr(&pages.kmax[layer]));
        let (nh, nkv, hdi, page, maxp) = (
            at.n_head as i32,
            at.n_head_kv as i32,
            hd as i32,
            cfg.page.min(at.n_ctx) as i32,
            max_pages as i32,
        );
        let (sinks, recent) = (clamp(cfg.sink_pages), clamp(cfg.recent_pages));
        let kv = at.kv;
        let (od, nr, rb) = (only_decode as i32, n_rows as i32, row_base as i32);
        self.plain(
            "page_keys",
            (
                rows as u32,
                at.n_head as u32,
                max_pages.div_ceil(KEY_THREADS as usize) as u32,
            ),
            (KEY_THREADS, 1, 1),
            vec![
                Arg::Ptr(at.q),
                Arg::Ptr(at.slots),
                Arg::Ptr(pmin),
                Arg::Ptr(pmax),
                Arg::I32(nh),
                Arg::I32(nkv),
                Arg::I32(hdi),
                Arg::I32(page),
                Arg::I32(maxp),
                Arg::I32(sinks),
                Arg::I32(recent),
                Arg::I32(od),
                Arg::I32(nr),
                Arg::I32(rb),
                Arg::Ptr(pkeys),
            ],
        )?;
        self.plain(
            "select_pages",
            (rows as u32, at.n_head as u32, 1),
            (SEL_THREADS, 1, 1),
            vec![
                Arg::Ptr(pkeys),
                Arg::Ptr(at.slots),
                Arg::I32(nh),
                Arg::I32(page),
                Arg::I32(maxp),
                Arg::I32(sinks),
                Arg::I32(recent),
                Arg::I32(clamp(cfg.top_pages)),
                Arg::I32(clamp(cfg.top_percent)),
                Arg::I32(max_sel as i32),
                Arg::I32(od),
                Arg::I32(nr),
                Arg::I32(rb),
                Arg::Ptr(psel),
                Arg::Ptr(pnsel),
            ],
        )?;
        self.plain(
            &format!("attend_pages_part_{kv}"),
            (rows as u32, at.n_head as u32, n_split as u32),
            (ATTEND_THREADS, 1, 1),
            [
                at.cache_args(),
                vec![Arg::Ptr(psel), Arg::Ptr(pnsel)],
                at.heads().to_vec(),
            ]
            .concat()
            .into_iter()
            .chain([
                Arg::I32(page),
                Arg::I32(max_sel as i32),
                Arg::I32(od),
                Arg::I32(nr),
                Arg::I32(rb),
                Arg::F32(1.0 / (hd as f32).sqrt()),
                Arg::Ptr(ppart),
            ])
            .collect(),
        )?;
        self.combine(at, ppart, n_split, 0, Some((only_decode, row_base, rows)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(
        rows: usize,
        n_head: usize,
        n_head_kv: usize,
        n_ctx: usize,
        max_keys: usize,
    ) -> CacheAttention {
        CacheAttention {
            q: 0,
            kc: 0,
            vc: 0,
            slots: 0,
            out: 0,
            rows,
            n_head,
            n_head_kv,
            head_dim: 64,
            n_ctx,
            max_keys,
            kv: "f16",
        }
    }

    #[test]
    fn short_rows_take_one_split_of_one_head_per_block_covering_every_row() {
        for (n_head, n_head_kv) in [(14, 2), (28, 4), (12, 1), (4, 4)] {
            for max_keys in [1, 64, SHORT_KEYS] {
                let p = split_plan(&shape(3, n_head, n_head_kv, 32768, max_keys), 132);
                assert!(p.short);
                assert_eq!(
                    (p.n_split, p.heads_per_block, p.head_blocks),
                    (1, 1, n_head)
                );
                // att_chunk(n, 1, chunk) >= n for every row: the one split holds all keys.
                assert!(p.chunk >= max_keys);
            }
        }
        // A cache of at most SHORT_KEYS positions is always short.
        assert!(split_plan(&shape(1, 14, 2, SHORT_KEYS, SHORT_KEYS), 132).short);
    }

    #[test]
    fn longer_rows_split_the_cache_whatever_their_position() {
        // One key past the short form: the split form, the same grid as at
        // the end of the cache (a recorded step replays at every length).
        let at = |max_keys| split_plan(&shape(1, 14, 2, 32768, max_keys), 132);
        let (p, end) = (at(SHORT_KEYS + 1), at(32768));
        assert!(!p.short);
        assert_eq!(p, end);
        assert_eq!((p.heads_per_block, p.head_blocks), (7, 2));
        assert_eq!(p.n_split, (SPLIT_BLOCKS_PER_SM * 132).div_ceil(2));
        assert!(p.chunk * p.n_split >= 32768);
        // A group wider than a block takes two blocks; splits are capped by
        // the cache (one per ATTEND_MIN_CHUNK positions) and SPLIT_MAX.
        let wide = split_plan(&shape(1, 12, 1, 512, 300), 132);
        assert_eq!(
            (wide.heads_per_block, wide.head_blocks),
            (SPLIT_MAX_HEADS, 2)
        );
        assert_eq!(wide.n_split, 512 / ATTEND_MIN_CHUNK);
        let huge = split_plan(&shape(1, 1, 1, 1 << 20, 1 << 20), 100_000);
        assert_eq!(huge.n_split, SPLIT_MAX);
        let batch = split_plan(&shape(16, 28, 4, 4096, 4096), 132);
        assert!(batch.n_split >= 1 && batch.chunk * batch.n_split >= 4096);
    }
}
