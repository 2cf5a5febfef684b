//! The KV cache on the device and attention over it: RoPE and the KV store,
//! the split-K decode attention (`attend_split_*`: the query heads of a GQA
//! group in one block, so the cache is read once per KV head, split over the
//! context so that every length fills the device; RoPE and the KV store
//! folded in where it can; `attend_combine` merges the splits), the prefill
//! attention on f16 tensor cores (FlashAttention-2 style), and decode attention over selected KV pages (page
//! boxes kept on the device, chosen per head by `cuda/attention_pruned.cu`,
//! merged by the same `attend_combine`).
//!
//! This module holds `Backend::attention` (`CudaBackend::attend`, which
//! picks the path for a batch) and the shapes every path launches with;
//! the paths and the cache live in:
//! - `cache`: the device KV cache, its RoPE tables and page boxes;
//! - `decode`: the split-KV decode attention and `attend_combine`;
//! - `prefill`: the tiled prefill attention on tensor cores;
//! - `pruned`: page-box refresh and attention over selected KV pages.

use mirage_runtime::backend::{AttentionParams, InputShape, QkNorm, TokenSlot};
use mirage_runtime::kv_cache::KvDtype;
use mirage_runtime::ops::RopeMode;
use mirage_runtime::Result;

use crate::backend::{bad, drv, CudaActivations, CudaBackend, Scratch};
use crate::graph::GRAPH_MAX_ROWS;
use crate::launch::{Arg, Launch, Work};
use crate::weights::CudaVector;

mod cache;
mod decode;
mod prefill;
mod pruned;

pub use cache::CudaKvCache;
pub(crate) use cache::KvPageBoxes;
#[cfg(test)]
pub(crate) use decode::mma_warps;
#[cfg(test)]
pub(crate) use decode::{
    COMBINE_ARGS, KV_SCALE_ARGS, PAGES_MMA_ARGS, SPLIT_ARGS, SPLIT_MMA_ARGS, SPLIT_ROPE_ARGS,
};
pub(crate) use decode::{MMA_HEAD_DIMS, SPLIT_HEAD_DIMS};
pub(crate) use prefill::PREFILL_HEAD_DIMS;
use prefill::PREFILL_MIN_ROWS;
#[cfg(test)]
pub(crate) use prefill::{PREFILL_ARGS, PREFILL_COMBINE_ARGS};

/// One layer's attention over the cache as the kernels see it: device
/// addresses of the queries, the cache, the rows' (seq, pos) slots and the
/// output, and the shape.
pub(crate) struct CacheAttention {
    pub q: u64,
    pub kc: u64,
    pub vc: u64,
    /// The scales of a q8_0 cache's keys and values (0 for f32 and f16).
    pub kd: u64,
    pub vd: u64,
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
    /// `f32`, `f16` or `q8_0`: the cache's element type in kernel names.
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

    /// The last arguments of a q8_0 cache's kernels: the key and value
    /// scales (none for f32 and f16).
    fn scale_args(&self) -> Vec<Arg> {
        if self.kv == "q8_0" {
            vec![Arg::Ptr(self.kd), Arg::Ptr(self.vd)]
        } else {
            Vec::new()
        }
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
/// RoPE table (`CudaBackend::rope_table`). The default (all 0) tells a
/// kernel that takes them optionally that the cache already holds the rows.
#[derive(Default)]
pub(crate) struct RopeIn {
    pub k: u64,
    pub v: u64,
    pub neox: bool,
    pub table: u64,
}

impl RopeIn {
    /// The kernels' trailing arguments: the unrotated k and v, the pairing
    /// and the table.
    pub(crate) fn args(&self) -> [Arg; 4] {
        [
            Arg::Ptr(self.k),
            Arg::Ptr(self.v),
            Arg::I32(self.neox as i32),
            Arg::Ptr(self.table),
        ]
    }
}

pub(crate) fn kv_name(dtype: KvDtype) -> &'static str {
    match dtype {
        KvDtype::F32 => "f32",
        KvDtype::F16 => "f16",
        KvDtype::Q8_0 => "q8_0",
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

    /// `rope_store_*`: the rows' q and k through the per-head norms at
    /// `qk_norm` (q's, k's weights; 0 for none) and RoPE, in place, and k
    /// and v stored into the cache at the rows' slots.
    fn rope_store(
        &self,
        at: &CacheAttention,
        r: &RopeIn,
        qk_norm: (u64, u64),
        norm_eps: f32,
    ) -> Result<()> {
        let mut args = vec![
            Arg::Ptr(at.q),
            Arg::Ptr(r.k),
            Arg::Ptr(r.v),
            Arg::Ptr(at.slots),
            Arg::I32(at.n_head as i32),
            Arg::I32(at.n_head_kv as i32),
            Arg::I32(at.head_dim as i32),
            Arg::I32(r.neox as i32),
            Arg::Ptr(r.table),
            Arg::Ptr(qk_norm.0),
            Arg::Ptr(qk_norm.1),
            Arg::F32(norm_eps),
            Arg::Ptr(at.kc),
            Arg::Ptr(at.vc),
            Arg::I32(at.n_ctx as i32),
        ];
        args.extend(at.scale_args());
        self.plain(
            &format!("rope_store_{}", at.kv),
            (at.rows as u32, (at.n_head + at.n_head_kv) as u32, 1),
            ((at.head_dim / 2) as u32, 1, 1),
            args,
        )
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
        let shape = |a: &CudaActivations| InputShape {
            rows: a.rows,
            width: a.width,
        };
        let spec = cache.spec;
        p.check_batch(shape(q), shape(k), shape(v), slots, &spec, layer)?;
        if !SPLIT_HEAD_DIMS.contains(&hd) {
            return Err(bad(format!(
                "attention shape {p:?} (the cuda kernels take head_dim {SPLIT_HEAD_DIMS:?})"
            )));
        }
        let max_pos = slots.iter().map(|s| s.pos).max().unwrap_or(0);
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
        let [pkc, pvc, pkd, pvd] = self.layer_cache(cache, layer);
        let prope = self.rope_table(cache, p.rope_freq_base)?;
        let kv = kv_name(spec.dtype);
        let po = self.reshape(out, n, p.n_head * hd)?;
        let at = CacheAttention {
            q: pq,
            kc: pkc,
            vc: pvc,
            kd: pkd,
            vd: pvd,
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
        let rope = RopeIn {
            k: pk,
            v: pv,
            neox: p.rope_mode == RopeMode::Neox,
            table: prope,
        };
        if !rope_in_attention {
            self.rope_store(&at, &rope, (pqn, pkn), p.norm_eps)?;
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
            self.refresh_page_boxes(pages, layer, slots, pslots, [pkc, pkd], kv, &spec)?;
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
            && slots
                .windows(2)
                .all(|w| w[1].seq == w[0].seq && w[1].pos == w[0].pos + 1);
        if tiled {
            self.attend_prefill(&at, p, slots[n - 1].pos + 1, scale, po)?;
        } else if pruned != Some(false) {
            self.attend_cache(&at, rope_in_attention.then_some(rope))?;
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
}
