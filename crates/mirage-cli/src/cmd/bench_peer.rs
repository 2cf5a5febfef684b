//! `mirage-cli bench --backend cpu --llamacpp LLAMA_BENCH`: MIRAGE's CPU
//! engine and llama.cpp's `llama-bench` on the same GGUF file, thread count
//! and test shapes, alternating in one run, with the ratio per test.
//!
//! The tests are llama-bench's: `ppN` is one prefill of N prompt tokens
//! into an empty f16 KV cache (llama-bench's default cache type), in
//! batches of 512 (its `n_ubatch`), logits of the last token only; `tgN` is
//! N single-token decode steps from an empty cache, each feeding the
//! previous argmax. Each repetition runs MIRAGE's tests once and
//! `llama-bench -r 1` once (llama-bench warms each test up itself; MIRAGE
//! warms up once before the first repetition), alternating which engine
//! goes first, and records the load average; the table shows the median of
//! the repetitions. Decode also gets its weight-read bandwidth as a share of
//! a memcpy measured here with the same thread count (read plus written
//! bytes per second): the machine's copy-bandwidth limit.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use mirage_runtime::{CpuBackend, KvDtype, Model, TokenSlot};

/// What one comparison measured (also the `--json` output).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct PeerReport {
    /// The GGUF file.
    pub model: String,
    /// Threads of both engines.
    pub threads: usize,
    /// Repetitions (the medians below are over them).
    pub reps: usize,
    /// One row per test.
    pub rows: Vec<PeerRow>,
    /// Weight bytes one decode step reads.
    pub weight_bytes_per_token: u64,
    /// memcpy bandwidth with `threads` threads, read plus written bytes/s.
    pub copy_gb_s: f64,
    /// llama.cpp's `build_commit` as llama-bench reports it.
    pub llamacpp_commit: String,
    /// 1-minute load average before the first repetition and after each.
    pub load: Vec<f64>,
    /// Logical CPUs of the machine.
    pub cpus: usize,
}

/// One test of a [`PeerReport`].
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct PeerRow {
    /// `pp128`, `tg64`, ...
    pub test: String,
    /// MIRAGE tok/s, median of the repetitions.
    pub mirage: f64,
    /// llama.cpp tok/s, median of the repetitions.
    pub llamacpp: f64,
    /// Every repetition's (MIRAGE, llama.cpp) tok/s.
    pub samples: Vec<(f64, f64)>,
}

impl PeerRow {
    /// MIRAGE over llama.cpp.
    pub fn ratio(&self) -> f64 {
        self.mirage / self.llamacpp
    }
    /// A decode test's weight-read bandwidth as a share of the copy rate.
    fn share(&self, tok_s: f64, r: &PeerReport) -> Option<f64> {
        self.test
            .starts_with("tg")
            .then(|| r.weight_bytes_per_token as f64 * tok_s / (r.copy_gb_s * 1e9))
    }
}

/// The comparison's settings.
pub struct PeerArgs<'a> {
    pub model: &'a Path,
    pub llama_bench: &'a Path,
    pub threads: usize,
    pub pp: &'a [usize],
    pub tg: usize,
    pub reps: usize,
    /// Map the model file instead of reading it into memory.
    pub mmap: bool,
}

