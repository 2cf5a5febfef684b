//! KV-page pruning: page bounds, summaries, pruned attention vs full
//! attention on random data and on SmolLM2's logits.

mod common;
use common::{cosine, model_path};
use std::path::PathBuf;
use std::sync::Arc;

use mirage_gguf::GgufFile;
use mirage_runtime::attention_pruned::attend_pages;
use mirage_runtime::backend::{Backend, TokenSlot};
use mirage_runtime::kv_cache::{KvCache, KvDtype, KvSpec};
use mirage_runtime::kv_pages::{page_upper_bound, KvPruning};
use mirage_runtime::{CpuBackend, Model};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn spec(n_ctx: usize, dtype: KvDtype) -> KvSpec {
    KvSpec {
        n_layer: 2,
        n_head_kv: 2,
        head_dim: 16,
        n_ctx,
        n_seq: 2,
        dtype,
    }
}

fn random_row(rng: &mut StdRng, n: usize, spread: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-spread..spread)).collect()
}

/// Fills `n` positions of every layer of `seq` with random rows; returns the keys written.
fn fill(
    cache: &mut KvCache,
    rng: &mut StdRng,
    seq: usize,
    from: usize,
    to: usize,
) -> Vec<Vec<Vec<f32>>> {
    let s = *cache.spec();
    let w = s.n_head_kv * s.head_dim;
    let mut keys = vec![Vec::new(); s.n_layer];
    for pos in from..to {
        for (l, kl) in keys.iter_mut().enumerate() {
            let k = random_row(rng, w, 2.0);
            let v = random_row(rng, w, 1.0);
            cache.write(l, seq, pos, &k, &v).unwrap();
            kl.push(k);
        }
    }
    keys
}

/// Reference min/max of positions `page*p..min((page+1)*p, n)` read back from the cache.
fn reference_box(
    cache: &KvCache,
    layer: usize,
    seq: usize,
    head: usize,
    page: usize,
    p: usize,
    n: usize,
) -> (Vec<f32>, Vec<f32>) {
    let hd = cache.spec().head_dim;
    let (mut lo, mut hi) = (vec![f32::INFINITY; hd], vec![f32::NEG_INFINITY; hd]);
    let mut row = vec![0.0; hd];
    for pos in page * p..((page + 1) * p).min(n) {
        cache.head_view(layer, seq, head).key(pos, &mut row);
        for d in 0..hd {
            lo[d] = lo[d].min(row[d]);
            hi[d] = hi[d].max(row[d]);
        }
    }
    (lo, hi)
}

fn assert_summaries_exact(cache: &KvCache, seq: usize, n: usize) {
    let sums = cache.page_summaries().expect("summaries kept");
    let p = sums.page();
    let s = *cache.spec();
    for layer in 0..s.n_layer {
        assert_eq!(
            sums.len(layer, seq),
            n,
            "summarized length of layer {layer}"
        );
        for head in 0..s.n_head_kv {
            for page in 0..n.div_ceil(p) {
                let (lo, hi) = reference_box(cache, layer, seq, head, page, p, n);
                let (slo, shi) = sums.bounds(layer, seq, head, page);
                assert_eq!(
                    slo,
                    &lo[..],
                    "min of layer {layer} head {head} page {page} at n={n}"
                );
                assert_eq!(
                    shi,
                    &hi[..],
                    "max of layer {layer} head {head} page {page} at n={n}"
                );
            }
        }
    }
}

#[test]
fn upper_bound_is_never_below_the_true_max() {
    let mut rng = StdRng::seed_from_u64(7);
    for case in 0..2000 {
        let d = 1 + case % 33;
        let n = 1 + rng.random_range(0..70usize);
        let keys: Vec<Vec<f32>> = (0..n).map(|_| random_row(&mut rng, d, 3.0)).collect();
        let q = random_row(&mut rng, d, 4.0);
        let lo: Vec<f32> = (0..d)
            .map(|i| keys.iter().map(|k| k[i]).fold(f32::INFINITY, f32::min))
            .collect();
        let hi: Vec<f32> = (0..d)
            .map(|i| keys.iter().map(|k| k[i]).fold(f32::NEG_INFINITY, f32::max))
            .collect();
        let bound = page_upper_bound(&q, &lo, &hi) as f64;
        let true_max = keys
            .iter()
            .map(|k| {
                q.iter()
                    .zip(k)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
            })
            .fold(f64::NEG_INFINITY, f64::max);
        assert!(
            bound >= true_max - 1e-4 * (1.0 + true_max.abs()),
            "case {case}: bound {bound} < max {true_max}"
        );
        // Tight for one key: the box is a point.
        if n == 1 {
            assert!((bound - true_max).abs() < 1e-4 * (1.0 + true_max.abs()));
        }
    }
}

