//! The prefill attention on f16 tensor cores (`attend_prefill_*`,
//! FlashAttention-2 style): a batch of one sequence's consecutive positions,
//! 64 rows of one KV head's query heads per block, keys split over blocks
//! when the grid would leave SMs idle, merged by `attend_prefill_combine`.

use mirage_runtime::backend::AttentionParams;
use mirage_runtime::Result;

use super::CacheAttention;
use crate::backend::CudaBackend;
use crate::launch::Arg;

/// Arguments of an `attend_prefill_*` launch and of `attend_prefill_combine`
/// (`CudaBackend::attend_prefill`).
#[cfg(test)]
pub(crate) const PREFILL_ARGS: usize = 12;
#[cfg(test)]
pub(crate) const PREFILL_COMBINE_ARGS: usize = 5;

/// Rows (position, query head pairs of one KV head's group) per block of
/// the prefill attention on tensor cores (`FA_ROWS`), its threads per block
/// (`FA_WARPS` warps) and the head sizes it is built for
/// (`attend_prefill_<kv>_d<HD>`), in cuda/attention.cu.
const PREFILL_ROWS: usize = 64;
const PREFILL_THREADS: u32 = 128;
pub(crate) const PREFILL_HEAD_DIMS: [usize; 2] = [64, 128];

/// Batches of fewer rows take the split attention (`attend_split_*`).
pub(super) const PREFILL_MIN_ROWS: usize = 16;

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

impl CudaBackend {
    /// A prefill batch (`at.rows` consecutive positions of one sequence, the
    /// last at `keys - 1`) on tensor cores: `attend_prefill_*`, its keys
    /// split so that the grid has `PREFILL_BLOCKS_PER_SM` blocks per SM (no
    /// split shorter than `PREFILL_MIN_SPLIT_KEYS`), then
    /// `attend_prefill_combine` when split.
    pub(super) fn attend_prefill(
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
                at.scale_args(),
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
}
