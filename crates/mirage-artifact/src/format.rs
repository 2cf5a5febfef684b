//! The artifact file: writer and validating, memory-mapped loader. The byte
//! layout is specified in docs/ARTIFACT.md; keep the two in step.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use mirage_gguf::resident::FileBytes;
use mirage_gguf::{quant, FileMemory, GgmlType};
use mirage_route::RouterData;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{ArtifactError, Result};

/// File magic.
pub const MAGIC: &[u8; 8] = b"MIRAGEAF";
/// Format version this code writes and reads.
pub const VERSION: u32 = 1;
/// Channels per page.
pub const PAGE_CHANNELS: usize = 128;
/// Alignment of sections and of every page (bytes).
pub const PAGE_ALIGN: usize = 4096;
/// Header bytes before the section table.
pub const HEADER_BYTES: usize = 96;
/// Bytes per section-table entry.
pub const SECTION_ENTRY_BYTES: usize = 64;
/// Section names, in file order.
pub const SECTIONS: [&str; 6] = ["META", "LAYERS", "WEIGHTS", "ROUTER", "PREDICT", "CALIB"];

/// Self-description of an artifact (the META section, JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactMeta {
    /// Architecture name of the source model (`llama`, `qwen2`, ...).
    pub arch: String,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub d_model: usize,
    /// FFN channels of the source model.
    pub n_ff: usize,
    /// Channels per page.
    pub page_channels: usize,
    /// File name of the source GGUF.
    pub source_name: String,
    /// sha256 of the source GGUF (hex).
    pub source_sha256: String,
    /// Name of the calibration text.
    pub calib_name: String,
    /// sha256 of the calibration text (hex).
    pub calib_sha256: String,
    /// Calibration tokens used (fit + validation).
    pub calib_tokens: usize,
    /// Of those, tokens the router and predictor were fitted on (the rest
    /// chose the default margin and threshold).
    pub fit_tokens: usize,
    /// Router slices (3-D points per token).
    pub slices: usize,
    /// Rank of the low-rank predictor baseline.
    pub predictor_rank: usize,
    /// Oracle cosine target the calibration used.
    pub oracle_cosine: f64,
    /// Default router margin (in units of each slice axis' std).
    pub default_margin: f32,
    /// Default predictor score threshold.
    pub default_predictor_threshold: f32,
}

/// One layer of an artifact, in memory (what the builder produces and the
/// loader parses, except the page bytes).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerData {
    /// Pages stored (trunk first, then routed pages by decreasing hotness).
    pub n_pages: usize,
    /// Always-on pages (the first `n_trunk`).
    pub n_trunk: usize,
    /// Quantization of this layer's pages.
    pub quant: GgmlType,
    /// Source channel of each stored channel (`n_pages * PAGE_CHANNELS`).
    pub perm: Vec<u32>,
    /// Per page: share of calibration tokens whose oracle set held it.
    pub page_freq: Vec<f32>,
    /// Router data over the stored pages, with tight (margin 0) boxes.
    pub router: RouterData,
    /// Per slice and axis: the unit the margin is measured in (std of the
    /// calibration points).
    pub margin_scale: Vec<f32>,
    /// Predictor: `rank` rows of `d_model` (the feature projection).
    pub predictor_proj: Vec<f32>,
    /// Predictor: per page `rank + 1` weights (last one the bias).
    pub predictor_weights: Vec<f32>,
    /// Per source channel: mean |h| on calibration text.
    pub channel_mean_abs: Vec<f32>,
    /// Per source channel: share of calibration tokens whose oracle set held
    /// the channel's page.
    pub channel_oracle_freq: Vec<f32>,
}

/// Bytes of one packed page of `d_model`-wide rows in `ty`.
pub fn page_bytes(ty: GgmlType, d_model: usize) -> Result<usize> {
    if !d_model.is_multiple_of(ty.block_size()) {
        return Err(ArtifactError::QuantUnsupported {
            ty,
            d_model,
            block: ty.block_size(),
        });
    }
    Ok(3 * PAGE_CHANNELS * quant::row_bytes(ty, d_model)?)
}

/// Distance between page starts (page bytes rounded up to [`PAGE_ALIGN`]).
pub fn page_stride(ty: GgmlType, d_model: usize) -> Result<usize> {
    Ok(page_bytes(ty, d_model)?.div_ceil(PAGE_ALIGN) * PAGE_ALIGN)
}

