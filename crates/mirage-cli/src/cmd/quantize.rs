//! `mirage-cli quantize IN OUT --type TYPE`: re-quantizes a GGUF file's
//! weight matrices (dequantize, then quantize with ggml's reference
//! quantizer), the way `llama-quantize` does for a pure type.
//!
//! Which tensors change: 2-D `*.weight` tensors that are not norms. Norms,
//! biases and every 1-D tensor are copied unchanged (they stay F32). A tensor
//! already of the target type is copied byte for byte. Where a row length is
//! not a multiple of the target's block size (K-quants need 256; 576 and 896
//! are not), the tensor falls back the way llama.cpp's `llama_tensor_get_type`
//! does: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and Q2_K/Q3_K -> Q5_0
//! (llama.cpp picks IQ4_NL there, which MIRAGE does not implement; Q5_0 is
//! the nearest legacy type that is at least as accurate).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use mirage_gguf::quant::{dequantize, quantize};
use mirage_gguf::{GgmlType, GgufFile, GgufWriter, TensorInfo, Value};
use rayon::prelude::*;

/// Arguments of `mirage-cli quantize`.
#[derive(Debug, clap::Args)]
pub struct QuantizeArgs {
    /// The source GGUF file.
    pub input: PathBuf,
    /// Where to write the re-quantized GGUF file (written to a temporary
    /// name beside it, then renamed).
    pub output: PathBuf,
    /// Target type of the weight matrices: q8_0, q4_0, q4_1, q5_0, q5_1,
    /// q2_k, q3_k, q4_k, q5_k, q6_k, f16, bf16 or f32.
    #[arg(long = "type", short = 't')]
    pub ty: String,
}

/// What happens to one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Copied unchanged (not a weight matrix, or already the target type).
    Keep,
    /// Re-quantized to this type.
    Convert(GgmlType),
}

/// The type llama.cpp falls back to when a row does not fit `target`'s block.
fn fallback(target: GgmlType) -> Option<GgmlType> {
    use GgmlType::*;
    match target {
        Q2_K | Q3_K | Q4_K => Some(Q5_0),
        Q5_K => Some(Q5_1),
        Q6_K => Some(Q8_0),
        _ => None,
    }
}

/// Whether a tensor is a weight matrix that quantization applies to.
fn is_weight_matrix(info: &TensorInfo) -> bool {
    info.dims.len() == 2 && info.name.ends_with(".weight") && !info.name.contains("norm")
}

/// Decides a tensor's fate; the second value says why a fallback was taken.
fn plan(info: &TensorInfo, target: GgmlType) -> (Plan, Option<String>) {
    if !is_weight_matrix(info) {
        return (Plan::Keep, None);
    }
    let row = info.row_len();
    let fits = |ty: GgmlType| row % ty.block_size() as u64 == 0;
    let (ty, note) = if fits(target) {
        (target, None)
    } else if let Some(fb) = fallback(target).filter(|fb| fits(*fb)) {
        let why = format!(
            "row length {row} is not a multiple of {target}'s block of {}: {fb} instead",
            target.block_size()
        );
        (fb, Some(why))
    } else {
        let why = format!(
            "row length {row} fits no block of {target}: kept as {}",
            info.ty
        );
        return (Plan::Keep, Some(why));
    };
    if ty == info.ty {
        (Plan::Keep, note)
    } else {
        (Plan::Convert(ty), note)
    }
}

/// Rows converted per parallel task: big enough to amortise the scratch
/// buffer, small enough to balance two cores on a 576-row matrix.
const ROWS_PER_TASK: usize = 16;

