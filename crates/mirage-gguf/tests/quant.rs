//! Codec tests against the `gguf` Python package (fixtures written by
//! scripts/gen_quant_fixtures.py), round-trip error bounds, SIMD vs scalar
//! dot kernels, and dequantization of real tensors of both models.

use std::path::{Path, PathBuf};

use mirage_gguf::quant::{
    self, dequantize, quantize, scalar_dot_fn, simd_dot_fn, vec_dot, vec_dot_scalar, vec_dot_type,
    QuantError,
};
use mirage_gguf::GgmlType::{self, *};
use mirage_gguf::GgufFile;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant")
}

fn read_fixture(name: &str) -> Vec<u8> {
    let p = fixture_dir().join(name);
    std::fs::read(&p).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; regenerate with `python3 scripts/gen_quant_fixtures.py`",
            p.display()
        )
    })
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Deterministic normal samples (splitmix64 + Box-Muller), no rand API churn.
struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
    fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }
}

const DEQUANT_FIXTURE_TYPES: [GgmlType; 12] = [
    F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
];
const GGUF_QUANTIZED_TYPES: [GgmlType; 7] = [F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0];
const QUANTIZABLE: [GgmlType; 15] = [
    F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
];

fn quantized(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut q = vec![0u8; quant::row_bytes(ty, x.len()).unwrap()];
    quantize(ty, x, &mut q).unwrap();
    q
}

fn dequantized(ty: GgmlType, q: &[u8], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n];
    dequantize(ty, q, &mut y).unwrap();
    y
}

#[test]
fn dequantize_matches_gguf_bit_for_bit() {
    for ty in DEQUANT_FIXTURE_TYPES {
        let name = ty.name();
        let blocks = read_fixture(&format!("{name}.blocks.bin"));
        let want = f32s(&read_fixture(&format!("{name}.deq.f32")));
        assert!(!want.is_empty());
        let got = dequantized(ty, &blocks, want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{ty} element {i}: ours {g:e}, gguf {w:e}"
            );
        }
        // A length that is not a multiple of any internal staging size.
        let n = if ty.is_quantized() {
            want.len() - ty.block_size()
        } else {
            want.len() - 3
        };
        let part = dequantized(ty, &blocks[..quant::row_bytes(ty, n).unwrap()], n);
        assert!(
            part.iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits()),
            "{ty} prefix"
        );
    }
}

#[test]
fn quantize_matches_gguf_bytes() {
    for ty in GGUF_QUANTIZED_TYPES {
        let name = ty.name();
        let x = f32s(&read_fixture(&format!("{name}.qin.f32")));
        let want = read_fixture(&format!("{name}.qout.bin"));
        let got = quantized(ty, &x);
        assert_eq!(got.len(), want.len(), "{ty}");
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            let bs = ty.type_size();
            panic!(
                "{ty}: first differing byte {i} (block {}): ours {:?}, gguf {:?}",
                i / bs,
                &got[i / bs * bs..(i / bs + 1) * bs],
                &want[i / bs * bs..(i / bs + 1) * bs]
            );
        }
    }
}

/// Relative RMS error bound of quantize→dequantize on N(0,1) data; measured
/// values (this implementation, 64 Ki samples) are in the comments, the bounds
/// leave ~25% headroom. They are what ggml's reference quantizers achieve.
fn rms_bound(ty: GgmlType) -> f64 {
    match ty {
        F32 => 0.0,
        F16 => 2.5e-4,        // 1.7e-4 (11-bit mantissa)
        BF16 => 2.2e-3,       // 1.67e-3 (8-bit mantissa)
        Q8_0 | Q8_1 => 0.007, // 0.0054
        Q8_K => 0.009,        // 0.0069 (one scale per 256)
        Q6_K => 0.023,        // 0.0179
        Q5_0 => 0.055,        // 0.0429
        Q5_1 => 0.05,         // 0.0381
        Q5_K => 0.045,        // 0.0360
        Q4_0 => 0.11,         // 0.0853
        Q4_1 => 0.1,          // 0.0784
        Q4_K => 0.09,         // 0.0714
        Q3_K => 0.19,         // 0.1513
        Q2_K => 0.37,         // 0.2959
    }
}

