//! NVFP4 and Q2_K pages (`PageFormat::Nvfp4`, `superblock_ffn_nvfp4`;
//! `PageFormat::Q2K`, `superblock_ffn_q2k`): their packing in the artifact's
//! channel order and the Q2_K width check (CPU), and every page-selecting
//! mode on the GPU vs f64 on the decoded pages.

use mirage_artifact::superblock::PageSelector;
use mirage_artifact::SparseMode;
use mirage_cuda::sparse::pages::{quantize_rows, split_q2k_rows};
use mirage_cuda::{
    layer_pages, random_subset, CudaBackend, PageFormat, PageSource, Pages, RouteTraversal,
    SparseCudaBackend, SparsePages,
};
use mirage_gguf::quant::Nvfp4Tensor;
use mirage_gguf::{quant, GgmlType};
use mirage_runtime::backend::{Backend, HostMatrix, SharedBytes};
use mirage_runtime::RuntimeError;
use rand::Rng;

use crate::common::{cuda, rel_err, rng};
use crate::fixture::{
    artifact_from, exact_nvfp4_weights, fixture, host, random_perm, run_ffn, xs, Fixture, LayerW,
    D, N_FF, N_LAYER, N_PAGES, PAGE,
};

// ---------------------------------------------------------------------------
// NVFP4 pages (`PageFormat::Nvfp4`, `superblock_ffn_nvfp4`).

fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; m.len()];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = m[i * cols + j];
        }
    }
    t
}

/// f64 FFN of channel `ch` of a decoded page, added into `y`.
fn add_channel_f64(page: &[Vec<f32>; 3], ch: usize, x: &[f32], y: &mut [f64]) {
    let d = x.len();
    let [g, u, dt] = page;
    let dot = |w: &[f32]| {
        w[ch * d..(ch + 1) * d]
            .iter()
            .zip(x)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum::<f64>()
    };
    let (gv, uv) = (dot(g), dot(u));
    let h = gv / (1.0 + (-gv).exp()) * uv;
    for (j, yj) in y.iter_mut().enumerate() {
        *yj += dt[ch * d + j] as f64 * h;
    }
}

/// f64 FFN over the `active` pages (ids past the last page skipped, as the
/// kernel does) of host pages, on the packer's decode of their bytes.
fn pages_reference(p: &Pages, x: &[f32], active: &[u32]) -> Vec<f32> {
    let mut y = vec![0f64; p.d_model()];
    for &pg in active {
        if pg as usize >= p.n_pages() {
            continue;
        }
        let page = p.dequantize_page(pg as usize).unwrap();
        for c in 0..PAGE {
            add_channel_f64(&page, c, x, &mut y);
        }
    }
    y.into_iter().map(|v| v as f32).collect()
}

/// The f64 FFN over all of `pages` (an artifact layer's, stored channel `k`
/// = source channel `perm[k]`, `kept` pages) equals the FFN over those
/// source channels of `direct` (the same format's unpermuted pages).
fn assert_permuted_ffn_matches(
    pages: &Pages,
    direct: &Pages,
    perm: &[u32],
    kept: usize,
    layer: usize,
) {
    let x = &xs(8, 1)[0];
    let got = pages_reference(pages, x, &(0..kept as u32).collect::<Vec<_>>());
    let mut want = vec![0f64; D];
    for &c in &perm[..kept * PAGE] {
        let page = direct.dequantize_page(c as usize / PAGE).unwrap();
        add_channel_f64(&page, c as usize % PAGE, x, &mut want);
    }
    let want: Vec<f32> = want.into_iter().map(|v| v as f32).collect();
    let e = rel_err(&got, &want);
    assert!(
        e < 1e-6,
        "layer {layer}: permuted vs unpermuted FFN: rel err {e}"
    );
}