pub(crate) fn align(n: usize) -> usize {
    n.div_ceil(PAGE_ALIGN) * PAGE_ALIGN
}

fn put_u32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put_u64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put_f32s(v: &mut Vec<u8>, xs: &[f32]) {
    for x in xs {
        v.extend_from_slice(&x.to_le_bytes());
    }
}

/// Serializes an artifact. `pages[l]` holds layer `l`'s packed pages, each
/// exactly [`page_bytes`] long, in stored order.
pub fn write_bytes(
    meta: &ArtifactMeta,
    layers: &[LayerData],
    pages: &[Vec<Vec<u8>>],
) -> Result<Vec<u8>> {
    if layers.len() != meta.n_layer || pages.len() != meta.n_layer {
        return Err(ArtifactError::InvalidArgument(
            "one LayerData and page list per layer".into(),
        ));
    }
    let source_sha: [u8; 32] = hex::decode(&meta.source_sha256)
        .ok()
        .and_then(|v| v.try_into().ok())
        .ok_or_else(|| {
            ArtifactError::InvalidArgument("source_sha256 is not 64 hex digits".into())
        })?;
    let meta_json = serde_json::to_vec_pretty(meta)
        .map_err(|e| ArtifactError::InvalidArgument(e.to_string()))?;
    // WEIGHTS and LAYERS together: page offsets are relative to WEIGHTS.
    let mut weights = Vec::new();
    let mut layer_sec = Vec::new();
    for (l, (ld, lp)) in layers.iter().zip(pages).enumerate() {
        let pb = page_bytes(ld.quant, meta.d_model)?;
        let stride = page_stride(ld.quant, meta.d_model)?;
        if lp.len() != ld.n_pages
            || ld.perm.len() != ld.n_pages * PAGE_CHANNELS
            || ld.page_freq.len() != ld.n_pages
        {
            return Err(ArtifactError::InvalidArgument(format!(
                "layer {l}: page count mismatch"
            )));
        }
        let offset = weights.len();
        for p in lp {
            if p.len() != pb {
                return Err(ArtifactError::InvalidArgument(format!(
                    "layer {l}: page of {} bytes, want {pb}",
                    p.len()
                )));
            }
            weights.extend_from_slice(p);
            weights.resize(align(weights.len()), 0);
        }
        debug_assert_eq!(weights.len(), offset + stride * ld.n_pages);
        put_u32(&mut layer_sec, ld.n_pages as u32);
        put_u32(&mut layer_sec, ld.n_trunk as u32);
        put_u32(&mut layer_sec, ld.quant.id());
        put_u32(&mut layer_sec, 0);
        put_u64(&mut layer_sec, offset as u64);
        put_u64(&mut layer_sec, stride as u64);
        for c in &ld.perm {
            put_u32(&mut layer_sec, *c);
        }
        put_f32s(&mut layer_sec, &ld.page_freq);
    }
    let mut router = Vec::new();
    let mut predict = Vec::new();
    let mut calib = Vec::new();
    for ld in layers {
        let rb = ld.router.to_bytes();
        put_u64(&mut router, rb.len() as u64);
        router.extend_from_slice(&rb);
        put_f32s(&mut router, &ld.margin_scale);
        put_u32(&mut predict, meta.predictor_rank as u32);
        put_u32(&mut predict, ld.n_pages as u32);
        put_f32s(&mut predict, &ld.predictor_proj);
        put_f32s(&mut predict, &ld.predictor_weights);
        put_f32s(&mut calib, &ld.channel_mean_abs);
        put_f32s(&mut calib, &ld.channel_oracle_freq);
    }
    Ok(write_container(
        VERSION,
        &source_sha,
        &SECTIONS,
        &[&meta_json, &layer_sec, &weights, &router, &predict, &calib],
    ))
}

/// Lays out serialized section bodies (in [`SECTIONS`] order) as a
/// page-major artifact file ([`write_container`]). [`write_bytes`]
/// serializes the sections and calls this; tests and the fuzzer call it to
/// build files whose checksums pass around contents that do not.
pub fn assemble(source_sha256: &[u8; 32], bodies: [&[u8]; 6]) -> Vec<u8> {
    write_container(VERSION, source_sha256, &SECTIONS, &bodies)
}