fn rel_rms(x: &[f32], y: &[f32]) -> f64 {
    let num: f64 = x
        .iter()
        .zip(y)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let den: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

#[test]
fn round_trip_error_is_bounded_and_stable() {
    let mut rng = Rng(7);
    for ty in QUANTIZABLE {
        let n = 256 * 256;
        let x = rng.normals(n, 1.0);
        let q1 = quantized(ty, &x);
        let y1 = dequantized(ty, &q1, n);
        let err = rel_rms(&x, &y1);
        eprintln!("{ty}: relative RMS round-trip error {err:.5}");
        assert!(
            err <= rms_bound(ty),
            "{ty}: relative RMS error {err} > {}",
            rms_bound(ty)
        );
        // Re-quantizing what we decoded must not drift: the second round adds
        // well under the first round's error (exactly zero for most types).
        let q2 = quantized(ty, &y1);
        let y2 = dequantized(ty, &q2, n);
        let drift = rel_rms(&y1, &y2);
        assert!(
            drift <= 0.25 * err + 1e-7,
            "{ty}: re-quantization drift {drift} vs error {err}"
        );
    }
}

#[test]
fn fixture_inputs_round_trip_for_every_type() {
    // The fixture inputs hold zero blocks, outliers, tiny and one-signed blocks.
    for ty in QUANTIZABLE {
        let src = if ty == F32 || ty == Q8_1 {
            "q8_0"
        } else {
            ty.name()
        };
        let x = f32s(&read_fixture(&format!("{src}.qin.f32")));
        let y = dequantized(ty, &quantized(ty, &x), x.len());
        let bs = ty.block_size().max(32);
        for (b, (xb, yb)) in x.chunks(bs).zip(y.chunks(bs)).enumerate() {
            assert!(
                yb.iter().all(|v| v.is_finite()),
                "{ty} block {b}: non-finite output"
            );
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            if amax == 0.0 {
                assert!(
                    yb.iter().all(|v| *v == 0.0),
                    "{ty} block {b}: zeros did not stay zero"
                );
                continue;
            }
            // Every element within a type-dependent fraction of the block's
            // largest magnitude (loose: Q2_K has 4 levels, one outlier per block).
            let frac = match ty {
                Q2_K => 0.6,
                Q3_K => 0.35,
                Q4_0 | Q4_1 | Q4_K => 0.16,
                _ => 0.08,
            };
            // Scales are f16 (F16 values themselves): below 2^-24 they flush
            // to zero, so tiny blocks may decode as zero, as in ggml.
            let floor = 64.0 * 2f32.powi(-24);
            let worst = xb
                .iter()
                .zip(yb)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= frac * amax + floor,
                "{ty} block {b}: max error {worst} > {frac} * {amax}"
            );
        }
    }
}

#[test]
fn bad_lengths_are_typed_errors() {
    let mut out = vec![0f32; 33];
    assert!(matches!(
        dequantize(Q8_0, &[0u8; 34], &mut out),
        Err(QuantError::NotBlockMultiple {
            n: 33,
            block_size: 32,
            ..
        })
    ));
    let mut out = vec![0f32; 32];
    assert!(matches!(
        dequantize(Q8_0, &[0u8; 33], &mut out),
        Err(QuantError::LengthMismatch {
            expected: 34,
            got: 33,
            ..
        })
    ));
    assert!(matches!(
        quantize(Q4_K, &[0f32; 256], &mut [0u8; 10]),
        Err(QuantError::LengthMismatch { expected: 144, .. })
    ));
    assert!(vec_dot(Q4_K, 256, &[0u8; 144], &[0u8; 291]).is_err());
    assert!(vec_dot_scalar(Q4_0, 64, &[0u8; 36], &[0u8; 68]).is_ok());
    assert!(vec_dot(Q4_0, 64, &[0u8; 36], &[0u8; 67]).is_err());
}

fn dot_f64(a: &[f32], b: &[f32]) -> (f64, f64) {
    let dot = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let abs = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 * *y as f64).abs())
        .sum();
    (dot, abs)
}

/// Types whose SIMD dot must equal the scalar one bit for bit (per-block
/// integer sums combined by the same float expression in the same order).
fn simd_is_exact(ty: GgmlType) -> bool {
    matches!(ty, Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K)
}

