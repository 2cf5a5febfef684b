//! The CUDA backend of the MIRAGE runtime.
//!
//! [`CudaBackend`] implements [`mirage_runtime::Backend`]: weights are
//! uploaded once in their ggml encoding and every op of a decode or prefill
//! step runs on the device (embedding lookup, RMSNorm, quantized mat-vec
//! straight on the ggml blocks, bias and residual adds, RoPE with the KV-cache
//! write, attention over a device KV cache, SwiGLU, lm head, argmax).
//!
//! Kernels live in `cuda/*.cu` at the workspace root and are compiled at run
//! time by NVRTC for the device's compute capability; the PTX is cached on
//! disk per device architecture and source hash (see [`module`]). Run-time
//! compilation was chosen over nvcc ahead of time so that the crate builds
//! with no CUDA toolkit at all (cudarc loads `libcuda` and `libnvrtc`
//! dynamically) and each GPU gets code for its own architecture.
//!
//! Without the `cuda` cargo feature the crate builds a stand-in whose
//! constructor returns [`CudaError::NotCompiledWithCuda`]. With it, a machine
//! without `libcuda` gets [`CudaError::DriverNotFound`]; nothing panics.
#![deny(missing_docs)]

mod error;
pub use error::CudaError;

// Pure arithmetic (tested without a GPU); only the CUDA backend uses it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod attn_block;
pub use attn_block::attention_block_at_start;
#[cfg(feature = "cuda")]
mod backend;
/// Kernel launches with programmatic stream serialization
/// (`cuLaunchKernelEx`).
#[cfg(feature = "cuda")]
pub mod cluster;
/// Decode attention over selected KV pages (page boxes, selection and
/// split-K on the device).
#[cfg(feature = "cuda")]
pub mod kv_pruning;
#[cfg(feature = "cuda")]
pub mod module;
#[cfg(feature = "cuda")]
pub use backend::sparse_backend::{
    nvfp4_layer_pages, pages_for_fraction, q2k_layer_pages, random_subset, OpTimes, PageFormat,
    PageSource, RouteTraversal, SparseCudaBackend, SparseFfn, SparsePages, ROUTE_SCAN_MAX_PRIMS,
};
#[cfg(feature = "cuda")]
pub use backend::{CudaActivations, CudaBackend, CudaFfn, CudaKvCache, CudaMatrix, CudaVector};

pub mod nvfp4;
pub mod superblock;
pub mod superblock_q2k;
/// Routing through the Vulkan ray-tracing router with CUDA–Vulkan interop
/// (exported memory and timeline semaphores), and route.cu on its own
/// context for comparison.
#[cfg(feature = "vulkan-interop")]
pub mod vk_interop;

#[cfg(not(feature = "cuda"))]
mod dummy;
#[cfg(not(feature = "cuda"))]
pub use dummy::{CudaActivations, CudaBackend, CudaFfn, CudaKvCache, CudaMatrix, CudaVector};

/// Where the cross-op weight prefetch (`Backend::prefetch`) is issued in a
/// recorded decode step: while the attention runs (the output projection's
/// weights) and between the FFN's gate/up and down halves (the next layer's
/// Q/K/V weights), one `l2_prefetch` launch per site and layer. Off by
/// default: on the H200 (7B Q8_0 shape) it made the step slower, dense
/// 3.81 -> 3.94 ms and sparse 40 % 2.79 -> 2.95 ms, since the extra graph
/// node costs more than the L2 hits save (ncu: the output projection 9.1
/// instead of 9.6 us). `MIRAGE_CUDA_XPREFETCH=on|attn|ffn` at start, or
/// `CudaBackend::set_cross_prefetch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchSites {
    /// Issue the regions hinted before an attention while it runs.
    pub attention: bool,
    /// Issue the regions hinted before an FFN between its two halves.
    pub ffn: bool,
}

impl PrefetchSites {
    /// Both sites.
    pub const ALL: PrefetchSites = PrefetchSites {
        attention: true,
        ffn: true,
    };
    /// No cross-op prefetch.
    pub const NONE: PrefetchSites = PrefetchSites {
        attention: false,
        ffn: false,
    };

