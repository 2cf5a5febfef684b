//! Pruned decode attention on the GPU (`mirage_cuda::kv_pruning`): device
//! page boxes equal the host min/max, every page selected equals attention.cu's
//! full split-K attention, and a real selection equals an f64 host reference
//! of the CPU path's rule, for f32, f16 and q8_0 caches (f16 and q8_0 with
//! head size 64 attend the pages on tensor cores, `attend_pages_mma`).
//! Without a GPU each test prints why it skips; with
//! MIRAGE_REQUIRE_CUDA_TESTS=1 a missing GPU fails them.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use half::f16;
use mirage_runtime::kv_cache::{dequantize_q8_0, quantize_q8_0, Q8_0_BLOCK};
use mirage_runtime::kv_pages::{page_upper_bound, KvPruning};
use mirage_runtime::KvDtype;
use rand::{Rng, SeedableRng};

const N_SEQ: usize = 2;
const N_HEAD_KV: usize = 2;
const N_HEAD: usize = 8;
const HD: usize = 64;
const N_CTX: usize = 1000;
const PAGE: usize = 64;

/// Keys, values (device layout [seq, kv head, pos, d]) and queries
/// ([row, head, d]); keys drift by page so that bounds differ. Keys and
/// values are the values a cache of `dtype` holds (f16: rounded; q8_0:
/// quantized per 32 and widened back, as the CPU's cache does).
fn data(seed: u64, dtype: KvDtype) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let n = N_SEQ * N_HEAD_KV * N_CTX * HD;
    let mut k: Vec<f32> = (0..n)
        .map(|i| r.random_range(-1.0f32..1.0) + ((i / HD % N_CTX / PAGE) as f32 * 0.37).sin())
        .collect();
    let mut v: Vec<f32> = (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect();
    match dtype {
        KvDtype::F32 => {}
        KvDtype::F16 => {
            for x in k.iter_mut().chain(v.iter_mut()) {
                *x = f16::from_f32(*x).to_f32();
            }
        }
        KvDtype::Q8_0 => {
            for x in [&mut k, &mut v] {
                let (mut q, mut d) = (vec![0i8; x.len()], vec![f16::ZERO; x.len() / Q8_0_BLOCK]);
                quantize_q8_0(x, &mut q, &mut d);
                dequantize_q8_0(&q, &d, x);
            }
        }
    }
    let q = (0..ROWS.len() * N_HEAD * HD)
        .map(|_| r.random_range(-2.0f32..2.0))
        .collect();
    (k, v, q)
}

/// (seq, pos) of each query row.
const ROWS: [(usize, usize); 3] = [(0, 999), (1, 500), (1, 63)];

fn head_rows(x: &[f32], seq: usize, kvh: usize) -> &[f32] {
    let at = (seq * N_HEAD_KV + kvh) * N_CTX * HD;
    &x[at..at + N_CTX * HD]
}

/// The pages the CPU rule (kv_pages::PageSummaries::select) picks.
fn host_select(cfg: &KvPruning, k: &[f32], q: &[f32], n: usize) -> Vec<usize> {
    let n_pages = n.div_ceil(cfg.page);
    if n_pages <= cfg.max_selected() {
        return (0..n_pages).collect();
    }
    let sinks = cfg.sink_pages.min(n_pages);
    let recent_from = n_pages.saturating_sub(cfg.recent_pages).max(sinks);
    let mut bounds: Vec<(f32, usize)> = (sinks..recent_from)
        .map(|p| {
            let (mut lo, mut hi) = (vec![f32::INFINITY; HD], vec![f32::NEG_INFINITY; HD]);
            for j in p * cfg.page..((p + 1) * cfg.page).min(n) {
                for d in 0..HD {
                    lo[d] = lo[d].min(k[j * HD + d]);
                    hi[d] = hi[d].max(k[j * HD + d]);
                }
            }
            (page_upper_bound(q, &lo, &hi), p)
        })
        .collect();
    bounds.sort_by(|a, b| b.0.total_cmp(&a.0));
    bounds.truncate(cfg.top_pages);
    let mut out: Vec<usize> = (0..sinks)
        .chain(bounds.iter().map(|b| b.1))
        .chain(recent_from..n_pages)
        .collect();
    out.sort_unstable();
    out
}

