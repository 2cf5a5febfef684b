//! The activation-sparsity artifact (format version 3, spec in
//! docs/ARTIFACT.md): the seven projections of every layer and the lm head
//! in the channel-major layout, each matrix's column norms and score
//! quantiles per criterion, and allocation plans (per-matrix sparsities for
//! a grid of model-wide targets, with the calibration perplexity of each).
//! Same container as the page-major kind (header, checksummed sections).

use std::path::Path;
use std::sync::Arc;

use mirage_gguf::quant::channel_major::ChannelMajorLayout;
use mirage_gguf::{FileMemory, GgmlType};
use serde::{Deserialize, Serialize};

use super::fit::head_index;
use super::{matrix_index, Criterion, Proj, SparsityTarget};
use crate::error::{ArtifactError, Result};
use crate::format::{
    align, read_container, write_container, Storage, ACTIVATION_VERSION, PAGE_ALIGN,
};

/// Section names, in file order.
pub const SECTIONS: [&str; 5] = ["META", "MATRICES", "WEIGHTS", "SCORES", "PLANS"];

/// Quantile levels per matrix and criterion: thresholds at sparsity
/// `k / QUANTILE_LEVELS` for `k = 0..=QUANTILE_LEVELS`.
pub const QUANTILE_LEVELS: usize = 200;

/// How a plan spreads a model-wide target over the matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Allocation {
    /// Every projection at the same sparsity (the head dense).
    Uniform,
    /// TEAL's block-wise greedy: every layer at the same sparsity, its
    /// projections as its greedy path has them there (the head dense).
    BlockGreedy,
    /// Every projection's sparsity by least predicted loss per byte
    /// (measured sensitivity times error energy; the head dense).
    Sensitivity,
    /// As [`Allocation::Sensitivity`], the lm head included.
    SensitivityHead,
}

impl Allocation {
    /// Name users type and tables print.
    pub fn name(self) -> &'static str {
        match self {
            Allocation::Uniform => "uniform",
            Allocation::BlockGreedy => "block-greedy",
            Allocation::Sensitivity => "sensitivity",
            Allocation::SensitivityHead => "sensitivity+head",
        }
    }
}

/// One plan's description (META); its table lives in PLANS.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanMeta {
    /// Unique name (`wina/layer-sensitivity`, ...).
    pub name: String,
    /// Score the thresholds use.
    pub criterion: Criterion,
    /// How the target is spread.
    pub allocation: Allocation,
    /// Model-wide targets of the rows (shares of the bytes of every
    /// projection and the head skipped), ascending, the first 0.
    pub targets: Vec<f32>,
}

/// Self-description (the META section, JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActivationMeta {
    /// Always `activation`.
    pub kind: String,
    /// Architecture of the source model.
    pub arch: String,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub d_model: usize,
    /// FFN channels.
    pub n_ff: usize,
    /// File name of the source GGUF.
    pub source_name: String,
    /// The source tensor the lm head reads (`output.weight`, or
    /// `token_embd.weight` when tied).
    pub head_tensor: String,
    /// sha256 of the source GGUF (hex).
    pub source_sha256: String,
    /// Name of the calibration text.
    pub calib_name: String,
    /// sha256 of the calibration text (hex).
    pub calib_sha256: String,
    /// Calibration tokens whose scores gave the quantiles.
    pub calib_tokens: usize,
    /// Calibration tokens the perplexities were measured on.
    pub ppl_tokens: usize,
    /// Dense perplexity on those tokens (the same masked graph, no mask).
    pub dense_calib_ppl: f64,
    /// The plans, in PLANS order.
    pub plans: Vec<PlanMeta>,
    /// The plan an unnamed `--sparsity` runs where the plans measured on the
    /// calibration text tie or none is measured (`ActivationArtifact::resolve`).
    pub default_plan: String,
}

/// Where one projection lies in WEIGHTS.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatrixEntry {
    /// Its layout (type, shape).
    pub layout: ChannelMajorLayout,
    /// File offset of its bytes.
    pub offset: usize,
}

/// One matrix's score statistics (SCORES).
#[derive(Debug, Clone, PartialEq)]
pub struct MatrixScores {
    /// `||W[:, i]||` per input channel (the dequantized source).
    pub col_norms: Vec<f32>,
    /// Per criterion ([`Criterion::ALL`] order): the score at sparsity
    /// `k / QUANTILE_LEVELS`, `k = 0..=QUANTILE_LEVELS`, non-decreasing.
    pub quantiles: [Vec<f32>; 2],
}

