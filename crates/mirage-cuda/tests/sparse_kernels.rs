//! The sparse-path kernels (NVFP4 and split-Q8_0 mat-vecs, the fused
//! superblock FFN) against f64 references computed here on the dequantized
//! weights. Without a GPU each device test prints why it skips and passes;
//! with MIRAGE_REQUIRE_CUDA_TESTS=1 a missing GPU fails them.
// The f64 references serve only the device tests.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use mirage_cuda::superblock::{nvfp4_page_bytes, split_q8_0_page, Nvfp4Pages, PAGE_CHANNELS};
use mirage_gguf::quant::nvfp4::{e2m1_to_f32, e4m3_to_f32};
use mirage_gguf::quant::Nvfp4Tensor;
use mirage_gguf::{quant, GgmlType};
use rand::{Rng, SeedableRng};

fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// The page lists the fused-FFN tests run: every page; a random subset in
/// reverse order with a repeated page, plus two ids past the end that the
/// kernel must skip (`ids` holds them, the reference set does not); none.
/// Each entry is (name, reference pages, device ids).
fn page_sets(r: &mut impl Rng, n_pages: usize) -> [(&'static str, Vec<usize>, Vec<u32>); 3] {
    let all: Vec<usize> = (0..n_pages).collect();
    let mut subset: Vec<usize> = (0..n_pages).filter(|_| r.random_bool(0.5)).collect();
    if subset.is_empty() {
        subset.push(n_pages - 1);
    }
    subset.reverse();
    subset.push(subset[0]);
    let mut ids: Vec<u32> = subset.iter().map(|&p| p as u32).collect();
    ids.insert(ids.len() / 2, n_pages as u32 + 1000);
    ids.insert(0, n_pages as u32);
    let all_ids = all.iter().map(|&p| p as u32).collect();
    [
        ("all", all, all_ids),
        ("subset", subset, ids),
        ("empty", Vec::new(), Vec::new()),
    ]
}

fn uniform(r: &mut impl Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| r.random_range(-1.0f32..1.0) * scale)
        .collect()
}

fn q8_rows(values: &[f32], cols: usize) -> Vec<u8> {
    let rb = quant::row_bytes(GgmlType::Q8_0, cols).unwrap();
    let rows = values.len() / cols;
    let mut out = vec![0u8; rows * rb];
    for r in 0..rows {
        quant::quantize(
            GgmlType::Q8_0,
            &values[r * cols..(r + 1) * cols],
            &mut out[r * rb..(r + 1) * rb],
        )
        .unwrap();
    }
    out
}

fn dequant_q8(bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    quant::dequantize(GgmlType::Q8_0, bytes, &mut out).unwrap();
    out
}

/// One FFN as artifact pages (`pack_page` layout, Q8_0) plus its
/// dequantized weights: gate and up `[n_ff][d]`, down_t `[n_ff][d]`
/// (row c = column c of W_down).
struct PagedFfn {
    d: usize,
    pages: Vec<Vec<u8>>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down_t: Vec<f32>,
}

fn paged_ffn(r: &mut impl Rng, d: usize, n_pages: usize) -> PagedFfn {
    let n_ff = n_pages * PAGE_CHANNELS;
    let s = 1.0 / (d as f32).sqrt();
    let mats: Vec<Vec<u8>> = (0..3)
        .map(|_| q8_rows(&uniform(r, n_ff * d, 2.0 * s), d))
        .collect();
    let rb = quant::row_bytes(GgmlType::Q8_0, d).unwrap();
    let pages = (0..n_pages)
        .map(|p| {
            let span = p * PAGE_CHANNELS * rb..(p + 1) * PAGE_CHANNELS * rb;
            [
                &mats[0][span.clone()],
                &mats[1][span.clone()],
                &mats[2][span],
            ]
            .concat()
        })
        .collect();
    PagedFfn {
        d,
        pages,
        gate: dequant_q8(&mats[0], n_ff * d),
        up: dequant_q8(&mats[1], n_ff * d),
        down_t: dequant_q8(&mats[2], n_ff * d),
    }
}

/// f64 FFN output over the channels of `pages` (any order, repeats count).
fn reference_ffn(f: &PagedFfn, x: &[f32], pages: &[usize]) -> Vec<f64> {
    let d = f.d;
    let mut y = vec![0f64; d];
    for &p in pages {
        for c in p * PAGE_CHANNELS..(p + 1) * PAGE_CHANNELS {
            let dot = |w: &[f32]| -> f64 {
                w[c * d..(c + 1) * d]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum()
            };
            let (g, u) = (dot(&f.gate), dot(&f.up));
            let h = g / (1.0 + (-g).exp()) * u;
            for (yj, w) in y.iter_mut().zip(&f.down_t[c * d..(c + 1) * d]) {
                *yj += h * *w as f64;
            }
        }
    }
    y
}

/// The fused-FFN tests' bound on one page set: the ordered result against
/// the reference, and the atomic and ordered results accumulated onto a
/// residual against reference + residual, each under 1e-5 relative error.
/// Returns the three errors (ordered, atomic + residual, ordered + residual).
fn check_ffn_errors(
    tag: &str,
    ordered: &[f32],
    atomic: &[f32],
    ordered_acc: &[f32],
    want: &[f64],
    want_acc: &[f64],
) -> [f64; 3] {
    let e = rel_err(ordered, want);
    let ea = rel_err(atomic, want_acc);
    let eo = rel_err(ordered_acc, want_acc);
    assert!(e < 1e-5, "{tag}: ordered relative error {e}");
    assert!(ea < 1e-5, "{tag}: atomic relative error {ea}");
    assert!(
        eo < 1e-5,
        "{tag}: ordered onto a residual: relative error {eo}"
    );
    [e, ea, eo]
}

/// The outputs over an empty page list: ordered from scratch zero, atomic
/// and ordered onto the residual the residual unchanged.
fn check_empty_list(
    tag: &str,
    ordered: &[f32],
    atomic: &[f32],
    ordered_acc: &[f32],
    residual: &[f32],
) {
    assert!(
        ordered.iter().all(|v| *v == 0.0),
        "{tag}: ordered, no pages, not zero"
    );
    assert_eq!(atomic, residual, "{tag}: atomic, no pages, changed y");
    assert_eq!(ordered_acc, residual, "{tag}: ordered, no pages, changed y");
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - b).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| b.powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

