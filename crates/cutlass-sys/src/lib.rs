//! Rust bindings to a small C ABI around two CUTLASS GEMMs:
//!
//! * [`sm90_bf16_gemm`]: BF16 x BF16 -> F32 for prefill on Hopper, built for
//!   `sm_90a` (TMA + warp-specialized `wgmma`, CUTLASS 3.x collective builder).
//! * [`sm120_nvfp4_gemm`]: block-scaled NVFP4 x NVFP4 -> BF16, built for
//!   `sm_120a` (Blackwell GeForce / RTX PRO). It only runs there: Hopper has
//!   no FP4 tensor cores, so on an H200 it is compiled, never run.
//!
//! Design rules. The kernels are compiled only with feature `cutlass` and
//! when build.rs finds nvcc and the CUTLASS headers; otherwise this crate is
//! a stub whose every call returns [`Error::NotBuilt`] with the reason (the
//! candle pattern: no cfg attributes leak to callers). Each kernel is
//! arch-specific, so calls are dispatched by compute capability: the C side
//! refuses a device whose capability differs ([`Error::UnsupportedArch`])
//! instead of failing in the launch, and [`Kernel::check`] lets a caller
//! that already knows the capability (e.g. from cudarc) decide without a
//! call. The crate has no Rust dependencies (no cudarc, no thiserror) so
//! that its stub build is instant; the C side queries the device through
//! the CUDA runtime it links statically.

#![deny(missing_docs)]

use std::ffi::c_void;
use std::fmt;

mod imp;

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The kernels are not compiled into this build.
    NotBuilt {
        /// Why build.rs built the stub (feature off, nvcc or CUTLASS missing).
        reason: &'static str,
    },
    /// The kernel is compiled for another compute capability.
    UnsupportedArch {
        /// What the kernel needs and what the device is.
        message: String,
    },
    /// A shape or buffer does not fit the call.
    InvalidArgument(String),
    /// A CUDA runtime call failed (no device, no driver, launch error...).
    Cuda(String),
    /// CUTLASS's `can_implement` refused the problem (alignment, shape).
    CannotImplement(String),
    /// CUTLASS failed to initialize or run the kernel.
    LaunchFailed(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NotBuilt { reason } => write!(f, "cutlass-sys kernels not built: {reason}"),
            Error::UnsupportedArch { message } => write!(f, "unsupported GPU: {message}"),
            Error::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            Error::Cuda(m) => write!(f, "CUDA error: {m}"),
            Error::CannotImplement(m) => write!(f, "CUTLASS cannot implement: {m}"),
            Error::LaunchFailed(m) => write!(f, "CUTLASS launch failed: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// A CUDA compute capability (`major.minor`; the H200 is 9.0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ComputeCapability {
    /// Major version (9 = Hopper, 10/12 = Blackwell).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// The kernels of this crate, for dispatch by compute capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// BF16 GEMM, `sm_90a` cubin.
    Sm90Bf16Gemm,
    /// Block-scaled NVFP4 GEMM, `sm_120a` cubin.
    Sm120Nvfp4Gemm,
}

impl Kernel {
    /// The one capability the kernel's arch-specific ("a") cubin runs on.
    pub fn required_capability(self) -> ComputeCapability {
        match self {
            Kernel::Sm90Bf16Gemm => ComputeCapability { major: 9, minor: 0 },
            Kernel::Sm120Nvfp4Gemm => ComputeCapability {
                major: 12,
                minor: 0,
            },
        }
    }

    /// Whether the kernel can launch on a device of capability `cc`, as the
    /// error the C side would return (same wording).
    pub fn check(self, cc: ComputeCapability) -> Result<(), Error> {
        let needed = self.required_capability();
        if cc == needed {
            return Ok(());
        }
        let (name, what) = match self {
            Kernel::Sm90Bf16Gemm => ("sm90 bf16 gemm", "Hopper wgmma"),
            Kernel::Sm120Nvfp4Gemm => (
                "sm120 nvfp4 gemm",
                "Blackwell GeForce/RTX PRO block-scaled FP4 MMA",
            ),
        };
        Err(Error::UnsupportedArch {
            message: format!("{name} is built for {needed}a only ({what}); the device is {cc}"),
        })
    }
}

/// Whether the CUTLASS kernels are compiled into this build.
pub fn is_built() -> bool {
    imp::BUILT
}

/// The CUTLASS version the kernels were compiled against (`(4, 2)`).
pub fn cutlass_version() -> Result<(u32, u32), Error> {
    imp::version().map(|v| (v / 100, v % 100))
}

/// Compute capability of CUDA device `device` (CUDA runtime query).
pub fn device_capability(device: i32) -> Result<ComputeCapability, Error> {
    let (major, minor) = imp::device_capability(device)?;
    Ok(ComputeCapability { major, minor })
}

fn check_dims(m: usize, n: usize, k: usize) -> Result<(i32, i32, i32), Error> {
    let to_i32 = |v: usize, name: &str| {
        i32::try_from(v)
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("{name}={v} must be in 1..=i32::MAX")))
    };
    Ok((to_i32(m, "m")?, to_i32(n, "n")?, to_i32(k, "k")?))
}