    /// The sites `MIRAGE_CUDA_XPREFETCH` asks for (what a new backend
    /// starts with): `on`/`1`/`all`, `attn`, `ffn`, anything else none.
    pub fn from_env() -> PrefetchSites {
        match std::env::var("MIRAGE_CUDA_XPREFETCH").as_deref() {
            Ok("1" | "on" | "all") => PrefetchSites::ALL,
            Ok("attn" | "attention") => PrefetchSites {
                attention: true,
                ffn: false,
            },
            Ok("ffn") => PrefetchSites {
                attention: false,
                ffn: true,
            },
            _ => PrefetchSites::NONE,
        }
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn bits(self) -> u8 {
        self.attention as u8 | (self.ffn as u8) << 1
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn from_bits(b: u8) -> PrefetchSites {
        PrefetchSites {
            attention: b & 1 != 0,
            ffn: b & 2 != 0,
        }
    }
}

/// Which kernels read what they can before their PDL wait (the preload):
/// the v2 split Q8_0 mat-vecs (`matvec`) and the dense FFN's gate/up
/// (`ffn`) their first chunks of weights into registers, the decode
/// attention (`attention`) its position, RoPE angle and first keys and
/// values. Weights are constant during a step and the cache positions
/// before the new one were written by earlier steps, so the results are
/// the same bits. Off by default; `MIRAGE_CUDA_PRELOAD` at start or
/// `CudaBackend::set_preload`. The FFN part is its own switch because its
/// kernel needs 121 registers a thread with the preload (80 without),
/// which costs the gate/up launch a resident block per SM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreloadParts {
    /// The split Q8_0 mat-vecs (Q/K/V, output projection, down, head).
    pub matvec: bool,
    /// The dense FFN's fused gate/up kernel.
    pub ffn: bool,
    /// The decode attention with RoPE (`attend_rope`).
    pub attention: bool,
}

impl PreloadParts {
    /// Every part.
    pub const ALL: PreloadParts = PreloadParts {
        matvec: true,
        ffn: true,
        attention: true,
    };
    /// No preload (the default).
    pub const NONE: PreloadParts = PreloadParts {
        matvec: false,
        ffn: false,
        attention: false,
    };

    /// What [`PreloadParts::parse`] reads, for error messages.
    pub const EXPECTED: &'static str = "all, none, or a comma list of matvec, ffn, attn";

    /// The parts `MIRAGE_CUDA_PRELOAD` asks for (none when unset; see
    /// [`PreloadParts::parse`]), or an error naming a value it does not
    /// read. A new backend starts with them (with none on an error).
    pub fn from_env() -> Result<PreloadParts, CudaError> {
        match std::env::var("MIRAGE_CUDA_PRELOAD") {
            Err(_) => Ok(Self::NONE),
            Ok(v) => Self::parse(&v).ok_or_else(|| {
                CudaError::Setting(format!(
                    "MIRAGE_CUDA_PRELOAD={v:?}: want {}",
                    Self::EXPECTED
                ))
            }),
        }
    }

