//! `mirage-fuzz`: list, run and replay the fuzz targets (see the crate doc
//! and fuzz/README.md). `cargo xtask fuzz` builds it with coverage counters
//! and runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use mirage_fuzz::engine::{self, Options, SharedPage};
use mirage_fuzz::{alloc, coverage, find_target, targets, Target};

#[derive(Debug, Parser)]
#[command(
    name = "mirage-fuzz",
    about = "Fuzz MIRAGE's input parsers on stable Rust"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, clap::Args, Clone)]
struct RunArgs {
    /// The target (`mirage-fuzz list`).
    target: String,
    /// Mutated executions to run.
    #[arg(long, default_value_t = 1_000_000)]
    execs: u64,
    /// Stop after this many seconds even if the executions are not done.
    #[arg(long)]
    seconds: Option<f64>,
    /// Seed of the mutation stream.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// An input running longer than this many seconds is a hang.
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
    /// Cap on one allocation and on the live heap, in MiB.
    #[arg(long, default_value_t = 1024)]
    cap_mib: usize,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// The targets and what each checks.
    List,
    /// Fuzz a target in a watched child process; save what crashes or hangs it.
    Run(RunArgs),
    /// Run inputs through a target once each (a crasher, a corpus folder).
    Replay {
        /// The target.
        target: String,
        /// Files or folders of inputs.
        inputs: Vec<PathBuf>,
    },
    /// The child side of `run` (not for direct use).
    #[command(hide = true)]
    Worker {
        #[command(flatten)]
        args: RunArgs,
        /// The page shared with the supervisor.
        #[arg(long)]
        page: PathBuf,
    },
}

/// The fuzz crate's folder: corpus, regressions and artifacts live there.
fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn target(name: &str) -> anyhow::Result<Target> {
    find_target(name).with_context(|| {
        let names: Vec<&str> = targets::all().iter().map(|t| t.name).collect();
        format!("no target {name:?} (targets: {})", names.join(", "))
    })
}

fn corpus_dirs(name: &str) -> Vec<PathBuf> {
    let d = fuzz_dir();
    vec![
        d.join("corpus").join(name),
        d.join("regressions").join(name),
        d.join("target/corpus").join(name),
    ]
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Cmd::List => {
            for t in targets::all() {
                println!("{:<16} {}", t.name, t.about);
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Replay {
            target: name,
            inputs,
        } => {
            let t = target(&name)?;
            let mut files = Vec::new();
            for p in &inputs {
                if p.is_dir() {
                    files.extend(engine::read_dir_inputs(p));
                } else {
                    files.push((
                        p.clone(),
                        std::fs::read(p).with_context(|| p.display().to_string())?,
                    ));
                }
            }
            let mut failed = 0;
            for (p, bytes) in &files {
                match engine::run_one(&t, bytes) {
                    Ok(()) => println!("ok    {}", p.display()),
                    Err(m) => {
                        failed += 1;
                        println!("PANIC {}: {m}", p.display());
                    }
                }
            }
            println!("{} inputs, {failed} panicked", files.len());
            Ok(if failed == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Cmd::Worker { args, page } => worker(&args, &page),
        Cmd::Run(args) => supervise(&args),
    }
}

fn worker(args: &RunArgs, page: &Path) -> anyhow::Result<ExitCode> {
    alloc::set_cap(args.cap_mib << 20);
    let t = target(&args.target)?;
    let mut shared = SharedPage::open(page)?;
    shared.install();
    let opts = Options {
        execs: args.execs,
        max_time: args.seconds.map(Duration::from_secs_f64),
        seed: args.seed,
        corpus_dirs: corpus_dirs(t.name),
        save_dir: Some(fuzz_dir().join("target/corpus").join(t.name)),
        status_every: Some(Duration::from_secs(10)),
    };
    match engine::fuzz(&t, &opts, Some(&mut shared)) {
        Ok(r) => {
            println!(
                "{}: {} executions in {:.1} s ({:.0}/s), corpus {}, coverage features {} of {} counters{}, {} allocations refused and handled, peak heap {:.1} MiB, no crash",
                t.name,
                r.execs,
                r.secs,
                r.execs as f64 / r.secs.max(1e-9),
                r.corpus,
                r.features,
                r.counters,
                if coverage::instrumented() { "" } else { " (not instrumented: no feedback)" },
                r.refused_allocations,
                r.peak_live_bytes as f64 / (1 << 20) as f64,
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(f) => {
            eprintln!("{}: panic: {}", t.name, f.message);
            // The supervisor saves the input from the shared page.
            std::process::exit(101)
        }
    }
}

fn supervise(args: &RunArgs) -> anyhow::Result<ExitCode> {
    let t = target(&args.target)?;
    let artifacts = fuzz_dir().join("artifacts").join(t.name);
    std::fs::create_dir_all(&artifacts)?;
    let page_path = artifacts.join(format!(".page-{}", std::process::id()));
    let page = SharedPage::create(&page_path, t.max_len)?;
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.arg("worker")
        .arg(&args.target)
        .args(["--execs", &args.execs.to_string()])
        .args(["--seed", &args.seed.to_string()])
        .args(["--timeout", &args.timeout.to_string()])
        .args(["--cap-mib", &args.cap_mib.to_string()])
        .arg("--page")
        .arg(&page_path);
    if let Some(s) = args.seconds {
        cmd.args(["--seconds", &s.to_string()]);
    }
    let started = Instant::now();
    let mut child = cmd.spawn().context("starting the worker")?;
    let (mut last_execs, mut last_progress) = (0, Instant::now());
    let outcome = loop {
        std::thread::sleep(Duration::from_millis(50));
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        let execs = page.execs();
        if execs != last_execs {
            (last_execs, last_progress) = (execs, Instant::now());
        } else if last_progress.elapsed().as_secs_f64() > args.timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
    };
    let finding = match outcome {
        Some(status) if status.success() => None,
        Some(status) => {
            use std::os::unix::process::ExitStatusExt;
            let refused = page.refused();
            let kind = if refused > 0 && status.signal().is_some() {
                format!("oom-{refused}")
            } else {
                "crash".to_string()
            };
            let during = if page.was_mutating() {
                " while MUTATING this input (a harness bug, not a target finding)"
            } else {
                ""
            };
            Some((kind, format!("worker ended with {status}{during}")))
        }
        None => Some((
            "timeout".to_string(),
            format!("no execution finished for {} s", args.timeout),
        )),
    };
    let _ = std::fs::remove_file(&page_path);
    let Some((kind, why)) = finding else {
        eprintln!(
            "{}: done in {:.1} s",
            t.name,
            started.elapsed().as_secs_f64()
        );
        return Ok(ExitCode::SUCCESS);
    };
    let input = page.input();
    let path = artifacts.join(format!("{kind}-{}", short_hash(&input)));
    std::fs::write(&path, &input)?;
    eprintln!(
        "{}: FOUND {kind} after {} executions: {why}\n  input ({} bytes): {}\n  replay: cargo run --release -p mirage-fuzz -- replay {} {}",
        t.name,
        page.execs(),
        input.len(),
        path.display(),
        t.name,
        path.display()
    );
    if kind == "timeout" || kind.starts_with("oom") {
        bail!("{kind}");
    }
    Ok(ExitCode::FAILURE)
}

fn short_hash(data: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(&sha2::Sha256::digest(data)[..8])
}