/// The fixture, a random channel order per layer and an artifact over it
/// keeping all pages but the last (`kept` of them).
fn permuted_fixture(seed: u64) -> (Fixture, Vec<Vec<u32>>, usize, PageSource) {
    let fx = fixture();
    let mut r = rng(seed);
    let perms: Vec<Vec<u32>> = (0..N_LAYER).map(|_| random_perm(&mut r, N_FF)).collect();
    let kept = N_PAGES - 1;
    let art = artifact_from(&fx.layers, &perms, kept, &mut r);
    (fx, perms, kept, PageSource::Artifact(art))
}

/// Synthetic pages of `format` are the packer's, in the identity order, and
/// `src` refuses a layer its artifact does not have.
fn assert_synthetic_pages_are_the_packers(format: PageFormat, fx: &Fixture, src: &PageSource) {
    let (g, u, d) = fx.layers[0].host();
    let syn = layer_pages(format, &PageSource::Synthetic, 0, &g, &u, &d).unwrap();
    let direct = Pages::from_gguf_parts(
        format,
        D,
        N_FF,
        (g.ty, g.data.as_slice()),
        (u.ty, u.data.as_slice()),
        (d.ty, d.data.as_slice()),
        2,
    )
    .unwrap();
    assert_eq!(syn.n_pages(), N_PAGES);
    assert!(syn == direct, "synthetic {format} pages != the packer's");
    assert!(layer_pages(format, src, N_LAYER, &g, &u, &d).is_err());
}

/// The NVFP4 pages built for an artifact follow its channel order (stored
/// channel k = source channel perm[k], only the kept pages): every row's
/// codes and block scales are those of the whole-matrix requantization of
/// the source row (gate and up exactly the dense backend's NVFP4 rows; down_t
/// the codec's quantization of W_downᵀ, whose tensor scale is W_down's).
/// Synthetic pages are the packer's own. No GPU needed.
#[test]
fn nvfp4_pages_follow_the_artifact_permutation() {
    let (fx, perms, kept, src) = permuted_fixture(11);
    let dims = [D as u64, N_FF as u64];
    let (rc, rs) = (D / 2, D / 16);
    let (mat, smat) = (PAGE * rc, PAGE * rs);
    for (l, w) in fx.layers.iter().enumerate() {
        let (g, u, d) = w.host();
        let pages = layer_pages(PageFormat::Nvfp4, &src, l, &g, &u, &d).unwrap();
        assert_eq!((pages.d_model(), pages.n_pages()), (D, kept));
        assert_eq!(pages.bytes().len(), kept * PageFormat::Nvfp4.page_bytes(D));
        let gt = Nvfp4Tensor::requantize(GgmlType::Q8_0, g.data.as_slice(), &dims).unwrap();
        let ut = Nvfp4Tensor::requantize(GgmlType::Q8_0, u.data.as_slice(), &dims).unwrap();
        let mut down_f = vec![0f32; D * N_FF];
        quant::dequantize(GgmlType::Q8_0, d.data.as_slice(), &mut down_f).unwrap();
        let dtt = Nvfp4Tensor::quantize(&transpose(&down_f, D, N_FF), &dims).unwrap();
        let wd_dims = [N_FF as u64, D as u64];
        let wd = Nvfp4Tensor::requantize(GgmlType::Q8_0, d.data.as_slice(), &wd_dims).unwrap();
        assert_eq!(dtt.tensor_scale, wd.tensor_scale);
        assert_eq!(
            pages.tensor_scales(),
            [gt.tensor_scale, ut.tensor_scale, dtt.tensor_scale]
        );
        for (k, &c) in perms[l][..kept * PAGE].iter().enumerate() {
            let c = c as usize;
            let (page, ch) = (pages.page(k / PAGE), k % PAGE);
            for (m, t) in [&gt, &ut, &dtt].into_iter().enumerate() {
                let (scales, codes) = t.row(c).unwrap();
                assert_eq!(
                    &page[m * mat + ch * rc..m * mat + (ch + 1) * rc],
                    codes,
                    "layer {l} stored channel {k} (source {c}) matrix {m}: codes"
                );
                let s0 = 3 * mat + m * smat + ch * rs;
                assert_eq!(
                    &page[s0..s0 + rs],
                    scales,
                    "layer {l} stored channel {k} (source {c}) matrix {m}: block scales"
                );
            }
        }
        // The f64 FFN over all stored pages = the FFN over the kept source
        // channels of the unpermuted pages.
        let direct = layer_pages(PageFormat::Nvfp4, &PageSource::Synthetic, l, &g, &u, &d).unwrap();
        assert_permuted_ffn_matches(&pages, &direct, &perms[l], kept, l);
    }
    assert_synthetic_pages_are_the_packers(PageFormat::Nvfp4, &fx, &src);
}