/// f64 softmax attention of `q` over the positions `< n` of `pages`.
fn host_attend(k: &[f32], v: &[f32], q: &[f32], pages: &[usize], n: usize) -> Vec<f32> {
    let pos: Vec<usize> = pages
        .iter()
        .flat_map(|&p| p * PAGE..((p + 1) * PAGE).min(n))
        .collect();
    let scale = 1.0 / (HD as f64).sqrt();
    let s: Vec<f64> = pos
        .iter()
        .map(|&j| {
            (0..HD)
                .map(|d| q[d] as f64 * k[j * HD + d] as f64)
                .sum::<f64>()
                * scale
        })
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = w.iter().sum();
    (0..HD)
        .map(|d| {
            (pos.iter()
                .zip(&w)
                .map(|(&j, wj)| wj * v[j * HD + d] as f64)
                .sum::<f64>()
                / l) as f32
        })
        .collect()
}

#[cfg(feature = "cuda")]
mod device {
    use super::*;
    use mirage_cuda::kv_pruning::{LayerKvShape, PrunedAttention};
    use mirage_cuda::CudaError;

    fn device(test: &str) -> Option<PrunedAttention> {
        let require = std::env::var("MIRAGE_REQUIRE_CUDA_TESTS").is_ok_and(|v| v == "1");
        match PrunedAttention::new(0) {
            Ok(d) => Some(d),
            Err(e @ (CudaError::DriverNotFound | CudaError::NoDevice { .. })) if !require => {
                eprintln!("{test}: skipped, no CUDA device here: {e}");
                None
            }
            Err(e) => panic!("{test}: CUDA device expected but the pruned-attention kernels failed to start: {e}"),
        }
    }

    fn shape(dtype: KvDtype) -> LayerKvShape {
        LayerKvShape {
            n_seq: N_SEQ,
            n_head_kv: N_HEAD_KV,
            n_ctx: N_CTX,
            head_dim: HD,
            dtype,
            page: PAGE,
        }
    }

