//! The split-KV decode attention: `attend_split_*` (a block per up to 8
//! query heads of a GQA group and range of positions, RoPE and the KV store
//! folded in where it can), its grid (`split_plan`: the short form for rows
//! of at most `SHORT_KEYS` keys, else splits that depend on the batch, the
//! cache size and the SM count only), and `attend_combine`, which merges
//! the splits of this and of the pruned attention.

use mirage_runtime::Result;

use super::{CacheAttention, RopeIn};
use crate::backend::{bad, CudaBackend};
use crate::launch::{Arg, Launch, Work};

/// Head sizes the split decode attention is compiled for (`attend_split_*_dN`).
pub(crate) const SPLIT_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Threads of an `attend_split` block and query heads it takes at most
/// (`AS_THREADS`, `AS_MAX_G`), and the most splits `attend_combine` merges
/// (`AS_MAX_SPLITS`), in cuda/attention.cu.
const SPLIT_THREADS: u32 = 128;
/// Parameters of `attend_split_*`, `attend_split_rope_*` and
/// `attend_combine` (checked against the PTX by `checks::nvrtc_check`); a
/// q8_0 cache's kernels take its two scale arrays after them
/// (`KV_SCALE_ARGS`).
pub(crate) const SPLIT_ARGS: usize = 12;
pub(crate) const SPLIT_ROPE_ARGS: usize = 16;
pub(crate) const COMBINE_ARGS: usize = 10;
#[cfg(test)]
pub(crate) const KV_SCALE_ARGS: usize = 2;
const SPLIT_MAX_HEADS: usize = 8;
const SPLIT_MAX: usize = 1024;
/// Most threads of an `attend_combine` block (`AC_THREADS`): slices of
/// `head_dim` threads that share a row's splits.
const COMBINE_THREADS: usize = 512;

/// `attend_combine`'s block: as many whole slices of `head_dim` threads as
/// fit in `COMBINE_THREADS`.
fn combine_threads(head_dim: usize) -> Result<u32> {
    if head_dim == 0 || head_dim > COMBINE_THREADS {
        return Err(bad(format!(
            "attention head size {head_dim}: the split combine takes 1 to {COMBINE_THREADS}"
        )));
    }
    Ok((COMBINE_THREADS / head_dim * head_dim) as u32)
}

/// `attend_split_mma_{f16,q8_0}_d*` (cuda/attention_mma.cu): head sizes, keys a
/// warp's step, the most query heads of a group (the rows of one m16n8k16
/// product) and its parameters.
pub(crate) const MMA_HEAD_DIMS: [usize; 2] = [64, 128];
const MMA_KEYS: usize = 16;
const MMA_MAX_GROUP: usize = 16;
pub(crate) const SPLIT_MMA_ARGS: usize = 14;
/// Parameters of `attend_pages_mma_*` (before a q8_0 cache's scales).
pub(crate) const PAGES_MMA_ARGS: usize = 17;

/// Warps of an `attend_split_mma` block and stages of each warp's ring, by
/// head size (`tm_warps`, `tm_stages`): 4 warps of 3 stages at 64, 2 of 4 at
/// 128.
pub(crate) fn mma_warps(head_dim: usize) -> usize {
    if head_dim == 64 {
        4
    } else {
        2
    }
}

fn mma_stages(head_dim: usize) -> usize {
    if head_dim == 64 {
        3
    } else {
        4
    }
}

/// Warps an SM the tensor-core split is sized for at long context: with
/// more (shorter splits, more partials to combine) an H100 read a 32k cache
/// slower at every Qwen2.5 head shape (benches/gpu/attention_split.py: the
/// 0.5B's layer took 14.5 µs with 4 warps an SM against 18.2 with 16).
const MMA_SM_WARPS: usize = 4;

/// Dynamic shared memory of an `attend_split_mma` block: each warp's ring
/// of stages of `MMA_KEYS` keys and values (f16: rows padded by 8 halves;
/// q8_0: code rows padded by 16 bytes, then the rows' scales,
/// `TM_Q8_STAGE_BYTES`), or the warps' partial sums at the end, whichever
/// is larger.
fn mma_smem(head_dim: usize, kv: &str) -> usize {
    let stage = if kv == "q8_0" {
        2 * MMA_KEYS * (head_dim + 16) + 2 * MMA_KEYS * (head_dim / 16)
    } else {
        2 * MMA_KEYS * (head_dim + 8) * 2
    };
    let warps = mma_warps(head_dim);
    let merge = warps * 16 * (head_dim + 2) * 4;
    (warps * mma_stages(head_dim) * stage).max(merge)
}

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

