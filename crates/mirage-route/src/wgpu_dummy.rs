//! Stand-in for the wgpu router when the `wgpu` feature is off: every
//! constructor returns [`Unavailable::NotBuilt`].

use crate::data::RouterData;
use crate::{CandidateSet, RouteError, Router, RouterKind, Unavailable};

/// Options of the wgpu router.
#[derive(Clone, Copy, Debug, Default)]
pub struct WgpuOptions {
    /// Accept software adapters (Mesa lavapipe); tests do, [`crate::best_available`] does not.
    pub allow_software: bool,
}

/// The wgpu compute router (not built: enable the `wgpu` feature).
#[derive(Debug)]
pub struct WgpuRouter {
    _never: std::convert::Infallible,
}

impl WgpuRouter {
    /// Always fails: the crate was built without `wgpu`.
    pub fn new(_data: &RouterData, _options: WgpuOptions) -> Result<Self, RouteError> {
        Err(RouteError::Unavailable {
            kind: RouterKind::Wgpu,
            reason: Unavailable::NotBuilt("wgpu"),
        })
    }

    /// The adapter's name (never reached).
    pub fn adapter_name(&self) -> &str {
        match self._never {}
    }
}

impl Router for WgpuRouter {
    fn kind(&self) -> RouterKind {
        RouterKind::Wgpu
    }
    fn route(&mut self, _points: &[[f32; 3]]) -> Result<CandidateSet, RouteError> {
        match self._never {}
    }
}
