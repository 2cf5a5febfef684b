//! Products with the weight matrices: the decode mat-vecs (`mv3_*`: up to
//! three matrices of one input in one launch; `ffn_*`: gate, up and SwiGLU
//! in one launch; split Q4_K's and Q6_K's on int8 tensor cores,
//! cuda/matvec_imma.cu),
//! their launch shape (column split, persistent grid, shared memory), and
//! the prefill products on tensor cores: int8 `mmq_*` for the split layouts,
//! cuBLAS on f16 tiles for the others.

use mirage_runtime::{Result, RuntimeError};

use crate::backend::{bad, drv, CudaBackend};
use crate::launch::{Arg, GateUp, Launch, MatVec, Work, XSplit, F32};
use crate::weights::{CudaFfn, CudaMatrix, Layout};
use crate::CudaError;

/// Arguments of an `mv3_*` launch (`MV3_PARAMS` in cuda/matvec.cu).
#[cfg(test)]
pub(crate) const MV3_ARGS: usize = 23;
/// Arguments of an `ffn_*` launch (`FFN_PARAMS`).
#[cfg(test)]
pub(crate) const FFN_ARGS: usize = 13;
/// Arguments of an `mmq_*` launch and of `quantize_q8`.
#[cfg(test)]
pub(crate) const MMQ_ARGS: usize = 7;
#[cfg(test)]
pub(crate) const QUANTIZE_ARGS: usize = 4;

/// Warps per block of the mat-vec kernels (`FAST_WARPS` in cuda/matvec.cu).
const WARPS: usize = 8;

/// Weight rows per warp of the split-layout and NVFP4 mat-vecs (`FAST_ROWS`,
/// `MV_NR`); the ggml-layout kernels take one row per warp.
const ROWS_PER_WARP: usize = 4;

/// Weight rows per warp of the tensor-core mat-vecs of split Q4_K and Q6_K
/// (`IMMA_ROWS`: the mma's 16 rows).
const IMMA_ROWS: usize = 16;

/// Their column split is the smallest giving at least this many blocks per
/// SM (their blocks stage the input in shared memory, so fewer and larger
/// blocks than the f32 kernels'), with slices of at least one super-block.
const IMMA_BLOCKS_PER_SM: usize = 2;

/// Splits of `mvx_q4_ks_x*` and `mvx_q6_ks_x*` (cuda/matvec_imma.cu), the
/// column split across
/// blocks: each block rounds only its slice of x, which for long rows is a
/// large share of the one-block-a-row-group kernels' time (7B down, 74
/// super-blocks: about a quarter of `mv3_q4_ks_k8`'s, measured alone on an
/// H100). Rows of fewer super-blocks keep those kernels.
pub(crate) const XSPLIT: [usize; 4] = [2, 4, 8, 16];
const XSPLIT_MIN_SUPERBLOCKS: usize = 32;
/// Activation rows a split-across-blocks launch takes (its scratch grows
/// with them; larger batches are prefill products).
const XSPLIT_MAX_ROWS: usize = 16;

/// Shared memory of the tensor-core mat-vecs' activation planes for rows of
/// `cols` (`imma_stage_x`: two int8 planes, a scale and a sum per 32).
pub(crate) fn imma_smem(cols: usize) -> usize {
    2 * cols + 8 * (cols / 32)
}

/// The kernel-name suffix of column split `split` (`_k<S>`; none for 1).
fn split_suffix(split: usize) -> String {
    if split == 1 {
        String::new()
    } else {
        format!("_k{split}")
    }
}

/// Column splits of the split-layout mat-vecs (`mv3_<suffix>_k<S>`; 1 is
/// one warp per row group).
pub(crate) const SPLIT_K: [usize; 4] = [1, 2, 4, 8];

/// The split-K rule picks the smallest split whose grid has at least this
/// many blocks per SM (a single block of 8 warps per SM leaves too few
/// loads in flight to stream a matrix at the copy rate).
const SPLIT_K_BLOCKS_PER_SM: usize = 3;

/// Shortest column slice (elements) a split-K warp is given.
const SPLIT_K_MIN_SLICE: usize = 128;

/// Shortest rows that take the persistent-grid split Q8_0 mat-vecs
/// (`mv3_q8_0s_grid*`: at most the device's resident blocks, each taking
/// several row groups and reading the input and the folded norm once), when
/// the launch has more row groups than resident blocks: the 7B shape's
/// Q/K/V, output projection, down and head (2-4 % faster steps there); the
/// 0.5B shape's stay one block per row group.
const GRID_MIN_COLS: usize = 2048;

