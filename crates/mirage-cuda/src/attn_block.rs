//! Grid and shared memory of the attention block kernel (`attn_block_q8s_*`
//! in cuda/dense.cu): Q/K/V, the decode attention and O of one layer in one
//! persistent launch, which [`crate::CudaBackend`] substitutes for those
//! three launches of a recorded one-row step when
//! `MIRAGE_CUDA_ATTN_BLOCK=1` (`CudaBackend::set_attention_block`).
//!
//! The kernel's blocks wait on each other through counters, so every block
//! must be resident at once: the grid is at most the resident blocks at the
//! chosen dynamic shared memory, which is the input vector (the folded
//! norm's output, later the attention output) plus the block's O row tiles
//! when they fit (copied in before the kernel's PDL wait). This module is
//! the arithmetic of that choice, kept apart from the driver so that it is
//! tested without a GPU. `MIRAGE_CUDA_ATTN_BLOCK_COPY=0` plans no copies
//! (more resident blocks: an A/B of occupancy against copying ahead).
//!
//! Measured on the H200 (seventeenth session, NOTES.md): at the 7B shape the
//! kernel is slower than the three launches it replaces (4.53-4.60 against
//! 3.56-3.64 ms a step), so it stays off by default.

/// Whether the attention block kernel is on at start:
/// `MIRAGE_CUDA_ATTN_BLOCK=1` (or `on`); off by default.
pub fn attention_block_at_start() -> bool {
    std::env::var("MIRAGE_CUDA_ATTN_BLOCK").is_ok_and(|v| v == "1" || v == "on")
}

/// Rows per warp of the split Q8_0 v2 mat-vecs (`MVV2_NR`) and warps per
/// block (`FAST_WARPS`): a row tile of a launch split `s` ways is
/// `(8 / s) * 4` rows.
const NR: usize = 4;
const WARPS: usize = 8;

/// Bytes of shared memory between the vector and the O tiles at most (the
/// kernel aligns the tiles to 128 bytes).
const ALIGN_SLACK: usize = 128;

/// Counters the kernel keeps per launch (`ATTB_SYNC` in dense.cu).
pub(crate) fn sync_words(n_head: usize, n_head_kv: usize) -> usize {
    n_head + 2 * n_head_kv + 2
}

/// Rows of one mat-vec row tile at column split `s` (1, 2, 4 or 8).
pub(crate) fn tile_rows(s: usize) -> usize {
    (WARPS / s) * NR
}

/// What the plan needs to know of a layer and the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct AttnBlockShape {
    /// Input width of Q/K/V (`d_model`).
    pub cols: usize,
    /// Rows of Q, K and V.
    pub rows_qkv: [usize; 3],
    /// Column split of the Q/K/V and of the O launch being replaced.
    pub s_qkv: usize,
    pub s_o: usize,
    /// O's rows (`d_model`) and columns (`n_head * head_dim`).
    pub rows_o: usize,
    pub cols_o: usize,
    /// Attention work items: heads x splits.
    pub att_items: usize,
    pub sm_count: usize,
    /// Largest dynamic shared memory a block may opt into.
    pub max_dynamic_smem: usize,
    /// At most this many blocks (tests: several items a block).
    pub max_grid: Option<usize>,
    /// Whether the device has the copy engine for bulk copies (sm_90+);
    /// without it the kernel's fallback is thread 0 copying alone, so the
    /// plan copies nothing ahead.
    pub bulk_copies: bool,
}

/// The launch: `grid` blocks, `smem` bytes of dynamic shared memory of
/// which the first `vec_floats` floats are the vector area, `o_pre` O
/// tiles per block copied in ahead. `refused` is the first candidate the
/// driver did not admit, (dynamic shared memory, resident blocks an SM it
/// gave): the bench prints it, so a table says why a grid came out smaller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AttnBlockPlan {
    pub grid: usize,
    pub smem: usize,
    pub o_pre: usize,
    pub vec_floats: usize,
    pub refused: Option<(usize, usize)>,
}