/// A plan's table (PLANS): per target row, each matrix's sparsity and the
/// calibration perplexity measured there (NaN: not measured).
#[derive(Debug, Clone, PartialEq)]
pub struct PlanTable {
    /// `rows[r][matrix_index]`.
    pub rows: Vec<Vec<f32>>,
    /// Calibration perplexity per row.
    pub ppl: Vec<f32>,
}

/// Everything a build produces besides the weights.
#[derive(Debug, Clone)]
pub struct ActivationContents {
    /// META.
    pub meta: ActivationMeta,
    /// Per matrix index (the head last).
    pub scores: Vec<MatrixScores>,
    /// Per plan (META order).
    pub plans: Vec<PlanTable>,
}

/// Serializes an activation artifact: `matrices[matrix_index]` holds the
/// matrix's channel-major bytes and layout (the head last).
pub fn write_bytes(
    c: &ActivationContents,
    matrices: &[(ChannelMajorLayout, Vec<u8>)],
) -> Result<Vec<u8>> {
    let n = c.meta.n_layer * Proj::ALL.len() + 1;
    if matrices.len() != n || c.scores.len() != n || c.plans.len() != c.meta.plans.len() {
        return Err(ArtifactError::InvalidArgument(
            "one matrix and score entry per projection, one table per plan".into(),
        ));
    }
    let source_sha: [u8; 32] = hex::decode(&c.meta.source_sha256)
        .ok()
        .and_then(|v| v.try_into().ok())
        .ok_or_else(|| {
            ArtifactError::InvalidArgument("source_sha256 is not 64 hex digits".into())
        })?;
    let meta = serde_json::to_vec_pretty(&c.meta)
        .map_err(|e| ArtifactError::InvalidArgument(e.to_string()))?;
    let (mut table, mut weights) = (Vec::new(), Vec::new());
    for (layout, bytes) in matrices {
        if bytes.len() != layout.bytes() {
            return Err(ArtifactError::InvalidArgument(
                "matrix bytes do not match the layout".into(),
            ));
        }
        let off = weights.len();
        weights.extend_from_slice(bytes);
        weights.resize(align(weights.len()), 0);
        for v in [
            layout.ty().id(),
            layout.rows() as u32,
            layout.cols() as u32,
            layout.tile() as u32,
        ] {
            table.extend_from_slice(&v.to_le_bytes());
        }
        table.extend_from_slice(&(off as u64).to_le_bytes());
        table.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    }
    let mut scores = Vec::new();
    for s in &c.scores {
        put_f32s(&mut scores, &s.col_norms);
        for q in &s.quantiles {
            if q.len() != QUANTILE_LEVELS + 1 {
                return Err(ArtifactError::InvalidArgument(
                    "quantile table length".into(),
                ));
            }
            put_f32s(&mut scores, q);
        }
    }
    let mut plans = Vec::new();
    for (pm, t) in c.meta.plans.iter().zip(&c.plans) {
        if t.rows.len() != pm.targets.len() || t.ppl.len() != pm.targets.len() {
            return Err(ArtifactError::InvalidArgument(format!(
                "plan {}: {} rows for {} targets",
                pm.name,
                t.rows.len(),
                pm.targets.len()
            )));
        }
        for r in &t.rows {
            if r.len() != n {
                return Err(ArtifactError::InvalidArgument("plan row length".into()));
            }
            put_f32s(&mut plans, r);
        }
        put_f32s(&mut plans, &t.ppl);
    }
    Ok(write_container(
        ACTIVATION_VERSION,
        &source_sha,
        &SECTIONS,
        &[&meta, &table, &weights, &scores, &plans],
    ))
}

fn put_f32s(v: &mut Vec<u8>, xs: &[f32]) {
    for x in xs {
        v.extend_from_slice(&x.to_le_bytes());
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
    what: &'static str,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| ArtifactError::Malformed(format!("{} section ends early", self.what)))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn f32s(&mut self, n: usize) -> Result<Vec<f32>> {
        let bytes = self.take(
            n.checked_mul(4)
                .ok_or_else(|| ArtifactError::Malformed("size overflow".into()))?,
        )?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
            .collect())
    }
    fn done(&self) -> Result<()> {
        if self.at != self.b.len() {
            return Err(ArtifactError::Malformed(format!(
                "{} section has {} trailing bytes",
                self.what,
                self.b.len() - self.at
            )));
        }
        Ok(())
    }
}