/// Batches of more rows than this multiply on tensor cores; smaller ones
/// use the mat-vec.
const GEMM_MIN_ROWS: usize = 17;

/// Layouts the int8 tensor-core products read (`mmq_<suffix>_t<T>` in
/// cuda/mmq.cu).
pub(crate) const MMQ_SUFFIXES: [&str; 2] = ["q8_0s", "q5_0s"];
/// Tile edges of the `mmq_*` kernels (`_t<T>`: T weight rows x T activation
/// rows a block, T * T / 32 threads): the 64 tile fills the SMs on small
/// matrices and short batches; the 128 tile reads half the bytes per
/// product from L2 and shared memory, for the large ones.
pub(crate) const MMQ_TILES: [usize; 2] = [64, 128];
/// Columns of one `mmq_*` stage (`MMQ_K`): a matrix's columns must be a
/// multiple.
const MMQ_K: usize = 128;

/// Stages in the ring of an `mmq_*_t<T>` block (`MMQ_STAGES(T)`).
const fn mmq_stages(t: usize) -> usize {
    if t == 64 {
        2
    } else {
        3
    }
}

/// Dynamic shared memory of an `mmq_*_t<T>` launch: its ring of stages
/// (`MMQ_STAGES(T) * MMQ_STAGE_BYTES(T)`: per stage T rows of weight and of
/// activation quants with 16 bytes of padding, and their per-32-column
/// scales, f16 and f32).
pub(crate) const fn mmq_shared_bytes(t: usize) -> usize {
    mmq_stages(t) * t * (2 * (MMQ_K + 16) + 2 * (MMQ_K / 32) + 4 * (MMQ_K / 32))
}

/// The largest tile edge (`MMQ_TILES`) whose ring fits a block's shared
/// memory on a device that lets a kernel opt in to `optin` bytes (the
/// smallest tile always: it fits the default 48 KiB).
pub(crate) fn mmq_max_tile(optin: usize) -> usize {
    MMQ_TILES
        .into_iter()
        .filter(|&t| mmq_shared_bytes(t) <= optin.max(48 * 1024))
        .max()
        .unwrap_or(MMQ_TILES[0])
}

/// Least share of the 128 tile's work that is useful for it to take a
/// product: its grid's blocks over the block slots of its waves (the
/// device's resident blocks, a last partial wave counting whole), times the
/// tile's share of real rows and activation rows. Below it the 64 tile's
/// finer blocks keep more of the device busy.
const MMQ_WIDE_MIN_SHARE: f64 = 0.75;

/// The tile edge (`MMQ_TILES`) of a product of `rows` weight rows and
/// `n_act` activation rows, when the device holds `wide_slots` blocks of the
/// 128 tile at once. At 7B (ubatches of 512) the FFN, Q, O and down
/// matrices take the 128 tile, K and V the 64; at 0.5B every matrix the 64.
pub(crate) fn mmq_tile_for(rows: usize, n_act: usize, wide_slots: usize) -> usize {
    let t = MMQ_TILES[1];
    let blocks = rows.div_ceil(t) * n_act.div_ceil(t);
    let slots = wide_slots.max(1);
    let fill = blocks as f64 / (blocks.div_ceil(slots) * slots) as f64;
    let real = (rows * n_act) as f64 / (blocks * t * t) as f64;
    if fill * real >= MMQ_WIDE_MIN_SHARE {
        t
    } else {
        MMQ_TILES[0]
    }
}

