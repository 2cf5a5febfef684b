//! `cargo xtask route-export`: real router queries for the routing benchmark.
//!
//! Loads a MIRAGE artifact and its source GGUF, runs the dense CPU engine over
//! held-out text, projects every layer's FFN input with that layer's router
//! projection, and writes, per layer, the router data the runtime routes with
//! (the artifact's boxes inflated by `--margin`, default the artifact's default
//! margin) and the query points. `route-real` (crates/mirage-route) reads it.
//!
//! # File layout (version 1, little-endian)
//!
//! | size | field |
//! | --- | --- |
//! | 4 | magic `b"MRRQ"` |
//! | 4 | version `u32` = 1 |
//! | 4 | `n_layer` `u32` |
//! | 4 | `json_len` `u32`, then `json_len` bytes of UTF-8 JSON (provenance) |
//! | per layer | `router_len` `u64`, router bytes (`RouterData::to_bytes`), `queries` `u32`, `queries * slices * 3` `f32` points, query-major |

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use mirage_artifact::format::sha256_hex;
use mirage_artifact::Artifact;
use mirage_gguf::GgufFile;
use mirage_runtime::observe::observe_ffn_inputs;
use mirage_runtime::{CpuBackend, Engine, EngineOptions, KvDtype};

/// Arguments of `cargo xtask route-export`.
#[derive(Debug, clap::Args)]
pub struct RouteExportArgs {
    /// The artifact (`cargo xtask build-artifacts` output).
    #[arg(long)]
    artifact: PathBuf,
    /// Its source GGUF (default: models/<source_name from the artifact>).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Held-out text (must differ from the calibration text).
    #[arg(long, default_value = "/usr/share/common-licenses/GFDL-1.3")]
    text: PathBuf,
    /// Most tokens of the text.
    #[arg(long, default_value_t = 384)]
    max_tokens: usize,
    /// Router margin in per-axis std units (default: the artifact's default margin).
    #[arg(long)]
    margin: Option<f32>,
    /// Output file.
    #[arg(long)]
    out: PathBuf,
    /// CPU threads (0: all).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

/// Magic of the export file.
const MAGIC: &[u8; 4] = b"MRRQ";
/// Version of the export file.
const VERSION: u32 = 1;

/// Runs the task.
pub fn run(args: &RouteExportArgs, root: &Path) -> anyhow::Result<()> {
    let artifact = Artifact::open(&args.artifact)
        .with_context(|| format!("loading {}", args.artifact.display()))?;
    let meta = artifact.meta().clone();
    let model_path = args
        .model
        .clone()
        .unwrap_or_else(|| root.join("models").join(&meta.source_name));
    let file = Arc::new(
        GgufFile::open(&model_path).with_context(|| format!("opening {}", model_path.display()))?,
    );
    artifact.check_source(&file)?;
    let text = std::fs::read_to_string(&args.text)
        .with_context(|| format!("reading {}", args.text.display()))?;
    if sha256_hex(text.as_bytes()) == meta.calib_sha256 {
        bail!(
            "{} is the calibration text; export queries from held-out text",
            args.text.display()
        );
    }
    let margin = args.margin.unwrap_or(meta.default_margin);
    let engine = Engine::from_file(
        file.clone(),
        CpuBackend::new(args.threads)?,
        EngineOptions {
            threads: args.threads,
            ..EngineOptions::default()
        },
    )?;
    let mut tokens = engine.encode(&text, true)?;
    tokens.truncate(args.max_tokens.min(engine.n_ctx()));
    if tokens.is_empty() {
        bail!("{} gives no tokens", args.text.display());
    }
    let (n, d, n_layer) = (tokens.len(), meta.d_model, meta.n_layer);
    let mut xs: Vec<Vec<f32>> = vec![Vec::with_capacity(n * d); n_layer];
    observe_ffn_inputs(
        engine.model(),
        &tokens,
        128,
        KvDtype::F32,
        &mut |l, _, x| xs[l].extend_from_slice(x),
        &mut |_, _| {},
    )?;
    drop(engine);

    let provenance = serde_json::json!({
        "artifact": args.artifact.display().to_string(),
        "model": meta.source_name,
        "text": args.text.display().to_string(),
        "tokens": n,
        "margin": margin,
        "n_layer": n_layer,
        "d_model": d,
        "slices": meta.slices,
    })
    .to_string();
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(n_layer as u32).to_le_bytes());
    out.extend_from_slice(&(provenance.len() as u32).to_le_bytes());
    out.extend_from_slice(provenance.as_bytes());
    let mut pages = Vec::with_capacity(n_layer);
    let mut points = Vec::new();
    for (l, x) in xs.iter().enumerate() {
        let router = artifact.router_with_margin(l, margin);
        pages.push(router.pages());
        points.clear();
        for t in 0..n {
            router.project_into(&x[t * d..(t + 1) * d], &mut points)?;
        }
        let rb = router.to_bytes();
        out.extend_from_slice(&(rb.len() as u64).to_le_bytes());
        out.extend_from_slice(&rb);
        out.extend_from_slice(&(n as u32).to_le_bytes());
        for p in &points {
            for v in p {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    std::fs::write(&args.out, &out).with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "{}: {} layers x {n} tokens of {} (margin {margin}), pages per layer {:?}, {} bytes",
        args.out.display(),
        n_layer,
        args.text.display(),
        pages,
        out.len()
    );
    Ok(())
}
