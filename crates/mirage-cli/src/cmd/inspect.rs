//! `mirage-cli inspect FILE [--json]`: what a GGUF file holds.
//!
//! The report is one [`Report`] value, printed either as text tables or as
//! JSON; the JSON keys are the struct's field names, so they are stable.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use mirage_gguf::{GgmlType, GgufFile, Metadata};
use serde::Serialize;

/// Arguments of `mirage-cli inspect`.
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// The GGUF file to describe.
    pub file: PathBuf,
    /// Print one JSON object (stable keys) instead of tables.
    #[arg(long)]
    pub json: bool,
    /// In text mode, also list every metadata key (long arrays abbreviated).
    #[arg(long)]
    pub metadata: bool,
}

/// Everything `inspect` reports.
#[derive(Debug, Serialize)]
pub struct Report {
    file: String,
    file_size: u64,
    gguf_version: u32,
    metadata_count: usize,
    architecture: Option<String>,
    name: Option<String>,
    file_type: Option<u64>,
    file_type_name: Option<&'static str>,
    block_count: Option<u64>,
    embedding_length: Option<u64>,
    feed_forward_length: Option<u64>,
    head_count: Option<u64>,
    head_count_kv: Option<u64>,
    head_dim: Option<usize>,
    context_length: Option<u64>,
    rope_freq_base: Option<f32>,
    rms_norm_eps: Option<f32>,
    tied_embeddings: Option<bool>,
    attn_qkv_bias: Option<bool>,
    attn_qk_norm: Option<bool>,
    /// Why typed hyperparameters could not be derived, if they could not.
    hparams_error: Option<String>,
    /// Where the hyperparameters and the tensor table disagree (missing
    /// blocks, wrong widths); empty when they agree. Such a file does not load.
    tensor_mismatches: Vec<String>,
    vocab_size: Option<u64>,
    tokenizer: TokenizerSummary,
    tensor_count: usize,
    parameter_count: u64,
    tensor_bytes: u64,
    bytes_per_type: BTreeMap<String, TypeTotals>,
    tensors: Vec<TensorRow>,
}

/// The tokenizer as the metadata describes it.
#[derive(Debug, Serialize)]
struct TokenizerSummary {
    model: Option<String>,
    pre: Option<String>,
    vocab_size: Option<u64>,
    merges: Option<u64>,
    bos_token_id: Option<u64>,
    eos_token_id: Option<u64>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos_token: Option<bool>,
    has_chat_template: bool,
}

/// Per ggml type: how many tensors, elements and bytes.
#[derive(Debug, Default, Serialize)]
struct TypeTotals {
    tensors: usize,
    elements: u64,
    bytes: u64,
}

/// One row of the tensor table.
#[derive(Debug, Serialize)]
struct TensorRow {
    name: String,
    #[serde(rename = "type")]
    ty: String,
    /// ggml order: `shape[0]` is the contiguous row length.
    shape: Vec<u64>,
    elements: u64,
    bytes: u64,
}

fn token_text(md: &Metadata, id: Option<u64>) -> Option<String> {
    let id = usize::try_from(id?).ok()?;
    let tokens = md.get_array("tokenizer.ggml.tokens")?;
    tokens.values.get(id)?.as_str().map(str::to_string)
}