/// A loaded, validated activation artifact (memory-mapped from a file).
pub struct ActivationArtifact {
    storage: Storage,
    meta: ActivationMeta,
    matrices: Vec<MatrixEntry>,
    scores: Vec<MatrixScores>,
    plans: Vec<PlanTable>,
}

impl std::fmt::Debug for ActivationArtifact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivationArtifact")
            .field("source", &self.meta.source_name)
            .field("bytes", &self.storage.bytes().len())
            .finish()
    }
}

/// What [`ActivationArtifact::resolve`] chose for a [`SparsityTarget`].
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedSparsity {
    /// The plan.
    pub plan: String,
    /// How the plan was chosen.
    pub choice: PlanChoice,
    /// Model-wide sparsity (parameter-weighted over the projections).
    pub sparsity: f32,
    /// Calibration perplexity there, when measured (else NaN).
    pub calib_ppl: f64,
    /// Dense calibration perplexity.
    pub dense_calib_ppl: f64,
    /// Per matrix index (the head last): its sparsity.
    pub per_matrix: Vec<f32>,
}

/// How [`ActivationArtifact::resolve`] came to its plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanChoice {
    /// The caller named it.
    Named,
    /// None named: of the plans with a measured calibration perplexity
    /// at the target, the lowest one (a fixed sparsity), or the one that
    /// reaches the highest sparsity within the budget.
    Calibration,
    /// None named and no plan has a measured calibration perplexity at the
    /// target: the artifact's default plan.
    ArtifactDefault,
}

impl PlanChoice {
    /// Words for logs and tables.
    pub fn describe(self) -> &'static str {
        match self {
            PlanChoice::Named => "named",
            PlanChoice::Calibration => "chosen by calibration perplexity",
            PlanChoice::ArtifactDefault => "the artifact's default",
        }
    }
}

impl ActivationArtifact {
    /// Memory-maps and validates an activation artifact.
    pub fn open(path: impl AsRef<Path>) -> Result<Arc<ActivationArtifact>> {
        ActivationArtifact::open_with(path, FileMemory::Mapped)
    }

    /// Validates an activation artifact held as `memory` says (the CPU
    /// decode reads it best resident: [`mirage_gguf::resident`]).
    pub fn open_with(
        path: impl AsRef<Path>,
        memory: FileMemory,
    ) -> Result<Arc<ActivationArtifact>> {
        Ok(Arc::new(ActivationArtifact::parse(Storage::open(
            path.as_ref(),
            memory,
        )?)?))
    }

    /// How the artifact's bytes are held.
    pub fn memory(&self) -> FileMemory {
        self.storage.memory()
    }

