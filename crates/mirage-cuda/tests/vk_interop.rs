//! The Vulkan ray-tracing router fed and read by CUDA through exported
//! memory and timeline semaphores (feature `vulkan-interop`): for many random
//! queries the active page lists equal the CPU traversal's and route.cu's,
//! through both the interop path and the host-copy path.
//!
//! Skips with a printed reason without a CUDA device (a failure under
//! `MIRAGE_REQUIRE_CUDA_TESTS=1`) or without a Vulkan ray-tracing device with
//! CUDA interop (a failure under `MIRAGE_REQUIRE_VK_RT=1`), and without the
//! feature (a failure under `MIRAGE_REQUIRE_VK_RT=1`).

mod common;

/// `MIRAGE_REQUIRE_VK_RT=1` (or mirage-route's `MIRAGE_REQUIRE_VULKAN_RT=1`).
fn require_vk_rt() -> bool {
    ["MIRAGE_REQUIRE_VK_RT", "MIRAGE_REQUIRE_VULKAN_RT"]
        .iter()
        .any(|v| std::env::var(v).as_deref() == Ok("1"))
}

#[cfg(not(feature = "vulkan-interop"))]
#[test]
fn vulkan_interop_routing_equals_cpu_and_route_cu() {
    assert!(
        !require_vk_rt(),
        "MIRAGE_REQUIRE_VK_RT=1 but mirage-cuda was built without the `vulkan-interop` feature"
    );
    eprintln!("vk_interop: skipped, built without the `vulkan-interop` feature");
}

#[cfg(feature = "vulkan-interop")]
mod gpu {
    use std::time::Duration;

    use mirage_cuda::vk_interop::{
        cpu_active, CudaBvhRouter, InteropError, RouteDevice, VkInteropRouter,
    };
    use mirage_cuda::{CudaError, RouteTraversal};
    use mirage_route::synth::{router_data, SynthSpec};
    use mirage_route::{CpuBvh, RouterData};
    use rand::Rng;

    use super::common::{randn, require_cuda_tests, rng};
    use super::require_vk_rt;

    const D: usize = 96;
    const SLICES: usize = 4;
    /// Not a multiple of 32 (a partial last bitset word), more than one
    /// compaction round of 256.
    const PAGES: usize = 301;
    const TRUNK: usize = 3;
    const BATCH: usize = 64;

    fn device(test: &str) -> Option<RouteDevice> {
        match RouteDevice::new(0) {
            Ok(d) => Some(d),
            Err(
                e @ (CudaError::NotCompiledWithCuda
                | CudaError::DriverNotFound
                | CudaError::NoDevice { .. }),
            ) => {
                assert!(
                    !require_cuda_tests(),
                    "{test}: MIRAGE_REQUIRE_CUDA_TESTS=1 but no CUDA device: {e}"
                );
                eprintln!("{test}: skipped, no CUDA device here: {e}");
                None
            }
            Err(e) => panic!("{test}: CUDA device present but failed to start: {e}"),
        }
    }

    fn vk_router(
        test: &str,
        dev: &RouteDevice,
        data: &RouterData,
        max_queries: usize,
    ) -> Option<VkInteropRouter> {
        match VkInteropRouter::new(dev, data, PAGES, TRUNK, max_queries) {
            Ok(r) => Some(r),
            Err(e) if e.is_vulkan_unavailable() => {
                assert!(
                    !require_vk_rt(),
                    "{test}: MIRAGE_REQUIRE_VK_RT=1 but no Vulkan RT device with CUDA interop: {e}"
                );
                eprintln!("{test}: skipped, no Vulkan RT device with CUDA interop: {e}");
                None
            }
            Err(e) => panic!("{test}: Vulkan RT interop router failed: {e}"),
        }
    }

