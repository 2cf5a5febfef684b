//! The loader on the real SmolLM2-135M model: backend choice, an artifact
//! built here from the model, and the errors for a missing, corrupt or
//! foreign artifact.

use std::path::PathBuf;

use mirage::artifact::{build, BuildOptions};
use mirage::gguf::FileMemory;
use mirage::{
    Backend, BackendChoice, Engine, EngineOptions, LoadError, LoadSpec, SparseMode, WeightMemory,
    WithEngine,
};

fn model_path() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/smollm2-135m-instruct-q4_1.gguf");
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
    panic!("{} is missing: run `cargo xtask fetch-models`", p.display());
}

/// The backend's name and the last position's logits of a fixed prompt.
struct Probe;

impl WithEngine for Probe {
    type Out = (String, Vec<f32>);
    fn run<B: Backend>(self, engine: Engine<B>) -> Self::Out {
        let tokens = engine.encode("The capital of France is", true).unwrap();
        let mut session = engine.session().unwrap();
        let logits = session.feed(&tokens).unwrap().to_vec();
        (engine.backend_name(), logits)
    }
}

/// Whether a CUDA device answers in this build.
fn gpu_here() -> bool {
    #[cfg(feature = "cuda")]
    return mirage::cuda::CudaBackend::new(0).is_ok();
    #[cfg(not(feature = "cuda"))]
    false
}

fn options() -> EngineOptions {
    EngineOptions {
        threads: 2,
        n_ctx: 256,
        ..EngineOptions::default()
    }
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0
}

/// How the engine holds its model file, and the last position's logits.
struct Memory;

impl WithEngine for Memory {
    type Out = (FileMemory, Vec<f32>);
    fn run<B: Backend>(self, engine: Engine<B>) -> Self::Out {
        let memory = engine.file_memory();
        (memory, Probe.run(engine).1)
    }
}

#[test]
fn the_cpu_reads_the_model_into_memory_unless_told_to_map_it() {
    let Some(model) = model_path() else { return };
    let spec = LoadSpec::new(&model)
        .backend(BackendChoice::Cpu)
        .options(options());
    // 98 MB: it fits wherever these tests run.
    let (memory, resident) = mirage::load(&spec, Memory).unwrap();
    assert_eq!(memory, FileMemory::Resident);
    let (memory, mapped) =
        mirage::load(&spec.clone().memory(WeightMemory::Mapped), Memory).unwrap();
    assert_eq!(memory, FileMemory::Mapped);
    assert_eq!(resident, mapped, "the same bytes give the same logits");
    // Auto never copies for CUDA, which uploads the weights.
    assert_eq!(WeightMemory::Auto.for_backend(false, 1), FileMemory::Mapped);
    assert_eq!(
        WeightMemory::Auto.for_backend(true, u64::MAX),
        FileMemory::Mapped
    );
    assert_eq!(
        WeightMemory::Resident.for_backend(false, u64::MAX),
        FileMemory::Resident
    );
}

#[test]
fn cpu_auto_and_artifact_backends_load_and_agree() {
    let Some(model) = model_path() else { return };
    let (name, cpu) = mirage::load(
        &LoadSpec::new(&model)
            .backend(BackendChoice::Cpu)
            .options(options()),
        Probe,
    )
    .unwrap();
    assert_eq!(name, "cpu");
    assert!(cpu.iter().all(|x| x.is_finite()));

    // auto: CUDA where it is built and a GPU answers, else the CPU.
    let (auto_name, auto) = mirage::load(&LoadSpec::new(&model).options(options()), Probe).unwrap();
    assert_eq!(auto_name, if gpu_here() { "cuda" } else { "cpu" });
    assert_eq!(argmax(&auto), argmax(&cpu));

    // An artifact built from this model runs on the superblock backend; with
    // every page it computes the dense FFN.
    let calib: String = std::fs::read_to_string("/usr/share/common-licenses/Apache-2.0")
        .expect("/usr/share/common-licenses/Apache-2.0 (install base-files)")
        .chars()
        .take(1200)
        .collect();
    let bopts = BuildOptions {
        calib_name: "Apache-2.0".into(),
        calib_text: calib,
        max_calib_tokens: 64,
        threads: 2,
        ..BuildOptions::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let art = dir.path().join("smol.mirage");
    std::fs::write(&art, build(&model, &bopts, &mut |_| {}).unwrap().bytes).unwrap();
    for choice in [BackendChoice::Auto, BackendChoice::Cpu] {
        let spec = LoadSpec::new(&model)
            .backend(choice)
            .artifact(&art, Some(SparseMode::All))
            .options(options());
        let (name, sparse) = mirage::load(&spec, Probe).unwrap();
        assert_eq!(name, "superblock-cpu", "{choice}");
        assert_eq!(argmax(&sparse), argmax(&cpu), "{choice}");
    }
    // The artifact's default mode (BVH router) loads too.
    let (name, _) = mirage::load(
        &LoadSpec::new(&model)
            .artifact(&art, None)
            .options(options()),
        Probe,
    )
    .unwrap();
    assert_eq!(name, "superblock-cpu");

    // cuda + artifact: the sparse CUDA backend over the artifact's pages
    // where a GPU answers (every page: the dense model's next token), else
    // the CUDA error.
    let spec = LoadSpec::new(&model)
        .backend(BackendChoice::Cuda)
        .artifact(&art, Some(SparseMode::All))
        .options(options());
    match mirage::load(&spec, Probe) {
        Ok((name, logits)) => {
            assert!(gpu_here(), "loaded on CUDA without a GPU");
            assert!(name.contains("cuda"), "{name}");
            assert_eq!(argmax(&logits), argmax(&cpu));
        }
        Err(e) => {
            assert!(!gpu_here(), "a GPU answered but: {e}");
            assert!(
                matches!(e, LoadError::CudaNotBuilt | LoadError::CudaUnavailable(_)),
                "{e:?}"
            );
        }
    }

    // A missing artifact names the file.
    let missing = dir.path().join("missing.mirage");
    let e = mirage::load(&LoadSpec::new(&model).artifact(&missing, None), Probe).unwrap_err();
    assert!(
        matches!(e, LoadError::Artifact { .. }) && e.to_string().contains("missing.mirage"),
        "{e}"
    );

    // A file that is not an artifact.
    let e = mirage::load(&LoadSpec::new(&model).artifact(&model, None), Probe).unwrap_err();
    assert!(e.to_string().contains("not a MIRAGE artifact"), "{e}");

    // The artifact with another model (the same GGUF plus one alignment of
    // trailing bytes: a different sha256).
    let other = dir.path().join("other.gguf");
    let mut bytes = std::fs::read(&model).unwrap();
    bytes.extend_from_slice(&[0u8; 32]);
    std::fs::write(&other, bytes).unwrap();
    let e = mirage::load(&LoadSpec::new(&other).artifact(&art, None), Probe).unwrap_err();
    assert!(matches!(e, LoadError::ArtifactMismatch { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("smol.mirage") && msg.contains("other.gguf") && msg.contains("sha256"),
        "{msg}"
    );

    // A missing model.
    let e = mirage::load(
        &LoadSpec::new(dir.path().join("nope.gguf")).backend(BackendChoice::Cpu),
        Probe,
    )
    .unwrap_err();
    assert!(
        matches!(e, LoadError::Model { .. }) && e.to_string().contains("nope.gguf"),
        "{e}"
    );
}
