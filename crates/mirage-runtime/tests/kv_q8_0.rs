//! The q8_0 KV cache: block round trip within half a step, attention close
//! to the f32 cache on random data, SmolLM2's logits close to the f32
//! cache's, and the KV-page path over q8_0 equal to its full attention.

mod common;
use common::{cosine, model_path};

use half::f16;
use mirage_runtime::kv_cache::{dequantize_q8_0, quantize_q8_0, KvCache, KvDtype, KvSpec};
use mirage_runtime::kv_pages::KvPruning;
use mirage_runtime::{Engine, EngineOptions};

fn wave(n: usize, seed: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.731 + seed) * 1.37).sin() * (1.0 + (i % 7) as f32))
        .collect()
}

#[test]
fn q8_0_round_trip_is_within_half_a_step() {
    let x = wave(128, 0.3);
    let (mut q, mut d, mut y) = (vec![0i8; 128], vec![f16::ZERO; 4], vec![0f32; 128]);
    quantize_q8_0(&x, &mut q, &mut d);
    dequantize_q8_0(&q, &d, &mut y);
    for (b, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Half a step of the f32 scale, plus the f16 rounding of the scale.
        let tol = amax / 127.0 * 0.5 + amax * 2f32.powi(-10);
        for (a, c) in xb.iter().zip(yb) {
            assert!((a - c).abs() <= tol, "block {b}: {a} -> {c} (tol {tol})");
        }
    }
    assert!(KvCache::new(KvSpec {
        n_layer: 1,
        n_head_kv: 1,
        head_dim: 48,
        n_ctx: 4,
        n_seq: 1,
        dtype: KvDtype::Q8_0
    })
    .is_err());
}

#[test]
fn q8_0_attention_is_close_to_f32_and_pages_equal_full() {
    let spec = |dtype| KvSpec {
        n_layer: 1,
        n_head_kv: 2,
        head_dim: 64,
        n_ctx: 300,
        n_seq: 1,
        dtype,
    };
    let (mut a, mut b) = (
        KvCache::new(spec(KvDtype::F32)).unwrap(),
        KvCache::new(spec(KvDtype::Q8_0)).unwrap(),
    );
    b.enable_kv_pruning(KvPruning::all_pages(32)).unwrap();
    for pos in 0..300 {
        let (k, v) = (wave(128, pos as f32), wave(128, 0.5 - pos as f32));
        a.write(0, 0, pos, &k, &v).unwrap();
        b.write(0, 0, pos, &k, &v).unwrap();
    }
    let q = wave(64, 9.0);
    let (mut s, mut oa, mut ob, mut op) = (
        vec![0f32; 300],
        vec![0f32; 64],
        vec![0f32; 64],
        vec![0f32; 64],
    );
    a.attend(0, 0, 1, 300, &q, 0.125, &mut s, &mut oa);
    b.attend(0, 0, 1, 300, &q, 0.125, &mut s, &mut ob);
    b.attend_maybe_pruned(0, 0, 1, 300, &q, 0.125, true, &mut s, &mut op);
    let c = cosine(&oa, &ob);
    assert!(c > 0.999, "q8_0 vs f32 attention cosine {c}");
    let diff = ob
        .iter()
        .zip(&op)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(diff < 1e-5, "q8_0 page path vs its full attention: {diff}");
}

#[test]
fn smollm2_q8_0_cache_logits_close_to_f32() {
    let Some(path) = model_path("smollm2-135m-instruct-q4_1.gguf") else {
        return;
    };
    let logits = |kv_dtype| {
        let engine = Engine::load(
            &path,
            EngineOptions {
                threads: 2,
                n_ctx: 512,
                kv_dtype,
                ..EngineOptions::default()
            },
        )
        .unwrap();
        let mut prompt = engine
            .encode(include_str!("../src/kv_cache.rs"), false)
            .unwrap();
        prompt.truncate(400);
        let mut s = engine.session().unwrap();
        s.feed(&prompt).unwrap();
        let mut out = vec![s.feed(&[42]).unwrap().to_vec()];
        out.push(s.feed(&[7]).unwrap().to_vec());
        out
    };
    let (f32s, q8s) = (logits(KvDtype::F32), logits(KvDtype::Q8_0));
    for (i, (a, b)) in f32s.iter().zip(&q8s).enumerate() {
        let c = cosine(a, b);
        let argmax = |v: &[f32]| {
            v.iter()
                .enumerate()
                .max_by(|x, y| x.1.total_cmp(y.1))
                .map(|x| x.0)
        };
        eprintln!("decode step {i}: q8_0 vs f32 KV logit cosine {c:.6}");
        assert!(c > 0.995, "step {i}: cosine {c}");
        assert_eq!(argmax(a), argmax(b), "step {i}: greedy token differs");
    }
}
