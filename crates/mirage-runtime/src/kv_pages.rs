//! KV pages with key summaries, for attention over a subset of the cache.
//!
//! The cache of each layer, sequence and KV head is cut into pages of
//! [`KvPruning::page`] positions. Each page keeps the per-dimension minimum
//! and maximum of its keys (an axis-aligned box, AABB), updated as tokens are
//! appended. For a query `q` the largest `q·k` any key of the page can have
//! is bounded exactly by `Σ_d max(q_d·min_d, q_d·max_d)`, so pages whose bound
//! is low cannot hold a large attention weight.
//!
//! Selection keeps the first [`KvPruning::sink_pages`] pages (attention
//! sinks), the last [`KvPruning::recent_pages`] pages (locality) and the
//! [`KvPruning::top_pages`] other pages with the highest bound. Attention then
//! runs over the selected pages only ([`crate::attention_pruned`]).
//!
//! Two ways to find the top pages, with the same answer (tested): a flat scan
//! of every page's bound ([`PageSelector::Flat`], what the CUDA kernels do: one
//! pass, all pages in parallel), or a traversal of a two-level bounding-volume
//! hierarchy ([`PageSelector::Bvh`]): groups of [`PAGE_GROUP`] consecutive
//! pages keep the union box of their pages, a group's bound bounds every page
//! in it, and groups are visited best bound first, stopping once no group can
//! beat the `top`-th page found. Ties go to the lower page index in both.

use crate::error::RuntimeError;
use crate::kv_cache::{KvCache, KvSpec};

/// Which KV pages decode attention reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPruning {
    /// Positions per page.
    pub page: usize,
    /// Pages at the start of the sequence that are always attended.
    pub sink_pages: usize,
    /// Most recent pages (the one being filled included) always attended.
    pub recent_pages: usize,
    /// Other pages attended: those with the highest `q·k` upper bound.
    pub top_pages: usize,
    /// Budget that grows with the context: at least this percentage of the
    /// sequence's pages (rounded up) among the top pages, when more than
    /// `top_pages` (0: a fixed budget).
    pub top_percent: usize,
    /// The first layers attend every position (their attention is spread
    /// out, so page bounds select poorly there; Quest does the same).
    pub dense_layers: usize,
}

impl Default for KvPruning {
    fn default() -> Self {
        KvPruning {
            page: 64,
            sink_pages: 1,
            recent_pages: 2,
            top_pages: 8,
            top_percent: 0,
            dense_layers: 0,
        }
    }
}

impl KvPruning {
    /// Settings that select every page: pruned attention then computes full
    /// attention (used to check the pruned path against the full one).
    pub fn all_pages(page: usize) -> KvPruning {
        KvPruning {
            page,
            sink_pages: 0,
            recent_pages: 0,
            top_pages: usize::MAX,
            top_percent: 0,
            dense_layers: 0,
        }
    }

    /// Rejects a zero page size and a percentage above 100.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        if self.page == 0 {
            return Err(RuntimeError::InvalidArgument(
                "KV page size must be at least 1".into(),
            ));
        }
        if self.top_percent > 100 {
            return Err(RuntimeError::InvalidArgument(format!(
                "KV top_percent {} is above 100",
                self.top_percent
            )));
        }
        Ok(())
    }

    /// Top pages chosen by bound for a sequence of `n_pages` pages:
    /// `max(top_pages, ceil(n_pages * top_percent / 100))`.
    pub fn top_for(&self, n_pages: usize) -> usize {
        self.top_pages
            .max((n_pages.saturating_mul(self.top_percent)).div_ceil(100))
    }

    /// Most pages attended per query head of a sequence of `n_pages` pages
    /// (sinks, recent and top pages).
    pub fn max_selected_for(&self, n_pages: usize) -> usize {
        self.sink_pages
            .saturating_add(self.recent_pages)
            .saturating_add(self.top_for(n_pages))
    }

    /// Most pages attended per query head with a fixed budget
    /// (`top_percent` 0; otherwise see [`KvPruning::max_selected_for`]).
    pub fn max_selected(&self) -> usize {
        self.sink_pages
            .saturating_add(self.recent_pages)
            .saturating_add(self.top_pages)
    }
}