    /// `1`/`on`/`all` every part, `0`/`off`/`none` none, or a comma list
    /// of `matvec`, `ffn`, `attn` (or `attention`); `None` for anything else.
    pub fn parse(s: &str) -> Option<PreloadParts> {
        match s.trim().to_ascii_lowercase().as_str() {
            "1" | "on" | "all" => return Some(Self::ALL),
            "0" | "off" | "none" | "" => return Some(Self::NONE),
            _ => {}
        }
        let mut p = Self::NONE;
        for part in s.split(',') {
            match part.trim().to_ascii_lowercase().as_str() {
                "matvec" => p.matvec = true,
                "ffn" => p.ffn = true,
                "attn" | "attention" => p.attention = true,
                _ => return None,
            }
        }
        Some(p)
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn bits(self) -> u8 {
        self.matvec as u8 | (self.ffn as u8) << 1 | (self.attention as u8) << 2
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn from_bits(b: u8) -> PreloadParts {
        PreloadParts {
            matvec: b & 1 != 0,
            ffn: b & 2 != 0,
            attention: b & 4 != 0,
        }
    }
}

impl std::fmt::Display for PreloadParts {
    /// The form [`PreloadParts::parse`] reads back: `none`, `all` or a list.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Self::NONE {
            return f.write_str("none");
        }
        if *self == Self::ALL {
            return f.write_str("all");
        }
        let names = [
            (self.matvec, "matvec"),
            (self.ffn, "ffn"),
            (self.attention, "attn"),
        ];
        let on: Vec<&str> = names.iter().filter(|(b, _)| *b).map(|(_, n)| *n).collect();
        f.write_str(&on.join(","))
    }
}

/// When the v2 split Q8_0 mat-vecs run on a persistent grid (`mv3_*_v2g*`:
/// at most the device's resident blocks, each taking several row groups and
/// reading the input and folded norm once; the same bits). `Auto`, the
/// default, takes it where it measured faster on the H200: rows of at least
/// 2048 columns and more row groups than resident blocks (the 7B shape's
/// Q/K/V, output projection, down and head). Measured on the H200 in the
/// same process, grid off -> auto, synthetic 7B Q8_0: the dense step
/// 3.65-3.80 -> 3.57-3.62 ms in all seven pairs of two sessions (2-4 %),
/// sparse 40 % faster in six of seven (up to 4 %); the 0.5B shape, which the
/// rule leaves on v2, unchanged within its spread between processes
/// (synthetic 819-995 tok/s off, 864-960 auto; real Qwen 0.5B dense 697-752
/// off, 727-749 auto). `MIRAGE_CUDA_MV_GRID=0|auto|1` at start, or
/// `CudaBackend::set_matvec_grid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatvecGrid {
    /// One block per row group (the v2 kernels).
    Off,
    /// The persistent grid where the rule above says so (the default).
    Auto,
    /// The persistent grid for every v2 split Q8_0 mat-vec (tests, A/B).
    Always,
}

impl MatvecGrid {
    /// `MIRAGE_CUDA_MV_GRID`: `0`/`off`, `1`/`on`/`always`; unset, `auto`
    /// or not understood, `Auto` (the default).
    pub fn from_env() -> MatvecGrid {
        match std::env::var("MIRAGE_CUDA_MV_GRID")
            .map(|v| v.to_ascii_lowercase())
            .as_deref()
        {
            Ok("0" | "off") => MatvecGrid::Off,
            Ok("1" | "on" | "always") => MatvecGrid::Always,
            _ => MatvecGrid::Auto,
        }
    }

    /// Whether a launch of `tiles` row groups of `cols`-element rows on a
    /// device of `resident` blocks takes the persistent grid.
    pub fn applies(self, cols: usize, tiles: usize, resident: usize) -> bool {
        match self {
            MatvecGrid::Off => false,
            MatvecGrid::Always => true,
            MatvecGrid::Auto => cols >= 2048 && tiles > resident,
        }
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn bits(self) -> u8 {
        self as u8
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn from_bits(b: u8) -> MatvecGrid {
        match b {
            1 => MatvecGrid::Auto,
            2 => MatvecGrid::Always,
            _ => MatvecGrid::Off,
        }
    }
}

/// Device memory the backend holds, by purpose (bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Weight matrices and vectors.
    pub weights: usize,
    /// KV caches.
    pub kv_cache: usize,
    /// Activation buffers and scratch (high-water mark; they are reused).
    pub workspace: usize,
    /// Highest total of the three seen so far.
    pub peak: usize,
}

/// How forward passes ran on the backend since it started (see
/// `CudaBackend::graph_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Steps captured into a new CUDA graph.
    pub captures: u64,
    /// Steps that replayed a captured graph.
    pub replays: u64,
    /// Steps launched op by op (too many rows, or graphs off).
    pub eager: u64,
}

/// The encoding weight matrices are uploaded in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// The file's own quantization (Q8_0 repacked to the split layout when
    /// the fast decode path is on).
    #[default]
    Native,
    /// Every attention and FFN matrix requantized to NVFP4 at upload with
    /// the CPU codec (weight-only: activations stay f32). The embedding
    /// table and the lm head keep their own type.
    Nvfp4,
}

/// Whether this build has the CUDA backend compiled in.
pub const COMPILED_WITH_CUDA: bool = cfg!(feature = "cuda");

/// Every CUDA module compiles (NVRTC, for the H200's sm_90), every kernel a
/// backend loads is in its PTX, and every one of them waits on its
/// prerequisite grid (the programmatic-dependent-launch rule, cuda/pdl.cu).
/// Needs only `libnvrtc` (`pip install nvidia-cuda-nvrtc`, which `.ci/run`
/// does), no driver and no GPU: a kernel that would not compile on the
/// device fails here first. Without the library it prints why and passes,
/// unless `MIRAGE_REQUIRE_NVRTC=1` (set by `.ci/run`).
#[cfg(all(test, feature = "cuda"))]
mod nvrtc_check {
    use crate::module;