fn cosine(got: &[f32], want: &[f64]) -> f64 {
    let dot: f64 = got.iter().zip(want).map(|(a, b)| *a as f64 * b).sum();
    let na: f64 = got.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = want.iter().map(|b| b.powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn split_q8_0_page_keeps_every_weight() {
    let mut r = rng(11);
    let d = 96;
    let f = paged_ffn(&mut r, d, 2);
    let q = PAGE_CHANNELS * d;
    let s = PAGE_CHANNELS * d / 32 * 2;
    for (p, page) in f.pages.iter().enumerate() {
        let split = split_q8_0_page(page, d).unwrap();
        assert_eq!(split.len(), page.len());
        for (k, m) in [&f.gate, &f.up, &f.down_t].into_iter().enumerate() {
            for i in 0..q {
                let quant = split[k * q + i] as i8 as f32;
                let b = i / 32;
                let at = 3 * q + k * s + 2 * b;
                let scale = half::f16::from_le_bytes([split[at], split[at + 1]]).to_f32();
                let want = m[p * q + i];
                assert_eq!(quant * scale, want, "page {p} matrix {k} weight {i}");
            }
        }
    }
    assert!(split_q8_0_page(&f.pages[0][1..], d).is_err());
    assert!(split_q8_0_page(&f.pages[0], d + 32).is_err());
}

/// `n` values in (-1, 1) * scale, each 16-element block further scaled by
/// one of four factors (a spread of E4M3 block scales within a matrix).
fn blocky(r: &mut impl Rng, n: usize, scale: f32) -> Vec<f32> {
    let mut v = uniform(r, n, scale);
    for (i, x) in v.iter_mut().enumerate() {
        *x *= [1.0, 0.1, 3.0, 0.01][(i / 16 + i / 96) % 4];
    }
    v
}

/// `rows x cols` row-major to `cols x rows`.
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; m.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = m[r * cols + c];
        }
    }
    t
}

/// Decodes weight `i` of row `row` of matrix `k` (0 gate, 1 up, 2 down_t)
/// straight from a page's bytes, by the layout documented in
/// cuda/superblock.cu (not through the packer's own decoder).
fn nvfp4_page_weight(page: &[u8], d: usize, ts: [f32; 3], k: usize, row: usize, i: usize) -> f32 {
    let (mat, smat) = (PAGE_CHANNELS * d / 2, PAGE_CHANNELS * d / 16);
    let byte = page[k * mat + row * d / 2 + i / 2];
    let code = if i % 2 == 0 { byte & 15 } else { byte >> 4 };
    let scale = page[3 * mat + k * smat + row * d / 16 + i / 16];
    e2m1_to_f32(code) * (e4m3_to_f32(scale) * ts[k])
}