#[test]
fn summaries_stay_exact_after_appends_and_truncation() {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut rng = StdRng::seed_from_u64(11);
        let mut cache = KvCache::new(spec(300, dtype)).unwrap();
        cache
            .enable_kv_pruning(KvPruning {
                page: 64,
                ..KvPruning::default()
            })
            .unwrap();
        fill(&mut cache, &mut rng, 1, 0, 200);
        assert_summaries_exact(&cache, 1, 200);
        assert_eq!(
            cache.page_summaries().unwrap().len(0, 0),
            0,
            "other sequence untouched"
        );
        // Cut inside a page: its box shrinks to the keys that remain.
        cache.truncate(1, 150);
        assert_summaries_exact(&cache, 1, 150);
        // Re-append different keys over the forgotten positions.
        fill(&mut cache, &mut rng, 1, 150, 260);
        assert_summaries_exact(&cache, 1, 260);
        // Cut on a page boundary, then append: the page is rebuilt, not widened.
        cache.truncate(1, 128);
        fill(&mut cache, &mut rng, 1, 128, 140);
        assert_summaries_exact(&cache, 1, 140);
        cache.clear();
        fill(&mut cache, &mut rng, 1, 0, 5);
        assert_summaries_exact(&cache, 1, 5);
    }
}

#[test]
fn pruned_attention_with_every_page_equals_full_attention() {
    let mut rng = StdRng::seed_from_u64(3);
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut cache = KvCache::new(spec(700, dtype)).unwrap();
        cache.enable_kv_pruning(KvPruning::all_pages(64)).unwrap();
        fill(&mut cache, &mut rng, 0, 0, 677);
        let hd = cache.spec().head_dim;
        for n in [1, 63, 64, 65, 400, 677] {
            for head in 0..2 {
                let q = random_row(&mut rng, hd, 1.5);
                let mut scores = vec![0.0; n];
                let (mut full, mut pruned, mut shuffled) =
                    (vec![0.0; hd], vec![0.0; hd], vec![0.0; hd]);
                cache.attend(1, 0, head, n, &q, 0.25, &mut scores, &mut full);
                cache.attend_maybe_pruned(1, 0, head, n, &q, 0.25, true, &mut scores, &mut pruned);
                // Page order does not matter.
                let mut pages: Vec<usize> = (0..n.div_ceil(64)).rev().collect();
                let half = pages.len() / 2;
                pages.rotate_left(half);
                attend_pages(
                    &cache.head_view(1, 0, head),
                    64,
                    &pages,
                    n,
                    &q,
                    0.25,
                    &mut scores,
                    &mut shuffled,
                );
                for d in 0..hd {
                    assert!(
                        (full[d] - pruned[d]).abs() < 1e-5,
                        "{dtype:?} n={n} d={d}: {} vs {}",
                        full[d],
                        pruned[d]
                    );
                    assert!(
                        (full[d] - shuffled[d]).abs() < 1e-5,
                        "{dtype:?} n={n} d={d}: {} vs {}",
                        full[d],
                        shuffled[d]
                    );
                }
            }
        }
    }
}