    /// Random boxes in [-1, 1]^3 with random thresholds (0..=slices) and a
    /// projection scaled so the slice points of `randn` rows land there too.
    fn fixture(seed: u64) -> RouterData {
        let spec = SynthSpec {
            pages: PAGES,
            slices: SLICES,
            half_min: 0.15,
            half_max: 0.6,
            threshold: None,
        };
        let mut data = router_data(&spec, seed);
        let mut r = rng(seed ^ 0xD00D);
        let scale = 1.0 / (D as f32).sqrt();
        data.d_model = D;
        data.projection = (0..SLICES * 3 * D)
            .map(|_| r.random_range(-1.5f32..1.5) * scale)
            .collect();
        data.validate().unwrap();
        data
    }

    fn check<T>(what: &str, r: Result<T, InteropError>) -> T {
        r.unwrap_or_else(|e| panic!("{what}: {e}"))
    }

    #[test]
    fn vulkan_interop_routing_equals_cpu_and_route_cu() {
        let test = "vulkan_interop_routing_equals_cpu_and_route_cu";
        let Some(dev) = device(test) else { return };
        let data = fixture(7);
        let Some(mut vk) = vk_router(test, &dev, &data, BATCH) else {
            return;
        };
        eprintln!(
            "{test}: CUDA {} / Vulkan {}",
            dev.name(),
            vk.vulkan_device()
        );
        let cu = check(
            "route.cu router",
            CudaBvhRouter::new(&dev, &data, PAGES, TRUNK),
        );
        let mut cpu = CpuBvh::new(&data).unwrap();
        let mut r = rng(11);
        let (mut sizes, mut total) = (std::collections::BTreeSet::new(), 0usize);
        for round in 0..8 {
            // Full batches, then smaller ones (other recorded command buffers).
            let q = if round < 4 { BATCH } else { 1 + round * 7 };
            let xs = randn(&mut r, q * D);
            let x = check("upload", dev.upload(&xs));
            let mut a_vk = check("lists", dev.active_lists(BATCH, PAGES));
            let mut a_host = check("lists", dev.active_lists(BATCH, PAGES));
            let mut a_cu = check("lists", dev.active_lists(BATCH, PAGES));
            check("interop route", vk.route(&dev, &x, q, &mut a_vk));
            check("vulkan done", vk.wait_vulkan(Duration::from_secs(20)));
            check("host-copy route", vk.route_host(&dev, &x, q, &mut a_host));
            check(
                "route.cu",
                cu.route(&dev, &x, q, RouteTraversal::Auto, &mut a_cu),
            );
            let got_vk = check("read", dev.read(&a_vk, q));
            let got_host = check("read", dev.read(&a_host, q));
            let got_cu = check("read", dev.read(&a_cu, q));
            for i in 0..q {
                let want = check(
                    "cpu",
                    cpu_active(&mut cpu, &data, &xs[i * D..][..D], PAGES, TRUNK),
                );
                assert_eq!(got_cu[i], want, "round {round} query {i}: route.cu != CPU");
                assert_eq!(
                    got_vk[i], want,
                    "round {round} query {i}: Vulkan interop != CPU"
                );
                assert_eq!(
                    got_host[i], want,
                    "round {round} query {i}: Vulkan host path != CPU"
                );
                sizes.insert(want.len());
                total += 1;
            }
        }
        eprintln!(
            "{test}: {total} queries equal on 4 paths, {} distinct set sizes ({:?}..{:?}), timeline value {}",
            sizes.len(),
            sizes.first(),
            sizes.last(),
            vk.value()
        );
        assert!(
            sizes.len() > 5,
            "the fixture must produce varied sets: {sizes:?}"
        );
        assert!(
            sizes.iter().any(|&s| s > TRUNK),
            "some queries must route to candidate pages"
        );
    }

