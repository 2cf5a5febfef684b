//! Decode attention over selected KV pages (`cuda/attention_pruned.cu`):
//! the page key boxes refreshed after every write, then per row and head
//! page keys, a radix select of the pages, split-K attention over the
//! chosen ones and `attend_combine`.

use mirage_runtime::backend::TokenSlot;
use mirage_runtime::kv_cache::KvSpec;
use mirage_runtime::Result;

use super::decode::{mma_threads, pages_mma_plan, PAGES_MMA_ARGS};
use super::{CacheAttention, KvPageBoxes};
use crate::backend::CudaBackend;
use crate::graph::GRAPH_MAX_ROWS;
use crate::launch::{Arg, Launch, Work};

/// Threads of a pruned-attention block (`ATT_THREADS` in cuda/attention.cu):
/// the largest head_dim its kernels take.
pub(crate) const ATTEND_THREADS: u32 = 256;

/// Attention splits of the pruned attention are added while its grid has
/// fewer blocks than this.
const ATTEND_TARGET_BLOCKS: usize = 1024;

/// Threads of `page_keys` and `select_pages` (`KEY_THREADS`, `SEL_THREADS` in
/// cuda/attention_pruned.cu).
pub(crate) const KEY_THREADS: u32 = 128;
pub(crate) const SEL_THREADS: u32 = 512;

impl CudaBackend {
    /// Rewrites the boxes of the pages the batch `slots` wrote in `layer`
    /// (after rope_store), from the layer's keys `[codes, scales]` (scales 0
    /// unless `kv` is q8_0). Inside a recorded step (and for small batches)
    /// one launch reads the positions from device memory; a large eager
    /// batch (prefill) launches per sequence over its range of pages.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn refresh_page_boxes(
        &self,
        pages: &KvPageBoxes,
        layer: usize,
        slots: &[TokenSlot],
        pslots: u64,
        [pkc, pkd]: [u64; 2],
        kv: &str,
        spec: &KvSpec,
    ) -> Result<()> {
        let key_scale: Vec<Arg> = if kv == "q8_0" {
            vec![Arg::Ptr(pkd)]
        } else {
            Vec::new()
        };
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
                ]
                .into_iter()
                .chain(key_scale)
                .collect(),
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
                ]
                .into_iter()
                .chain(key_scale.iter().cloned())
                .collect(),
            )?;
        }
        Ok(())
    }

    /// Attention of rows `row_base .. row_base + rows` of `at` over the
    /// pages the cache's rule selects: page keys, radix select, split-K over
    /// the chosen pages, combine (attention_pruned.cu). Where the cache's
    /// decode attention runs on tensor cores (`decode::pages_mma_plan`), the
    /// split is `attend_pages_mma_*` over the union of each KV head's pages
    /// (`union_pages`; each head masks the pages it did not choose), so a
    /// page is read once for the group; otherwise `attend_pages_part_*`, a
    /// block per query head. With
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
        let page_len = cfg.page.min(at.n_ctx);
        let group = at.n_head / at.n_head_kv;
        let max_union = (group * max_sel).min(max_pages);
        let mma = pages_mma_plan(
            at,
            rows,
            page_len,
            max_union,
            self.sm_count,
            self.smem_optin,
        );
        let n_split = match mma {
            Some((n_split, _)) => n_split,
            None => max_sel
                .min((ATTEND_TARGET_BLOCKS / (rows * at.n_head)).max(1))
                .max(1),
        };
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
        if let Some((_, smem)) = mma {
            let groups = rows * at.n_head_kv;
            let span = groups * max_pages;
            let punion = {
                let mut s = self.scratch();
                self.grow_scratch(&mut s.prune_union, 2 * span + groups)?
            };
            let (pupages, pumask, pucount) =
                (punion, punion + 4 * span as u64, punion + 8 * span as u64);
            self.plain(
                "union_pages",
                (rows as u32, at.n_head_kv as u32, 1),
                (SEL_THREADS, 1, 1),
                vec![
                    Arg::Ptr(psel),
                    Arg::Ptr(pnsel),
                    Arg::Ptr(at.slots),
                    Arg::I32(nh),
                    Arg::I32(nkv),
                    Arg::I32(page),
                    Arg::I32(maxp),
                    Arg::I32(max_sel as i32),
                    Arg::I32(od),
                    Arg::I32(nr),
                    Arg::I32(rb),
                    Arg::Ptr(pupages),
                    Arg::Ptr(pumask),
                    Arg::Ptr(pucount),
                ],
            )?;
            let mut args = vec![
                Arg::Ptr(at.q),
                Arg::Ptr(at.kc),
                Arg::Ptr(at.vc),
                Arg::Ptr(at.slots),
                Arg::Ptr(pupages),
                Arg::Ptr(pumask),
                Arg::Ptr(pucount),
                Arg::I32(nh),
                Arg::I32(nkv),
                Arg::I32(at.n_ctx as i32),
                Arg::I32(maxp),
                Arg::I32(page),
                Arg::I32(od),
                Arg::I32(nr),
                Arg::I32(rb),
                Arg::F32(1.0 / (hd as f32).sqrt()),
                Arg::Ptr(ppart),
            ];
            debug_assert_eq!(args.len(), PAGES_MMA_ARGS);
            args.extend(at.scale_args());
            self.push_launch(Launch {
                kernel: self
                    .kernels
                    .index(&format!("attend_pages_mma_{kv}_d{hd}"))?,
                grid: (rows as u32, at.n_head_kv as u32, n_split as u32),
                block: (mma_threads(hd), 1, 1),
                smem: smem as u32,
                work: Work::Plain(args),
            })?;
            return self.combine(at, ppart, n_split, 0, Some((only_decode, row_base, rows)));
        }
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
            .chain(at.scale_args())
            .collect(),
        )?;
        self.combine(at, ppart, n_split, 0, Some((only_decode, row_base, rows)))
    }
}