    fn slots() -> Vec<i32> {
        ROWS.iter()
            .flat_map(|&(s, p)| [s as i32, p as i32])
            .collect()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn device_page_boxes_equal_host_min_max() {
        let Some(dev) = device("device_page_boxes_equal_host_min_max") else {
            return;
        };
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8_0] {
            let (k, v, _) = data(1, dtype);
            let mut kv = dev.upload_kv(shape(dtype), &k, &v).unwrap();
            let n = 777;
            dev.refresh_bounds(&mut kv, 1, 0, n).unwrap();
            for (head, page) in [(0, 0), (1, 5), (1, n / PAGE)] {
                let (lo, hi) = dev.read_bounds(&kv, 1, head, page).unwrap();
                let rows = head_rows(&k, 1, head);
                for d in 0..HD {
                    let col = (page * PAGE..((page + 1) * PAGE).min(n)).map(|j| rows[j * HD + d]);
                    let (l, h) = col.fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), x| {
                        (l.min(x), h.max(x))
                    });
                    assert_eq!(
                        (lo[d], hi[d]),
                        (l, h),
                        "{dtype:?} head {head} page {page} dim {d}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_page_selected_equals_full_cuda_attention() {
        let Some(mut dev) = device("every_page_selected_equals_full_cuda_attention") else {
            return;
        };
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8_0] {
            let (k, v, q) = data(2, dtype);
            let mut kv = dev.upload_kv(shape(dtype), &k, &v).unwrap();
            for seq in 0..N_SEQ {
                dev.refresh_bounds(&mut kv, seq, 0, N_CTX).unwrap();
            }
            let (dq, ds) = (
                dev.upload_f32(&q).unwrap(),
                dev.upload_i32(&slots()).unwrap(),
            );
            let mut full = dev.upload_f32(&vec![0.0; q.len()]).unwrap();
            let mut pruned = dev.upload_f32(&vec![0.0; q.len()]).unwrap();
            dev.attend(&mut kv, &dq, &ds, ROWS.len(), N_HEAD, None, &mut full)
                .unwrap();
            dev.attend(
                &mut kv,
                &dq,
                &ds,
                ROWS.len(),
                N_HEAD,
                Some(&KvPruning::all_pages(PAGE)),
                &mut pruned,
            )
            .unwrap();
            let (full, pruned) = (
                dev.download_f32(&full).unwrap(),
                dev.download_f32(&pruned).unwrap(),
            );
            // Same keys, another split of the sum: equal to f32 rounding.
            let diff = max_diff(&full, &pruned);
            assert!(
                diff < 2e-5,
                "{dtype:?}: every page selected differs from full attention by {diff}"
            );
            // And both equal the f64 reference over every position.
            for (r, &(seq, pos)) in ROWS.iter().enumerate() {
                for h in 0..N_HEAD {
                    let at = (r * N_HEAD + h) * HD;
                    let kvh = h / (N_HEAD / N_HEAD_KV);
                    let all: Vec<usize> = (0..(pos + 1).div_ceil(PAGE)).collect();
                    let want = host_attend(
                        head_rows(&k, seq, kvh),
                        head_rows(&v, seq, kvh),
                        &q[at..at + HD],
                        &all,
                        pos + 1,
                    );
                    let d = max_diff(&full[at..at + HD], &want);
                    assert!(
                        d < 1e-4,
                        "{dtype:?} row {r} head {h}: full attention off the f64 reference by {d}"
                    );
                }
            }
        }
    }

    #[test]
    fn device_selection_equals_the_cpu_rule() {
        let Some(mut dev) = device("device_selection_equals_the_cpu_rule") else {
            return;
        };
        let cfg = KvPruning {
            page: PAGE,
            sink_pages: 1,
            recent_pages: 2,
            top_pages: 3,
            top_percent: 0,
            dense_layers: 0,
        };
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8_0] {
            let (k, v, q) = data(3, dtype);
            let mut kv = dev.upload_kv(shape(dtype), &k, &v).unwrap();
            for (seq, _) in ROWS {
                dev.refresh_bounds(&mut kv, seq, 0, N_CTX).unwrap();
            }
            let (dq, ds) = (
                dev.upload_f32(&q).unwrap(),
                dev.upload_i32(&slots()).unwrap(),
            );
            let mut out = dev.upload_f32(&vec![0.0; q.len()]).unwrap();
            let mut full = dev.upload_f32(&vec![0.0; q.len()]).unwrap();
            dev.attend(&mut kv, &dq, &ds, ROWS.len(), N_HEAD, Some(&cfg), &mut out)
                .unwrap();
            dev.attend(&mut kv, &dq, &ds, ROWS.len(), N_HEAD, None, &mut full)
                .unwrap();
            let (out, full) = (
                dev.download_f32(&out).unwrap(),
                dev.download_f32(&full).unwrap(),
            );
            // The boxes were refreshed over every position, but row r only
            // sees 0..=pos: rebuild them on the host the same way.
            for (r, &(seq, pos)) in ROWS.iter().enumerate() {
                for h in 0..N_HEAD {
                    let at = (r * N_HEAD + h) * HD;
                    let kvh = h / (N_HEAD / N_HEAD_KV);
                    let (kh, vh) = (head_rows(&k, seq, kvh), head_rows(&v, seq, kvh));
                    // Pages wholly before pos have the same box either way;
                    // the last page's box covers positions past pos on the
                    // device, but it is always selected (recent), so the
                    // choice is unaffected.
                    let pages = host_select(&cfg, kh, &q[at..at + HD], pos + 1);
                    let want = host_attend(kh, vh, &q[at..at + HD], &pages, pos + 1);
                    let d = max_diff(&out[at..at + HD], &want);
                    assert!(d < 1e-4, "{dtype:?} row {r} head {h}: pruned attention off the reference by {d} (pages {pages:?})");
                }
            }
            // The long row really dropped pages, and that changed the output.
            assert!(
                max_diff(&out[..N_HEAD * HD], &full[..N_HEAD * HD]) > 1e-4,
                "pruning changed nothing"
            );
        }
    }
}