/// Parses `key=value` pairs separated by commas over [`KvPruning::default`]:
/// `page`, `sinks`, `recent`, `top`, `top_percent`, `dense` (e.g.
/// `top=16,top_percent=10,dense=2`);
/// `default` alone is the default, `all` every page (64 positions each).
impl std::str::FromStr for KvPruning {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<KvPruning, RuntimeError> {
        let s = s.trim();
        if s == "all" {
            return Ok(KvPruning::all_pages(64));
        }
        let mut cfg = KvPruning::default();
        for part in s
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty() && *p != "default")
        {
            let bad = || {
                RuntimeError::InvalidArgument(format!("KV pruning: expected key=number, got `{part}` (keys: page, sinks, recent, top, top_percent, dense)"))
            };
            let (key, value) = part.split_once('=').ok_or_else(bad)?;
            let value: usize = value.trim().parse().map_err(|_| bad())?;
            match key.trim() {
                "page" => cfg.page = value,
                "sinks" => cfg.sink_pages = value,
                "recent" => cfg.recent_pages = value,
                "top" => cfg.top_pages = value,
                "top_percent" => cfg.top_percent = value,
                "dense" => cfg.dense_layers = value,
                _ => return Err(bad()),
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Pages per group of the two-level page hierarchy ([`PageSelector::Bvh`]).
pub const PAGE_GROUP: usize = 16;

/// How [`PageSummaries`] finds the pages with the highest bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PageSelector {
    /// Every candidate page's bound, then a partial sort.
    #[default]
    Flat,
    /// Group bounds first, pages of a group only while the group can still
    /// hold one of the top pages (branch and bound over a two-level BVH).
    Bvh,
}

/// Exact upper bound of `q·k` over every `k` inside the box `[min, max]`.
#[inline]
pub fn page_upper_bound(q: &[f32], min: &[f32], max: &[f32]) -> f32 {
    q.iter()
        .zip(min)
        .zip(max)
        .map(|((&q, &lo), &hi)| (q * lo).max(q * hi))
        .sum()
}

/// Per-page key boxes of a whole cache.
#[derive(Debug, Clone)]
pub struct PageSummaries {
    page: usize,
    n_seq: usize,
    n_head_kv: usize,
    head_dim: usize,
    n_pages: usize,
    /// Minimum of each key dimension, `[layer][seq][head][page][dim]`.
    min: Vec<f32>,
    /// Maximum of each key dimension, same layout.
    max: Vec<f32>,
    /// Union boxes of groups of [`PAGE_GROUP`] pages, `[layer][seq][head][group][dim]`.
    gmin: Vec<f32>,
    gmax: Vec<f32>,
    n_groups: usize,
    /// Positions summarized per `[layer][seq]`.
    lens: Vec<usize>,
}

impl PageSummaries {
    /// Empty summaries for a cache of shape `spec` with `page` positions per page.
    pub fn new(spec: &KvSpec, page: usize) -> Result<PageSummaries, RuntimeError> {
        if page == 0 {
            return Err(RuntimeError::InvalidArgument(
                "KV page size must be at least 1".into(),
            ));
        }
        let n_pages = spec.n_ctx.div_ceil(page);
        let n = spec
            .n_layer
            .checked_mul(spec.n_seq)
            .and_then(|x| x.checked_mul(spec.n_head_kv))
            .and_then(|x| x.checked_mul(n_pages))
            .and_then(|x| x.checked_mul(spec.head_dim))
            .ok_or_else(|| {
                RuntimeError::InvalidArgument("KV page summaries size overflows".into())
            })?;
        let n_groups = n_pages.div_ceil(PAGE_GROUP);
        let ng = n / n_pages.max(1) * n_groups;
        Ok(PageSummaries {
            page,
            n_seq: spec.n_seq,
            n_head_kv: spec.n_head_kv,
            head_dim: spec.head_dim,
            n_pages,
            min: vec![f32::INFINITY; n],
            max: vec![f32::NEG_INFINITY; n],
            gmin: vec![f32::INFINITY; ng],
            gmax: vec![f32::NEG_INFINITY; ng],
            n_groups,
            lens: vec![0; spec.n_layer * spec.n_seq],
        })
    }

    /// Positions per page.
    pub fn page(&self) -> usize {
        self.page
    }

    /// Positions summarized in `layer` of `seq`.
    pub fn len(&self, layer: usize, seq: usize) -> usize {
        self.lens
            .get(layer * self.n_seq + seq)
            .copied()
            .unwrap_or(0)
    }

    /// Whether nothing is summarized.
    pub fn is_empty(&self) -> bool {
        self.lens.iter().all(|&l| l == 0)
    }

    fn at(&self, layer: usize, seq: usize, head: usize, page: usize) -> usize {
        (((layer * self.n_seq + seq) * self.n_head_kv + head) * self.n_pages + page) * self.head_dim
    }

    /// The key box `(min, max)` of `page` of `head` in `layer` of `seq`
    /// (infinite, i.e. empty, for a page with no positions).
    pub fn bounds(&self, layer: usize, seq: usize, head: usize, page: usize) -> (&[f32], &[f32]) {
        let at = self.at(layer, seq, head, page);
        let hd = self.head_dim;
        (&self.min[at..at + hd], &self.max[at..at + hd])
    }

    fn group_at(&self, layer: usize, seq: usize, head: usize, group: usize) -> usize {
        (((layer * self.n_seq + seq) * self.n_head_kv + head) * self.n_groups + group)
            * self.head_dim
    }

    /// The union box `(min, max)` of group `group` (pages `16 group ..`).
    pub fn group_bounds(
        &self,
        layer: usize,
        seq: usize,
        head: usize,
        group: usize,
    ) -> (&[f32], &[f32]) {
        let at = self.group_at(layer, seq, head, group);
        let hd = self.head_dim;
        (&self.gmin[at..at + hd], &self.gmax[at..at + hd])
    }

    fn reset_page(&mut self, layer: usize, seq: usize, page: usize) {
        for head in 0..self.n_head_kv {
            let at = self.at(layer, seq, head, page);
            self.min[at..at + self.head_dim].fill(f32::INFINITY);
            self.max[at..at + self.head_dim].fill(f32::NEG_INFINITY);
            self.rebuild_group(layer, seq, head, page / PAGE_GROUP);
        }
    }

    /// The group box as the union of its pages' boxes (after a page shrank).
    fn rebuild_group(&mut self, layer: usize, seq: usize, head: usize, group: usize) {
        let hd = self.head_dim;
        let g = self.group_at(layer, seq, head, group);
        self.gmin[g..g + hd].fill(f32::INFINITY);
        self.gmax[g..g + hd].fill(f32::NEG_INFINITY);
        for page in group * PAGE_GROUP..((group + 1) * PAGE_GROUP).min(self.n_pages) {
            let at = self.at(layer, seq, head, page);
            for d in 0..hd {
                self.gmin[g + d] = self.gmin[g + d].min(self.min[at + d]);
                self.gmax[g + d] = self.gmax[g + d].max(self.max[at + d]);
            }
        }
    }

    fn fold(&mut self, layer: usize, seq: usize, head: usize, pos: usize, key: &[f32]) {
        let page = pos / self.page;
        let at = self.at(layer, seq, head, page);
        let g = self.group_at(layer, seq, head, page / PAGE_GROUP);
        let hd = self.head_dim;
        for ((lo, hi), &k) in self.min[at..at + hd]
            .iter_mut()
            .zip(&mut self.max[at..at + hd])
            .zip(key)
        {
            *lo = lo.min(k);
            *hi = hi.max(k);
        }
        for ((lo, hi), &k) in self.gmin[g..g + hd]
            .iter_mut()
            .zip(&mut self.gmax[g..g + hd])
            .zip(key)
        {
            *lo = lo.min(k);
            *hi = hi.max(k);
        }
    }

    /// Folds the keys of one token (`n_head_kv * head_dim`, heads
    /// concatenated) written at `pos`. Pages past the summarized length are
    /// cleared first; rewriting a position already summarized only widens its
    /// box, which keeps the bound valid (truncate first to make it tight).
    /// Callers check the ranges.
    pub fn record(&mut self, layer: usize, seq: usize, pos: usize, keys: &[f32]) {
        let li = layer * self.n_seq + seq;
        let len = self.lens[li];
        if pos >= len {
            for page in len.div_ceil(self.page)..=pos / self.page {
                self.reset_page(layer, seq, page);
            }
            self.lens[li] = pos + 1;
        }
        for head in 0..self.n_head_kv {
            self.fold(
                layer,
                seq,
                head,
                pos,
                &keys[head * self.head_dim..(head + 1) * self.head_dim],
            );
        }
    }

    /// Forgets positions `pos..` of `seq` and rebuilds the box of the page
    /// cut in two from the keys that remain; `key(layer, head, position, out)`
    /// reads one cached key.
    pub fn truncate(
        &mut self,
        seq: usize,
        pos: usize,
        mut key: impl FnMut(usize, usize, usize, &mut [f32]),
    ) {
        if seq >= self.n_seq {
            return;
        }
        let n_layer = self.lens.len() / self.n_seq;
        let mut row = vec![0.0f32; self.head_dim];
        for layer in 0..n_layer {
            let li = layer * self.n_seq + seq;
            let len = self.lens[li].min(pos);
            self.lens[li] = len;
            if len.is_multiple_of(self.page) {
                continue; // no page is cut; pages past `len` are cleared on the next write
            }
            let first = len / self.page * self.page;
            self.reset_page(layer, seq, len / self.page);
            for head in 0..self.n_head_kv {
                for p in first..len {
                    key(layer, head, p, &mut row);
                    self.fold(layer, seq, head, p, &row);
                }
            }
        }
    }

    /// For a query over positions `0..n`: the page count and the pages that
    /// compete by bound (after the sinks, before the recent pages), or
    /// `None` when `cfg` selects every page anyway. Shared by both selectors
    /// and the selection cost count.
    fn candidate_pages(
        &self,
        cfg: &KvPruning,
        n: usize,
    ) -> (usize, Option<std::ops::Range<usize>>) {
        let n_pages = n.div_ceil(self.page).min(self.n_pages);
        if n_pages <= cfg.max_selected_for(n_pages) {
            return (n_pages, None);
        }
        let sinks = cfg.sink_pages.min(n_pages);
        (
            n_pages,
            Some(sinks..n_pages.saturating_sub(cfg.recent_pages).max(sinks)),
        )
    }

    /// The pages of `head` in `layer` of `seq` that a query `q` over
    /// positions `0..n` attends under `cfg`, in increasing order, written to
    /// `out`. `bounds` is scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn select(
        &self,
        cfg: &KvPruning,
        layer: usize,
        seq: usize,
        head: usize,
        n: usize,
        q: &[f32],
        bounds: &mut Vec<(f32, usize)>,
        out: &mut Vec<usize>,
    ) {
        out.clear();
        let (n_pages, candidates) = self.candidate_pages(cfg, n);
        let Some(candidates) = candidates else {
            out.extend(0..n_pages);
            return;
        };
        let (sinks, recent_from) = (candidates.start, candidates.end);
        bounds.clear();
        for page in sinks..recent_from {
            let (lo, hi) = self.bounds(layer, seq, head, page);
            bounds.push((page_upper_bound(q, lo, hi), page));
        }
        let top = cfg.top_for(n_pages).min(bounds.len());
        if top < bounds.len() {
            // Highest bounds first, ties to the lower page; NaN (from a NaN
            // query) sorts as lowest.
            let by_bound_desc =
                |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
            if top > 0 {
                bounds.select_nth_unstable_by(top - 1, by_bound_desc);
            }
            bounds.truncate(top);
        }
        out.extend(0..sinks);
        out.extend(bounds.iter().map(|&(_, p)| p));
        out.extend(recent_from..n_pages);
        out.sort_unstable();
    }

    /// [`PageSummaries::select`] by traversing the two-level hierarchy
    /// ([`PageSelector::Bvh`]): the same pages, found with fewer bound
    /// evaluations when the bounds discriminate. Returns the number of bounds
    /// computed (group and page bounds), the cost the flat scan pays
    /// `recent_from - sinks` of. `groups` and `heap` are scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn select_bvh(
        &self,
        cfg: &KvPruning,
        layer: usize,
        seq: usize,
        head: usize,
        n: usize,
        q: &[f32],
        groups: &mut Vec<(f32, usize)>,
        heap: &mut std::collections::BinaryHeap<TopPage>,
        out: &mut Vec<usize>,
    ) -> usize {
        out.clear();
        let (n_pages, candidates) = self.candidate_pages(cfg, n);
        let Some(candidates) = candidates else {
            out.extend(0..n_pages);
            return 0;
        };
        let (sinks, recent_from) = (candidates.start, candidates.end);
        let top = cfg.top_for(n_pages).min(recent_from - sinks);
        out.extend(0..sinks);
        out.extend(recent_from..n_pages);
        if top == recent_from - sinks {
            out.extend(sinks..recent_from);
            out.sort_unstable();
            return 0;
        }
        let mut evals = 0;
        groups.clear();
        if top > 0 {
            for g in sinks / PAGE_GROUP..=(recent_from - 1) / PAGE_GROUP {
                let (lo, hi) = self.group_bounds(layer, seq, head, g);
                groups.push((page_upper_bound(q, lo, hi), g));
                evals += 1;
            }
        }
        groups.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        heap.clear();
        for &(gb, g) in groups.iter() {
            if heap.len() == top {
                // A group's bound bounds each of its pages: once it is below
                // the worst page kept, no later group can contribute. (Equal
                // bounds are visited: a tie goes to the lower page index.)
                let worst = heap.peek().expect("top > 0");
                if gb.total_cmp(&worst.bound).is_lt() {
                    break;
                }
            }
            for page in (g * PAGE_GROUP).max(sinks)..((g + 1) * PAGE_GROUP).min(recent_from) {
                let (lo, hi) = self.bounds(layer, seq, head, page);
                let cand = TopPage {
                    bound: page_upper_bound(q, lo, hi),
                    page,
                };
                evals += 1;
                if heap.len() < top {
                    heap.push(cand);
                } else if cand < *heap.peek().expect("top > 0") {
                    heap.pop();
                    heap.push(cand);
                }
            }
        }
        out.extend(heap.iter().map(|t| t.page));
        out.sort_unstable();
        evals
    }
}