fn check_len(what: &str, expected: usize, got: usize) -> Result<(), Error> {
    if expected != got {
        return Err(Error::InvalidArgument(format!(
            "{what} holds {got}, expected {expected}"
        )));
    }
    Ok(())
}

/// `D[m,n] = A[m,k] · B[n,k]ᵀ` on device memory: A row-major BF16 (bits as
/// u16), B row-major `[n, k]` BF16 (the GGUF weight layout), D row-major F32.
/// `k` must be a multiple of 8 and `n` of 4 (16-byte TMA alignment).
///
/// # Safety
/// `a`, `b`, `d` are device pointers holding `m*k`, `n*k` and `m*n`
/// elements on the current device; `stream` is a CUDA stream or null.
pub unsafe fn sm90_bf16_gemm(
    m: usize,
    n: usize,
    k: usize,
    a: *const c_void,
    b: *const c_void,
    d: *mut f32,
    stream: *mut c_void,
) -> Result<(), Error> {
    let (m, n, k) = check_dims(m, n, k)?;
    // SAFETY: forwarded caller contract.
    unsafe { imp::sm90_bf16_gemm(m, n, k, a, b, d, stream) }
}

/// [`sm90_bf16_gemm`] on host slices: copies to the device, runs once into
/// `d`, then `iters` more timed runs. Returns the mean milliseconds per run
/// of the timed runs (`None` when `iters == 0`).
pub fn sm90_bf16_gemm_host(
    m: usize,
    n: usize,
    k: usize,
    a: &[u16],
    b: &[u16],
    d: &mut [f32],
    iters: u32,
) -> Result<Option<f32>, Error> {
    check_len("a (bf16 elements)", m * k, a.len())?;
    check_len("b (bf16 elements)", n * k, b.len())?;
    check_len("d (f32 elements)", m * n, d.len())?;
    let (m, n, k) = check_dims(m, n, k)?;
    let iters = i32::try_from(iters).map_err(|_| Error::InvalidArgument("iters".into()))?;
    imp::sm90_bf16_gemm_host(m, n, k, a, b, d, iters)
}

/// Operand of a block-scaled GEMM (its scale tensor's layout differs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// A, `m` rows.
    A,
    /// B, `n` rows.
    B,
}

/// Bytes of one E4M3 scale tensor in CUTLASS's interleaved SM1xx layout
/// for an `m x n x k` NVFP4 GEMM (rows padded to 128, k-blocks to 4).
pub fn sm120_scale_bytes(m: usize, n: usize, k: usize, operand: Operand) -> Result<usize, Error> {
    let (m, n, k) = check_dims(m, n, k)?;
    imp::sm120_sf_bytes(m, n, k, operand as i32)
}