/// Dequantizes `src` (rows of `info.ty`) and quantizes it to `to`.
fn requantize(
    info: &TensorInfo,
    src: &[u8],
    to: GgmlType,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<u8>> {
    let row_len = usize::try_from(info.row_len())?;
    let src_row = mirage_gguf::quant::row_bytes(info.ty, row_len)?;
    let dst_row = mirage_gguf::quant::row_bytes(to, row_len)?;
    let n_rows = usize::try_from(info.n_rows())?;
    if src.len() != src_row * n_rows {
        bail!(
            "{}: {} data bytes, expected {}",
            info.name,
            src.len(),
            src_row * n_rows
        );
    }
    let mut out = vec![0u8; dst_row * n_rows];
    out.par_chunks_mut(dst_row * ROWS_PER_TASK)
        .zip(src.par_chunks(src_row * ROWS_PER_TASK))
        .try_for_each(|(dst, src)| -> anyhow::Result<()> {
            let rows = src.len() / src_row;
            let mut scratch = vec![0f32; rows * row_len];
            dequantize(info.ty, src, &mut scratch)?;
            quantize(to, &scratch, dst)?;
            bar.inc((rows * row_len) as u64);
            Ok(())
        })
        .with_context(|| format!("converting {} from {} to {to}", info.name, info.ty))?;
    Ok(out)
}

/// Runs `quantize`.
pub fn run(args: QuantizeArgs) -> anyhow::Result<()> {
    let target =
        GgmlType::from_name(&args.ty).with_context(|| format!("unknown type {:?}", args.ty))?;
    let file_type = super::file_type_of(target)
        .with_context(|| format!("{target} is an activation format, not a weight type"))?;
    let started = Instant::now();
    let input =
        GgufFile::open(&args.input).with_context(|| format!("reading {}", args.input.display()))?;

    let plans: Vec<(Plan, Option<String>)> =
        input.tensors().iter().map(|t| plan(t, target)).collect();
    let total: u64 = input
        .tensors()
        .iter()
        .zip(&plans)
        .filter(|(_, (p, _))| matches!(p, Plan::Convert(_)))
        .map(|(t, _)| t.n_elements())
        .sum();
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{msg:<32} [{bar:30}] {percent:>3}% eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );

    let mut metadata = input.metadata().clone();
    metadata.insert("general.file_type", Value::U32(file_type));
    let mut writer = GgufWriter::new(metadata);
    writer.set_version(input.version())?;

    // (from, to) -> tensor count, for the summary.
    let mut counts: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut notes: BTreeMap<String, usize> = BTreeMap::new();
    for (view, (plan, note)) in input.tensor_views().zip(plans) {
        let info = view.info;
        let data: Cow<'_, [u8]> = match plan {
            Plan::Keep => Cow::Borrowed(view.data),
            Plan::Convert(to) => {
                bar.set_message(info.name.clone());
                Cow::Owned(requantize(info, view.data, to, &bar)?)
            }
        };
        let to = match plan {
            Plan::Keep => info.ty,
            Plan::Convert(to) => to,
        };
        *counts
            .entry((info.ty.to_string(), to.to_string()))
            .or_default() += 1;
        if let Some(note) = note {
            *notes.entry(note).or_default() += 1;
        }
        writer
            .add_tensor(info.name.clone(), info.dims.clone(), to, data)
            .with_context(|| format!("adding {}", info.name))?;
    }
    bar.finish_and_clear();

    let written = writer
        .write_to_path(&args.output)
        .with_context(|| format!("writing {}", args.output.display()))?;
    println!(
        "wrote {} ({:.2} MiB, {} tensors, general.file_type {file_type}) in {:.1}s",
        args.output.display(),
        written as f64 / (1024.0 * 1024.0),
        input.tensors().len(),
        started.elapsed().as_secs_f64()
    );
    for ((from, to), n) in &counts {
        let verb = if from == to { "kept" } else { "converted" };
        println!("  {n:>4} tensors {verb:<9} {from} -> {to}");
    }
    for (note, n) in &notes {
        println!("  note: {n} tensors: {note}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, dims: &[u64], ty: GgmlType) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
            offset: 0,
        }
    }

    #[test]
    fn plans_follow_llama_cpp() {
        use GgmlType::*;
        let w = info("blk.0.ffn_up.weight", &[576, 1536], Q4_1);
        assert_eq!(plan(&w, Q8_0).0, Plan::Convert(Q8_0));
        // 576 is not a multiple of 256: Q4_K falls back to Q5_0, Q6_K to Q8_0.
        let (p, note) = plan(&w, Q4_K);
        assert_eq!(p, Plan::Convert(Q5_0));
        assert!(note.unwrap().contains("576"));
        assert_eq!(plan(&w, Q6_K).0, Plan::Convert(Q8_0));
        // 1536 is: ffn_down takes the K-quant.
        let down = info("blk.0.ffn_down.weight", &[1536, 576], Q4_1);
        assert_eq!(plan(&down, Q4_K), (Plan::Convert(Q4_K), None));
        // Norms and 1-D tensors stay as they are.
        assert_eq!(
            plan(&info("blk.0.attn_norm.weight", &[576], F32), Q8_0).0,
            Plan::Keep
        );
        assert_eq!(
            plan(&info("blk.0.attn_q.bias", &[896], F32), Q8_0).0,
            Plan::Keep
        );
        // Already the target type: copied verbatim.
        assert_eq!(
            plan(&info("token_embd.weight", &[576, 49152], Q8_0), Q8_0).0,
            Plan::Keep
        );
        // A row that fits no block at all is kept.
        let odd = info("odd.weight", &[100, 4], F32);
        assert_eq!(plan(&odd, Q4_0).0, Plan::Keep);
    }
}
