//! NVFP4 codec against the ml_dtypes reference (fixtures from
//! scripts/gen_nvfp4_fixtures.py, compared bit for bit), round-trip error
//! bounds, dot products, requantizing GGUF tensors.

use mirage_gguf::quant;
use mirage_gguf::quant::nvfp4::{self, e2m1_to_f32, e4m3_to_f32, Nvfp4Error, Nvfp4Tensor};
use mirage_gguf::types::GgmlType;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nvfp4")
}

struct Case {
    name: String,
    tensor_scale: f32,
    input: Vec<f32>,
    scales: Vec<u8>,
    packed: Vec<u8>,
    decoded: Vec<f32>,
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn load_cases() -> Vec<Case> {
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir().join("manifest.json"))
            .expect("fixtures missing: run `python3 scripts/gen_nvfp4_fixtures.py`"),
    )
    .unwrap();
    let cases = manifest["cases"].as_array().unwrap();
    assert!(cases.len() >= 7, "manifest lists {} cases", cases.len());
    cases
        .iter()
        .map(|c| {
            let name = c["name"].as_str().unwrap().to_string();
            let b = std::fs::read(fixture_dir().join(format!("{name}.bin"))).unwrap();
            let n = u32::from_le_bytes(b[0..4].try_into().unwrap()) as usize;
            let tensor_scale = f32::from_le_bytes(b[4..8].try_into().unwrap());
            let mut off = 8;
            let mut take = |len: usize| {
                let s = b[off..off + len].to_vec();
                off += len;
                s
            };
            let input = f32s(&take(4 * n));
            let scales = take(n / 16);
            let packed = take(n / 2);
            let decoded = f32s(&take(4 * n));
            assert_eq!(off, b.len(), "{name}: trailing bytes");
            Case {
                name,
                tensor_scale,
                input,
                scales,
                packed,
                decoded,
            }
        })
        .collect()
}