    fn nvrtc_present() -> bool {
        // SAFETY: only probes whether the shared library can be opened.
        let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if !present {
            assert!(
                std::env::var("MIRAGE_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "MIRAGE_REQUIRE_NVRTC=1 but libnvrtc was not found (LD_LIBRARY_PATH)"
            );
            eprintln!("nvrtc_check: skipped, libnvrtc not found (pip install nvidia-cuda-nvrtc and put its lib/ on LD_LIBRARY_PATH)");
        }
        present
    }

    /// Parameters of kernel `name` in `ptx` (its `.entry` line's list).
    fn param_count(ptx: &str, name: &str) -> usize {
        let e = module::entry(ptx, name).unwrap_or_else(|| panic!("{name} not in the PTX"));
        e[..e.find(')').unwrap()].matches(".param").count()
    }

    fn check(module_name: &str, source: &str, kernels: &[&str]) -> String {
        let ptx = module::compile(module_name, source, 9, 0)
            .unwrap_or_else(|e| panic!("{module_name}: {e}"));
        let missing: Vec<_> = kernels
            .iter()
            .filter(|k| module::entry(&ptx, k).is_none())
            .collect();
        assert!(
            missing.is_empty(),
            "{module_name}: kernels not in the PTX: {missing:?}"
        );
        let no_wait: Vec<_> = kernels
            .iter()
            .filter(|k| !module::waits_on_prerequisite(&ptx, k))
            .collect();
        assert!(
            no_wait.is_empty(),
            "{module_name}: kernels without griddepcontrol.wait: {no_wait:?}"
        );
        eprintln!("{module_name}: {} kernels compile for sm_90", kernels.len());
        ptx
    }

    #[test]
    fn dense_module_compiles_with_and_without_the_compile_time_switches() {
        if !nvrtc_present() {
            return;
        }
        let names = crate::backend::kernel_names();
        let ptx = check("dense", module::DENSE_SOURCE, &names);
        // The host's argument counts for the launches it patches by position.
        for name in names.iter().filter(|n| n.starts_with("mv3_")) {
            assert_eq!(param_count(&ptx, name), crate::backend::MV3_ARGS, "{name}");
        }
        for name in names.iter().filter(|n| n.starts_with("ffn_")) {
            assert_eq!(param_count(&ptx, name), crate::backend::FFN_ARGS, "{name}");
        }
        // The attention block: the argument list the host builds, the copy
        // engine's bulk copies (O rows ahead) and the counters' acquire loads.
        for kv in ["f16", "f32"] {
            let name = format!("attn_block_q8s_{kv}");
            assert_eq!(
                param_count(&ptx, &name),
                crate::backend::ATTN_BLOCK_ARGS,
                "{name}"
            );
            let body = module::entry(&ptx, &name).unwrap_or_default();
            for op in ["cp.async.bulk", "ld.acquire.gpu", "mbarrier.try_wait"] {
                assert!(body.contains(op), "{name} without {op}");
            }
        }
        // kernel-bench's floors (loaded by name there, not by the backend).
        for name in ["pdl_floor", "flag_floor"] {
            assert!(module::entry(&ptx, name).is_some(), "{name} not in the PTX");
        }
        // The cross-op prefetch: six arguments (three regions), and it waits
        // on its prerequisite grid, so the kernel after it waits on both.
        assert_eq!(param_count(&ptx, "l2_prefetch"), 6);
        assert!(module::waits_on_prerequisite(&ptx, "l2_prefetch"));
        let off = format!(
            "#define MIRAGE_PREFETCH_ROW 0\n#define MIRAGE_NORM_SCALAR 1\n#define MIRAGE_ATT_MIN_KEYS 0\n\
             #define MIRAGE_XPF_EVICT_LAST 1\n#define MIRAGE_MV2_MIN_BLOCKS 3\n{}",
            module::DENSE_SOURCE
        );
        let ptx_off = check("dense-noprefetch-scalar-norm", &off, &names);
        let evict = module::entry(&ptx_off, "l2_prefetch").unwrap_or_default();
        assert!(
            evict.contains("evict_last"),
            "l2_prefetch without L2::evict_last"
        );
    }

    #[test]
    fn sparse_module_compiles() {
        if !nvrtc_present() {
            return;
        }
        use crate::backend::sparse_backend::{
            FFN_KERNEL_ARGS, KERNELS, Q8_FFN_ARGS, ROUTE_ARGS, SOURCE,
        };
        let ptx = check("sparse-backend", SOURCE, KERNELS);
        for (name, want) in [
            ("route_bvh", ROUTE_ARGS),
            ("superblock_ffn_q8s", Q8_FFN_ARGS),
            ("superblock_ffn_nvfp4", FFN_KERNEL_ARGS + 3),
            ("superblock_ffn_q2k", FFN_KERNEL_ARGS),
        ] {
            assert_eq!(
                param_count(&ptx, name),
                want,
                "{name}: kernel parameters vs launch_ffn / launch_route"
            );
        }
    }

    #[cfg(feature = "vulkan-interop")]
    #[test]
    fn vk_interop_module_compiles() {
        if !nvrtc_present() {
            return;
        }
        check(
            "vk_interop",
            crate::vk_interop::SOURCE,
            &["route_bvh", "vki_project", "vki_compact"],
        );
    }
}

#[cfg(test)]
mod settings {
    use super::PreloadParts;

