//! `cargo xtask fuzz TARGET|all [--execs N] [--seconds S]`: builds the fuzz
//! harness (`fuzz/`) with LLVM's SanitizerCoverage counters, which stable
//! rustc emits with the flags below, into its own target folder
//! (`fuzz/target/`, so the workspace's build cache is untouched), then runs
//! `mirage-fuzz run` on each target and prints one line per target.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};

/// The coverage flags (edge coverage, one inline 8-bit counter per edge).
pub const COVERAGE_RUSTFLAGS: &str = "-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=3 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cdebug-assertions -Coverflow-checks";

/// Arguments of `cargo xtask fuzz`.
#[derive(Debug, clap::Args)]
pub struct FuzzArgs {
    /// A target (`mirage-fuzz list`), or `all`.
    target: String,
    /// Mutated executions per target.
    #[arg(long, default_value_t = 1_000_000)]
    execs: u64,
    /// Stop each target after this many seconds.
    #[arg(long)]
    seconds: Option<f64>,
    /// Seed of the mutation stream.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// Runs the task.
pub fn run(args: &FuzzArgs, root: &Path) -> anyhow::Result<()> {
    let target_dir = root.join("fuzz/target");
    // With an explicit --target the flags reach only the target's crates,
    // not build scripts and proc macros (which would need the counters'
    // init function too).
    let host = host_triple()?;
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(root)
        .args([
            "build",
            "--release",
            "-p",
            "mirage-fuzz",
            "--bin",
            "mirage-fuzz",
        ])
        .args(["--target", &host])
        .arg("--target-dir")
        .arg(&target_dir)
        .env("RUSTFLAGS", COVERAGE_RUSTFLAGS)
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("building the instrumented fuzz harness failed");
    }
    let exe = target_dir.join(&host).join("release/mirage-fuzz");
    let targets: Vec<String> = if args.target == "all" {
        let out = Command::new(&exe).arg("list").output()?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .collect()
    } else {
        vec![args.target.clone()]
    };
    let mut failed = Vec::new();
    for t in &targets {
        let mut cmd = Command::new(&exe);
        cmd.args(["run", t, "--execs", &args.execs.to_string()])
            .args(["--seed", &args.seed.to_string()]);
        if let Some(s) = args.seconds {
            cmd.args(["--seconds", &s.to_string()]);
        }
        if !cmd.status().context("running mirage-fuzz")?.success() {
            failed.push(t.clone());
        }
    }
    if !failed.is_empty() {
        bail!("findings in: {}", failed.join(", "));
    }
    Ok(())
}

/// The host's target triple, as rustc reports it.
fn host_triple() -> anyhow::Result<String> {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .context("running rustc -vV")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .context("rustc -vV printed no host")
}