#[test]
fn dot_products_agree_with_dequantized_f64_and_scalar() {
    let mut rng = Rng(11);
    let avx2 = cfg!(target_arch = "x86_64") && {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    };
    if !avx2 {
        eprintln!("no AVX2+FMA on this CPU: only the scalar kernels are tested");
    }
    for ty in QUANTIZABLE {
        let act_ty = vec_dot_type(ty);
        assert!(scalar_dot_fn(ty).is_some(), "{ty} has no scalar kernel");
        if avx2 {
            assert!(
                simd_dot_fn(ty).is_some(),
                "{ty}: AVX2 detected but no AVX2 kernel"
            );
        }
        let bs = ty.block_size().max(act_ty.block_size()).max(32);
        let mut sizes: Vec<usize> = [1usize, 3, 7, 16, 33].iter().map(|b| b * bs).collect();
        if !ty.is_quantized() {
            // Float kernels run 32/8 lanes at a time and finish with a scalar tail.
            sizes.extend([1, 5, 37, 1001]);
        }
        for n in sizes {
            let x = rng.normals(n, 0.7);
            let a = rng.normals(n, 1.3);
            let (wq, aq) = (quantized(ty, &x), quantized(act_ty, &a));
            let (wd, ad) = (dequantized(ty, &wq, n), dequantized(act_ty, &aq, n));
            let (want, abs) = dot_f64(&wd, &ad);
            let scalar = vec_dot_scalar(ty, n, &wq, &aq).unwrap() as f64;
            // Q8_1 stores its block sum d*sum(q) as f16, which the Q4_1/Q5_1
            // dots use for the min term: 2^-11 relative on that term.
            let tol = if act_ty == Q8_1 { 2e-3 } else { 2e-6 } * abs + 1e-6;
            assert!(
                (scalar - want).abs() <= tol,
                "{ty} n={n}: scalar {scalar} vs f64 of dequantized {want} (tol {tol})"
            );
            // And both close to the unquantized dot (the quantization error).
            let (exact, exact_abs) = dot_f64(&x, &a);
            let qtol = (rms_bound(ty) + rms_bound(act_ty)) * 3.0 * exact_abs.max(1e-6) + 1e-4;
            assert!(
                (scalar - exact).abs() <= qtol,
                "{ty} n={n}: {scalar} vs exact {exact}"
            );
            let fast = vec_dot(ty, n, &wq, &aq).unwrap() as f64;
            if simd_is_exact(ty) {
                assert_eq!(
                    fast.to_bits(),
                    scalar.to_bits(),
                    "{ty} n={n}: SIMD {fast} != scalar {scalar}"
                );
            } else {
                // Float partial sums are added in a different order.
                assert!(
                    (fast - scalar).abs() <= 1e-5 * abs + 1e-6,
                    "{ty} n={n}: SIMD {fast} vs scalar {scalar}"
                );
            }
        }
    }
}

// ------------------------------------------------------------ real tensors

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models")
}

