//! The sparse CUDA backend ([`SparseCudaBackend`]) on a small artifact built
//! here (random FFN whose Q8_0 encoding is exact in both orientations, random
//! BVH router data): all pages vs the dense CUDA FFN, the device routing vs
//! the CPU PageSelector, the forced and routed modes vs the CPU superblock
//! backend and an f64 reference, and the routed FFN replayed from a CUDA
//! graph. With SmolLM2 present, a real artifact end to end against the CPU
//! superblock backend. Without a GPU each test prints why it skips and
//! passes; with MIRAGE_REQUIRE_CUDA_TESTS=1 a missing GPU fails them.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use mirage_artifact::format::{write_bytes, ArtifactMeta, LayerData};
use mirage_artifact::metrics::cosine;
use mirage_artifact::superblock::PageSelector;
use mirage_artifact::{Artifact, SparseMode, SuperblockBackend};
use mirage_cuda::{random_subset, PageSource, SparseCudaBackend, SparsePages};
use mirage_gguf::{quant, GgmlType};
use mirage_route::{Aabb, RouterData};
use mirage_runtime::backend::cpu::CpuActivations;
use mirage_runtime::backend::{Backend, HostMatrix, SharedBytes, StepInputs, TokenSlot};
use mirage_runtime::CpuBackend;
use rand::Rng;

mod common;
use common::{cuda, rng};

const PAGE: usize = 128;
const D: usize = 256;
const N_PAGES: usize = 6;
const N_FF: usize = N_PAGES * PAGE;
const N_LAYER: usize = 2;
const SLICES: usize = 4;

