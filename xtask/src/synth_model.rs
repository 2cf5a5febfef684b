//! `cargo xtask synth-model`: a shape-true Qwen2.5 GGUF with random weights,
//! for speed measurements of sizes that are not downloaded (7B, 14B).
//!
//! The file has the real hyperparameters of the named size (embedding, FFN,
//! layers, heads, KV heads, vocabulary, RoPE base, q/k/v biases, a separate
//! `output.weight`) and the real tokenizer metadata copied from a Qwen GGUF,
//! its token list padded with unused `[PADn]` tokens up to the vocabulary
//! (as Qwen's own converter does), so llama.cpp and MIRAGE both load it.
//! Weights are random quantized blocks written straight in their ggml
//! encoding (`mirage_gguf::synth`), streamed to disk chunk by chunk with
//! each chunk seeded from its index: a 7B Q8_0 file (~8 GB) never sits in
//! memory, and the bytes depend only on `--seed`. Written to a temporary
//! name and renamed when complete.
//!
//! The weights mean nothing: use these files for speed, never for fidelity.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use mirage_gguf::quant_mix::{plan_model, LayerOrder, Plan, Preset, Target, TensorEntry};
use mirage_gguf::synth::{fill_random, mix_seed, WyRand};
use mirage_gguf::{GgmlType, GgufFile, GgufStreamWriter, Metadata, TensorDecl, Value, ValueType};
use rayon::prelude::*;

/// Arguments of `cargo xtask synth-model`.
#[derive(Debug, clap::Args)]
pub struct SynthModelArgs {
    /// Shape: qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, qwen2.5-14b, or tiny (2 layers, 256 wide, for tests).
    #[arg(long, required_unless_present = "tokenizer_only")]
    like: Option<String>,
    /// Weight type: q8_0, q4_k or q2_k (K-quants fall back to q5_0 / q4_0 for rows not a multiple of 256,
    /// as llama.cpp does), or q4_k_m: llama.cpp's Q4_K_M mix (Q4_K; Q6_K for the output and for attn_v
    /// and ffn_down of some layers; Q5_0 and Q8_0 where rows are not a multiple of 256).
    #[arg(long, default_value = "q8_0")]
    quant: String,
    /// Random seed (the file's bytes depend only on it and the shape and type).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output GGUF file.
    #[arg(long)]
    out: PathBuf,
    /// GGUF whose tokenizer.* metadata is copied (a Qwen2.5 model, or a file written with --tokenizer-only).
    #[arg(long, default_value = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")]
    tokenizer_from: PathBuf,
    /// Write only the tokenizer metadata (a few MB, no tensors): a small stand-in for --tokenizer-from
    /// on machines without the Qwen model.
    #[arg(long)]
    tokenizer_only: bool,
}

/// Hyperparameters of one Qwen2.5 size (from its config.json).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// `--like` name.
    pub name: &'static str,
    /// Hidden size.
    pub n_embd: usize,
    /// FFN intermediate size.
    pub n_ff: usize,
    /// Layers.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// KV heads.
    pub n_head_kv: usize,
    /// Vocabulary (rows of the embedding and the lm head).
    pub vocab: usize,
    /// Training context.
    pub n_ctx: usize,
}

/// The sizes `--like` knows.
pub const SHAPES: [Shape; 5] = [
    Shape {
        name: "qwen2.5-0.5b",
        n_embd: 896,
        n_ff: 4864,
        n_layer: 24,
        n_head: 14,
        n_head_kv: 2,
        vocab: 151936,
        n_ctx: 32768,
    },
    Shape {
        name: "qwen2.5-1.5b",
        n_embd: 1536,
        n_ff: 8960,
        n_layer: 28,
        n_head: 12,
        n_head_kv: 2,
        vocab: 151936,
        n_ctx: 32768,
    },
    Shape {
        name: "qwen2.5-7b",
        n_embd: 3584,
        n_ff: 18944,
        n_layer: 28,
        n_head: 28,
        n_head_kv: 4,
        vocab: 152064,
        n_ctx: 32768,
    },
    Shape {
        name: "qwen2.5-14b",
        n_embd: 5120,
        n_ff: 13824,
        n_layer: 48,
        n_head: 40,
        n_head_kv: 8,
        vocab: 152064,
        n_ctx: 32768,
    },
    // Not a real size: small enough for tests, with the real vocabulary so the real tokenizer fits.
    Shape {
        name: "tiny",
        n_embd: 256,
        n_ff: 512,
        n_layer: 2,
        n_head: 4,
        n_head_kv: 2,
        vocab: 151936,
        n_ctx: 4096,
    },
];