/// Runs the comparison (see the module docs).
pub fn compare(a: &PeerArgs<'_>) -> anyhow::Result<PeerReport> {
    if a.pp.is_empty() || a.pp.contains(&0) || a.tg == 0 || a.reps == 0 {
        bail!("--pp sizes, --gen and --reps must be at least 1");
    }
    if !a.llama_bench.exists() {
        bail!(
            "{} does not exist: build it with scripts/build_llamacpp.sh",
            a.llama_bench.display()
        );
    }
    let file = Arc::new(super::bench::open_model(a.model, a.mmap, true)?);
    let weight_bytes = super::bench::weight_bytes_per_token(&file);
    let backend = CpuBackend::new(a.threads)?;
    let threads = backend.threads();
    let copy = threaded_copy_bandwidth(256 << 20, 5, threads);
    let model = Model::load(file, backend)?;
    let engine = MirageTests::new(&model, a.pp, a.tg)?;
    engine.warm_up()?;
    let mut load = vec![load_average()];
    // samples[test][rep] = (mirage, llama.cpp)
    let tests: Vec<String> =
        a.pp.iter()
            .map(|p| format!("pp{p}"))
            .chain([format!("tg{}", a.tg)])
            .collect();
    let mut samples = vec![Vec::new(); tests.len()];
    let mut commit = String::new();
    for rep in 0..a.reps {
        let (m, l) = if rep % 2 == 0 {
            let m = engine.run_all()?;
            (m, llama_bench_once(a, threads, &mut commit)?)
        } else {
            let l = llama_bench_once(a, threads, &mut commit)?;
            (engine.run_all()?, l)
        };
        for (i, s) in samples.iter_mut().enumerate() {
            s.push((m[i], l[i]));
        }
        load.push(load_average());
        eprintln!(
            "rep {}/{}: {} (load {:.2})",
            rep + 1,
            a.reps,
            tests
                .iter()
                .enumerate()
                .map(|(i, t)| format!("{t} {:.1} vs {:.1}", m[i], l[i]))
                .collect::<Vec<_>>()
                .join(", "),
            load.last().copied().unwrap_or(f64::NAN)
        );
    }
    let rows = tests
        .into_iter()
        .zip(samples)
        .map(|(test, s)| PeerRow {
            test,
            mirage: median(s.iter().map(|x| x.0).collect()),
            llamacpp: median(s.iter().map(|x| x.1).collect()),
            samples: s,
        })
        .collect();
    Ok(PeerReport {
        model: a.model.display().to_string(),
        threads,
        reps: a.reps,
        rows,
        weight_bytes_per_token: weight_bytes,
        copy_gb_s: copy / 1e9,
        llamacpp_commit: commit,
        load,
        cpus: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    })
}

/// Prints a report as a table.
pub fn print_report(r: &PeerReport) {
    println!("model   {}", r.model);
    println!(
        "threads {} (both engines), median of {} alternating runs; llama.cpp {}",
        r.threads, r.reps, r.llamacpp_commit
    );
    println!(
        "copy    {:.1} GB/s (memcpy, {} threads, read + written); weights/token {:.1} MiB",
        r.copy_gb_s,
        r.threads,
        r.weight_bytes_per_token as f64 / (1 << 20) as f64
    );
    println!();
    println!("| test | MIRAGE tok/s | llama.cpp tok/s | MIRAGE / llama.cpp | decode share of copy (MIRAGE / llama.cpp) |");
    println!("|---|---:|---:|---:|---:|");
    for row in &r.rows {
        let share = match (row.share(row.mirage, r), row.share(row.llamacpp, r)) {
            (Some(m), Some(l)) => format!("{:.0}% / {:.0}%", 100.0 * m, 100.0 * l),
            _ => "-".into(),
        };
        println!(
            "| {} | {:.1} | {:.1} | {:.2}x | {share} |",
            row.test,
            row.mirage,
            row.llamacpp,
            row.ratio()
        );
    }
    println!();
    println!("{}", load_line(&r.load, r.cpus, r.threads));
}

/// "load average ... " with a warning when the machine was busy.
pub fn load_line(load: &[f64], cpus: usize, threads: usize) -> String {
    let max = load.iter().copied().fold(f64::NAN, f64::max);
    format!(
        "load average (1 min) before and after each run: {} on {cpus} logical CPUs{}",
        load.iter()
            .map(|l| format!("{l:.2}"))
            .collect::<Vec<_>>()
            .join(" "),
        if max > threads as f64 {
            " (LOADED: other processes shared the cores; ratios from one run still compare like with like, absolute numbers do not)"
        } else {
            ""
        }
    )
}

/// MIRAGE's tests on a loaded model.
struct MirageTests<'a> {
    model: &'a Model<CpuBackend>,
    pp: &'a [usize],
    tg: usize,
    prompt: Vec<u32>,
}

