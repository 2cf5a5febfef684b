//! Stand-in for the Vulkan ray-tracing router when the `vulkan-rt` feature is
//! off: every constructor returns [`Unavailable::NotBuilt`].

use crate::data::RouterData;
use crate::{CandidateSet, RouteError, Router, RouterKind, Unavailable};

/// The Vulkan ray-tracing router (not built: enable the `vulkan-rt` feature).
#[derive(Debug)]
pub struct VulkanRtRouter {
    _never: std::convert::Infallible,
}

impl VulkanRtRouter {
    /// Always fails: the crate was built without `vulkan-rt`.
    pub fn new(_data: &RouterData) -> Result<Self, RouteError> {
        Err(RouteError::Unavailable {
            kind: RouterKind::VulkanRt,
            reason: Unavailable::NotBuilt("vulkan-rt"),
        })
    }

    /// The device's name (never reached).
    pub fn device_name(&self) -> &str {
        match self._never {}
    }
}

impl Router for VulkanRtRouter {
    fn kind(&self) -> RouterKind {
        RouterKind::VulkanRt
    }
    fn route(&mut self, _points: &[[f32; 3]]) -> Result<CandidateSet, RouteError> {
        match self._never {}
    }
}

/// What a CUDA importer asks of the Vulkan router (see the `vulkan-rt` build).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InteropRequest {
    /// Most queries one interop submission routes.
    pub max_queries: usize,
    /// Use only the Vulkan device with this UUID.
    pub device_uuid: Option<[u8; 16]>,
}

/// An exported allocation (never built without `vulkan-rt`).
#[derive(Debug)]
pub struct ExportedMemory {
    _never: std::convert::Infallible,
}

/// The exported buffers and semaphores (never built without `vulkan-rt`).
#[derive(Debug)]
pub struct InteropExports {
    _never: std::convert::Infallible,
}

impl VulkanRtRouter {
    /// Always fails: the crate was built without `vulkan-rt`.
    pub fn new_interop(
        _data: &RouterData,
        _req: &InteropRequest,
    ) -> Result<(Self, InteropExports), RouteError> {
        Err(RouteError::Unavailable {
            kind: RouterKind::VulkanRt,
            reason: Unavailable::NotBuilt("vulkan-rt"),
        })
    }
}
