//! Stand-in when the kernels are not compiled: every call is NotBuilt.

use crate::Error;
use std::ffi::c_void;

pub(crate) const BUILT: bool = false;

fn not_built<T>() -> Result<T, Error> {
    Err(Error::NotBuilt {
        reason: env!("CUTLASS_SYS_STUB_REASON"),
    })
}

pub(crate) fn version() -> Result<u32, Error> {
    not_built()
}

pub(crate) fn device_capability(_device: i32) -> Result<(u32, u32), Error> {
    not_built()
}

pub(crate) unsafe fn sm90_bf16_gemm(
    _m: i32,
    _n: i32,
    _k: i32,
    _a: *const c_void,
    _b: *const c_void,
    _d: *mut f32,
    _stream: *mut c_void,
) -> Result<(), Error> {
    not_built()
}

pub(crate) fn sm90_bf16_gemm_host(
    _m: i32,
    _n: i32,
    _k: i32,
    _a: &[u16],
    _b: &[u16],
    _d: &mut [f32],
    _iters: i32,
) -> Result<Option<f32>, Error> {
    not_built()
}

pub(crate) fn sm120_sf_bytes(_m: i32, _n: i32, _k: i32, _operand: i32) -> Result<usize, Error> {
    not_built()
}

pub(crate) fn sm120_reorder_scales(
    _m: i32,
    _n: i32,
    _k: i32,
    _operand: i32,
    _rowmajor: &[u8],
    _out: &mut [u8],
) -> Result<(), Error> {
    not_built()
}

#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sm120_nvfp4_gemm(
    _m: i32,
    _n: i32,
    _k: i32,
    _a: *const c_void,
    _sfa: *const c_void,
    _b: *const c_void,
    _sfb: *const c_void,
    _alpha: f32,
    _d: *mut c_void,
    _stream: *mut c_void,
) -> Result<(), Error> {
    not_built()
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn sm120_nvfp4_gemm_host(
    _m: i32,
    _n: i32,
    _k: i32,
    _a: &[u8],
    _sfa: &[u8],
    _b: &[u8],
    _sfb: &[u8],
    _alpha: f32,
    _d: &mut [f32],
    _iters: i32,
) -> Result<Option<f32>, Error> {
    not_built()
}