#[test]
fn pruned_attention_is_exact_over_the_selected_positions() {
    // An independent f64 softmax over exactly the positions of the selected pages.
    let mut rng = StdRng::seed_from_u64(5);
    let mut cache = KvCache::new(spec(600, KvDtype::F32)).unwrap();
    let cfg = KvPruning {
        page: 32,
        sink_pages: 1,
        recent_pages: 2,
        top_pages: 3,
        top_percent: 0,
        dense_layers: 0,
    };
    cache.enable_kv_pruning(cfg).unwrap();
    fill(&mut cache, &mut rng, 0, 0, 555);
    let hd = 16;
    let n = 555;
    let q = random_row(&mut rng, hd, 1.5);
    let sums = cache.page_summaries().unwrap();
    let (mut bounds, mut pages) = (Vec::new(), Vec::new());
    sums.select(&cfg, 0, 0, 1, n, &q, &mut bounds, &mut pages);
    let n_pages = n.div_ceil(32);
    assert_eq!(pages.len(), 6);
    assert_eq!(pages[0], 0, "sink page");
    assert_eq!(&pages[4..], &[n_pages - 2, n_pages - 1], "recent pages");
    // The top pages have the highest bounds among the middle pages.
    let bound = |p: usize| {
        let (lo, hi) = sums.bounds(0, 0, 1, p);
        page_upper_bound(&q, lo, hi)
    };
    let worst_kept = pages[1..4]
        .iter()
        .map(|&p| bound(p))
        .fold(f32::INFINITY, f32::min);
    for p in 1..n_pages - 2 {
        if !pages.contains(&p) {
            assert!(
                bound(p) <= worst_kept,
                "page {p} dropped with bound {} > {worst_kept}",
                bound(p)
            );
        }
    }
    let mut scores = vec![0.0; n];
    let mut out = vec![0.0; hd];
    cache.attend_maybe_pruned(0, 0, 1, n, &q, 0.3, true, &mut scores, &mut out);
    let view = cache.head_view(0, 0, 1);
    let positions: Vec<usize> = pages
        .iter()
        .flat_map(|&p| p * 32..((p + 1) * 32).min(n))
        .collect();
    let mut row = vec![0.0; hd];
    let logits: Vec<f64> = positions
        .iter()
        .map(|&j| {
            view.key(j, &mut row);
            q.iter()
                .zip(&row)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
                * 0.3
        })
        .collect();
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
    let z: f64 = w.iter().sum();
    let mirage_runtime::attention_pruned::KvHeadView::F32 { v, .. } = view else {
        panic!("f32 cache")
    };
    for d in 0..hd {
        let want: f64 = positions
            .iter()
            .zip(&w)
            .map(|(&j, wj)| wj / z * v[j * hd + d] as f64)
            .sum();
        assert!(
            (want - out[d] as f64).abs() < 1e-5,
            "d={d}: {want} vs {}",
            out[d]
        );
    }
    // Switched off, the same cache attends every position.
    cache.set_kv_pruning(None).unwrap();
    let mut full = vec![0.0; hd];
    cache.attend_maybe_pruned(0, 0, 1, n, &q, 0.3, true, &mut scores, &mut full);
    let mut want = vec![0.0; hd];
    cache.attend(0, 0, 1, n, &q, 0.3, &mut scores, &mut want);
    assert_eq!(full, want);
    assert!(
        cache
            .set_kv_pruning(Some(KvPruning { page: 16, ..cfg }))
            .is_err(),
        "page size is fixed"
    );
}

