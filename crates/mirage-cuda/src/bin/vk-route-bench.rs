//! vk-route-bench: per-layer page-routing time on the device, one query per
//! layer over `--layers` layers (24, Qwen2.5-0.5B), synthetic routers of
//! `--pages` pages x `--slices` slices (38 x 4: the 0.5B's 4864 FFN channels
//! in 128-channel pages) projecting `--d-model` (896) inputs:
//!
//! (a) route.cu on CUDA (the sparse backend's routed-mode kernel);
//! (b) the Vulkan ray-tracing router with CUDA–Vulkan interop: CUDA projects
//!     into the exported points buffer, signals a timeline semaphore, Vulkan
//!     traces and signals back, CUDA compacts, all enqueued with no host wait;
//!     (b1) the same for one layer followed by a stream synchronize (the
//!     round-trip latency);
//! (c) the Vulkan ray-tracing router with host copies (points down, the
//!     router's own upload/trace/fence/readback, bits up).
//!
//! (a), (b): CUDA events around the whole token (all layers enqueued), and
//! host wall time from the first enqueue to the synchronize; (c): host time.
//! Medians of `--iters` tokens after 5 warm-up tokens. Every path's lists are
//! checked against route.cu's on the last token.
//!
//! Usage: `vk-route-bench [--layers 24] [--pages 38] [--slices 4]
//! [--d-model 896] [--iters 200] [--routers N] [--bvh | --scan]` (`--routers`:
//! distinct Vulkan routers, each its own VkDevice, reused cyclically;
//! default one per layer; `--bvh` / `--scan`: how route.cu finds the hit
//! boxes, default by size). Build: `cargo build --release -p mirage-cuda
//! --features vulkan-interop --bin vk-route-bench`.

use std::error::Error;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use mirage_cuda::vk_interop::{ActiveLists, CudaBvhRouter, RouteDevice, VkInteropRouter};
use mirage_cuda::{RouteTraversal, ROUTE_SCAN_MAX_PRIMS};
use mirage_route::synth::{router_data, SplitMix64, SynthSpec};
use mirage_route::RouterData;

type Res<T> = Result<T, Box<dyn Error>>;

struct Opts {
    layers: usize,
    pages: usize,
    slices: usize,
    d_model: usize,
    iters: usize,
    routers: Option<usize>,
    traversal: RouteTraversal,
}