/// Serializes a container: the header (magic, `version`, section count,
/// `source_sha`, header checksum), the section table and the sections,
/// each [`PAGE_ALIGN`]-aligned with its sha256. Every artifact kind uses it.
pub(crate) fn write_container(
    version: u32,
    source_sha: &[u8; 32],
    names: &[&str],
    bodies: &[&[u8]],
) -> Vec<u8> {
    let table_end = HEADER_BYTES + SECTION_ENTRY_BYTES * bodies.len();
    let mut out = vec![0u8; table_end];
    out[..8].copy_from_slice(MAGIC);
    out[8..12].copy_from_slice(&version.to_le_bytes());
    out[12..16].copy_from_slice(&(bodies.len() as u32).to_le_bytes());
    out[16..48].copy_from_slice(source_sha);
    for (i, body) in bodies.iter().enumerate() {
        out.resize(align(out.len()), 0);
        let e = HEADER_BYTES + SECTION_ENTRY_BYTES * i;
        let mut name = [0u8; 8];
        name[..names[i].len()].copy_from_slice(names[i].as_bytes());
        out[e..e + 8].copy_from_slice(&name);
        let at = out.len() as u64;
        out[e + 8..e + 16].copy_from_slice(&at.to_le_bytes());
        out[e + 16..e + 24].copy_from_slice(&(body.len() as u64).to_le_bytes());
        out[e + 24..e + 56].copy_from_slice(&Sha256::digest(body));
        out.extend_from_slice(body);
    }
    let h = Sha256::digest(&out[..table_end]);
    out[48..80].copy_from_slice(&h);
    out
}

/// The source sha256 and the section bodies of an artifact's bytes, as
/// the section table places them, without checking checksums or contents
/// (`None` when the header or table does not fit): the inverse of
/// [`assemble`], for tests and the fuzzer.
pub fn sections(bytes: &[u8]) -> Option<([u8; 32], [&[u8]; 6])> {
    let table_end = HEADER_BYTES + SECTION_ENTRY_BYTES * SECTIONS.len();
    if bytes.len() < table_end {
        return None;
    }
    let sha: [u8; 32] = bytes[16..48].try_into().ok()?;
    let mut out = [&bytes[..0]; 6];
    for (i, slot) in out.iter_mut().enumerate() {
        let e = HEADER_BYTES + SECTION_ENTRY_BYTES * i;
        let off = u64::from_le_bytes(bytes[e + 8..e + 16].try_into().ok()?);
        let len = u64::from_le_bytes(bytes[e + 16..e + 24].try_into().ok()?);
        let end = off.checked_add(len)?;
        *slot = bytes.get(usize::try_from(off).ok()?..usize::try_from(end).ok()?)?;
    }
    Some((sha, out))
}

/// Writes `bytes` to `path` atomically ([`mirage_gguf::atomic::AtomicFile`]:
/// a locked temporary in the same folder, synced, then renamed over
/// `path`; a temporary left by a killed writer goes on the next write).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |e| ArtifactError::io(path, e);
    let mut out = mirage_gguf::atomic::AtomicFile::create(path).map_err(io)?;
    out.file().write_all(bytes).map_err(io)?;
    out.commit().map_err(io)
}

/// Format version of activation-sparsity artifacts (channel-major
/// projections, thresholds, allocation plans; `activation::format`).
pub const ACTIVATION_VERSION: u32 = 3;

/// The kind of artifact a version number names.
pub(crate) fn kind_of_version(v: u32) -> &'static str {
    match v {
        VERSION => "a page-major artifact (sparse FFN pages, `--artifact` with the page router)",
        ACTIVATION_VERSION => "an activation-sparsity artifact (`--sparsity`)",
        _ => "an artifact of an unknown kind",
    }
}

/// The format version in the header of the artifact file at `path` (to
/// tell the two kinds apart before loading one).
pub fn peek_version(path: &Path) -> Result<u32> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| ArtifactError::io(path, e))?;
    let mut head = [0u8; 12];
    let n = f.read(&mut head).map_err(|e| ArtifactError::io(path, e))?;
    if n < 8 || &head[..8] != MAGIC {
        return Err(ArtifactError::BadMagic);
    }
    if n < 12 {
        return Err(ArtifactError::Truncated {
            what: "header".into(),
            need: HEADER_BYTES as u64,
            have: n as u64,
        });
    }
    Ok(u32::from_le_bytes(head[8..12].try_into().expect("4")))
}

