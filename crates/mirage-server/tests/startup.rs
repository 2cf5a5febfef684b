//! End-to-end tests of `mirage-server` startup with SmolLM2: serving from a
//! page-major artifact (the same text as a session on that artifact), and
//! the choices it refuses before it listens, saying why (a missing, foreign
//! or wrong-model artifact, a backend that is not there, deterministic mode
//! on a backend that cannot keep it).

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

use mirage_runtime::{Engine, EngineOptions, GenerateParams};
use serde_json::json;

/// Runs the server expecting it to refuse to start; returns its stderr.
fn start_fails(model: &std::path::Path, extra: &[&str]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mirage-server"))
        .arg("--model")
        .arg(model)
        .args(["--port", "0", "--ctx", "256", "--threads", "2"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn mirage-server");
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("mirage-server {extra:?} kept running; it should refuse to start");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!status.success(), "{extra:?} started: {out}");
    assert!(!out.contains("listening on"), "{out}");
    err
}

/// Greedy text of `prompt` through a non-batched session on the engine
/// `spec` loads (the shared loader the server uses too).
struct GreedyText<'a>(&'a str, usize);

impl mirage::WithEngine for GreedyText<'_> {
    type Out = (String, String);
    fn run<B: mirage::Backend>(self, engine: Engine<B>) -> (String, String) {
        let params = GenerateParams {
            max_tokens: self.1,
            ..Default::default()
        };
        let ctx = engine.encode(self.0, true).unwrap();
        let text = engine
            .session()
            .unwrap()
            .generate_from(&ctx, &params, |_| true)
            .unwrap()
            .text;
        (engine.backend_name(), text)
    }
}

#[test]
fn serves_from_an_artifact_and_refuses_bad_ones_at_startup() {
    let Some(model) = model() else { return };
    let calib: String = std::fs::read_to_string("/usr/share/common-licenses/Apache-2.0")
        .expect("/usr/share/common-licenses/Apache-2.0 (install base-files)")
        .chars()
        .take(1200)
        .collect();
    let opts = mirage_artifact::BuildOptions {
        calib_name: "Apache-2.0".into(),
        calib_text: calib,
        max_calib_tokens: 64,
        threads: 2,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let art = dir.path().join("smol.mirage");
    std::fs::write(
        &art,
        mirage_artifact::build(&model, &opts, &mut |_| {})
            .unwrap()
            .bytes,
    )
    .unwrap();
    let art_s = art.to_str().unwrap();

    // Reference: the same artifact through a session.
    let prompt = "The capital of France is";
    let spec = mirage::LoadSpec::new(&model)
        .backend(mirage::BackendChoice::Cpu)
        .artifact(&art, None)
        .options(EngineOptions {
            n_ctx: 1024,
            threads: 2,
            ..Default::default()
        });
    let (name, want) = mirage::load(&spec, GreedyText(prompt, 12)).unwrap();
    assert_eq!(name, "superblock-cpu");

    // `auto` with an artifact is the CPU superblock backend.
    let srv = Server::start(&model, &["--artifact", art_s, "--backend", "auto"]);
    let m = &srv.request("GET", "/v1/models", &[], b"").json()["data"][0];
    assert_eq!(m["backend"], "superblock-cpu");
    assert_eq!(m["artifact"], "smol.mirage");
    let metrics = srv.request("GET", "/metrics", &[], b"").body;
    assert!(
        metrics.contains("mirage_backend_info{backend=\"superblock-cpu\"} 1"),
        "{metrics}"
    );
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let got = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!got.is_empty());
    assert_eq!(got, want);
    assert!(srv.terminate().success());

    // A missing file, a file that is not an artifact, an artifact of another
    // model: each refused at startup, saying why.
    let missing = dir.path().join("missing.mirage");
    let err = start_fails(&model, &["--artifact", missing.to_str().unwrap()]);
    assert!(
        err.contains("missing.mirage") && err.contains("No such file"),
        "{err}"
    );
    let err = start_fails(&model, &["--artifact", model.to_str().unwrap()]);
    assert!(err.contains("not a MIRAGE artifact"), "{err}");
    let other = dir.path().join("other.gguf");
    let mut bytes = std::fs::read(&model).unwrap();
    bytes.extend_from_slice(&[0u8; 32]);
    std::fs::write(&other, bytes).unwrap();
    let err = start_fails(&other, &["--artifact", art_s]);
    assert!(
        err.contains("smol.mirage")
            && err.contains("does not belong to model")
            && err.contains("other.gguf"),
        "{err}"
    );
    // An artifact on CUDA runs on the sparse CUDA backend: where no GPU
    // answers, startup says so, naming the backend.
    if !gpu_answers() {
        let err = start_fails(&model, &["--artifact", art_s, "--backend", "cuda"]);
        assert!(err.contains("`cuda`"), "{err}");
    }
    // Deterministic mode is a promise the superblock backend cannot keep.
    let err = start_fails(&model, &["--artifact", art_s, "--deterministic"]);
    assert!(
        err.contains("superblock-cpu") && err.contains("does not implement deterministic"),
        "{err}"
    );
    let err = start_fails(&model, &["--backend", "tpu"]);
    assert!(err.contains("unknown backend `tpu`"), "{err}");
}

/// Whether a CUDA device answers in this build.
fn gpu_answers() -> bool {
    #[cfg(feature = "cuda")]
    return mirage::cuda::CudaBackend::new(0).is_ok();
    #[cfg(not(feature = "cuda"))]
    false
}