/// Reorders row-major E4M3 block scales (`[rows, k/16]`, the layout of
/// `mirage_gguf`'s NVFP4 codec; rows = `m` for A, `n` for B) into the
/// interleaved layout [`sm120_nvfp4_gemm`] reads, with CUTLASS's own layout
/// function. Host-only (no GPU needed); padding is zero.
pub fn sm120_reorder_scales(
    m: usize,
    n: usize,
    k: usize,
    operand: Operand,
    rowmajor: &[u8],
) -> Result<Vec<u8>, Error> {
    if !k.is_multiple_of(128) {
        return Err(Error::InvalidArgument(format!(
            "k={k} is not a multiple of 128"
        )));
    }
    let rows = match operand {
        Operand::A => m,
        Operand::B => n,
    };
    check_len("block scales (e4m3 bytes)", rows * k / 16, rowmajor.len())?;
    let (mi, ni, ki) = check_dims(m, n, k)?;
    let mut out = vec![0u8; imp::sm120_sf_bytes(mi, ni, ki, operand as i32)?];
    imp::sm120_reorder_scales(mi, ni, ki, operand as i32, rowmajor, &mut out)?;
    Ok(out)
}

/// `D[m,n] = alpha · A[m,k] · B[n,k]ᵀ` with NVFP4 A and B on device memory:
/// packed E2M1 (two per byte, low nibble first, row-major `[rows, k/2]`)
/// with UE4M3 block scales (one per 16 elements) in CUTLASS's interleaved
/// layout ([`sm120_scale_bytes`]); `alpha` is the product of the two
/// per-tensor FP32 scales; D is row-major BF16. `k` must be a multiple of
/// 128. Runs only on compute capability 12.0.
///
/// # Safety
/// Pointers are device pointers of the sizes above on the current device;
/// `stream` is a CUDA stream or null.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sm120_nvfp4_gemm(
    m: usize,
    n: usize,
    k: usize,
    a: *const c_void,
    scales_a: *const c_void,
    b: *const c_void,
    scales_b: *const c_void,
    alpha: f32,
    d: *mut c_void,
    stream: *mut c_void,
) -> Result<(), Error> {
    let (m, n, k) = check_dims(m, n, k)?;
    // SAFETY: forwarded caller contract.
    unsafe { imp::sm120_nvfp4_gemm(m, n, k, a, scales_a, b, scales_b, alpha, d, stream) }
}

/// [`sm120_nvfp4_gemm`] on host slices, with the block scales given
/// row-major (`[rows, k/16]`, the layout of `mirage_gguf`'s NVFP4 codec);
/// they are reordered into CUTLASS's layout on the host. D comes back as
/// F32 (widened from the kernel's BF16). Returns the mean milliseconds per
/// timed run (`None` when `iters == 0`).
#[allow(clippy::too_many_arguments)]
pub fn sm120_nvfp4_gemm_host(
    m: usize,
    n: usize,
    k: usize,
    a: &[u8],
    scales_a: &[u8],
    b: &[u8],
    scales_b: &[u8],
    alpha: f32,
    d: &mut [f32],
    iters: u32,
) -> Result<Option<f32>, Error> {
    if !k.is_multiple_of(128) {
        return Err(Error::InvalidArgument(format!(
            "k={k} is not a multiple of 128"
        )));
    }
    check_len("a (packed e2m1 bytes)", m * k / 2, a.len())?;
    check_len("b (packed e2m1 bytes)", n * k / 2, b.len())?;
    check_len("scales_a (e4m3 bytes)", m * k / 16, scales_a.len())?;
    check_len("scales_b (e4m3 bytes)", n * k / 16, scales_b.len())?;
    check_len("d (f32 elements)", m * n, d.len())?;
    let (m, n, k) = check_dims(m, n, k)?;
    let iters = i32::try_from(iters).map_err(|_| Error::InvalidArgument("iters".into()))?;
    imp::sm120_nvfp4_gemm_host(m, n, k, a, scales_a, b, scales_b, alpha, d, iters)
}
