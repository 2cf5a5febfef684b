//! What a user may choose of the CUDA backends, as plain data: these types
//! exist in every build (with or without the `cuda` feature), so a frontend
//! can hold and parse them unconditionally.

/// What a user may choose of the CUDA backend; everything else is fixed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// Record each decode step once and replay it as a CUDA graph (`true`,
    /// the default) or launch every op as it comes (`false`, for debugging:
    /// the same results, slower).
    pub graphs: bool,
    /// The encoding of the weight matrices on the device.
    pub weights: WeightFormat,
    /// Multiply prefill batches (more than 16 rows) on tensor cores (`true`,
    /// the default): Q8_0, Q4_K, Q5_0 and Q6_K as int8 products read from
    /// their blocks (activations rounded to 8 bits per 32 values), the other
    /// types through cuBLAS on f16 tiles when the library loads; or run them
    /// through the mat-vec kernels row by row (`false`, for debugging).
    pub prefill_gemm: bool,
    /// Bytes of the f16 weight tile a cuBLAS prefill GEMM dequantizes at a time:
    /// bounds that workspace (at least 16 rows a tile; default 32 MiB).
    pub gemm_tile_bytes: usize,
}

impl Default for CudaOptions {
    fn default() -> CudaOptions {
        CudaOptions {
            graphs: true,
            weights: WeightFormat::Native,
            prefill_gemm: true,
            gemm_tile_bytes: 32 << 20,
        }
    }
}

/// The encoding weight matrices are uploaded in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// The file's own quantization (Q8_0, Q4_K, Q5_0 and Q6_K repacked to
    /// their split layouts, the same bytes grouped by field).
    #[default]
    Native,
    /// Every attention and FFN matrix requantized to NVFP4 at upload with
    /// the CPU codec (weight-only: activations stay f32). The embedding
    /// table and the lm head keep their own type.
    Nvfp4,
}

impl std::str::FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<WeightFormat, String> {
        match s.to_ascii_lowercase().as_str() {
            "native" => Ok(WeightFormat::Native),
            "nvfp4" => Ok(WeightFormat::Nvfp4),
            other => Err(format!("weight format `{other}`: expected native or nvfp4")),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightFormat::Native => "native",
            WeightFormat::Nvfp4 => "nvfp4",
        })
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

/// Device time of one decode step by op class (`CudaBackend::profile_next_step`):
/// the step's launches as its graph would replay them (fusions applied), but
/// launched one by one with an event before and after each, so every time
/// includes its kernel's launch latency and none overlaps the next kernel
/// (no graph, no programmatic dependent launch across the events).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepProfile {
    /// Mat-vecs and FFNs (the weight reads), microseconds.
    pub matvec_us: f64,
    /// Attention over the KV cache (with the RoPE and KV store folded into
    /// it, page selection), microseconds.
    pub attention_us: f64,
    /// Everything else: norms, a separate RoPE and KV store, residual adds,
    /// embedding, arg-max, microseconds.
    pub other_us: f64,
    /// Kernel launches of the step.
    pub launches: usize,
}

impl StepProfile {
    /// The sum of the three classes, microseconds.
    pub fn total_us(&self) -> f64 {
        self.matvec_us + self.attention_us + self.other_us
    }
}

/// The op class a kernel's time counts in ([`StepProfile`]), by its name.
pub fn op_class(kernel: &str) -> OpClass {
    const MATVEC: [&str; 8] = [
        "mv3_",
        "mvx_",
        "ffn_",
        "dequant_",
        "superblock_",
        "mmq_",
        "quantize_q8",
        "asp_",
    ];
    const ATTENTION: [&str; 4] = ["attend_", "page_keys", "page_bounds", "select_pages"];
    if MATVEC.iter().any(|p| kernel.starts_with(p)) {
        OpClass::MatVec
    } else if ATTENTION.iter().any(|p| kernel.starts_with(p)) {
        OpClass::Attention
    } else {
        OpClass::Other
    }
}

/// The classes of [`StepProfile`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpClass {
    /// Mat-vecs and FFNs.
    MatVec,
    /// Attention over the KV cache.
    Attention,
    /// Norms, RoPE, elementwise, embedding, arg-max.
    Other,
}

