//! Extended kernel launches (`cuLaunchKernelEx`) with programmatic stream
//! serialization (PDL), which cudarc's launch builder does not take; every
//! launch of `CudaBackend` (and so of the sparse backend) goes through
//! [`launch_ex`].

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaStream, DriverError};

/// Launches `f` on `stream` with `params` (pointers to the argument
/// values, in the kernel's order), with programmatic stream serialization
/// when `programmatic`.
///
/// # Safety
/// `params` must match `f`'s signature and the values must outlive the
/// call; `f` must belong to `stream`'s context.
pub unsafe fn launch_ex(
    f: &CudaFunction,
    stream: &CudaStream,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    params: &mut [*mut c_void],
    programmatic: bool,
) -> Result<(), DriverError> {
    // As cudarc's own launches do: the stream's context current on this
    // thread (a no-op when it already is).
    stream.context().bind_to_thread()?;
    // SAFETY: a plain C union of integers; zero is a valid value of every
    // member.
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attrs = [sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    }];
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: programmatic as u32,
    };
    // SAFETY: the caller's contract; `attrs` outlives the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}
