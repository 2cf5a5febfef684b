//! Helpers shared by the CUDA integration tests (each test file is its own
//! crate and includes this module with `mod common;`).
#![allow(dead_code)] // not every test file uses every helper

use mirage_cuda::{CudaBackend, CudaError};
use rand::{Rng, SeedableRng};

/// The CUDA backend on device 0, or `None` after printing why the test
/// skips (no `cuda` feature, no driver, no device). On the GPU machine
/// (`MIRAGE_REQUIRE_CUDA_TESTS=1`, set by the H200 scripts) skipping is a
/// failure. A device that is present but fails to start always fails.
pub fn cuda(test: &str) -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(
            e @ (CudaError::NotCompiledWithCuda
            | CudaError::DriverNotFound
            | CudaError::NoDevice { .. }),
        ) => {
            assert!(
                !require_cuda_tests(),
                "{test}: MIRAGE_REQUIRE_CUDA_TESTS=1 but no CUDA device: {e}"
            );
            eprintln!("{test}: skipped, no CUDA device here: {e}");
            None
        }
        Err(e) => panic!("{test}: CUDA device present but the backend failed to start: {e}"),
    }
}

/// Whether the GPU tests must run (`MIRAGE_REQUIRE_CUDA_TESTS=1`).
pub fn require_cuda_tests() -> bool {
    std::env::var("MIRAGE_REQUIRE_CUDA_TESTS").as_deref() == Ok("1")
}

/// A seeded generator (tests are reproducible).
pub fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// `n` values in (-2, 2), triangular around 0.
pub fn randn(r: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| r.random_range(-1.0f32..1.0) + r.random_range(-1.0f32..1.0))
        .collect()
}

/// How many elements of `a` and `b` differ in their bits (the bit-equality
/// tests print it; a length mismatch counts the missing elements too).
pub fn bits_differ(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count()
        + a.len().abs_diff(b.len())
}

/// Where the real models are: `MIRAGE_MODELS_DIR`, or models/ at the
/// workspace root (what `cargo xtask fetch-models` fills).
pub fn models_dir() -> std::path::PathBuf {
    std::env::var_os("MIRAGE_MODELS_DIR")
        .map(Into::into)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models"))
}

/// `path` when that model file exists; else `None` after printing why
/// `test` skips, which only `MIRAGE_SKIP_MODEL_TESTS=1` allows (otherwise
/// a missing model fails the test, as on CI and the GPU machine).
pub fn model_path(test: &str, path: std::path::PathBuf) -> Option<std::path::PathBuf> {
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1"),
        "{test}: {} is missing: run `cargo xtask fetch-models` (or set MIRAGE_SKIP_MODEL_TESTS=1 to skip)",
        path.display()
    );
    eprintln!(
        "{test}: skipped, {} missing (MIRAGE_SKIP_MODEL_TESTS=1)",
        path.display()
    );
    None
}

/// Real model `name` in [`models_dir`] (see [`model_path`]).
pub fn model_file(test: &str, name: &str) -> Option<std::path::PathBuf> {
    model_path(test, models_dir().join(name))
}

/// The model of the real-model sparse tests: `MIRAGE_SPARSE_MODEL`, by
/// default SmolLM2 in [`models_dir`] (see [`model_path`]).
pub fn sparse_model(test: &str) -> Option<std::path::PathBuf> {
    let model = std::env::var_os("MIRAGE_SPARSE_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| models_dir().join("smollm2-135m-instruct-q4_1.gguf"));
    model_path(test, model)
}

/// The artifact of the real-model sparse tests: `MIRAGE_SPARSE_ARTIFACT`,
/// or a small one of `model` built here ([`build_artifact`]).
pub fn sparse_artifact(model: &std::path::Path) -> std::sync::Arc<mirage_artifact::Artifact> {
    match std::env::var_os("MIRAGE_SPARSE_ARTIFACT") {
        Some(p) => mirage_artifact::Artifact::open(&p).expect("MIRAGE_SPARSE_ARTIFACT"),
        None => build_artifact(model),
    }
}

/// A small artifact of `model` built here (Apache-2.0 text, 64 calibration
/// tokens): enough for routed-mode tests when no artifact is given.
pub fn build_artifact(model: &std::path::Path) -> std::sync::Arc<mirage_artifact::Artifact> {
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
    mirage_artifact::Artifact::from_bytes(built.bytes).unwrap()
}