impl CudaBackend {
    /// Blocks of `kernel` (a block of `threads`, `smem` bytes of dynamic
    /// shared memory) resident on the whole device at once. Asked of the
    /// driver once per kernel and kept: the decode path runs on the host
    /// every step (the step is recorded, then its graph replayed), and a
    /// driver query per mat-vec launch would cost the host more than the
    /// grid saves.
    fn resident_blocks(&self, kernel: usize, threads: u32, smem: u32) -> Result<usize> {
        let mut known = self.resident.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&n) = known.get(&(kernel, threads, smem)) {
            return Ok(n);
        }
        let per_sm = self.kernels.functions[kernel]
            .occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
            .map_err(drv)?;
        let n = per_sm.max(1) as usize * self.sm_count;
        known.insert((kernel, threads, smem), n);
        Ok(n)
    }

    /// Column split for a split-layout mat-vec over matrices of these row
    /// counts and `cols` columns: the smallest split giving at least
    /// `SPLIT_K_BLOCKS_PER_SM` blocks per SM with column slices of at least
    /// `SPLIT_K_MIN_SLICE` elements.
    fn split_k_for(&self, rows: &[usize], cols: usize) -> usize {
        self.split_for(
            rows,
            cols,
            ROWS_PER_WARP,
            SPLIT_K_BLOCKS_PER_SM,
            SPLIT_K_MIN_SLICE,
        )
    }

    /// The smallest column split whose grid (`rows_per_warp` rows a warp)
    /// has at least `per_sm` blocks per SM, with slices of at least
    /// `min_slice` columns.
    fn split_for(
        &self,
        rows: &[usize],
        cols: usize,
        rows_per_warp: usize,
        per_sm: usize,
        min_slice: usize,
    ) -> usize {
        let blocks = |k: usize| -> usize {
            let per_block = WARPS / k * rows_per_warp;
            rows.iter().map(|r| r.div_ceil(per_block)).sum()
        };
        let target = per_sm * self.sm_count;
        let mut best = 1;
        for &k in &SPLIT_K {
            if k > 1 && cols / k < min_slice {
                break;
            }
            best = k;
            if blocks(k) >= target {
                break;
            }
        }
        best
    }

    /// Whether a product over `n_act` activation rows goes to tensor cores.
    pub(crate) fn use_gemm(&self, n_act: usize) -> bool {
        n_act >= GEMM_MIN_ROWS && self.prefill_gemm && !self.recording()
    }

    /// The `mmq_*` suffix of `w` when the int8 products read it.
    fn mmq_suffix(w: &CudaMatrix) -> Option<&'static str> {
        let suffix = MMQ_SUFFIXES.into_iter().find(|&s| s == w.suffix())?;
        w.cols.is_multiple_of(MMQ_K).then_some(suffix)
    }

    /// `y[a, :] = W x[a, :]` for `n_act` rows.
    pub(crate) fn matvec(&self, w: &CudaMatrix, x: u64, n_act: usize, y: u64) -> Result<()> {
        self.matvec_many(&[w], x, n_act, &[y])
    }

    /// `ys[i][a, :] = ws[i] x[a, :]` one product after another (a batch on
    /// tensor cores quantizes `x` once for all the int8 products).
    pub(crate) fn matvec_many(
        &self,
        ws: &[&CudaMatrix],
        x: u64,
        n_act: usize,
        ys: &[u64],
    ) -> Result<()> {
        let mut quantized: Option<(usize, u64, u64)> = None;
        for (w, &y) in ws.iter().zip(ys) {
            if self.use_gemm(n_act) {
                if let Some(s) = Self::mmq_suffix(w) {
                    let (pq, pxd) = match quantized {
                        Some((cols, pq, pxd)) if cols == w.cols => (pq, pxd),
                        _ => {
                            let (pq, pxd) = self.quantize_q8(x, n_act, w.cols)?;
                            quantized = Some((w.cols, pq, pxd));
                            (pq, pxd)
                        }
                    };
                    self.mmq(w, s, pq, pxd, n_act, y)?;
                    continue;
                }
                if self.blas.is_some() {
                    self.gemm(w, x, n_act, y)?;
                    continue;
                }
            }
            self.mv3(&[w], x, n_act, &[y])?;
        }
        Ok(())
    }

    /// The `n_act x cols` activations at `x` in 8-bit blocks (32 values:
    /// int8 quants, and the f32 scale d = max|x| / 127) in the scratch:
    /// returns the quants' and the scales' addresses.
    fn quantize_q8(&self, x: u64, n_act: usize, cols: usize) -> Result<(u64, u64)> {
        let n_blocks = n_act * cols / 32;
        // Quants, then the scales 16-byte aligned (`mmq_*` copies a row's
        // four scales of a stage as 16 bytes).
        let q_bytes = (n_act * cols).next_multiple_of(16);
        let pq = {
            let mut s = self.scratch();
            self.grow_scratch(&mut s.mmq_x, q_bytes + 4 * n_blocks)?
        };
        let pxd = pq + q_bytes as u64;
        self.push_launch(Launch {
            kernel: self.kernels.index("quantize_q8")?,
            grid: (n_blocks.div_ceil(8) as u32, 1, 1),
            block: (256, 1, 1),
            smem: 0,
            work: Work::Plain(vec![
                Arg::Ptr(x),
                Arg::I64(n_blocks as i64),
                Arg::Ptr(pq),
                Arg::Ptr(pxd),
            ]),
        })?;
        Ok((pq, pxd))
    }

    /// The tile edge `mmq_*` takes for `rows` weight rows and `n_act`
    /// activation rows on this device (`mmq_tile_for`; the 64 tile where
    /// the 128 tile's ring does not fit the device's shared memory).
    pub fn mmq_tile(&self, rows: usize, n_act: usize) -> Result<usize> {
        let t = MMQ_TILES[1];
        if self.mmq_max_tile < t {
            return Ok(MMQ_TILES[0]);
        }
        let wide = self
            .kernels
            .index(&format!("mmq_{}_t{t}", MMQ_SUFFIXES[0]))?;
        let slots = self.resident_blocks(wide, (t * t / 32) as u32, mmq_shared_bytes(t) as u32)?;
        Ok(mmq_tile_for(rows, n_act, slots))
    }

    /// `y[a, r] = W[r, :] . x[a, :]` on int8 tensor cores, x given as 8-bit
    /// blocks (`quantize_q8`): `mmq_<suffix>_t<T>` reads the weight's own
    /// blocks tile by tile (cuda/mmq.cu). Activation tiles are the grid's
    /// x, so the blocks of one weight tile run side by side.
    fn mmq(
        &self,
        w: &CudaMatrix,
        suffix: &str,
        pq: u64,
        pxd: u64,
        n_act: usize,
        y: u64,
    ) -> Result<()> {
        let (rows, cols) = (w.rows, w.cols);
        let t = self.mmq_tile(rows, n_act)?;
        self.push_launch(Launch {
            kernel: self.kernels.index(&format!("mmq_{suffix}_t{t}"))?,
            grid: (n_act.div_ceil(t) as u32, rows.div_ceil(t) as u32, 1),
            block: ((t * t / 32) as u32, 1, 1),
            smem: mmq_shared_bytes(t) as u32,
            work: Work::Plain(vec![
                Arg::Ptr(self.ptr(&w.data)),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::Ptr(pq),
                Arg::Ptr(pxd),
                Arg::I32(n_act as i32),
                Arg::Ptr(y),
            ]),
        })
    }

    /// `ys[i][a, :] = ws[i] x[a, :]` for 1 to 3 matrices of one layout and
    /// row length, in one launch of `mv3_*` (its blocks are cut between the
    /// matrices by their row counts).
    pub(crate) fn mv3(&self, ws: &[&CudaMatrix], x: u64, n_act: usize, ys: &[u64]) -> Result<()> {
        if ws.is_empty() || ws.len() > 3 || ws.len() != ys.len() {
            return Err(bad("mv3 takes 1 to 3 matrices with one output each"));
        }
        let w0 = ws[0];
        let suffix = w0.suffix();
        if ws.iter().any(|w| w.suffix() != suffix || w.cols != w0.cols) {
            return Err(bad("mv3 matrices differ in layout or row length"));
        }
        let rows: Vec<usize> = ws.iter().map(|w| w.rows).collect();
        let (split, per_block, smem) = match w0.layout {
            Layout::Ggml => (1, WARPS, 0),
            Layout::Q4KSplit | Layout::Q6KSplit => {
                let split = self.imma_split(&rows, w0.cols);
                (
                    split,
                    WARPS / split * IMMA_ROWS,
                    self.imma_smem_checked(w0.cols)?,
                )
            }
            _ => {
                let split = self.split_k_for(&rows, w0.cols);
                (split, WARPS * ROWS_PER_WARP / split, 0)
            }
        };
        let mut m = MatVec {
            w: [self.ptr(&w0.data); 3],
            rows: [0; 3],
            row_bytes: w0.row_bytes as i64,
            cols: w0.cols as i32,
            x,
            y: [ys[0]; 3],
            tensor_scale: [F32(0.0); 3],
            bias: [0; 3],
            res: 0,
            norm: None,
            xsplit: None,
        };
        let mut blocks = 0usize;
        for (i, (w, &y)) in ws.iter().zip(ys).enumerate() {
            m.w[i] = self.ptr(&w.data);
            m.rows[i] = w.rows as i32;
            m.y[i] = y;
            m.tensor_scale[i] = F32(w.tensor_scale());
            blocks += w.rows.div_ceil(per_block);
        }
        if let Some(split) = self.xsplit_for(w0, ws.len(), n_act) {
            return self.mvx(w0, m, split, n_act);
        }
        let k = split_suffix(split);
        let mut kernel = self.kernels.index(&format!("mv3_{suffix}{k}"))?;
        if w0.layout == Layout::Q8Split && w0.cols >= GRID_MIN_COLS {
            let grid = self.kernels.index(&format!("mv3_q8_0s_grid{k}"))?;
            let resident = self.resident_blocks(grid, (32 * WARPS) as u32, 0)?;
            if blocks > resident {
                // Grid-stride over the same row groups: no more blocks than fit.
                kernel = grid;
                blocks = resident;
            }
        }
        self.push_launch(Launch {
            kernel,
            grid: (blocks as u32, n_act as u32, 1),
            block: ((32 * WARPS) as u32, 1, 1),
            smem,
            work: Work::MatVec(m),
        })
    }

    /// The split across blocks (`mvx_*_x*`) for one split-Q4_K or -Q6_K matrix
    /// with rows of at least `XSPLIT_MIN_SUPERBLOCKS` super-blocks and at
    /// most `XSPLIT_MAX_ROWS` activation rows: the largest split whose grid
    /// still fits `IMMA_BLOCKS_PER_SM` blocks an SM (at least 2), or `None`
    /// for the one-block-a-row-group kernels.
    fn xsplit_for(&self, w: &CudaMatrix, n_mats: usize, n_act: usize) -> Option<usize> {
        if !matches!(w.layout, Layout::Q4KSplit | Layout::Q6KSplit)
            || n_mats != 1
            || n_act > XSPLIT_MAX_ROWS
            || w.cols / 256 < XSPLIT_MIN_SUPERBLOCKS
        {
            return None;
        }
        let tiles = w.rows.div_ceil(WARPS * IMMA_ROWS);
        let target = IMMA_BLOCKS_PER_SM * self.sm_count;
        let fits = XSPLIT
            .iter()
            .copied()
            .filter(|&s| tiles * s <= target)
            .max();
        Some(fits.unwrap_or(XSPLIT[0]))
    }

    /// `mvx_<suffix>_x{split}` for the one matrix of `m` (norm not folded:
    /// `fusion::fold_norm` leaves these launches alone).
    fn mvx(&self, w: &CudaMatrix, mut m: MatVec, split: usize, n_act: usize) -> Result<()> {
        let tiles = w.rows.div_ceil(WARPS * IMMA_ROWS);
        let slice_cols = (w.cols / 256).div_ceil(split) * 256;
        let (part, ctr) = {
            let mut s = self.scratch();
            let s = &mut *s;
            (
                self.grow_scratch(&mut s.xsplit_part, n_act * split * w.rows)?,
                self.grow_scratch(&mut s.xsplit_ctr, n_act * tiles)?,
            )
        };
        m.xsplit = Some(XSplit { part, ctr });
        self.push_launch(Launch {
            kernel: self
                .kernels
                .index(&format!("mvx_{}_x{split}", w.suffix()))?,
            grid: ((tiles * split) as u32, n_act as u32, 1),
            block: ((32 * WARPS) as u32, 1, 1),
            smem: imma_smem(slice_cols) as u32,
            work: Work::MatVec(m),
        })
    }

    /// Column split of the tensor-core mat-vecs over matrices of these row
    /// counts (`IMMA_BLOCKS_PER_SM`).
    fn imma_split(&self, rows: &[usize], cols: usize) -> usize {
        self.split_for(rows, cols, IMMA_ROWS, IMMA_BLOCKS_PER_SM, 256)
    }

    /// `imma_smem(cols)` as a launch's dynamic shared memory, refused when
    /// it could not take a folded norm's row as well on this device.
    fn imma_smem_checked(&self, cols: usize) -> Result<u32> {
        let need = imma_smem(cols) + 4 * cols;
        if need > self.smem_optin {
            return Err(bad(format!(
                "rows of {cols} columns need {need} bytes of shared memory a block; the device allows {}",
                self.smem_optin
            )));
        }
        Ok(imma_smem(cols) as u32)
    }

    /// `h[a, r] = silu(gate[r] . x[a]) * (up[r] . x[a])` in one launch;
    /// `false` (nothing launched) when gate and up are read by different
    /// kernels.
    pub(crate) fn ffn_gate_up(&self, f: &CudaFfn, x: u64, n_act: usize, h: u64) -> Result<bool> {
        let (g, u) = (&f.gate, &f.up);
        if g.suffix() != u.suffix() || g.row_bytes != u.row_bytes {
            return Ok(false);
        }
        let (per_block, kernel, smem) = match g.layout {
            Layout::Ggml => (WARPS, format!("ffn_{}", g.suffix()), 0),
            Layout::Q4KSplit | Layout::Q6KSplit => {
                // A warp takes 16 channels (their gate and up rows).
                let split = self.imma_split(&[g.rows], g.cols);
                (
                    WARPS / split * IMMA_ROWS,
                    format!("ffn_{}{}", g.suffix(), split_suffix(split)),
                    self.imma_smem_checked(g.cols)?,
                )
            }
            _ => (WARPS * ROWS_PER_WARP / 2, format!("ffn_{}", g.suffix()), 0),
        };
        self.push_launch(Launch {
            kernel: self.kernels.index(&kernel)?,
            grid: (g.rows.div_ceil(per_block) as u32, n_act as u32, 1),
            block: ((32 * WARPS) as u32, 1, 1),
            smem,
            work: Work::GateUp(GateUp {
                gate: self.ptr(&g.data),
                up: self.ptr(&u.data),
                rows: g.rows as i32,
                row_bytes: g.row_bytes as i64,
                cols: g.cols as i32,
                x,
                h,
                tensor_scale: [F32(g.tensor_scale()), F32(u.tensor_scale())],
                norm: None,
            }),
        })?;
        Ok(true)
    }

    /// `y[a, r] = W[r, :] . x[a, :]` on tensor cores: the activations go to
    /// f16 once, the weight is dequantized to f16 in tiles of rows that fit
    /// the options' `gemm_tile_bytes`, and each tile is one cuBLAS GemmEx
    /// (f16 inputs, f32 accumulation and output) writing its columns of `y`.
    fn gemm(&self, w: &CudaMatrix, x: u64, n_act: usize, y: u64) -> Result<()> {
        let blas = self
            .blas
            .as_ref()
            .ok_or_else(|| bad("cuBLAS is not loaded"))?;
        let (rows, cols) = (w.rows, w.cols);
        let tile_rows = (self.gemm_tile_bytes / (2 * cols)).max(16) / 16 * 16;
        let tile_rows = tile_rows.min(rows);
        let (px, pw) = {
            let mut s = self.scratch();
            let s = &mut *s;
            (
                self.grow_scratch(&mut s.gemm_x, n_act * cols)?,
                self.grow_scratch(&mut s.gemm_w, tile_rows * cols)?,
            )
        };
        let n = (n_act * cols) as i64;
        self.push_launch(Launch {
            kernel: self.kernels.index("f32_to_f16")?,
            grid: ((n as u64).div_ceil(256) as u32, 1, 1),
            block: (256, 1, 1),
            smem: 0,
            work: Work::Plain(vec![Arg::Ptr(x), Arg::Ptr(px), Arg::I64(n)]),
        })?;
        let dq = self.kernels.index(&format!("dequant_f16_{}", w.suffix()))?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let mut r0 = 0;
        while r0 < rows {
            let rc = tile_rows.min(rows - r0);
            let mut args = vec![Arg::Ptr(self.ptr(&w.data))];
            match w.layout {
                Layout::Ggml => args.extend([Arg::I64(w.row_bytes as i64), Arg::I32(cols as i32)]),
                Layout::Nvfp4 { tensor_scale } => args.extend([
                    Arg::I32(rows as i32),
                    Arg::I32(cols as i32),
                    Arg::F32(tensor_scale),
                ]),
                _ => args.extend([Arg::I32(rows as i32), Arg::I32(cols as i32)]),
            }
            args.extend([Arg::I32(r0 as i32), Arg::Ptr(pw)]);
            self.push_launch(Launch {
                kernel: dq,
                grid: (rc as u32, 1, 1),
                block: (128, 1, 1),
                smem: 0,
                work: Work::Plain(args),
            })?;
            // Column-major view: Y^T (rows x n_act, ld rows) = W_tile (cols x
            // rc, transposed) times X^T (cols x n_act).
            use cudarc::cublas::sys::{
                cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
            };
            // SAFETY: the pointers hold rc * cols and n_act * cols halves and
            // n_act * rows floats; the handle runs on self.stream.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    rc as i32,
                    n_act as i32,
                    cols as i32,
                    (&alpha) as *const f32 as *const _,
                    pw as *const _,
                    cudaDataType::CUDA_R_16F,
                    cols as i32,
                    px as *const _,
                    cudaDataType::CUDA_R_16F,
                    cols as i32,
                    (&beta) as *const f32 as *const _,
                    (y + 4 * r0 as u64) as *mut _,
                    cudaDataType::CUDA_R_32F,
                    rows as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| RuntimeError::from(CudaError::Driver(format!("cuBLAS GemmEx: {e:?}"))))?;
            r0 += rc;
        }
        Ok(())
    }

    /// The FFN of `n` rows at `px` into `po`: gate/up/SwiGLU in one launch
    /// (or, for a prefill on tensor cores or gate and up of different
    /// layouts, two products and `swiglu`), then the down product.
    pub(crate) fn ffn_rows(&self, f: &CudaFfn, px: u64, n: usize, po: u64) -> Result<()> {
        let n_ff = f.gate.rows;
        // The scratch lock is released before the products: the GEMM paths
        // take it again for their buffers.
        let (pg, pu, ph) = {
            let mut s = self.scratch();
            let s = &mut *s;
            (
                self.reshape(&mut s.gate, n, n_ff)?,
                self.reshape(&mut s.up, n, n_ff)?,
                self.reshape(&mut s.hidden, n, n_ff)?,
            )
        };
        let fused = !self.use_gemm(n) && self.ffn_gate_up(f, px, n, ph)?;
        if !fused {
            self.matvec_many(&[&f.gate, &f.up], px, n, &[pg, pu])?;
            self.elementwise("swiglu", n * n_ff, &[pg, pu, ph], None)?;
        }
        self.matvec(&f.down, ph, n, po)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rings the launches reserve: two stages of the 64 tile (under the
    /// 48 KiB a launch gets without opting in), three of the 128 tile (one
    /// block per SM on sm_90's 227 KiB).
    #[test]
    fn mmq_rings_fit_their_devices() {
        assert_eq!(mmq_shared_bytes(64), 39_936);
        assert!(mmq_shared_bytes(64) <= 48 * 1024);
        assert_eq!(mmq_shared_bytes(128), 119_808);
        assert!(mmq_shared_bytes(128) <= 227 * 1024);
    }

    /// The tile rule on the Qwen2.5 shapes at ubatches of 512 on an H100's
    /// 132 SMs (one block of the 128 tile each): at 7B the FFN, Q, O and
    /// down take the 128 tile, K and V (16 blocks) the 64; at 0.5B every
    /// matrix the 64 (the FFN's 152 blocks would leave most SMs idle in a
    /// second wave); short batches the 64 (mostly padding in a 128 tile).
    #[test]
    fn the_large_tile_needs_the_shared_memory_for_its_ring() {
        assert_eq!(mmq_max_tile(227 * 1024), 128, "an H100's opt-in");
        assert_eq!(mmq_max_tile(mmq_shared_bytes(128)), 128);
        assert_eq!(mmq_max_tile(mmq_shared_bytes(128) - 1), 64);
        assert_eq!(mmq_max_tile(0), 64, "the 64 tile fits the default 48 KiB");
    }

    #[test]
    fn mmq_tile_rule_on_the_benchmark_shapes() {
        let slots = 132;
        for rows in [18944, 3584] {
            assert_eq!(mmq_tile_for(rows, 512, slots), 128, "7B, {rows} rows");
        }
        assert_eq!(mmq_tile_for(512, 512, slots), 64, "7B K and V");
        for rows in [4864, 896, 128] {
            assert_eq!(mmq_tile_for(rows, 512, slots), 64, "0.5B, {rows} rows");
        }
        assert_eq!(mmq_tile_for(18944, 40, slots), 64, "a short batch");
        assert_eq!(
            mmq_tile_for(18944, 300, slots),
            64,
            "300 rows: 22 % padding"
        );
        assert_eq!(mmq_tile_for(18944, 384, slots), 128);
        // A device that reports no slots still gets an answer.
        assert_eq!(mmq_tile_for(18944, 512, 0), 128);
    }
}