const ROPE_BASE: f32 = 1_000_000.0;
const RMS_EPS: f32 = 1e-6;

/// How one tensor is filled.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fill {
    /// Random quantized weights with this std.
    Weights(f32),
    /// f32 values 1 ± a little (norm gains).
    NearOne,
    /// Small f32 values (biases).
    Small,
}

/// One tensor of the file: declaration and fill.
#[derive(Debug, Clone)]
struct Planned {
    decl: TensorDecl,
    fill: Fill,
}

impl TensorEntry for Planned {
    fn name(&self) -> &str {
        &self.decl.name
    }
    fn dims(&self) -> &[u64] {
        &self.decl.dims
    }
    fn ty(&self) -> GgmlType {
        self.decl.ty
    }
}

/// The weight types' name in `general.name` (`Q8_0`, `Q4_K_M`, ...).
fn target_label(target: Target) -> String {
    match target {
        Target::Single(ty) => ty.to_string(),
        Target::Preset(p) => p.name().to_ascii_uppercase(),
    }
}

/// The type a weight matrix with rows of `row` values gets when every
/// matrix is `ty`: `ty`, or the fallback of the llama.cpp versions before
/// IQ4_NL when the row is not a whole number of its blocks (Q4_K -> Q5_0,
/// the others -> Q4_0).
fn single_type(ty: GgmlType, row: u64) -> GgmlType {
    match (row % ty.block_size() as u64, ty) {
        (0, _) => ty,
        (_, GgmlType::Q4_K) => GgmlType::Q5_0,
        _ => GgmlType::Q4_0,
    }
}

