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
    use mirage_cuda::superblock::{FfnScratch, Reduction, SparseDevice, SparseError};
    use mirage_cuda::CudaError;
    use mirage_gguf::quant::Nvfp4Tensor;

    fn device(test: &str) -> Option<SparseDevice> {
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
        use mirage_cuda::superblock::FfnLaunch;
        let Some(dev) = device("nvfp4_fused_ffn_matches_f64_reference") else {
            return;
        };
        let mut r = rng(61);
        // d: multiples of 32 but not of 128 (96, 864: a last output chunk of
        // 96 and a partial last 1024-element group of the gate/up rows),
        // 3584 (Qwen2-7B). n_ff: padded last pages (300, 900).
        for &(d, n_ff) in &[(96usize, 300usize), (320, 640), (864, 900), (3584, 768)] {
            let (pages, f) = nvfp4_ffn(&mut r, d, n_ff);
            let n_pages = pages.n_pages();
            let dp = dev.upload_nvfp4_pages(&pages).unwrap();
            let x = uniform(&mut r, d, 1.0);
            let residual = uniform(&mut r, d, 0.1);
            let dx = dev.upload_f32(&x).unwrap();
            // All pages; a random subset in random order with an id past
            // the end inserted (skipped) and one page twice (counted twice);
            // no page at all.
            let all: Vec<usize> = (0..n_pages).collect();
            let mut subset: Vec<usize> = (0..n_pages).filter(|_| r.random_bool(0.5)).collect();
            if subset.is_empty() {
                subset.push(n_pages - 1);
            }
            subset.reverse();
            subset.push(subset[0]);
            let sets: [(&str, Vec<usize>, Vec<u32>); 3] = [
                ("all", all.clone(), all.iter().map(|&p| p as u32).collect()),
                ("subset", subset.clone(), {
                    let mut ids: Vec<u32> = subset.iter().map(|&p| p as u32).collect();
                    ids.insert(ids.len() / 2, n_pages as u32 + 1000);
                    ids.insert(0, n_pages as u32);
                    ids
                }),
                ("empty", Vec::new(), Vec::new()),
            ];
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
                let mut ordered_bits: Vec<Vec<u32>> = Vec::new();
                for launch in [FfnLaunch::Cooperative, FfnLaunch::TwoLaunches] {
                    let mut run =
                        |reduction: Reduction, y0: &[f32], accumulate: bool| -> Vec<f32> {
                            let mut dy = dev.upload_f32(y0).unwrap();
                            dev.ffn_nvfp4(
                                &dp,
                                &dx,
                                &active,
                                reduction,
                                accumulate,
                                launch,
                                &mut scratch,
                                &mut dy,
                            )
                            .unwrap();
                            dev.download_f32(&dy).unwrap()
                        };
                    let ordered = run(Reduction::Ordered, &vec![f32::NAN; d], false);
                    let atomic = run(Reduction::Atomic, &residual, true);
                    let ordered_acc = run(Reduction::Ordered, &residual, true);
                    let tag = format!("nvfp4 ffn d={d} n_ff={n_ff} {name} {launch:?}");
                    if set.is_empty() {
                        assert!(
                            ordered.iter().all(|v| *v == 0.0),
                            "{tag}: ordered, no pages, not zero"
                        );
                        assert_eq!(atomic, residual, "{tag}: atomic, no pages, changed y");
                        assert_eq!(ordered_acc, residual, "{tag}: ordered, no pages, changed y");
                    } else {
                        let e = rel_err(&ordered, &want);
                        let ea = rel_err(&atomic, &want_acc);
                        let eo = rel_err(&ordered_acc, &want_acc);
                        eprintln!(
                            "{tag}: relative error ordered {e:.3e} (cosine {:.9}), atomic + residual {ea:.3e}, ordered + residual {eo:.3e}",
                            cosine(&ordered, &want)
                        );
                        assert!(e < 1e-5, "{tag}: ordered relative error {e}");
                        assert!(ea < 1e-5, "{tag}: atomic relative error {ea}");
                        assert!(
                            eo < 1e-5,
                            "{tag}: ordered onto a residual: relative error {eo}"
                        );
                    }
                    ordered_bits.push(ordered.iter().map(|v| v.to_bits()).collect());
                }
                // Same grid, same order: the ordered reduction gives the same
                // bits from one cooperative launch as from the two phases.
                assert_eq!(
                    ordered_bits[0], ordered_bits[1],
                    "d={d} {name}: ordered results differ between the launch modes"
                );
            }
        }
    }
}