/// A page and its bound, ordered best first: higher bound, then lower page
/// index. A max-heap of them keeps the worst kept page on top.
#[derive(Debug, Clone, Copy)]
pub struct TopPage {
    /// The page's `q·k` upper bound.
    pub bound: f32,
    /// The page index.
    pub page: usize,
}

impl Ord for TopPage {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .bound
            .total_cmp(&self.bound)
            .then(self.page.cmp(&other.page))
    }
}
impl PartialOrd for TopPage {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for TopPage {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}
impl Eq for TopPage {}

/// Page summaries of a cache together with the selection rule in force.
#[derive(Debug, Clone)]
pub struct PagedKv {
    /// The key boxes, kept up to date on every write.
    pub summaries: PageSummaries,
    /// The selection used by decode attention; `None` attends every position
    /// (summaries are still maintained, so pruning can be switched back on).
    pub pruning: Option<KvPruning>,
    /// How the top pages are found (same pages either way).
    pub selector: PageSelector,
    /// Bounds computed by the selections so far (see [`SelectionStats`]).
    pub stats: SelectionStats,
}

/// What the page selections of a cache cost: queries that pruned, bounds the
/// selector computed for them, and the bounds a flat scan would have computed
/// (every candidate page's). Counted by [`KvCache::attend_maybe_pruned`].
#[derive(Debug, Default)]
pub struct SelectionStats {
    queries: std::sync::atomic::AtomicU64,
    evaluated: std::sync::atomic::AtomicU64,
    flat: std::sync::atomic::AtomicU64,
}

impl Clone for SelectionStats {
    fn clone(&self) -> Self {
        let (q, e, f) = self.get();
        let s = SelectionStats::default();
        s.add(q, e, f);
        s
    }
}

impl SelectionStats {
    fn add(&self, queries: u64, evaluated: u64, flat: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.queries.fetch_add(queries, Relaxed);
        self.evaluated.fetch_add(evaluated, Relaxed);
        self.flat.fetch_add(flat, Relaxed);
    }