fn plan(shape: &Shape, target: Target) -> anyhow::Result<Vec<Planned>> {
    let head_dim = shape.n_embd / shape.n_head;
    let kv = shape.n_head_kv * head_dim;
    let mut out = Vec::new();
    let weight = |out: &mut Vec<Planned>, name: String, cols: usize, rows: usize| {
        out.push(Planned {
            decl: TensorDecl {
                name,
                dims: vec![cols as u64, rows as u64],
                // Unquantized, as a converted model is before llama-quantize;
                // the types are planned below, once every tensor is known.
                ty: GgmlType::F32,
            },
            fill: Fill::Weights(1.0 / (cols as f32).sqrt()),
        })
    };
    let vector = |out: &mut Vec<Planned>, name: String, n: usize, fill: Fill| {
        out.push(Planned {
            decl: TensorDecl {
                name,
                dims: vec![n as u64],
                ty: GgmlType::F32,
            },
            fill,
        })
    };
    weight(
        &mut out,
        "token_embd.weight".into(),
        shape.n_embd,
        shape.vocab,
    );
    for l in 0..shape.n_layer {
        let b = |s: &str| format!("blk.{l}.{s}");
        vector(&mut out, b("attn_norm.weight"), shape.n_embd, Fill::NearOne);
        weight(&mut out, b("attn_q.weight"), shape.n_embd, shape.n_embd);
        vector(&mut out, b("attn_q.bias"), shape.n_embd, Fill::Small);
        weight(&mut out, b("attn_k.weight"), shape.n_embd, kv);
        vector(&mut out, b("attn_k.bias"), kv, Fill::Small);
        weight(&mut out, b("attn_v.weight"), shape.n_embd, kv);
        vector(&mut out, b("attn_v.bias"), kv, Fill::Small);
        weight(
            &mut out,
            b("attn_output.weight"),
            shape.n_embd,
            shape.n_embd,
        );
        vector(&mut out, b("ffn_norm.weight"), shape.n_embd, Fill::NearOne);
        weight(&mut out, b("ffn_gate.weight"), shape.n_embd, shape.n_ff);
        weight(&mut out, b("ffn_up.weight"), shape.n_embd, shape.n_ff);
        weight(&mut out, b("ffn_down.weight"), shape.n_ff, shape.n_embd);
    }
    vector(
        &mut out,
        "output_norm.weight".into(),
        shape.n_embd,
        Fill::NearOne,
    );
    weight(&mut out, "output.weight".into(), shape.n_embd, shape.vocab);
    match target {
        Target::Single(ty) => {
            for p in out
                .iter_mut()
                .filter(|p| matches!(p.fill, Fill::Weights(_)))
            {
                p.decl.ty = single_type(ty, p.row_len());
            }
        }
        Target::Preset(_) => {
            // Counted in the shipped files' layer order, so that the types
            // are theirs tensor for tensor.
            let plans = plan_model(&out, shape.n_layer, target, LayerOrder::Name);
            for (p, (tensor_plan, _)) in out.iter_mut().zip(plans) {
                match (tensor_plan, p.fill) {
                    (Plan::Convert(ty), _) => p.decl.ty = ty,
                    (Plan::Keep, Fill::Weights(_)) => bail!(
                        "{}: rows of {} values fit no type of {}",
                        p.decl.name,
                        p.row_len(),
                        target.name()
                    ),
                    (Plan::Keep, _) => {}
                }
            }
        }
    }
    Ok(out)
}

/// The tokenizer.* keys of `src`, with the token list (and its types)
/// padded to `vocab` entries by unused `[PADn]` tokens.
fn tokenizer_metadata(
    src: &GgufFile,
    vocab: Option<usize>,
) -> anyhow::Result<Vec<(String, Value)>> {
    let md = src.metadata();
    let mut keys: Vec<(String, Value)> = md
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let n_tokens = md
        .array_len("tokenizer.ggml.tokens")
        .context("the file has no tokenizer.ggml.tokens")?;
    let Some(vocab) = vocab else { return Ok(keys) };
    if n_tokens > vocab {
        bail!("the tokenizer has {n_tokens} tokens, more than the shape's vocabulary of {vocab}");
    }
    for (k, v) in keys.iter_mut() {
        let Value::Array(a) = v else { continue };
        match k.as_str() {
            "tokenizer.ggml.tokens" => a
                .values
                .extend((n_tokens..vocab).map(|i| Value::String(format!("[PAD{i}]")))),
            "tokenizer.ggml.token_type" => {
                if a.values.len() != n_tokens {
                    bail!(
                        "tokenizer.ggml.token_type has {} entries for {n_tokens} tokens",
                        a.values.len()
                    );
                }
                // llama.cpp's LLAMA_TOKEN_TYPE_UNUSED.
                let unused = match a.elem_type {
                    ValueType::I32 => Value::I32(5),
                    ValueType::U32 => Value::U32(5),
                    t => bail!(
                        "tokenizer.ggml.token_type is an array of {}, expected i32",
                        t.name()
                    ),
                };
                a.values.extend((n_tokens..vocab).map(|_| unused.clone()));
            }
            "tokenizer.ggml.scores" => {
                a.values.extend((n_tokens..vocab).map(|_| Value::F32(0.0)));
            }
            _ => {}
        }
    }
    Ok(keys)
}

fn parse_quant(q: &str) -> anyhow::Result<Target> {
    Ok(match q.to_ascii_lowercase().as_str() {
        "q8_0" => Target::Single(GgmlType::Q8_0),
        "q4_k" => Target::Single(GgmlType::Q4_K),
        "q2_k" => Target::Single(GgmlType::Q2_K),
        "q4_k_m" => Target::Preset(Preset::Q4KM),
        other => bail!("--quant {other}: expected q8_0, q4_k, q2_k or q4_k_m"),
    })
}