    #[test]
    fn matvec_grid_rule_and_bits() {
        use super::MatvecGrid;
        for g in [MatvecGrid::Off, MatvecGrid::Auto, MatvecGrid::Always] {
            assert_eq!(MatvecGrid::from_bits(g.bits()), g);
        }
        assert!(MatvecGrid::Auto.applies(3584, 576, 264));
        assert!(!MatvecGrid::Auto.applies(3584, 200, 264));
        assert!(!MatvecGrid::Auto.applies(896, 4748, 264));
        assert!(MatvecGrid::Always.applies(896, 1, 264));
        assert!(!MatvecGrid::Off.applies(3584, 576, 264));
    }

    #[test]
    fn parse_reads_words_and_lists_and_display_reads_back() {
        assert_eq!(PreloadParts::parse("on"), Some(PreloadParts::ALL));
        assert_eq!(PreloadParts::parse("1"), Some(PreloadParts::ALL));
        assert_eq!(PreloadParts::parse("OFF"), Some(PreloadParts::NONE));
        let p = PreloadParts::parse("matvec, attn").unwrap();
        assert!(p.matvec && p.attention && !p.ffn);
        assert_eq!(PreloadParts::parse("ffn,bogus"), None);
        assert_eq!(PreloadParts::parse("yes"), None);
        for bits in 0..8 {
            let p = PreloadParts::from_bits(bits);
            assert_eq!(p.bits(), bits);
            assert_eq!(PreloadParts::parse(&p.to_string()), Some(p), "{p}");
        }
    }
}

/// The host checks of device code (`hostcheck/run.sh`: the split-layout dot
/// helpers, the mat-vec variants' per-lane dots, the RMSNorm row, the decode
/// attention and phase 1 of the fused Q8_0 FFN against f64 references or
/// their previous forms; `hostcheck/run_pruned.sh`: the pruned-attention kernels):
/// the CUDA sources compiled as C++ with every CUDA thread an std::thread, so
/// they run in CI, which has no GPU. Needs g++ (C++20) and python3; without
/// them it prints why and passes.
#[cfg(test)]
mod hostcheck {
    fn run(script: &str) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("hostcheck");
        let out = std::process::Command::new("bash")
            .arg(dir.join(script))
            .output()
            .unwrap_or_else(|e| panic!("cannot run bash {script}: {e}"));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "hostcheck/{script} failed ({}):\n{text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("hostcheck/{script}: {}", text.lines().last().unwrap_or(""));
    }

    fn tools_present() -> bool {
        let ok = |cmd: &str| {
            std::process::Command::new(cmd)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        };
        let present = ok("g++") && ok("python3");
        if !present {
            eprintln!("hostcheck: skipped, g++ or python3 not found");
        }
        present
    }

    #[test]
    fn device_helpers_pass_the_host_checks() {
        if tools_present() {
            run("run.sh");
        }
    }

    #[test]
    fn pruned_attention_kernels_pass_the_host_check() {
        if tools_present() {
            run("run_pruned.sh");
        }
    }
}
