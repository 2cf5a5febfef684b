//! Helpers the runtime's integration tests share.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;

/// `models/<name>` of the workspace; `None` (with a message) only when it is
/// missing and MIRAGE_SKIP_MODEL_TESTS=1, otherwise a missing model fails.
pub fn model_path(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name);
    if p.exists() {
        return Some(p);
    }
    if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!(
            "skipping: {} is missing and MIRAGE_SKIP_MODEL_TESTS=1",
            p.display()
        );
        return None;
    }
    panic!(
        "{} is missing: run `cargo xtask fetch-models` (or set MIRAGE_SKIP_MODEL_TESTS=1)",
        p.display()
    );
}

/// Cosine similarity in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += x as f64 * y as f64;
        aa += x as f64 * x as f64;
        bb += y as f64 * y as f64;
    }
    ab / (aa.sqrt() * bb.sqrt())
}
