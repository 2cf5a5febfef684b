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

/// The dense kernels (`cuda/dense.cu`), after `cuda/pdl.cu` (the
/// programmatic-dependent-launch helpers every module starts with),
/// `cuda/norm.cu` (the RMSNorm row both the dense and the sparse module
/// run) and `cuda/nvfp4.cu`, whose `sb_*` decode helpers the fast decode kernels
/// (split Q8_0, NVFP4) share with the sparse path, then the pruned decode
/// attention (`cuda/attention_pruned.cu`, which uses dense.cu's helpers).
pub const DENSE_SOURCE: &str = concat!(
    include_str!("../../../cuda/pdl.cu"),
    include_str!("../../../cuda/norm.cu"),
    include_str!("../../../cuda/nvfp4.cu"),
    include_str!("../../../cuda/dense.cu"),
    include_str!("../../../cuda/attention_pruned.cu")
);

/// NVRTC options besides the architecture. Precise `expf`/division: the
/// backend is checked against the CPU reference to cosine 0.9999.
const OPTIONS: &[&str] = &["--std=c++17", "-default-device"];

/// `MIRAGE_CUDA_ATT_KEYS` when it is a number: the least keys per split
/// block of the decode attention, read by the kernels (`with_env_defines`)
/// and by the host's split plan (`backend::attend_min_chunk`) alike.
pub(crate) fn attention_min_keys_setting() -> Option<usize> {
    env_number("MIRAGE_CUDA_ATT_KEYS")
}

/// Environment variable `key` when it parses as a `T`.
fn env_number<T: std::str::FromStr>(key: &str) -> Option<T> {
    std::env::var(key).ok().and_then(|v| v.parse().ok())
}

/// Whether environment variable `key` is `value` (any case).
fn env_is(key: &str, value: &str) -> bool {
    std::env::var(key).is_ok_and(|v| v.eq_ignore_ascii_case(value))
}

