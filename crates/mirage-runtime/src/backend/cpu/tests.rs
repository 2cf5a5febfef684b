//! Tests of the CPU backend's ops against scalar and by-hand references.

use super::*;
use crate::backend::{AttentionParams, SharedBytes, TokenSlot};
use crate::kv_cache::{KvDtype, KvSpec};
use crate::ops::RopeMode;

/// Deterministic values in about [-1, 1] (an LCG).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn q8_matrix(name: &str, seed: u64, rows: usize, cols: usize) -> HostMatrix {
    let mut data = vec![0u8; quant::row_bytes(GgmlType::Q8_0, cols).unwrap() * rows];
    quant::quantize(GgmlType::Q8_0, &values(seed, rows * cols), &mut data).unwrap();
    HostMatrix {
        name: name.into(),
        ty: GgmlType::Q8_0,
        rows,
        cols,
        data: SharedBytes::from_vec(data),
    }
}

fn acts(rows: usize, width: usize, seed: u64) -> CpuActivations {
    CpuActivations::from_vec(rows, width, values(seed, rows * width)).unwrap()
}

/// Largest |a - b| over the largest |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn quantized_matrix(ty: GgmlType, seed: u64, rows: usize, cols: usize) -> HostMatrix {
    let mut data = vec![0u8; quant::row_bytes(ty, cols).unwrap() * rows];
    quant::quantize(ty, &values(seed, rows * cols), &mut data).unwrap();
    HostMatrix {
        name: format!("w {ty}"),
        ty,
        rows,
        cols,
        data: SharedBytes::from_vec(data),
    }
}

/// Batched products (the GEMM kernels on packed activations) of every
/// type of the llama.cpp Q4_K_M / Q5_K_M mixes equal the scalar
/// reference dot of every (row, token) — bit for bit for the K-quants,
/// to float rounding for the Q8_0-activation types — and the
/// single-token products (matrix-vector kernels) equal it to float
/// rounding; row counts are not multiples of the tiles, token counts
/// not of the 8-token groups.
#[test]
fn batched_and_single_token_products_match_the_scalar_dot() {
    use GgmlType::*;
    let backend = CpuBackend::new(2).unwrap();
    for (ty, rows, cols) in [
        (Q8_0, 44usize, 96usize),
        (Q8_0, 37, 320),
        (Q5_0, 37, 320),
        (Q4_0, 19, 64),
        (Q4_K, 45, 512),
        (Q5_K, 33, 256),
        (Q6_K, 41, 768),
    ] {
        let host = quantized_matrix(ty, rows as u64, rows, cols);
        let w = backend.upload_matrix(&host).unwrap();
        let rb = quant::row_bytes(ty, cols).unwrap();
        let act_ty = quant::vec_dot_type(ty);
        let exact = matches!(ty, Q4_K | Q5_K | Q6_K);
        for n in [1usize, 2, 3, 8, 9, 17] {
            let x = acts(n, cols, 100 + n as u64);
            let mut out = CpuActivations::default();
            backend.matmul(&w, &x, &mut out).unwrap();
            let mut one = CpuActivations::default();
            let mut aq = vec![0u8; quant::row_bytes(act_ty, cols).unwrap()];
            for t in 0..n {
                quant::quantize(act_ty, x.row(t), &mut aq).unwrap();
                let reference: Vec<f32> = (0..rows)
                    .map(|r| {
                        quant::vec_dot_scalar(
                            ty,
                            cols,
                            &host.data.as_slice()[r * rb..(r + 1) * rb],
                            &aq,
                        )
                        .unwrap()
                    })
                    .collect();
                let xt = CpuActivations::from_vec(1, cols, x.row(t).to_vec()).unwrap();
                backend.matmul(&w, &xt, &mut one).unwrap();
                if exact && n > 1 {
                    assert_eq!(
                        out.row(t),
                        &reference[..],
                        "{ty} {rows}x{cols} n={n} token {t}: batched"
                    );
                    let e = rel_err(one.row(0), &reference);
                    assert!(
                        e < 1e-5,
                        "{ty} {rows}x{cols} token {t}: single-token rel err {e}"
                    );
                } else {
                    let e = rel_err(out.row(t), &reference);
                    assert!(
                        e < 1e-5,
                        "{ty} {rows}x{cols} n={n} token {t}: batched rel err {e}"
                    );
                    let e = rel_err(one.row(0), &reference);
                    assert!(
                        e < 1e-5,
                        "{ty} {rows}x{cols} token {t}: single-token rel err {e}"
                    );
                }
            }
        }
    }
}