/// How the pages are encoded on the device (and so which fused kernel runs
/// the FFN). Chosen before the layers are uploaded; the active lists,
/// routing and modes do not depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PageFormat {
    /// Split Q8_0 (`superblock_ffn_q8s`): artifact pages as stored (other
    /// types requantized to Q8_0), synthetic pages from the model's FFN.
    #[default]
    Q8_0,
    /// Weight-only NVFP4 (`superblock_ffn_nvfp4`): the model's own
    /// gate/up/down requantized at upload (one tensor scale per layer
    /// matrix), in the same channel order as the Q8_0 pages. 53 % of the
    /// Q8_0 bytes.
    Nvfp4,
    /// Split Q2_K (`superblock_ffn_q2k`): the model's own gate/up/down as
    /// ggml Q2_K at upload (Q2_K gate/up rows copied verbatim, other types
    /// requantized; `W_down` dequantized, transposed and quantized), in the
    /// same channel order as the Q8_0 pages. 33 % of the Q8_0 bytes. Needs
    /// `d_model` a multiple of 256 (one Q2_K super-block) up to
    /// [`Q2K_MAX_D`].
    Q2K,
}

impl PageFormat {
    /// Every format.
    pub const ALL: [PageFormat; 3] = [PageFormat::Q8_0, PageFormat::Nvfp4, PageFormat::Q2K];

    /// `q8_0`, `nvfp4` or `q2_k`.
    pub fn name(self) -> &'static str {
        match self {
            PageFormat::Q8_0 => "q8_0",
            PageFormat::Nvfp4 => "nvfp4",
            PageFormat::Q2K => "q2_k",
        }
    }
}

impl std::fmt::Display for PageFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PageFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<PageFormat, String> {
        match s.to_ascii_lowercase().as_str() {
            "q8_0" | "q8" => Ok(PageFormat::Q8_0),
            "nvfp4" => Ok(PageFormat::Nvfp4),
            "q2_k" | "q2k" => Ok(PageFormat::Q2K),
            other => Err(format!(
                "page format `{other}`: expected q8_0, nvfp4 or q2_k"
            )),
        }
    }
}

/// Largest router (leaf primitives = pages x slices) that `route_bvh` tests
/// primitive by primitive (one thread each, a few rounds of 512) instead of
/// walking the BVH: with the heavily overlapping boxes of real routers the
/// walk visits nearly every leaf anyway, serially (see cuda/route.cu).
pub const ROUTE_SCAN_MAX_PRIMS: usize = 8192;

/// How `route_bvh` finds the boxes that hold each slice point. Every choice
/// gives the same sets (the CPU's); they differ only in speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RouteTraversal {
    /// Scan up to [`ROUTE_SCAN_MAX_PRIMS`] primitives, walk the BVH above.
    #[default]
    Auto,
    /// Test every leaf primitive, one thread each.
    Scan,
    /// Walk the BVH, one thread per slice.
    Bvh,
}

/// Which pages the sparse FFN runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SparsePages {
    /// Every stored page (must equal the dense FFN up to rounding).
    All,
    /// The first `k` pages of every layer (trunk first, then by hotness):
    /// prefix slicing.
    Prefix(usize),
    /// The first `ceil(fraction * n_pages)` pages of every layer.
    Fraction(f32),
    /// A random subset of `ceil(fraction * n_pages)` pages per layer
    /// (ascending ids), fixed by `seed`.
    Random {
        /// Share of pages kept.
        fraction: f32,
        /// Seed of the subset.
        seed: u64,
    },
    /// Trunk + the artifact BVH router's candidates, routed on the device
    /// per token and layer.
    Routed {
        /// Box inflation (the artifact's `default_margin` is calibrated).
        margin: f32,
        /// Primitive scan or BVH walk (same sets).
        traversal: RouteTraversal,
    },
}

#[cfg(test)]
mod tests {
    use super::WeightFormat;

    #[test]
    fn weight_format_names_parse_and_print() {
        for f in [WeightFormat::Native, WeightFormat::Nvfp4] {
            assert_eq!(f.to_string().parse::<WeightFormat>(), Ok(f));
        }
        assert!("q8"
            .parse::<WeightFormat>()
            .unwrap_err()
            .contains("native or nvfp4"));
    }
}