/// The file's metadata.
fn metadata(
    shape: &Shape,
    target: Target,
    seed: u64,
    tokenizer: Vec<(String, Value)>,
) -> anyhow::Result<Metadata> {
    let file_type = target
        .file_type()
        .with_context(|| format!("{} has no llama_ftype", target.name()))?;
    let mut md = Metadata::new();
    let s = |x: &str| Value::String(x.to_string());
    let u = |x: usize| Value::U32(x as u32);
    md.insert("general.architecture", s("qwen2"));
    md.insert("general.type", s("model"));
    md.insert(
        "general.name",
        s(&format!(
            "synthetic {} shape, random {} weights (seed {seed}; speed only, not a model)",
            shape.name,
            target_label(target)
        )),
    );
    md.insert("qwen2.block_count", u(shape.n_layer));
    md.insert("qwen2.context_length", u(shape.n_ctx));
    md.insert("qwen2.embedding_length", u(shape.n_embd));
    md.insert("qwen2.feed_forward_length", u(shape.n_ff));
    md.insert("qwen2.attention.head_count", u(shape.n_head));
    md.insert("qwen2.attention.head_count_kv", u(shape.n_head_kv));
    md.insert("qwen2.rope.freq_base", Value::F32(ROPE_BASE));
    md.insert(
        "qwen2.attention.layer_norm_rms_epsilon",
        Value::F32(RMS_EPS),
    );
    md.insert("general.file_type", Value::U32(file_type));
    md.insert("general.quantization_version", Value::U32(2));
    md.insert("mirage.synth.like", s(shape.name));
    md.insert("mirage.synth.seed", Value::U64(seed));
    for (k, v) in tokenizer {
        md.insert(k, v);
    }
    Ok(md)
}

/// Bytes generated per seeded chunk (whole blocks).
const CHUNK_BYTES: usize = 1 << 20;
/// Chunks generated in parallel before one write.
const CHUNKS_PER_WRITE: usize = 32;

fn write_tensor<W: Write>(
    w: &mut GgufStreamWriter<W>,
    p: &Planned,
    index: usize,
    seed: u64,
    buf: &mut Vec<u8>,
    bar: &ProgressBar,
) -> anyhow::Result<()> {
    let total = p.decl.n_bytes()? as usize;
    let tensor_seed = mix_seed(&[seed, index as u64]);
    match p.fill {
        Fill::Weights(std) => {
            let ts = p.decl.ty.type_size();
            let chunk = (CHUNK_BYTES / ts).max(1) * ts;
            let mut done = 0usize;
            let mut chunk_index = 0u64;
            while done < total {
                let n = (total - done).min(chunk * CHUNKS_PER_WRITE);
                buf.resize(n, 0);
                let first = chunk_index;
                buf.par_chunks_mut(chunk)
                    .enumerate()
                    .try_for_each(|(i, c)| {
                        fill_random(
                            p.decl.ty,
                            std,
                            mix_seed(&[tensor_seed, first + i as u64]),
                            c,
                        )
                    })?;
                w.write_data(buf)?;
                chunk_index += n.div_ceil(chunk) as u64;
                done += n;
                bar.inc(n as u64);
            }
        }
        Fill::NearOne | Fill::Small => {
            let mut rng = WyRand::new(tensor_seed);
            let n = total / 4;
            let values: Vec<u8> = (0..n)
                .flat_map(|_| {
                    let u = rng.next_f32() * 2.0 - 1.0;
                    let x = if p.fill == Fill::NearOne {
                        1.0 + 0.05 * u
                    } else {
                        0.02 * u
                    };
                    x.to_le_bytes()
                })
                .collect();
            w.write_data(&values)?;
            bar.inc(total as u64);
        }
    }
    Ok(())
}

