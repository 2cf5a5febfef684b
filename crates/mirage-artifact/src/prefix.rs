//! Prefix slicing as a plain dense model: the first `k` pages of every
//! layer's FFN (trunk first, then by hotness: the artifact's stored channel
//! order, or the source order for synthetic 128-channel pages) cut out of a
//! GGUF into a smaller GGUF whose FFN has exactly those channels, so that
//! any dense backend runs the prefix slice with its own dense kernels (the
//! second baseline of the sparse decode bench, beside the fused page
//! kernel's forced fractions).
//!
//! `ffn_gate` / `ffn_up` rows are whole channels and are copied verbatim in
//! the kept order. `ffn_down` keeps columns: in the source order with a
//! width of whole blocks of its type, each row's leading bytes are copied
//! verbatim; otherwise each row is decoded, gathered in the kept order and
//! re-encoded: float types as they are, quantized ones in Q8_0 (a page is
//! whole Q8_0 blocks; the artifact's pages are Q8_0 re-encodings too, and a
//! 4-bit re-encoding of gathered columns cost SmolLM2 a visible share of its
//! prefix-mode fidelity). `feed_forward_length` becomes the kept width.

use mirage_gguf::metadata::Value;
use mirage_gguf::quant::{dequantize, quantize};
use mirage_gguf::writer::GgufWriter;
use mirage_gguf::{GgmlType, GgufFile};

use crate::{Artifact, ArtifactError, Result, PAGE_CHANNELS};

/// Pages of `n` a forced fraction keeps: `ceil(fraction * n)`, at least one
/// (the rule every fixed-fraction mode shares: this slice, the CPU superblock
/// backend's `Prefix(k)` as the bench builds it and its `OracleTop`, the CUDA sparse backend).
pub fn pages_for_fraction(fraction: f32, n: usize) -> usize {
    // The tolerance keeps 0.4 * 70 (28.000000298 in f32) at 28 pages.
    ((fraction.clamp(0.0, 1.0) as f64 * n as f64 - 1e-4).ceil() as usize).clamp(1, n.max(1))
}

/// The order pages (and their channels) are kept in.
#[derive(Debug, Clone, Copy)]
pub enum ChannelOrder<'a> {
    /// Source channel order, [`PAGE_CHANNELS`] consecutive channels a page
    /// (synthetic pages: no calibration, no hotness).
    Source,
    /// The artifact's stored order (`LayerData::perm`: trunk first, then by
    /// decreasing hotness); the artifact must come from this model's shape.
    Artifact(&'a Artifact),
}

/// A prefix-sliced model.
#[derive(Debug)]
pub struct PrefixSlice {
    /// The sliced GGUF (in memory).
    pub file: GgufFile,
    /// Pages kept in every layer.
    pub pages: usize,
    /// Pages stored in every layer.
    pub total_pages: usize,
    /// Whether some `ffn_down` was re-encoded (not copied verbatim).
    pub requantized_down: bool,
}

fn invalid(msg: String) -> ArtifactError {
    ArtifactError::InvalidArgument(msg)
}

