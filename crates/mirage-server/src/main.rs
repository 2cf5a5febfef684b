//! `mirage-server`: an OpenAI-compatible HTTP server for GGUF models with
//! continuous batching, Prometheus metrics and a chat page at `/`.

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use mirage::{BackendChoice, LoadSpec, SparseMode, WeightMemory};
use mirage_runtime::EngineOptions;
use mirage_server::access::{cors_layer, HostPolicy, OriginPolicy};
use mirage_server::body::BodyLimits;
use mirage_server::conn::{self, ConnLimits};
use mirage_server::metrics::Metrics;
use mirage_server::routes::{self, AppState};
use mirage_server::scheduler::{Scheduler, SchedulerConfig};
use tracing_subscriber::EnvFilter;

/// Serve a GGUF model over an OpenAI-compatible HTTP API.
#[derive(Debug, Parser)]
#[command(name = "mirage-server", version)]
#[command(
    after_help = "Repeatable outputs: with --deterministic, a request with `temperature: 0` (or a fixed `seed`) \
gives the same tokens whatever else the server runs, for the same model file, binary and CPU."
)]
struct Args {
    /// The GGUF model file.
    #[arg(
        short = 'm',
        long,
        default_value = "models/smollm2-135m-instruct-q4_1.gguf"
    )]
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
    /// Activation sparsity (CPU): skip this share of the projections' weights per token (e.g. 0.4), or
    /// `auto` with --max-ppl-increase; reads `<model>.activation.mirage` unless --artifact names it.
    #[arg(long, conflicts_with = "margin")]
    sparsity: Option<String>,
    /// With --sparsity auto: the highest sparsity whose calibration perplexity rises at most this much (1%).
    #[arg(long, requires = "sparsity")]
    max_ppl_increase: Option<String>,
    /// Address to listen on (an IP address, or a name: its first address, and a `Host` it answers to).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* and /metrics (also read from MIRAGE_API_KEY).
    #[arg(long, env = "MIRAGE_API_KEY")]
    api_key: Option<String>,
    /// Sequences decoded together (KV cache slots).
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Context size: positions per sequence (0: the model's training context, capped at 4096).
    #[arg(short = 'c', long = "ctx-size", alias = "ctx", default_value_t = 2048)]
    ctx: usize,
    /// Requests that may wait for a slot before new ones get 429.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Most rows (decode tokens plus prompt tokens) per forward pass.
    #[arg(long, default_value_t = 256)]
    batch_rows: usize,
    /// CPU threads (0: one per logical CPU).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// Largest request body in bytes (413 above it).
    #[arg(long, default_value_t = 1 << 20)]
    max_body: usize,
    /// Seconds in-flight work may take after a shutdown signal before it is cancelled.
    #[arg(long, default_value_t = 10)]
    shutdown_grace: u64,
    /// Batch-invariant arithmetic: a request's logits are the same bits whatever else runs beside it, so
    /// `temperature: 0` (or a fixed `seed`) repeats exactly. Slower; CPU backend only (`auto` picks it).
    #[arg(long)]
    deterministic: bool,
    /// Map the model file (and artifact) instead of reading it into memory: an instant start and pages
    /// shared with other processes, but the CPU decode reads the weights through 4 KiB pages (on a
    /// 2-vCPU Xeon VM the 1.5B model decoded 1.3-1.7x slower so). Default: read into huge-page memory on
    /// the CPU when it fits.
    #[arg(long)]
    mmap: bool,
    /// Most open connections (also capped at the open-file limit less 128). At the limit a new connection
    /// closes the longest-waiting one without a request in progress; when all have one it gets 503.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    max_connections: u64,
    /// Seconds from a connection's accept (or a request's first byte) to the end of the request head;
    /// the connection is closed after that.
    #[arg(long, default_value_t = 10.0, value_parser = positive_secs)]
    header_timeout: f64,
    /// Seconds from the end of the request head to the last byte of its body (408 after that).
    #[arg(long, default_value_t = 30.0, value_parser = positive_secs)]
    body_timeout: f64,
    /// Seconds a keep-alive connection may wait for its next request before it is closed.
    #[arg(long, default_value_t = 60.0, value_parser = positive_secs)]
    idle_timeout: f64,
    /// Largest request head (request line and headers) in bytes (431 above it).
    #[arg(long, default_value_t = 16 * 1024, value_parser = clap::value_parser!(u64).range(1024..=1 << 20))]
    max_header_bytes: u64,
    /// Also answer requests whose `Host` is this name (repeatable; `*`: any). Without it the server answers to
    /// the address it is bound to and, bound to loopback or to 0.0.0.0/::, to `localhost` (on 0.0.0.0/:: also
    /// to any IP literal); other names get 403 (a DNS-rebinding page sends its own name).
    #[arg(long = "allowed-host", value_name = "HOST")]
    allowed_hosts: Vec<String>,
    /// Let web pages from this origin call the API (repeatable, e.g. `--cors https://app.example`; `*`: any).
    /// Off by default: cross-origin browser requests get 403 and no CORS headers.
    #[arg(long = "cors", value_name = "ORIGIN")]
    cors: Vec<String>,
}