/// Builds the report of an opened file.
pub fn report(path: &std::path::Path, file: &GgufFile) -> Report {
    let md = file.metadata();
    let arch = md.get_str("general.architecture").map(str::to_string);
    let key = |suffix: &str| {
        arch.as_ref()
            .and_then(|a| md.get_u64(&format!("{a}.{suffix}")))
    };
    // The keys as written, even when the tensors contradict them: the
    // contradictions are listed, not hidden behind an error.
    let hparams = mirage_gguf::ModelHparams::from_metadata(file);

    let tokens_len = md.array_len("tokenizer.ggml.tokens").map(|n| n as u64);
    let bos = md.get_u64("tokenizer.ggml.bos_token_id");
    let eos = md.get_u64("tokenizer.ggml.eos_token_id");
    let tokenizer = TokenizerSummary {
        model: md.get_str("tokenizer.ggml.model").map(str::to_string),
        pre: md.get_str("tokenizer.ggml.pre").map(str::to_string),
        vocab_size: tokens_len,
        merges: md.array_len("tokenizer.ggml.merges").map(|n| n as u64),
        bos_token_id: bos,
        eos_token_id: eos,
        bos_token: token_text(md, bos),
        eos_token: token_text(md, eos),
        add_bos_token: md.get_bool("tokenizer.ggml.add_bos_token"),
        has_chat_template: md.get_str("tokenizer.chat_template").is_some(),
    };

    let mut bytes_per_type: BTreeMap<String, TypeTotals> = BTreeMap::new();
    let mut tensors = Vec::with_capacity(file.tensors().len());
    for t in file.tensors() {
        let totals = bytes_per_type.entry(t.ty.to_string()).or_default();
        totals.tensors += 1;
        totals.elements += t.n_elements();
        totals.bytes += t.n_bytes();
        tensors.push(TensorRow {
            name: t.name.clone(),
            ty: t.ty.to_string(),
            shape: t.dims.clone(),
            elements: t.n_elements(),
            bytes: t.n_bytes(),
        });
    }

    let file_type = md.get_u64("general.file_type");
    let hp = hparams.as_ref().ok();
    Report {
        file: path.display().to_string(),
        file_size: file.len(),
        gguf_version: file.version(),
        metadata_count: md.len(),
        architecture: arch.clone(),
        name: md.get_str("general.name").map(str::to_string),
        file_type,
        file_type_name: file_type.and_then(super::file_type_name),
        block_count: key("block_count"),
        embedding_length: key("embedding_length"),
        feed_forward_length: key("feed_forward_length"),
        head_count: key("attention.head_count"),
        head_count_kv: key("attention.head_count_kv").or(key("attention.head_count")),
        head_dim: hp.map(|h| h.head_dim),
        context_length: key("context_length"),
        rope_freq_base: hp.map(|h| h.rope_freq_base),
        rms_norm_eps: hp.map(|h| h.rms_norm_eps),
        tied_embeddings: hp.map(|h| h.tied_embeddings),
        attn_qkv_bias: hp.map(|h| h.attn_qkv_bias),
        attn_qk_norm: hp.map(|h| h.attn_qk_norm),
        hparams_error: hparams.as_ref().err().map(|e| e.to_string()),
        tensor_mismatches: hp.map(|h| h.tensor_mismatches(file)).unwrap_or_default(),
        vocab_size: hp.map(|h| h.vocab_size as u64).or(tokens_len),
        tokenizer,
        tensor_count: file.tensors().len(),
        parameter_count: file.tensors().iter().map(|t| t.n_elements()).sum(),
        tensor_bytes: file.tensors().iter().map(|t| t.n_bytes()).sum(),
        bytes_per_type,
        tensors,
    }
}

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    match v {
        Some(v) => v.to_string(),
        None => "-".to_string(),
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn print_text(r: &Report, file: &GgufFile, show_metadata: bool) {
    println!(
        "file            {} ({} bytes, GGUF v{})",
        r.file, r.file_size, r.gguf_version
    );
    println!("name            {}", opt(&r.name));
    println!("architecture    {}", opt(&r.architecture));
    let ft_name = r.file_type_name.unwrap_or("?");
    println!("file type       {} ({ft_name})", opt(&r.file_type));
    println!();
    println!("hyperparameters");
    println!("  block_count          {}", opt(&r.block_count));
    println!("  embedding_length     {}", opt(&r.embedding_length));
    println!("  feed_forward_length  {}", opt(&r.feed_forward_length));
    println!(
        "  head_count           {} (kv {})",
        opt(&r.head_count),
        opt(&r.head_count_kv)
    );
    println!("  head_dim             {}", opt(&r.head_dim));
    println!("  context_length       {}", opt(&r.context_length));
    println!("  rope_freq_base       {}", opt(&r.rope_freq_base));
    println!("  rms_norm_eps         {}", opt(&r.rms_norm_eps));
    println!("  vocab_size           {}", opt(&r.vocab_size));
    println!(
        "  tied_embeddings {}  qkv_bias {}  qk_norm {}",
        opt(&r.tied_embeddings),
        opt(&r.attn_qkv_bias),
        opt(&r.attn_qk_norm)
    );
    if let Some(err) = &r.hparams_error {
        println!("  (typed hyperparameters unavailable: {err})");
    }
    for m in &r.tensor_mismatches {
        println!("  tensor mismatch: {m}");
    }
    let t = &r.tokenizer;
    println!();
    println!("tokenizer");
    println!("  model {}  pre {}", opt(&t.model), opt(&t.pre));
    println!("  vocab {}  merges {}", opt(&t.vocab_size), opt(&t.merges));
    println!(
        "  bos {} {:?}  eos {} {:?}  add_bos {}",
        opt(&t.bos_token_id),
        t.bos_token.as_deref().unwrap_or(""),
        opt(&t.eos_token_id),
        t.eos_token.as_deref().unwrap_or(""),
        opt(&t.add_bos_token)
    );
    println!(
        "  chat template  {}",
        if t.has_chat_template { "yes" } else { "no" }
    );

    if show_metadata {
        println!();
        println!("metadata ({} keys)", r.metadata_count);
        for (key, value) in file.metadata().iter() {
            println!("  {key:<40} {}", describe_value(value));
        }
    }

    println!();
    println!(
        "tensors: {}  parameters: {}  data: {}",
        r.tensor_count,
        r.parameter_count,
        mib(r.tensor_bytes)
    );
    let name_w = r
        .tensors
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    println!(
        "  {:<name_w$}  {:<5}  {:>20}  {:>12}",
        "name", "type", "shape", "bytes"
    );
    for t in &r.tensors {
        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
        println!(
            "  {:<name_w$}  {:<5}  {:>20}  {:>12}",
            t.name,
            t.ty,
            shape.join(" x "),
            t.bytes
        );
    }
    println!();
    println!("bytes per type");
    for (ty, totals) in &r.bytes_per_type {
        let share = 100.0 * totals.bytes as f64 / r.tensor_bytes.max(1) as f64;
        let bpw = GgmlType::from_name(ty)
            .map(|t| 8.0 * t.type_size() as f64 / t.block_size() as f64)
            .unwrap_or(f64::NAN);
        println!(
            "  {ty:<5} {:>4} tensors  {:>12}  {:>5.1}%  {bpw:.2} bits/weight",
            totals.tensors,
            mib(totals.bytes),
            share
        );
    }
}

/// One line for a metadata value; arrays show their length and first items.
fn describe_value(value: &mirage_gguf::Value) -> String {
    use mirage_gguf::Value;
    match value {
        Value::String(s) => {
            let one_line = s.replace('\n', "\\n");
            if one_line.chars().count() > 60 {
                let head: String = one_line.chars().take(60).collect();
                format!("{head:?}... ({} chars)", s.chars().count())
            } else {
                format!("{one_line:?}")
            }
        }
        Value::Array(a) => {
            let head: Vec<String> = a.values.iter().take(4).map(describe_value).collect();
            let more = if a.values.len() > 4 { ", ..." } else { "" };
            format!(
                "[{}{more}] ({} x {})",
                head.join(", "),
                a.values.len(),
                a.elem_type.name()
            )
        }
        other => format!("{other:?}"),
    }
}

/// Runs `inspect`.
pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let file =
        GgufFile::open(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let r = report(&args.file, &file);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_text(&r, &file, args.metadata);
    }
    Ok(())
}