    /// `(queries, bounds evaluated, bounds a flat scan evaluates)` so far.
    pub fn get(&self) -> (u64, u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.queries.load(Relaxed),
            self.evaluated.load(Relaxed),
            self.flat.load(Relaxed),
        )
    }

    /// Starts counting again.
    pub fn reset(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.queries.store(0, Relaxed);
        self.evaluated.store(0, Relaxed);
        self.flat.store(0, Relaxed);
    }
}

impl KvCache {
    /// Starts keeping page summaries and prunes decode attention with `cfg`.
    /// Must be called on an empty cache (the summaries start empty).
    pub fn enable_kv_pruning(&mut self, cfg: KvPruning) -> Result<(), RuntimeError> {
        cfg.validate()?;
        if !self.is_empty() {
            return Err(RuntimeError::InvalidArgument(
                "KV pruning must be enabled on an empty cache".into(),
            ));
        }
        let summaries = PageSummaries::new(self.spec(), cfg.page)?;
        *self.paged_mut() = Some(PagedKv {
            summaries,
            pruning: Some(cfg),
            selector: PageSelector::Flat,
            stats: SelectionStats::default(),
        });
        Ok(())
    }

    /// Switches the selection on (`Some`, same page size as enabled) or off
    /// (`None`: full attention) on a cache that keeps page summaries.
    pub fn set_kv_pruning(&mut self, cfg: Option<KvPruning>) -> Result<(), RuntimeError> {
        let Some(paged) = self.paged_mut() else {
            return Err(RuntimeError::InvalidArgument(
                "this KV cache keeps no page summaries".into(),
            ));
        };
        if let Some(c) = &cfg {
            c.validate()?;
            if c.page != paged.summaries.page() {
                return Err(RuntimeError::InvalidArgument(format!(
                    "KV page size {} differs from the summaries' {}",
                    c.page,
                    paged.summaries.page()
                )));
            }
        }
        paged.pruning = cfg;
        Ok(())
    }