fn parse() -> Res<Opts> {
    let mut o = Opts {
        layers: 24,
        pages: 38,
        slices: 4,
        d_model: 896,
        iters: 200,
        routers: None,
        traversal: RouteTraversal::Auto,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> Res<usize> {
            let v = args.next().ok_or(format!("{name} needs a value"))?;
            Ok(v.parse::<usize>().map_err(|e| format!("{name} {v}: {e}"))?)
        };
        match a.as_str() {
            "--layers" => o.layers = num("--layers")?.max(1),
            "--pages" => o.pages = num("--pages")?.max(1),
            "--slices" => o.slices = num("--slices")?.clamp(1, 32),
            "--d-model" => o.d_model = num("--d-model")?.max(1),
            "--iters" => o.iters = num("--iters")?.max(1),
            "--routers" => o.routers = Some(num("--routers")?.max(1)),
            "--bvh" => o.traversal = RouteTraversal::Bvh,
            "--scan" => o.traversal = RouteTraversal::Scan,
            "-h" | "--help" => {
                println!("vk-route-bench [--layers N] [--pages N] [--slices N] [--d-model N] [--iters N] [--routers N] [--bvh | --scan]");
                println!("  --bvh / --scan: route.cu walks the BVH / tests every box (default: scan up to {ROUTE_SCAN_MAX_PRIMS} boxes)");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(o)
}

/// A layer's router: random boxes, random thresholds in 1..=slices/2+1, a
/// projection scaled so that rows of unit-variance inputs land in the boxes.
fn layer_router(o: &Opts, layer: usize) -> RouterData {
    let spec = SynthSpec {
        pages: o.pages,
        slices: o.slices,
        half_min: 0.2,
        half_max: 0.7,
        threshold: Some((o.slices as u32 / 2).max(1)),
    };
    let mut data = router_data(&spec, 1000 + layer as u64);
    let mut r = SplitMix64(77 + layer as u64);
    let scale = 0.5 / (o.d_model as f32).sqrt();
    data.d_model = o.d_model;
    data.projection = (0..o.slices * 3 * o.d_model)
        .map(|_| r.range(-1.7, 1.7) * scale)
        .collect();
    data
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    if let Err(e) = run() {
        eprintln!("vk-route-bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    let o = parse()?;
    let dev = RouteDevice::new(0)?;
    let n_routers = o.routers.unwrap_or(o.layers).min(o.layers);
    let datas: Vec<RouterData> = (0..o.layers).map(|l| layer_router(&o, l)).collect();
    let n_trunk = 1;
    eprintln!(
        "device {}: {} layers, {} pages x {} slices, d_model {}, {} Vulkan routers, route.cu {:?}",
        dev.name(),
        o.layers,
        o.pages,
        o.slices,
        o.d_model,
        n_routers,
        o.traversal
    );
    let mut r = SplitMix64(3);
    let xs: Vec<f32> = (0..o.layers * o.d_model)
        .map(|_| r.range(-1.0, 1.0) + r.range(-1.0, 1.0))
        .collect();
    let x_rows = (0..o.layers)
        .map(|l| dev.upload(&xs[l * o.d_model..][..o.d_model]))
        .collect::<Result<Vec<_>, _>>()?;
    let lists = |n: usize| -> Res<Vec<ActiveLists>> {
        (0..n)
            .map(|_| dev.active_lists(1, o.pages).map_err(Into::into))
            .collect()
    };
    let (mut l_cu, mut l_vk, mut l_host) = (lists(o.layers)?, lists(o.layers)?, lists(o.layers)?);
    let cu: Vec<CudaBvhRouter> = datas
        .iter()
        .map(|d| CudaBvhRouter::new(&dev, d, o.pages, n_trunk))
        .collect::<Result<_, _>>()?;
    let t = Instant::now();
    let mut vk: Vec<VkInteropRouter> = Vec::with_capacity(n_routers);
    for d in datas.iter().take(n_routers) {
        vk.push(VkInteropRouter::new(&dev, d, o.pages, n_trunk, 1)?);
    }
    eprintln!(
        "Vulkan device {}: {} interop routers built in {:.2} s",
        vk[0].vulkan_device(),
        n_routers,
        t.elapsed().as_secs_f64()
    );
    let ctx = dev.context();
    let stream = dev.stream();
    let ev = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
    let watchdog = |vk: &[VkInteropRouter]| -> Res<()> {
        for v in vk {
            v.wait_vulkan(Duration::from_secs(20))?;
        }
        Ok(())
    };
    let warm = 5;

    // (a) route.cu.
    let (mut a_dev, mut a_host) = (Vec::new(), Vec::new());
    for i in 0..warm + o.iters {
        let (e0, e1) = (ev()?, ev()?);
        let t = Instant::now();
        e0.record(stream)?;
        for l in 0..o.layers {
            cu[l].route(&dev, &x_rows[l], 1, o.traversal, &mut l_cu[l])?;
        }
        e1.record(stream)?;
        e1.synchronize()?;
        if i >= warm {
            a_host.push(t.elapsed().as_secs_f64() * 1e6);
            a_dev.push(e0.elapsed_ms(&e1)? as f64 * 1e3);
        }
    }

    // (b) interop, all layers enqueued.
    let (mut b_dev, mut b_host) = (Vec::new(), Vec::new());
    for i in 0..warm + o.iters {
        let (e0, e1) = (ev()?, ev()?);
        let t = Instant::now();
        e0.record(stream)?;
        for l in 0..o.layers {
            vk[l % n_routers].route(&dev, &x_rows[l], 1, &mut l_vk[l])?;
        }
        e1.record(stream)?;
        watchdog(&vk)?;
        e1.synchronize()?;
        if i >= warm {
            b_host.push(t.elapsed().as_secs_f64() * 1e6);
            b_dev.push(e0.elapsed_ms(&e1)? as f64 * 1e3);
        }
    }

    // (b1) interop, one layer and a synchronize.
    let (mut b1_dev, mut b1_host) = (Vec::new(), Vec::new());
    for i in 0..warm + o.iters {
        let l = i % o.layers;
        let (e0, e1) = (ev()?, ev()?);
        let t = Instant::now();
        e0.record(stream)?;
        vk[l % n_routers].route(&dev, &x_rows[l], 1, &mut l_vk[l])?;
        e1.record(stream)?;
        vk[l % n_routers].wait_vulkan(Duration::from_secs(20))?;
        e1.synchronize()?;
        if i >= warm {
            b1_host.push(t.elapsed().as_secs_f64() * 1e6);
            b1_dev.push(e0.elapsed_ms(&e1)? as f64 * 1e3);
        }
    }

    // (c) host copies.
    let mut c_host = Vec::new();
    for i in 0..warm + o.iters {
        let t = Instant::now();
        for l in 0..o.layers {
            vk[l % n_routers].route_host(&dev, &x_rows[l], 1, &mut l_host[l])?;
        }
        dev.synchronize()?;
        if i >= warm {
            c_host.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }

    // The last token's lists of every path against route.cu's. With
    // --routers < --layers the Vulkan routers are other layers' boxes, so
    // only layers with their own router are compared.
    let (mut checked, mut bad_vk, mut bad_host, mut active) = (0, 0, 0, 0usize);
    for l in 0..n_routers {
        // Re-route layer l on all paths (b1 overwrote some interop lists).
        cu[l].route(&dev, &x_rows[l], 1, o.traversal, &mut l_cu[l])?;
        vk[l].route(&dev, &x_rows[l], 1, &mut l_vk[l])?;
        vk[l].route_host(&dev, &x_rows[l], 1, &mut l_host[l])?;
    }
    watchdog(&vk)?;
    for l in 0..n_routers {
        let want = &dev.read(&l_cu[l], 1)?[0];
        bad_vk += usize::from(&dev.read(&l_vk[l], 1)?[0] != want);
        bad_host += usize::from(&dev.read(&l_host[l], 1)?[0] != want);
        active += want.len();
        checked += 1;
    }
    let per = |v: f64| v / o.layers as f64;
    let (a_d, a_h, b_d, b_h) = (median(a_dev), median(a_host), median(b_dev), median(b_host));
    let (b1_d, b1_h, c_h) = (median(b1_dev), median(b1_host), median(c_host));
    println!(
        "\nrouting, {} layers x 1 query, {} pages x {} slices, d_model {} (medians of {} tokens; us)",
        o.layers, o.pages, o.slices, o.d_model, o.iters
    );
    println!(
        "{:<46} {:>12} {:>12} {:>12}",
        "path", "layer dev", "layer host", "token host"
    );
    println!(
        "{:<46} {:>12.2} {:>12.2} {:>12.1}",
        "(a) route.cu on CUDA",
        per(a_d),
        per(a_h),
        a_h
    );
    println!(
        "{:<46} {:>12.2} {:>12.2} {:>12.1}",
        "(b) Vulkan RT, CUDA interop (semaphores)",
        per(b_d),
        per(b_h),
        b_h
    );
    println!(
        "{:<46} {:>12.2} {:>12.2} {:>12}",
        "(b1) Vulkan RT interop, 1 layer + sync", b1_d, b1_h, "-"
    );
    println!(
        "{:<46} {:>12} {:>12.2} {:>12.1}",
        "(c) Vulkan RT, host copies",
        "-",
        per(c_h),
        c_h
    );
    println!(
        "check: {checked} layers, mean {:.1} active pages, interop != route.cu: {bad_vk}, host path != route.cu: {bad_host}",
        active as f64 / checked.max(1) as f64
    );
    if bad_vk + bad_host > 0 {
        return Err("Vulkan paths disagree with route.cu".into());
    }
    Ok(())
}
