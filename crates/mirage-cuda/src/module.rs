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

/// The dense kernels (`cuda/dense.cu`), after `cuda/nvfp4.cu`, whose `sb_*`
/// decode helpers the fast decode kernels (split Q8_0, NVFP4) share with the
/// sparse path, then the pruned decode attention (`cuda/attention_pruned.cu`,
/// which uses dense.cu's helpers).
pub const DENSE_SOURCE: &str = concat!(
    include_str!("../../../cuda/nvfp4.cu"),
    include_str!("../../../cuda/dense.cu"),
    include_str!("../../../cuda/attention_pruned.cu")
);

/// NVRTC options besides the architecture. Precise `expf`/division: the
/// backend is checked against the CPU reference to cosine 0.9999.
const OPTIONS: &[&str] = &["--std=c++17", "-default-device"];

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
    let text = ptx.to_src();
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