/// Slices `file` to the first `pages_for_fraction(fraction, n)` pages of
/// every layer in `order` (see the module doc). Every layer must store the
/// same number of pages (the dense model has one FFN width).
pub fn prefix_slice(
    file: &GgufFile,
    order: ChannelOrder<'_>,
    fraction: f32,
) -> Result<PrefixSlice> {
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(invalid(format!(
            "prefix fraction must be in (0, 1], got {fraction}"
        )));
    }
    let hp = file.hparams()?;
    let (d, n_ff, n_layer) = (hp.n_embd, hp.n_ff, hp.n_layer);
    let arch = hp.arch.name();
    if file.tensors().iter().any(|t| {
        t.name.starts_with("blk.") && t.name.contains(".ffn_") && t.name.ends_with(".bias")
    }) {
        return Err(invalid("prefix slicing does not handle FFN biases".into()));
    }
    let total_pages = match order {
        ChannelOrder::Source => {
            if n_ff % PAGE_CHANNELS != 0 {
                return Err(invalid(format!(
                    "n_ff {n_ff} is not a whole number of {PAGE_CHANNELS}-channel pages"
                )));
            }
            n_ff / PAGE_CHANNELS
        }
        ChannelOrder::Artifact(a) => {
            let m = a.meta();
            if m.n_layer != n_layer || m.d_model != d || m.n_ff != n_ff {
                return Err(invalid(format!(
                    "artifact shape (layers {}, d_model {}, n_ff {}) is not the model's ({n_layer}, {d}, {n_ff})",
                    m.n_layer, m.d_model, m.n_ff
                )));
            }
            let n = a.layer(0).n_pages;
            if let Some(l) = (0..n_layer).find(|&l| a.layer(l).n_pages != n) {
                return Err(invalid(format!(
                    "layer {l} stores {} pages, layer 0 {n}: a dense prefix slice needs one FFN width",
                    a.layer(l).n_pages
                )));
            }
            n
        }
    };
    let pages = pages_for_fraction(fraction, total_pages);
    let kept = pages * PAGE_CHANNELS;
    // Per layer: the kept source channels, in order.
    let channels = |l: usize| -> Result<Vec<usize>> {
        match order {
            ChannelOrder::Source => Ok((0..kept).collect()),
            ChannelOrder::Artifact(a) => {
                let perm = &a.layer(l).perm;
                let c: Vec<usize> = perm.iter().take(kept).map(|&c| c as usize).collect();
                if c.len() != kept || c.iter().any(|&c| c >= n_ff) {
                    return Err(invalid(format!(
                        "layer {l}: artifact channel order out of range"
                    )));
                }
                Ok(c)
            }
        }
    };
    let kept_channels = (0..n_layer).map(channels).collect::<Result<Vec<_>>>()?;
    let mut md = file.metadata().clone();
    md.insert(
        format!("{arch}.feed_forward_length"),
        Value::U32(kept as u32),
    );
    let mut w = GgufWriter::new(md);
    w.set_version(file.version())?;
    let mut requantized_down = false;
    for view in file.tensor_views() {
        let info = view.info;
        let name = info.name.as_str();
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|s| s.parse::<usize>().ok());
        let kind = ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
            .into_iter()
            .find(|k| name.ends_with(&format!(".{k}")));
        let (Some(l), Some(kind)) = (layer, kind) else {
            w.add_tensor(name, info.dims.clone(), info.ty, view.data)?;
            continue;
        };
        let keep = kept_channels
            .get(l)
            .ok_or_else(|| invalid(format!("{name}: block {l} is past block_count {n_layer}")))?;
        let ty = info.ty;
        if kind == "ffn_down.weight" {
            if info.dims != [n_ff as u64, d as u64] {
                return Err(invalid(format!(
                    "{name}: dims {:?}, expected [{n_ff}, {d}]",
                    info.dims
                )));
            }
            let row_in = bytes_for(ty, n_ff)?;
            let identity = keep.iter().enumerate().all(|(i, &c)| i == c);
            let (out_ty, data) = if identity && kept.is_multiple_of(ty.block_size()) {
                let row_out = bytes_for(ty, kept)?;
                let mut data = Vec::with_capacity(row_out * d);
                for r in 0..d {
                    data.extend_from_slice(&view.data[r * row_in..r * row_in + row_out]);
                }
                (ty, data)
            } else {
                requantized_down = true;
                let out_ty = match ty {
                    GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => ty,
                    _ => GgmlType::Q8_0,
                };
                let row_out = bytes_for(out_ty, kept)?;
                let mut data = vec![0u8; row_out * d];
                let (mut row, mut gathered) = (vec![0f32; n_ff], vec![0f32; kept]);
                for r in 0..d {
                    dequantize(ty, &view.data[r * row_in..(r + 1) * row_in], &mut row)?;
                    for (g, &c) in gathered.iter_mut().zip(keep) {
                        *g = row[c];
                    }
                    quantize(out_ty, &gathered, &mut data[r * row_out..(r + 1) * row_out])?;
                }
                (out_ty, data)
            };
            w.add_tensor(name, vec![kept as u64, d as u64], out_ty, data)?;
        } else {
            if info.dims != [d as u64, n_ff as u64] {
                return Err(invalid(format!(
                    "{name}: dims {:?}, expected [{d}, {n_ff}]",
                    info.dims
                )));
            }
            let row = bytes_for(ty, d)?;
            let mut data = Vec::with_capacity(row * kept);
            for &c in keep {
                data.extend_from_slice(&view.data[c * row..(c + 1) * row]);
            }
            w.add_tensor(name, vec![d as u64, kept as u64], ty, data)?;
        }
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes)?;
    Ok(PrefixSlice {
        file: GgufFile::from_bytes(bytes)?,
        pages,
        total_pages,
        requantized_down,
    })
}

fn bytes_for(ty: GgmlType, n: usize) -> Result<usize> {
    ty.bytes_for(n as u64)
        .map(|b| b as usize)
        .ok_or_else(|| invalid(format!("{n} values are not whole {ty} blocks")))
}
