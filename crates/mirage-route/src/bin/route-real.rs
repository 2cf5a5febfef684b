//! `route-real`: every router on REAL artifact router data.
//!
//! Reads files written by `cargo xtask route-export` (per layer: the router
//! data the runtime routes with and the projected FFN inputs of a dense pass
//! over held-out text), then
//! 1. checks that brute force, wgpu and Vulkan RT return exactly the CPU BVH's
//!    candidate sets for every layer and every query (whole batch at once,
//!    and again chunk by chunk at every benchmarked batch size);
//! 2. times each router: µs per token-layer and queries/s when each layer's
//!    queries are routed in batches of 1, 24 and the whole export, summed over
//!    all layers (one router per layer, built once, like an artifact load).
//!
//! Prints the equality summary, then a markdown table LAST. Exits 1 on any
//! mismatch, and 2 when `--require-gpu` (or `MIRAGE_REQUIRE_GPU_TESTS=1`) is
//! set and a GPU path (wgpu or Vulkan RT) is unavailable.
//!
//! With `--all-routed`, each export is also run with every page routed (the
//! trunk pages' fitted boxes included) at threshold 1 and at threshold =
//! slices, because the artifacts route only a few pages per model (most pages
//! are always-on trunk pages) and the equality check should exercise every box.
//!
//! Usage: `route-real [--seconds S] [--require-gpu] [--batches 1,24,all]
//! [--all-routed [--variant-batches 24,all]] FILE...`

use std::time::{Duration, Instant};

use mirage_route::{
    BruteForce, CandidateSet, CpuBvh, RouteError, Router, RouterData, VulkanRtRouter, WgpuOptions,
    WgpuRouter,
};

/// One layer of an export file.
struct Layer {
    data: RouterData,
    points: Vec<[f32; 3]>,
    queries: usize,
}

/// One export file.
struct Export {
    name: String,
    provenance: String,
    layers: Vec<Layer>,
}

fn read_export(path: &str) -> Result<Export, String> {
    let b = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let s = b
            .get(at..at.checked_add(n).ok_or("size overflow")?)
            .ok_or_else(|| format!("{path}: ends early at {at}"))?;
        at += n;
        Ok(s)
    };
    if take(4)? != b"MRRQ" {
        return Err(format!("{path}: not a route-export file (magic)"));
    }
    let u32_of = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes")) as usize;
    let version = u32_of(take(4)?);
    if version != 1 {
        return Err(format!(
            "{path}: export version {version}, this reader knows 1"
        ));
    }
    let n_layer = u32_of(take(4)?);
    let json_len = u32_of(take(4)?);
    let provenance = String::from_utf8_lossy(take(json_len)?).into_owned();
    let mut layers = Vec::with_capacity(n_layer);
    for l in 0..n_layer {
        let rlen = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes")) as usize;
        let data =
            RouterData::from_bytes(take(rlen)?).map_err(|e| format!("{path} layer {l}: {e}"))?;
        let queries = u32_of(take(4)?);
        let n_f = queries
            .checked_mul(data.slices * 3)
            .ok_or("size overflow")?;
        let raw = take(n_f.checked_mul(4).ok_or("size overflow")?)?;
        let f: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        let points = f.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect();
        layers.push(Layer {
            data,
            points,
            queries,
        });
    }
    if at != b.len() {
        return Err(format!("{path}: {} trailing bytes", b.len() - at));
    }
    let name = std::path::Path::new(path)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(Export {
        name,
        provenance,
        layers,
    })
}

/// Pages that need slice hits (threshold > 0); the others are always-on trunk pages.
fn routed_of(d: &RouterData) -> usize {
    d.thresholds.iter().filter(|&&t| t > 0).count()
}

type Make = fn(&RouterData) -> Result<Box<dyn Router>, RouteError>;

const MAKERS: [(&str, Make); 4] = [
    ("brute-force", |d| Ok(Box::new(BruteForce::new(d)?))),
    ("cpu-bvh", |d| Ok(Box::new(CpuBvh::new(d)?))),
    ("wgpu", |d| {
        Ok(Box::new(WgpuRouter::new(
            d,
            WgpuOptions {
                allow_software: true,
            },
        )?))
    }),
    ("vulkan-rt", |d| Ok(Box::new(VulkanRtRouter::new(d)?))),
];