#[test]
fn smollm2_logits_with_every_page_selected_equal_full_attention() {
    let Some(path) = model_path("smollm2-135m-instruct-q4_1.gguf") else {
        return;
    };
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let tokenizer = mirage_tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let backend = CpuBackend::new(2)
        .unwrap()
        .with_kv_pruning(KvPruning::all_pages(64))
        .unwrap();
    let model = Model::load(file, backend).unwrap();
    // ~1.5k tokens of real text: this crate's own sources.
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut text = String::new();
    for f in ["kv_cache.rs", "engine.rs", "sampling.rs", "model.rs"] {
        text.push_str(&std::fs::read_to_string(src.join(f)).unwrap());
    }
    let mut tokens = tokenizer.encode(&text, false, false).unwrap();
    tokens.truncate(1500);
    assert_eq!(tokens.len(), 1500, "prompt long enough");
    let n = tokens.len();
    let (prompt, tail) = tokens.split_at(n - 3);
    let mut cache = model.new_kv_cache(n, 1, KvDtype::F32).unwrap();
    let mut scratch = model.new_scratch();
    let slots: Vec<TokenSlot> = (0..prompt.len())
        .map(|pos| TokenSlot { seq: 0, pos })
        .collect();
    let mut logits = Vec::new();
    model
        .forward(prompt, &slots, &[], &mut cache, &mut scratch, &mut logits)
        .unwrap();
    // Decode the tail one token at a time, with the page path (every page
    // selected), then again with full attention after truncating back.
    let decode = |cache: &mut KvCache,
                  scratch: &mut mirage_runtime::model::Scratch<CpuBackend>|
     -> Vec<Vec<f32>> {
        let mut out = Vec::new();
        for (i, &t) in tail.iter().enumerate() {
            let mut l = Vec::new();
            model
                .forward(
                    &[t],
                    &[TokenSlot {
                        seq: 0,
                        pos: prompt.len() + i,
                    }],
                    &[0],
                    cache,
                    scratch,
                    &mut l,
                )
                .unwrap();
            out.push(l);
        }
        out
    };
    let paged = decode(&mut cache, &mut scratch);
    cache.truncate(0, prompt.len());
    cache.set_kv_pruning(None).unwrap();
    let full = decode(&mut cache, &mut scratch);
    for (i, (a, b)) in paged.iter().zip(&full).enumerate() {
        let max_diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(max_diff < 1e-3, "step {i}: logits differ by {max_diff}");
        assert!(
            cosine(a, b) > 0.999_999,
            "step {i}: cosine {}",
            cosine(a, b)
        );
    }
    // Real pruning (a quarter of the 24 pages) stays close on this text.
    cache.truncate(0, prompt.len());
    cache
        .set_kv_pruning(Some(KvPruning {
            page: 64,
            sink_pages: 1,
            recent_pages: 2,
            top_pages: 3,
            top_percent: 0,
            dense_layers: 0,
        }))
        .unwrap();
    let pruned = decode(&mut cache, &mut scratch);
    let cos = cosine(&pruned[2], &full[2]);
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
            .unwrap()
    };
    eprintln!(
        "SmolLM2 n={n}: pruned (6 of 24 pages) vs full cosine {cos:.6}, argmax {} vs {}",
        argmax(&pruned[2]),
        argmax(&full[2])
    );
    assert!(cos > 0.95, "pruned vs full cosine {cos}");
}

/// `Backend::kv_set_pruning` switches the page selection of one cache
/// between runs from the same prefix, as `mirage-cli eval-long` does: off,
/// its decode logits are bit-identical to a cache made without pruning; on,
/// to a cache made with it (the summaries were kept up to date while it was
/// off); off again, to the unpruned cache once more. `None` is accepted on a
/// cache without summaries, `Some` is refused there and with another page
/// size.
#[test]
fn smollm2_pruning_toggled_on_one_cache_equals_dedicated_caches() {
    let Some(path) = model_path("smollm2-135m-instruct-q4_1.gguf") else {
        return;
    };
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let tokenizer = mirage_tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let model = Model::load(file, CpuBackend::new(2).unwrap()).unwrap();
    let b = model.backend();
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut text = String::new();
    for f in ["kv_pages.rs", "engine.rs"] {
        text.push_str(&std::fs::read_to_string(src.join(f)).unwrap());
    }
    let mut tokens = tokenizer.encode(&text, false, false).unwrap();
    tokens.truncate(700);
    assert_eq!(tokens.len(), 700, "prompt long enough");
    let (prompt, tail) = tokens.split_at(694);
    // 22 pages of 32 at the prompt's end, 6 attended: the selection prunes.
    let cfg = KvPruning {
        page: 32,
        sink_pages: 1,
        recent_pages: 2,
        top_pages: 3,
        top_percent: 0,
        dense_layers: 0,
    };
    let mut scratch = model.new_scratch();
    let prefilled = |pruning: Option<KvPruning>,
                     scratch: &mut mirage_runtime::model::Scratch<CpuBackend>|
     -> KvCache {
        let mut cache = model
            .new_kv_cache_pruned(tokens.len(), 1, KvDtype::F32, pruning)
            .unwrap();
        let slots: Vec<TokenSlot> = (0..prompt.len())
            .map(|pos| TokenSlot { seq: 0, pos })
            .collect();
        model
            .forward(prompt, &slots, &[], &mut cache, scratch, &mut Vec::new())
            .unwrap();
        cache
    };
    let decode = |cache: &mut KvCache,
                  scratch: &mut mirage_runtime::model::Scratch<CpuBackend>|
     -> Vec<Vec<f32>> {
        let mut out = Vec::new();
        for (i, &t) in tail.iter().enumerate() {
            let mut l = Vec::new();
            model
                .forward(
                    &[t],
                    &[TokenSlot {
                        seq: 0,
                        pos: prompt.len() + i,
                    }],
                    &[0],
                    cache,
                    scratch,
                    &mut l,
                )
                .unwrap();
            out.push(l);
        }
        out
    };
    let full = decode(&mut prefilled(None, &mut scratch), &mut scratch);
    let pruned = decode(&mut prefilled(Some(cfg), &mut scratch), &mut scratch);
    assert_ne!(full, pruned, "the selection prunes nothing");

    let mut cache = prefilled(Some(cfg), &mut scratch);
    b.kv_set_pruning(&mut cache, None).unwrap();
    assert_eq!(cache.kv_pruning(), None);
    assert_eq!(decode(&mut cache, &mut scratch), full, "selection off");
    // The boxes kept up with the full-attention steps.
    assert_summaries_exact(&cache, 0, tokens.len());
    b.kv_truncate(&mut cache, 0, prompt.len());
    b.kv_set_pruning(&mut cache, Some(cfg)).unwrap();
    assert_eq!(cache.kv_pruning(), Some(&cfg));
    assert_eq!(
        decode(&mut cache, &mut scratch),
        pruned,
        "selection back on"
    );
    b.kv_truncate(&mut cache, 0, prompt.len());
    b.kv_set_pruning(&mut cache, None).unwrap();
    assert_eq!(
        decode(&mut cache, &mut scratch),
        full,
        "selection off again"
    );

    // Same page size, another budget: accepted; another page size: refused.
    let wider = KvPruning {
        top_pages: 5,
        ..cfg
    };
    b.kv_set_pruning(&mut cache, Some(wider)).unwrap();
    assert_eq!(cache.kv_pruning(), Some(&wider));
    let err = b
        .kv_set_pruning(&mut cache, Some(KvPruning { page: 64, ..cfg }))
        .unwrap_err();
    assert!(err.to_string().contains("page size"), "{err}");
    // A cache without summaries: already full attention; cannot prune.
    let mut plain = model.new_kv_cache(64, 1, KvDtype::F32).unwrap();
    b.kv_set_pruning(&mut plain, None).unwrap();
    assert!(b.kv_set_pruning(&mut plain, Some(cfg)).is_err());
}