    /// Chooses how the top pages are found: a flat scan (default) or the
    /// two-level hierarchy. The pages are the same; only the cost differs.
    pub fn set_page_selector(&mut self, selector: PageSelector) -> Result<(), RuntimeError> {
        let Some(paged) = self.paged_mut() else {
            return Err(RuntimeError::InvalidArgument(
                "this KV cache keeps no page summaries".into(),
            ));
        };
        paged.selector = selector;
        Ok(())
    }

    /// What the page selections cost so far (`None` without summaries).
    pub fn selection_stats(&self) -> Option<&SelectionStats> {
        self.paged().map(|p| &p.stats)
    }

    /// The selection in force, if any.
    pub fn kv_pruning(&self) -> Option<&KvPruning> {
        self.paged().and_then(|p| p.pruning.as_ref())
    }

    /// The page summaries, when kept.
    pub fn page_summaries(&self) -> Option<&PageSummaries> {
        self.paged().map(|p| &p.summaries)
    }

    /// Attention of query head `q` over positions `0..n` of KV head `head`:
    /// over the selected pages only when `prune` is set and a selection is in
    /// force, otherwise over every position ([`KvCache::attend`]). `scores`
    /// needs `n` elements. Callers check the ranges.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_maybe_pruned(
        &self,
        layer: usize,
        seq: usize,
        head: usize,
        n: usize,
        q: &[f32],
        scale: f32,
        prune: bool,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let paged = match self.paged() {
            Some(p) if prune => p,
            _ => return self.attend(layer, seq, head, n, q, scale, scores, out),
        };
        let cfg = match &paged.pruning {
            Some(cfg) if layer >= cfg.dense_layers => cfg,
            _ => return self.attend(layer, seq, head, n, q, scale, scores, out),
        };
        // No shortcut to full attention when every page is selected: the page
        // path costs the same, and tests rely on it being the one that runs.
        let summaries = &paged.summaries;
        let mut bounds = Vec::new();
        let mut pages = Vec::new();
        // What a flat scan computes: one bound per competing page.
        let flat = summaries.candidate_pages(cfg, n).1.map(|c| c.len() as u64);
        let evaluated = match paged.selector {
            PageSelector::Flat => {
                summaries.select(cfg, layer, seq, head, n, q, &mut bounds, &mut pages);
                flat.unwrap_or(0)
            }
            PageSelector::Bvh => {
                let mut heap = std::collections::BinaryHeap::new();
                summaries.select_bvh(
                    cfg,
                    layer,
                    seq,
                    head,
                    n,
                    q,
                    &mut bounds,
                    &mut heap,
                    &mut pages,
                ) as u64
            }
        };
        if let Some(flat) = flat {
            paged.stats.add(1, evaluated, flat);
        }
        let view = self.head_view(layer, seq, head);
        crate::attention_pruned::attend_pages(
            &view,
            summaries.page(),
            &pages,
            n,
            q,
            scale,
            scores,
            out,
        );
    }
}