    /// Validates an activation artifact held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Arc<ActivationArtifact>> {
        Ok(Arc::new(ActivationArtifact::parse(Storage::Owned(bytes))?))
    }

    fn parse(storage: Storage) -> Result<ActivationArtifact> {
        let b = storage.bytes();
        let sec = read_container(b, ACTIVATION_VERSION, &SECTIONS)?;
        let meta: ActivationMeta = serde_json::from_slice(sec[0])
            .map_err(|e| ArtifactError::Malformed(format!("META: {e}")))?;
        if meta.kind != "activation" {
            return Err(ArtifactError::Malformed(format!(
                "META kind `{}`",
                meta.kind
            )));
        }
        if hex::encode(&b[16..48]) != meta.source_sha256 {
            return Err(ArtifactError::Malformed(
                "header and META disagree on the source sha256".into(),
            ));
        }
        if meta.n_layer == 0 || meta.n_layer > 4096 {
            return Err(ArtifactError::Malformed(format!("{} layers", meta.n_layer)));
        }
        let n = meta.n_layer * Proj::ALL.len() + 1;
        let weights_off = sec[2].as_ptr() as usize - b.as_ptr() as usize;
        let mut mc = Cursor {
            b: sec[1],
            at: 0,
            what: "MATRICES",
        };
        let mut matrices = Vec::with_capacity(n);
        for m in 0..n {
            let bad = |s: String| ArtifactError::Malformed(format!("matrix {m}: {s}"));
            let (ty, rows, cols, tile) = (
                mc.u32()?,
                mc.u32()? as usize,
                mc.u32()? as usize,
                mc.u32()? as usize,
            );
            let (off, len) = (mc.u64()? as usize, mc.u64()? as usize);
            let ty = GgmlType::from_id(ty).ok_or_else(|| bad(format!("unknown type id {ty}")))?;
            let layout = ChannelMajorLayout::with_tile(ty, rows, cols, tile)
                .map_err(|e| bad(e.to_string()))?;
            if len != layout.bytes()
                || off % PAGE_ALIGN != 0
                || off.checked_add(len).is_none_or(|e| e > sec[2].len())
            {
                return Err(bad(format!(
                    "{len} bytes at {off} do not fit WEIGHTS or the layout"
                )));
            }
            matrices.push(MatrixEntry {
                layout,
                offset: weights_off + off,
            });
        }
        mc.done()?;
        let mut sc = Cursor {
            b: sec[3],
            at: 0,
            what: "SCORES",
        };
        let mut scores = Vec::with_capacity(n);
        for e in &matrices {
            let col_norms = sc.f32s(e.layout.cols())?;
            let q0 = sc.f32s(QUANTILE_LEVELS + 1)?;
            let q1 = sc.f32s(QUANTILE_LEVELS + 1)?;
            scores.push(MatrixScores {
                col_norms,
                quantiles: [q0, q1],
            });
        }
        sc.done()?;
        let mut pc = Cursor {
            b: sec[4],
            at: 0,
            what: "PLANS",
        };
        let mut plans = Vec::with_capacity(meta.plans.len());
        for pm in &meta.plans {
            if pm.targets.is_empty()
                || pm.targets[0] != 0.0
                || pm.targets.windows(2).any(|w| w[1] <= w[0])
                || pm.targets.iter().any(|t| !(0.0..1.0).contains(t))
            {
                return Err(ArtifactError::Malformed(format!(
                    "plan {}: targets must rise from 0 and stay below 1",
                    pm.name
                )));
            }
            let rows = (0..pm.targets.len())
                .map(|_| pc.f32s(n))
                .collect::<Result<Vec<_>>>()?;
            let ppl = pc.f32s(pm.targets.len())?;
            plans.push(PlanTable { rows, ppl });
        }
        pc.done()?;
        if !meta.plans.iter().any(|p| p.name == meta.default_plan) {
            return Err(ArtifactError::Malformed(format!(
                "default plan `{}` is not among the plans",
                meta.default_plan
            )));
        }
        Ok(ActivationArtifact {
            storage,
            meta,
            matrices,
            scores,
            plans,
        })
    }

    /// The self-description.
    pub fn meta(&self) -> &ActivationMeta {
        &self.meta
    }
    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }
    /// Size of the file.
    pub fn file_len(&self) -> usize {
        self.storage.bytes().len()
    }
    /// Projection `p` of layer `l`.
    pub fn matrix(&self, l: usize, p: Proj) -> Option<MatrixEntry> {
        (l < self.meta.n_layer).then(|| self.matrices[matrix_index(l, p)])
    }
    /// The lm head.
    pub fn head(&self) -> MatrixEntry {
        self.matrices[head_index(self.meta.n_layer)]
    }
    /// Every matrix, by matrix index (the head last).
    pub fn matrices(&self) -> &[MatrixEntry] {
        &self.matrices
    }
    /// The channel-major bytes of projection `p` of layer `l`.
    pub fn matrix_bytes(&self, l: usize, p: Proj) -> Option<&[u8]> {
        let e = self.matrix(l, p)?;
        Some(&self.storage.bytes()[e.offset..e.offset + e.layout.bytes()])
    }
    /// Score statistics per matrix index (the head last).
    pub fn scores(&self) -> &[MatrixScores] {
        &self.scores
    }
    /// The plan named `name` (its META and table).
    pub fn plan(&self, name: &str) -> Option<(&PlanMeta, &PlanTable)> {
        let i = self.plan_index(name)?;
        Some((&self.meta.plans[i], &self.plans[i]))
    }

    /// Refuses a model whose sha256 differs from the source's.
    pub fn check_source_sha256(&self, sha256_hex: &str) -> Result<()> {
        crate::format::check_sha256(&self.meta.source_sha256, sha256_hex)
    }

    /// The per-matrix sparsities of a plan for `target`: a fixed
    /// model-wide sparsity (rows interpolated linearly; above the highest
    /// stored target is refused), or the highest stored target such that it
    /// and every smaller one keep the calibration perplexity within the
    /// budget (refused when not even the smallest non-zero target does).
    ///
    /// `plan` names the plan; `None` chooses per target on the calibration
    /// text: for a fixed sparsity the plan with the lowest (interpolated)
    /// calibration perplexity there, for a budget the plan reaching the
    /// highest sparsity within it (ties: the lower perplexity, then the
    /// artifact's default plan). Plans without measured perplexities are
    /// not candidates; where no plan has one, the default plan runs.
    pub fn resolve(&self, plan: Option<&str>, target: SparsityTarget) -> Result<ResolvedSparsity> {
        let target = target.validate()?;
        if let Some(name) = plan {
            let i = self.plan_index(name).ok_or_else(|| {
                ArtifactError::InvalidArgument(format!(
                    "no plan `{name}` in this artifact (it has {})",
                    self.meta
                        .plans
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            return self.resolve_plan(i, target, PlanChoice::Named);
        }
        let default = self
            .plan_index(&self.meta.default_plan)
            .expect("validated at load");
        // The default first, so that it wins ties.
        let order = std::iter::once(default).chain((0..self.plans.len()).filter(|&i| i != default));
        let mut best: Option<ResolvedSparsity> = None;
        for i in order {
            let Ok(r) = self.resolve_plan(i, target, PlanChoice::Calibration) else {
                continue;
            };
            if !r.calib_ppl.is_finite() {
                continue;
            }
            let better = best.as_ref().is_none_or(|b| match target {
                SparsityTarget::Fixed(_) => r.calib_ppl < b.calib_ppl,
                SparsityTarget::MaxPplIncrease(_) => {
                    r.sparsity > b.sparsity
                        || (r.sparsity == b.sparsity && r.calib_ppl < b.calib_ppl)
                }
            });
            if better {
                best = Some(r);
            }
        }
        match best {
            Some(r) => Ok(r),
            None => self.resolve_plan(default, target, PlanChoice::ArtifactDefault),
        }
    }

    fn plan_index(&self, name: &str) -> Option<usize> {
        self.meta.plans.iter().position(|p| p.name == name)
    }

    /// [`ActivationArtifact::resolve`] within plan `i`.
    fn resolve_plan(
        &self,
        i: usize,
        target: SparsityTarget,
        choice: PlanChoice,
    ) -> Result<ResolvedSparsity> {
        let (pm, t) = (&self.meta.plans[i], &self.plans[i]);
        let name = pm.name.as_str();
        let dense = self.meta.dense_calib_ppl;
        let (sparsity, per_matrix, ppl) = match target {
            SparsityTarget::Fixed(s) => {
                let last = *pm.targets.last().expect("validated non-empty");
                if s > last + 1e-6 {
                    return Err(ArtifactError::InvalidArgument(format!(
                        "sparsity {s} is above the highest target plan `{name}` stores ({last})"
                    )));
                }
                let r = pm.targets.partition_point(|&x| x <= s).max(1) - 1;
                if r + 1 >= pm.targets.len() || (pm.targets[r] - s).abs() < 1e-6 {
                    (s, t.rows[r].clone(), t.ppl[r] as f64)
                } else {
                    let (a, b) = (pm.targets[r], pm.targets[r + 1]);
                    let w = (s - a) / (b - a);
                    let row = t.rows[r]
                        .iter()
                        .zip(&t.rows[r + 1])
                        .map(|(x, y)| x + w * (y - x))
                        .collect();
                    let ppl = t.ppl[r] as f64 + w as f64 * (t.ppl[r + 1] as f64 - t.ppl[r] as f64);
                    (s, row, ppl)
                }
            }
            SparsityTarget::MaxPplIncrease(budget) => {
                let limit = dense * (1.0 + budget as f64);
                // The targets up to the first one over the budget (a noisy
                // dip of the measured perplexity further up is not trusted).
                let best = (1..pm.targets.len())
                    .take_while(|&r| (t.ppl[r] as f64) <= limit)
                    .last();
                match best {
                    Some(r) => (pm.targets[r], t.rows[r].clone(), t.ppl[r] as f64),
                    None => {
                        let first = (1..pm.targets.len()).find(|&r| t.ppl[r].is_finite());
                        return Err(ArtifactError::InvalidArgument(match first {
                            Some(r) => format!(
                                "no sparsity meets a perplexity increase of {:.2} %: the smallest stored target ({}) already costs {:+.2} % on the calibration text",
                                100.0 * budget,
                                pm.targets[r],
                                100.0 * (t.ppl[r] as f64 / dense - 1.0)
                            ),
                            None => format!(
                                "plan `{name}` has no measured calibration perplexity to meet a budget with"
                            ),
                        }));
                    }
                }
            }
        };
        Ok(ResolvedSparsity {
            plan: name.to_string(),
            choice,
            sparsity,
            calib_ppl: ppl,
            dense_calib_ppl: dense,
            per_matrix,
        })
    }

    /// Per-channel thresholds of every matrix for per-matrix sparsities
    /// under `criterion` (`None` where the sparsity is 0: every channel).
    pub fn thresholds(&self, criterion: Criterion, per_matrix: &[f32]) -> Vec<Option<Vec<f32>>> {
        self.scores
            .iter()
            .zip(per_matrix)
            .map(|(s, &sp)| thresholds_for(s, criterion, sp))
            .collect()
    }
}

/// The score at sparsity `s` of a quantile table (linear between levels).
pub fn quantile_at(q: &[f32], s: f32) -> f32 {
    let levels = q.len() - 1;
    let x = (s.clamp(0.0, 1.0) * levels as f32).min(levels as f32);
    let k = (x.floor() as usize).min(levels - 1);
    let w = x - k as f32;
    q[k] + w * (q[k + 1] - q[k])
}

/// Per-channel thresholds of one matrix at sparsity `s` (`None` at 0).
pub fn thresholds_for(s: &MatrixScores, criterion: Criterion, sparsity: f32) -> Option<Vec<f32>> {
    if sparsity <= 0.0 {
        return None;
    }
    let ci = Criterion::ALL
        .iter()
        .position(|&c| c == criterion)
        .expect("in ALL");
    let tau = quantile_at(&s.quantiles[ci], sparsity);
    Some(match criterion {
        Criterion::Teal => vec![tau; s.col_norms.len()],
        Criterion::Wina => s
            .col_norms
            .iter()
            .map(|&n| if n > 0.0 { tau / n } else { f32::INFINITY })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-layer artifact of tiny Q8_0 matrices with three plans over
    /// targets 0, 0.1, 0.2, 0.3 (`c/z`: to 0.5): `a/x` and `b/y` with
    /// calibration perplexities that cross between 0.1 and 0.2 (at 1/6),
    /// `c/z` unmeasured. Every matrix of a plan's row holds `target * k`
    /// (k = 1, 2, 3 per plan), so a result shows which plan it came from.
    fn crossing() -> Arc<ActivationArtifact> {
        let n = Proj::ALL.len() + 1;
        let layout = ChannelMajorLayout::new(GgmlType::Q8_0, 128, 32).unwrap();
        let matrices = vec![(layout, vec![0u8; layout.bytes()]); n];
        let scores = vec![
            MatrixScores {
                col_norms: vec![1.0; 32],
                quantiles: [
                    vec![0.0; QUANTILE_LEVELS + 1],
                    vec![0.0; QUANTILE_LEVELS + 1],
                ],
            };
            n
        ];
        let plan = |name: &str, criterion, targets: &[f32], k: f32, ppl: &[f32]| {
            (
                PlanMeta {
                    name: name.into(),
                    criterion,
                    allocation: Allocation::SensitivityHead,
                    targets: targets.to_vec(),
                },
                PlanTable {
                    rows: targets.iter().map(|t| vec![t * k; n]).collect(),
                    ppl: ppl.to_vec(),
                },
            )
        };
        let grid = [0.0, 0.1, 0.2, 0.3];
        let (metas, tables): (Vec<_>, Vec<_>) = [
            plan(
                "a/x",
                Criterion::Teal,
                &grid,
                1.0,
                &[10.0, 10.1, 10.5, 12.0],
            ),
            plan(
                "b/y",
                Criterion::Wina,
                &grid,
                2.0,
                &[10.0, 10.3, 10.4, 11.0],
            ),
            plan(
                "c/z",
                Criterion::Teal,
                &[0.0, 0.1, 0.3, 0.5],
                3.0,
                &[f32::NAN; 4],
            ),
        ]
        .into_iter()
        .unzip();
        let meta = ActivationMeta {
            kind: "activation".into(),
            arch: "llama".into(),
            n_layer: 1,
            d_model: 32,
            n_ff: 32,
            source_name: "tiny.gguf".into(),
            head_tensor: "output.weight".into(),
            source_sha256: "ab".repeat(32),
            calib_name: "calib".into(),
            calib_sha256: "cd".repeat(32),
            calib_tokens: 8,
            ppl_tokens: 8,
            dense_calib_ppl: 10.0,
            plans: metas,
            default_plan: "b/y".into(),
        };
        let c = ActivationContents {
            meta,
            scores,
            plans: tables,
        };
        ActivationArtifact::from_bytes(write_bytes(&c, &matrices).unwrap()).unwrap()
    }

    fn fixed(a: &ActivationArtifact, plan: Option<&str>, s: f32) -> ResolvedSparsity {
        a.resolve(plan, SparsityTarget::Fixed(s)).unwrap()
    }

    fn budget(a: &ActivationArtifact, b: f32) -> Result<ResolvedSparsity> {
        a.resolve(None, SparsityTarget::MaxPplIncrease(b))
    }

    #[test]
    fn the_default_takes_the_lower_calibration_perplexity_per_target() {
        let a = crossing();
        // 0.16: a/x 10.34 < b/y 10.36; 0.17: a/x 10.38 > b/y 10.37.
        for (s, plan, k, ppl) in [
            (0.05, "a/x", 1.0, 10.05),
            (0.1, "a/x", 1.0, 10.1),
            (0.16, "a/x", 1.0, 10.34),
            (0.17, "b/y", 2.0, 10.37),
            (0.2, "b/y", 2.0, 10.4),
            (0.3, "b/y", 2.0, 11.0),
        ] {
            let r = fixed(&a, None, s);
            assert_eq!((r.plan.as_str(), r.choice), (plan, PlanChoice::Calibration));
            assert!((r.calib_ppl - ppl).abs() < 1e-4, "{s}: {}", r.calib_ppl);
            assert!(r.per_matrix.iter().all(|&m| (m - s * k).abs() < 1e-6));
        }
        // A tie (both dense at 0): the artifact's default.
        assert_eq!(fixed(&a, None, 0.0).plan, "b/y");
        // Only the unmeasured plan reaches 0.4: the default's refusal.
        let e = a
            .resolve(None, SparsityTarget::Fixed(0.4))
            .unwrap_err()
            .to_string();
        assert!(e.contains("above the highest target plan `b/y`"), "{e}");
    }

    #[test]
    fn a_budget_takes_the_plan_reaching_further() {
        let a = crossing();
        // +2 %: a/x reaches 0.1, b/y nothing.
        let r = budget(&a, 0.02).unwrap();
        assert_eq!((r.plan.as_str(), r.sparsity), ("a/x", 0.1));
        // +6 %: both reach 0.2; b/y's perplexity there is lower.
        let r = budget(&a, 0.06).unwrap();
        assert_eq!((r.plan.as_str(), r.sparsity), ("b/y", 0.2));
        // +12 %: b/y reaches 0.3, a/x stops at 0.2.
        let r = budget(&a, 0.12).unwrap();
        assert_eq!((r.plan.as_str(), r.sparsity), ("b/y", 0.3));
        assert_eq!(r.choice, PlanChoice::Calibration);
        assert!(r.per_matrix.iter().all(|&m| (m - 0.6).abs() < 1e-6));
        // +0.5 %: no plan meets it.
        let e = budget(&a, 0.005).unwrap_err().to_string();
        assert!(e.contains("no sparsity meets"), "{e}");
    }

    #[test]
    fn a_named_plan_is_honoured() {
        let a = crossing();
        let r = fixed(&a, Some("b/y"), 0.1);
        assert_eq!((r.plan.as_str(), r.choice), ("b/y", PlanChoice::Named));
        assert!(r.per_matrix.iter().all(|&m| (m - 0.2).abs() < 1e-6));
        let r = fixed(&a, Some("c/z"), 0.4);
        assert_eq!(r.plan, "c/z");
        assert!(r.calib_ppl.is_nan());
        assert!(r.per_matrix.iter().all(|&m| (m - 1.2).abs() < 1e-6));
        let r = a
            .resolve(Some("a/x"), SparsityTarget::MaxPplIncrease(0.12))
            .unwrap();
        assert_eq!((r.plan.as_str(), r.sparsity), ("a/x", 0.2));
        let e = a
            .resolve(Some("c/z"), SparsityTarget::MaxPplIncrease(0.5))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no measured calibration perplexity"), "{e}");
    }
}