impl AttnBlockShape {
    /// Bytes of one O tile in shared memory (its quants, then its scales),
    /// or `None` when the tiles cannot be bulk-copied: not every tile
    /// whole, or a span not a 16-byte multiple at a 16-byte offset.
    fn o_tile_bytes(&self) -> Option<usize> {
        let t = tile_rows(self.s_o);
        let (q, m) = (t * self.cols_o, t * (self.cols_o / 16));
        let whole = self.rows_o % t == 0;
        let aligned = q % 16 == 0 && m % 16 == 0 && (self.rows_o * self.cols_o) % 16 == 0;
        (self.bulk_copies && whole && aligned && self.cols_o % 32 == 0).then_some(q + m)
    }

    /// Blocks that have work in some step: more would only repeat the
    /// norm's prologue.
    fn useful_blocks(&self) -> usize {
        let t = tile_rows(self.s_qkv);
        let qkv: usize = self.rows_qkv.iter().map(|r| r.div_ceil(t)).sum();
        let o = self.rows_o.div_ceil(tile_rows(self.s_o));
        qkv.max(o)
            .max(self.att_items)
            .min(self.max_grid.unwrap_or(usize::MAX))
            .max(1)
    }

    /// The plan: the most resident blocks (2, then 1 per SM) at which the
    /// block's share of O fits in shared memory beside the vector; if none
    /// does, no copies ahead and the grid of the resident blocks at the
    /// vector alone. `per_sm(smem)` is the driver's resident blocks per SM
    /// at that dynamic shared memory (0 when it does not fit).
    pub fn plan(
        &self,
        per_sm: impl Fn(usize) -> Result<usize, String>,
    ) -> Result<AttnBlockPlan, String> {
        let vec_floats = self.cols.max(self.cols_o).next_multiple_of(32);
        let vec_bytes = vec_floats * 4;
        let useful = self.useful_blocks();
        let n_o = self.rows_o.div_ceil(tile_rows(self.s_o));
        let mut refused = None;
        if let Some(tile) = self.o_tile_bytes() {
            for want in [2usize, 1] {
                let grid = (want * self.sm_count).min(useful);
                let o_pre = n_o.div_ceil(grid);
                // (+ ALIGN_SLACK: the kernel starts the tiles at a 128-byte boundary.)
                let smem = vec_bytes + ALIGN_SLACK + o_pre * tile;
                if smem <= self.max_dynamic_smem {
                    let per = per_sm(smem)?;
                    if per >= want {
                        return Ok(AttnBlockPlan {
                            grid,
                            smem,
                            o_pre,
                            vec_floats,
                            refused,
                        });
                    }
                    refused.get_or_insert((smem, per));
                }
            }
        }
        let per = per_sm(vec_bytes)?;
        if per == 0 {
            return Err(format!("no block of the attention block kernel fits with {vec_bytes} bytes of shared memory"));
        }
        Ok(AttnBlockPlan {
            grid: (per * self.sm_count).min(useful),
            smem: vec_bytes,
            o_pre: 0,
            vec_floats,
            refused,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 7B shape (Qwen2.5-7B: d 3584, 28 heads, 4 KV heads of 128) at
    /// split 4, on 132 SMs, with a resident count from a 228 KiB SM.
    fn shape_7b() -> AttnBlockShape {
        AttnBlockShape {
            cols: 3584,
            rows_qkv: [3584, 512, 512],
            s_qkv: 4,
            s_o: 4,
            rows_o: 3584,
            cols_o: 3584,
            att_items: 28 * 16,
            sm_count: 132,
            max_dynamic_smem: 227 * 1024,
            max_grid: None,
            bulk_copies: true,
        }
    }

    fn sm_228k(smem: usize) -> Result<usize, String> {
        Ok((228 * 1024 / (smem + 8 * 1024)).min(2))
    }

    #[test]
    fn the_7b_block_takes_its_o_rows_at_two_blocks_an_sm() {
        let p = shape_7b().plan(sm_228k).unwrap();
        // 448 O tiles of 8 rows on 264 blocks: 2 a block, 8 x (3584 + 224)
        // bytes each, after the 3584-float vector.
        assert_eq!(p.grid, 264);
        assert_eq!(p.o_pre, 2);
        assert_eq!(p.vec_floats, 3584);
        assert_eq!(p.smem, 3584 * 4 + 128 + 2 * 8 * (3584 + 224));
        assert_eq!(p.refused, None);
    }

    #[test]
    fn tiles_that_do_not_fit_two_an_sm_fall_back_to_one_then_to_none() {
        // Split 1: 32-row tiles, 112 of them; at 264 blocks one each
        // (14336 + 128 + 121856 bytes): too much for two an SM, fine for one.
        let s = AttnBlockShape {
            s_o: 1,
            ..shape_7b()
        };
        let p = s.plan(sm_228k).unwrap();
        assert_eq!((p.grid, p.o_pre), (132, 1));
        // A device that admits nothing beyond the vector: no copies ahead.
        let tight = |smem: usize| Ok(if smem <= 3584 * 4 { 2 } else { 0 });
        let p = s.plan(tight).unwrap();
        assert_eq!((p.grid, p.o_pre, p.smem), (264, 0, 3584 * 4));
        // The first candidate refused: one 32-row tile a block at 264.
        assert_eq!(p.refused, Some((3584 * 4 + 128 + 32 * (3584 + 224), 0)));
    }

    #[test]
    fn unaligned_or_partial_tiles_are_not_copied_ahead() {
        // 4-row tiles (split 8) of a 96-wide O: scale span 4 x 6 = 24 bytes.
        let s = AttnBlockShape {
            cols: 96,
            cols_o: 96,
            rows_o: 96,
            rows_qkv: [96, 32, 32],
            s_qkv: 8,
            s_o: 8,
            att_items: 3,
            ..shape_7b()
        };
        assert_eq!(s.plan(sm_228k).unwrap().o_pre, 0);
        // Rows that leave a partial last tile.
        let s = AttnBlockShape {
            rows_o: 3580,
            ..shape_7b()
        };
        assert_eq!(s.plan(sm_228k).unwrap().o_pre, 0);
        // No copy engine (before sm_90).
        let s = AttnBlockShape {
            bulk_copies: false,
            ..shape_7b()
        };
        assert_eq!(s.plan(sm_228k).unwrap().o_pre, 0);
    }

    #[test]
    fn the_grid_never_exceeds_the_work() {
        // The 0.5B shape: 896 wide, 14 heads of 64, 2 KV heads; 7 x 4 items.
        let s = AttnBlockShape {
            cols: 896,
            rows_qkv: [896, 128, 128],
            s_qkv: 2,
            s_o: 2,
            rows_o: 896,
            cols_o: 896,
            att_items: 14 * 4,
            ..shape_7b()
        };
        let p = s.plan(sm_228k).unwrap();
        // Q/K/V: (896 + 128 + 128) / 16 = 72 tiles; O 56: 72 blocks.
        assert_eq!(p.grid, 72);
        assert_eq!(p.o_pre, 1);
        assert!(s.plan(|_| Ok(0)).is_err());
        // Capped at 8 blocks: 7 of the 56 O tiles of 16 rows a block, 7 x 16 x
        // (896 + 56) bytes beside the vector: one block an SM.
        let capped = AttnBlockShape {
            max_grid: Some(8),
            ..s
        };
        let p = capped.plan(sm_228k).unwrap();
        assert_eq!((p.grid, p.o_pre), (8, 7));
        assert_eq!(p.smem, 896 * 4 + 128 + 7 * 16 * (896 + 56));
        // At 3 blocks, 19 tiles a block do not fit: none copied ahead.
        let capped = AttnBlockShape {
            max_grid: Some(3),
            ..s
        };
        let p = capped.plan(sm_228k).unwrap();
        assert_eq!((p.grid, p.o_pre), (3, 0));
        assert_eq!(sync_words(14, 2), 20);
    }
}
