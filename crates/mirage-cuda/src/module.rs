//! Run-time compilation of the kernels in `cuda/` with NVRTC, cached per
//! device architecture.
//!
//! The source is embedded in the binary (`include_str!`), so a binary runs
//! anywhere a driver and `libnvrtc` are. NVRTC emits PTX for the device's
//! own `sm_XY` (the driver then assembles it for that exact chip). The PTX is
//! kept in `$MIRAGE_CUDA_CACHE`, else `$XDG_CACHE_HOME/mirage/cuda`, else
//! `$HOME/.cache/mirage/cuda`, under a name made of the architecture and an
//! FNV-1a hash of the source and options, so a second start skips the
//! compiler; a cache that cannot be read or written is ignored.

use std::path::PathBuf;

use crate::CudaError;

/// The dense module: `cuda/pdl.cu` (the programmatic-dependent-launch
/// helpers every module starts with), `cuda/norm.cu` (the RMSNorm row both
/// modules run), `cuda/nvfp4.cu` (the weight decode helpers both modules
/// share), then the dense kernels by concern: ggml block decoding
/// (`cuda/ggml.cu`, whose helpers the later files use), element-wise and row
/// kernels (`cuda/elementwise.cu`), decode attention (`cuda/attention.cu`),
/// the prefill attention (`cuda/attention_prefill.cu`), the
/// mat-vecs (`cuda/matvec.cu`, `cuda/matvec_lanes.cu`,
/// `cuda/matvec_split.cu`, `cuda/matvec_imma.cu`), the prefill products on int8 tensor cores
/// (`cuda/mmq.cu`), the pruned decode attention
/// (`cuda/attention_pruned.cu`) and the split decode attention on tensor
/// cores (`cuda/attention_mma.cu`).
pub const DENSE_SOURCE: &str = concat!(
    include_str!("../../../cuda/pdl.cu"),
    include_str!("../../../cuda/norm.cu"),
    include_str!("../../../cuda/nvfp4.cu"),
    include_str!("../../../cuda/ggml.cu"),
    include_str!("../../../cuda/elementwise.cu"),
    include_str!("../../../cuda/attention.cu"),
    include_str!("../../../cuda/attention_prefill.cu"),
    include_str!("../../../cuda/matvec.cu"),
    include_str!("../../../cuda/matvec_lanes.cu"),
    include_str!("../../../cuda/matvec_split.cu"),
    include_str!("../../../cuda/matvec_imma.cu"),
    include_str!("../../../cuda/mmq.cu"),
    include_str!("../../../cuda/attention_pruned.cu"),
    include_str!("../../../cuda/attention_mma.cu")
);

/// The sparse module: the same first three, the fused FFN kernels over
/// pages (`cuda/superblock.cu`, `cuda/superblock_q2k.cu`) and the router
/// (`cuda/route.cu`).
pub const SPARSE_SOURCE: &str = concat!(
    include_str!("../../../cuda/pdl.cu"),
    include_str!("../../../cuda/norm.cu"),
    include_str!("../../../cuda/nvfp4.cu"),
    include_str!("../../../cuda/superblock.cu"),
    include_str!("../../../cuda/superblock_q2k.cu"),
    include_str!("../../../cuda/route.cu")
);

/// The activation-sparse module (`cuda/activation_sparse.cu` after
/// `pdl.cu` and `norm.cu`): the list kernel, the mat-vecs over the GPU
/// channel-major layout and the prompt-batch mask.
pub const ACTIVATION_SPARSE_SOURCE: &str = concat!(
    include_str!("../../../cuda/pdl.cu"),
    include_str!("../../../cuda/norm.cu"),
    include_str!("../../../cuda/activation_sparse.cu")
);

/// NVRTC options besides the architecture. Precise `expf`/division: the
/// backend is checked against the CPU reference to cosine 0.9999.
const OPTIONS: &[&str] = &["--std=c++17", "-default-device"];

/// Whether kernel `name` of `ptx` waits on its prerequisite grid
/// (`griddepcontrol.wait`, `cuda/pdl.cu`): only such a kernel may be
/// launched with programmatic stream serialization, since it is what keeps
/// the kernel from reading the previous kernel's output too early.
pub fn waits_on_prerequisite(ptx: &str, name: &str) -> bool {
    entry(ptx, name).is_some_and(|e| e.contains("griddepcontrol.wait"))
}