/// The batched (GEMM) and single-token (matrix-vector) kernels on the
/// first rows of a real tensor, against several activation rows: every
/// result equals the scalar dot of that row and token (the K-quant GEMMs
/// bit for bit; the kernels that add block terms in another order within
/// 1e-5 of the terms' magnitude), and the f64 dot of the rows `gguf`
/// dequantized (`deq`) within 2e-6 of it (1.2e-5 for the reordered ones).
fn real_rows_through_gemm_and_matvec(
    model: &str,
    name: &str,
    ty: GgmlType,
    raw: &[u8],
    row_len: usize,
    deq: &[f32],
) {
    let Some(act_ty) = quant::gemm_input_type(ty) else {
        return;
    };
    let (rows, n) = (
        13usize.min(raw.len() / quant::row_bytes(ty, row_len).unwrap()),
        9usize,
    );
    let wb = quant::row_bytes(ty, row_len).unwrap();
    let w = &raw[..rows * wb];
    let ab = quant::row_bytes(act_ty, row_len).unwrap();
    let mut act = vec![0u8; n * ab];
    let mut act_deq = Vec::new();
    for t in 0..n {
        let x = Rng(row_len as u64 * 31 + t as u64).normals(row_len, 1.0);
        quantize(act_ty, &x, &mut act[t * ab..(t + 1) * ab]).unwrap();
        act_deq.extend(dequantized(act_ty, &act[t * ab..(t + 1) * ab], row_len));
    }
    let mut packed = vec![0u8; quant::packed_bytes(ty, n, row_len).unwrap()];
    quant::pack_rows(ty, &act, ab, n, row_len, &mut packed).unwrap();
    let exact = matches!(ty, Q4_K | Q5_K | Q6_K);
    for isa in quant::GemmIsa::ALL.into_iter().filter(|k| k.available()) {
        let mut out = vec![f32::NAN; rows * n];
        isa.gemm(ty, row_len, w, rows, &packed, n, &mut out)
            .unwrap();
        let mut mv = vec![f32::NAN; rows * n];
        if isa.matvec_kernel(ty).is_some() {
            for t in 0..n {
                let mut o = vec![0f32; rows];
                isa.matvec(ty, row_len, w, rows, &act[t * ab..(t + 1) * ab], &mut o)
                    .unwrap();
                for r in 0..rows {
                    mv[r * n + t] = o[r];
                }
            }
        }
        for r in 0..rows {
            for t in 0..n {
                let a = &act[t * ab..(t + 1) * ab];
                let scalar = vec_dot_scalar(ty, row_len, &w[r * wb..(r + 1) * wb], a).unwrap();
                let (want, abs) = dot_f64(
                    &deq[r * row_len..(r + 1) * row_len],
                    &act_deq[t * row_len..(t + 1) * row_len],
                );
                for (what, got) in [("gemm", out[r * n + t]), ("matvec", mv[r * n + t])] {
                    if got.is_nan() && what == "matvec" {
                        continue; // no matrix-vector kernel for this type here
                    }
                    if exact && what == "gemm" {
                        assert_eq!(
                            got.to_bits(),
                            scalar.to_bits(),
                            "{model} {name} {isa:?} {what} ({r},{t}): {got} vs scalar {scalar}"
                        );
                    } else {
                        assert!(
                            (got - scalar).abs() as f64 <= 1e-5 * abs + 1e-6,
                            "{model} {name} {isa:?} {what} ({r},{t}): {got} vs scalar {scalar}"
                        );
                    }
                    let tol = if exact && what == "gemm" {
                        2e-6
                    } else {
                        1.2e-5
                    } * abs
                        + 1e-6;
                    assert!(
                        (got as f64 - want).abs() <= tol,
                        "{model} {name} {isa:?} {what} ({r},{t}): {got} vs gguf-dequantized f64 {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn real_tensors_dequantize_like_gguf() {
    let json: serde_json::Value =
        serde_json::from_slice(&read_fixture("real_tensors.json")).expect("valid JSON");
    let tensors = json["tensors"].as_array().expect("tensors array");
    let mut types_seen = std::collections::BTreeSet::new();
    let mut files = std::collections::HashMap::new();
    for t in tensors {
        let model = t["model"].as_str().unwrap();
        let path = models_dir().join(model);
        if !path.exists() {
            if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
                eprintln!("skipping {model}: not found and MIRAGE_SKIP_MODEL_TESTS=1");
                continue;
            }
            panic!("{} missing: run `cargo xtask fetch-models`", path.display());
        }
        let ty = GgmlType::from_name(t["type"].as_str().unwrap()).unwrap();
        let n = t["n_elements"].as_u64().unwrap() as usize;
        let n_bytes = t["n_bytes"].as_u64().unwrap() as usize;
        let name = t["tensor"].as_str().unwrap();
        assert_eq!(quant::row_bytes(ty, n).unwrap(), n_bytes);
        // Tensor located by our reader, its position checked against gguf-py's.
        let file = files
            .entry(model.to_string())
            .or_insert_with(|| GgufFile::open(&path).expect("model parses"));
        let view = file
            .tensor(name)
            .unwrap_or_else(|| panic!("{model}: no tensor {name}"));
        assert_eq!(view.ty(), ty, "{model} {name} type");
        assert_eq!(
            file.data_offset() + view.info.offset,
            t["offset"].as_u64().unwrap(),
            "{model} {name}: data offset differs from gguf-py's"
        );
        let raw = view.data;
        assert_eq!(raw.len(), n_bytes, "{model} {name} byte length");
        let y = dequantized(ty, raw, n);

        let checksum = y.iter().enumerate().fold(0u64, |s, (i, v)| {
            s.wrapping_add((v.to_bits() as u64).wrapping_mul(i as u64 + 1))
        });
        assert_eq!(
            checksum.to_string(),
            t["checksum"].as_str().unwrap(),
            "{model} {name} checksum"
        );
        let sumsq: f64 = y.iter().map(|v| (*v as f64).powi(2)).sum();
        let want = t["sum_squares"].as_f64().unwrap();
        assert!(
            (sumsq - want).abs() <= 1e-9 * want,
            "{model} {name}: sum of squares {sumsq} vs {want}"
        );
        for s in t["samples"].as_array().unwrap() {
            let (i, bits) = (
                s[0].as_u64().unwrap() as usize,
                s[1].as_u64().unwrap() as u32,
            );
            assert_eq!(y[i].to_bits(), bits, "{model} {name}[{i}]");
        }
        // The runtime's use: a few rows dotted with quantized activations.
        let row_len = view.info.row_len() as usize;
        let row_bytes = quant::row_bytes(ty, row_len).unwrap();
        let act_ty = vec_dot_type(ty);
        let a = Rng(row_len as u64).normals(row_len, 1.0);
        let aq = quantized(act_ty, &a);
        let ad = dequantized(act_ty, &aq, row_len);
        for r in 0..4 {
            let (want, abs) = dot_f64(&y[r * row_len..(r + 1) * row_len], &ad);
            let got = vec_dot(ty, row_len, &raw[r * row_bytes..(r + 1) * row_bytes], &aq).unwrap();
            let tol = if act_ty == Q8_1 { 2e-3 } else { 2e-6 } * abs + 1e-6;
            assert!(
                (got as f64 - want).abs() <= tol,
                "{model} {name} row {r}: {got} vs {want}"
            );
        }
        real_rows_through_gemm_and_matvec(model, name, ty, raw, row_len, &y);
        types_seen.insert(ty);
    }
    if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() != Ok("1") {
        assert_eq!(
            types_seen.into_iter().collect::<Vec<_>>(),
            vec![Q4_1, Q5_0, Q8_0, Q4_K, Q6_K],
            "every quant type of both models is covered"
        );
    }
}