impl<'a> MirageTests<'a> {
    fn new(model: &'a Model<CpuBackend>, pp: &'a [usize], tg: usize) -> anyhow::Result<Self> {
        let vocab = model.config().vocab_size.max(2);
        let n = pp.iter().copied().max().unwrap_or(1).max(1);
        // A fixed LCG: ids spread over the vocabulary (speed does not
        // depend on which they are).
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let prompt = (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) % (vocab as u64 - 1) + 1) as u32
            })
            .collect();
        Ok(MirageTests {
            model,
            pp,
            tg,
            prompt,
        })
    }

    fn warm_up(&self) -> anyhow::Result<()> {
        self.prefill(self.pp.iter().copied().min().unwrap_or(1).min(64))?;
        self.decode(2)?;
        Ok(())
    }

    /// tok/s of every pp test, then of the tg test.
    fn run_all(&self) -> anyhow::Result<Vec<f64>> {
        let mut out = Vec::new();
        for &p in self.pp {
            out.push(self.prefill(p)?);
        }
        out.push(self.decode(self.tg)?);
        Ok(out)
    }

    /// One prefill of `n` tokens into an empty cache, in batches of 512.
    fn prefill(&self, n: usize) -> anyhow::Result<f64> {
        let m = self.model;
        let mut cache = m.new_kv_cache(n, 1, KvDtype::F16)?;
        let mut scratch = m.new_scratch();
        let mut logits = Vec::new();
        let slots: Vec<TokenSlot> = (0..n).map(|pos| TokenSlot { seq: 0, pos }).collect();
        let t = Instant::now();
        for (chunk, s) in self.prompt[..n].chunks(512).zip(slots.chunks(512)) {
            m.forward(
                chunk,
                s,
                &[chunk.len() - 1],
                &mut cache,
                &mut scratch,
                &mut logits,
            )?;
        }
        Ok(n as f64 / t.elapsed().as_secs_f64())
    }

    /// `n` single-token steps from an empty cache.
    fn decode(&self, n: usize) -> anyhow::Result<f64> {
        let m = self.model;
        let mut cache = m.new_kv_cache(n + 1, 1, KvDtype::F16)?;
        let mut scratch = m.new_scratch();
        let mut logits = Vec::new();
        let mut tok = self.prompt[0];
        let t = Instant::now();
        for pos in 0..n {
            m.forward(
                &[tok],
                &[TokenSlot { seq: 0, pos }],
                &[0],
                &mut cache,
                &mut scratch,
                &mut logits,
            )?;
            tok = super::bench::argmax(&logits);
        }
        Ok(n as f64 / t.elapsed().as_secs_f64())
    }
}

/// One `llama-bench -r 1` run of every test: tok/s per test, in the order
/// of [`PeerArgs::pp`] then tg.
fn llama_bench_once(
    a: &PeerArgs<'_>,
    threads: usize,
    commit: &mut String,
) -> anyhow::Result<Vec<f64>> {
    let pp_list =
        a.pp.iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(",");
    let out = Command::new(a.llama_bench)
        .arg("-m")
        .arg(a.model)
        .args([
            "-p",
            &pp_list,
            "-n",
            &a.tg.to_string(),
            "-t",
            &threads.to_string(),
            "-r",
            "1",
            "-o",
            "json",
        ])
        .output()
        .with_context(|| format!("running {}", a.llama_bench.display()))?;
    if !out.status.success() {
        bail!(
            "llama-bench failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("parsing llama-bench JSON")?;
    let tests = json
        .as_array()
        .context("llama-bench JSON is not an array")?;
    let mut speed = |pp: usize, tg: usize| -> anyhow::Result<f64> {
        let t = tests
            .iter()
            .find(|t| {
                t["n_prompt"].as_u64() == Some(pp as u64) && t["n_gen"].as_u64() == Some(tg as u64)
            })
            .with_context(|| format!("llama-bench output has no pp{pp}/tg{tg} test"))?;
        if commit.is_empty() {
            if let Some(c) = t["build_commit"].as_str() {
                *commit = c.to_string();
            }
        }
        t["avg_ts"]
            .as_f64()
            .context("llama-bench test without avg_ts")
    };
    let mut out = Vec::new();
    for &p in a.pp {
        out.push(speed(p, 0)?);
    }
    out.push(speed(0, a.tg)?);
    Ok(out)
}

/// memcpy bandwidth with `threads` threads each copying its share (read +
/// written bytes per second), median of `iters`.
pub fn threaded_copy_bandwidth(bytes: usize, iters: usize, threads: usize) -> f64 {
    let threads = threads.max(1);
    let src: Vec<u8> = (0..bytes).map(|i| (i * 31 + 7) as u8).collect();
    let mut dst = vec![0u8; bytes];
    let part = bytes.div_ceil(threads);
    let mut times = Vec::new();
    for _ in 0..iters + 1 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, c) in dst.chunks_mut(part).zip(src.chunks(part)) {
                s.spawn(move || {
                    d.copy_from_slice(c);
                    std::hint::black_box(d);
                });
            }
        });
        times.push(t.elapsed().as_secs_f64());
    }
    times.remove(0);
    times.sort_by(|a, b| a.total_cmp(b));
    2.0 * bytes as f64 / times[times.len() / 2]
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// The 1-minute load average (Linux), NaN where unreadable.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}
