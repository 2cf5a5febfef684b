//! Weight upload: matrices in the layout their kernels read (the split
//! layouts of Q8_0, Q4_K, Q5_0 and Q6_K, NVFP4 when asked for, the file's
//! ggml blocks for the other types), vectors, and the embedding lookup that
//! reads a table in any of them.
//!
//! A split layout holds the same bytes as the ggml blocks, grouped by field
//! across the whole matrix (all quants, then all scales, ...), so that a
//! warp's wide loads cover whole 128-byte lines of one field; the block
//! sizes come from mirage-gguf's type table.

use cudarc::driver::CudaSlice;
use mirage_gguf::quant;
use mirage_gguf::GgmlType;
use mirage_runtime::backend::HostMatrix;
use mirage_runtime::{Result, RuntimeError};

use crate::backend::{bad, drv, CudaActivations, CudaBackend, MemKind};
use crate::launch::{Arg, Launch, Work};
use crate::WeightFormat;

/// How a matrix's bytes are laid out on the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Layout {
    /// The file's ggml blocks.
    Ggml,
    /// Split Q8_0: all quants `[rows][cols]`, then all f16 scales
    /// (`sparse::pages::split_q8_0_rows`).
    Q8Split,
    /// Split Q4_K: all super-blocks' 128 quant bytes `[rows][cols/2]`, then
    /// their 16 header bytes (d, dmin, packed scales) `[rows][cols/256][16]`.
    Q4KSplit,
    /// Split Q5_0: all blocks' 16 quant bytes `[rows][cols/2]`, then their
    /// 32-bit high-bit words `[rows][cols/32]`, then their f16 scales.
    Q5Split,
    /// Split Q6_K: all super-blocks' 128 ql bytes `[rows][cols/2]`, then
    /// their 64 qh bytes, then their 16 scales, then their f16 d.
    Q6KSplit,
    /// NVFP4 (the CPU codec's): packed codes `[rows][cols/2]`, then E4M3
    /// scales `[rows][cols/16]`, and this tensor scale.
    Nvfp4 { tensor_scale: f32 },
}

/// A weight matrix on the device.
#[derive(Debug)]
pub struct CudaMatrix {
    pub(crate) name: String,
    pub(crate) ty: GgmlType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_bytes: usize,
    pub(crate) layout: Layout,
    pub(crate) data: CudaSlice<u8>,
}

impl CudaMatrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Element type (as the file stores it).
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }
    /// Whether the matrix was requantized to NVFP4 at upload.
    pub fn is_nvfp4(&self) -> bool {
        matches!(self.layout, Layout::Nvfp4 { .. })
    }
    /// Whether the matrix sits in a split layout or NVFP4 rather than the
    /// file's ggml blocks.
    pub fn is_repacked(&self) -> bool {
        self.layout != Layout::Ggml
    }
    /// Kernel-name suffix of the mat-vecs (`mv3_*`, `ffn_*`), embedding and
    /// dequantization kernels that read it.
    pub(crate) fn suffix(&self) -> &'static str {
        match self.layout {
            Layout::Ggml => ggml_suffix(self.ty).expect("checked at upload"),
            Layout::Q8Split => "q8_0s",
            Layout::Q4KSplit => "q4_ks",
            Layout::Q5Split => "q5_0s",
            Layout::Q6KSplit => "q6_ks",
            Layout::Nvfp4 { .. } => "nvfp4",
        }
    }
    /// The NVFP4 tensor scale (0 for the other layouts).
    pub(crate) fn tensor_scale(&self) -> f32 {
        match self.layout {
            Layout::Nvfp4 { tensor_scale } => tensor_scale,
            _ => 0.0,
        }
    }
}

/// An f32 vector on the device.
#[derive(Debug)]
pub struct CudaVector {
    pub(crate) len: usize,
    pub(crate) data: CudaSlice<f32>,
}

/// One layer's FFN on the device.
#[derive(Debug)]
pub struct CudaFfn {
    pub(crate) gate: CudaMatrix,
    pub(crate) up: CudaMatrix,
    pub(crate) down: CudaMatrix,
}

/// Kernel-name suffix of a ggml type the kernels read in the file's blocks
/// (its llama.cpp name; `cuda/ggml.cu`'s `GGML_TYPES` row), `None` for the
/// others.
pub(crate) fn ggml_suffix(ty: GgmlType) -> Option<&'static str> {
    GGML_TYPES.contains(&ty).then(|| ty.name())
}

/// Every ggml type the kernels read in the file's blocks: the rows of
/// `cuda/ggml.cu`'s `GGML_TYPES` (checked by a test against that table and
/// mirage-gguf's).
pub(crate) const GGML_TYPES: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Suffixes of the split layouts and NVFP4.
pub(crate) const REPACKED_SUFFIXES: [&str; 5] = ["q8_0s", "q4_ks", "q5_0s", "q6_ks", "nvfp4"];

