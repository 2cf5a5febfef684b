//! Stand-in for builds without the `cuda` feature: the same public API, whose
//! constructor returns [`CudaError::NotCompiledWithCuda`], so frontends can
//! name the types unconditionally.

use mirage_runtime::backend::{AttentionParams, Backend, HostMatrix, QkNorm, TokenSlot};
use mirage_runtime::kv_cache::KvSpec;
use mirage_runtime::{Result, RuntimeError};

use crate::{CudaError, GraphStats, MemoryStats};

fn no() -> RuntimeError {
    CudaError::NotCompiledWithCuda.into()
}

/// Stand-in: never constructed.
#[derive(Debug)]
pub struct CudaMatrix(());
/// Stand-in: never constructed.
#[derive(Debug)]
pub struct CudaVector(());
/// Stand-in: never constructed.
#[derive(Debug)]
pub struct CudaFfn(());
/// Stand-in: never constructed.
#[derive(Debug)]
pub struct CudaKvCache(());

impl CudaKvCache {
    /// Never reached.
    pub fn kv_pruning(&self) -> Option<&mirage_runtime::KvPruning> {
        None
    }
}
/// Stand-in activation buffer.
#[derive(Debug, Default)]
pub struct CudaActivations(());

/// Stand-in backend: [`CudaBackend::new`] always fails.
#[derive(Debug)]
pub struct CudaBackend(());

impl CudaBackend {
    /// Always [`CudaError::NotCompiledWithCuda`].
    pub fn new(_ordinal: usize) -> Result<CudaBackend, CudaError> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Never reached.
    pub fn device_name(&self) -> &str {
        ""
    }
    /// Never reached.
    pub fn compute_capability(&self) -> (i32, i32) {
        (0, 0)
    }
    /// Never reached.
    pub fn ptx_from_cache(&self) -> bool {
        false
    }
    /// Never reached.
    pub fn set_graphs(&self, _on: bool) {}
    /// Fast decode path switch (no effect without CUDA).
    pub fn set_fast_decode(&self, _on: bool) {}
    /// Whether the fast decode path is on.
    pub fn fast_decode(&self) -> bool {
        false
    }
    /// Launches of the last decode graph (none without CUDA).
    pub fn last_graph_launches(&self) -> usize {
        0
    }
    /// Fused decode attention switch (no effect without CUDA).
    pub fn set_fused_attention(&self, _on: bool) {}
    /// Attention block switch (no effect without CUDA).
    pub fn set_attention_block(&self, _on: bool) {}
    /// The attention block launches planned so far (none without CUDA).
    pub fn attention_block_plans(&self) -> Vec<String> {
        Vec::new()
    }
    /// Attention block grid cap (no effect without CUDA).
    pub fn set_attention_block_grid(&self, _blocks: Option<usize>) {}
    /// RoPE-in-attention switch (no effect without CUDA).
    pub fn set_rope_in_attention(&self, _on: bool) {}
    /// Programmatic dependent launch switch (no effect without CUDA).
    pub fn set_pdl(&self, _on: bool) {}
    /// Whether programmatic dependent launch is on (never without CUDA).
    pub fn pdl(&self) -> bool {
        false
    }
    /// Cross-op weight prefetch switch (no effect without CUDA).
    pub fn set_cross_prefetch(&self, _sites: crate::PrefetchSites) {}
    /// Where the cross-op weight prefetch is issued (nowhere without CUDA).
    pub fn cross_prefetch(&self) -> crate::PrefetchSites {
        crate::PrefetchSites::NONE
    }
    /// Persistent-grid mat-vec switch (no effect without CUDA).
    pub fn set_matvec_grid(&self, _grid: crate::MatvecGrid) {}
    /// When the mat-vecs run on a persistent grid (never without CUDA).
    pub fn matvec_grid(&self) -> crate::MatvecGrid {
        crate::MatvecGrid::Off
    }
    /// Preload switch (no effect without CUDA).
    pub fn set_preload(&self, _parts: crate::PreloadParts) {}
    /// Which kernels preload before their PDL wait (none without CUDA).
    pub fn preload(&self) -> crate::PreloadParts {
        crate::PreloadParts::NONE
    }
    /// Split-layout type switch (no effect without CUDA).
    pub fn set_repacked_types(&self, _types: &[mirage_gguf::GgmlType]) {}
    /// Split-K switch (no effect without CUDA).
    pub fn set_split_k(&self, _k: usize) -> Result<(), CudaError> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Tiled prefill attention switch (no effect without CUDA).
    pub fn set_tiled_prefill_attention(&self, _on: bool) {}
    /// Whether prefill uses the tiled attention kernel (never without CUDA).
    pub fn tiled_prefill_attention(&self) -> bool {
        false
    }
    /// Mat-vec variant switch (no effect without CUDA).
    pub fn set_matvec_variant(&self, _v: usize) -> Result<(), CudaError> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// The mat-vec variant (2, the CUDA backend's default).
    pub fn matvec_variant(&self) -> usize {
        2
    }
    /// Norm folding switch (no effect without CUDA).
    pub fn set_fuse_norm(&self, _on: bool) {}
    /// Whether norms are folded into the next mat-vec.
    pub fn fuse_norm(&self) -> bool {
        false
    }
    /// Weight upload format (no effect without CUDA).
    pub fn set_weight_format(&self, _f: crate::WeightFormat) {}
    /// The weight upload format.
    pub fn weight_format(&self) -> crate::WeightFormat {
        crate::WeightFormat::Native
    }
    /// Never reached.
    pub fn graphs(&self) -> bool {
        false
    }
    /// Never reached.
    pub fn set_prefill_gemm(&self, _on: bool) -> bool {
        false
    }
    /// Never reached.
    pub fn prefill_gemm(&self) -> bool {
        false
    }
    /// Never reached.
    pub fn set_gemm_tile_bytes(&self, _bytes: usize) {}
    /// Never reached.
    pub fn graph_stats(&self) -> GraphStats {
        GraphStats::default()
    }
    /// Never reached.
    pub fn memory_stats(&self) -> MemoryStats {
        MemoryStats::default()
    }
    /// Never reached.
    pub fn device_memory(&self) -> Result<(usize, usize)> {
        Err(no())
    }
    /// Never reached.
    pub fn synchronize(&self) -> Result<()> {
        Err(no())
    }
    /// Never reached.
    pub fn copy_bandwidth(&self, _bytes: usize, _iters: usize) -> Result<f64> {
        Err(no())
    }
    /// Never reached.
    pub fn upload_activations(
        &self,
        _rows: usize,
        _width: usize,
        _data: &[f32],
    ) -> Result<CudaActivations> {
        Err(no())
    }
    /// Never reached.
    pub fn argmax(&self, _x: &CudaActivations) -> Result<Vec<u32>> {
        Err(no())
    }
}