/// Number of queries whose candidate sets differ, and the first one.
fn diff(want: &CandidateSet, got: &CandidateSet) -> (usize, Option<String>) {
    if want.queries != got.queries || want.pages != got.pages {
        return (
            want.queries.max(got.queries),
            Some(format!(
                "shape {}x{} vs {}x{}",
                want.queries, want.pages, got.queries, got.pages
            )),
        );
    }
    let mut n = 0;
    let mut first = None;
    for q in 0..want.queries {
        let (a, b) = (want.pages_of(q), got.pages_of(q));
        if a != b {
            n += 1;
            first.get_or_insert_with(|| format!("query {q}: cpu-bvh {a:?} vs {b:?}"));
        }
    }
    (n, first)
}

/// Routes all of a layer's queries in chunks of `batch` queries; returns the chunks' sets.
fn route_chunks(
    r: &mut dyn Router,
    layer: &Layer,
    batch: usize,
) -> Result<Vec<CandidateSet>, RouteError> {
    layer
        .points
        .chunks(batch * layer.data.slices)
        .map(|c| r.route(c))
        .collect()
}

/// The part of `set` for queries `from..from + n`.
fn slice_set(set: &CandidateSet, from: usize, n: usize) -> CandidateSet {
    let w = set.words_per_query;
    CandidateSet {
        queries: n,
        pages: set.pages,
        words_per_query: w,
        bits: set.bits[from * w..(from + n) * w].to_vec(),
    }
}