#[test]
fn nvfp4_pages_dequantize_to_the_codecs_rows() {
    let mut r = rng(13);
    // d a multiple of 32 but not of 128; n_ff not a multiple of 128 (the
    // last page is padded), a multiple of 32 so W_down can be Q8_0.
    let (d, n_ff) = (96usize, 288usize);
    let s = 1.0 / (d as f32).sqrt();
    let gate = blocky(&mut r, n_ff * d, s);
    let up = blocky(&mut r, n_ff * d, s);
    let down = blocky(&mut r, d * n_ff, s); // W_down: d rows of n_ff
    let gate_q8 = q8_rows(&gate, d);
    let down_q8 = q8_rows(&down, n_ff);
    let up_bytes: Vec<u8> = up.iter().flat_map(|v| v.to_le_bytes()).collect();
    let pages = Nvfp4Pages::from_gguf_parts(
        d,
        n_ff,
        (GgmlType::Q8_0, &gate_q8),
        (GgmlType::F32, &up_bytes),
        (GgmlType::Q8_0, &down_q8),
        3,
    )
    .unwrap();
    assert_eq!(pages.n_pages(), 3);
    assert_eq!(pages.bytes().len(), 3 * nvfp4_page_bytes(d));
    assert_eq!(nvfp4_page_bytes(d), 216 * d);

    // What the codec gives for the same matrices: gate and up requantized
    // as they are, down dequantized, transposed and quantized.
    let dims = [d as u64, n_ff as u64];
    let tg = Nvfp4Tensor::requantize(GgmlType::Q8_0, &gate_q8, &dims).unwrap();
    let tu = Nvfp4Tensor::requantize(GgmlType::F32, &up_bytes, &dims).unwrap();
    let down_t = transpose(&dequant_q8(&down_q8, d * n_ff), d, n_ff);
    let td = Nvfp4Tensor::quantize(&down_t, &dims).unwrap();
    let t_down =
        Nvfp4Tensor::requantize(GgmlType::Q8_0, &down_q8, &[n_ff as u64, d as u64]).unwrap();
    let ts = pages.tensor_scales();
    assert_eq!(
        ts.map(f32::to_bits),
        [tg.tensor_scale, tu.tensor_scale, td.tensor_scale].map(f32::to_bits)
    );
    // The down tensor scale is that of requantizing W_down itself.
    assert_eq!(ts[2].to_bits(), t_down.tensor_scale.to_bits());
    let want = [
        tg.dequantize().unwrap(),
        tu.dequantize().unwrap(),
        td.dequantize().unwrap(),
    ];
    for p in 0..pages.n_pages() {
        let page = pages.page(p);
        let decoded = pages.dequantize_page(p).unwrap();
        for (k, w) in want.iter().enumerate() {
            for row in 0..PAGE_CHANNELS {
                let c = p * PAGE_CHANNELS + row;
                for i in 0..d {
                    let got = nvfp4_page_weight(page, d, ts, k, row, i);
                    let exp = if c < n_ff { w[c * d + i] } else { 0.0 };
                    assert_eq!(
                        got.to_bits(),
                        exp.to_bits(),
                        "page {p} matrix {k} row {row} weight {i}"
                    );
                    assert_eq!(decoded[k][row * d + i].to_bits(), exp.to_bits());
                }
            }
        }
    }
    // From f32: the same as quantizing the three matrices with the codec.
    let from_f32 = Nvfp4Pages::from_f32(d, &gate, &up, &down_t).unwrap();
    let again = Nvfp4Pages::from_tensors(
        &Nvfp4Tensor::quantize(&gate, &dims).unwrap(),
        &Nvfp4Tensor::quantize(&up, &dims).unwrap(),
        &Nvfp4Tensor::quantize(&down_t, &dims).unwrap(),
    )
    .unwrap();
    assert_eq!(from_f32, again);
    // Row lengths the kernel cannot take, and mismatched shapes.
    let g48 = blocky(&mut r, 128 * 48, 1.0);
    assert!(Nvfp4Pages::from_f32(48, &g48, &g48, &g48).is_err());
    assert!(Nvfp4Pages::from_f32(d, &gate, &up, &down_t[d..]).is_err());
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use mirage_cuda::superblock::{
        ActivePages, FfnLaunch, FfnScratch, Reduction, SparseDevice, SparseError,
    };
    use mirage_cuda::CudaError;
    use mirage_gguf::quant::Nvfp4Tensor;

    pub(super) fn device(test: &str) -> Option<SparseDevice> {
        let require = std::env::var("MIRAGE_REQUIRE_CUDA_TESTS").is_ok_and(|v| v == "1");
        match SparseDevice::new(0) {
            Ok(d) => Some(d),
            Err(SparseError::Cuda(
                e @ (CudaError::NotCompiledWithCuda
                | CudaError::DriverNotFound
                | CudaError::NoDevice { .. }),
            )) if !require => {
                eprintln!("{test}: skipped, no CUDA device here: {e}");
                None
            }
            Err(e) => {
                panic!("{test}: CUDA device expected but the sparse kernels failed to start: {e}")
            }
        }
    }

    #[test]
    fn nvfp4_matvec_matches_f64_reference() {
        let Some(dev) = device("nvfp4_matvec_matches_f64_reference") else {
            return;
        };
        let mut r = rng(21);
        // Odd row counts (partial row groups and blocks), column counts that
        // are not multiples of the 256-element warp chunk.
        for &(rows, cols) in &[
            (1usize, 16usize),
            (7, 48),
            (33, 272),
            (130, 4112),
            (517, 3584),
        ] {
            let mut values = uniform(&mut r, rows * cols, 1.0);
            // A wide dynamic range across blocks exercises the E4M3 scales
            // (subnormal ones included).
            for (i, v) in values.iter_mut().enumerate() {
                *v *= [1.0, 1e-3, 30.0, 1e-5][(i / 16) % 4];
            }
            let t = Nvfp4Tensor::quantize(&values, &[cols as u64, rows as u64]).unwrap();
            let w = t.dequantize().unwrap();
            let x = uniform(&mut r, cols, 1.0);
            let want: Vec<f64> = (0..rows)
                .map(|o| {
                    (0..cols)
                        .map(|i| w[o * cols + i] as f64 * x[i] as f64)
                        .sum()
                })
                .collect();
            let dm = dev.upload_nvfp4(&t).unwrap();
            let dx = dev.upload_f32(&x).unwrap();
            let mut dy = dev.upload_f32(&vec![f32::NAN; rows]).unwrap();
            dev.matvec_nvfp4(&dm, &dx, &mut dy).unwrap();
            let got = dev.download_f32(&dy).unwrap();
            let e = rel_err(&got, &want);
            eprintln!("nvfp4 {rows}x{cols}: relative error {e:.3e}");
            assert!(e < 1e-5, "nvfp4 {rows}x{cols}: relative error {e}");
        }
    }

    #[test]
    fn q8s_matvec_matches_f64_reference() {
        let Some(dev) = device("q8s_matvec_matches_f64_reference") else {
            return;
        };
        let mut r = rng(22);
        for &(rows, cols) in &[(1usize, 32usize), (9, 160), (67, 896), (301, 3584)] {
            let bytes = q8_rows(&uniform(&mut r, rows * cols, 1.0), cols);
            let w = dequant_q8(&bytes, rows * cols);
            let x = uniform(&mut r, cols, 1.0);
            let want: Vec<f64> = (0..rows)
                .map(|o| {
                    (0..cols)
                        .map(|i| w[o * cols + i] as f64 * x[i] as f64)
                        .sum()
                })
                .collect();
            let dm = dev.upload_q8s(&bytes, rows, cols).unwrap();
            let dx = dev.upload_f32(&x).unwrap();
            let mut dy = dev.upload_f32(&vec![f32::NAN; rows]).unwrap();
            dev.matvec_q8s(&dm, &dx, &mut dy).unwrap();
            let got = dev.download_f32(&dy).unwrap();
            let e = rel_err(&got, &want);
            eprintln!("q8s {rows}x{cols}: relative error {e:.3e}");
            assert!(e < 1e-5, "q8s {rows}x{cols}: relative error {e}");
        }
    }

    fn run_ffn(
        dev: &SparseDevice,
        f: &PagedFfn,
        x: &[f32],
        ids: &[u32],
        reduction: Reduction,
        y0: &[f32],
        accumulate: bool,
    ) -> Vec<f32> {
        let pages: Vec<&[u8]> = f.pages.iter().map(|p| p.as_slice()).collect();
        let dp = dev.upload_q8_0_pages(f.d, &pages).unwrap();
        let active = dev.new_active(ids, ids.len().max(4)).unwrap();
        let dx = dev.upload_f32(x).unwrap();
        let mut dy = dev.upload_f32(y0).unwrap();
        let mut scratch = FfnScratch::default();
        dev.ffn_q8(
            &dp,
            &dx,
            &active,
            reduction,
            accumulate,
            &mut scratch,
            &mut dy,
        )
        .unwrap();
        dev.download_f32(&dy).unwrap()
    }

    #[test]
    fn fused_ffn_all_pages_equals_dense_ffn() {
        let Some(dev) = device("fused_ffn_all_pages_equals_dense_ffn") else {
            return;
        };
        let mut r = rng(31);
        // 320 and 896: a last output chunk narrower than 128; 3584: Qwen2-7B.
        for &(d, n_pages) in &[(320usize, 5usize), (896, 7), (3584, 6)] {
            let f = paged_ffn(&mut r, d, n_pages);
            let x = uniform(&mut r, d, 1.0);
            let all: Vec<usize> = (0..n_pages).collect();
            let want = reference_ffn(&f, &x, &all);
            let ids: Vec<u32> = (0..n_pages as u32).collect();
            for reduction in [Reduction::Atomic, Reduction::Ordered] {
                let got = run_ffn(&dev, &f, &x, &ids, reduction, &vec![0.0; d], true);
                let (c, e) = (cosine(&got, &want), rel_err(&got, &want));
                eprintln!("ffn d={d} all {n_pages} pages {reduction:?}: cosine {c:.9}, relative error {e:.3e}");
                assert!(c >= 0.9999, "d={d} {reduction:?}: cosine {c}");
                assert!(e < 1e-5, "d={d} {reduction:?}: relative error {e}");
            }
        }
    }

    #[test]
    fn fused_ffn_page_subset_equals_restricted_reference() {
        let Some(dev) = device("fused_ffn_page_subset_equals_restricted_reference") else {
            return;
        };
        let mut r = rng(41);
        for &(d, n_pages) in &[(896usize, 9usize), (3584, 12)] {
            let f = paged_ffn(&mut r, d, n_pages);
            let x = uniform(&mut r, d, 1.0);
            // A random subset in random order, plus an id past the end that
            // the kernel must skip.
            let mut subset: Vec<usize> = (0..n_pages).filter(|_| r.random_bool(0.4)).collect();
            if subset.is_empty() {
                subset.push(n_pages / 2);
            }
            subset.reverse();
            let mut ids: Vec<u32> = subset.iter().map(|&p| p as u32).collect();
            ids.insert(ids.len() / 2, 1000);
            let want = reference_ffn(&f, &x, &subset);
            let residual = uniform(&mut r, d, 0.1);
            let want_acc: Vec<f64> = want
                .iter()
                .zip(&residual)
                .map(|(a, b)| a + *b as f64)
                .collect();

            let ordered = run_ffn(
                &dev,
                &f,
                &x,
                &ids,
                Reduction::Ordered,
                &vec![f32::NAN; d],
                false,
            );
            let e = rel_err(&ordered, &want);
            eprintln!(
                "ffn d={d} pages {subset:?}: ordered relative error {e:.3e}, cosine {:.9}",
                cosine(&ordered, &want)
            );
            assert!(e < 1e-5, "d={d} ordered: relative error {e}");
            let again = run_ffn(
                &dev,
                &f,
                &x,
                &ids,
                Reduction::Ordered,
                &vec![f32::NAN; d],
                false,
            );
            assert!(
                ordered
                    .iter()
                    .zip(&again)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "the ordered reduction is not bit-reproducible"
            );
            for reduction in [Reduction::Atomic, Reduction::Ordered] {
                let got = run_ffn(&dev, &f, &x, &ids, reduction, &residual, true);
                let e = rel_err(&got, &want_acc);
                assert!(
                    e < 1e-5,
                    "d={d} {reduction:?} onto a residual: relative error {e}"
                );
            }
        }
    }

    #[test]
    fn fused_ffn_with_no_active_pages_leaves_or_zeroes_y() {
        let Some(dev) = device("fused_ffn_with_no_active_pages_leaves_or_zeroes_y") else {
            return;
        };
        let mut r = rng(51);
        let f = paged_ffn(&mut r, 256, 2);
        let x = uniform(&mut r, 256, 1.0);
        let y0 = uniform(&mut r, 256, 1.0);
        assert_eq!(run_ffn(&dev, &f, &x, &[], Reduction::Atomic, &y0, true), y0);
        assert_eq!(
            run_ffn(&dev, &f, &x, &[], Reduction::Ordered, &y0, true),
            y0
        );
        let zero = run_ffn(&dev, &f, &x, &[], Reduction::Ordered, &y0, false);
        assert!(zero.iter().all(|v| *v == 0.0));
    }

    /// One page set's inputs on the device, for runs of `ffn_q8_with`.
    struct Q8Case<'a> {
        dev: &'a SparseDevice,
        pages: &'a mirage_cuda::superblock::Q8Pages,
        x: &'a cudarc::driver::CudaSlice<f32>,
        active: &'a ActivePages,
    }

    impl Q8Case<'_> {
        /// `ffn_q8_with` of `opts` onto a fresh copy of `y0`, read back.
        fn run(
            &self,
            opts: mirage_cuda::superblock::FfnQ8Options,
            reduction: Reduction,
            y0: &[f32],
            accumulate: bool,
            scratch: &mut FfnScratch,
        ) -> Vec<f32> {
            let mut dy = self.dev.upload_f32(y0).unwrap();
            self.dev
                .ffn_q8_with(
                    self.pages,
                    self.x,
                    self.active,
                    reduction,
                    accumulate,
                    opts,
                    scratch,
                    &mut dy,
                )
                .unwrap();
            self.dev.download_f32(&dy).unwrap()
        }
    }

    /// Every fused Q8_0 FFN variant (`superblock_ffn_q8s_v<n>`) at several
    /// phase-2 part sizes against the f64 reference, as the NVFP4 test does:
    /// all pages / a subset with ids past the end and a repeated page / no
    /// page; ordered, atomic onto a residual, ordered onto a residual; one
    /// cooperative launch and the two phase launches, ordered bit-equal
    /// across them (the tiled-down and cluster-finished variants: refused
    /// cooperatively, two runs of the two launches bit-equal); v0 with
    /// part_ch 0 bit-equal to
    /// `superblock_ffn_q8s`.
    #[test]
    fn q8s_ffn_variants_match_f64_reference() {
        use mirage_cuda::superblock::{FfnLaunch, FfnQ8Options, Q8_FFN_VARIANTS};
        let Some(dev) = device("q8s_ffn_variants_match_f64_reference") else {
            return;
        };
        let mut r = rng(71);
        // d: 96 and 864 (a last output chunk narrower than 128, rows not a
        // whole number of 512-byte warp loads), 320, 896 (Qwen2.5-0.5B),
        // 3584 (Qwen2-7B).
        for &(d, n_pages) in &[(96usize, 5usize), (320, 4), (864, 6), (896, 7), (3584, 5)] {
            let f = paged_ffn(&mut r, d, n_pages);
            let pages: Vec<&[u8]> = f.pages.iter().map(|p| p.as_slice()).collect();
            let dp = dev.upload_q8_0_pages(d, &pages).unwrap();
            let x = uniform(&mut r, d, 1.0);
            let residual = uniform(&mut r, d, 0.1);
            let dx = dev.upload_f32(&x).unwrap();
            let sets = page_sets(&mut r, n_pages);
            let mut scratch = FfnScratch::default();
            let mut active = dev.new_active(&[], n_pages + 8).unwrap();
            for (name, set, ids) in &sets {
                dev.set_active(&mut active, ids).unwrap();
                let want = reference_ffn(&f, &x, set);
                let want_acc: Vec<f64> = want
                    .iter()
                    .zip(&residual)
                    .map(|(a, b)| a + *b as f64)
                    .collect();
                let case = Q8Case {
                    dev: &dev,
                    pages: &dp,
                    x: &dx,
                    active: &active,
                };
                let mut run =
                    |opts: FfnQ8Options, reduction: Reduction, y0: &[f32], accumulate: bool| {
                        case.run(opts, reduction, y0, accumulate, &mut scratch)
                    };
                let first = run(
                    FfnQ8Options::default(),
                    Reduction::Ordered,
                    &vec![f32::NAN; d],
                    false,
                );
                for v in &Q8_FFN_VARIANTS {
                    // 0: K = grid / n_chunks; 64: many small parts; 1 << 20:
                    // one part per output chunk.
                    for part_ch in [0u32, 64, 1 << 20] {
                        let mut ordered_bits: Vec<Vec<u32>> = Vec::new();
                        // The tiled and cluster-finished variants' phase 2
                        // is a kernel of its own: one cooperative launch is
                        // refused with an error; their two launches run
                        // twice instead (the same bits run to run).
                        let launches = if v.tiled_down || v.cluster_down {
                            let mut dy = dev.upload_f32(&vec![0.0; d]).unwrap();
                            let coop = FfnQ8Options {
                                variant: Some(v.index),
                                part_ch,
                                launch: FfnLaunch::Cooperative,
                                cluster: None,
                            };
                            let err = dev
                                .ffn_q8_with(
                                    &dp,
                                    &dx,
                                    &active,
                                    Reduction::Ordered,
                                    false,
                                    coop,
                                    &mut FfnScratch::default(),
                                    &mut dy,
                                )
                                .expect_err(
                                    "a variant with its own phase-2 kernel launched cooperatively",
                                );
                            assert!(
                                err.to_string().contains("cooperative"),
                                "{}: {err}",
                                v.kernel
                            );
                            [FfnLaunch::TwoLaunches, FfnLaunch::TwoLaunches]
                        } else {
                            [FfnLaunch::Cooperative, FfnLaunch::TwoLaunches]
                        };
                        for launch in launches {
                            let opts = FfnQ8Options {
                                variant: Some(v.index),
                                part_ch,
                                launch,
                                cluster: None,
                            };
                            let ordered = run(opts, Reduction::Ordered, &vec![f32::NAN; d], false);
                            let atomic = run(opts, Reduction::Atomic, &residual, true);
                            let ordered_acc = run(opts, Reduction::Ordered, &residual, true);
                            let tag = format!(
                                "q8s ffn {} d={d} {name} part_ch {part_ch} {launch:?}",
                                v.kernel
                            );
                            // The single-pass kernels also take the atomic
                            // reduction without accumulate (they zero y
                            // themselves; y starts as NaN here).
                            let atomic_zeroed = v
                                .single_pass
                                .then(|| run(opts, Reduction::Atomic, &vec![f32::NAN; d], false));
                            if set.is_empty() {
                                check_empty_list(&tag, &ordered, &atomic, &ordered_acc, &residual);
                                if let Some(z) = &atomic_zeroed {
                                    assert!(
                                        z.iter().all(|v| *v == 0.0),
                                        "{tag}: atomic from NaN, no pages, not zero"
                                    );
                                }
                            } else {
                                let [e, ea, eo] = check_ffn_errors(
                                    &tag,
                                    &ordered,
                                    &atomic,
                                    &ordered_acc,
                                    &want,
                                    &want_acc,
                                );
                                if let Some(z) = &atomic_zeroed {
                                    check_ffn_errors(
                                        &format!("{tag} (atomic from NaN as 'ordered')"),
                                        z,
                                        &atomic,
                                        &ordered_acc,
                                        &want,
                                        &want_acc,
                                    );
                                }
                                if launch == FfnLaunch::TwoLaunches && part_ch == 0 {
                                    eprintln!(
                                        "{tag}: relative error ordered {e:.3e}, atomic + residual {ea:.3e}, ordered + residual {eo:.3e}"
                                    );
                                }
                            }
                            ordered_bits.push(ordered.iter().map(|v| v.to_bits()).collect());
                        }
                        assert_eq!(
                            ordered_bits[0], ordered_bits[1],
                            "{} d={d} {name} part_ch {part_ch}: ordered results differ between the launch modes",
                            v.kernel
                        );
                        // v0 is the first version's code: the same bits when
                        // it runs on the same grid.
                        if v.index == 0 && part_ch == 0 && dp.variant_grid(0) == Some(dp.grid()) {
                            let first_bits: Vec<u32> = first.iter().map(|v| v.to_bits()).collect();
                            assert_eq!(
                                ordered_bits[0], first_bits,
                                "d={d} {name}: v0 differs from superblock_ffn_q8s"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The cluster-finished phase 2 (v15, `superblock_ffn_q8s_c2`) at
    /// cluster sizes 1, 2, 3 (not a power of two), 8 (the portable limit)
    /// and the largest the device takes (the H200: 16, non-portable), each
    /// as one cluster looping over every output chunk and as one cluster a
    /// chunk: the f64 reference (ordered, atomic onto a residual, ordered
    /// onto a residual), and the ordered bits a function of the cluster
    /// size alone (equal across the two numbers of clusters).
    #[test]
    fn q8s_cluster_finish_at_every_cluster_shape() {
        use mirage_cuda::superblock::{FfnQ8Options, Q8_FFN_VARIANTS};
        let Some(dev) = device("q8s_cluster_finish_at_every_cluster_shape") else {
            return;
        };
        let v = Q8_FFN_VARIANTS
            .iter()
            .find(|v| v.cluster_down)
            .expect("a cluster-finished variant");
        let mut r = rng(73);
        for &(d, n_pages) in &[(96usize, 5usize), (864, 6), (3584, 5)] {
            let f = paged_ffn(&mut r, d, n_pages);
            let pages: Vec<&[u8]> = f.pages.iter().map(|p| p.as_slice()).collect();
            let dp = dev.upload_q8_0_pages(d, &pages).unwrap();
            let (grid, k_max) = dp.cluster_shape();
            eprintln!(
                "d={d}: the upload's phase-2 shape: {} clusters of {k_max}",
                grid / k_max.max(1)
            );
            assert!(
                k_max >= 1 && grid % k_max == 0,
                "d={d}: grid {grid}, cluster {k_max}"
            );
            let x = uniform(&mut r, d, 1.0);
            let residual = uniform(&mut r, d, 0.1);
            let dx = dev.upload_f32(&x).unwrap();
            let mut scratch = FfnScratch::default();
            let mut active = dev.new_active(&[], n_pages + 8).unwrap();
            let n_chunks = d.div_ceil(128) as u32;
            for (name, set, ids) in &page_sets(&mut r, n_pages) {
                dev.set_active(&mut active, ids).unwrap();
                let want = reference_ffn(&f, &x, set);
                let want_acc: Vec<f64> = want
                    .iter()
                    .zip(&residual)
                    .map(|(a, b)| a + *b as f64)
                    .collect();
                let mut sizes = vec![1u32, 2, 3, 8, k_max];
                sizes.retain(|&k| k <= k_max);
                sizes.dedup();
                for k in sizes {
                    let mut bits: Vec<Vec<u32>> = Vec::new();
                    for clusters in [1, n_chunks] {
                        let opts = FfnQ8Options {
                            variant: Some(v.index),
                            part_ch: 0,
                            launch: FfnLaunch::TwoLaunches,
                            cluster: Some((clusters, k)),
                        };
                        let case = Q8Case {
                            dev: &dev,
                            pages: &dp,
                            x: &dx,
                            active: &active,
                        };
                        let mut run = |reduction: Reduction, y0: &[f32], accumulate: bool| {
                            case.run(opts, reduction, y0, accumulate, &mut scratch)
                        };
                        let ordered = run(Reduction::Ordered, &vec![f32::NAN; d], false);
                        let atomic = run(Reduction::Atomic, &residual, true);
                        let ordered_acc = run(Reduction::Ordered, &residual, true);
                        let tag = format!("c2 d={d} {name}: {clusters} clusters of {k}");
                        if set.is_empty() {
                            check_empty_list(&tag, &ordered, &atomic, &ordered_acc, &residual);
                        } else {
                            let [e, ea, eo] = check_ffn_errors(
                                &tag,
                                &ordered,
                                &atomic,
                                &ordered_acc,
                                &want,
                                &want_acc,
                            );
                            eprintln!("{tag}: relative error {e:.3e} / {ea:.3e} / {eo:.3e}");
                        }
                        bits.push(ordered.iter().map(|v| v.to_bits()).collect());
                    }
                    assert_eq!(
                        bits[0], bits[1],
                        "c2 d={d} {name}, clusters of {k}: bits depend on the cluster count"
                    );
                }
            }
        }
    }

    /// NVFP4 pages of random weights (`n_ff` rows, the last page padded)
    /// and their codec-dequantized weights as a [`PagedFfn`] (pages of
    /// 128 rows, padding rows zero) for [`reference_ffn`].
    fn nvfp4_ffn(r: &mut impl Rng, d: usize, n_ff: usize) -> (Nvfp4Pages, PagedFfn) {
        let s = 1.0 / (d as f32).sqrt();
        let m: Vec<Vec<f32>> = (0..3).map(|_| blocky(r, n_ff * d, 2.0 * s)).collect();
        let pages = Nvfp4Pages::from_f32(d, &m[0], &m[1], &m[2]).unwrap();
        let mut f = PagedFfn {
            d,
            pages: Vec::new(),
            gate: Vec::new(),
            up: Vec::new(),
            down_t: Vec::new(),
        };
        for p in 0..pages.n_pages() {
            let [g, u, dt] = pages.dequantize_page(p).unwrap();
            f.gate.extend(g);
            f.up.extend(u);
            f.down_t.extend(dt);
        }
        (pages, f)
    }

    #[test]
    fn nvfp4_fused_ffn_matches_f64_reference() {
        let Some(dev) = device("nvfp4_fused_ffn_matches_f64_reference") else {
            return;
        };
        let mut r = rng(61);
        // d: multiples of 32 but not of 128 (96, 864: a last output chunk of
        // 96 and a partial last 1024-element group of the gate/up rows),
        // 3584 (Qwen2-7B). n_ff: padded last pages (300, 900).
        for &(d, n_ff) in &[(96usize, 300usize), (320, 640), (864, 900), (3584, 768)] {
            let (pages, f) = nvfp4_ffn(&mut r, d, n_ff);
            let dp = dev.upload_nvfp4_pages(&pages).unwrap();
            let tag = format!("nvfp4 ffn d={d} n_ff={n_ff}");
            check_weight_only_ffn(
                &dev,
                &mut r,
                &tag,
                &f,
                pages.n_pages(),
                d,
                |x, a, red, y0, acc, launch, sc| {
                    let dx = dev.upload_f32(x).unwrap();
                    let mut dy = dev.upload_f32(y0).unwrap();
                    dev.ffn_nvfp4(&dp, &dx, a, red, acc, launch, sc, &mut dy)
                        .unwrap();
                    dev.download_f32(&dy).unwrap()
                },
            );
        }
    }

    /// The checks of a weight-only fused FFN (NVFP4, Q2_K) at one shape,
    /// against `f` (the f64 reference on the dequantized weights): all pages;
    /// a random subset in random order with ids past the end inserted
    /// (skipped, one of them == n_pages) and one page twice (counted twice);
    /// no page at all; each as ordered, atomic onto a residual and ordered
    /// onto a residual, from one cooperative launch and from two launches,
    /// the ordered bits equal across the two. `run(x, active, reduction, y0,
    /// accumulate, launch, scratch)` runs the kernel with y starting at y0
    /// and returns y.
    #[allow(clippy::type_complexity)]
    pub(super) fn check_weight_only_ffn(
        dev: &SparseDevice,
        r: &mut impl Rng,
        tag: &str,
        f: &PagedFfn,
        n_pages: usize,
        d: usize,
        run: impl Fn(
            &[f32],
            &ActivePages,
            Reduction,
            &[f32],
            bool,
            FfnLaunch,
            &mut FfnScratch,
        ) -> Vec<f32>,
    ) {
        let x = uniform(r, d, 1.0);
        let residual = uniform(r, d, 0.1);
        let sets = page_sets(r, n_pages);
        let mut scratch = FfnScratch::default();
        let mut active = dev.new_active(&[], n_pages + 8).unwrap();
        for (name, set, ids) in &sets {
            dev.set_active(&mut active, ids).unwrap();
            let want = reference_ffn(f, &x, set);
            let want_acc: Vec<f64> = want
                .iter()
                .zip(&residual)
                .map(|(a, b)| a + *b as f64)
                .collect();
            let mut ordered_bits: Vec<Vec<u32>> = Vec::new();
            for launch in [FfnLaunch::Cooperative, FfnLaunch::TwoLaunches] {
                let mut go = |reduction: Reduction, y0: &[f32], accumulate: bool| {
                    run(&x, &active, reduction, y0, accumulate, launch, &mut scratch)
                };
                let ordered = go(Reduction::Ordered, &vec![f32::NAN; d], false);
                let atomic = go(Reduction::Atomic, &residual, true);
                let ordered_acc = go(Reduction::Ordered, &residual, true);
                let tag = format!("{tag} {name} {launch:?}");
                if set.is_empty() {
                    check_empty_list(&tag, &ordered, &atomic, &ordered_acc, &residual);
                } else {
                    let [e, ea, eo] =
                        check_ffn_errors(&tag, &ordered, &atomic, &ordered_acc, &want, &want_acc);
                    eprintln!(
                        "{tag}: relative error ordered {e:.3e} (cosine {:.9}), atomic + residual {ea:.3e}, ordered + residual {eo:.3e}",
                        cosine(&ordered, &want)
                    );
                }
                ordered_bits.push(ordered.iter().map(|v| v.to_bits()).collect());
            }
            // Same grid, same order: the ordered reduction gives the same
            // bits from one cooperative launch as from the two phases.
            assert_eq!(
                ordered_bits[0], ordered_bits[1],
                "{tag} {name}: ordered results differ between the launch modes"
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Q2_K pages (`superblock_ffn_q2k`, cuda/superblock_q2k.cu).

/// u32 at byte `at` (little-endian).
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// (d, dmin) of a split-Q2_K dm word.
fn q2k_dm(w: u32) -> (f32, f32) {
    (
        half::f16::from_bits(w as u16).to_f32(),
        half::f16::from_bits((w >> 16) as u16).to_f32(),
    )
}

/// Decodes weight `i` of row `row` of matrix `k` (0 gate, 1 up, 2 down_t)
/// straight from a Q2_K page's bytes, by the layout documented in
/// cuda/superblock_q2k.cu (not through the packer's decoder), with ggml's
/// float expressions.
fn q2k_page_weight(page: &[u8], d: usize, k: usize, row: usize, i: usize) -> f32 {
    let (mq, ms, mm) = (
        PAGE_CHANNELS * d / 4,
        PAGE_CHANNELS * d / 16,
        PAGE_CHANNELS * d / 64,
    );
    let (blk, e) = (i / 256, i % 256);
    let byte = page[k * mq + row * d / 4 + 64 * blk + 32 * (e >> 7) + (e & 31)];
    let code = (byte >> (2 * ((e >> 5) & 3))) & 3;
    // Quarter u = 2 h + hi, bit pair j: scale byte 4 u + j of the block.
    let (h, j, hi) = (e >> 7, (e >> 5) & 3, (e >> 4) & 1);
    let sc = page[3 * mq + k * ms + row * d / 16 + 16 * blk + 4 * (2 * h + hi) + j];
    let (dd, dmin) = q2k_dm(u32_at(
        page,
        3 * mq + 3 * ms + k * mm + row * d / 64 + 4 * blk,
    ));
    let dl = dd * (sc & 0xf) as f32;
    let ml = dmin * (sc >> 4) as f32;
    dl * code as f32 - ml
}

fn dequant(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    quant::dequantize(ty, bytes, &mut out).unwrap();
    out
}

#[test]
fn q2k_pages_dequantize_to_ggml_rows() {
    use mirage_cuda::superblock_q2k::{
        join_q2k_rows, q2k_page_bytes, q2k_scale_slot, quantize_q2k_rows, split_q2k_rows, Q2kPages,
    };
    let mut r = rng(71);
    // n_ff not a multiple of 128 (the last page is padded), a multiple of
    // 32 so W_down can be Q8_0.
    let (d, n_ff) = (512usize, 288usize);
    let s = 1.0 / (d as f32).sqrt();
    let gate = blocky(&mut r, n_ff * d, s);
    let up = blocky(&mut r, n_ff * d, s);
    let down = blocky(&mut r, d * n_ff, s); // W_down: d rows of n_ff
    let gate_q2k = quantize_q2k_rows(&gate, d, 3).unwrap();
    let up_bytes: Vec<u8> = up.iter().flat_map(|v| v.to_le_bytes()).collect();
    let down_q8 = q8_rows(&down, n_ff);
    let pages = Q2kPages::from_gguf_parts(
        d,
        n_ff,
        (GgmlType::Q2_K, &gate_q2k),
        (GgmlType::F32, &up_bytes),
        (GgmlType::Q8_0, &down_q8),
        3,
    )
    .unwrap();
    assert_eq!(pages.n_pages(), 3);
    assert_eq!(q2k_page_bytes(d), 126 * d);
    assert_eq!(pages.bytes().len(), 3 * q2k_page_bytes(d));

    // mirage-gguf's own Q2_K: gate verbatim, up quantized in one call, down
    // dequantized, transposed and quantized.
    let one_call = |v: &[f32]| -> Vec<u8> {
        let mut b = vec![0u8; quant::row_bytes(GgmlType::Q2_K, v.len()).unwrap()];
        quant::quantize(GgmlType::Q2_K, v, &mut b).unwrap();
        b
    };
    assert_eq!(gate_q2k, one_call(&gate), "threaded quantizer differs");
    let down_t = transpose(&dequant_q8(&down_q8, d * n_ff), d, n_ff);
    let want = [
        dequant(GgmlType::Q2_K, &gate_q2k, n_ff * d),
        dequant(GgmlType::Q2_K, &one_call(&up), n_ff * d),
        dequant(GgmlType::Q2_K, &one_call(&down_t), n_ff * d),
    ];
    for p in 0..pages.n_pages() {
        let page = pages.page(p);
        let decoded = pages.dequantize_page(p).unwrap();
        for (k, w) in want.iter().enumerate() {
            for row in 0..PAGE_CHANNELS {
                let c = p * PAGE_CHANNELS + row;
                for i in 0..d {
                    let got = q2k_page_weight(page, d, k, row, i);
                    let exp = if c < n_ff { w[c * d + i] } else { 0.0 };
                    assert_eq!(
                        got.to_bits(),
                        exp.to_bits(),
                        "page {p} matrix {k} row {row} weight {i}"
                    );
                    assert_eq!(decoded[k][row * d + i].to_bits(), exp.to_bits());
                }
            }
        }
    }
    // From f32: the same as packing mirage-gguf's Q2_K rows.
    let from_f32 = Q2kPages::from_f32(d, &gate, &up, &down_t).unwrap();
    let again =
        Q2kPages::from_q2k_rows(d, n_ff, &gate_q2k, &one_call(&up), &one_call(&down_t)).unwrap();
    assert_eq!(from_f32, again);
    // The scale permutation is one, and split/join are inverses.
    let mut slots: Vec<usize> = (0..16).map(q2k_scale_slot).collect();
    slots.sort_unstable();
    assert_eq!(slots, (0..16).collect::<Vec<_>>());
    let split = split_q2k_rows(&gate_q2k, n_ff, d).unwrap();
    assert_eq!(join_q2k_rows(&split, n_ff, d).unwrap(), gate_q2k);
    // Widths the kernel cannot take, and mismatched shapes.
    let g384 = blocky(&mut r, 128 * 384, 1.0);
    assert!(Q2kPages::from_f32(384, &g384, &g384, &g384).is_err());
    assert!(Q2kPages::from_f32(d, &gate, &up, &down_t[d..]).is_err());
    assert!(Q2kPages::from_q2k_rows(d, n_ff, &gate_q2k[1..], &gate_q2k, &gate_q2k).is_err());
}

/// Q2_K pages of random weights (`n_ff` rows, the last page padded) and
/// their dequantized weights as a [`PagedFfn`] for [`reference_ffn`].
fn q2k_ffn(
    r: &mut impl Rng,
    d: usize,
    n_ff: usize,
) -> (mirage_cuda::superblock_q2k::Q2kPages, PagedFfn) {
    let s = 1.0 / (d as f32).sqrt();
    let m: Vec<Vec<f32>> = (0..3).map(|_| blocky(r, n_ff * d, 2.0 * s)).collect();
    let pages = mirage_cuda::superblock_q2k::Q2kPages::from_f32(d, &m[0], &m[1], &m[2]).unwrap();
    let mut f = PagedFfn {
        d,
        pages: Vec::new(),
        gate: Vec::new(),
        up: Vec::new(),
        down_t: Vec::new(),
    };
    for p in 0..pages.n_pages() {
        let [g, u, dt] = pages.dequantize_page(p).unwrap();
        f.gate.extend(g);
        f.up.extend(u);
        f.down_t.extend(dt);
    }
    (pages, f)
}

/// `superblock_ffn_q2k` transliterated to the host (ordered mode, `y =
/// FFN(x)`): the same x planes and 16-weight sums, lane -> quarter map and
/// page offsets in phase 1; the same items, parts, 8-channel groups, lane
/// map, min sums, reduce-scatter and red[] index in phase 2; f32 as on the
/// device. `grid` blocks (phase 2's split K depends on it).
// Index loops on purpose: they read as the kernel's lane and element indices.
#[allow(clippy::needless_range_loop)]
fn emulate_ffn_q2k(
    bytes: &[u8],
    n_pages: usize,
    d: usize,
    x: &[f32],
    ids: &[u32],
    grid: usize,
) -> Vec<f32> {
    const U1: usize = 2; // Q2_FFN_U1
    const U2: usize = 4; // Q2_FFN_U2
    let pb = 126 * d;
    let (mat, smat, dmat) = (128 * d / 4, 128 * d / 16, 128 * d / 64);
    let qn = d >> 6;
    let code = |w: u32, b: usize, j: usize| ((w >> (8 * b + 2 * j)) & 3) as f32;
    let nib = |sw: u32| -> ([f32; 4], [f32; 4]) {
        (
            std::array::from_fn(|j| ((sw >> (8 * j)) & 15) as f32),
            std::array::from_fn(|j| ((sw >> (8 * j + 4)) & 15) as f32),
        )
    };
    // Phase 1.
    let mut xs = vec![[0f32; 4]; d / 4];
    for t in 0..d / 4 {
        let b = t & 63;
        let (h, j, hi, w) = (b >> 5, (b >> 3) & 3, (b >> 2) & 1, b & 3);
        xs[(4 * j + w) * qn + 4 * (t >> 6) + 2 * h + hi].copy_from_slice(&x[4 * t..4 * t + 4]);
    }
    let xsum: Vec<f32> = (0..d / 16)
        .map(|g| {
            let (j, qi) = (g / qn, g % qn);
            (0..4)
                .map(|w| {
                    let v = xs[(4 * j + w) * qn + qi];
                    (v[0] + v[1]) + (v[2] + v[3])
                })
                .fold(0f32, |s, v| s + v)
        })
        .collect();
    let n_ch = ids.len() * 128;
    let mut hbuf = vec![0f32; n_ch];
    for (c, hv) in hbuf.iter_mut().enumerate() {
        let page = ids[c >> 7] as usize;
        if page >= n_pages {
            continue;
        }
        let (ch, base) = (c & 127, page * pb);
        let mut dots = [0f32; 2];
        for (k, dot) in dots.iter_mut().enumerate() {
            let mut acc = [0f32; 32];
            for c0 in (0..qn).step_by(32 * U1) {
                for hh in 0..U1 {
                    for (lane, a) in acc.iter_mut().enumerate() {
                        let qi = c0 + 32 * hh + lane;
                        if qi >= qn {
                            continue;
                        }
                        let q = base + k * mat + ch * (d >> 2) + 16 * qi;
                        let w: [u32; 4] = std::array::from_fn(|t| u32_at(bytes, q + 4 * t));
                        let sw = u32_at(bytes, base + 3 * mat + k * smat + ch * (d >> 4) + 4 * qi);
                        let dw = u32_at(
                            bytes,
                            base + 3 * mat + 3 * smat + k * dmat + ch * (d >> 6) + 4 * (qi >> 2),
                        );
                        let (sc, mn) = nib(sw);
                        let (mut pp, mut mm) = (0f32, 0f32);
                        for j in 0..4 {
                            let mut s = 0f32;
                            for (t, wt) in w.iter().enumerate() {
                                let xv = xs[(4 * j + t) * qn + qi];
                                for b in 0..4 {
                                    s += code(*wt, b, j) * xv[b];
                                }
                            }
                            pp += sc[j] * s;
                            mm += mn[j] * xsum[j * qn + qi];
                        }
                        let (dd, dmin) = q2k_dm(dw);
                        *a += dd * pp - dmin * mm;
                    }
                }
            }
            *dot = acc.iter().sum();
        }
        let (g, u) = (dots[0], dots[1]);
        *hv = g / (1.0 + (-g).exp()) * u;
    }
    // Phase 2.
    let n_chunks = d >> 7;
    let kk = (grid / n_chunks).max(1);
    let mut partials = vec![vec![0f32; d]; kk];
    for it in 0..kk * n_chunks {
        let (chunk, k) = (it % n_chunks, it / n_chunks);
        let groups = n_ch >> 3;
        let (g_begin, g_end) = (groups * k / kk, groups * (k + 1) / kk);
        let mut red = [[0f32; 128]; 8];
        for (warp, red_w) in red.iter_mut().enumerate() {
            let mut a = [[0f32; 32]; 32];
            let mut mins = [[0f32; 4]; 32];
            for gi in (g_begin + warp..g_end).step_by(8 * U2) {
                for v in 0..U2 {
                    let g = gi + v * 8;
                    if g >= g_end || ids[g >> 4] as usize >= n_pages {
                        continue;
                    }
                    let base = ids[g >> 4] as usize * pb;
                    for lane in 0..32 {
                        let (sub, t8) = (lane >> 2, lane & 3);
                        let c = (g << 3) + sub;
                        let ch = c & 127;
                        let qo = base + 2 * mat + 32 * chunk + 8 * t8 + ch * (d >> 2);
                        let so =
                            base + 3 * mat + 2 * smat + 8 * chunk + 4 * (t8 >> 1) + ch * (d >> 4);
                        let mo =
                            base + 3 * mat + 3 * smat + 2 * dmat + 4 * (chunk >> 1) + ch * (d >> 6);
                        let (w0, w1) = (u32_at(bytes, qo), u32_at(bytes, qo + 4));
                        let (sc, mn) = nib(u32_at(bytes, so));
                        let (dd, dmin) = q2k_dm(u32_at(bytes, mo));
                        let (hd, hm) = (hbuf[c] * dd, hbuf[c] * dmin);
                        for j in 0..4 {
                            mins[lane][j] += hm * mn[j];
                            let sf = hd * sc[j];
                            for b in 0..4 {
                                a[lane][8 * j + b] += sf * code(w0, b, j);
                                a[lane][8 * j + 4 + b] += sf * code(w1, b, j);
                            }
                        }
                    }
                }
            }
            for lane in 0..32 {
                for i in 0..32 {
                    a[lane][i] -= mins[lane][i >> 3];
                }
            }
            for (bit, n) in [(16usize, 16usize), (8, 8), (4, 4)] {
                let prev = a;
                for (lane, al) in a.iter_mut().enumerate() {
                    let upper = lane & bit != 0;
                    let p = lane ^ bit; // the partner is upper iff this lane is not
                    for i in 0..n {
                        let keep = if upper {
                            prev[lane][i + n]
                        } else {
                            prev[lane][i]
                        };
                        let sent = if upper { prev[p][i + n] } else { prev[p][i] };
                        al[i] = keep + sent;
                    }
                }
            }
            for (lane, al) in a.iter().enumerate() {
                let (sub, t8) = (lane >> 2, lane & 3);
                for i in 0..4 {
                    red_w[32 * (sub >> 1) + 8 * t8 + 4 * (sub & 1) + i] = al[i];
                }
            }
        }
        for j in 0..128 {
            partials[k][128 * chunk + j] = (0..8).fold(0f32, |s, w| s + red[w][j]);
        }
    }
    (0..d)
        .map(|e| (0..kk).fold(0f32, |s, k| s + partials[k][e]))
        .collect()
}

#[test]
fn q2k_kernel_indexing_emulated_on_the_cpu() {
    let mut r = rng(73);
    for &(d, n_ff, grid) in &[
        (256usize, 300usize, 12usize),
        (512, 640, 40),
        (1024, 200, 7),
    ] {
        let (pages, f) = q2k_ffn(&mut r, d, n_ff);
        let n_pages = pages.n_pages();
        let x = uniform(&mut r, d, 1.0);
        let all: Vec<usize> = (0..n_pages).collect();
        let mut subset: Vec<usize> = (0..n_pages).rev().step_by(2).collect();
        subset.push(subset[0]);
        let mut ids: Vec<u32> = subset.iter().map(|&p| p as u32).collect();
        ids.insert(0, n_pages as u32);
        ids.insert(ids.len() / 2, n_pages as u32 + 1000);
        for (set, ids) in [
            (all.clone(), all.iter().map(|&p| p as u32).collect()),
            (subset, ids),
        ] {
            let got = emulate_ffn_q2k(pages.bytes(), n_pages, d, &x, &ids, grid);
            let e = rel_err(&got, &reference_ffn(&f, &x, &set));
            eprintln!(
                "q2k emulation d={d} n_ff={n_ff} grid={grid} ids {ids:?}: relative error {e:.3e}"
            );
            assert!(e < 1e-5, "d={d} ids {ids:?}: relative error {e}");
        }
        let none = emulate_ffn_q2k(pages.bytes(), n_pages, d, &x, &[], grid);
        assert!(none.iter().all(|v| *v == 0.0));
    }
}

#[cfg(feature = "cuda")]
mod gpu_q2k {
    use super::*;

    #[test]
    fn q2k_fused_ffn_matches_f64_reference() {
        let Some(dev) = super::gpu::device("q2k_fused_ffn_matches_f64_reference") else {
            return;
        };
        let mut r = rng(75);
        // d: one block (256: 2 output chunks, 4 quarters a row), 512, 3584
        // (Qwen2-7B: 56 quarters, the second phase-1 trip 24 lanes wide).
        // n_ff: padded last pages (300, 900).
        for &(d, n_ff) in &[(256usize, 300usize), (512, 640), (3584, 900)] {
            let (pages, f) = q2k_ffn(&mut r, d, n_ff);
            let dp = dev.upload_q2k_pages(&pages).unwrap();
            assert_eq!(dp.page_bytes(), 126 * d);
            let tag = format!("q2k ffn d={d} n_ff={n_ff}");
            super::gpu::check_weight_only_ffn(
                &dev,
                &mut r,
                &tag,
                &f,
                pages.n_pages(),
                d,
                |x, a, red, y0, acc, launch, sc| {
                    let dx = dev.upload_f32(x).unwrap();
                    let mut dy = dev.upload_f32(y0).unwrap();
                    dev.ffn_q2k(&dp, &dx, a, red, acc, launch, sc, &mut dy)
                        .unwrap();
                    dev.download_f32(&dy).unwrap()
                },
            );
        }
    }
}