/// `matmul_many` splits its row chunks where one matrix ends; each
/// output must equal that matrix's own `matmul` bit for bit (the
/// kernels compute every (row, token) the same way whatever the tile).
#[test]
fn matmul_many_equals_separate_matmuls() {
    let backend = CpuBackend::new(2).unwrap();
    let cols = 128;
    let ws: Vec<CpuMatrix> = [(40usize, 1u64), (12, 2), (20, 3)]
        .iter()
        .map(|&(rows, seed)| {
            backend
                .upload_matrix(&q8_matrix("w", seed, rows, cols))
                .unwrap()
        })
        .collect();
    for n in [1usize, 5, 16] {
        let x = acts(n, cols, 7 + n as u64);
        let mut outs = vec![CpuActivations::default(); ws.len()];
        {
            let refs: Vec<&CpuMatrix> = ws.iter().collect();
            let mut out_refs: Vec<&mut CpuActivations> = outs.iter_mut().collect();
            backend.matmul_many(&refs, &x, &mut out_refs).unwrap();
        }
        for (w, many) in ws.iter().zip(&outs) {
            let mut single = CpuActivations::default();
            backend.matmul(w, &x, &mut single).unwrap();
            assert_eq!(many.data(), single.data(), "n={n}, {} rows", w.rows());
        }
    }
}

/// The fused FFN of a batch equals the FFN of each token alone (to
/// float rounding, which can move an activation quantization step).
#[test]
fn batched_ffn_equals_per_token_ffn() {
    let backend = CpuBackend::new(2).unwrap();
    let (n_embd, n_ff) = (64usize, 96usize);
    let ffn = backend
        .upload_ffn(
            0,
            &q8_matrix("gate", 1, n_ff, n_embd),
            &q8_matrix("up", 2, n_ff, n_embd),
            &q8_matrix("down", 3, n_embd, n_ff),
        )
        .unwrap();
    let n = 11;
    let x = acts(n, n_embd, 42);
    let mut batched = CpuActivations::default();
    backend.ffn(&ffn, &x, &mut batched).unwrap();
    for t in 0..n {
        let xt = CpuActivations::from_vec(1, n_embd, x.row(t).to_vec()).unwrap();
        let mut one = CpuActivations::default();
        backend.ffn(&ffn, &xt, &mut one).unwrap();
        let e = rel_err(batched.row(t), one.row(0));
        assert!(e < 2e-2, "token {t}: rel err {e}");
    }
}

/// Prefill attention equals decoding the same tokens one at a time,
/// bit for bit: both run the same f16 attention kernels, whose scores
/// and sums do not depend on how many keys a call covers.
#[test]
fn prefill_attention_equals_token_by_token() {
    let backend = CpuBackend::new(2).unwrap();
    let p = AttentionParams {
        n_head: 4,
        n_head_kv: 2,
        head_dim: 16,
        rope_mode: RopeMode::Neox,
        rope_freq_base: 10000.0,
        rope_scaling: Default::default(),
        norm_eps: 1e-6,
    };
    let n = 7;
    let spec = KvSpec {
        n_layer: 1,
        n_head_kv: 2,
        head_dim: 16,
        n_ctx: 16,
        n_seq: 2,
        dtype: KvDtype::F16,
    };
    let (q0, k0, v0) = (acts(n, 64, 1), acts(n, 32, 2), acts(n, 32, 3));
    // Sequence 1 of the cache, so that the per-sequence offsets matter.
    let slots: Vec<TokenSlot> = (0..n).map(|pos| TokenSlot { seq: 1, pos }).collect();
    let mut cache = backend.new_kv_cache(spec).unwrap();
    let (mut q, mut k, mut out) = (q0.clone(), k0.clone(), CpuActivations::default());
    backend
        .attention(
            0, &p, &mut q, &mut k, &v0, None, &slots, &mut cache, &mut out,
        )
        .unwrap();
    let mut cache1 = backend.new_kv_cache(spec).unwrap();
    for t in 0..n {
        let row =
            |a: &CpuActivations| CpuActivations::from_vec(1, a.width(), a.row(t).to_vec()).unwrap();
        let (mut q, mut k, v) = (row(&q0), row(&k0), row(&v0));
        let mut o = CpuActivations::default();
        backend
            .attention(
                0,
                &p,
                &mut q,
                &mut k,
                &v,
                None,
                &slots[t..t + 1],
                &mut cache1,
                &mut o,
            )
            .unwrap();
        assert_eq!(out.row(t), o.row(0), "token {t}");
    }
}

