//! RoPE scaling reaches the CPU backend's attention: the rotated q and k it
//! leaves in place follow the scaled frequency table.

use mirage_runtime::backend::cpu::CpuActivations;
use mirage_runtime::backend::{AttentionParams, Backend, TokenSlot};
use mirage_runtime::kv_cache::{KvDtype, KvSpec};
use mirage_runtime::ops::RopeMode;
use mirage_runtime::rope::RopeScaling;
use mirage_runtime::CpuBackend;

const HD: usize = 64;

fn params(rope_scaling: RopeScaling) -> AttentionParams {
    AttentionParams {
        n_head: 2,
        n_head_kv: 1,
        head_dim: HD,
        rope_mode: RopeMode::Neox,
        rope_freq_base: 1e6,
        rope_scaling,
        norm_eps: 1e-6,
    }
}

fn row(width: usize, seed: u32) -> Vec<f32> {
    (0..width)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

/// q and k of one row after the backend rotated them at position `pos`.
fn rotated(scaling: RopeScaling, pos: usize) -> (Vec<f32>, Vec<f32>) {
    let backend = CpuBackend::new(1).unwrap();
    let spec = KvSpec {
        n_layer: 1,
        n_head_kv: 1,
        head_dim: HD,
        n_ctx: 64,
        n_seq: 1,
        dtype: KvDtype::F32,
    };
    let mut cache = backend.new_kv_cache(spec).unwrap();
    let mut q = CpuActivations::from_vec(1, 2 * HD, row(2 * HD, 1)).unwrap();
    let mut k = CpuActivations::from_vec(1, HD, row(HD, 2)).unwrap();
    let v = CpuActivations::from_vec(1, HD, row(HD, 3)).unwrap();
    let mut out = CpuActivations::default();
    let slots = [TokenSlot { seq: 0, pos }];
    backend
        .attention(
            0,
            &params(scaling),
            &mut q,
            &mut k,
            &v,
            None,
            &slots,
            &mut cache,
            &mut out,
        )
        .unwrap();
    (q.data().to_vec(), k.data().to_vec())
}

#[test]
fn linear_scaling_is_position_interpolation() {
    // Factor 2 at position 2p rotates exactly as unscaled RoPE at p (the
    // halved frequencies are exact in binary).
    for p in [1, 5, 20] {
        assert_eq!(
            rotated(RopeScaling::linear(2.0), 2 * p),
            rotated(RopeScaling::none(), p),
            "position {p}"
        );
    }
    assert_ne!(
        rotated(RopeScaling::linear(2.0), 10),
        rotated(RopeScaling::none(), 10)
    );
}

#[test]
fn yarn_scales_the_magnitude_and_keeps_high_frequencies() {
    let s = RopeScaling::yarn(4.0, 32768);
    let (q, _) = rotated(s, 9);
    let (q0, _) = rotated(RopeScaling::none(), 9);
    // Rotations keep norms, so the norm ratio is YaRN's mscale.
    let norm = |x: &[f32]| x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
    let ratio = norm(&q) / norm(&q0);
    assert!(
        (ratio - s.mscale() as f64).abs() < 1e-5,
        "norm ratio {ratio} vs mscale {}",
        s.mscale()
    );
    // Pair 0 (below the correction range) keeps its frequency: same angle,
    // only scaled (NEOX pairs element 0 with element HD/2).
    let m = s.mscale();
    assert!((q[0] - m * q0[0]).abs() < 1e-5 && (q[HD / 2] - m * q0[HD / 2]).abs() < 1e-5);
}