/// Validates a container written by [`write_container`] and returns its
/// sections' bytes: magic, version (`want`; the other kind is named in the
/// error), section names and count, bounds, alignment, every checksum.
pub(crate) fn read_container<'a>(b: &'a [u8], want: u32, names: &[&str]) -> Result<Vec<&'a [u8]>> {
    let have = b.len() as u64;
    if b.len() < 8 || &b[..8] != MAGIC {
        return Err(ArtifactError::BadMagic);
    }
    if b.len() < HEADER_BYTES {
        return Err(ArtifactError::Truncated {
            what: "header".into(),
            need: HEADER_BYTES as u64,
            have,
        });
    }
    let version = u32::from_le_bytes(b[8..12].try_into().expect("4"));
    if version != want {
        if version == VERSION || version == ACTIVATION_VERSION {
            return Err(ArtifactError::WrongKind {
                found: kind_of_version(version),
                expected: kind_of_version(want),
            });
        }
        return Err(ArtifactError::UnsupportedVersion {
            found: version,
            supported: want,
        });
    }
    let n_sections = u32::from_le_bytes(b[12..16].try_into().expect("4")) as usize;
    if n_sections != names.len() {
        return Err(ArtifactError::Malformed(format!(
            "{n_sections} sections, version {want} has {}",
            names.len()
        )));
    }
    let table_end = HEADER_BYTES + SECTION_ENTRY_BYTES * n_sections;
    if b.len() < table_end {
        return Err(ArtifactError::Truncated {
            what: "section table".into(),
            need: table_end as u64,
            have,
        });
    }
    let mut head = b[..table_end].to_vec();
    head[48..80].fill(0);
    if Sha256::digest(&head)[..] != b[48..80] {
        return Err(ArtifactError::ChecksumMismatch {
            section: "header".into(),
        });
    }
    let mut sections: Vec<&[u8]> = Vec::new();
    for (i, want) in names.iter().enumerate() {
        let e = HEADER_BYTES + SECTION_ENTRY_BYTES * i;
        let name = &b[e..e + 8];
        if &name[..want.len()] != want.as_bytes() || name[want.len()..].iter().any(|&c| c != 0) {
            return Err(ArtifactError::Malformed(format!(
                "section {i} is not {want}"
            )));
        }
        let off = u64::from_le_bytes(b[e + 8..e + 16].try_into().expect("8"));
        let len = u64::from_le_bytes(b[e + 16..e + 24].try_into().expect("8"));
        let end = off
            .checked_add(len)
            .ok_or_else(|| ArtifactError::Malformed(format!("{want}: size overflows")))?;
        if end > have {
            return Err(ArtifactError::Truncated {
                what: format!("section {want}"),
                need: end,
                have,
            });
        }
        if off % PAGE_ALIGN as u64 != 0 {
            return Err(ArtifactError::Malformed(format!(
                "{want} is not {PAGE_ALIGN}-aligned"
            )));
        }
        let body = &b[off as usize..end as usize];
        if Sha256::digest(body)[..] != b[e + 24..e + 56] {
            return Err(ArtifactError::ChecksumMismatch {
                section: (*want).into(),
            });
        }
        sections.push(body);
    }
    Ok(sections)
}

/// Where an artifact's bytes live.
pub(crate) enum Storage {
    /// The file, mapped or read into memory.
    File(FileBytes),
    /// Bytes in memory.
    Owned(Vec<u8>),
}

impl Storage {
    /// `path`, held as `memory` says.
    pub(crate) fn open(path: &Path, memory: FileMemory) -> Result<Storage> {
        // Artifacts are written atomically (rename), so a mapped file is
        // never rewritten in place.
        let bytes = FileBytes::open(path, memory).map_err(|e| ArtifactError::io(path, e))?;
        Ok(Storage::File(bytes))
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Storage::File(m) => m,
            Storage::Owned(v) => v,
        }
    }

    pub(crate) fn memory(&self) -> FileMemory {
        match self {
            Storage::File(m) => m.memory(),
            Storage::Owned(_) => FileMemory::Mapped,
        }
    }
}