/// Sliding-window attention with a custom scale equals a softmax over
/// exactly the window, computed by hand from the rotated q and k the
/// call leaves behind; decoding token by token gives the same rows.
#[test]
fn sliding_window_attention_is_a_softmax_over_the_window() {
    let backend = CpuBackend::new(2).unwrap();
    let (hd, n, window, scale) = (16, 9, 3, 0.3f32);
    let p = AttentionParams {
        n_head: 2,
        n_head_kv: 1,
        head_dim: hd,
        rope_mode: RopeMode::Neox,
        rope_freq_base: 10000.0,
        rope_scaling: Default::default(),
        norm_eps: 1e-6,
    };
    let options = AttentionOptions {
        scale: Some(scale),
        sliding_window: Some(window),
    };
    let spec = KvSpec {
        n_layer: 1,
        n_head_kv: 1,
        head_dim: hd,
        n_ctx: 16,
        n_seq: 1,
        dtype: KvDtype::F32,
    };
    let (q0, k0, v) = (acts(n, 2 * hd, 4), acts(n, hd, 5), acts(n, hd, 6));
    let slots: Vec<TokenSlot> = (0..n).map(|pos| TokenSlot { seq: 0, pos }).collect();
    let mut cache = backend.new_kv_cache(spec).unwrap();
    let (mut q, mut k, mut out) = (q0.clone(), k0.clone(), CpuActivations::default());
    backend
        .attention_with(
            0, &p, &options, &mut q, &mut k, &v, None, &slots, &mut cache, &mut out,
        )
        .unwrap();
    for t in 0..n {
        for head in 0..2 {
            let qh = &q.row(t)[head * hd..(head + 1) * hd];
            let span = (t + 1).saturating_sub(window)..t + 1;
            let scores: Vec<f32> = span
                .clone()
                .map(|j| scale * ops::dot_f32(qh, k.row(j)))
                .collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f32 = weights.iter().sum();
            let mut want = vec![0.0f32; hd];
            for (w, j) in weights.iter().zip(span) {
                for (o, x) in want.iter_mut().zip(v.row(j)) {
                    *o += w / total * x;
                }
            }
            let got = &out.row(t)[head * hd..(head + 1) * hd];
            assert!(rel_err(got, &want) < 1e-5, "token {t} head {head}");
        }
    }
    let mut cache1 = backend.new_kv_cache(spec).unwrap();
    for t in 0..n {
        let row =
            |a: &CpuActivations| CpuActivations::from_vec(1, a.width(), a.row(t).to_vec()).unwrap();
        let (mut q, mut k, v) = (row(&q0), row(&k0), row(&v));
        let mut o = CpuActivations::default();
        backend
            .attention_with(
                0,
                &p,
                &options,
                &mut q,
                &mut k,
                &v,
                None,
                &slots[t..t + 1],
                &mut cache1,
                &mut o,
            )
            .unwrap();
        assert_eq!(out.row(t), o.row(0), "token {t}");
    }
}

#[test]
fn geglu_ffn_and_softcap() {
    let backend = CpuBackend::new(2).unwrap();
    let (gate, up, down) = (
        q8_matrix("gate", 1, 64, 32),
        q8_matrix("up", 2, 64, 32),
        q8_matrix("down", 3, 32, 64),
    );
    let silu = backend.upload_ffn(0, &gate, &up, &down).unwrap();
    let gelu = backend
        .upload_ffn_with(0, FfnActivation::GeluTanh, &gate, &up, &down)
        .unwrap();
    let x = acts(3, 32, 7);
    let (mut a, mut b) = (CpuActivations::default(), CpuActivations::default());
    backend.ffn(&silu, &x, &mut a).unwrap();
    backend.ffn(&gelu, &x, &mut b).unwrap();
    assert!(rel_err(a.data(), b.data()) > 1e-3, "activation ignored");
    // The GELU FFN by hand: dequantized weights, f32 products.
    let deq = |m: &HostMatrix| {
        let mut w = vec![0.0f32; m.rows * m.cols];
        quant::dequantize(m.ty, m.data.as_slice(), &mut w).unwrap();
        w
    };
    let (wg, wu, wd) = (deq(&gate), deq(&up), deq(&down));
    for r in 0..3 {
        let xr = x.row(r);
        let h: Vec<f32> = (0..64)
            .map(|i| {
                let g = ops::dot_f32(&wg[i * 32..(i + 1) * 32], xr);
                let u = ops::dot_f32(&wu[i * 32..(i + 1) * 32], xr);
                ops::gelu_tanh(g) * u
            })
            .collect();
        let want: Vec<f32> = (0..32)
            .map(|o| ops::dot_f32(&wd[o * 64..(o + 1) * 64], &h))
            .collect();
        // Q8_0 activations on the way: a quantization-sized tolerance.
        assert!(rel_err(b.row(r), &want) < 0.03, "row {r}");
    }
    let mut logits = CpuActivations::from_vec(1, 3, vec![-100.0, 0.5, 100.0]).unwrap();
    backend.softcap(&mut logits, 30.0).unwrap();
    let want = [
        -30.0 * (100.0f32 / 30.0).tanh(),
        30.0 * (0.5f32 / 30.0).tanh(),
        30.0 * (100.0f32 / 30.0).tanh(),
    ];
    assert!(rel_err(logits.data(), &want) < 1e-6);
    assert!(backend.softcap(&mut logits, 0.0).is_err());
}
