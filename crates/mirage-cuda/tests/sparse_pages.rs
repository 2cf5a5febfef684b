//! The sparse FFN's page formats on the host (no GPU): split Q8_0, NVFP4 and
//! Q2_K pages decode to the weights they were packed from, read by the
//! layouts the kernels document, and the Q2_K kernel's indexing emulated on
//! the CPU against an f64 reference. The kernels themselves run in
//! tests/sparse_backend/.

use mirage_cuda::sparse::pages::{
    join_q2k_rows, q2k_scale_slot, quantize_rows, split_q2k_rows, PAGE_CHANNELS,
};
use mirage_cuda::{PageFormat, Pages};
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
    quantize_rows(GgmlType::Q8_0, values, cols, 2).unwrap()
}

fn dequant_q8(bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    quant::dequantize(GgmlType::Q8_0, bytes, &mut out).unwrap();
    out
}

/// One FFN as Q8_0 rows (gate, up, down_t: the matrices an artifact's
/// pages hold) plus its dequantized weights: gate and up `[n_ff][d]`,
/// down_t `[n_ff][d]` (row c = column c of W_down).
struct PagedFfn {
    d: usize,
    q8: Vec<Vec<u8>>,
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
    PagedFfn {
        d,
        gate: dequant_q8(&mats[0], n_ff * d),
        up: dequant_q8(&mats[1], n_ff * d),
        down_t: dequant_q8(&mats[2], n_ff * d),
        q8: mats,
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

/// Q8_0 pages keep every weight of the Q8_0 rows they are packed from, in
/// the layout cuda/superblock.cu documents: per page the quants of gate,
/// up and down_t (128 rows of d bytes each), then their f16 block scales.
#[test]
fn q8_0_pages_keep_every_weight() {
    let mut r = rng(11);
    let d = 96;
    let f = paged_ffn(&mut r, d, 2);
    let n_ff = 2 * PAGE_CHANNELS;
    let split: Vec<(Vec<u8>, f32)> =
        f.q8.iter()
            .map(|m| {
                PageFormat::Q8_0
                    .encode_rows(GgmlType::Q8_0, m, n_ff, d, 2)
                    .unwrap()
            })
            .collect();
    let pages = Pages::from_split(
        PageFormat::Q8_0,
        d,
        n_ff,
        [(&split[0].0, 0.0), (&split[1].0, 0.0), (&split[2].0, 0.0)],
    )
    .unwrap();
    let q = PAGE_CHANNELS * d;
    let s = PAGE_CHANNELS * d / 32 * 2;
    assert_eq!(PageFormat::Q8_0.page_bytes(d), 3 * (q + s));
    for p in 0..pages.n_pages() {
        let page = pages.page(p);
        for (k, m) in [&f.gate, &f.up, &f.down_t].into_iter().enumerate() {
            for i in 0..q {
                let quant = page[k * q + i] as i8 as f32;
                let at = 3 * q + k * s + 2 * (i / 32);
                let scale = half::f16::from_le_bytes([page[at], page[at + 1]]).to_f32();
                assert_eq!(
                    quant * scale,
                    m[p * q + i],
                    "page {p} matrix {k} weight {i}"
                );
            }
        }
    }
    assert!(PageFormat::Q8_0
        .encode_rows(GgmlType::Q8_0, &f.q8[0][1..], n_ff, d, 2)
        .is_err());
    assert!(PageFormat::Q8_0
        .encode_rows(GgmlType::Q8_0, &f.q8[0], n_ff, d + 32, 2)
        .is_err());
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
    let code = if i.is_multiple_of(2) {
        byte & 15
    } else {
        byte >> 4
    };
    let scale = page[3 * mat + k * smat + row * d / 16 + i / 16];
    e2m1_to_f32(code) * (e4m3_to_f32(scale) * ts[k])
}

/// Every weight of `pages`, read from the page bytes by `weight(page,
/// matrix, row, i)` and decoded by the packer, is bit for bit `want`'s
/// (gate, up, down_t: `n_ff` rows each; the padding rows of the last page
/// zero).
fn assert_pages_hold(
    pages: &Pages,
    want: &[Vec<f32>; 3],
    n_ff: usize,
    weight: impl Fn(&[u8], usize, usize, usize) -> f32,
) {
    let d = pages.d_model();
    for p in 0..pages.n_pages() {
        let page = pages.page(p);
        let decoded = pages.dequantize_page(p).unwrap();
        for (k, w) in want.iter().enumerate() {
            for row in 0..PAGE_CHANNELS {
                let c = p * PAGE_CHANNELS + row;
                for i in 0..d {
                    let exp = if c < n_ff { w[c * d + i] } else { 0.0 };
                    let got = weight(page, k, row, i);
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
    let pages = Pages::from_gguf_parts(
        PageFormat::Nvfp4,
        d,
        n_ff,
        (GgmlType::Q8_0, &gate_q8),
        (GgmlType::F32, &up_bytes),
        (GgmlType::Q8_0, &down_q8),
        3,
    )
    .unwrap();
    assert_eq!(pages.n_pages(), 3);
    assert_eq!(pages.bytes().len(), 3 * PageFormat::Nvfp4.page_bytes(d));
    assert_eq!(PageFormat::Nvfp4.page_bytes(d), 216 * d);

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
    assert_pages_hold(&pages, &want, n_ff, |page, k, row, i| {
        nvfp4_page_weight(page, d, ts, k, row, i)
    });
    // From f32: the same as quantizing the three matrices with the codec.
    let from_f32 = Pages::from_f32(PageFormat::Nvfp4, d, &gate, &up, &down_t).unwrap();
    let again = Pages::from_nvfp4(
        &Nvfp4Tensor::quantize(&gate, &dims).unwrap(),
        &Nvfp4Tensor::quantize(&up, &dims).unwrap(),
        &Nvfp4Tensor::quantize(&down_t, &dims).unwrap(),
    )
    .unwrap();
    assert_eq!(from_f32, again);
    // Row lengths the kernel cannot take, and mismatched shapes.
    let g48 = blocky(&mut r, 128 * 48, 1.0);
    assert!(Pages::from_f32(PageFormat::Nvfp4, 48, &g48, &g48, &g48).is_err());
    assert!(Pages::from_f32(PageFormat::Nvfp4, d, &gate, &up, &down_t[d..]).is_err());
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
    let mut r = rng(71);
    // n_ff not a multiple of 128 (the last page is padded), a multiple of
    // 32 so W_down can be Q8_0.
    let (d, n_ff) = (512usize, 288usize);
    let s = 1.0 / (d as f32).sqrt();
    let gate = blocky(&mut r, n_ff * d, s);
    let up = blocky(&mut r, n_ff * d, s);
    let down = blocky(&mut r, d * n_ff, s); // W_down: d rows of n_ff
    let gate_q2k = quantize_rows(GgmlType::Q2_K, &gate, d, 3).unwrap();
    let up_bytes: Vec<u8> = up.iter().flat_map(|v| v.to_le_bytes()).collect();
    let down_q8 = q8_rows(&down, n_ff);
    let pages = Pages::from_gguf_parts(
        PageFormat::Q2K,
        d,
        n_ff,
        (GgmlType::Q2_K, &gate_q2k),
        (GgmlType::F32, &up_bytes),
        (GgmlType::Q8_0, &down_q8),
        3,
    )
    .unwrap();
    assert_eq!(pages.n_pages(), 3);
    assert_eq!(PageFormat::Q2K.page_bytes(d), 126 * d);
    assert_eq!(pages.bytes().len(), 3 * PageFormat::Q2K.page_bytes(d));

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
    assert_pages_hold(&pages, &want, n_ff, |page, k, row, i| {
        q2k_page_weight(page, d, k, row, i)
    });
    // From f32: the same as packing mirage-gguf's Q2_K rows.
    let from_f32 = Pages::from_f32(PageFormat::Q2K, d, &gate, &up, &down_t).unwrap();
    let q2k_pages = |g: &[u8], u: &[u8], dt: &[u8]| {
        let [g, u, dt] = [g, u, dt].map(|m| split_q2k_rows(m, m.len() / (d / 256 * 84), d));
        let (g, u, dt) = (g?, u?, dt?);
        Pages::from_split(PageFormat::Q2K, d, n_ff, [(&g, 0.0), (&u, 0.0), (&dt, 0.0)])
    };
    let again = q2k_pages(&gate_q2k, &one_call(&up), &one_call(&down_t)).unwrap();
    assert_eq!(from_f32, again);
    // The scale permutation is one, and split/join are inverses.
    let mut slots: Vec<usize> = (0..16).map(q2k_scale_slot).collect();
    slots.sort_unstable();
    assert_eq!(slots, (0..16).collect::<Vec<_>>());
    let split = split_q2k_rows(&gate_q2k, n_ff, d).unwrap();
    assert_eq!(join_q2k_rows(&split, n_ff, d).unwrap(), gate_q2k);
    // Widths the kernel cannot take, and mismatched shapes.
    let g384 = blocky(&mut r, 128 * 384, 1.0);
    assert!(Pages::from_f32(PageFormat::Q2K, 384, &g384, &g384, &g384).is_err());
    assert!(Pages::from_f32(PageFormat::Q2K, d, &gate, &up, &down_t[d..]).is_err());
    assert!(q2k_pages(&gate_q2k[84..], &gate_q2k, &gate_q2k).is_err());
}

/// Q2_K pages of random weights (`n_ff` rows, the last page padded) and
/// their dequantized weights as a [`PagedFfn`] for [`reference_ffn`].
fn q2k_ffn(r: &mut impl Rng, d: usize, n_ff: usize) -> (Pages, PagedFfn) {
    let s = 1.0 / (d as f32).sqrt();
    let m: Vec<Vec<f32>> = (0..3).map(|_| blocky(r, n_ff * d, 2.0 * s)).collect();
    let pages = Pages::from_f32(PageFormat::Q2K, d, &m[0], &m[1], &m[2]).unwrap();
    let mut f = PagedFfn {
        d,
        q8: Vec::new(),
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
