//! `route-bench`: µs per token-layer and queries per second of every router on
//! synthetic router data at the real page count (38 routed pages per layer of a
//! 4864-wide FFN, 4 slices) and at 10x and 100x more pages, for a decode-sized
//! batch (24 layers x 1 token) and a prefill-sized one (24 layers x 256 tokens).
//! Every GPU result is checked against the CPU BVH. Prints a markdown table.
//!
//! Usage: `route-bench [--quick] [--seconds S]`

use std::time::{Duration, Instant};

use mirage_route::synth::{query_points, router_data, SynthSpec};
use mirage_route::{
    BruteForce, CandidateSet, CpuBvh, RouteError, Router, RouterData, VulkanRtRouter, WgpuOptions,
    WgpuRouter,
};

fn time_route(
    r: &mut dyn Router,
    pts: &[[f32; 3]],
    budget: Duration,
) -> Result<(f64, CandidateSet), RouteError> {
    let first = r.route(pts)?; // warm-up (pipelines, buffers)
    let start = Instant::now();
    let mut iters = 0u32;
    while iters < 3 || (start.elapsed() < budget && iters < 10_000) {
        std::hint::black_box(r.route(pts)?);
        iters += 1;
    }
    Ok((start.elapsed().as_secs_f64() / iters as f64, first))
}

type Make = fn(&RouterData) -> Result<Box<dyn Router>, RouteError>;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let seconds: f64 = args
        .iter()
        .position(|a| a == "--seconds")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 0.1 } else { 0.5 });
    let budget = Duration::from_secs_f64(seconds);
    let makers: [(&str, Make); 4] = [
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
    let mut notes = Vec::new();
    let mut rows = Vec::new();
    for pages in [38usize, 380, 3800] {
        let data = router_data(
            &SynthSpec {
                pages,
                slices: 4,
                half_min: 0.2,
                half_max: 0.6,
                threshold: Some(2),
            },
            pages as u64,
        );
        for batch in [24usize, 24 * 256] {
            let pts = query_points(&data, batch, 7 + batch as u64);
            let reference = CpuBvh::new(&data)
                .and_then(|mut r| r.route(&pts))
                .expect("cpu-bvh routes synthetic data");
            let cand = reference.total() as f64 / batch as f64;
            for (name, make) in makers {
                let t_load = Instant::now();
                let mut router = match make(&data) {
                    Ok(r) => r,
                    Err(e) => {
                        let note = format!("{name}: {e}");
                        if !notes.contains(&note) {
                            notes.push(note);
                        }
                        continue;
                    }
                };
                let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
                match time_route(router.as_mut(), &pts, budget) {
                    Ok((secs, got)) => {
                        let equal = if got == reference { "yes" } else { "NO" };
                        rows.push(format!(
                            "| {name} | {pages} | {batch} | {:.3} | {:.0} | {load_ms:.1} | {cand:.2} | {equal} |",
                            secs * 1e6 / batch as f64,
                            batch as f64 / secs
                        ));
                    }
                    Err(e) => notes.push(format!("{name} at {pages} pages: {e}")),
                }
            }
        }
    }
    for n in &notes {
        println!("skipped {n}");
    }
    println!();
    println!("| router | pages/layer | batch (token-layers) | µs per token-layer | queries/s | load ms | candidates/query | equal to cpu-bvh |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        println!("{r}");
    }
    if rows.iter().any(|r| r.ends_with("| NO |")) {
        std::process::exit(1);
    }
}