#[test]
fn quantize_matches_ml_dtypes_bit_for_bit() {
    for case in load_cases() {
        let n = case.input.len();
        let t = Nvfp4Tensor::quantize(&case.input, &[n as u64]).unwrap();
        assert_eq!(
            t.tensor_scale.to_bits(),
            case.tensor_scale.to_bits(),
            "{}: tensor scale",
            case.name
        );
        let bad_scales = t
            .block_scales
            .iter()
            .zip(&case.scales)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(
            bad_scales, 0,
            "{}: {bad_scales} block scales differ",
            case.name
        );
        let first_bad = t.packed.iter().zip(&case.packed).position(|(a, b)| a != b);
        assert_eq!(first_bad, None, "{}: packed bytes differ", case.name);
        let got = t.dequantize().unwrap();
        let bad = got
            .iter()
            .zip(&case.decoded)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(bad, 0, "{}: {bad} decoded values differ", case.name);
        // Decoding the reference bytes (not ours) gives the same bits too.
        let mut from_ref = vec![0f32; n];
        nvfp4::dequantize_into(case.tensor_scale, &case.scales, &case.packed, &mut from_ref)
            .unwrap();
        assert!(from_ref
            .iter()
            .zip(&case.decoded)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn ties_round_to_even_codes() {
    let case = load_cases().into_iter().find(|c| c.name == "ties").unwrap();
    // Block 1 holds the E2M1 midpoints with tensor scale 1 and block scale 1.
    assert_eq!(case.tensor_scale, 1.0);
    assert_eq!(e4m3_to_f32(case.scales[1]), 1.0);
    let codes: Vec<f32> = case.packed[8..12]
        .iter()
        .flat_map(|&b| [e2m1_to_f32(b), e2m1_to_f32(b >> 4)])
        .collect();
    assert_eq!(codes, [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]);
}

/// Per-element bound: half the widest E2M1 gap (1 between 4 and 6) times
/// the block's step, plus what saturation at ±6 loses; blocks whose scale
/// rounds to E4M3 zero lose everything (and are tiny next to amax).
fn check_round_trip_bound(name: &str, x: &[f32], t: &Nvfp4Tensor) -> f64 {
    let y = t.dequantize().unwrap();
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (mut se, mut sx) = (0f64, 0f64);
    for (b, (xb, yb)) in x.chunks(16).zip(y.chunks(16)).enumerate() {
        let denom = e4m3_to_f32(t.block_scales[b]) * t.tensor_scale;
        for (&xi, &yi) in xb.iter().zip(yb) {
            let err = (xi - yi).abs();
            let bound = if denom == 0.0 {
                assert!(
                    xi.abs() <= amax / 2688.0 * 6.0 / 512.0 * 1.01 || amax == 0.0,
                    "{name}: zero scale for {xi}"
                );
                xi.abs()
            } else {
                denom * 1.0 + (xi.abs() - 6.0 * denom).max(0.0)
            };
            assert!(
                err <= bound * (1.0 + 1e-6),
                "{name}: |{xi} - {yi}| = {err} > {bound}"
            );
            se += (err as f64).powi(2);
            sx += (xi as f64).powi(2);
        }
    }
    (se / sx.max(f64::MIN_POSITIVE)).sqrt()
}

#[test]
fn round_trip_error_bounds() {
    for case in load_cases() {
        let t = Nvfp4Tensor::quantize(&case.input, &[case.input.len() as u64]).unwrap();
        let rel = check_round_trip_bound(&case.name, &case.input, &t);
        println!("{}: relative RMS round-trip error {rel:.4}", case.name);
        if case.name == "normal_4096" {
            // Gaussian data: NVFP4's RMS error is about 8-10 % of the RMS value.
            assert!(rel < 0.12, "normal_4096: {rel}");
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for scale in [1e-20f32, 1e-3, 1.0, 1e6, 1e30] {
        let x: Vec<f32> = (0..16 * 257)
            .map(|_| (rng.random::<f32>() - 0.5) * scale)
            .collect();
        let t = Nvfp4Tensor::quantize(&x, &[16 * 257]).unwrap();
        let rel = check_round_trip_bound("scaled", &x, &t);
        assert!(rel < 0.12, "scale {scale}: {rel}");
        // Re-quantizing decoded values is a fixed point.
        let again = Nvfp4Tensor::quantize(&t.dequantize().unwrap(), &[16 * 257]).unwrap();
        assert_eq!(
            again.packed, t.packed,
            "scale {scale}: requantize changed codes"
        );
    }
}

#[test]
fn bad_input_is_refused() {
    assert!(matches!(
        Nvfp4Tensor::quantize(&[0.0; 24], &[24]),
        Err(Nvfp4Error::NotBlockMultiple { n: 24, block: 16 })
    ));
    assert!(matches!(
        Nvfp4Tensor::quantize(&[0.0; 32], &[16, 3]),
        Err(Nvfp4Error::LengthMismatch {
            expected: 48,
            got: 32,
            ..
        })
    ));
    let mut x = vec![1.0f32; 32];
    x[5] = f32::NAN;
    assert!(matches!(
        Nvfp4Tensor::quantize(&x, &[32]),
        Err(Nvfp4Error::NonFinite { index: 5, .. })
    ));
    let mut bytes = Nvfp4Tensor::quantize(&[1.0; 32], &[32]).unwrap().to_bytes();
    assert!(Nvfp4Tensor::from_bytes(&bytes[1..], &[32]).is_err());
    bytes[0..4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    assert!(matches!(
        Nvfp4Tensor::from_bytes(&bytes, &[32]),
        Err(Nvfp4Error::BadTensorScale(_))
    ));
    assert!(nvfp4::dot_f32(1.0, &[0; 2], &[0; 16], &[0.0; 16]).is_err());
    assert!(nvfp4::dot_q8_0(16, 1.0, &[0; 1], &[0; 8], &[0; 34]).is_err());
}

#[test]
fn serialized_form_round_trips() {
    let case = load_cases()
        .into_iter()
        .find(|c| c.name == "normal_4096")
        .unwrap();
    let t = Nvfp4Tensor::quantize(&case.input, &[64, 64]).unwrap();
    let bytes = t.to_bytes();
    assert_eq!(bytes.len(), nvfp4::serialized_len(4096));
    assert_eq!(bytes.len(), 4 + 256 + 2048);
    assert_eq!(Nvfp4Tensor::from_bytes(&bytes, &[64, 64]).unwrap(), t);
}

#[test]
fn dot_products_match_dequantized_reference() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (rows, cols) = (8usize, 1024usize);
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random::<f32>() * 2.0 - 1.0)
        .collect();
    let t = Nvfp4Tensor::quantize(&w, &[cols as u64, rows as u64]).unwrap();
    let wd = t.dequantize().unwrap();
    let x: Vec<f32> = (0..cols).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
    let mut xq = vec![0u8; cols / 32 * 34];
    quant::quantize(GgmlType::Q8_0, &x, &mut xq).unwrap();
    let mut xd = vec![0f32; cols];
    quant::dequantize(GgmlType::Q8_0, &xq, &mut xd).unwrap();
    for r in 0..rows {
        let (scales, packed) = t.row(r).unwrap();
        let wr = &wd[r * cols..(r + 1) * cols];
        let exact = |a: &[f32]| {
            wr.iter()
                .zip(a)
                .map(|(&p, &q)| p as f64 * q as f64)
                .sum::<f64>()
        };
        let norm: f64 = wr.iter().zip(&x).map(|(p, q)| (p * q).abs() as f64).sum();
        let f = nvfp4::dot_f32(t.tensor_scale, scales, packed, &x).unwrap() as f64;
        assert!(
            (f - exact(&x)).abs() <= 1e-5 * norm,
            "row {r}: f32 dot {f} vs {}",
            exact(&x)
        );
        // Q8_0 activations: compare with the dequantized activations' dot.
        let want = exact(&xd);
        let s = nvfp4::dot_q8_0_scalar(cols, t.tensor_scale, scales, packed, &xq).unwrap() as f64;
        let v = nvfp4::dot_q8_0(cols, t.tensor_scale, scales, packed, &xq).unwrap() as f64;
        assert!(
            (s - want).abs() <= 1e-5 * norm,
            "row {r}: scalar q8 {s} vs {want}"
        );
        assert!(
            (v - want).abs() <= 1e-5 * norm,
            "row {r}: simd q8 {v} vs {want}"
        );
    }
}

#[test]
fn requantize_gguf_types() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let (cols, rows) = (256usize, 4usize);
    let x: Vec<f32> = (0..cols * rows)
        .map(|_| rng.random::<f32>() * 2.0 - 1.0)
        .collect();
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ] {
        let mut bytes = vec![0u8; quant::row_bytes(ty, x.len()).unwrap()];
        quant::quantize(ty, &x, &mut bytes).unwrap();
        let mut src = vec![0f32; x.len()];
        quant::dequantize(ty, &bytes, &mut src).unwrap();
        let t = Nvfp4Tensor::requantize(ty, &bytes, &[cols as u64, rows as u64]).unwrap();
        // Requantizing = dequantize with the GGUF codec, then quantize.
        assert_eq!(
            t,
            Nvfp4Tensor::quantize(&src, &[cols as u64, rows as u64]).unwrap(),
            "{ty}"
        );
        let rel = check_round_trip_bound("requantize", &src, &t);
        assert!(rel < 0.12, "{ty}: {rel}");
    }
    assert!(matches!(
        Nvfp4Tensor::requantize(GgmlType::Q8_0, &[0; 33], &[32]),
        Err(Nvfp4Error::Source(_))
    ));
}

/// The threaded requantization (rows in chunks, shared tensor scale) is
/// bit-identical to the serial one for every chunking, including chunks
/// that do not divide the rows evenly; a NaN is reported at its global index.
#[test]
fn requantize_parallel_equals_serial() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (cols, rows) = (512usize, 37usize);
    let mut x: Vec<f32> = (0..cols * rows)
        .map(|_| rng.random::<f32>() * 2.0 - 1.0)
        .collect();
    // One large outlier in a late row sets the tensor scale for all chunks.
    x[cols * 30 + 5] = 40.0;
    let dims = [cols as u64, rows as u64];
    for ty in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_K] {
        let mut bytes = vec![0u8; quant::row_bytes(ty, x.len()).unwrap()];
        quant::quantize(ty, &x, &mut bytes).unwrap();
        let serial = Nvfp4Tensor::requantize(ty, &bytes, &dims).unwrap();
        for threads in [1, 2, 3, 5, 16, 64] {
            let par = Nvfp4Tensor::requantize_parallel(ty, &bytes, &dims, threads).unwrap();
            assert_eq!(par, serial, "{ty}, {threads} threads");
        }
    }
    let mut bad = x.clone();
    bad[cols * 20 + 7] = f32::NAN;
    let mut bytes = vec![0u8; bad.len() * 4];
    quant::quantize(GgmlType::F32, &bad, &mut bytes).unwrap();
    match Nvfp4Tensor::requantize_parallel(GgmlType::F32, &bytes, &dims, 4) {
        Err(Nvfp4Error::NonFinite { index, .. }) => assert_eq!(index, cols * 20 + 7),
        other => panic!("expected NonFinite, got {other:?}"),
    }
    assert!(Nvfp4Tensor::requantize_parallel(GgmlType::Q8_0, &[0; 33], &[32], 4).is_err());
}

#[test]
fn requantize_real_model_tensor() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/smollm2-135m-instruct-q4_1.gguf");
    if !path.exists() {
        if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
            println!(
                "skipping: {} missing (MIRAGE_SKIP_MODEL_TESTS=1)",
                path.display()
            );
            return;
        }
        panic!("{} missing: run `cargo xtask fetch-models`", path.display());
    }
    let file = mirage_gguf::GgufFile::open(&path).unwrap();
    let view = file
        .tensor("blk.0.ffn_down.weight")
        .expect("blk.0.ffn_down.weight");
    let src = view.to_f32().unwrap();
    let t = Nvfp4Tensor::from_gguf(&view).unwrap();
    assert_eq!(t.dims, view.dims());
    let rel = check_round_trip_bound("smollm2 blk.0.ffn_down", &src, &t);
    println!(
        "smollm2 blk.0.ffn_down ({:?}, {}): NVFP4 relative RMS error vs the Q4_1 values {rel:.4}; {} -> {} bytes",
        view.dims(),
        view.ty(),
        view.data.len(),
        t.to_bytes().len()
    );
    assert!(rel < 0.15, "{rel}");
}