impl Backend for CudaBackend {
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type Ffn = CudaFfn;
    type Activations = CudaActivations;
    type KvCache = CudaKvCache;

    fn name(&self) -> String {
        "cuda".into()
    }
    fn upload_matrix(&self, _m: &HostMatrix) -> Result<CudaMatrix> {
        Err(no())
    }
    fn upload_vector(&self, _v: &[f32]) -> Result<CudaVector> {
        Err(no())
    }
    fn upload_ffn(
        &self,
        _l: usize,
        _g: &HostMatrix,
        _u: &HostMatrix,
        _d: &HostMatrix,
    ) -> Result<CudaFfn> {
        Err(no())
    }
    fn new_kv_cache(&self, _spec: KvSpec) -> Result<CudaKvCache> {
        Err(no())
    }
    fn new_kv_cache_pruned(
        &self,
        _spec: KvSpec,
        _pruning: Option<mirage_runtime::KvPruning>,
    ) -> Result<CudaKvCache> {
        Err(no())
    }
    fn kv_set_pruning(
        &self,
        _cache: &mut CudaKvCache,
        _pruning: Option<mirage_runtime::KvPruning>,
    ) -> Result<()> {
        Err(no())
    }
    fn kv_truncate(&self, _cache: &mut CudaKvCache, _seq: usize, _pos: usize) {}
    fn new_activations(&self) -> CudaActivations {
        CudaActivations(())
    }
    fn embed(&self, _t: &CudaMatrix, _tokens: &[u32], _out: &mut CudaActivations) -> Result<()> {
        Err(no())
    }
    fn rms_norm(
        &self,
        _x: &CudaActivations,
        _w: &CudaVector,
        _eps: f32,
        _out: &mut CudaActivations,
    ) -> Result<()> {
        Err(no())
    }
    fn matmul(
        &self,
        _w: &CudaMatrix,
        _x: &CudaActivations,
        _out: &mut CudaActivations,
    ) -> Result<()> {
        Err(no())
    }
    fn add_bias(&self, _x: &mut CudaActivations, _b: &CudaVector) -> Result<()> {
        Err(no())
    }
    fn add(&self, _acc: &mut CudaActivations, _x: &CudaActivations) -> Result<()> {
        Err(no())
    }
    fn attention(
        &self,
        _layer: usize,
        _p: &AttentionParams,
        _q: &mut CudaActivations,
        _k: &mut CudaActivations,
        _v: &CudaActivations,
        _qk_norm: Option<QkNorm<'_, CudaVector>>,
        _slots: &[TokenSlot],
        _cache: &mut CudaKvCache,
        _out: &mut CudaActivations,
    ) -> Result<()> {
        Err(no())
    }
    fn ffn(&self, _f: &CudaFfn, _x: &CudaActivations, _out: &mut CudaActivations) -> Result<()> {
        Err(no())
    }
    fn select_rows(
        &self,
        _x: &CudaActivations,
        _rows: &[usize],
        _out: &mut CudaActivations,
    ) -> Result<()> {
        Err(no())
    }
    fn read(&self, _x: &CudaActivations, _out: &mut Vec<f32>) -> Result<(usize, usize)> {
        Err(no())
    }
}