fn write_file(out: &Path, md: &Metadata, planned: &[Planned], seed: u64) -> anyhow::Result<u64> {
    // A locked temporary renamed into place; a killed run's temporary is
    // removed by the next write of the same file.
    let mut atomic = mirage_gguf::atomic::AtomicFile::create(out)
        .with_context(|| format!("creating a temporary for {}", out.display()))?;
    let n = {
        let file = atomic.file();
        let decls: Vec<TensorDecl> = planned.iter().map(|p| p.decl.clone()).collect();
        let total: u64 = decls.iter().map(|d| d.n_bytes()).sum::<Result<u64, _>>()?;
        let mut w = GgufStreamWriter::new(BufWriter::with_capacity(8 << 20, file), md, &decls)?;
        let bar = ProgressBar::new(total).with_style(
            ProgressStyle::with_template(
                "{prefix} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .expect("template")
            .progress_chars("=> "),
        );
        bar.set_prefix(
            out.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
        let mut buf = Vec::new();
        for (i, p) in planned.iter().enumerate() {
            write_tensor(&mut w, p, i, seed, &mut buf, &bar)
                .with_context(|| format!("writing {}", p.decl.name))?;
        }
        bar.finish_and_clear();
        let (mut buffered, n) = w.finish()?;
        buffered.flush().context("flushing")?;
        n
    };
    atomic
        .commit()
        .with_context(|| format!("renaming into place as {}", out.display()))?;
    Ok(n)
}

/// Runs the task.
pub fn run(args: &SynthModelArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let src = GgufFile::open(&args.tokenizer_from).with_context(|| {
        format!(
            "reading the tokenizer from {} (a Qwen2.5 GGUF: `cargo xtask fetch-models --only qwen2.5-coder`, \
             or a file written by `synth-model --tokenizer-only`)",
            args.tokenizer_from.display()
        )
    })?;
    if args.tokenizer_only {
        let mut md = Metadata::new();
        md.insert("general.architecture", Value::String("qwen2".into()));
        md.insert("general.type", Value::String("vocab".into()));
        for (k, v) in tokenizer_metadata(&src, None)? {
            md.insert(k, v);
        }
        let n = write_file(&args.out, &md, &[], args.seed)?;
        println!(
            "{}: tokenizer only, {:.1} MB",
            args.out.display(),
            n as f64 / 1e6
        );
        return Ok(());
    }
    let like = args.like.as_deref().unwrap_or_default();
    let shape = SHAPES
        .iter()
        .find(|s| s.name.eq_ignore_ascii_case(like))
        .with_context(|| {
            let names: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
            format!("--like {like}: expected one of {}", names.join(", "))
        })?;
    let target = parse_quant(&args.quant)?;
    let md = metadata(
        shape,
        target,
        args.seed,
        tokenizer_metadata(&src, Some(shape.vocab))?,
    )?;
    let planned = plan(shape, target)?;
    let n = write_file(&args.out, &md, &planned, args.seed)?;
    let secs = started.elapsed().as_secs_f64();
    let params: u64 = planned
        .iter()
        .map(|p| p.decl.dims.iter().product::<u64>())
        .sum();
    println!(
        "{}: {} {} ({:.2} B parameters), {:.2} GB in {:.1} s ({:.0} MB/s)",
        args.out.display(),
        shape.name,
        target_label(target),
        params as f64 / 1e9,
        n as f64 / 1e9,
        secs,
        n as f64 / 1e6 / secs.max(1e-9)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q4KM: Target = Target::Preset(Preset::Q4KM);

    /// The layers whose attn_v and ffn_down get more bits in the shipped
    /// Qwen2.5-Coder-0.5B-Instruct Q4_K_M file (24 layers, read with gguf-py;
    /// Q8_0 there, the Q6_K fallback for rows of 896).
    #[test]
    fn q4_k_m_spends_more_bits_on_the_shipped_files_layers() {
        let shape = SHAPES.iter().find(|s| s.name == "qwen2.5-0.5b").unwrap();
        let planned = plan(shape, Q4KM).unwrap();
        let layers_in = |kind: &str, ty: GgmlType| -> Vec<usize> {
            (0..24)
                .filter(|l| {
                    let name = format!("blk.{l}.{kind}");
                    planned
                        .iter()
                        .any(|p| p.decl.name == name && p.decl.ty == ty)
                })
                .collect()
        };
        let more = [0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21];
        assert_eq!(layers_in("attn_v.weight", GgmlType::Q8_0), more);
        assert_eq!(layers_in("ffn_down.weight", GgmlType::Q6_K), more);
        let types: Vec<(String, GgmlType)> = planned
            .into_iter()
            .filter(|p| p.decl.ty != GgmlType::F32)
            .map(|p| (p.decl.name, p.decl.ty))
            .collect();
        let ty = |n: &str| types.iter().find(|(name, _)| name == n).unwrap().1;
        assert_eq!(ty("token_embd.weight"), GgmlType::Q5_0);
        assert_eq!(ty("output.weight"), GgmlType::Q8_0);
        assert_eq!(ty("blk.2.attn_v.weight"), GgmlType::Q5_0);
        assert_eq!(ty("blk.3.attn_v.weight"), GgmlType::Q8_0);
        assert_eq!(ty("blk.3.ffn_down.weight"), GgmlType::Q6_K);
        assert_eq!(ty("blk.2.ffn_down.weight"), GgmlType::Q4_K);
        assert_eq!(ty("blk.0.ffn_gate.weight"), GgmlType::Q5_0);
    }

    /// Every weight tensor of the Q4_K_M plan has the type of the same
    /// tensor in the shipped Q4_K_M files (made by llama.cpp), for the
    /// sizes on this machine.
    #[test]
    fn q4_k_m_types_equal_the_shipped_qwen_files() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for (like, file) in [
            (
                "qwen2.5-0.5b",
                "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            ),
            (
                "qwen2.5-1.5b",
                "models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            ),
        ] {
            let path = root.join(file);
            if !path.exists() {
                eprintln!("{like}: {file} is not here (cargo xtask fetch-models): not compared");
                continue;
            }
            let real = GgufFile::open(&path).unwrap();
            let shape = SHAPES.iter().find(|s| s.name == like).unwrap();
            let mut compared = 0;
            for p in plan(shape, Q4KM).unwrap() {
                if p.decl.ty == GgmlType::F32 {
                    continue;
                }
                let t = real
                    .tensors()
                    .iter()
                    .find(|t| t.name == p.decl.name)
                    .unwrap_or_else(|| panic!("{like}: {} not in {file}", p.decl.name));
                assert_eq!(t.ty, p.decl.ty, "{like}: {}", p.decl.name);
                compared += 1;
            }
            eprintln!("{like}: {compared} weight types equal {file}'s");
        }
    }

    #[test]
    fn tokenizer_is_padded_to_the_vocabulary_with_unused_tokens() {
        let mut md = Metadata::new();
        md.insert("general.architecture", Value::String("qwen2".into()));
        md.insert("tokenizer.ggml.model", Value::String("gpt2".into()));
        md.insert(
            "tokenizer.ggml.tokens",
            Value::string_array(["a", "b", "<|end|>"]),
        );
        md.insert(
            "tokenizer.ggml.token_type",
            Value::array(
                ValueType::I32,
                vec![Value::I32(1), Value::I32(1), Value::I32(3)],
            ),
        );
        md.insert("tokenizer.ggml.merges", Value::string_array(["a b"]));
        md.insert("qwen2.block_count", Value::U32(1));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tok.gguf");
        mirage_gguf::GgufWriter::new(md)
            .write_to_path(&path)
            .unwrap();
        let src = GgufFile::open(&path).unwrap();
        let keys = tokenizer_metadata(&src, Some(5)).unwrap();
        let get = |k: &str| {
            keys.iter()
                .find(|(name, _)| name == k)
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        let Value::Array(tokens) = get("tokenizer.ggml.tokens") else {
            panic!()
        };
        let names: Vec<_> = tokens
            .values
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        assert_eq!(names, ["a", "b", "<|end|>", "[PAD3]", "[PAD4]"]);
        let Value::Array(types) = get("tokenizer.ggml.token_type") else {
            panic!()
        };
        assert_eq!(types.values, [1, 1, 3, 5, 5].map(Value::I32));
        // Only tokenizer keys are copied; merges untouched.
        assert!(keys.iter().all(|(k, _)| k.starts_with("tokenizer.")));
        assert_eq!(get("tokenizer.ggml.merges"), Value::string_array(["a b"]));
        // A vocabulary smaller than the token list is refused.
        assert!(tokenizer_metadata(&src, Some(2)).is_err());
        // --tokenizer-only copies without padding.
        assert_eq!(tokenizer_metadata(&src, None).unwrap().len(), 4);
    }

    #[test]
    fn plans_have_the_real_shapes_and_fallback_types() {
        let q05 = plan(&SHAPES[0], Target::Single(GgmlType::Q4_K)).unwrap();
        // 1 embedding + 12 per layer + output norm + output.
        assert_eq!(q05.len(), 1 + 24 * 12 + 2);
        let get =
            |p: &[Planned], n: &str| p.iter().find(|t| t.decl.name == n).unwrap().decl.clone();
        let q = get(&q05, "blk.0.attn_q.weight");
        // 896 is not a multiple of 256: Q4_K falls back to Q5_0 as in llama.cpp.
        assert_eq!((q.dims.clone(), q.ty), (vec![896, 896], GgmlType::Q5_0));
        let down = get(&q05, "blk.23.ffn_down.weight");
        assert_eq!(
            (down.dims.clone(), down.ty),
            (vec![4864, 896], GgmlType::Q4_K)
        );
        // Under q2_k the rows of 896 fall back to Q4_0, as llama.cpp did before IQ4_NL.
        let q05_q2k = plan(&SHAPES[0], Target::Single(GgmlType::Q2_K)).unwrap();
        assert_eq!(get(&q05_q2k, "blk.0.attn_q.weight").ty, GgmlType::Q4_0);
        assert_eq!(get(&q05_q2k, "blk.0.ffn_down.weight").ty, GgmlType::Q2_K);
        assert_eq!(get(&q05, "blk.0.attn_k.weight").dims, vec![896, 128]);
        assert_eq!(get(&q05, "blk.0.attn_v.bias").dims, vec![128]);
        let q7 = plan(&SHAPES[2], Target::Single(GgmlType::Q8_0)).unwrap();
        assert_eq!(get(&q7, "output.weight").dims, vec![3584, 152064]);
        assert_eq!(get(&q7, "blk.27.attn_k.weight").dims, vec![3584, 512]);
        let params: u64 = q7.iter().map(|p| p.decl.dims.iter().product::<u64>()).sum();
        // Qwen2.5-7B has 7.62 B parameters.
        assert!((7.6e9..7.65e9).contains(&(params as f64)), "{params}");
        let bytes: u64 = q7.iter().map(|p| p.decl.n_bytes().unwrap()).sum();
        assert!((8.0e9..8.2e9).contains(&(bytes as f64)), "{bytes}");
        let q14 = plan(&SHAPES[3], Target::Single(GgmlType::Q2_K)).unwrap();
        assert!(q14
            .iter()
            .all(|p| p.decl.ty == GgmlType::Q2_K || p.decl.ty == GgmlType::F32));
        let params: u64 = q14
            .iter()
            .map(|p| p.decl.dims.iter().product::<u64>())
            .sum();
        // Qwen2.5-14B has 14.77 B parameters.
        assert!((14.7e9..14.8e9).contains(&(params as f64)), "{params}");
    }
}