    /// Many small routings back to back with no host wait between them (the
    /// per-layer pattern), each into its own lists, then one check.
    #[test]
    fn interop_routings_queue_without_host_waits() {
        let test = "interop_routings_queue_without_host_waits";
        let Some(dev) = device(test) else { return };
        let data = fixture(21);
        let Some(mut vk) = vk_router(test, &dev, &data, 1) else {
            return;
        };
        let mut cpu = CpuBvh::new(&data).unwrap();
        let mut r = rng(5);
        let n = 48;
        let xs = randn(&mut r, n * D);
        let rows: Vec<_> = (0..n)
            .map(|i| check("upload", dev.upload(&xs[i * D..][..D])))
            .collect();
        let mut lists: Vec<_> = (0..n)
            .map(|_| check("lists", dev.active_lists(1, PAGES)))
            .collect();
        for (x, a) in rows.iter().zip(lists.iter_mut()) {
            check("interop route", vk.route(&dev, x, 1, a));
        }
        check("vulkan done", vk.wait_vulkan(Duration::from_secs(20)));
        check("sync", dev.synchronize());
        assert_eq!(vk.value(), n as u64);
        for (i, a) in lists.iter().enumerate() {
            let got = check("read", dev.read(a, 1));
            let want = check(
                "cpu",
                cpu_active(&mut cpu, &data, &xs[i * D..][..D], PAGES, TRUNK),
            );
            assert_eq!(got[0], want, "routing {i}");
        }
    }

    /// The sparse backend's routed mode with the Vulkan RT router wired in
    /// (`SparseCudaBackend::set_vulkan_router`: the interop routing on the
    /// backend's own stream, into each layer's active list, graphs off)
    /// against route.cu on the same backend and artifact: 8 greedy steps of a
    /// real model (MIRAGE_SPARSE_MODEL, default SmolLM2; MIRAGE_SPARSE_ARTIFACT
    /// or a small one built here) give the same last-token list in every
    /// layer and the same logits bit for bit (same lists, same FFN kernel).
    #[test]
    fn routed_decode_with_the_vulkan_router_equals_route_cu() {
        use std::sync::Arc;

        use mirage_cuda::{PageSource, SparseCudaBackend, SparsePages};

        let test = "routed_decode_with_the_vulkan_router_equals_route_cu";
        let Some(model) = super::common::sparse_model(test) else {
            return;
        };
        // Skip (saying why) without a CUDA device or a Vulkan RT device.
        let Some(dev) = device(test) else { return };
        if vk_router(test, &dev, &fixture(3), 1).is_none() {
            return;
        }
        drop(dev);
        let gpu = super::common::cuda(test).expect("CUDA device");
        let artifact = super::common::sparse_artifact(&model);
        let mode = SparsePages::Routed {
            margin: artifact.meta().default_margin,
            traversal: RouteTraversal::Auto,
        };
        let sb = SparseCudaBackend::new(gpu, PageSource::Artifact(artifact), mode).unwrap();
        sb.inner().set_graphs(false);
        let file = Arc::new(mirage_gguf::GgufFile::open(&model).unwrap());
        let eo = mirage_runtime::EngineOptions {
            threads: 2,
            n_ctx: 128,
            ..Default::default()
        };
        let e = mirage_runtime::Engine::from_file(file, sb, eo).unwrap();
        let sb = e.model().backend();
        let n_layer = sb.page_shape().len();
        let lists =
            || -> Vec<Vec<u32>> { (0..n_layer).map(|l| sb.active_pages(l).unwrap()).collect() };
        let mut tokens = e
            .encode("Licensed under the Apache License, Version 2.0", true)
            .unwrap();
        let mut active = 0usize;
        for step in 0..8 {
            sb.set_vulkan_router(false).unwrap();
            let want = e.model().logits_all(&tokens, Default::default()).unwrap();
            let want_lists = lists();
            sb.set_vulkan_router(true).unwrap();
            let got = e.model().logits_all(&tokens, Default::default()).unwrap();
            let got_lists = lists();
            assert_eq!(got_lists, want_lists, "step {step}: active lists");
            assert_eq!(
                super::common::bits_differ(&got, &want),
                0,
                "step {step}: logits, Vulkan router vs route.cu"
            );
            active = got_lists.iter().map(|l| l.len()).sum();
            let v = got.len() / tokens.len();
            let last = &got[got.len() - v..];
            let next = (0..v).max_by(|&a, &b| last[a].total_cmp(&last[b])).unwrap();
            tokens.push(next as u32);
        }
        eprintln!(
            "{test}: {}: 8 greedy steps, Vulkan RT router == route.cu (lists and logits bit for bit); last token {active} active pages over {n_layer} layers",
            model.display()
        );
    }
}