/// Regroups whole ggml blocks of `ty` field by field: each block is cut at
/// `fields` (byte lengths of its consecutive fields, summing to the block
/// size) and field `f` of every block is written, block after block, into
/// output span `order[f]` (spans laid out in `order`'s numbering, each
/// `n_blocks * fields[f]` bytes long).
fn split_fields(ty: GgmlType, ggml: &[u8], fields: &[usize], order: &[usize]) -> Vec<u8> {
    let bytes = ty.type_size();
    debug_assert_eq!(fields.iter().sum::<usize>(), bytes);
    let n = ggml.len() / bytes;
    let mut span_at = vec![0; fields.len()];
    let mut at = 0;
    for span in 0..fields.len() {
        let f = order
            .iter()
            .position(|&o| o == span)
            .expect("a permutation");
        span_at[f] = at;
        at += n * fields[f];
    }
    let mut out = vec![0u8; n * bytes];
    for (i, blk) in ggml.chunks_exact(bytes).enumerate() {
        let mut off = 0;
        for (f, &len) in fields.iter().enumerate() {
            let dst = span_at[f] + i * len;
            out[dst..dst + len].copy_from_slice(&blk[off..off + len]);
            off += len;
        }
    }
    out
}

/// Ggml Q6_K super-blocks (ql 128, qh 64, scales 16, f16 d) in the split
/// layout: every ql, then every qh, then every scales, then every d.
pub(crate) fn split_q6_k_rows(ggml: &[u8]) -> Vec<u8> {
    split_fields(GgmlType::Q6_K, ggml, &[128, 64, 16, 2], &[0, 1, 2, 3])
}

/// Ggml Q5_0 blocks (f16 d, 32-bit qh, 16 quant bytes) in the split layout:
/// every block's quants, then every qh word, then every d.
pub(crate) fn split_q5_0_rows(ggml: &[u8]) -> Vec<u8> {
    split_fields(GgmlType::Q5_0, ggml, &[2, 4, 16], &[2, 1, 0])
}

/// Ggml Q4_K super-blocks (16 header bytes: d, dmin, packed scales; then 128
/// quant bytes) in the split layout: every super-block's quants in order,
/// then every header. Row r's quants start at `r * cols / 2`, its headers at
/// `rows * cols / 2 + r * cols / 16`.
pub(crate) fn split_q4_k_rows(ggml: &[u8]) -> Vec<u8> {
    split_fields(GgmlType::Q4_K, ggml, &[16, 128], &[1, 0])
}

impl CudaBackend {
    /// Uploads `m` in the layout its kernels read (see the module doc).
    pub(crate) fn upload_host_matrix(&self, m: &HostMatrix) -> Result<CudaMatrix> {
        let row_bytes = quant::row_bytes(m.ty, m.cols)?;
        let bytes = m.data.as_slice();
        if bytes.len() != row_bytes * m.rows {
            return Err(bad(format!(
                "{}: {} bytes for {}x{} {}",
                m.name,
                bytes.len(),
                m.rows,
                m.cols,
                m.ty
            )));
        }
        if ggml_suffix(m.ty).is_none() {
            return Err(RuntimeError::UnsupportedType {
                backend: "cuda".into(),
                ty: m.ty,
                what: m.name.clone(),
            });
        }
        if !m.cols.is_multiple_of(32) {
            return Err(bad(format!(
                "{}: row length {} is not a multiple of 32",
                m.name, m.cols
            )));
        }
        // The embedding table and the lm head keep their type under NVFP4
        // (they set the logits' fidelity and are read once per token).
        let is_table = m.name == "token_embd.weight" || m.name == "output.weight";
        let repacked;
        let (layout, upload): (Layout, &[u8]) =
            if self.weight_format() == WeightFormat::Nvfp4 && !is_table {
                let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
                let t = quant::Nvfp4Tensor::requantize_parallel(
                    m.ty,
                    bytes,
                    &[m.cols as u64, m.rows as u64],
                    threads,
                )
                .map_err(|e| bad(format!("{}: NVFP4 requantization: {e}", m.name)))?;
                let mut v = t.packed;
                v.extend_from_slice(&t.block_scales);
                repacked = v;
                (
                    Layout::Nvfp4 {
                        tensor_scale: t.tensor_scale,
                    },
                    &repacked,
                )
            } else {
                match m.ty {
                    GgmlType::Q8_0 => {
                        repacked = crate::sparse::pages::split_q8_0_rows(bytes, m.rows, m.cols)
                            .map_err(|e| bad(format!("{}: {e}", m.name)))?;
                        (Layout::Q8Split, &repacked)
                    }
                    GgmlType::Q4_K => {
                        repacked = split_q4_k_rows(bytes);
                        (Layout::Q4KSplit, &repacked)
                    }
                    GgmlType::Q5_0 => {
                        repacked = split_q5_0_rows(bytes);
                        (Layout::Q5Split, &repacked)
                    }
                    GgmlType::Q6_K => {
                        repacked = split_q6_k_rows(bytes);
                        (Layout::Q6KSplit, &repacked)
                    }
                    _ => (Layout::Ggml, bytes),
                }
            };
        let data = self.stream.clone_htod(upload).map_err(drv)?;
        self.account(MemKind::Weights, upload.len());
        Ok(CudaMatrix {
            name: m.name.clone(),
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
            row_bytes,
            layout,
            data,
        })
    }