fn positive_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!("`{s}` is not a number of seconds in (0, 86400]")),
    }
}

/// Raises the open-file limit to its hard limit (sockets are files) and
/// returns the connection limit that fits under it.
fn connection_limit(asked: u64) -> (usize, u64) {
    let files = rlimit::increase_nofile_limit(u64::MAX)
        .or_else(|_| rlimit::getrlimit(rlimit::Resource::NOFILE).map(|(soft, _)| soft))
        .unwrap_or(1024);
    // Room for the model file, the runtime's own descriptors and
    // connections on their way out.
    let fit = files.saturating_sub(128).max(16);
    (asked.min(fit) as usize, files)
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
        deterministic: args.deterministic,
        ..EngineOptions::default()
    };
    let mut load = LoadSpec::new(&args.model)
        .backend(args.backend)
        .options(engine)
        .memory(WeightMemory::mapped_if(args.mmap));
    load.cuda_device = args.device;
    if let Some(a) = &args.artifact {
        load = load.artifact(a, args.margin.map(|margin| SparseMode::Bvh { margin }));
    }
    if let Some(s) = &args.sparsity {
        load = load.sparsity(
            mirage::SparsitySpec::parse(s, args.max_ppl_increase.as_deref())
                .map_err(anyhow::Error::msg)?,
        );
    }
    let cfg = SchedulerConfig {
        load,
        max_batch: args.max_batch,
    };
    let scheduler = Scheduler::start(cfg, jobs_rx, metrics.clone())
        .with_context(|| format!("starting on {}", args.model.display()))?;
    let _ = metrics.backend.set(scheduler.info.backend.clone());
    tracing::info!(model = %scheduler.info.id, backend = %scheduler.info.backend, artifact = ?scheduler.info.artifact, n_ctx = scheduler.info.n_ctx, max_batch = args.max_batch, "model loaded");
    // A name (`--host localhost`) binds its first address and is a name the
    // server answers to.
    let mut allowed_hosts = args.allowed_hosts.clone();
    let bind: IpAddr = match args.host.parse() {
        Ok(ip) => ip,
        Err(_) => {
            use std::net::ToSocketAddrs;
            allowed_hosts.push(args.host.clone());
            (args.host.as_str(), args.port)
                .to_socket_addrs()
                .with_context(|| format!("--host {}", args.host))?
                .next()
                .with_context(|| format!("--host {}: no address", args.host))?
                .ip()
        }
    };
    let origins = OriginPolicy::new(&args.cors);
    let cors = origins.enabled().then(|| cors_layer(&origins, &args.cors));
    let state = Arc::new(AppState {
        jobs: jobs_tx,
        info: scheduler.info.clone(),
        metrics: metrics.clone(),
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        shutting_down: AtomicBool::new(false),
        body_limits: BodyLimits {
            max_bytes: args.max_body,
            timeout: Duration::from_secs_f64(args.body_timeout),
        },
        hosts: HostPolicy::new(bind, &allowed_hosts),
        origins,
        cors,
        counter: AtomicU64::new(0),
    });
    let (max_connections, files) = connection_limit(args.max_connections);
    let limits = ConnLimits {
        max_connections,
        header_timeout: Duration::from_secs_f64(args.header_timeout),
        idle_timeout: Duration::from_secs_f64(args.idle_timeout),
        max_header_bytes: args.max_header_bytes as usize,
    };
    tracing::info!(max_connections, open_file_limit = files, "connection limit");
    let cancel_all = scheduler.cancel_all.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((bind, args.port))
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
        // In-flight requests get the grace period, then a few seconds to
        // end after their generation is cancelled.
        conn::serve(listener, app, limits, metrics, shutdown, grace + Duration::from_secs(5)).await;
        anyhow::Ok(())
    })?;
    // Every job sender is gone with the router: the scheduler drains and ends.
    rt.shutdown_timeout(Duration::from_secs(1));
    scheduler.join();
    tracing::info!("stopped");
    Ok(())
}