/// `source` with the compile-time switches the environment asks for put in
/// front: `MIRAGE_PREFETCH_ROW` from `MIRAGE_CUDA_PREFETCH` (bytes of each
/// weight row the mat-vec variants ask L2 for before waiting on the previous
/// kernel, `cuda/pdl.cu`; `0` turns the prefetch off) when that variable is
/// a number, `MIRAGE_ATT_MIN_KEYS` from `MIRAGE_CUDA_ATT_KEYS` (the least
/// keys per split block of the decode attention, dense.cu's `att_chunk`;
/// `0` keeps the host's fixed chunk) when that is a number, and
/// `MIRAGE_NORM_SCALAR` when `MIRAGE_CUDA_NORM=scalar` (the RMSNorm's
/// previous scalar loop instead of its vector path, norm.cu's
/// `rms_norm_row`), `MIRAGE_MV2_MIN_BLOCKS` from `MIRAGE_CUDA_MV2_BLOCKS`
/// (1 to 8: the least resident blocks per SM the split Q8_0 v2 mat-vecs are
/// compiled for, dense.cu), and `MIRAGE_XPF_EVICT_LAST` when
/// `MIRAGE_CUDA_XPREFETCH_EVICT=last` (the cross-op weight prefetch,
/// dense.cu's `l2_prefetch`, asks for the evict-last priority),
/// `MIRAGE_ATT_LOADS_BATCH 0` when `MIRAGE_CUDA_ATT_LOADS=serial` (the
/// decode attention's previous predicated loads, which ptxas issued one at
/// a time, instead of the default batch of key and value loads in flight
/// before any is converted, dense.cu's `att_load_keys`), `MIRAGE_T2_PROBE`
/// 1 / 2 when `MIRAGE_CUDA_T2_PROBE=copy` / `math` (superblock.cu: the tiled
/// fused-FFN phase 2's copies alone / arithmetic alone, wrong outputs, for
/// kernel-bench timing only); `source` as it is when none is set.
pub fn with_env_defines(source: &str) -> std::borrow::Cow<'_, str> {
    let mut defines = String::new();
    if let Some(n) = env_number::<u32>("MIRAGE_CUDA_PREFETCH") {
        defines.push_str(&format!("#define MIRAGE_PREFETCH_ROW {n}\n"));
    }
    if let Some(n) = attention_min_keys_setting() {
        defines.push_str(&format!("#define MIRAGE_ATT_MIN_KEYS {n}\n"));
    }
    if env_is("MIRAGE_CUDA_NORM", "scalar") {
        defines.push_str("#define MIRAGE_NORM_SCALAR 1\n");
    }
    if let Some(n) = env_number::<u32>("MIRAGE_CUDA_MV2_BLOCKS").filter(|n| (1..=8).contains(n)) {
        defines.push_str(&format!("#define MIRAGE_MV2_MIN_BLOCKS {n}\n"));
    }
    if env_is("MIRAGE_CUDA_ATT_LOADS", "serial") {
        // The decode attention's key/value loads back in their predicated
        // form (dense.cu, att_load_keys), for A/Bs against the batched default.
        defines.push_str("#define MIRAGE_ATT_LOADS_BATCH 0\n");
    }
    if env_is("MIRAGE_CUDA_XPREFETCH_EVICT", "last") {
        defines.push_str("#define MIRAGE_XPF_EVICT_LAST 1\n");
    }
    // Timing probes of the tiled fused-FFN phase 2 (superblock.cu,
    // MIRAGE_T2_PROBE): its copies alone or its arithmetic alone. Wrong
    // outputs: for kernel-bench rows only.
    if env_is("MIRAGE_CUDA_T2_PROBE", "copy") {
        defines.push_str("#define MIRAGE_T2_PROBE 1\n");
    } else if env_is("MIRAGE_CUDA_T2_PROBE", "math") {
        defines.push_str("#define MIRAGE_T2_PROBE 2\n");
    }
    if defines.is_empty() {
        source.into()
    } else {
        format!("{defines}{source}").into()
    }
}

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

    /// Every kernel of the shipped sources starts with PDL_ENTRY() (pdl.cu);
    /// a kernel without it would only lose the overlap, but the rule is that
    /// all of them have it.
    #[test]
    fn every_shipped_kernel_calls_pdl_entry() {
        let files = [
            include_str!("../../../cuda/dense.cu"),
            include_str!("../../../cuda/attention_pruned.cu"),
            include_str!("../../../cuda/nvfp4.cu"),
            include_str!("../../../cuda/superblock.cu"),
            include_str!("../../../cuda/superblock_q2k.cu"),
            include_str!("../../../cuda/route.cu"),
            include_str!("../../../cuda/vk_interop.cu"),
        ];
        for src in files {
            let kernels = src.matches("__global__").count();
            // The split mat-vec variants wait inside mv3_variant/ffn_variant
            // (after their weight prefetch) or mv3_preload/ffn_preload, one
            // call for the 5 kernels of each MVV_INSTANCE / MVV_PRE_INSTANCE (mv3_grid: the 4 of its
            // MV3_SPLIT_KERNELS); l2_prefetch triggers first and waits last
            // (`pdl_wait();` of its own).
            let entries = src.matches("PDL_ENTRY();").count() + src.matches("pdl_wait();").count();
            // (each macro's count less its #define line).
            // MV3_SPLIT_KERNELS: 4 kernels per use (one of them inside
            // MVV_PRE_INSTANCE's body, which adds its FFN kernel).
            let uses = |m: &str| src.matches(m).count().saturating_sub(1);
            let variant_kernels = uses("MVV_INSTANCE(") * 5
                + uses("MV3_SPLIT_KERNELS(") * 4
                + uses("MVV_PRE_INSTANCE(");
            assert!(
                entries + variant_kernels >= kernels,
                "{kernels} kernels, {entries} PDL_ENTRY calls, {variant_kernels} variant kernels"
            );
        }
    }
}