/// `[rows][cols]` weights that Q8_0 encodes exactly along rows and along
/// columns: integers in -126..=126 times 2^-7, with 127 * 2^-7 wherever
/// `i % 32 == j % 32` (every 32-block of a row or a column holds one, so
/// the block scale is exactly 2^-7 both ways).
fn exact_q8_weights(r: &mut impl Rng, rows: usize, cols: usize) -> Vec<f32> {
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

fn q8(values: &[f32], cols: usize) -> Vec<u8> {
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

fn host(name: &str, rows: usize, cols: usize, values: &[f32]) -> HostMatrix {
    HostMatrix {
        name: name.into(),
        ty: GgmlType::Q8_0,
        rows,
        cols,
        data: SharedBytes::from_vec(q8(values, cols)),
    }
}

/// One layer's weights: gate, up `[N_FF][D]`, down `[D][N_FF]` (f32, exact in Q8_0).
struct LayerW {
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

impl LayerW {
    fn host(&self) -> (HostMatrix, HostMatrix, HostMatrix) {
        (
            host("gate", N_FF, D, &self.gate),
            host("up", N_FF, D, &self.up),
            host("down", D, N_FF, &self.down),
        )
    }
    /// f64 FFN over the channels of `pages`.
    fn reference(&self, x: &[f32], pages: &[u32]) -> Vec<f32> {
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

struct Fixture {
    layers: Vec<LayerW>,
    artifact: Arc<Artifact>,
}

/// A 2-layer artifact: identity channel order (page p = channels 128p..),
/// one trunk page, random router boxes over 4 slices with threshold 2.
fn fixture() -> Fixture {
    let mut r = rng(7);
    let layers: Vec<LayerW> = (0..N_LAYER)
        .map(|_| LayerW {
            gate: exact_q8_weights(&mut r, N_FF, D),
            up: exact_q8_weights(&mut r, N_FF, D),
            down: exact_q8_weights(&mut r, D, N_FF),
        })
        .collect();
    let rank = 2;
    let mut lds = Vec::new();
    let mut pages = Vec::new();
    for w in &layers {
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
        };
        pages.push(
            (0..N_PAGES)
                .map(|p| mirage_artifact::pack::pack_page(&ffn, p, GgmlType::Q8_0).unwrap())
                .collect::<Vec<_>>(),
        );
        let boxes: Vec<Aabb> = (0..N_PAGES * SLICES)
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
            n_pages: N_PAGES,
            n_trunk: 1,
            quant: GgmlType::Q8_0,
            perm: (0..N_FF as u32).collect(),
            page_freq: (0..N_PAGES).map(|p| 1.0 - p as f32 * 0.1).collect(),
            router,
            margin_scale: vec![0.1; SLICES * 3],
            predictor_proj: vec![0.0; rank * D],
            predictor_weights: vec![0.0; N_PAGES * (rank + 1)],
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
    Fixture {
        layers,
        artifact: Artifact::from_bytes(bytes).unwrap(),
    }
}

fn xs(seed: u64, n: usize) -> Vec<Vec<f32>> {
    let mut r = rng(seed);
    (0..n)
        .map(|_| (0..D).map(|_| r.random_range(-1.0f32..1.0)).collect())
        .collect()
}

fn sparse(
    test: &str,
    fx: &Fixture,
    mode: SparsePages,
) -> Option<(SparseCudaBackend, Vec<mirage_cuda::SparseFfn>)> {
    let gpu = cuda(test)?;
    let sb = SparseCudaBackend::new(gpu, PageSource::Artifact(fx.artifact.clone()), mode)
        .expect("sparse backend");
    let ffns = fx
        .layers
        .iter()
        .enumerate()
        .map(|(l, w)| {
            let (g, u, d) = w.host();
            sb.upload_ffn(l, &g, &u, &d).expect("upload_ffn")
        })
        .collect();
    Some((sb, ffns))
}

fn run_ffn(sb: &SparseCudaBackend, f: &mirage_cuda::SparseFfn, rows: &[Vec<f32>]) -> Vec<f32> {
    let flat: Vec<f32> = rows.concat();
    let x = sb.inner().upload_activations(rows.len(), D, &flat).unwrap();
    let mut y = sb.new_activations();
    sb.ffn(f, &x, &mut y).unwrap();
    let mut out = Vec::new();
    assert_eq!(sb.read(&y, &mut out).unwrap(), (rows.len(), D));
    out
}

#[test]
fn all_pages_equal_the_dense_cuda_ffn() {
    let fx = fixture();
    let Some((sb, ffns)) = sparse("all_pages_equal_the_dense_cuda_ffn", &fx, SparsePages::All)
    else {
        return;
    };
    let dense = cuda("dense").unwrap();
    let rows = xs(1, 3);
    for (l, w) in fx.layers.iter().enumerate() {
        let (g, u, d) = w.host();
        let df = dense.upload_ffn(l, &g, &u, &d).unwrap();
        let x = dense.upload_activations(3, D, &rows.concat()).unwrap();
        let mut y = dense.new_activations();
        dense.ffn(&df, &x, &mut y).unwrap();
        let mut want = Vec::new();
        dense.read(&y, &mut want).unwrap();
        let got = run_ffn(&sb, &ffns[l], &rows);
        for r in 0..3 {
            let c = cosine(&got[r * D..(r + 1) * D], &want[r * D..(r + 1) * D]);
            let c64 = cosine(
                &got[r * D..(r + 1) * D],
                &w.reference(&rows[r], &(0..N_PAGES as u32).collect::<Vec<_>>()),
            );
            eprintln!(
                "layer {l} row {r}: all-pages sparse vs dense cuda cosine {c:.9}, vs f64 {c64:.9}"
            );
            assert!(c >= 0.9999, "layer {l} row {r}: cosine {c}");
        }
    }
    assert_eq!(sb.active_counts().unwrap(), vec![N_PAGES; N_LAYER]);
}

#[test]
fn device_routing_equals_the_cpu_page_selector() {
    let fx = fixture();
    let margin = fx.artifact.meta().default_margin;
    let mode = SparsePages::Routed {
        margin,
        exact_projection: true,
    };
    let Some((sb, _ffns)) = sparse("device_routing_equals_the_cpu_page_selector", &fx, mode) else {
        return;
    };
    let sel = PageSelector::new(fx.artifact.clone(), SparseMode::Bvh { margin }).unwrap();
    let inputs = xs(2, 300);
    let mut sizes = std::collections::BTreeMap::new();
    let mut fast_diff = 0;
    for exact in [true, false] {
        sb.set_mode(SparsePages::Routed {
            margin,
            exact_projection: exact,
        })
        .unwrap();
        for (i, x) in inputs.iter().enumerate() {
            let xa = sb.inner().upload_activations(1, D, x).unwrap();
            for l in 0..N_LAYER {
                sb.route_only(l, &xa).unwrap();
                let got: Vec<usize> = sb
                    .active_pages(l)
                    .unwrap()
                    .into_iter()
                    .map(|p| p as usize)
                    .collect();
                let want = sel.select(l, x).unwrap().unwrap();
                if exact {
                    assert_eq!(got, want, "input {i} layer {l}: device vs CPU route");
                    *sizes.entry(got.len()).or_insert(0) += 1;
                } else if got != want {
                    fast_diff += 1;
                }
            }
        }
    }
    eprintln!(
        "active-set sizes over {} routes: {sizes:?}; fast projection differed on {fast_diff}",
        inputs.len() * N_LAYER
    );
    assert!(
        sizes.len() >= 3,
        "the fixture must exercise several set sizes: {sizes:?}"
    );
    assert!(
        fast_diff * 100 <= inputs.len() * N_LAYER,
        "fast projection differs on {fast_diff} routes (> 1%)"
    );
}

#[test]
fn forced_and_routed_modes_match_cpu_references() {
    let fx = fixture();
    let Some((sb, ffns)) = sparse(
        "forced_and_routed_modes_match_cpu_references",
        &fx,
        SparsePages::All,
    ) else {
        return;
    };
    let margin = fx.artifact.meta().default_margin;
    let cpu = SuperblockBackend::new(
        CpuBackend::new(1).unwrap(),
        fx.artifact.clone(),
        SparseMode::All,
    )
    .unwrap();
    let cpu_ffns: Vec<_> = fx
        .layers
        .iter()
        .enumerate()
        .map(|(l, w)| {
            let (g, u, d) = w.host();
            cpu.upload_ffn(l, &g, &u, &d).unwrap()
        })
        .collect();
    let inputs = xs(3, 8);
    let cases = [
        (SparsePages::Prefix(3), Some(SparseMode::Prefix(3))),
        (SparsePages::Fraction(0.5), Some(SparseMode::Prefix(3))),
        (
            SparsePages::Routed {
                margin,
                exact_projection: true,
            },
            Some(SparseMode::Bvh { margin }),
        ),
        (
            SparsePages::Random {
                fraction: 0.5,
                seed: 9,
            },
            None,
        ),
    ];
    for (mode, cpu_mode) in cases {
        sb.set_mode(mode).unwrap();
        if let Some(m) = cpu_mode {
            cpu.set_mode(m).unwrap();
        }
        for (l, w) in fx.layers.iter().enumerate() {
            for x in &inputs {
                let got = run_ffn(&sb, &ffns[l], std::slice::from_ref(x));
                let pages: Vec<u32> = match mode {
                    SparsePages::Random { fraction, seed } => random_subset(
                        N_PAGES,
                        mirage_cuda::pages_for_fraction(fraction, N_PAGES),
                        seed ^ l as u64,
                    ),
                    _ => {
                        let sel =
                            PageSelector::new(fx.artifact.clone(), cpu_mode.unwrap()).unwrap();
                        sel.select(l, x)
                            .unwrap()
                            .unwrap()
                            .into_iter()
                            .map(|p| p as u32)
                            .collect()
                    }
                };
                assert_eq!(sb.active_pages(l).unwrap(), pages, "{mode:?} layer {l}");
                let c64 = cosine(&got, &w.reference(x, &pages));
                assert!(
                    c64 >= 0.99999,
                    "{mode:?} layer {l}: vs f64 reference cosine {c64}"
                );
                if cpu_mode.is_some() {
                    let xa = CpuActivations::from_vec(1, D, x.clone()).unwrap();
                    let mut ya = cpu.new_activations();
                    cpu.ffn(&cpu_ffns[l], &xa, &mut ya).unwrap();
                    let c = cosine(&got, ya.row(0));
                    assert!(
                        c >= 0.999,
                        "{mode:?} layer {l}: vs CPU superblock cosine {c}"
                    );
                }
            }
        }
    }
}

#[test]
fn routed_ffn_replays_from_a_cuda_graph() {
    let fx = fixture();
    let margin = fx.artifact.meta().default_margin;
    let mode = SparsePages::Routed {
        margin,
        exact_projection: false,
    };
    let Some((sb, ffns)) = sparse("routed_ffn_replays_from_a_cuda_graph", &fx, mode) else {
        return;
    };
    let inputs = xs(4, 6);
    let mut x = sb.new_activations();
    let (mut h, mut y) = (sb.new_activations(), sb.new_activations());
    let slots = [TokenSlot { seq: 0, pos: 0 }];
    let step = StepInputs {
        tokens: &[0],
        slots: &slots,
        logits_rows: &[0],
    };
    let mut counts = std::collections::BTreeSet::new();
    for xi in &inputs {
        // Eager reference.
        let want = run_ffn(&sb, &ffns[1], &[sb_layer0(&sb, &ffns[0], xi)]);
        // Two chained layers inside one recorded step.
        sb.write_activations(&mut x, 1, D, xi).unwrap();
        sb.step(&step, || {
            sb.ffn(&ffns[0], &x, &mut h)?;
            sb.ffn(&ffns[1], &h, &mut y)
        })
        .unwrap();
        let mut got = Vec::new();
        sb.read(&y, &mut got).unwrap();
        assert_eq!(got, want, "graph replay vs eager launches");
        counts.insert(sb.active_counts().unwrap());
    }
    let st = sb.inner().graph_stats();
    eprintln!("graph stats {st:?}; per-layer active counts seen {counts:?}");
    assert_eq!(st.captures, 1, "one graph for every step: {st:?}");
    assert_eq!(st.replays as usize, inputs.len() - 1);
    assert!(
        counts.len() >= 2,
        "the routed counts must vary between steps: {counts:?}"
    );
}

fn sb_layer0(sb: &SparseCudaBackend, f: &mirage_cuda::SparseFfn, x: &[f32]) -> Vec<f32> {
    run_ffn(sb, f, &[x.to_vec()])
}

/// SmolLM2 with a real artifact: routed sparse CUDA vs the CPU superblock
/// backend (same artifact, same mode, f32 activations on both), 16 greedy
/// tokens (the CPU's; a near-tie may differ) and the last logits.
/// `MIRAGE_SPARSE_MODEL` and `MIRAGE_SPARSE_ARTIFACT` name another model and
/// its prebuilt artifact (the device run uses SmolLM2 cut to 4 blocks, which
/// fits the transfer limit); otherwise the artifact is built here.
#[test]
fn smollm2_routed_matches_cpu_superblock() {
    let model = std::env::var_os("MIRAGE_SPARSE_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../models/smollm2-135m-instruct-q4_1.gguf")
        });
    if !model.exists() {
        assert!(
            std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1"),
            "{} is missing",
            model.display()
        );
        eprintln!(
            "smollm2_routed_matches_cpu_superblock: skipped, {} is missing",
            model.display()
        );
        return;
    }
    let Some(gpu) = cuda("smollm2_routed_matches_cpu_superblock") else {
        return;
    };
    let artifact = match std::env::var_os("MIRAGE_SPARSE_ARTIFACT") {
        Some(p) => Artifact::open(&p).expect("MIRAGE_SPARSE_ARTIFACT"),
        None => build_artifact(&model),
    };
    let margin = artifact.meta().default_margin;
    let file = Arc::new(mirage_gguf::GgufFile::open(&model).unwrap());
    let eo = mirage_runtime::EngineOptions {
        threads: 2,
        n_ctx: 128,
        ..Default::default()
    };
    let sb = SparseCudaBackend::new(
        gpu,
        PageSource::Artifact(artifact.clone()),
        SparsePages::Routed {
            margin,
            exact_projection: false,
        },
    )
    .unwrap();
    // f32 activations outside the FFN and inside it, as the CUDA backend
    // computes.
    let cpu = SuperblockBackend::new(
        CpuBackend::new_f32_activations(0).unwrap(),
        artifact.clone(),
        SparseMode::Bvh { margin },
    )
    .unwrap()
    // Gate/up dotted with f32 x, as the CUDA fused kernel does (the default
    // quantizes x to Q8_0; over a whole model that alone is visible).
    .with_f32_activations();
    let g = mirage_runtime::Engine::from_file(file.clone(), sb, eo.clone()).unwrap();
    let c = mirage_runtime::Engine::from_file(file, cpu, eo).unwrap();
    let mut tokens = g
        .encode("Licensed under the Apache License, Version 2.0", true)
        .unwrap();
    let (mut worst, mut ties) = (1.0f64, 0);
    for step in 0..16 {
        let gl = g.model().logits_all(&tokens, Default::default()).unwrap();
        let cl = c.model().logits_all(&tokens, Default::default()).unwrap();
        let v = gl.len() / tokens.len();
        let (gl, cl) = (&gl[gl.len() - v..], &cl[cl.len() - v..]);
        let cs = cosine(gl, cl);
        worst = worst.min(cs);
        let am = |l: &[f32]| {
            l.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32
        };
        let (g_tok, c_tok) = (am(gl) as usize, am(cl) as usize);
        if g_tok != c_tok {
            // A near-tie may go either way (as in tests/real_models.rs): the
            // CPU's logit gap between the two below 1e-3 of its logit range.
            let (lo, hi) = cl
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            let gap = cl[c_tok] - cl[g_tok];
            assert!(
                gap <= 1e-3 * (hi - lo),
                "step {step}: greedy tokens differ (gpu {g_tok}, cpu {c_tok}, cpu gap {gap}, cosine {cs})"
            );
            ties += 1;
        }
        // Both continue with the CPU's token.
        tokens.push(c_tok as u32);
    }
    let counts = g.model().backend().active_counts().unwrap();
    eprintln!(
        "{}: routed sparse cuda vs cpu superblock: worst last-logit cosine {worst:.6} over 16 greedy steps ({ties} near-tie steps); last token's active pages per layer {counts:?} of {}",
        model.display(),
        artifact.layer(0).n_pages
    );
    assert!(worst >= 0.999, "cosine {worst}");
}

fn build_artifact(model: &std::path::Path) -> Arc<Artifact> {
    let text: String = std::fs::read_to_string("/usr/share/common-licenses/Apache-2.0")
        .map(|t| t.chars().take(1200).collect())
        .unwrap_or_else(|_| "The quick brown fox jumps over the lazy dog. ".repeat(30));
    let opts = mirage_artifact::BuildOptions {
        calib_name: "Apache-2.0 (first 1200 chars)".into(),
        calib_text: text,
        max_calib_tokens: 64,
        threads: 2,
        ..mirage_artifact::BuildOptions::default()
    };
    let built = mirage_artifact::build(model, &opts, &mut |_| {}).expect("artifact build");
    Artifact::from_bytes(built.bytes).unwrap()
}

/// The fixture itself (no GPU): the CPU router sees several set sizes and the
/// CPU superblock backend over every page matches the f64 reference.
#[test]
fn fixture_routes_to_several_set_sizes_on_the_cpu() {
    let fx = fixture();
    let margin = fx.artifact.meta().default_margin;
    let sel = PageSelector::new(fx.artifact.clone(), SparseMode::Bvh { margin }).unwrap();
    let mut sizes = std::collections::BTreeMap::new();
    for x in xs(2, 300) {
        for l in 0..N_LAYER {
            *sizes
                .entry(sel.select(l, &x).unwrap().unwrap().len())
                .or_insert(0) += 1;
        }
    }
    eprintln!("CPU active-set sizes: {sizes:?}");
    assert!(sizes.len() >= 3, "{sizes:?}");
    let cpu = SuperblockBackend::new(
        CpuBackend::new(1).unwrap(),
        fx.artifact.clone(),
        SparseMode::All,
    )
    .unwrap();
    let all: Vec<u32> = (0..N_PAGES as u32).collect();
    for (l, w) in fx.layers.iter().enumerate() {
        let (g, u, d) = w.host();
        let f = cpu.upload_ffn(l, &g, &u, &d).unwrap();
        for x in xs(5, 3) {
            let mut y = cpu.new_activations();
            cpu.ffn(
                &f,
                &CpuActivations::from_vec(1, D, x.clone()).unwrap(),
                &mut y,
            )
            .unwrap();
            let c = cosine(y.row(0), &w.reference(&x, &all));
            assert!(c >= 0.9999, "layer {l}: CPU superblock vs f64 cosine {c}");
        }
    }
}
