//! `mirage-cli quantize IN OUT TYPE`: re-quantizes a GGUF file's weight
//! matrices (dequantize, then quantize with ggml's reference quantizer) the
//! way `llama-quantize` does: TYPE is one of llama.cpp's mixes (`q4_k_m`,
//! `q5_k_m`, `q6_k`, `q8_0`) or a single ggml type for every weight matrix
//! (`q4_0`, `q4_k`, `f16`, ...). Which tensor gets which type is
//! [`mirage_gguf::quant_mix`]'s business; this module reads, converts and
//! writes (to a temporary name, then renamed), and refuses to write over
//! its input.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use indicatif::ProgressBar;
use mirage_gguf::quant::{dequantize, quantize};
use mirage_gguf::quant_mix::{is_weight_matrix, plan_model, LayerOrder, Plan, Target};
use mirage_gguf::{GgmlType, GgufFile, GgufWriter, TensorInfo, Value};
use rayon::prelude::*;

/// Arguments of `mirage-cli quantize`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["type_pos", "ty"])))]
pub struct QuantizeArgs {
    /// The source GGUF file.
    pub input: PathBuf,
    /// Where to write the re-quantized GGUF file (written to a temporary
    /// name beside it, then renamed; never the input file).
    pub output: PathBuf,
    /// Target, as llama-quantize takes it: a preset mixing types per tensor as llama.cpp does
    /// (q4_k_m, q5_k_m, q6_k, q8_0) or one type for every weight matrix (q4_0, q4_1, q5_0,
    /// q5_1, q2_k, q3_k, q4_k, q5_k, f16, bf16, f32).
    #[arg(value_name = "TYPE")]
    pub type_pos: Option<String>,
    /// The same as TYPE, as a flag.
    #[arg(long = "type", value_name = "TYPE", conflicts_with = "type_pos")]
    pub ty: Option<String>,
    /// Print the type each tensor would get (`name: FROM -> TO`) and write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Worker threads (0: one per CPU).
    #[arg(short = 't', long, default_value_t = 0, value_parser = super::generate::parse_threads)]
    pub threads: usize,
}

/// Fails when `output` names the same file as `input` (the same path, a
/// symlink to it or a hard link): the output is renamed over its path, and
/// losing the source to a typo is not recoverable.
fn refuse_same_file(input: &Path, output: &Path) -> anyhow::Result<()> {
    let (Ok(a), Ok(b)) = (std::fs::metadata(input), std::fs::metadata(output)) else {
        // No output file yet (or no input, reported when it is opened).
        return Ok(());
    };
    #[cfg(unix)]
    let same = {
        use std::os::unix::fs::MetadataExt;
        a.dev() == b.dev() && a.ino() == b.ino()
    };
    #[cfg(not(unix))]
    let same = {
        let _ = (a, b);
        std::fs::canonicalize(input)? == std::fs::canonicalize(output)?
    };
    if same {
        bail!(
            "refusing to overwrite the input: {} is the same file as {}; choose another output path",
            output.display(),
            input.display()
        );
    }
    Ok(())
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
    let asked = args
        .type_pos
        .as_deref()
        .or(args.ty.as_deref())
        .unwrap_or_default();
    let target = Target::parse(asked)?;
    refuse_same_file(&args.input, &args.output)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build()
        .context("starting the worker threads")?;
    pool.install(|| quantize_file(&args, target))
}

fn quantize_file(args: &QuantizeArgs, target: Target) -> anyhow::Result<()> {
    let file_type = target
        .file_type()
        .with_context(|| format!("{} has no llama_ftype", target.name()))?;
    let started = Instant::now();
    let input =
        GgufFile::open(&args.input).with_context(|| format!("reading {}", args.input.display()))?;
    let n_layer = input
        .metadata()
        .get_str("general.architecture")
        .and_then(|arch| input.metadata().get_u64(&format!("{arch}.block_count")))
        .unwrap_or(0) as usize;
    // Layers counted as current llama.cpp counts them.
    let plans = plan_model(input.tensors(), n_layer, target, LayerOrder::LayerIndex);
    if args.dry_run {
        for (info, (plan, note)) in input.tensors().iter().zip(&plans) {
            let to = match plan {
                Plan::Keep => info.ty,
                Plan::Convert(to) => *to,
            };
            let note = note.map_or(String::new(), |n| format!(" ({n})"));
            println!("{}: {} -> {to}{note}", info.name, info.ty);
        }
        return Ok(());
    }
    let total: u64 = input
        .tensors()
        .iter()
        .zip(&plans)
        .filter(|(_, (p, _))| matches!(p, Plan::Convert(_)))
        .map(|(t, _)| t.n_elements())
        .sum();
    let bar = super::progress::bar("quantize", total);

    let mut metadata = input.metadata().clone();
    metadata.insert("general.file_type", Value::U32(file_type));
    let mut writer = GgufWriter::new(metadata);
    writer.set_version(input.version())?;

    // (from, to) -> tensor count, for the summary.
    let mut counts: BTreeMap<(String, String), usize> = BTreeMap::new();
    // (tensor kind, type) -> layers, to say which tensors got which type.
    let mut kinds: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
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
        if is_weight_matrix(info) {
            let (layer, kind) = split_layer(&info.name);
            kinds
                .entry((kind.to_string(), to.to_string()))
                .or_default()
                .push(layer.to_string());
        }
        if let Some(note) = note {
            *notes.entry(note.to_string()).or_default() += 1;
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
        "wrote {} ({:.2} MiB, {} tensors, {}, general.file_type {file_type}) in {:.1}s",
        args.output.display(),
        written as f64 / (1024.0 * 1024.0),
        input.tensors().len(),
        target.name(),
        started.elapsed().as_secs_f64()
    );
    for ((from, to), n) in &counts {
        let verb = if from == to { "kept" } else { "converted" };
        println!("  {n:>4} tensors {verb:<9} {from} -> {to}");
    }
    println!("  weight matrices by type:");
    for ((kind, to), layers) in &kinds {
        let which = if layers.iter().all(|l| l.is_empty()) {
            String::new()
        } else {
            format!(" (layers {})", layers.join(","))
        };
        println!("    {kind:<28} {to:<5} {:>4}{which}", layers.len());
    }
    for (note, n) in &notes {
        println!("  note: {n} tensors: {note}");
    }
    Ok(())
}

/// `blk.12.ffn_down.weight` -> ("12", "ffn_down.weight"); other names have no layer.
fn split_layer(name: &str) -> (&str, &str) {
    name.strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
        .unwrap_or(("", name))
}
