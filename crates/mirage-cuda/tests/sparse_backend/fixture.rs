//! The small artifact the sparse tests run on: random FFN weights whose
//! Q8_0 (or NVFP4) encoding is exact in both orientations, an artifact over
//! them with random BVH router boxes, and the sparse backend and FFN calls
//! every test module drives.

use std::sync::Arc;

use mirage_artifact::format::{write_bytes, ArtifactMeta, LayerData};
use mirage_artifact::Artifact;
use mirage_cuda::sparse::pages::quantize_rows;
use mirage_cuda::{PageSource, SparseCudaBackend, SparsePages};
use mirage_gguf::GgmlType;
use mirage_route::{Aabb, RouterData};
use mirage_runtime::backend::{Backend, HostMatrix, SharedBytes};
use rand::Rng;

use crate::common::{cuda, rng};

pub const PAGE: usize = 128;
pub const D: usize = 256;
pub const N_PAGES: usize = 6;
pub const N_FF: usize = N_PAGES * PAGE;
pub const N_LAYER: usize = 2;
pub const SLICES: usize = 4;

/// `[rows][cols]` weights that Q8_0 encodes exactly along rows and along
/// columns: integers in -126..=126 times 2^-7, with 127 * 2^-7 wherever
/// `i % 32 == j % 32` (every 32-block of a row or a column holds one, so
/// the block scale is exactly 2^-7 both ways).
pub fn exact_q8_weights(r: &mut impl Rng, rows: usize, cols: usize) -> Vec<f32> {
    let s = 1.0 / 128.0;
    (0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            let q = if i % 32 == j % 32 {
                127
            } else {
                r.random_range(-126i32..=126)
            };
            q as f32 * s / 8.0
        })
        .collect()
}

pub fn q8(values: &[f32], cols: usize) -> Vec<u8> {
    quantize_rows(GgmlType::Q8_0, values, cols, 2).unwrap()
}

pub fn host(name: &str, rows: usize, cols: usize, values: &[f32]) -> HostMatrix {
    HostMatrix {
        name: name.into(),
        ty: GgmlType::Q8_0,
        rows,
        cols,
        data: SharedBytes::from_vec(q8(values, cols)),
    }
}