/// Where one layer's pages lie in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRange {
    /// File offset of page 0.
    pub offset: usize,
    /// Distance between pages.
    pub stride: usize,
    /// Bytes of one page.
    pub bytes: usize,
}

/// A loaded, validated artifact (memory-mapped when opened from a file).
pub struct Artifact {
    storage: Storage,
    meta: ArtifactMeta,
    layers: Vec<LayerData>,
    pages: Vec<PageRange>,
}

impl std::fmt::Debug for Artifact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Artifact")
            .field("meta", &self.meta)
            .field("bytes", &self.storage.bytes().len())
            .finish()
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    what: &'static str,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| {
                ArtifactError::Malformed(format!(
                    "{} section ends early (needs {} more bytes at {})",
                    self.what, n, self.at
                ))
            })?;
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
        // A saturated count (a hostile META) fails `take` like any count
        // larger than the section.
        let bytes = self.take(n.saturating_mul(4))?;
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

/// The META values are untrusted until they agree with the section sizes;
/// everything the loader sizes by them is bounded here first. Each layer
/// takes at least 32 bytes of LAYERS; CALIB holds exactly `2 * n_ff` f32 per
/// layer; each layer's router projection holds `slices * 3 * d_model` f32
/// and its predictor `predictor_rank * d_model`.
fn check_meta_against_sections(meta: &ArtifactMeta, sections: &[&[u8]]) -> Result<()> {
    let bad = |m: String| Err(ArtifactError::Malformed(m));
    let (layers, router, predict, calib) = (
        sections[1].len(),
        sections[3].len(),
        sections[4].len(),
        sections[5].len(),
    );
    if meta.page_channels != PAGE_CHANNELS {
        return bad(format!(
            "META page_channels {} (this reader knows {PAGE_CHANNELS})",
            meta.page_channels
        ));
    }
    if meta.n_layer == 0 || meta.n_layer > layers / 32 {
        return bad(format!(
            "META n_layer {} does not fit the LAYERS section ({layers} bytes, at least 32 a layer)",
            meta.n_layer
        ));
    }
    if meta.n_ff == 0 || !meta.n_ff.is_multiple_of(PAGE_CHANNELS) {
        return bad(format!(
            "META n_ff {} is not a positive multiple of {PAGE_CHANNELS}",
            meta.n_ff
        ));
    }
    let calib_want = meta
        .n_ff
        .checked_mul(8)
        .and_then(|x| x.checked_mul(meta.n_layer));
    if calib_want != Some(calib) {
        return bad(format!(
            "META n_ff {} x n_layer {} does not match the CALIB section ({calib} bytes, 8 a channel)",
            meta.n_ff, meta.n_layer
        ));
    }
    if meta.slices == 0 || meta.slices > router / 12 {
        return bad(format!(
            "META slices {} does not fit the ROUTER section ({router} bytes)",
            meta.slices
        ));
    }
    let per_layer_router = meta.slices * 12 * meta.n_layer;
    if meta.d_model == 0 || meta.d_model > router / per_layer_router {
        return bad(format!(
            "META d_model {} does not fit the ROUTER section ({router} bytes for {} layers of {} slices)",
            meta.d_model, meta.n_layer, meta.slices
        ));
    }
    let predict_want = meta
        .predictor_rank
        .checked_mul(meta.d_model)
        .and_then(|x| x.checked_mul(4 * meta.n_layer));
    if predict_want.is_none_or(|w| w > predict) {
        return bad(format!(
            "META predictor_rank {} x d_model {} does not fit the PREDICT section ({predict} bytes)",
            meta.predictor_rank, meta.d_model
        ));
    }
    Ok(())
}

impl Artifact {
    /// Memory-maps and validates an artifact file.
    pub fn open(path: impl AsRef<Path>) -> Result<Arc<Artifact>> {
        Artifact::open_with(path, FileMemory::Mapped)
    }

    /// Validates an artifact file held as `memory` says.
    pub fn open_with(path: impl AsRef<Path>, memory: FileMemory) -> Result<Arc<Artifact>> {
        Ok(Arc::new(Artifact::parse(Storage::open(
            path.as_ref(),
            memory,
        )?)?))
    }

