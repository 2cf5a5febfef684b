//! Hugging Face safetensors checkpoint -> GGUF, for the qwen2 and qwen3
//! architectures (whose Q/K weights need no permutation: llama.cpp runs
//! them with NEOX RoPE, the same pairing as HF's `rotate_half`).
//!
//! Tensors keep their dtype (F32/F16/BF16) and their bytes: PyTorch's
//! `[out, in]` row-major layout is ggml's `[in, out]`. Metadata uses
//! llama.cpp's key names (`qwen3.block_count`, ...). No tokenizer is written:
//! the result is for graph tests that feed token ids directly.

use std::path::Path;

use mirage_gguf::{GgufWriter, Metadata, SafetensorsFile, Value};
use serde_json::Value as Json;

use crate::error::{Result, RuntimeError};

/// The GGUF name of an HF tensor name (`None` for names with no GGUF
/// counterpart, such as rotary caches).
pub fn gguf_tensor_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_owned());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, name) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let mapped = match name {
        "input_layernorm.weight" => "attn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}"))
}

fn bad(what: String) -> RuntimeError {
    RuntimeError::InvalidArgument(format!("HF config: {what}"))
}

/// The GGUF metadata of an HF `config.json` (qwen2 or qwen3).
pub fn metadata_from_config(config: &Json) -> Result<Metadata> {
    let arch = match config["model_type"].as_str() {
        Some("qwen3") => "qwen3",
        Some("qwen2") => "qwen2",
        other => return Err(bad(format!("model_type {other:?} is not qwen2 or qwen3"))),
    };
    let int = |k: &str| {
        config[k]
            .as_u64()
            .ok_or_else(|| bad(format!("`{k}` missing")))
    };
    let hidden = int("hidden_size")?;
    let heads = int("num_attention_heads")?;
    let head_dim = config["head_dim"].as_u64().unwrap_or(hidden / heads.max(1));
    let theta = config["rope_theta"]
        .as_f64()
        .or_else(|| config["rope_parameters"]["rope_theta"].as_f64())
        .unwrap_or(10_000.0);
    let eps = config["rms_norm_eps"]
        .as_f64()
        .ok_or_else(|| bad("`rms_norm_eps` missing".into()))?;
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String(arch.into()));
    md.insert(
        "general.name",
        Value::String(format!("{arch} (converted from safetensors)")),
    );
    let u32v = |v: u64| Value::U32(v as u32);
    md.insert(
        format!("{arch}.block_count"),
        u32v(int("num_hidden_layers")?),
    );
    md.insert(
        format!("{arch}.context_length"),
        u32v(int("max_position_embeddings")?),
    );
    md.insert(format!("{arch}.embedding_length"), u32v(hidden));
    md.insert(
        format!("{arch}.feed_forward_length"),
        u32v(int("intermediate_size")?),
    );
    md.insert(format!("{arch}.attention.head_count"), u32v(heads));
    md.insert(
        format!("{arch}.attention.head_count_kv"),
        u32v(config["num_key_value_heads"].as_u64().unwrap_or(heads)),
    );
    md.insert(format!("{arch}.attention.key_length"), u32v(head_dim));
    md.insert(format!("{arch}.attention.value_length"), u32v(head_dim));
    md.insert(
        format!("{arch}.attention.layer_norm_rms_epsilon"),
        Value::F32(eps as f32),
    );
    md.insert(format!("{arch}.rope.freq_base"), Value::F32(theta as f32));
    md.insert(format!("{arch}.vocab_size"), u32v(int("vocab_size")?));
    Ok(md)
}

/// Converts `model.safetensors` + `config.json` into a GGUF at `out`.
/// A tied checkpoint (no `lm_head.weight`) becomes a GGUF without
/// `output.weight`, which the runtime reads as tied.
pub fn safetensors_to_gguf(safetensors: &Path, config: &Path, out: &Path) -> Result<()> {
    let config: Json = serde_json::from_slice(&std::fs::read(config)?)
        .map_err(|e| bad(format!("not JSON: {e}")))?;
    let md = metadata_from_config(&config)?;
    let st = SafetensorsFile::open(safetensors)?;
    let mut writer = GgufWriter::new(md);
    let mut unknown = Vec::new();
    st.add_to_writer(&mut writer, |name| {
        let mapped = gguf_tensor_name(name);
        if mapped.is_none() && !name.contains("rotary_emb") {
            unknown.push(name.to_owned());
        }
        mapped
    })?;
    if !unknown.is_empty() {
        return Err(RuntimeError::InvalidArgument(format!(
            "tensors with no GGUF name: {unknown:?}"
        )));
    }
    writer.write_to_path(out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_like_gguf_py() {
        assert_eq!(
            gguf_tensor_name("model.layers.12.self_attn.k_norm.weight").as_deref(),
            Some("blk.12.attn_k_norm.weight")
        );
        assert_eq!(
            gguf_tensor_name("model.layers.0.mlp.down_proj.weight").as_deref(),
            Some("blk.0.ffn_down.weight")
        );
        assert_eq!(
            gguf_tensor_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
        assert_eq!(
            gguf_tensor_name("model.layers.x.mlp.down_proj.weight"),
            None
        );
        assert_eq!(
            gguf_tensor_name("model.layers.0.self_attn.rotary_emb.inv_freq"),
            None
        );
    }
}