/// The text of kernel `name` in `ptx`: from its `.entry name(` line (its
/// parameter list first) up to the next kernel's; `None` when the PTX has
/// no such kernel (a name that is a prefix of another kernel's does not
/// match that kernel).
pub(crate) fn entry<'a>(ptx: &'a str, name: &str) -> Option<&'a str> {
    let at = ptx
        .match_indices(".entry ")
        .map(|(i, _)| i)
        .find(|&i| ptx[i + 7..].starts_with(name) && ptx[i + 7 + name.len()..].starts_with('('))?;
    let body = &ptx[at + 7..];
    Some(&body[..body.find(".entry ").unwrap_or(body.len())])
}

/// The width and kind of each parameter of kernel `name` in `ptx`, in order
/// (`.u64` / `.s64` / `.b64` pointers and longs, `.u32` / `.s32` / `.b32`
/// ints, `.f32` floats); `None` when the PTX has no such kernel.
pub(crate) fn param_kinds(ptx: &str, name: &str) -> Option<Vec<ParamKind>> {
    let e = entry(ptx, name)?;
    let list = &e[..e.find(')').unwrap_or(e.len())];
    Some(
        list.split(".param")
            .skip(1)
            .map(|p| {
                let ty = p.split_whitespace().next().unwrap_or("");
                match ty {
                    ".u64" | ".s64" | ".b64" => ParamKind::Word64,
                    ".u32" | ".s32" | ".b32" => ParamKind::Int32,
                    ".f32" => ParamKind::F32,
                    _ => ParamKind::Other,
                }
            })
            .collect(),
    )
}

/// A kernel parameter's kind as the PTX declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParamKind {
    /// 64 bits: a pointer or a `long`.
    Word64,
    /// A 32-bit integer.
    Int32,
    /// A 32-bit float.
    F32,
    /// Anything else (aligned structs, other widths).
    Other,
}

fn fnv1a(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain(std::iter::once(0)) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("MIRAGE_CUDA_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("mirage/cuda"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/mirage/cuda"))
}

/// PTX of `source` for compute capability `major.minor`, compiled now (no
/// cache): what [`ptx_for`] runs on a cache miss. Needs only `libnvrtc`, no
/// driver and no GPU, so a machine without one can still check that every
/// kernel source compiles (the crate's `nvrtc_check` test).
pub fn compile(name: &str, source: &str, major: i32, minor: i32) -> Result<String, CudaError> {
    let arch = format!("sm_{major}{minor}");
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NvrtcNotFound);
    }
    let mut options: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    let opts = cudarc::nvrtc::CompileOptions {
        options,
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| {
        let log = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        CudaError::Compile {
            source_name: format!("{name}.cu"),
            arch: arch.clone(),
            log,
        }
    })?;
    Ok(ptx.to_src())
}

/// PTX of `source` for compute capability `major.minor`, from the cache or
/// freshly compiled. Returns the PTX and whether it came from the cache.
pub fn ptx_for(
    name: &str,
    source: &str,
    major: i32,
    minor: i32,
) -> Result<(String, bool), CudaError> {
    let arch = format!("sm_{major}{minor}");
    let key = fnv1a(&[source, &arch, &OPTIONS.join(" ")]);
    let path = cache_dir().map(|d| d.join(format!("{name}-{arch}-{key:016x}.ptx")));
    if let Some(p) = &path {
        if let Ok(ptx) = std::fs::read_to_string(p) {
            if ptx.contains(".entry") {
                return Ok((ptx, true));
            }
        }
    }
    let text = compile(name, source, major, minor)?;
    if let Some(p) = &path {
        // Write to a temporary name and rename, so that a concurrent reader
        // never sees half a file.
        if let Some(dir) = p.parent() {
            if std::fs::create_dir_all(dir).is_ok() {
                let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &text).is_ok() {
                    let _ = std::fs::rename(&tmp, p);
                }
            }
        }
    }
    Ok((text, false))
}

#[cfg(test)]
mod tests {
    use super::waits_on_prerequisite;

    const PTX: &str = "
.visible .entry add_one(
\t.param .u64 add_one_param_0
)
{
\tgriddepcontrol.wait;
\tgriddepcontrol.launch_dependents;
\tret;
}
.visible .entry add_one_plain(
\t.param .u64 add_one_plain_param_0
)
{
\tret;
}
";

    /// Only a kernel whose own body waits is eligible; a name that is a
    /// prefix of another kernel's does not match that kernel.
    #[test]
    fn finds_the_wait_in_the_named_kernel_only() {
        assert!(waits_on_prerequisite(PTX, "add_one"));
        assert!(!waits_on_prerequisite(PTX, "add_one_plain"));
        assert!(!waits_on_prerequisite(PTX, "add"));
        assert!(!waits_on_prerequisite(PTX, "missing"));
    }
}