    /// How the artifact's bytes are held.
    pub fn memory(&self) -> FileMemory {
        self.storage.memory()
    }

    /// Validates an artifact held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Arc<Artifact>> {
        Ok(Arc::new(Artifact::parse(Storage::Owned(bytes))?))
    }

    fn parse(storage: Storage) -> Result<Artifact> {
        let b = storage.bytes();
        let sections = read_container(b, VERSION, &SECTIONS)?;
        let meta: ArtifactMeta = serde_json::from_slice(sections[0])
            .map_err(|e| ArtifactError::Malformed(format!("META: {e}")))?;
        if hex::encode(&b[16..48]) != meta.source_sha256 {
            return Err(ArtifactError::Malformed(
                "header and META disagree on the source sha256".into(),
            ));
        }
        check_meta_against_sections(&meta, &sections)?;
        let (d, n_ff, slices) = (meta.d_model, meta.n_ff, meta.slices);
        let weights_off = (sections[2].as_ptr() as usize) - (b.as_ptr() as usize);
        let mut lr = Reader {
            b: sections[1],
            at: 0,
            what: "LAYERS",
        };
        let mut rr = Reader {
            b: sections[3],
            at: 0,
            what: "ROUTER",
        };
        let mut pr = Reader {
            b: sections[4],
            at: 0,
            what: "PREDICT",
        };
        let mut cr = Reader {
            b: sections[5],
            at: 0,
            what: "CALIB",
        };
        let mut layers = Vec::with_capacity(meta.n_layer);
        let mut pages = Vec::with_capacity(meta.n_layer);
        for l in 0..meta.n_layer {
            let bad = |m: String| ArtifactError::Malformed(format!("layer {l}: {m}"));
            let n_pages = lr.u32()? as usize;
            let n_trunk = lr.u32()? as usize;
            let qid = lr.u32()?;
            let _reserved = lr.u32()?;
            let offset = lr.u64()? as usize;
            let stride = lr.u64()? as usize;
            let quant = GgmlType::from_id(qid)
                .ok_or_else(|| bad(format!("unknown quant type id {qid}")))?;
            if n_pages.saturating_mul(PAGE_CHANNELS) > n_ff || n_trunk > n_pages {
                return Err(bad(format!(
                    "{n_pages} pages / {n_trunk} trunk for n_ff {n_ff}"
                )));
            }
            let pb = page_bytes(quant, d)?;
            if stride != page_stride(quant, d)? || !offset.is_multiple_of(PAGE_ALIGN) {
                return Err(bad(format!(
                    "page stride {stride} / offset {offset} not aligned packing of {pb}-byte pages"
                )));
            }
            if stride
                .checked_mul(n_pages)
                .and_then(|b| offset.checked_add(b))
                .is_none_or(|e| e > sections[2].len())
            {
                return Err(bad("pages lie outside WEIGHTS".into()));
            }
            let perm: Vec<u32> = lr
                .take(n_pages * PAGE_CHANNELS * 4)?
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
                .collect();
            let mut seen = vec![false; n_ff];
            for &c in &perm {
                if c as usize >= n_ff || std::mem::replace(&mut seen[c as usize], true) {
                    return Err(bad(format!("channel {c} out of range or repeated")));
                }
            }
            let page_freq = lr.f32s(n_pages)?;
            let rlen = rr.u64()? as usize;
            let router = RouterData::from_bytes(rr.take(rlen)?)?;
            if router.pages() != n_pages || router.d_model != d || router.slices != slices {
                return Err(bad(format!(
                    "router has {} pages/d_model {}/{} slices",
                    router.pages(),
                    router.d_model,
                    router.slices
                )));
            }
            let margin_scale = rr.f32s(slices.saturating_mul(3))?;
            let rank = pr.u32()? as usize;
            let pp = pr.u32()? as usize;
            if rank != meta.predictor_rank || pp != n_pages {
                return Err(bad(format!("predictor rank {rank} / pages {pp}")));
            }
            let predictor_proj = pr.f32s(rank.saturating_mul(d))?;
            let predictor_weights = pr.f32s(n_pages.saturating_mul(rank.saturating_add(1)))?;
            let channel_mean_abs = cr.f32s(n_ff)?;
            let channel_oracle_freq = cr.f32s(n_ff)?;
            layers.push(LayerData {
                n_pages,
                n_trunk,
                quant,
                perm,
                page_freq,
                router,
                margin_scale,
                predictor_proj,
                predictor_weights,
                channel_mean_abs,
                channel_oracle_freq,
            });
            pages.push(PageRange {
                offset: weights_off + offset,
                stride,
                bytes: pb,
            });
        }
        lr.done()?;
        rr.done()?;
        pr.done()?;
        cr.done()?;
        Ok(Artifact {
            storage,
            meta,
            layers,
            pages,
        })
    }

    /// The self-description.
    pub fn meta(&self) -> &ArtifactMeta {
        &self.meta
    }

    /// Layer `l`'s tables.
    pub fn layer(&self, l: usize) -> &LayerData {
        &self.layers[l]
    }

    /// All layers.
    pub fn layers(&self) -> &[LayerData] {
        &self.layers
    }

    /// Packed bytes of page `p` of layer `l`: gate rows, up rows, then the
    /// transposed down slice, `PAGE_CHANNELS` rows of `d_model` each.
    pub fn page(&self, l: usize, p: usize) -> &[u8] {
        let r = self.pages[l];
        &self.storage.bytes()[r.offset + p * r.stride..][..r.bytes]
    }

    /// Layer `l`'s pages `0..k` as one contiguous range (with alignment
    /// padding between pages): what prefix slicing hands a dense kernel.
    pub fn page_prefix(&self, l: usize, k: usize) -> &[u8] {
        let r = self.pages[l];
        &self.storage.bytes()[r.offset..r.offset + k * r.stride]
    }

    /// Where layer `l`'s pages lie.
    pub fn page_range(&self, l: usize) -> PageRange {
        self.pages[l]
    }

    /// Size of the file.
    pub fn file_len(&self) -> usize {
        self.storage.bytes().len()
    }

    /// Layer `l`'s router data with every box inflated by `margin` times the
    /// layer's per-axis scale.
    pub fn router_with_margin(&self, l: usize, margin: f32) -> RouterData {
        let ld = &self.layers[l];
        let mut r = ld.router.clone();
        let s = r.slices;
        for (i, b) in r.boxes.iter_mut().enumerate() {
            let slice = i % s;
            for a in 0..3 {
                let m = margin * ld.margin_scale[slice * 3 + a];
                b.min[a] -= m;
                b.max[a] += m;
            }
        }
        r
    }

    /// Refuses a model other than the one the artifact was built from: its
    /// sha256 must be the recorded one, and its hyperparameters (checked
    /// against its tensors) must have the META's architecture, layer count
    /// and widths. The hash alone is not enough: a file's META is as
    /// untrusted as its pages.
    pub fn check_source(&self, model: &mirage_gguf::GgufFile) -> Result<()> {
        self.check_source_sha256(&sha256_hex(model.as_bytes()))?;
        let hp = model.hparams()?;
        let m = &self.meta;
        let theirs = (hp.arch.name(), hp.n_layer, hp.n_embd, hp.n_ff);
        if (m.arch.as_str(), m.n_layer, m.d_model, m.n_ff) != theirs {
            return Err(ArtifactError::Malformed(format!(
                "META says {} with n_layer {}, d_model {}, n_ff {}; the model is {} with n_layer {}, d_model {}, n_ff {}",
                m.arch, m.n_layer, m.d_model, m.n_ff, theirs.0, theirs.1, theirs.2, theirs.3
            )));
        }
        Ok(())
    }

    /// Refuses a model whose sha256 differs from the one the artifact was
    /// built from.
    pub fn check_source_sha256(&self, sha256_hex: &str) -> Result<()> {
        check_sha256(&self.meta.source_sha256, sha256_hex)
    }
}

/// [`ArtifactError::SourceMismatch`] unless a model's sha256 (hex) is the
/// one an artifact was built from.
pub(crate) fn check_sha256(expected: &str, found: &str) -> Result<()> {
    if found != expected {
        return Err(ArtifactError::SourceMismatch {
            expected: expected.into(),
            found: found.into(),
        });
    }
    Ok(())
}

/// sha256 (hex) of a file's bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}
