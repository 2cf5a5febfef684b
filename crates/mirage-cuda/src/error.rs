//! Why the CUDA backend could not start or run.

use mirage_runtime::RuntimeError;

/// An error of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The crate was built without its `cuda` feature.
    #[error("mirage-cuda was built without the `cuda` feature")]
    NotCompiledWithCuda,
    /// `libcuda` (the NVIDIA driver library) could not be loaded.
    #[error("the CUDA driver library (libcuda) is not present on this machine")]
    DriverNotFound,
    /// `libnvrtc` (the run-time compiler) could not be loaded.
    #[error("the CUDA run-time compiler library (libnvrtc) is not present; add its folder to LD_LIBRARY_PATH")]
    NvrtcNotFound,
    /// The driver is there but reports no device with this ordinal.
    #[error("no CUDA device {ordinal} (the driver reports {count})")]
    NoDevice {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A backend setting out of its range.
    #[error("CUDA backend setting: {0}")]
    Setting(String),
    /// NVRTC refused the kernel source.
    #[error("NVRTC compile of {source_name} for {arch}: {log}")]
    Compile {
        /// Kernel file.
        source_name: String,
        /// Target architecture.
        arch: String,
        /// Compiler log.
        log: String,
    },
}

impl From<CudaError> for RuntimeError {
    fn from(e: CudaError) -> RuntimeError {
        RuntimeError::Device {
            backend: "cuda".into(),
            message: e.to_string(),
        }
    }
}