    pub(crate) fn upload_vector_f32(&self, v: &[f32]) -> Result<CudaVector> {
        let data = self.stream.clone_htod(v).map_err(drv)?;
        self.account(MemKind::Weights, v.len() * 4);
        Ok(CudaVector { len: v.len(), data })
    }

    pub(crate) fn upload_ffn_matrices(
        &self,
        gate: &HostMatrix,
        up: &HostMatrix,
        down: &HostMatrix,
    ) -> Result<CudaFfn> {
        if gate.rows != up.rows
            || gate.cols != up.cols
            || down.cols != gate.rows
            || down.rows != gate.cols
        {
            return Err(bad(format!(
                "FFN shapes disagree: gate {}x{}, up {}x{}, down {}x{}",
                gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols
            )));
        }
        Ok(CudaFfn {
            gate: self.upload_host_matrix(gate)?,
            up: self.upload_host_matrix(up)?,
            down: self.upload_host_matrix(down)?,
        })
    }

    /// `out[r] = table[tokens[r]]` as f32, from a table in any layout.
    pub(crate) fn embed_rows(
        &self,
        table: &CudaMatrix,
        tokens: &[u32],
        out: &mut CudaActivations,
    ) -> Result<()> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(bad(format!("token id {t} >= vocabulary {}", table.rows)));
        }
        let po = self.reshape(out, tokens.len(), table.cols)?;
        let pt = match self.staged(|s| (s.tokens == tokens).then_some(s.base))? {
            Some(p) => p,
            None => {
                let mut s = self.scratch();
                self.upload_u32(&mut s.indices, tokens)?
            }
        };
        let (rows, cols) = (Arg::I32(table.rows as i32), Arg::I32(table.cols as i32));
        let mut args = vec![Arg::Ptr(self.ptr(&table.data))];
        match table.layout {
            Layout::Ggml => args.extend([Arg::I64(table.row_bytes as i64), rows, cols]),
            Layout::Nvfp4 { tensor_scale } => args.extend([rows, cols, Arg::F32(tensor_scale)]),
            _ => args.extend([rows, cols]),
        }
        args.extend([Arg::Ptr(pt), Arg::Ptr(po)]);
        self.push_launch(Launch {
            kernel: self.kernels.index(&format!("embed_{}", table.suffix()))?,
            grid: (tokens.len() as u32, 1, 1),
            block: (128, 1, 1),
            smem: 0,
            work: Work::Plain(args),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The field-wise regrouping is the layouts the kernels document: every
    /// block's fields at their place in the split matrix.
    #[test]
    fn split_layouts_group_each_field_block_after_block() {
        let blocks = 3;
        let q6: Vec<u8> = (0..blocks * 210).map(|i| (i % 251) as u8).collect();
        let s = split_q6_k_rows(&q6);
        for b in 0..blocks {
            let blk = &q6[b * 210..(b + 1) * 210];
            assert_eq!(&s[b * 128..(b + 1) * 128], &blk[..128]);
            assert_eq!(&s[blocks * 128 + b * 64..][..64], &blk[128..192]);
            assert_eq!(&s[blocks * 192 + b * 16..][..16], &blk[192..208]);
            assert_eq!(&s[blocks * 208 + b * 2..][..2], &blk[208..]);
        }
        let q5: Vec<u8> = (0..blocks * 22).map(|i| (i % 241) as u8).collect();
        let s = split_q5_0_rows(&q5);
        for b in 0..blocks {
            let blk = &q5[b * 22..(b + 1) * 22];
            assert_eq!(&s[b * 16..(b + 1) * 16], &blk[6..]);
            assert_eq!(&s[blocks * 16 + b * 4..][..4], &blk[2..6]);
            assert_eq!(&s[blocks * 20 + b * 2..][..2], &blk[..2]);
        }
        let q4: Vec<u8> = (0..blocks * 144).map(|i| (i % 239) as u8).collect();
        let s = split_q4_k_rows(&q4);
        for b in 0..blocks {
            let blk = &q4[b * 144..(b + 1) * 144];
            assert_eq!(&s[b * 128..(b + 1) * 128], &blk[16..]);
            assert_eq!(&s[blocks * 128 + b * 16..][..16], &blk[..16]);
        }
    }
}
