//! The two implementations behind the public API: the FFI to the compiled
//! kernels, or the stub. Only this module knows which one was built.

#[cfg(cutlass_built)]
mod ffi;
#[cfg(cutlass_built)]
pub(crate) use ffi::*;

#[cfg(not(cutlass_built))]
mod stub;
#[cfg(not(cutlass_built))]
pub(crate) use stub::*;