/// Runs one (export, GPU router) pair in a child process; passes its output
/// through and returns (mismatching queries, load seconds, seconds per pass per batch).
fn run_child(
    args: &[String],
    job: usize,
    name: &str,
    n_batches: usize,
) -> Result<(usize, f64, Vec<f64>), String> {
    let exe = std::env::current_exe().map_err(|e| format!("{name}: current_exe: {e}"))?;
    let out = std::process::Command::new(exe)
        .args(args)
        .args(["--child", &job.to_string(), name])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("{name}: spawning child: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut result = None;
    for line in text.lines() {
        match line.strip_prefix("RESULT ") {
            Some(r) => result = Some(r.to_string()),
            None => println!("{line}"),
        }
    }
    let r =
        result.ok_or_else(|| format!("{name}: child exited with {} and no result", out.status))?;
    if let Some(f) = r.strip_prefix("fail ") {
        return Err(f.to_string());
    }
    let v: Vec<&str> = r.split_whitespace().collect();
    let parse = |s: &str| {
        s.parse::<f64>()
            .map_err(|e| format!("{name}: child result {r:?}: {e}"))
    };
    if v.len() != 3 + n_batches || v[0] != "ok" {
        return Err(format!("{name}: malformed child result {r:?}"));
    }
    let secs = v[3..]
        .iter()
        .map(|s| parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((parse(v[1])? as usize, parse(v[2])?, secs))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut seconds = 0.5f64;
    let mut require_gpu = std::env::var("MIRAGE_REQUIRE_GPU_TESTS").is_ok_and(|v| v == "1");
    let mut batch_spec = "1,24,all".to_string();
    let mut variant_batches = "24,all".to_string();
    let mut all_routed = false;
    // GPU routers run in a child process per (export, router): the first H200
    // run lost its Vulkan driver after ~30 wgpu devices in one process.
    let mut isolate = true;
    let mut child: Option<(usize, String)> = None;
    let mut files = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => seconds = it.next().and_then(|s| s.parse().ok()).expect("--seconds S"),
            "--require-gpu" => require_gpu = true,
            "--batches" => batch_spec = it.next().expect("--batches LIST").clone(),
            "--all-routed" => all_routed = true,
            "--no-isolate" => isolate = false,
            "--child" => {
                let j: usize = it
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("--child JOB ROUTER");
                child = Some((j, it.next().expect("--child JOB ROUTER").clone()));
            }
            "--variant-batches" => {
                variant_batches = it.next().expect("--variant-batches LIST").clone()
            }
            f => files.push(f.to_string()),
        }
    }
    if files.is_empty() {
        eprintln!("usage: route-real [--seconds S] [--require-gpu] [--batches 1,24,all] [--all-routed [--variant-batches 24,all]] EXPORT...");
        std::process::exit(2);
    }
    let mut rows = Vec::new();
    let mut mismatches = 0usize;
    let mut unavailable = Vec::new();
    let mut jobs: Vec<(Export, String, String)> = Vec::new();
    for path in &files {
        let ex = match read_export(path) {
            Ok(e) => e,
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
        };
        if all_routed {
            // The same real boxes and query points with every page routed
            // (trunk pages keep their fitted boxes): threshold 1 checks the
            // union of slice hits, threshold = slices their intersection.
            for t in ["1", "slices"] {
                let layers = ex
                    .layers
                    .iter()
                    .map(|l| {
                        let mut data = l.data.clone();
                        let th = if t == "1" { 1 } else { data.slices as u32 };
                        data.thresholds.iter_mut().for_each(|x| *x = th);
                        Layer {
                            data,
                            points: l.points.clone(),
                            queries: l.queries,
                        }
                    })
                    .collect();
                let name = format!("{} all-routed t={t}", ex.name);
                jobs.push((
                    Export {
                        name,
                        provenance: ex.provenance.clone(),
                        layers,
                    },
                    path.clone(),
                    variant_batches.clone(),
                ));
            }
        }
        jobs.insert(
            jobs.len() - if all_routed { 2 } else { 0 },
            (ex, path.clone(), batch_spec.clone()),
        );
    }
    for (ji, (ex, path, batch_spec)) in jobs.iter().enumerate() {
        if child.as_ref().is_some_and(|(cj, _)| *cj != ji) {
            continue;
        }
        let n_layer = ex.layers.len();
        let queries: usize = ex.layers.iter().map(|l| l.queries).sum();
        let max_q = ex.layers.iter().map(|l| l.queries).max().unwrap_or(0);
        let pages: Vec<usize> = ex.layers.iter().map(|l| l.data.pages()).collect();
        let routed: Vec<usize> = ex.layers.iter().map(|l| routed_of(&l.data)).collect();
        let (pmin, pmax) = (
            pages.iter().min().copied().unwrap_or(0),
            pages.iter().max().copied().unwrap_or(0),
        );
        let (rmin, rmax) = (
            routed.iter().min().copied().unwrap_or(0),
            routed.iter().max().copied().unwrap_or(0),
        );
        let span = |a: usize, b: usize| {
            if a == b {
                format!("{a}")
            } else {
                format!("{a}..{b}")
            }
        };
        let pages_txt = format!("{} ({} routed)", span(pmin, pmax), span(rmin, rmax));
        if child.is_none() {
            println!("== {} ({path}): {n_layer} layers, {queries} token-layer queries, pages/layer {pages:?}, routed (threshold > 0) {routed:?}", ex.name);
            println!("   provenance: {}", ex.provenance);
        }
        let batches: Vec<usize> = batch_spec
            .split(',')
            .map(|b| {
                if b == "all" {
                    max_q
                } else {
                    b.parse().expect("batch size")
                }
            })
            .filter(|&b| b > 0)
            .collect();
        // Reference sets and candidates per query.
        let reference: Vec<CandidateSet> = ex
            .layers
            .iter()
            .map(|l| {
                CpuBvh::new(&l.data)
                    .and_then(|mut r| r.route(&l.points))
                    .expect("cpu-bvh routes the export")
            })
            .collect();
        let total_cand: usize = reference.iter().map(|s| s.total()).sum();
        let cand = total_cand as f64 / queries.max(1) as f64;
        // Candidates among routed pages only (trunk pages, threshold 0, are always in).
        let trunk_total: usize = ex
            .layers
            .iter()
            .map(|l| l.queries * (l.data.pages() - routed_of(&l.data)))
            .sum();
        let routed_cand = (total_cand - trunk_total) as f64 / queries.max(1) as f64;
        let budget_per_layer = Duration::from_secs_f64(seconds / n_layer.max(1) as f64);
        for (name, make) in MAKERS {
            let mut load = 0f64;
            let mut secs = vec![0f64; batches.len()];
            let mut bad = 0usize;
            let mut failed = None;
            if child.as_ref().is_some_and(|(_, cn)| cn != name) {
                continue;
            }
            let in_child = child.is_none() && isolate && (name == "wgpu" || name == "vulkan-rt");
            if in_child {
                match run_child(&args, ji, name, batches.len()) {
                    Ok((b, l, s)) => {
                        bad = b;
                        load = l;
                        secs = s;
                    }
                    Err(f) => failed = Some(f),
                }
            }
            for (l, layer) in ex.layers.iter().enumerate().filter(|_| !in_child) {
                let t = Instant::now();
                let mut router = match make(&layer.data) {
                    Ok(r) => r,
                    Err(e) => {
                        failed = Some(format!("{name} on {} layer {l}: {e}", ex.name));
                        break;
                    }
                };
                load += t.elapsed().as_secs_f64();
                // Whole batch at once.
                let whole = match router.route(&layer.points) {
                    Ok(s) => s,
                    Err(e) => {
                        failed = Some(format!("{name} on {} layer {l}: {e}", ex.name));
                        break;
                    }
                };
                let (n, first) = diff(&reference[l], &whole);
                if n > 0 {
                    bad += n;
                    println!(
                        "MISMATCH {name} {} layer {l} (whole batch): {n} of {} queries differ; {}",
                        ex.name,
                        layer.queries,
                        first.unwrap_or_default()
                    );
                }
                for (bi, &b) in batches.iter().enumerate() {
                    // Warm-up pass doubles as the chunked equality check.
                    let sets = match route_chunks(router.as_mut(), layer, b) {
                        Ok(s) => s,
                        Err(e) => {
                            failed =
                                Some(format!("{name} on {} layer {l} batch {b}: {e}", ex.name));
                            break;
                        }
                    };
                    for (ci, s) in sets.iter().enumerate() {
                        let from = ci * b;
                        let want = slice_set(&reference[l], from, s.queries);
                        let (n, first) = diff(&want, s);
                        if n > 0 {
                            bad += n;
                            println!("MISMATCH {name} {} layer {l} batch {b} chunk {ci}: {n} queries differ; {}", ex.name, first.unwrap_or_default());
                        }
                    }
                    let start = Instant::now();
                    let mut iters = 0u32;
                    while iters < 2 || (start.elapsed() < budget_per_layer && iters < 10_000) {
                        match route_chunks(router.as_mut(), layer, b) {
                            Ok(s) => drop(std::hint::black_box(s)),
                            Err(e) => {
                                failed =
                                    Some(format!("{name} on {} layer {l} batch {b}: {e}", ex.name));
                                break;
                            }
                        }
                        iters += 1;
                    }
                    secs[bi] += start.elapsed().as_secs_f64() / iters as f64;
                }
                if failed.is_some() {
                    break;
                }
            }
            if child.is_some() {
                match &failed {
                    // Open file descriptors, to tell a leak from a missing driver.
                    Some(f) => println!(
                        "RESULT fail {f} (open fds {})",
                        std::fs::read_dir("/proc/self/fd")
                            .map(|d| d.count())
                            .unwrap_or(0)
                    ),
                    None => println!(
                        "RESULT ok {bad} {load} {}",
                        secs.iter()
                            .map(|x| x.to_string())
                            .collect::<Vec<_>>()
                            .join(" ")
                    ),
                }
                std::process::exit(0);
            }
            if let Some(f) = failed {
                println!("UNAVAILABLE {f}");
                if name == "wgpu" || name == "vulkan-rt" {
                    unavailable.push(f);
                } else {
                    mismatches += 1;
                }
                continue;
            }
            mismatches += bad;
            println!(
                "{name} on {}: {} ({n_layer} layers x all queries, whole batch and chunks of {batches:?}) equal to cpu-bvh",
                ex.name,
                if bad == 0 { "every candidate set" } else { "NOT every candidate set" }
            );
            for (bi, &b) in batches.iter().enumerate() {
                let us = secs[bi] * 1e6 / queries as f64;
                rows.push(format!(
                    "| {} | {name} | {n_layer} | {pages_txt} | {b} | {:.3} | {:.0} | {:.1} | {cand:.2} | {routed_cand:.2} | {} |",
                    ex.name,
                    us,
                    1e6 / us,
                    load * 1e3,
                    if bad == 0 { "yes" } else { "NO" }
                ));
            }
        }
    }
    let gpu_missing = require_gpu && !unavailable.is_empty();
    if gpu_missing {
        for u in &unavailable {
            println!("FAIL (GPU required): {u}");
        }
    }
    println!();
    println!("| export | router | layers | pages/layer | batch (tokens per layer call) | µs per token-layer | queries/s | load ms (all layers) | candidates/query | routed candidates/query | equal to cpu-bvh |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        println!("{r}");
    }
    if mismatches > 0 {
        std::process::exit(1);
    }
    if gpu_missing {
        std::process::exit(2);
    }
}
