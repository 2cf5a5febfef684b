//! FFI to csrc/mirage_cutlass.h (compiled by build.rs with nvcc).

use crate::Error;
use std::ffi::{c_char, c_int, c_void, CStr};

pub(crate) const BUILT: bool = true;

const OK: c_int = 0;
const INVALID_ARGUMENT: c_int = 1;
const UNSUPPORTED_ARCH: c_int = 2;
const CUDA_ERROR: c_int = 3;
const CANNOT_IMPLEMENT: c_int = 4;

extern "C" {
    fn mirage_cutlass_last_error() -> *const c_char;
    fn mirage_cutlass_version() -> c_int;
    fn mirage_cutlass_device_capability(
        device: c_int,
        major: *mut c_int,
        minor: *mut c_int,
    ) -> c_int;
    fn mirage_cutlass_sm90_bf16_gemm(
        m: c_int,
        n: c_int,
        k: c_int,
        a: *const c_void,
        b: *const c_void,
        d: *mut f32,
        stream: *mut c_void,
    ) -> c_int;
    fn mirage_cutlass_sm90_bf16_gemm_host(
        m: c_int,
        n: c_int,
        k: c_int,
        a: *const u16,
        b: *const u16,
        d: *mut f32,
        iters: c_int,
        ms_per_iter: *mut f32,
    ) -> c_int;
    fn mirage_cutlass_sm120_sf_bytes(
        m: c_int,
        n: c_int,
        k: c_int,
        operand: c_int,
        bytes: *mut usize,
    ) -> c_int;
    fn mirage_cutlass_sm120_reorder_scales(
        m: c_int,
        n: c_int,
        k: c_int,
        operand: c_int,
        rowmajor: *const u8,
        out: *mut u8,
        out_bytes: usize,
    ) -> c_int;
    fn mirage_cutlass_sm120_nvfp4_gemm(
        m: c_int,
        n: c_int,
        k: c_int,
        a: *const c_void,
        sfa: *const c_void,
        b: *const c_void,
        sfb: *const c_void,
        alpha: f32,
        d: *mut c_void,
        stream: *mut c_void,
    ) -> c_int;
    fn mirage_cutlass_sm120_nvfp4_gemm_host(
        m: c_int,
        n: c_int,
        k: c_int,
        a: *const u8,
        sfa: *const u8,
        b: *const u8,
        sfb: *const u8,
        alpha: f32,
        d: *mut f32,
        iters: c_int,
        ms_per_iter: *mut f32,
    ) -> c_int;
}

/// Maps a status code and the thread's last message to an [`Error`].
fn check(status: c_int) -> Result<(), Error> {
    if status == OK {
        return Ok(());
    }
    // SAFETY: the C side returns a NUL-terminated thread-local string that
    // stays valid until the next failing call on this thread; we copy it.
    let message = unsafe { CStr::from_ptr(mirage_cutlass_last_error()) }
        .to_string_lossy()
        .into_owned();
    Err(match status {
        INVALID_ARGUMENT => Error::InvalidArgument(message),
        UNSUPPORTED_ARCH => Error::UnsupportedArch { message },
        CUDA_ERROR => Error::Cuda(message),
        CANNOT_IMPLEMENT => Error::CannotImplement(message),
        _ => Error::LaunchFailed(message),
    })
}

pub(crate) fn version() -> Result<u32, Error> {
    // SAFETY: no arguments, returns a constant.
    Ok(unsafe { mirage_cutlass_version() } as u32)
}

pub(crate) fn device_capability(device: i32) -> Result<(u32, u32), Error> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both out-pointers are valid for writes.
    check(unsafe { mirage_cutlass_device_capability(device, &mut major, &mut minor) })?;
    Ok((major as u32, minor as u32))
}

pub(crate) unsafe fn sm90_bf16_gemm(
    m: i32,
    n: i32,
    k: i32,
    a: *const c_void,
    b: *const c_void,
    d: *mut f32,
    stream: *mut c_void,
) -> Result<(), Error> {
    // SAFETY: caller's contract (device pointers of the right sizes).
    check(unsafe { mirage_cutlass_sm90_bf16_gemm(m, n, k, a, b, d, stream) })
}

fn timing(iters: i32, ms: f32) -> Option<f32> {
    (iters > 0).then_some(ms)
}

pub(crate) fn sm90_bf16_gemm_host(
    m: i32,
    n: i32,
    k: i32,
    a: &[u16],
    b: &[u16],
    d: &mut [f32],
    iters: i32,
) -> Result<Option<f32>, Error> {
    let mut ms = 0.0f32;
    // SAFETY: lengths were checked against m, n, k by the caller.
    check(unsafe {
        mirage_cutlass_sm90_bf16_gemm_host(
            m,
            n,
            k,
            a.as_ptr(),
            b.as_ptr(),
            d.as_mut_ptr(),
            iters,
            &mut ms,
        )
    })?;
    Ok(timing(iters, ms))
}

pub(crate) fn sm120_sf_bytes(m: i32, n: i32, k: i32, operand: i32) -> Result<usize, Error> {
    let mut bytes = 0usize;
    // SAFETY: out-pointer valid for writes.
    check(unsafe { mirage_cutlass_sm120_sf_bytes(m, n, k, operand, &mut bytes) })?;
    Ok(bytes)
}

pub(crate) fn sm120_reorder_scales(
    m: i32,
    n: i32,
    k: i32,
    operand: i32,
    rowmajor: &[u8],
    out: &mut [u8],
) -> Result<(), Error> {
    // SAFETY: rowmajor's length was checked by the caller; out's length is
    // passed and checked on the C side.
    check(unsafe {
        mirage_cutlass_sm120_reorder_scales(
            m,
            n,
            k,
            operand,
            rowmajor.as_ptr(),
            out.as_mut_ptr(),
            out.len(),
        )
    })
}

#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sm120_nvfp4_gemm(
    m: i32,
    n: i32,
    k: i32,
    a: *const c_void,
    sfa: *const c_void,
    b: *const c_void,
    sfb: *const c_void,
    alpha: f32,
    d: *mut c_void,
    stream: *mut c_void,
) -> Result<(), Error> {
    // SAFETY: caller's contract (device pointers of the right sizes).
    check(unsafe { mirage_cutlass_sm120_nvfp4_gemm(m, n, k, a, sfa, b, sfb, alpha, d, stream) })
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn sm120_nvfp4_gemm_host(
    m: i32,
    n: i32,
    k: i32,
    a: &[u8],
    sfa: &[u8],
    b: &[u8],
    sfb: &[u8],
    alpha: f32,
    d: &mut [f32],
    iters: i32,
) -> Result<Option<f32>, Error> {
    let mut ms = 0.0f32;
    // SAFETY: lengths were checked against m, n, k by the caller.
    check(unsafe {
        mirage_cutlass_sm120_nvfp4_gemm_host(
            m,
            n,
            k,
            a.as_ptr(),
            sfa.as_ptr(),
            b.as_ptr(),
            sfb.as_ptr(),
            alpha,
            d.as_mut_ptr(),
            iters,
            &mut ms,
        )
    })?;
    Ok(timing(iters, ms))
}
