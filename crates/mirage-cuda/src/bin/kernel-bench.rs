//! kernel-bench: decode mat-vec and FFN kernels on random data, timed with
//! CUDA events (warm-up, then the median of many runs, the L2 flushed by a
//! 256 MiB memset before every timed run), against a device-to-device copy
//! measured in the same run as the bandwidth ceiling.
//!
//! (a) mat-vec GB/s and microseconds for ggml Q8_0 and Q4_K (the kernels of
//!     cuda/dense.cu), split Q8_0 and NVFP4 (cuda/superblock.cu, nvfp4.cu);
//! (b) a Qwen2-7B-shape FFN (d 3584, n_ff 18944): dense (three mat-vecs +
//!     SwiGLU) in Q8_0, split Q8_0, Q4_K, NVFP4 and Q2_K, against the fused
//!     sparse kernels over Q8_0 pages and over NVFP4 pages at several active
//!     fractions and over Q2_K pages at 100/40/25 % (the same random page
//!     subsets for every format).
//!
//! (c) with `--variants`, only the copy and the mat-vec variants of the split
//!     Q8_0 and split Q4_K layouts (`mv3_<layout>[_v<N>][_k<S>]`,
//!     `ffn_<layout>[_v<N>]`, the backend's kernels and launch shapes) at
//!     every split-K setting on the 7B shapes, each checked against v1
//!     (rel err printed), then split Q8_0 v2 against v2g (`mv3_grid`, the
//!     same row groups on at most the resident blocks) at every split, with
//!     and without the folded RMSNorm, compared bit for bit.
//!
//! (d) the fused Q8_0 FFN variants (`superblock_ffn_q8s_v<n>`, both phases
//!     as the two launches of the sparse backend's graph, every phase-2 part
//!     size of PART_CH, each phase alone too) at the 7B shape (100/40/25 %
//!     of the pages) and the Qwen2.5-0.5B shape (d 896, n_ff 4864; 100/50 %),
//!     per layer in replayed CUDA graphs of several layers (each its own
//!     cold pages), against the backend's dense v2 FFN run the same way; printed last,
//!     and alone (after the copy) with `--sparse`.
//!
//! (e) with `--launch-floor`, only the floor of one decode-graph node: a
//!     graph of 64 launches of `pdl_floor` (dense.cu: the PDL handshake and
//!     one dependent increment, nothing else) at grids of 1 block and of 1,
//!     3 and 8 blocks per SM of 256 threads, with and without programmatic
//!     serialization; µs per node. What a kernel boundary costs by itself,
//!     beside the ~3.5 µs a fused-FFN phase costs over an empty page list.
//!     Then the same dependency inside one persistent launch: µs per round of
//!     `flag_floor` (a grid-wide handoff through a counter, as the attention
//!     block kernel's blocks wait on each other, and a chain of single-block
//!     handoffs), at 1 block and 1 and 2 blocks per SM.
//!
//! Usage: `kernel-bench [--iters N] [--variants | --sparse | --launch-floor]
//! [--sparse-variants 0,3,10]`. Prints a table last. `--sparse-variants`
//! keeps only those fused-FFN variants in (d) (v0, the "vs v0" column's
//! base, only when listed).

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("kernel-bench: built without the `cuda` feature");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = bench::run() {
        eprintln!("kernel-bench: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod bench {
    use std::error::Error;
    use std::sync::Arc;

    use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
    use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
    use mirage_cuda::module;
    use mirage_cuda::superblock::{
        q8_0_page_bytes, ActivePages, FfnLaunch, FfnQ8Options, FfnScratch, Nvfp4Pages, Reduction,
        SparseDevice, PAGE_CHANNELS, Q8_FFN_VARIANTS,
    };
    use mirage_cuda::superblock_q2k::Q2kPages;
    use mirage_gguf::quant::Nvfp4Tensor;

    type Res<T> = Result<T, Box<dyn Error>>;

    /// xorshift64*: fast, reproducible random bytes (speed does not depend
    /// on the values much, but all-zero data can run faster than real data).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            let mut v = vec![0u8; n];
            for c in v.chunks_mut(8) {
                let r = self.next().to_le_bytes();
                c.copy_from_slice(&r[..c.len()]);
            }
            v
        }
        fn f32s(&mut self, n: usize) -> Vec<f32> {
            (0..n)
                .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
                .collect()
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    fn f16_bytes(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_le_bytes()
    }

    /// Random ggml Q8_0 rows with valid, small block scales.
    fn random_q8_0(r: &mut Rng, rows: usize, cols: usize) -> Vec<u8> {
        let mut b = r.bytes(rows * cols / 32 * 34);
        for blk in b.chunks_exact_mut(34) {
            let s = 1e-3 * (1.0 + (blk[2] as f32) / 64.0);
            blk[..2].copy_from_slice(&f16_bytes(s));
        }
        b
    }

    /// Random ggml Q4_K super-blocks with valid d and dmin.
    fn random_q4_k(r: &mut Rng, rows: usize, cols: usize) -> Vec<u8> {
        let mut b = r.bytes(rows * cols / 256 * 144);
        for blk in b.chunks_exact_mut(144) {
            blk[..2].copy_from_slice(&f16_bytes(1e-3));
            blk[2..4].copy_from_slice(&f16_bytes(5e-4));
        }
        b
    }

    /// Random NVFP4 matrix: any code, E4M3 scales below the NaN pattern.
    fn random_nvfp4(r: &mut Rng, rows: usize, cols: usize) -> Nvfp4Tensor {
        let packed = r.bytes(rows * cols / 2);
        let block_scales = r.bytes(rows * cols / 16).iter().map(|b| b % 0x7f).collect();
        Nvfp4Tensor {
            dims: vec![cols as u64, rows as u64],
            tensor_scale: 1e-3,
            block_scales,
            packed,
        }
    }

    /// Random pages already in the device layout, valid f16 scales.
    fn random_q8s_pages(r: &mut Rng, d: usize, n_pages: usize) -> Vec<u8> {
        let pb = q8_0_page_bytes(d);
        let q = 3 * PAGE_CHANNELS * d;
        let mut v = r.bytes(n_pages * pb);
        for page in v.chunks_exact_mut(pb) {
            for s in page[q..].chunks_exact_mut(2) {
                s.copy_from_slice(&f16_bytes(1e-3));
            }
        }
        v
    }

    struct Timer<'a> {
        dev: &'a SparseDevice,
        flush: CudaSlice<u8>,
        warmup: usize,
        iters: usize,
    }

    impl Timer<'_> {
        /// Median microseconds of `f` (L2 flushed before every run).
        fn median_us(&mut self, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
            let ctx = self.dev.context();
            let stream = self.dev.stream();
            let n = self.warmup + self.iters;
            let mut pairs = Vec::with_capacity(n);
            for _ in 0..n {
                let a = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                let b = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                stream.memset_zeros(&mut self.flush)?;
                a.record(stream)?;
                f()?;
                b.record(stream)?;
                pairs.push((a, b));
            }
            stream.synchronize()?;
            let mut t: Vec<f64> = pairs[self.warmup..]
                .iter()
                .map(|(a, b)| a.elapsed_ms(b).map(|ms| ms as f64 * 1e3))
                .collect::<Result<_, _>>()?;
            t.sort_by(|a, b| a.total_cmp(b));
            Ok(t[t.len() / 2])
        }
    }

    /// Random NVFP4 pages: random gate, up and down_t matrices packed.
    fn random_nvfp4_pages(r: &mut Rng, d: usize, n_ff: usize) -> Res<Nvfp4Pages> {
        let (g, u, dt) = (
            random_nvfp4(r, n_ff, d),
            random_nvfp4(r, n_ff, d),
            random_nvfp4(r, n_ff, d),
        );
        Ok(Nvfp4Pages::from_tensors(&g, &u, &dt)?)
    }

    /// Random ggml Q2_K rows with valid d and dmin.
    fn random_q2_k(r: &mut Rng, rows: usize, cols: usize) -> Vec<u8> {
        let mut b = r.bytes(rows * cols / 256 * 84);
        for blk in b.chunks_exact_mut(84) {
            blk[80..82].copy_from_slice(&f16_bytes(1e-3));
            blk[82..84].copy_from_slice(&f16_bytes(5e-4));
        }
        b
    }

    /// Random Q2_K pages: random gate, up and down_t Q2_K rows packed.
    fn random_q2k_pages(r: &mut Rng, d: usize, n_ff: usize) -> Res<Q2kPages> {
        let (g, u, dt) = (
            random_q2_k(r, n_ff, d),
            random_q2_k(r, n_ff, d),
            random_q2_k(r, n_ff, d),
        );
        Ok(Q2kPages::from_q2k_rows(d, n_ff, &g, &u, &dt)?)
    }

    struct Dense {
        matvec_q8_0: CudaFunction,
        matvec_q4_k: CudaFunction,
        swiglu: CudaFunction,
    }

    fn ptr<T>(dev: &SparseDevice, s: &CudaSlice<T>) -> u64 {
        let (p, _g) = s.device_ptr(dev.stream());
        p
    }

    /// One launch of a cuda/dense.cu mat-vec (one warp per row, 8 rows per
    /// block: the backend's MATVEC_WARPS).
    #[allow(clippy::too_many_arguments)]
    fn dense_matvec(
        dev: &SparseDevice,
        f: &CudaFunction,
        w: &CudaSlice<u8>,
        row_bytes: usize,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Res<()> {
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (pw, px, py) = (ptr(dev, w), ptr(dev, x), ptr(dev, y));
        let (rb, r, c) = (row_bytes as i64, rows as i32, cols as i32);
        let mut b = dev.stream().launch_builder(f);
        b.arg(&pw).arg(&rb).arg(&r).arg(&c).arg(&px).arg(&py);
        // SAFETY: matches `matvec_<type>(const u8*, long, int, int, const
        // float*, float*)` of cuda/dense.cu; buffers sized by the caller.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn swiglu(
        dev: &SparseDevice,
        f: &CudaFunction,
        g: &CudaSlice<f32>,
        u: &CudaSlice<f32>,
        h: &mut CudaSlice<f32>,
        n: usize,
    ) -> Res<()> {
        let cfg = LaunchConfig::for_num_elems(n as u32);
        let (pg, pu, ph, nn) = (ptr(dev, g), ptr(dev, u), ptr(dev, h), n as i64);
        let mut b = dev.stream().launch_builder(f);
        b.arg(&pg).arg(&pu).arg(&ph).arg(&nn);
        // SAFETY: matches `swiglu(const float*, const float*, float*, long)`.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Median us of a dense FFN as the three cuda/dense.cu mat-vecs of one
    /// type (`mv`) and SwiGLU: `w` = gate and up (`n_ff` rows of `d`, rows
    /// of `row_bytes[0]`), down (`d` rows of `n_ff`, `row_bytes[1]`).
    #[allow(clippy::too_many_arguments)]
    fn dense_ffn_us(
        dev: &SparseDevice,
        timer: &mut Timer,
        mv: &CudaFunction,
        swiglu_f: &CudaFunction,
        w: [&[u8]; 3],
        row_bytes: [usize; 2],
        d: usize,
        n_ff: usize,
        x: &CudaSlice<f32>,
    ) -> Res<f64> {
        let stream = dev.stream();
        let (dg, du, ddn) = (
            stream.clone_htod(w[0])?,
            stream.clone_htod(w[1])?,
            stream.clone_htod(w[2])?,
        );
        let mut bg = stream.alloc_zeros::<f32>(n_ff)?;
        let mut bu = stream.alloc_zeros::<f32>(n_ff)?;
        let mut bh = stream.alloc_zeros::<f32>(n_ff)?;
        let mut y = stream.alloc_zeros::<f32>(d)?;
        let [rbd, rbf] = row_bytes;
        timer.median_us(|| {
            dense_matvec(dev, mv, &dg, rbd, n_ff, d, x, &mut bg)?;
            dense_matvec(dev, mv, &du, rbd, n_ff, d, x, &mut bu)?;
            swiglu(dev, swiglu_f, &bg, &bu, &mut bh, n_ff)?;
            dense_matvec(dev, mv, &ddn, rbf, d, n_ff, &bh, &mut y)
        })
    }

    /// `k` distinct random page ids below `n` (partial Fisher-Yates),
    /// ascending as a router emits them.
    fn random_subset(r: &mut Rng, n: usize, k: usize) -> Vec<u32> {
        let mut all: Vec<u32> = (0..n as u32).collect();
        for i in 0..k {
            let j = i + r.below(n - i);
            all.swap(i, j);
        }
        let mut ids = all[..k].to_vec();
        ids.sort_unstable();
        ids
    }

    /// Split layouts of the variants section: 0 = split Q8_0 (quants
    /// `[rows][cols]`, f16 scales `[rows][cols/32]`), 1 = split Q4_K (quants
    /// `[rows][cols/2]`, 16-byte headers `[rows][cols/256]`). Random bytes
    /// with sane f16 scales / d / dmin, directly in the device layout.
    fn random_split(r: &mut Rng, layout: usize, rows: usize, cols: usize) -> Vec<u8> {
        if layout == 0 {
            let mut b = r.bytes(rows * cols + rows * cols / 16);
            for (i, s) in b[rows * cols..].chunks_exact_mut(2).enumerate() {
                s.copy_from_slice(&f16_bytes(1e-3 * (1.0 + (i % 61) as f32 / 64.0)));
            }
            b
        } else {
            let mut b = r.bytes(rows * cols / 2 + rows * cols / 16);
            for h in b[rows * cols / 2..].chunks_exact_mut(16) {
                h[..2].copy_from_slice(&f16_bytes(1e-3));
                h[2..4].copy_from_slice(&f16_bytes(5e-4));
            }
            b
        }
    }

    /// Rows per warp of mat-vec variant v (backend's FAST_ROWS / VARIANT_ROWS).
    fn variant_rows(v: usize) -> usize {
        [4, 4, 2, 2, 2][v - 1]
    }

    /// The outputs of an `mv3_*` launch over matrices of `rows` (the
    /// matrices that exist, in order), read back to the host.
    fn read_outputs(dev: &SparseDevice, ys: &[CudaSlice<f32>], rows: [usize; 3]) -> Res<Vec<f32>> {
        let mut v = Vec::new();
        for (y, &n) in ys.iter().zip(&rows) {
            if n > 0 {
                v.extend(dev.stream().clone_dtoh(y)?);
            }
        }
        Ok(v)
    }

    /// Blocks of the backend's mv3 grid (tiles of `mv3_grid`).
    fn mv3_tiles(rows: [usize; 3], nr: usize, split: usize) -> usize {
        let per_block = 8 * nr / split;
        rows.iter().map(|r| r.div_ceil(per_block)).sum()
    }

    /// One `mv3_*` launch (MV3_PARAMS) over up to three matrices of `rows`
    /// on `blocks` blocks of 8 warps (the backend's grid: `mv3_tiles`), with
    /// the RMSNorm of `x` by weights `norm` folded in (the decode's Q/K/V
    /// and gate/up launches) when given.
    #[allow(clippy::too_many_arguments)]
    fn mv3_launch(
        dev: &SparseDevice,
        f: &CudaFunction,
        ws: [u64; 3],
        rows: [usize; 3],
        cols: usize,
        x: u64,
        ys: [u64; 3],
        blocks: usize,
        norm: Option<u64>,
    ) -> Res<()> {
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            // The folded norm's row (fused_norm_xs, dynamic shared memory).
            shared_mem_bytes: if norm.is_some() { (cols * 4) as u32 } else { 0 },
        };
        let (r0, r1, r2) = (rows[0] as i32, rows[1] as i32, rows[2] as i32);
        let (rb, c) = (0i64, cols as i32);
        let (z, zf) = (0u64, 0f32);
        let (nx, nw, neps) = match norm {
            Some(w) => (x, w, 1e-6f32),
            None => (0, 0, 0.0),
        };
        let mut b = dev.stream().launch_builder(f);
        b.arg(&ws[0])
            .arg(&ws[1])
            .arg(&ws[2])
            .arg(&r0)
            .arg(&r1)
            .arg(&r2);
        b.arg(&rb)
            .arg(&c)
            .arg(&x)
            .arg(&ys[0])
            .arg(&ys[1])
            .arg(&ys[2]);
        b.arg(&zf).arg(&zf).arg(&zf);
        b.arg(&z).arg(&z).arg(&z).arg(&z);
        b.arg(&nx).arg(&nw).arg(&neps).arg(&z);
        // SAFETY: matches MV3_PARAMS of cuda/dense.cu (W0..2, rows0..2,
        // row_bytes, cols, x, y0..2, ts0..2, bias0..2, res, nx, nw, neps,
        // nout); every matrix and output sized for its rows and cols, the
        // norm's weights (when given) for cols, and the shared memory for the
        // normalised row.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// One `ffn_*` launch (FFN_PARAMS): gate/up/SwiGLU, `nr / 2` channels
    /// per warp.
    #[allow(clippy::too_many_arguments)]
    fn ffn_launch(
        dev: &SparseDevice,
        f: &CudaFunction,
        wg: u64,
        wu: u64,
        rows: usize,
        cols: usize,
        x: u64,
        h: u64,
        nr: usize,
    ) -> Res<()> {
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(8 * nr / 2) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, rb, c) = (rows as i32, 0i64, cols as i32);
        let (z, zf) = (0u64, 0f32);
        let mut b = dev.stream().launch_builder(f);
        b.arg(&wg).arg(&wu).arg(&r).arg(&rb).arg(&c).arg(&x).arg(&h);
        b.arg(&zf).arg(&zf).arg(&z).arg(&z).arg(&zf).arg(&z);
        // SAFETY: matches FFN_PARAMS of cuda/dense.cu (Wg, Wu, rows,
        // row_bytes, cols, x, h, ts_g, ts_u, nx, nw, neps, nout).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn rel_err(got: &[f32], want: &[f32]) -> f64 {
        let num: f64 = got
            .iter()
            .zip(want)
            .map(|(a, b)| ((*a - *b) as f64).powi(2))
            .sum();
        let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
        (num / den.max(1e-30)).sqrt()
    }

    /// (c): every variant x split of the split Q8_0 / Q4_K mat-vecs on the
    /// 7B decode shapes, and the fused gate/up kernel; returns the rows of
    /// the table (what, us, bytes, "rel err vs v1").
    fn variants(
        dev: &SparseDevice,
        m: &Arc<cudarc::driver::CudaModule>,
        timer: &mut Timer,
        r: &mut Rng,
    ) -> Res<Vec<Row>> {
        let stream = dev.stream().clone();
        let mut out = Vec::new();
        // (label, matrices' rows, cols): QKV is one launch of three matrices.
        let shapes: [(&str, [usize; 3], usize); 4] = [
            ("QKV 4608x3584 (3584+512+512)", [3584, 512, 512], 3584),
            ("O 3584x3584", [3584, 0, 0], 3584),
            ("down 3584x18944", [3584, 0, 0], 18944),
            ("lm head 152064x3584", [152064, 0, 0], 3584),
        ];
        for (layout, lname) in [(0usize, "q8_0s"), (1, "q4_ks")] {
            let tname = if layout == 0 { "Q8_0" } else { "Q4_K" };
            for &(label, rows, cols) in &shapes {
                let ws: Vec<CudaSlice<u8>> = rows
                    .iter()
                    .filter(|&&n| n > 0)
                    .map(|&n| stream.clone_htod(&random_split(r, layout, n, cols)))
                    .collect::<Result<_, _>>()?;
                let bytes: f64 = ws.iter().map(|w| w.len() as f64).sum::<f64>()
                    + (cols + rows.iter().sum::<usize>()) as f64 * 4.0;
                let wp = [0, 1, 2].map(|i| ws.get(i).map_or(0, |w| ptr(dev, w)));
                let x = stream.clone_htod(&r.f32s(cols))?;
                let ys: Vec<CudaSlice<f32>> = rows
                    .iter()
                    .map(|&n| stream.alloc_zeros::<f32>(n.max(1)))
                    .collect::<Result<_, _>>()?;
                let yp = [0, 1, 2].map(|i| ptr(dev, &ys[i]));
                let px = ptr(dev, &x);
                let mut base: Option<Vec<f32>> = None;
                for v in 1..=5usize {
                    for split in [1usize, 2, 4, 8] {
                        let vs = if v == 1 {
                            String::new()
                        } else {
                            format!("_v{v}")
                        };
                        let name = if split == 1 {
                            format!("mv3_{lname}{vs}")
                        } else {
                            format!("mv3_{lname}{vs}_k{split}")
                        };
                        let f = m.load_function(&name)?;
                        let nr = variant_rows(v);
                        let blocks = mv3_tiles(rows, nr, split);
                        let us = timer.median_us(|| {
                            mv3_launch(dev, &f, wp, rows, cols, px, yp, blocks, None)
                        })?;
                        let got = read_outputs(dev, &ys, rows)?;
                        let err = match &base {
                            None => {
                                base = Some(got);
                                0.0
                            }
                            Some(b) => rel_err(&got, b),
                        };
                        out.push(Row {
                            what: format!("{tname} {label} v{v} k{split} ({name})"),
                            us,
                            bytes,
                            extra: format!("{err:.1e}"),
                        });
                    }
                }
                if layout == 0 {
                    out.extend(grid_rows(
                        dev,
                        m,
                        timer,
                        r,
                        (label, rows, cols),
                        &wp,
                        px,
                        &ys,
                        bytes,
                    )?);
                }
            }
            // gate + up + SwiGLU, 18944 x 3584 twice, one kernel.
            let (ff, d) = (18944usize, 3584usize);
            let g = stream.clone_htod(&random_split(r, layout, ff, d))?;
            let u = stream.clone_htod(&random_split(r, layout, ff, d))?;
            let bytes = (g.len() + u.len()) as f64 + (d + ff) as f64 * 4.0;
            let x = stream.clone_htod(&r.f32s(d))?;
            let h = stream.alloc_zeros::<f32>(ff)?;
            let (pg, pu, px, ph) = (ptr(dev, &g), ptr(dev, &u), ptr(dev, &x), ptr(dev, &h));
            let mut base: Option<Vec<f32>> = None;
            for v in 1..=5usize {
                let vs = if v == 1 {
                    String::new()
                } else {
                    format!("_v{v}")
                };
                let name = format!("ffn_{lname}{vs}");
                let f = m.load_function(&name)?;
                let nr = variant_rows(v);
                let us = timer.median_us(|| ffn_launch(dev, &f, pg, pu, ff, d, px, ph, nr))?;
                let got = stream.clone_dtoh(&h)?;
                let err = match &base {
                    None => {
                        base = Some(got);
                        0.0
                    }
                    Some(b) => rel_err(&got, b),
                };
                out.push(Row {
                    what: format!("{tname} gate+up 2x18944x3584 v{v} ({name})"),
                    us,
                    bytes,
                    extra: format!("{err:.1e}"),
                });
            }
        }
        Ok(out)
    }

    /// v2 against v2g (`mv3_grid`: the same tiles on a grid of the resident
    /// blocks) at every split, with and without the folded RMSNorm (row
    /// lengths <= 8192: the normalised row lives in shared memory); the
    /// outputs of each pair compared bit for bit ("bits equal" / "BITS
    /// DIFFER" in the last column).
    #[allow(clippy::too_many_arguments)]
    fn grid_rows(
        dev: &SparseDevice,
        m: &Arc<cudarc::driver::CudaModule>,
        timer: &mut Timer,
        r: &mut Rng,
        (label, rows, cols): (&str, [usize; 3], usize),
        wp: &[u64; 3],
        px: u64,
        ys: &[CudaSlice<f32>],
        bytes: f64,
    ) -> Res<Vec<Row>> {
        let stream = dev.stream().clone();
        let sms = dev.context().attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as usize;
        let nw = stream.clone_htod(&r.f32s(cols))?;
        let yp = [0, 1, 2].map(|i| ptr(dev, &ys[i]));
        let mut out = Vec::new();
        for with_norm in [false, true] {
            if with_norm && cols > 8192 {
                continue;
            }
            let norm = with_norm.then(|| ptr(dev, &nw));
            let smem = if norm.is_some() { cols * 4 } else { 0 };
            for split in [1usize, 2, 4, 8] {
                let ks = if split == 1 {
                    String::new()
                } else {
                    format!("_k{split}")
                };
                let tiles = mv3_tiles(rows, 4, split);
                let mut pair = Vec::new();
                for (name, persistent) in [
                    (format!("mv3_q8_0s_v2{ks}"), false),
                    (format!("mv3_q8_0s_v2g{ks}"), true),
                ] {
                    let f = m.load_function(&name)?;
                    let blocks = if persistent {
                        let per_sm = f
                            .occupancy_max_active_blocks_per_multiprocessor(256, smem, None)?
                            as usize;
                        tiles.min(per_sm.max(1) * sms)
                    } else {
                        tiles
                    };
                    let us = timer
                        .median_us(|| mv3_launch(dev, &f, *wp, rows, cols, px, yp, blocks, norm))?;
                    pair.push(read_outputs(dev, ys, rows)?);
                    let bits = match pair.as_slice() {
                        [a, b] if a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()) => {
                            "bits equal"
                        }
                        [_, _] => "BITS DIFFER",
                        _ => "",
                    };
                    out.push(Row {
                        what: format!(
                            "Q8_0 {label} v2{} k{split}{} ({name}, {blocks} blocks)",
                            if persistent { "g" } else { "" },
                            if norm.is_some() { " + norm" } else { "" }
                        ),
                        us,
                        bytes,
                        extra: bits.to_string(),
                    });
                }
            }
        }
        Ok(out)
    }

    struct Row {
        what: String,
        us: f64,
        bytes: f64,
        extra: String,
    }

    /// Rows of a weight-only fused FFN (NVFP4, Q2_K) over one page set: one
    /// cooperative launch with each reduction and the two phase launches of
    /// a graph (ordered). `what` has a `{}` for the launch's name; `run`
    /// launches the kernel once.
    fn weight_only_rows(
        timer: &mut Timer<'_>,
        rows: &mut Vec<Row>,
        what: &str,
        bytes: f64,
        dense_us: f64,
        mut run: impl FnMut(Reduction, FfnLaunch) -> Res<()>,
    ) -> Res<()> {
        for (reduction, launch, name) in [
            (Reduction::Atomic, FfnLaunch::Cooperative, "atomic"),
            (Reduction::Ordered, FfnLaunch::Cooperative, "ordered"),
            (
                Reduction::Ordered,
                FfnLaunch::TwoLaunches,
                "ordered, 2 launches",
            ),
        ] {
            let us = timer.median_us(|| run(reduction, launch))?;
            rows.push(Row {
                what: what.replacen("{}", name, 1),
                us,
                bytes,
                extra: format!("{:.2}x", dense_us / us),
            });
        }
        Ok(())
    }

    /// Phase-2 part sizes the fused-variant table sweeps
    /// (`FfnQ8Options::part_ch`; 0: K = grid / n_chunks, the first version).
    const PART_CH: [u32; 3] = [0, 128, 512];

    /// One row of the fused-variant table: a kernel variant at one shape and
    /// active fraction, or (`grid` 0) a dense reference. Times are per layer.
    struct SbRow {
        shape: String,
        what: String,
        grid: u32,
        /// Both phases over an empty list (part_ch 0: the fixed cost),
        /// phase 1 alone, phase 2 alone (at the best part size), us.
        empty: f64,
        p1: f64,
        p2: f64,
        /// Both phases as two launches, one per PART_CH (one entry for a
        /// dense reference).
        both: Vec<f64>,
        bytes: f64,
        /// v0 at part_ch 0 and the backend's dense v2 FFN at this shape, us.
        v0_us: f64,
        dense_us: f64,
    }

    impl SbRow {
        fn best(&self) -> f64 {
            self.both.iter().copied().fold(f64::INFINITY, f64::min)
        }
    }

    /// Median us per layer of `enqueue` (the launches of `layers` layers),
    /// run once to warm up (scratch allocations), then captured into a CUDA
    /// graph and replayed (L2 flushed before each replay): as the backend's
    /// decode graph runs it, without host launch costs.
    fn graph_us(
        dev: &SparseDevice,
        timer: &mut Timer,
        layers: usize,
        mut enqueue: impl FnMut() -> Res<()>,
    ) -> Res<f64> {
        let stream = dev.stream();
        enqueue()?;
        stream.synchronize()?;
        if let Err(e) =
            stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!("kernel-bench: no stream capture ({e}): timing eager launches")
            });
            return Ok(timer.median_us(&mut enqueue)? / layers as f64);
        }
        let launched = enqueue();
        // End the capture whatever happened, so that the stream stays usable.
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        launched?;
        let graph = graph?.ok_or("stream capture returned no graph")?;
        graph.upload()?;
        Ok(timer.median_us(|| Ok(graph.launch()?))? / layers as f64)
    }

    /// (e) µs per node of a replayed graph of `pdl_floor` launches (see the
    /// module docs), and a check that every node ran (the counter it
    /// increments holds one per node executed, eager and replayed runs).
    fn launch_floor(
        dev: &SparseDevice,
        m: &Arc<cudarc::driver::CudaModule>,
        timer: &mut Timer,
    ) -> Res<()> {
        use mirage_cuda::cluster::{launch_ex, LaunchMode};
        const NODES: usize = 64;
        let f = m.load_function("pdl_floor")?;
        let stream = dev.stream().clone();
        let counter = stream.alloc_zeros::<u32>(1)?;
        let pc: u64 = {
            let (p, _sync) = counter.device_ptr(&stream);
            p
        };
        let sms = dev.multiprocessors();
        let mut rows = Vec::new();
        let mut expected = 0u64;
        for grid in [1, sms, 3 * sms, 8 * sms] {
            for pdl in [false, true] {
                let how = LaunchMode {
                    programmatic: pdl,
                    ..LaunchMode::PLAIN
                };
                let us = graph_us(dev, timer, NODES, || {
                    for _ in 0..NODES {
                        let mut params = [&pc as *const u64 as *mut std::ffi::c_void];
                        // SAFETY: pdl_floor takes one pointer, to a live u32.
                        unsafe {
                            launch_ex(&f, &stream, (grid, 1, 1), (256, 1, 1), 0, &mut params, how)
                        }?;
                    }
                    Ok(())
                })?;
                // graph_us runs the launches once eagerly, then the graph
                // warm-up + iters times (the captured pass runs nothing).
                expected += (NODES * (1 + timer.warmup + timer.iters)) as u64;
                rows.push((grid, pdl, us));
            }
        }
        let got = stream.clone_dtoh(&counter)?[0] as u64;
        if got != expected {
            return Err(format!(
                "pdl_floor ran {got} times, {expected} expected: nodes were skipped or raced"
            )
            .into());
        }
        println!();
        println!("launch floor: {NODES} pdl_floor nodes in a replayed graph, 256 threads a block ({got} runs checked)");
        println!("| grid (blocks) | us per node, plain | us per node, PDL |");
        println!("| --- | --- | --- |");
        for pair in rows.chunks(2) {
            println!("| {} | {:.2} | {:.2} |", pair[0].0, pair[0].2, pair[1].2);
        }
        flag_floor(dev, m, timer, NODES)
    }

    /// (e, second table) µs per round of `flag_floor` (dense.cu): `rounds`
    /// handoffs through a counter inside one launch, grid-wide and as a
    /// chain of single blocks, at 1 block and 1 and 2 blocks per SM (every
    /// block resident); a launch of 0 rounds is subtracted. The counters must
    /// be zero after every launch (the kernel's reset).
    fn flag_floor(
        dev: &SparseDevice,
        m: &Arc<cudarc::driver::CudaModule>,
        timer: &mut Timer,
        rounds: usize,
    ) -> Res<()> {
        use mirage_cuda::cluster::{launch_ex, LaunchMode};
        let f = m.load_function("flag_floor")?;
        let stream = dev.stream().clone();
        let counter = stream.alloc_zeros::<u32>(2)?;
        let pc: u64 = {
            let (p, _sync) = counter.device_ptr(&stream);
            p
        };
        let sms = dev.multiprocessors();
        let mut rows = Vec::new();
        for grid in [1, sms, 2 * sms] {
            let mut per = [0f64; 2];
            for chain in [0i32, 1] {
                let mut time = |steps: i32| {
                    graph_us(dev, timer, 1, || {
                        let mut params = [
                            &pc as *const u64 as *mut std::ffi::c_void,
                            &steps as *const i32 as *mut std::ffi::c_void,
                            &chain as *const i32 as *mut std::ffi::c_void,
                        ];
                        // SAFETY: flag_floor takes a pointer to two live u32
                        // and two ints; its grid is at most 2 blocks of 256
                        // threads an SM, all resident (it spins on them).
                        unsafe {
                            launch_ex(
                                &f,
                                &stream,
                                (grid, 1, 1),
                                (256, 1, 1),
                                0,
                                &mut params,
                                LaunchMode::PLAIN,
                            )
                        }?;
                        Ok(())
                    })
                };
                let (full, empty) = (time(rounds as i32)?, time(0)?);
                per[chain as usize] = (full - empty) / rounds as f64;
                let left = stream.clone_dtoh(&counter)?;
                if left != [0, 0] {
                    return Err(
                        format!("flag_floor left its counters at {left:?}, not zero").into(),
                    );
                }
            }
            rows.push((grid, per));
        }
        println!();
        println!("flag floor: {rounds} handoffs through a counter inside one launch, 256 threads a block (counters checked zero after each launch)");
        println!("| grid (blocks) | us per grid-wide round | us per chained handoff |");
        println!("| --- | --- | --- |");
        for (grid, per) in rows {
            println!("| {grid} | {:.2} | {:.2} |", per[0], per[1]);
        }
        Ok(())
    }

    /// (d) the fused Q8_0 FFN variants (`superblock_ffn_q8s_v<n>`) as the
    /// sparse backend runs them (ordered reduction, y = FFN(x), phase 1 then
    /// phase 2 as two launches with the variant's grid) on random pages at
    /// the Qwen2-7B shape (100, 40, 25 % of the pages) and the Qwen2.5-0.5B
    /// shape (100, 50 %), every part size of PART_CH; each phase also timed
    /// alone. A timed run is a CUDA graph of `layers` layers, each with its
    /// own copy of the pages (so a layer's pages are cold when it runs, as
    /// in a decode step), replayed ([`graph_us`]); times are per layer. The reference: the backend's dense
    /// v2 FFN over the same layers (`ffn_q8_0s_v2` + `mv3_q8_0s_v2`, the
    /// best split of 1/2/4/8).
    fn sb_variants(
        dev: &SparseDevice,
        m: &Arc<cudarc::driver::CudaModule>,
        timer: &mut Timer,
        r: &mut Rng,
        only: &[usize],
    ) -> Res<Vec<SbRow>> {
        let stream = dev.stream().clone();
        let mut out = Vec::new();
        let variants: Vec<_> = Q8_FFN_VARIANTS
            .iter()
            .filter(|v| only.contains(&v.index))
            .collect();
        let shapes: [(&str, usize, usize, usize, &[f64]); 2] = [
            ("7B", 3584, 18944, 8, &[1.0, 0.4, 0.25]),
            ("0.5B", 896, 4864, 24, &[1.0, 0.5]),
        ];
        for (name, d, n_ff, layers, fracs) in shapes {
            let n_pages = n_ff / PAGE_CHANNELS;
            let x = stream.clone_htod(&r.f32s(d))?;
            // The backend's dense FFN: gate + up + SwiGLU in one kernel, the
            // down mat-vec, split Q8_0.
            let host = [
                random_split(r, 0, n_ff, d),
                random_split(r, 0, n_ff, d),
                random_split(r, 0, d, n_ff),
            ];
            let bytes = host.iter().map(|w| w.len() as f64).sum::<f64>();
            let mut ws: Vec<[u64; 3]> = Vec::new();
            let mut bufs: Vec<CudaSlice<u8>> = Vec::new();
            for _ in 0..layers {
                for h in &host {
                    bufs.push(stream.clone_htod(h)?);
                }
                let n = bufs.len();
                ws.push([0, 1, 2].map(|i| ptr(dev, &bufs[n - 3 + i])));
            }
            drop(host);
            let h = stream.alloc_zeros::<f32>(n_ff)?;
            let yd = stream.alloc_zeros::<f32>(d)?;
            let (px, ph, py) = (ptr(dev, &x), ptr(dev, &h), ptr(dev, &yd));
            let fg = m.load_function("ffn_q8_0s_v2")?;
            let nr = variant_rows(2);
            let mut dense_v2 = (f64::INFINITY, 1usize);
            for split in [1usize, 2, 4, 8] {
                let fname = if split == 1 {
                    "mv3_q8_0s_v2".to_string()
                } else {
                    format!("mv3_q8_0s_v2_k{split}")
                };
                let fd = m.load_function(&fname)?;
                let us = graph_us(dev, timer, layers, || {
                    for &[pg, pu, pd] in &ws {
                        ffn_launch(dev, &fg, pg, pu, n_ff, d, px, ph, nr)?;
                        mv3_launch(
                            dev,
                            &fd,
                            [pd, 0, 0],
                            [d, 0, 0],
                            n_ff,
                            ph,
                            [py, 0, 0],
                            mv3_tiles([d, 0, 0], nr, split),
                            None,
                        )?;
                    }
                    Ok(())
                })?;
                if us < dense_v2.0 {
                    dense_v2 = (us, split);
                }
            }
            out.push(SbRow {
                shape: format!("{name} dense, {layers} layers"),
                what: format!("dense v2: ffn_q8_0s_v2 + mv3_q8_0s_v2 k{}", dense_v2.1),
                grid: 0,
                empty: f64::NAN,
                p1: f64::NAN,
                p2: f64::NAN,
                both: vec![dense_v2.0],
                bytes,
                v0_us: f64::NAN,
                dense_us: f64::NAN,
            });
            drop(bufs);

            let host_pages = random_q8s_pages(r, d, n_pages);
            let pages: Vec<_> = (0..layers)
                .map(|_| dev.upload_q8s_pages(d, n_pages, &host_pages))
                .collect::<Result<_, _>>()?;
            drop(host_pages);
            let mut active = dev.new_active(&[], n_pages)?;
            let mut scratch = FfnScratch::default();
            let mut y = stream.alloc_zeros::<f32>(d)?;
            // The single-pass variants as the backend runs them with the
            // atomic reduction: one launch (phase 1), y = FFN(x).
            let one_pass = |v: usize| Q8_FFN_VARIANTS[v].single_pass;
            let mut time = |v: usize,
                            active: &ActivePages,
                            part_ch: u32,
                            launch: FfnLaunch,
                            reduction: Reduction|
             -> Res<f64> {
                let opts = FfnQ8Options {
                    variant: Some(v),
                    part_ch,
                    launch,
                    cluster: None,
                };
                graph_us(dev, timer, layers, || {
                    for p in &pages {
                        dev.ffn_q8_with(
                            p,
                            &x,
                            active,
                            reduction,
                            false,
                            opts,
                            &mut scratch,
                            &mut y,
                        )?;
                    }
                    Ok(())
                })
            };
            // A variant's usual launch: two phases, ordered; the single-pass
            // ones one atomic launch.
            let usual = |v: usize| {
                if one_pass(v) {
                    (FfnLaunch::Phase1Only, Reduction::Atomic)
                } else {
                    (FfnLaunch::TwoLaunches, Reduction::Ordered)
                }
            };
            dev.set_active(&mut active, &[])?;
            let empty: Vec<f64> = variants
                .iter()
                .map(|v| {
                    let (launch, red) = usual(v.index);
                    time(v.index, &active, 0, launch, red)
                })
                .collect::<Res<_>>()?;
            for &frac in fracs {
                let k = ((frac * n_pages as f64).round() as usize).clamp(1, n_pages);
                dev.set_active(&mut active, &random_subset(r, n_pages, k))?;
                let shape = format!("{name} {:.0} % ({k}/{n_pages})", frac * 100.0);
                let mut v0_us = f64::NAN;
                for (vi, v) in variants.iter().enumerate() {
                    let mut time = |part_ch: u32, launch: FfnLaunch, red: Reduction| -> Res<f64> {
                        time(v.index, &active, part_ch, launch, red)
                    };
                    let (both, p1, p2, what) = if v.single_pass {
                        // part_ch means nothing here: the columns are the
                        // atomic single launch, the ordered two launches
                        // and the ordered one cooperative launch.
                        let both = vec![
                            time(0, FfnLaunch::Phase1Only, Reduction::Atomic)?,
                            time(0, FfnLaunch::TwoLaunches, Reduction::Ordered)?,
                            time(0, FfnLaunch::Cooperative, Reduction::Ordered)?,
                        ];
                        let p1 = time(0, FfnLaunch::Phase1Only, Reduction::Ordered)?;
                        let p2 = time(0, FfnLaunch::Phase2Only, Reduction::Ordered)?;
                        let what = format!(
                            "v{} (atomic 1 launch / ordered 2 launches / ordered cooperative; p1, p2: ordered)",
                            v.index
                        );
                        (both, p1, p2, what)
                    } else {
                        let both: Vec<f64> = PART_CH
                            .iter()
                            .map(|&pc| time(pc, FfnLaunch::TwoLaunches, Reduction::Ordered))
                            .collect::<Res<_>>()?;
                        let best = (0..PART_CH.len())
                            .min_by(|&a, &b| both[a].total_cmp(&both[b]))
                            .unwrap_or(0);
                        let p1 = time(0, FfnLaunch::Phase1Only, Reduction::Ordered)?;
                        let p2 = time(PART_CH[best], FfnLaunch::Phase2Only, Reduction::Ordered)?;
                        let what = if v.cluster_down {
                            let (g, k) = pages[0].cluster_shape();
                            format!("v{} (p2: {} clusters of {k})", v.index, g / k.max(1))
                        } else {
                            format!("v{}", v.index)
                        };
                        (both, p1, p2, what)
                    };
                    if v.index == 0 {
                        v0_us = both[0];
                    }
                    out.push(SbRow {
                        shape: shape.clone(),
                        what,
                        grid: pages[0].variant_grid(v.index).unwrap_or(0),
                        empty: empty[vi],
                        p1,
                        p2,
                        both,
                        bytes: (k * pages[0].page_bytes()) as f64,
                        v0_us,
                        dense_us: dense_v2.0,
                    });
                }
            }
            let got = dev.download_f32(&y)?;
            if !got.iter().all(|v| v.is_finite()) {
                return Err(format!("fused FFN variants at {name}: non-finite output").into());
            }
        }
        Ok(out)
    }

    /// Prints the table of (d): one row per shape, active fraction and
    /// variant, the dense references first.
    fn print_sb_variants(rows: &[SbRow], copy_gbs: f64) {
        println!();
        println!(
            "== sparse FFN variants (superblock_ffn_q8s_v<n>): us per layer, CUDA graphs of several \
             layers (each its own pages, cold) replayed; ordered, phase 1 then phase 2 as two launches (the \
             sparse backend's graph); empty: both over no page; p1 / p2: that phase alone (p2 at the \
             best part_ch); part_ch: least channels per phase-2 part (0: K = grid / n_chunks); \
             GB/s of the page bytes read at the best part_ch; copy ceiling {copy_gbs:.0} GB/s"
        );
        let about: Vec<String> = Q8_FFN_VARIANTS
            .iter()
            .map(|v| format!("v{}: {}", v.index, v.about))
            .collect();
        println!("{}", about.join("; "));
        let pcs: Vec<String> = PART_CH.iter().map(|p| p.to_string()).collect();
        println!(
            "| shape, active pages | kernel | grid | empty us | p1 us | p2 us | p1+p2 us, part_ch {} | GB/s | % of copy | vs v0 | vs dense v2 |",
            pcs.join(" / ")
        );
        println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
        for row in rows {
            let best = row.best();
            let gbs = row.bytes / best / 1e3;
            let both: Vec<String> = row.both.iter().map(|u| format!("{u:.1}")).collect();
            let dash = || "-".to_string();
            let (grid, times, v0, dv2) = if row.grid == 0 {
                (dash(), "- | - | -".to_string(), dash(), dash())
            } else {
                (
                    row.grid.to_string(),
                    format!("{:.1} | {:.1} | {:.1}", row.empty, row.p1, row.p2),
                    // v0 left out by --sparse-variants: no base.
                    if row.v0_us.is_nan() {
                        dash()
                    } else {
                        format!("{:.2}x", row.v0_us / best)
                    },
                    format!("{:.2}x", row.dense_us / best),
                )
            };
            println!(
                "| {} | {} | {grid} | {times} | {} | {gbs:.0} | {:.0} % | {v0} | {dv2} |",
                row.shape,
                row.what,
                both.join(" / "),
                100.0 * gbs / copy_gbs,
            );
        }
    }

    pub fn run() -> Res<()> {
        let args: Vec<String> = std::env::args().collect();
        let iters = args
            .iter()
            .position(|a| a == "--iters")
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(30usize);
        // --sparse-variants: the fused-FFN variants to time (all if absent).
        let only: Vec<usize> = match args.iter().position(|a| a == "--sparse-variants") {
            None => (0..Q8_FFN_VARIANTS.len()).collect(),
            Some(i) => {
                let list = args
                    .get(i + 1)
                    .ok_or("--sparse-variants needs a list, e.g. 0,3,10")?;
                list.split(',')
                    .map(|v| match v.trim().parse::<usize>() {
                        Ok(n) if n < Q8_FFN_VARIANTS.len() => Ok(n),
                        _ => Err(format!(
                            "--sparse-variants: {v:?} is not a variant (0..{})",
                            Q8_FFN_VARIANTS.len() - 1
                        )),
                    })
                    .collect::<Result<_, _>>()?
            }
        };
        let dev = SparseDevice::new(0)?;
        let ctx: &Arc<_> = dev.context();
        let cc = ctx.compute_capability()?;
        let (ptx, _) = module::ptx_for("dense", module::DENSE_SOURCE, cc.0, cc.1)?;
        let m = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))?;
        let dense = Dense {
            matvec_q8_0: m.load_function("matvec_q8_0")?,
            matvec_q4_k: m.load_function("matvec_q4_k")?,
            swiglu: m.load_function("swiglu")?,
        };
        println!(
            "device: {} ({} SMs, sm_{}{}); iters {iters} (median), L2 flushed before each run",
            dev.device_name(),
            dev.multiprocessors(),
            cc.0,
            cc.1
        );
        let stream = dev.stream().clone();
        let mut timer = Timer {
            dev: &dev,
            flush: stream.alloc_zeros::<u8>(256 << 20)?,
            warmup: 3,
            iters,
        };
        let mut r = Rng(0x9e37_79b9_7f4a_7c15);

        // Ceiling: device-to-device copy of 1 GiB (bytes read + written).
        let copy_bytes = 1usize << 30;
        let src = stream.clone_htod(&r.bytes(copy_bytes))?;
        let mut dst = stream.alloc_zeros::<u8>(copy_bytes)?;
        let copy_us = timer.median_us(|| Ok(stream.memcpy_dtod(&src, &mut dst)?))?;
        drop((src, dst));
        let copy_gbs = 2.0 * copy_bytes as f64 / copy_us / 1e3;
        println!("copy: 1 GiB dtod {copy_us:.1} us = {copy_gbs:.0} GB/s (read + write)");

        if args.iter().any(|a| a == "--launch-floor") {
            return launch_floor(&dev, &m, &mut timer);
        }
        if args.iter().any(|a| a == "--sparse") {
            let rows = sb_variants(&dev, &m, &mut timer, &mut r, &only)?;
            print_sb_variants(&rows, copy_gbs);
            return Ok(());
        }
        if args.iter().any(|a| a == "--variants") {
            let rows = variants(&dev, &m, &mut timer, &mut r)?;
            println!();
            println!("copy ceiling: {copy_gbs:.0} GB/s (1 GiB dtod, read + write, same run)");
            println!("| mat-vec variant (7B shape) | us | MB read | GB/s | % of copy | rel err vs v1 k1 |");
            println!("| --- | --- | --- | --- | --- | --- |");
            for row in &rows {
                let gbs = row.bytes / row.us / 1e3;
                println!(
                    "| {} | {:.1} | {:.1} | {:.0} | {:.0} % | {} |",
                    row.what,
                    row.us,
                    row.bytes / 1e6,
                    gbs,
                    100.0 * gbs / copy_gbs,
                    row.extra
                );
            }
            // Short summary: the best (variant, split) per shape.
            println!();
            println!("| best per shape | us | GB/s | % of copy | v1 k1 us | speed-up vs v1 k1 |");
            println!("| --- | --- | --- | --- | --- | --- |");
            let shape_of = |w: &str| w.split(" v").next().unwrap_or(w).to_string();
            let mut shapes: Vec<String> = rows.iter().map(|r| shape_of(&r.what)).collect();
            shapes.dedup();
            for sh in shapes {
                let of: Vec<&Row> = rows.iter().filter(|r| shape_of(&r.what) == sh).collect();
                let best = of.iter().min_by(|a, b| a.us.total_cmp(&b.us)).unwrap();
                let gbs = best.bytes / best.us / 1e3;
                println!(
                    "| {} | {:.1} | {:.0} | {:.0} % | {:.1} | {:.2}x |",
                    best.what,
                    best.us,
                    gbs,
                    100.0 * gbs / copy_gbs,
                    of[0].us,
                    of[0].us / best.us
                );
            }
            return Ok(());
        }

        // (a) mat-vecs.
        let shapes = [
            (4096usize, 4096usize),
            (14336, 4096),
            (4096, 14336),
            (18944, 3584),
            (152064, 3584),
        ];
        let mut mv: Vec<Row> = Vec::new();
        for &(rows, cols) in &shapes {
            let x = stream.clone_htod(&r.f32s(cols))?;
            let mut y = stream.alloc_zeros::<f32>(rows)?;
            let io = (cols + rows) as f64 * 4.0;
            {
                let q8 = random_q8_0(&mut r, rows, cols);
                let rb = cols / 32 * 34;
                let dq8 = stream.clone_htod(&q8)?;
                let us = timer.median_us(|| {
                    dense_matvec(&dev, &dense.matvec_q8_0, &dq8, rb, rows, cols, &x, &mut y)
                })?;
                mv.push(Row {
                    what: format!("{rows}x{cols} Q8_0 dense.cu"),
                    us,
                    bytes: q8.len() as f64 + io,
                    extra: String::new(),
                });
                drop(dq8);
                let ds = dev.upload_q8s(&q8, rows, cols)?;
                let us = timer.median_us(|| Ok(dev.matvec_q8s(&ds, &x, &mut y)?))?;
                mv.push(Row {
                    what: format!("{rows}x{cols} Q8_0 split (q8s)"),
                    us,
                    bytes: ds.bytes() as f64 + io,
                    extra: String::new(),
                });
            }
            {
                let q4 = random_q4_k(&mut r, rows, cols);
                let dq4 = stream.clone_htod(&q4)?;
                let rb = cols / 256 * 144;
                let us = timer.median_us(|| {
                    dense_matvec(&dev, &dense.matvec_q4_k, &dq4, rb, rows, cols, &x, &mut y)
                })?;
                mv.push(Row {
                    what: format!("{rows}x{cols} Q4_K dense.cu"),
                    us,
                    bytes: q4.len() as f64 + io,
                    extra: String::new(),
                });
            }
            {
                let t = random_nvfp4(&mut r, rows, cols);
                let dn = dev.upload_nvfp4(&t)?;
                let us = timer.median_us(|| Ok(dev.matvec_nvfp4(&dn, &x, &mut y)?))?;
                mv.push(Row {
                    what: format!("{rows}x{cols} NVFP4"),
                    us,
                    bytes: dn.bytes() as f64 + io,
                    extra: String::new(),
                });
            }
        }

        // (b) Qwen2-7B FFN, Q8_0.
        let (d, n_ff) = (3584usize, 18944usize);
        let n_pages = n_ff / PAGE_CHANNELS;
        let x = stream.clone_htod(&r.f32s(d))?;
        let mut ffn: Vec<Row> = Vec::new();
        let dense_us;
        {
            let g = random_q8_0(&mut r, n_ff, d);
            let u = random_q8_0(&mut r, n_ff, d);
            let dn = random_q8_0(&mut r, d, n_ff);
            let bytes = (g.len() + u.len() + dn.len()) as f64;
            dense_us = dense_ffn_us(
                &dev,
                &mut timer,
                &dense.matvec_q8_0,
                &dense.swiglu,
                [&g, &u, &dn],
                [d / 32 * 34, n_ff / 32 * 34],
                d,
                n_ff,
                &x,
            )?;
            ffn.push(Row {
                what: "dense: 3 x matvec_q8_0 (dense.cu) + swiglu".into(),
                us: dense_us,
                bytes,
                extra: String::new(),
            });
            let mut bg = stream.alloc_zeros::<f32>(n_ff)?;
            let mut bu = stream.alloc_zeros::<f32>(n_ff)?;
            let mut bh = stream.alloc_zeros::<f32>(n_ff)?;
            let mut y = stream.alloc_zeros::<f32>(d)?;
            let sg = dev.upload_q8s(&g, n_ff, d)?;
            let su = dev.upload_q8s(&u, n_ff, d)?;
            let sd = dev.upload_q8s(&dn, d, n_ff)?;
            let us = timer.median_us(|| {
                dev.matvec_q8s(&sg, &x, &mut bg)?;
                dev.matvec_q8s(&su, &x, &mut bu)?;
                swiglu(&dev, &dense.swiglu, &bg, &bu, &mut bh, n_ff)?;
                Ok(dev.matvec_q8s(&sd, &bh, &mut y)?)
            })?;
            ffn.push(Row {
                what: "dense: 3 x matvec_q8s + swiglu".into(),
                us,
                bytes,
                extra: String::new(),
            });
        }
        {
            // The same FFN in Q4_K (dense.cu) and NVFP4 (matvec_nvfp4).
            let g = random_q4_k(&mut r, n_ff, d);
            let u = random_q4_k(&mut r, n_ff, d);
            let dn = random_q4_k(&mut r, d, n_ff);
            let bytes = (g.len() + u.len() + dn.len()) as f64;
            let us = dense_ffn_us(
                &dev,
                &mut timer,
                &dense.matvec_q4_k,
                &dense.swiglu,
                [&g, &u, &dn],
                [d / 256 * 144, n_ff / 256 * 144],
                d,
                n_ff,
                &x,
            )?;
            ffn.push(Row {
                what: "dense: 3 x matvec_q4_k (dense.cu) + swiglu".into(),
                us,
                bytes,
                extra: String::new(),
            });
            let mut bg = stream.alloc_zeros::<f32>(n_ff)?;
            let mut bu = stream.alloc_zeros::<f32>(n_ff)?;
            let mut bh = stream.alloc_zeros::<f32>(n_ff)?;
            let mut y = stream.alloc_zeros::<f32>(d)?;
            let ng = dev.upload_nvfp4(&random_nvfp4(&mut r, n_ff, d))?;
            let nu = dev.upload_nvfp4(&random_nvfp4(&mut r, n_ff, d))?;
            let nd = dev.upload_nvfp4(&random_nvfp4(&mut r, d, n_ff))?;
            let bytes = (ng.bytes() + nu.bytes() + nd.bytes()) as f64;
            let us = timer.median_us(|| {
                dev.matvec_nvfp4(&ng, &x, &mut bg)?;
                dev.matvec_nvfp4(&nu, &x, &mut bu)?;
                swiglu(&dev, &dense.swiglu, &bg, &bu, &mut bh, n_ff)?;
                Ok(dev.matvec_nvfp4(&nd, &bh, &mut y)?)
            })?;
            ffn.push(Row {
                what: "dense: 3 x matvec_nvfp4 + swiglu".into(),
                us,
                bytes,
                extra: String::new(),
            });
        }
        let pages = dev.upload_q8s_pages(d, n_pages, &random_q8s_pages(&mut r, d, n_pages))?;
        let nv_pages = dev.upload_nvfp4_pages(&random_nvfp4_pages(&mut r, d, n_ff)?)?;
        println!(
            "ffn: d {d}, n_ff {n_ff}, {n_pages} pages; Q8_0 pages {} bytes, fused grid {} blocks; \
             NVFP4 pages {} bytes, fused grid {} blocks",
            pages.page_bytes(),
            pages.grid(),
            nv_pages.page_bytes(),
            nv_pages.grid()
        );
        // Q2_K: the dense FFN (dense.cu's ggml-block mat-vecs) and pages for
        // the fused kernel (rows below, 100/40/25 %).
        let q2_pages = dev.upload_q2k_pages(&random_q2k_pages(&mut r, d, n_ff)?)?;
        println!(
            "ffn: Q2_K pages {} bytes, fused grid {} blocks",
            q2_pages.page_bytes(),
            q2_pages.grid()
        );
        {
            let w = [
                random_q2_k(&mut r, n_ff, d),
                random_q2_k(&mut r, n_ff, d),
                random_q2_k(&mut r, d, n_ff),
            ];
            let mv = m.load_function("matvec_q2_k")?;
            let us = dense_ffn_us(
                &dev,
                &mut timer,
                &mv,
                &dense.swiglu,
                [&w[0], &w[1], &w[2]],
                [d / 256 * 84, n_ff / 256 * 84],
                d,
                n_ff,
                &x,
            )?;
            ffn.push(Row {
                what: "dense: 3 x matvec_q2_k (dense.cu) + swiglu".into(),
                us,
                bytes: w.iter().map(|v| v.len()).sum::<usize>() as f64,
                extra: String::new(),
            });
        }
        let mut active = dev.new_active(&[], n_pages)?;
        let mut scratch = FfnScratch::default();
        let mut y = stream.alloc_zeros::<f32>(d)?;
        for &frac in &[1.0f64, 0.75, 0.5, 0.4, 0.35, 0.25] {
            let k = ((frac * n_pages as f64).round() as usize).clamp(1, n_pages);
            let ids = random_subset(&mut r, n_pages, k);
            dev.set_active(&mut active, &ids)?;
            let bytes = (k * pages.page_bytes()) as f64;
            for (reduction, name) in [
                (Reduction::Atomic, "atomic"),
                (Reduction::Ordered, "ordered"),
            ] {
                let us = timer.median_us(|| {
                    Ok(dev.ffn_q8(
                        &pages,
                        &x,
                        &active,
                        reduction,
                        reduction == Reduction::Atomic,
                        &mut scratch,
                        &mut y,
                    )?)
                })?;
                ffn.push(Row {
                    what: format!(
                        "fused Q8_0 {name}, {k}/{n_pages} pages ({:.0} %)",
                        frac * 100.0
                    ),
                    us,
                    bytes,
                    extra: format!("{:.2}x", dense_us / us),
                });
            }
            // The same pages in NVFP4, and in Q2_K at 100, 40 and 25 %.
            let pct = frac * 100.0;
            let bytes = (k * nv_pages.page_bytes()) as f64;
            weight_only_rows(
                &mut timer,
                &mut ffn,
                &format!("fused NVFP4 {{}}, {k}/{n_pages} pages ({pct:.0} %)"),
                bytes,
                dense_us,
                |reduction, launch| {
                    Ok(dev.ffn_nvfp4(
                        &nv_pages,
                        &x,
                        &active,
                        reduction,
                        reduction == Reduction::Atomic,
                        launch,
                        &mut scratch,
                        &mut y,
                    )?)
                },
            )?;
            if [1.0, 0.4, 0.25].contains(&frac) {
                let bytes = (k * q2_pages.page_bytes()) as f64;
                weight_only_rows(
                    &mut timer,
                    &mut ffn,
                    &format!("fused Q2_K {{}}, {k}/{n_pages} pages ({pct:.0} %)"),
                    bytes,
                    dense_us,
                    |reduction, launch| {
                        Ok(dev.ffn_q2k(
                            &q2_pages,
                            &x,
                            &active,
                            reduction,
                            reduction == Reduction::Atomic,
                            launch,
                            &mut scratch,
                            &mut y,
                        )?)
                    },
                )?;
            }
        }
        let out = dev.download_f32(&y)?;
        if !out.iter().all(|v| v.is_finite()) {
            return Err("fused FFN produced a non-finite output".into());
        }
        drop(q2_pages);
        drop((pages, nv_pages, active, scratch, y));
        let sb_rows = sb_variants(&dev, &m, &mut timer, &mut r, &only)?;

        println!();
        println!("copy ceiling: {copy_gbs:.0} GB/s (1 GiB dtod, read + write, same run)");
        println!("| mat-vec (rows x cols, type) | us | MB read | GB/s | % of copy |");
        println!("| --- | --- | --- | --- | --- |");
        for row in &mv {
            let gbs = row.bytes / row.us / 1e3;
            println!(
                "| {} | {:.1} | {:.1} | {:.0} | {:.0} % |",
                row.what,
                row.us,
                row.bytes / 1e6,
                gbs,
                100.0 * gbs / copy_gbs
            );
        }
        println!();
        println!(
            "| FFN d 3584, n_ff 18944 | us | MB read | GB/s | % of copy | speed-up vs dense Q8_0 (dense.cu) |"
        );
        println!("| --- | --- | --- | --- | --- | --- |");
        for row in &ffn {
            let gbs = row.bytes / row.us / 1e3;
            let speed = if row.extra.is_empty() {
                format!("{:.2}x", dense_us / row.us)
            } else {
                row.extra.clone()
            };
            println!(
                "| {} | {:.1} | {:.1} | {:.0} | {:.0} % | {} |",
                row.what,
                row.us,
                row.bytes / 1e6,
                gbs,
                100.0 * gbs / copy_gbs,
                speed
            );
        }
        print_sb_variants(&sb_rows, copy_gbs);
        Ok(())
    }
}
