//! `mirage-server`: an OpenAI-compatible HTTP server for GGUF models with
//! continuous batching, Prometheus metrics and a chat page at `/`.

mod api;
mod error;
mod metrics;
mod routes;
mod scheduler;

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use mirage::{BackendChoice, LoadSpec, SparseMode};
use mirage_runtime::EngineOptions;
use tracing_subscriber::EnvFilter;

use crate::metrics::Metrics;
use crate::routes::AppState;
use crate::scheduler::{Scheduler, SchedulerConfig};

/// Serve a GGUF model over an OpenAI-compatible HTTP API.
#[derive(Debug, Parser)]
#[command(name = "mirage-server", version)]
struct Args {
    /// The GGUF model file.
    #[arg(long, default_value = "models/smollm2-135m-instruct-q4_1.gguf")]
    model: PathBuf,
    /// Backend: cpu, cuda, or auto (CUDA when built in and a GPU answers, else CPU; CPU with --artifact).
    #[arg(long, default_value = "auto")]
    backend: BackendChoice,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Run the FFN sparsely from this page-major artifact (built from --model; the CPU superblock backend,
    /// or the sparse CUDA backend with --backend cuda).
    #[arg(long)]
    artifact: Option<PathBuf>,
    /// With --artifact: BVH router margin in std units (default: the artifact's).
    #[arg(long, requires = "artifact")]
    margin: Option<f32>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (also read from MIRAGE_API_KEY).
    #[arg(long, env = "MIRAGE_API_KEY")]
    api_key: Option<String>,
    /// Sequences decoded together (KV cache slots).
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Positions per sequence (0: the model's training context, capped at 4096).
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
    /// Requests that may wait for a slot before new ones get 429.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Most rows (decode tokens plus prompt tokens) per forward pass.
    #[arg(long, default_value_t = 256)]
    batch_rows: usize,
    /// CPU threads (0: one per logical CPU).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Largest request body in bytes (413 above it).
    #[arg(long, default_value_t = 1 << 20)]
    max_body: usize,
    /// Seconds in-flight work may take after a shutdown signal before it is cancelled.
    #[arg(long, default_value_t = 10)]
    shutdown_grace: u64,
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

fn main() -> std::process::ExitCode {
    match serve(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line with the context chain, like mirage-cli.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn serve(args: Args) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if args.max_batch == 0 || args.queue == 0 {
        anyhow::bail!("--max-batch and --queue must be at least 1");
    }
    let metrics = Arc::new(Metrics::new(args.max_batch));
    let (jobs_tx, jobs_rx) = tokio::sync::mpsc::channel(args.queue);
    let engine = EngineOptions {
        threads: args.threads,
        n_ctx: args.ctx,
        n_batch: args.batch_rows,
        ..EngineOptions::default()
    };
    let mut load = LoadSpec::new(&args.model)
        .backend(args.backend)
        .options(engine);
    load.cuda_device = args.device;
    if let Some(a) = &args.artifact {
        load = load.artifact(a, args.margin.map(|margin| SparseMode::Bvh { margin }));
    }
    let cfg = SchedulerConfig {
        load,
        max_batch: args.max_batch,
    };
    let scheduler = Scheduler::start(cfg, jobs_rx, metrics.clone())
        .with_context(|| format!("starting on {}", args.model.display()))?;
    let _ = metrics.backend.set(scheduler.info.backend.clone());
    tracing::info!(model = %scheduler.info.id, backend = %scheduler.info.backend, artifact = ?scheduler.info.artifact, n_ctx = scheduler.info.n_ctx, max_batch = args.max_batch, "model loaded");
    let state = Arc::new(AppState {
        jobs: jobs_tx,
        info: scheduler.info.clone(),
        metrics,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        shutting_down: AtomicBool::new(false),
        body_limit: args.max_body,
        counter: AtomicU64::new(0),
    });
    let cancel_all = scheduler.cancel_all.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        // Tests and scripts read this line to find the port.
        println!("mirage-server listening on http://{addr}");
        let _ = std::io::stdout().flush();
        let app = routes::router(state.clone());
        let grace = Duration::from_secs(args.shutdown_grace);
        let st = state.clone();
        let shutdown = async move {
            shutdown_signal().await;
            tracing::info!("shutting down: refusing new work, finishing in-flight requests");
            st.shutting_down.store(true, Ordering::Relaxed);
            tokio::spawn(async move {
                tokio::select! {
                    _ = tokio::time::sleep(grace) => tracing::warn!("grace period over: cancelling in-flight requests"),
                    _ = shutdown_signal() => tracing::warn!("second signal: cancelling in-flight requests"),
                }
                cancel_all.store(true, Ordering::Relaxed);
            });
        };
        drop(state);
        axum::serve(listener, app).with_graceful_shutdown(shutdown).await?;
        anyhow::Ok(())
    })?;
    // Every job sender is gone with the router: the scheduler drains and ends.
    rt.shutdown_timeout(Duration::from_secs(1));
    scheduler.join();
    tracing::info!("stopped");
    Ok(())
}
