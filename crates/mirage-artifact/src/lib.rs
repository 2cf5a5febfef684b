//! MIRAGE's page-major artifact: calibration, page formation, packing,
//! router and predictor fitting, the artifact file (writer + validating
//! memory-mapped loader), a budget solver, and the superblock CPU backend
//! that runs the FFN from the artifact's pages.
//!
//! Pipeline ([`build::build`]): run the dense CPU engine over calibration
//! text ([`mirage_runtime::observe`]) → per layer, group channels into
//! 128-channel pages by co-activation ([`build::form_pages`]), compute the
//! oracle useful set of every token ([`metrics`]), order pages by oracle
//! frequency (trunk first, then prefix-sliceable routed pages) → fit router
//! boxes and the low-rank predictor ([`fit`]) → pack pages ([`pack`]) →
//! write ([`format`], spec in docs/ARTIFACT.md).
//!
//! Libraries never print; progress goes through [`build::BuildEvent`].
#![deny(missing_docs)]

pub mod activation;
pub mod budget;
pub mod build;
pub mod error;
pub mod ffn;
pub mod fit;
pub mod format;
pub mod linalg;
pub mod metrics;
pub mod pack;
pub mod prefix;
pub mod superblock;

pub use build::{build, BuildEvent, BuildOptions, BuildOutput};
pub use error::{ArtifactError, Result};
pub use format::{Artifact, ArtifactMeta, LayerData, PAGE_CHANNELS};
pub use prefix::{pages_for_fraction, prefix_slice, ChannelOrder, PrefixSlice};
pub use superblock::{SparseMode, SuperblockBackend};
