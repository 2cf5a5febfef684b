//! An artifact's checksums only catch accidents: a file whose checksums
//! pass is still untrusted. META values that contradict the sections or the
//! model are typed errors, never a panic or an allocation sized by them.
//! The artifact is built here from a tiny synthetic model.

use std::sync::OnceLock;

use mirage_artifact::format::{assemble, sections};
use mirage_artifact::{build, Artifact, ArtifactError, BuildOptions};
use mirage_gguf::synth::TinyModel;
use mirage_gguf::GgufFile;

fn tiny_model() -> TinyModel {
    TinyModel {
        n_ff: 256,
        ..TinyModel::default()
    }
}

/// A tiny model's file and an artifact built from it (built once).
fn built() -> &'static (tempfile::TempDir, Vec<u8>) {
    static BUILT: OnceLock<(tempfile::TempDir, Vec<u8>)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        tiny_model().writer().unwrap().write_to_path(&path).unwrap();
        let options = BuildOptions {
            calib_name: "pangram".into(),
            calib_text: "The quick brown fox jumps over the lazy dog. ".repeat(8),
            max_calib_tokens: 96,
            slices: 2,
            predictor_rank: 4,
            threads: 1,
            ..BuildOptions::default()
        };
        let bytes = build(&path, &options, &mut |_| {}).unwrap().bytes;
        (dir, bytes)
    })
}

/// The built artifact with its META JSON edited, checksums recomputed.
fn with_meta(edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let (_, bytes) = built();
    let (sha, mut bodies) = sections(bytes).unwrap();
    let mut meta: serde_json::Value = serde_json::from_slice(bodies[0]).unwrap();
    edit(&mut meta);
    let json = serde_json::to_vec(&meta).unwrap();
    bodies[0] = &json;
    assemble(&sha, bodies)
}

fn malformed(bytes: Vec<u8>) -> String {
    match Artifact::from_bytes(bytes) {
        Err(e @ ArtifactError::Malformed(_)) => e.to_string(),
        other => panic!("expected Malformed, got {other:?}"),
    }
}

#[test]
fn the_tiny_artifact_loads_and_reassembles_identically() {
    let (_, bytes) = built();
    let a = Artifact::from_bytes(bytes.clone()).unwrap();
    assert_eq!((a.meta().n_layer, a.meta().n_ff), (2, 256));
    let (sha, bodies) = sections(bytes).unwrap();
    assert!(assemble(&sha, bodies) == *bytes);
}

#[test]
fn a_huge_n_layer_in_meta_is_refused() {
    for n in [i64::MAX as u64, u32::MAX as u64, 3] {
        let msg = malformed(with_meta(|m| m["n_layer"] = n.into()));
        assert!(
            msg.contains("n_layer") && msg.contains(&n.to_string()),
            "{msg}"
        );
    }
}

#[test]
fn a_huge_n_ff_or_d_model_in_meta_is_refused() {
    for (key, v) in [
        ("n_ff", 1u64 << 40),
        ("n_ff", 128),
        ("d_model", 1 << 40),
        ("d_model", u64::MAX / 4),
        ("slices", 1 << 62),
        ("predictor_rank", 1 << 62),
    ] {
        let msg = malformed(with_meta(|m| m[key] = v.into()));
        assert!(msg.contains(key), "{key}: {msg}");
    }
}

#[test]
fn an_artifact_is_checked_against_the_model_it_runs_with() {
    let (dir, bytes) = built();
    let a = Artifact::from_bytes(bytes.clone()).unwrap();
    let model = GgufFile::open(dir.path().join("tiny.gguf")).unwrap();
    a.check_source(&model).unwrap();
    // Another model (same sha256 recorded, other shape): refused by shape
    // even when the recorded hash is made to match.
    let other = TinyModel {
        n_layer: 3,
        ..tiny_model()
    }
    .to_bytes()
    .unwrap();
    let other_sha = mirage_artifact::format::sha256_hex(&other);
    let forged = with_meta(|m| m["source_sha256"] = other_sha.clone().into());
    let (_, bodies) = sections(&forged).unwrap();
    let sha: [u8; 32] = hex::decode(&other_sha).unwrap().try_into().unwrap();
    let forged = Artifact::from_bytes(assemble(&sha, bodies)).unwrap();
    let e = forged
        .check_source(&GgufFile::from_bytes(other).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("n_layer") && e.contains('3'), "{e}");
}