/// The premise of `nvfp4_all_pages_decode_matches_dense_nvfp4`: weights from
/// `exact_nvfp4_weights` decode bit for bit the same quantized along rows
/// and along columns, within 1e-6 of their values; and the pages' f64 FFN
/// equals the exact one. No GPU needed.
#[test]
fn exact_nvfp4_weights_decode_the_same_both_ways() {
    let mut r = rng(31);
    let w = LayerW {
        gate: exact_nvfp4_weights(&mut r, N_FF, D, 1.0 / 64.0),
        up: exact_nvfp4_weights(&mut r, N_FF, D, 1.0 / 64.0),
        down: exact_nvfp4_weights(&mut r, D, N_FF, 1.0 / 128.0),
    };
    let rows = Nvfp4Tensor::quantize(&w.down, &[N_FF as u64, D as u64])
        .unwrap()
        .dequantize()
        .unwrap();
    let cols = Nvfp4Tensor::quantize(&transpose(&w.down, D, N_FF), &[D as u64, N_FF as u64])
        .unwrap()
        .dequantize()
        .unwrap();
    assert!(
        rows == transpose(&cols, N_FF, D),
        "W_down and W_downᵀ decode differently"
    );
    assert!(rel_err(&rows, &w.down) < 1e-6);
    let f32_host = |name: &str, rows: usize, cols: usize, v: &[f32]| HostMatrix {
        name: name.into(),
        ty: GgmlType::F32,
        rows,
        cols,
        data: SharedBytes::from_vec(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    };
    let pages = layer_pages(
        PageFormat::Nvfp4,
        &PageSource::Synthetic,
        0,
        &f32_host("gate", N_FF, D, &w.gate),
        &f32_host("up", N_FF, D, &w.up),
        &f32_host("down", D, N_FF, &w.down),
    )
    .unwrap();
    let all: Vec<u32> = (0..N_PAGES as u32).collect();
    for x in xs(9, 3) {
        let e = rel_err(&pages_reference(&pages, &x, &all), &w.reference(&x, &all));
        assert!(e < 1e-5, "NVFP4 pages of exact weights vs f64: rel err {e}");
    }
}

// ---------------------------------------------------------------------------
// Q2_K pages (`PageFormat::Q2K`, `superblock_ffn_q2k`).

/// `[rows][cols]` f32 as a ggml Q2_K host matrix (mirage-gguf's quantizer).
fn q2k_host(name: &str, rows: usize, cols: usize, values: &[f32]) -> HostMatrix {
    HostMatrix {
        name: name.into(),
        ty: GgmlType::Q2_K,
        rows,
        cols,
        data: SharedBytes::from_vec(quantize_rows(GgmlType::Q2_K, values, cols, 2).unwrap()),
    }
}

/// A matrix's rows as ggml Q2_K, as the Q2_K pages must hold them: a Q2_K
/// matrix's own bytes, any other type dequantized and quantized.
fn q2k_rows_of(m: &HostMatrix) -> Vec<u8> {
    if m.ty == GgmlType::Q2_K {
        return m.data.as_slice().to_vec();
    }
    let mut f = vec![0f32; m.rows * m.cols];
    quant::dequantize(m.ty, m.data.as_slice(), &mut f).unwrap();
    quantize_rows(GgmlType::Q2_K, &f, m.cols, 2).unwrap()
}

/// Channel `ch`'s row of matrix `m` (gate, up, down_t) in a Q2_K page of
/// width `D`: its three planes (quants, scales, d/dmin words) concatenated,
/// which is the split Q2_K layout of that one row.
fn q2k_page_row(page: &[u8], m: usize, ch: usize) -> Vec<u8> {
    let (rq, rs, rm) = (D / 4, D / 16, D / 64);
    let (mq, ms, mm) = (PAGE * rq, PAGE * rs, PAGE * rm);
    let q = m * mq + ch * rq;
    let s = 3 * mq + m * ms + ch * rs;
    let w = 3 * mq + 3 * ms + m * mm + ch * rm;
    [&page[q..q + rq], &page[s..s + rs], &page[w..w + rm]].concat()
}

/// The Q2_K pages built for an artifact follow its channel order (stored
/// channel k = source channel perm[k], only the kept pages): every row is
/// byte-equal to the source channel's row in the packer's unpermuted pages
/// and to the split layout of the ggml Q2_K row (layer 0: Q8_0 gate/up,
/// requantized; layer 1: Q2_K gate/up, copied verbatim; down_t always
/// W_downᵀ quantized along d_model). Synthetic pages are the packer's own.
/// No GPU needed.
#[test]
fn q2k_pages_follow_the_artifact_permutation() {
    let (fx, perms, kept, src) = permuted_fixture(17);
    let rb = quant::row_bytes(GgmlType::Q2_K, D).unwrap();
    for (l, w) in fx.layers.iter().enumerate() {
        let (mut g, mut u, d) = w.host();
        if l == 1 {
            g = q2k_host("gate", N_FF, D, &w.gate);
            u = q2k_host("up", N_FF, D, &w.up);
        }
        let pages = layer_pages(PageFormat::Q2K, &src, l, &g, &u, &d).unwrap();
        assert_eq!((pages.d_model(), pages.n_pages()), (D, kept));
        assert_eq!(pages.bytes().len(), kept * PageFormat::Q2K.page_bytes(D));
        let direct = layer_pages(PageFormat::Q2K, &PageSource::Synthetic, l, &g, &u, &d).unwrap();
        let mut down_f = vec![0f32; D * N_FF];
        quant::dequantize(d.ty, d.data.as_slice(), &mut down_f).unwrap();
        let ggml = [
            q2k_rows_of(&g),
            q2k_rows_of(&u),
            quantize_rows(GgmlType::Q2_K, &transpose(&down_f, D, N_FF), D, 2).unwrap(),
        ];
        for (k, &c) in perms[l][..kept * PAGE].iter().enumerate() {
            let c = c as usize;
            let (page, ch) = (pages.page(k / PAGE), k % PAGE);
            for (m, rows) in ggml.iter().enumerate() {
                let got = q2k_page_row(page, m, ch);
                assert!(
                    got == q2k_page_row(direct.page(c / PAGE), m, c % PAGE),
                    "layer {l} stored channel {k} (source {c}) matrix {m}: not the packer's row"
                );
                assert!(
                    got == split_q2k_rows(&rows[c * rb..(c + 1) * rb], 1, D).unwrap(),
                    "layer {l} stored channel {k} (source {c}) matrix {m}: not the ggml Q2_K row"
                );
            }
        }
        assert_permuted_ffn_matches(&pages, &direct, &perms[l], kept, l);
    }
    assert_synthetic_pages_are_the_packers(PageFormat::Q2K, &fx, &src);
}

/// Random Q8_0 FFN matrices `d` wide with one page of channels.
fn narrow_ffn(d: usize) -> (HostMatrix, HostMatrix, HostMatrix) {
    let mut r = rng(23);
    let mut v = |n: usize| -> Vec<f32> { (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect() };
    (
        host("gate", PAGE, d, &v(PAGE * d)),
        host("up", PAGE, d, &v(PAGE * d)),
        host("down", d, PAGE, &v(PAGE * d)),
    )
}

/// `e` names width `d` and the Q2_K super-block.
fn assert_q2k_width_message(e: &dyn std::fmt::Display, d: usize) {
    let what = e.to_string();
    assert!(
        what.contains(&format!("d_model {d} ")) && what.contains("256"),
        "d_model {d}: {what}"
    );
}

/// `e` is the typed error of Q2_K pages refusing width `d`.
fn assert_q2k_width_error(e: &RuntimeError, d: usize) {
    assert!(
        matches!(
            e,
            RuntimeError::UnsupportedType {
                ty: GgmlType::Q2_K,
                ..
            }
        ),
        "d_model {d}: expected the Q2_K width error, got {e}"
    );
    assert_q2k_width_message(e, d);
}

/// Q2_K pages need d_model a positive multiple of 256 up to 16384 (the
/// kernel's limit): other widths (Qwen2.5 0.5B's 896) get a typed
/// `UnsupportedType` error naming the width, from the format check and from
/// building the pages; Q8_0 and NVFP4 take 896. Format names parse back.
/// No GPU needed.
#[test]
fn q2k_pages_refuse_widths_that_are_not_whole_super_blocks() {
    for d in [896, 0, 100, 16384 + 256] {
        assert_q2k_width_message(&PageFormat::Q2K.check_d_model(d).unwrap_err(), d);
    }
    for d in [256, 3584, 16384] {
        PageFormat::Q2K.check_d_model(d).unwrap();
    }
    PageFormat::Q8_0.check_d_model(896).unwrap();
    PageFormat::Nvfp4.check_d_model(896).unwrap();
    assert!(PageFormat::Q8_0.check_d_model(100).is_err());
    let (g, u, d) = narrow_ffn(896);
    let e = layer_pages(PageFormat::Q2K, &PageSource::Synthetic, 0, &g, &u, &d).unwrap_err();
    assert_q2k_width_error(&e, 896);
    eprintln!("896-wide Q2_K pages: {e}");
    // The width is checked before the artifact's shape (which is 256 wide).
    let art = fixture().artifact;
    let e = layer_pages(PageFormat::Q2K, &PageSource::Artifact(art), 0, &g, &u, &d).unwrap_err();
    assert_q2k_width_error(&e, 896);
    assert_eq!(
        layer_pages(PageFormat::Nvfp4, &PageSource::Synthetic, 0, &g, &u, &d)
            .unwrap()
            .n_pages(),
        1
    );
    for f in PageFormat::ALL {
        assert_eq!(f.name().parse::<PageFormat>(), Ok(f));
    }
    assert_eq!("Q2K".parse::<PageFormat>(), Ok(PageFormat::Q2K));
    assert_eq!(PageFormat::Q2K.page_bytes(3584), 126 * 3584);
}

/// Pages of `format` on the GPU, every page-selecting mode (all, prefix,
/// fraction, random, routed on the device): the active list is the mode's
/// (the same as with Q8_0 pages) and the FFN equals the f64 FFN on the
/// packer's decode of the same pages (`layer_pages`) over that list (rel err <
/// 1e-5), one row and three rows a call. The artifact has a random channel
/// order and keeps 5 of 6 pages.
fn modes_match_f64_on_the_dequantized_pages(gpu: CudaBackend, format: PageFormat) {
    let fx = fixture();
    let mut r = rng(13);
    let perms: Vec<Vec<u32>> = (0..N_LAYER).map(|_| random_perm(&mut r, N_FF)).collect();
    let kept = N_PAGES - 1;
    let art = artifact_from(&fx.layers, &perms, kept, &mut r);
    let src = PageSource::Artifact(art.clone());
    let sb = SparseCudaBackend::new(gpu, src.clone(), SparsePages::All).unwrap();
    sb.set_page_format(format).unwrap();
    let mut ffns = Vec::new();
    let mut pages = Vec::new();
    for (l, w) in fx.layers.iter().enumerate() {
        let (g, u, d) = w.host();
        ffns.push(sb.upload_ffn(l, &g, &u, &d).unwrap());
        pages.push(layer_pages(format, &src, l, &g, &u, &d).unwrap());
    }
    assert_eq!(sb.page_shape(), vec![(kept, format.page_bytes(D)); N_LAYER]);
    assert!(
        sb.set_page_format(PageFormat::Q8_0).is_err(),
        "the format cannot change after upload"
    );
    let margin = art.meta().default_margin;
    let sel = PageSelector::new(art.clone(), SparseMode::Bvh { margin }).unwrap();
    let modes = [
        SparsePages::All,
        SparsePages::Prefix(2),
        SparsePages::Fraction(0.5),
        SparsePages::Random {
            fraction: 0.5,
            seed: 9,
        },
        SparsePages::Routed {
            margin,
            traversal: RouteTraversal::Auto,
        },
    ];
    let inputs = xs(6, 6);
    let mut worst = 0f64;
    for mode in modes {
        sb.set_mode(mode).unwrap();
        for l in 0..N_LAYER {
            for x in &inputs {
                let got = run_ffn(&sb, &ffns[l], std::slice::from_ref(x));
                let active = sb.active_pages(l).unwrap();
                let want_ids: Vec<u32> = match mode {
                    SparsePages::All => (0..kept as u32).collect(),
                    SparsePages::Prefix(k) => (0..k as u32).collect(),
                    SparsePages::Fraction(f) => {
                        (0..mirage_cuda::pages_for_fraction(f, kept) as u32).collect()
                    }
                    SparsePages::Random { fraction, seed } => random_subset(
                        kept,
                        mirage_cuda::pages_for_fraction(fraction, kept),
                        seed ^ l as u64,
                    ),
                    SparsePages::Routed { .. } => sel
                        .select(l, x)
                        .unwrap()
                        .unwrap()
                        .into_iter()
                        .map(|p| p as u32)
                        .collect(),
                };
                assert_eq!(
                    active, want_ids,
                    "{format} {mode:?} layer {l}: active pages"
                );
                let e = rel_err(&got, &pages_reference(&pages[l], x, &active));
                worst = worst.max(e);
                assert!(e < 1e-5, "{format} {mode:?} layer {l}: vs f64 rel err {e}");
            }
        }
    }
    // Several rows in one call (the FFN runs row by row).
    sb.set_mode(SparsePages::Fraction(0.6)).unwrap();
    let got = run_ffn(&sb, &ffns[1], &inputs[..3]);
    let active = sb.active_pages(1).unwrap();
    for (i, x) in inputs[..3].iter().enumerate() {
        let e = rel_err(
            &got[i * D..(i + 1) * D],
            &pages_reference(&pages[1], x, &active),
        );
        assert!(e < 1e-5, "{format}: row {i} of 3: rel err {e}");
    }
    eprintln!("{format} sparse FFN vs f64 on the dequantized pages: worst rel err {worst:.2e}");
}

/// NVFP4 pages (`superblock_ffn_nvfp4`): see
/// `modes_match_f64_on_the_dequantized_pages`.
#[test]
fn nvfp4_modes_match_f64_on_the_dequantized_pages() {
    let Some(gpu) = cuda("nvfp4_modes_match_f64_on_the_dequantized_pages") else {
        return;
    };
    modes_match_f64_on_the_dequantized_pages(gpu, PageFormat::Nvfp4);
}

/// Q2_K pages (`superblock_ffn_q2k`): see
/// `modes_match_f64_on_the_dequantized_pages`. Then a model 896 wide (not
/// a multiple of 256) is refused at upload with the typed error.
#[test]
fn q2k_modes_match_f64_on_the_dequantized_pages() {
    let test = "q2k_modes_match_f64_on_the_dequantized_pages";
    let Some(gpu) = cuda(test) else {
        return;
    };
    modes_match_f64_on_the_dequantized_pages(gpu, PageFormat::Q2K);
    let gpu = cuda(test).expect("the device is still there");
    let sb = SparseCudaBackend::new(gpu, PageSource::Synthetic, SparsePages::All).unwrap();
    sb.set_page_format(PageFormat::Q2K).unwrap();
    let (g, u, d) = narrow_ffn(896);
    let e = sb.upload_ffn(0, &g, &u, &d).unwrap_err();
    assert_q2k_width_error(&e, 896);
    assert!(sb.page_shape().is_empty(), "nothing uploaded");
}