/// Fills positions `from..to` of every layer of sequence 0 with keys that
/// drift (a random walk plus noise, like real keys: neighbouring pages are
/// alike, far ones differ), so that group bounds discriminate.
fn fill_drifting(cache: &mut KvCache, rng: &mut StdRng, from: usize, to: usize) {
    let s = *cache.spec();
    let w = s.n_head_kv * s.head_dim;
    let mut walk = vec![0.0f32; w];
    for pos in from..to {
        for (i, x) in walk.iter_mut().enumerate() {
            *x += rng.random_range(-0.3..0.3) + if i % 3 == 0 { 0.002 } else { 0.0 };
        }
        for l in 0..s.n_layer {
            let k: Vec<f32> = walk
                .iter()
                .map(|&x| x + rng.random_range(-0.5..0.5))
                .collect();
            let v = random_row(rng, w, 1.0);
            cache.write(l, 0, pos, &k, &v).unwrap();
        }
    }
}

/// The hierarchy (PageSelector::Bvh) selects exactly the pages of the flat
/// scan, for many queries, budgets and lengths, after truncations and
/// rewrites; every group box contains its pages' boxes; attention through
/// either selector is bit-identical. Prints the bound evaluations of both.
#[test]
fn bvh_page_selection_equals_flat_scan() {
    use mirage_runtime::kv_pages::{PageSelector, PAGE_GROUP};
    let mut rng = StdRng::seed_from_u64(21);
    let spec = KvSpec {
        n_layer: 2,
        n_head_kv: 2,
        head_dim: 16,
        n_ctx: 4200,
        n_seq: 1,
        dtype: KvDtype::F32,
    };
    let cfgs = [
        KvPruning {
            page: 16,
            sink_pages: 4,
            recent_pages: 8,
            top_pages: 32,
            top_percent: 0,
            dense_layers: 0,
        },
        KvPruning {
            page: 16,
            sink_pages: 4,
            recent_pages: 8,
            top_pages: 32,
            top_percent: 20,
            dense_layers: 0,
        },
        KvPruning {
            page: 8,
            sink_pages: 0,
            recent_pages: 1,
            top_pages: 1,
            top_percent: 0,
            dense_layers: 0,
        },
        KvPruning {
            page: 64,
            sink_pages: 1,
            recent_pages: 2,
            top_pages: 0,
            top_percent: 0,
            dense_layers: 0,
        },
    ];
    let (mut flat_evals, mut bvh_evals) = (0usize, 0usize);
    for cfg in cfgs {
        let mut cache = KvCache::new(spec).unwrap();
        cache.enable_kv_pruning(cfg).unwrap();
        fill_drifting(&mut cache, &mut rng, 0, 4000);
        // Truncate into the middle of a page and of a group, then rewrite.
        cache.truncate(0, 2345);
        fill_drifting(&mut cache, &mut rng, 2345, 4100);
        let sums = cache.page_summaries().unwrap();
        for layer in 0..2 {
            for head in 0..2 {
                let n_pages = 4100usize.div_ceil(cfg.page);
                for g in 0..n_pages.div_ceil(PAGE_GROUP) {
                    let (glo, ghi) = sums.group_bounds(layer, 0, head, g);
                    for p in g * PAGE_GROUP..((g + 1) * PAGE_GROUP).min(n_pages) {
                        let (lo, hi) = sums.bounds(layer, 0, head, p);
                        for d in 0..16 {
                            assert!(
                                glo[d] <= lo[d] && ghi[d] >= hi[d],
                                "group {g} does not contain page {p}"
                            );
                        }
                    }
                }
            }
        }
        let (mut bounds, mut groups, mut heap) =
            (Vec::new(), Vec::new(), std::collections::BinaryHeap::new());
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for i in 0..200 {
            let n = [4100, 4099, 2346, 1000, 300, 17][i % 6];
            let (layer, head) = (i % 2, (i / 2) % 2);
            let q = random_row(&mut rng, 16, 1.5);
            sums.select(&cfg, layer, 0, head, n, &q, &mut bounds, &mut a);
            let evals =
                sums.select_bvh(&cfg, layer, 0, head, n, &q, &mut groups, &mut heap, &mut b);
            assert_eq!(a, b, "{cfg:?} n={n} layer {layer} head {head}: flat vs bvh");
            let n_pages = n.div_ceil(cfg.page);
            if n_pages > cfg.max_selected_for(n_pages) {
                flat_evals += n_pages - cfg.sink_pages.min(n_pages) - cfg.recent_pages.min(n_pages);
                bvh_evals += evals;
            }
        }
        // Attention through either selector: the same pages, the same bits.
        let q = random_row(&mut rng, 16, 1.5);
        let mut out = [vec![0.0f32; 16], vec![0.0f32; 16]];
        let mut scores = vec![0.0f32; 4100];
        let mut counted = Vec::new();
        for (sel, o) in [PageSelector::Flat, PageSelector::Bvh]
            .into_iter()
            .zip(out.iter_mut())
        {
            cache.set_page_selector(sel).unwrap();
            cache.selection_stats().unwrap().reset();
            cache.attend_maybe_pruned(1, 0, 1, 4100, &q, 0.25, true, &mut scores, o);
            counted.push(cache.selection_stats().unwrap().get());
        }
        assert_eq!(
            out[0], out[1],
            "{cfg:?}: attention differs between selectors"
        );
        // One pruned query each; the flat scan evaluates every candidate page,
        // the hierarchy reports what it computed against the same flat count.
        let n_pages = 4100usize.div_ceil(cfg.page);
        let candidates = (n_pages - cfg.sink_pages - cfg.recent_pages) as u64;
        assert_eq!(
            counted[0],
            (1, candidates, candidates),
            "{cfg:?}: flat stats"
        );
        assert_eq!(
            (counted[1].0, counted[1].2),
            (1, candidates),
            "{cfg:?}: bvh stats"
        );
        // (With no top pages to find the hierarchy computes no bound at all.)
        assert_eq!(
            counted[1].1 > 0,
            cfg.top_for(n_pages) > 0,
            "{cfg:?}: bvh bounds {}",
            counted[1].1
        );
    }
    eprintln!("bound evaluations over the queries that prune: flat {flat_evals}, bvh {bvh_evals}");
}