/// One layer's weights: gate, up `[N_FF][D]`, down `[D][N_FF]` (f32, exact in Q8_0).
pub struct LayerW {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

impl LayerW {
    pub fn host(&self) -> (HostMatrix, HostMatrix, HostMatrix) {
        (
            host("gate", N_FF, D, &self.gate),
            host("up", N_FF, D, &self.up),
            host("down", D, N_FF, &self.down),
        )
    }
    /// f64 FFN over the channels of `pages`.
    pub fn reference(&self, x: &[f32], pages: &[u32]) -> Vec<f32> {
        let mut y = vec![0f64; D];
        for &p in pages {
            for c in p as usize * PAGE..(p as usize + 1) * PAGE {
                let dot = |w: &[f32]| {
                    w[c * D..(c + 1) * D]
                        .iter()
                        .zip(x)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                };
                let (g, u) = (dot(&self.gate), dot(&self.up));
                let h = g / (1.0 + (-g).exp()) * u;
                for (j, yj) in y.iter_mut().enumerate() {
                    *yj += self.down[j * N_FF + c] as f64 * h;
                }
            }
        }
        y.into_iter().map(|v| v as f32).collect()
    }
}

pub struct Fixture {
    pub layers: Vec<LayerW>,
    pub artifact: Arc<Artifact>,
}

impl Fixture {
    /// Every layer's FFN uploaded to `b`, in layer order.
    pub fn upload<B: Backend>(&self, b: &B) -> Vec<B::Ffn> {
        self.layers
            .iter()
            .enumerate()
            .map(|(l, w)| {
                let (g, u, d) = w.host();
                b.upload_ffn(l, &g, &u, &d).expect("upload_ffn")
            })
            .collect()
    }
}

/// A 2-layer artifact: identity channel order (page p = channels 128p..),
/// one trunk page, random router boxes over 4 slices with threshold 2.
pub fn fixture() -> Fixture {
    let mut r = rng(7);
    let layers: Vec<LayerW> = (0..N_LAYER)
        .map(|_| LayerW {
            gate: exact_q8_weights(&mut r, N_FF, D),
            up: exact_q8_weights(&mut r, N_FF, D),
            down: exact_q8_weights(&mut r, D, N_FF),
        })
        .collect();
    let identity: Vec<Vec<u32>> = vec![(0..N_FF as u32).collect(); N_LAYER];
    let artifact = artifact_from(&layers, &identity, N_PAGES, &mut r);
    Fixture { layers, artifact }
}

/// An artifact over `layers`: stored channel `k` of layer `l` is source
/// channel `perms[l][k]`, the first `n_pages` pages kept (one trunk page),
/// Q8_0 pages, random router boxes over 4 slices with threshold 2.
pub fn artifact_from(
    layers: &[LayerW],
    perms: &[Vec<u32>],
    n_pages: usize,
    r: &mut impl Rng,
) -> Arc<Artifact> {
    artifact_with_trunks(layers, perms, n_pages, &vec![1; layers.len()], r)
}

/// [`artifact_from`] with `trunks[l]` trunk pages in layer `l`.
pub fn artifact_with_trunks(
    layers: &[LayerW],
    perms: &[Vec<u32>],
    n_pages: usize,
    trunks: &[usize],
    r: &mut impl Rng,
) -> Arc<Artifact> {
    let rank = 2;
    let mut lds = Vec::new();
    let mut pages = Vec::new();
    for ((w, perm), &n_trunk) in layers.iter().zip(perms).zip(trunks) {
        let perm = &perm[..n_pages * PAGE];
        let mut down_t = vec![0f32; N_FF * D];
        for j in 0..D {
            for c in 0..N_FF {
                down_t[c * D + j] = w.down[j * N_FF + c];
            }
        }
        let ffn = mirage_artifact::ffn::FfnF32 {
            d_model: D,
            n_ff: N_FF,
            gate: w.gate.clone(),
            up: w.up.clone(),
            down_t,
        }
        .permuted(&perm.iter().map(|&c| c as usize).collect::<Vec<_>>());
        pages.push(
            (0..n_pages)
                .map(|p| mirage_artifact::pack::pack_page(&ffn, p, GgmlType::Q8_0).unwrap())
                .collect::<Vec<_>>(),
        );
        let boxes: Vec<Aabb> = (0..n_pages * SLICES)
            .map(|_| {
                let c: [f32; 3] = std::array::from_fn(|_| r.random_range(-0.5f32..0.5));
                let h: [f32; 3] = std::array::from_fn(|_| r.random_range(0.2f32..0.7));
                Aabb::new(
                    std::array::from_fn(|a| c[a] - h[a]),
                    std::array::from_fn(|a| c[a] + h[a]),
                )
            })
            .collect();
        let mut router = RouterData::new(SLICES, boxes, 2).unwrap();
        router.d_model = D;
        router.projection = (0..SLICES * 3 * D)
            .map(|_| r.random_range(-1.0f32..1.0) / (D as f32).sqrt())
            .collect();
        router.validate().unwrap();
        lds.push(LayerData {
            n_pages,
            n_trunk,
            quant: GgmlType::Q8_0,
            perm: perm.to_vec(),
            page_freq: (0..n_pages).map(|p| 1.0 - p as f32 * 0.1).collect(),
            router,
            margin_scale: vec![0.1; SLICES * 3],
            predictor_proj: vec![0.0; rank * D],
            predictor_weights: vec![0.0; n_pages * (rank + 1)],
            channel_mean_abs: vec![0.0; N_FF],
            channel_oracle_freq: vec![0.0; N_FF],
        });
    }
    let meta = ArtifactMeta {
        arch: "llama".into(),
        n_layer: N_LAYER,
        d_model: D,
        n_ff: N_FF,
        page_channels: PAGE,
        source_name: "random".into(),
        source_sha256: "0".repeat(64),
        calib_name: "none".into(),
        calib_sha256: "0".repeat(64),
        calib_tokens: 0,
        fit_tokens: 0,
        slices: SLICES,
        predictor_rank: rank,
        oracle_cosine: 0.99,
        default_margin: 0.5,
        default_predictor_threshold: 0.0,
    };
    let bytes = write_bytes(&meta, &lds, &pages).unwrap();
    Artifact::from_bytes(bytes).unwrap()
}

pub fn xs(seed: u64, n: usize) -> Vec<Vec<f32>> {
    let mut r = rng(seed);
    (0..n)
        .map(|_| (0..D).map(|_| r.random_range(-1.0f32..1.0)).collect())
        .collect()
}

pub fn sparse(
    test: &str,
    fx: &Fixture,
    mode: SparsePages,
) -> Option<(SparseCudaBackend, Vec<mirage_cuda::SparseFfn>)> {
    let gpu = cuda(test)?;
    let sb = SparseCudaBackend::new(gpu, PageSource::Artifact(fx.artifact.clone()), mode)
        .expect("sparse backend");
    let ffns = fx.upload(&sb);
    Some((sb, ffns))
}

pub fn run_ffn(sb: &SparseCudaBackend, f: &mirage_cuda::SparseFfn, rows: &[Vec<f32>]) -> Vec<f32> {
    let flat: Vec<f32> = rows.concat();
    let x = sb.inner().upload_activations(rows.len(), D, &flat).unwrap();
    let mut y = sb.new_activations();
    sb.ffn(f, &x, &mut y).unwrap();
    let mut out = Vec::new();
    assert_eq!(sb.read(&y, &mut out).unwrap(), (rows.len(), D));
    out
}

/// A random permutation of `0..n`.
pub fn random_perm(r: &mut impl Rng, n: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        v.swap(i, r.random_range(0..=i));
    }
    v
}

/// E2M1 magnitudes.
pub const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// `[rows][cols]` weights that NVFP4 encodes the same along rows and along
/// columns: E2M1 values times `scale` (a power of 2), with ±6 wherever
/// `i % 16 == j % 16`, so every 16-block of a row or of a column (and the
/// whole matrix) has absolute maximum 6 · scale: the tensor scale is
/// 6 · scale / 2688, every block scale 448 (E4M3's largest) and every
/// weight decodes to its code times the same `448 · tensor_scale`. So the
/// dense backend's NVFP4 `W_down` and the pages' NVFP4 `W_downᵀ` hold the
/// same values.
pub fn exact_nvfp4_weights(r: &mut impl Rng, rows: usize, cols: usize, scale: f32) -> Vec<f32> {
    (0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            let m = if i % 16 == j % 16 {
                6.0
            } else {
                E2M1[r.random_range(0..8usize)]
            };
            if r.random_bool(0.5) {
                -m * scale
            } else {
                m * scale
            }
        })
        .collect()
}