/// The grid of `attend_split_*` for one attention over the cache.
#[derive(Debug, PartialEq)]
struct SplitPlan {
    /// The short form: one split whose chunk covers every row, output
    /// written by the split kernel, no combine.
    short: bool,
    /// The split form on tensor cores (`attend_split_mma`): all of a KV
    /// head's query heads in one block, so `heads_per_block` is the group.
    mma: bool,
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
/// count only (so a recorded step replays at every longer position). The
/// split form runs on tensor cores (`mma`) where `mma_blocks_per_sm` allows
/// (`smem_optin`: the device's shared memory a block may opt in to), with
/// as many blocks an SM as it gives.
fn split_plan(at: &CacheAttention, sm_count: usize, smem_optin: usize) -> SplitPlan {
    let group = at.n_head / at.n_head_kv;
    let short = at.max_keys <= SHORT_KEYS;
    let mma_blocks = if short {
        None
    } else {
        mma_blocks_per_sm(at, smem_optin)
    };
    let mma = mma_blocks.is_some();
    let heads_per_block = if short {
        1
    } else if mma {
        group
    } else {
        group.min(SPLIT_MAX_HEADS)
    };
    let head_blocks = at.n_head_kv * group.div_ceil(heads_per_block);
    let blocks_per_sm = mma_blocks.unwrap_or(SPLIT_BLOCKS_PER_SM);
    let n_split = if short {
        1
    } else {
        (blocks_per_sm * sm_count)
            .div_ceil(at.rows * head_blocks)
            .min(at.n_ctx.div_ceil(ATTEND_MIN_CHUNK))
            .clamp(1, SPLIT_MAX)
    };
    SplitPlan {
        short,
        mma,
        heads_per_block,
        head_blocks,
        n_split,
        chunk: at.n_ctx.div_ceil(n_split),
    }
}

/// Blocks an SM of the tensor-core split (`attend_split_mma_*`,
/// `attend_pages_mma_*`) over `at`'s cache, or `None` where that form does
/// not apply: an f16 or q8_0 cache, head sizes `MMA_HEAD_DIMS`, groups of
/// at most `MMA_MAX_GROUP` heads and a block's `mma_smem` within
/// `smem_optin`. `MMA_SM_WARPS` warps' worth, at most as many as fit an SM
/// by shared memory (`smem_optin` plus the 1 KiB an SM keeps per block, as
/// on sm_90).
fn mma_blocks_per_sm(at: &CacheAttention, smem_optin: usize) -> Option<usize> {
    let group = at.n_head / at.n_head_kv;
    let smem = mma_smem(at.head_dim, at.kv);
    let fits = (at.kv == "f16" || at.kv == "q8_0")
        && MMA_HEAD_DIMS.contains(&at.head_dim)
        && group <= MMA_MAX_GROUP
        && smem <= smem_optin;
    fits.then(|| {
        let fit = (smem_optin + 1024) / (smem + 1024);
        (MMA_SM_WARPS / mma_warps(at.head_dim)).clamp(1, fit.max(1))
    })
}

/// The grid of the pruned attention on tensor cores (`attend_pages_mma_*`,
/// `attend_split_mma` over the union of a KV head's chosen pages): its
/// split count and dynamic shared memory, or `None` where that form does
/// not apply (`mma_blocks_per_sm`, and pages a whole number of the
/// kernel's steps).
/// Splits as `split_plan`'s for a launch of `rows` rows, at most one per
/// page of the longest union (`max_union`).
pub(super) fn pages_mma_plan(
    at: &CacheAttention,
    rows: usize,
    page: usize,
    max_union: usize,
    sm_count: usize,
    smem_optin: usize,
) -> Option<(usize, usize)> {
    if page == 0 || !page.is_multiple_of(MMA_KEYS) {
        return None;
    }
    let blocks_per_sm = mma_blocks_per_sm(at, smem_optin)?;
    let n_split = (blocks_per_sm * sm_count)
        .div_ceil(rows.max(1) * at.n_head_kv)
        .min(max_union)
        .clamp(1, SPLIT_MAX);
    Some((n_split, mma_smem(at.head_dim, at.kv)))
}

/// Threads of an `attend_split_mma` / `attend_pages_mma` block.
pub(super) fn mma_threads(head_dim: usize) -> u32 {
    (mma_warps(head_dim) * 32) as u32
}

/// The split kernels' arguments after the cache's: heads, KV heads, cache
/// positions and the host's chunk.
fn split_shape_args(at: &CacheAttention, chunk: usize) -> [Arg; 4] {
    [
        Arg::I32(at.n_head as i32),
        Arg::I32(at.n_head_kv as i32),
        Arg::I32(at.n_ctx as i32),
        Arg::I32(chunk as i32),
    ]
}

impl CudaBackend {
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
            mma,
            heads_per_block,
            head_blocks,
            n_split,
            chunk,
        } = split_plan(at, self.sm_count, self.smem_optin);
        if mma {
            return self.attend_split_mma(at, rope, n_split, chunk);
        }
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
        args.extend(split_shape_args(at, chunk));
        args.extend([
            Arg::I32(heads_per_block as i32),
            Arg::F32(1.0 / (hd as f32).sqrt()),
            Arg::Ptr(ppart),
            Arg::Ptr(pout),
        ]);
        let rope_args = rope.is_some();
        let kernel = match rope {
            // attend_split_rope: then the unrotated k and v, mode and base.
            Some(r) => {
                args.extend(r.args());
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
        args.extend(at.scale_args());
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

    /// The split form on tensor cores (`attend_split_mma_*_d*`, RoPE and
    /// the KV store folded in when `rope` is given) and the combine.
    fn attend_split_mma(
        &self,
        at: &CacheAttention,
        rope: Option<RopeIn>,
        n_split: usize,
        chunk: usize,
    ) -> Result<()> {
        let hd = at.head_dim;
        let ppart = {
            let mut s = self.scratch();
            self.reshape(&mut s.attn_part, at.rows * at.n_head * n_split, hd + 2)?
        };
        let mut args = at.cache_args();
        args.extend(split_shape_args(at, chunk));
        args.extend([Arg::F32(1.0 / (hd as f32).sqrt()), Arg::Ptr(ppart)]);
        // Then the RoPE inputs (all 0: the cache already holds the rows' keys
        // and values).
        args.extend(rope.unwrap_or_default().args());
        debug_assert_eq!(args.len(), SPLIT_MMA_ARGS);
        args.extend(at.scale_args());
        self.push_launch(Launch {
            kernel: self
                .kernels
                .index(&format!("attend_split_mma_{}_d{hd}", at.kv))?,
            grid: (at.rows as u32, at.n_head_kv as u32, n_split as u32),
            block: ((mma_warps(hd) * 32) as u32, 1, 1),
            smem: mma_smem(hd, at.kv) as u32,
            work: Work::Plain(args),
        })?;
        self.combine(at, ppart, n_split, chunk, None)
    }

    /// `attend_combine`: rows `at` (or, with `pruned = Some((only_decode,
    /// row_base, rows))`, the launch's rows of the pruned attention) from
    /// their `n_split` partials at `ppart`; `chunk` 0 merges every split.
    pub(super) fn combine(
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
            (combine_threads(at.head_dim)?, 1, 1),
            args,
        )
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
            kd: 0,
            vd: 0,
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
    fn combine_blocks_are_whole_slices_of_the_head() {
        assert_eq!(combine_threads(64).unwrap(), 512);
        assert_eq!(combine_threads(128).unwrap(), 512);
        assert_eq!(combine_threads(96).unwrap(), 480);
        assert_eq!(combine_threads(256).unwrap(), 512);
        assert_eq!(combine_threads(512).unwrap(), 512);
        assert!(combine_threads(0).is_err());
        assert!(combine_threads(640).is_err());
    }

    #[test]
    fn short_rows_take_one_split_of_one_head_per_block_covering_every_row() {
        for (n_head, n_head_kv) in [(14, 2), (28, 4), (12, 1), (4, 4)] {
            for max_keys in [1, 64, SHORT_KEYS] {
                let p = split_plan(
                    &shape(3, n_head, n_head_kv, 32768, max_keys),
                    132,
                    H100_OPTIN,
                );
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
        assert!(split_plan(&shape(1, 14, 2, SHORT_KEYS, SHORT_KEYS), 132, H100_OPTIN).short);
    }

    /// An H100's shared memory a block may opt in to (227 KiB).
    const H100_OPTIN: usize = 232_448;

    #[test]
    fn long_rows_of_an_f16_cache_take_the_tensor_core_split_form() {
        let at = |max_keys| split_plan(&shape(1, 14, 2, 32768, max_keys), 132, H100_OPTIN);
        let (p, end) = (at(SHORT_KEYS + 1), at(32768));
        assert!(p.mma && !p.short);
        assert_eq!(p, end);
        // The whole group in one block of 4 warps (55,296 bytes), one
        // block an SM.
        assert_eq!(mma_smem(64, "f16"), 55_296);
        assert_eq!((p.heads_per_block, p.head_blocks), (7, 2));
        assert_eq!(p.n_split, 132usize.div_ceil(2));
        assert!(p.chunk * p.n_split >= 32768);
        // Head size 128: blocks of 2 warps (69,632 bytes), two an SM.
        let mut wide = shape(1, 28, 4, 32768, 32768);
        wide.head_dim = 128;
        assert_eq!(mma_smem(128, "f16"), 69_632);
        assert_eq!(
            split_plan(&wide, 132, H100_OPTIN).n_split,
            (2 * 132usize).div_ceil(4)
        );
        // A device whose SM holds one such block: one an SM.
        assert_eq!(split_plan(&wide, 132, 69_632).n_split, 132usize.div_ceil(4));
        // A q8_0 cache: the same plan, from smaller rings (codes rows of
        // head size + 16 bytes, then 2 bytes of scale per 32 codes).
        assert_eq!(mma_smem(64, "q8_0"), 4 * 3 * (2 * 16 * 80 + 2 * 16 * 4));
        assert_eq!(mma_smem(128, "q8_0"), 2 * 4 * (2 * 16 * 144 + 2 * 16 * 8));
        let mut q8 = shape(1, 14, 2, 32768, 32768);
        q8.kv = "q8_0";
        assert_eq!(split_plan(&q8, 132, H100_OPTIN), end);
        wide.kv = "q8_0";
        assert!(split_plan(&wide, 132, H100_OPTIN).mma);
        assert_eq!(
            split_plan(&wide, 132, H100_OPTIN).n_split,
            (2 * 132usize).div_ceil(4)
        );
        wide.kv = "f16";
        // Not for an f32 cache, a head size it is not built for, a group of
        // more than 16 heads or a device whose blocks cannot hold a ring.
        let mut f32_cache = shape(1, 14, 2, 32768, 32768);
        f32_cache.kv = "f32";
        wide.head_dim = 256;
        for other in [
            split_plan(&f32_cache, 132, H100_OPTIN),
            split_plan(&wide, 132, H100_OPTIN),
            split_plan(&shape(1, 17, 1, 32768, 32768), 132, H100_OPTIN),
            split_plan(&shape(1, 14, 2, 32768, 32768), 132, 48 * 1024),
        ] {
            assert!(!other.mma && !other.short);
        }
    }

    #[test]
    fn pruned_pages_take_the_tensor_core_split_where_it_applies() {
        let mut at = shape(1, 14, 2, 32768, 32768);
        // Splits as the unpruned split's, capped by the longest union.
        let (n_split, smem) = pages_mma_plan(&at, 1, 16, 2048, 132, H100_OPTIN).unwrap();
        assert_eq!(n_split, split_plan(&at, 132, H100_OPTIN).n_split);
        assert_eq!(smem, mma_smem(64, "f16"));
        assert_eq!(pages_mma_plan(&at, 1, 16, 5, 132, H100_OPTIN).unwrap().0, 5);
        // A launch of more rows: fewer splits each.
        assert_eq!(
            pages_mma_plan(&at, 4, 64, 2048, 132, H100_OPTIN).unwrap().0,
            132usize.div_ceil(8)
        );
        at.kv = "q8_0";
        assert!(pages_mma_plan(&at, 1, 64, 512, 132, H100_OPTIN).is_some());
        // Not for pages that split a step of keys, an f32 cache or a device
        // whose blocks cannot hold the ring.
        assert!(pages_mma_plan(&at, 1, 24, 512, 132, H100_OPTIN).is_none());
        assert!(pages_mma_plan(&at, 1, 0, 512, 132, H100_OPTIN).is_none());
        at.kv = "f32";
        assert!(pages_mma_plan(&at, 1, 16, 512, 132, H100_OPTIN).is_none());
        at.kv = "f16";
        assert!(pages_mma_plan(&at, 1, 16, 512, 132, 48 * 1024).is_none());
    }

    #[test]
    fn longer_rows_split_the_cache_whatever_their_position() {
        // One key past the short form: the split form, the same grid as at
        // the end of the cache (a recorded step replays at every length).
        let at = |max_keys| split_plan(&shape(1, 14, 2, 32768, max_keys), 132, 0);
        let (p, end) = (at(SHORT_KEYS + 1), at(32768));
        assert!(!p.short);
        assert_eq!(p, end);
        assert_eq!((p.heads_per_block, p.head_blocks), (7, 2));
        assert_eq!(p.n_split, (SPLIT_BLOCKS_PER_SM * 132).div_ceil(2));
        assert!(p.chunk * p.n_split >= 32768);
        // A group wider than a block takes two blocks; splits are capped by
        // the cache (one per ATTEND_MIN_CHUNK positions) and SPLIT_MAX.
        let wide = split_plan(&shape(1, 12, 1, 512, 300), 132, 0);
        assert_eq!(
            (wide.heads_per_block, wide.head_blocks),
            (SPLIT_MAX_HEADS, 2)
        );
        assert_eq!(wide.n_split, 512 / ATTEND_MIN_CHUNK);
        let huge = split_plan(&shape(1, 1, 1, 1 << 20, 1 << 20), 100_000, 0);
        assert_eq!(huge.n_split, SPLIT_MAX);
        let batch = split_plan(&shape(16, 28, 4, 4096, 4096), 132, 0);
        assert!(batch.n_split >= 1 && batch.chunk * batch.n_split >= 4096);
    }
}
