//! Random quantized blocks, written straight in their ggml encoding, for
//! shape-true synthetic models: speed measurements on model sizes that are
//! not downloaded (never for fidelity: the weights mean nothing).
//!
//! Every weight is a non-zero value with mean 0 and a chosen standard
//! deviation (so a model built from `std = 1/sqrt(row length)` keeps its
//! activations near unit scale). Quant codes are drawn uniformly from a set
//! symmetric about zero that excludes zero; scales are fixed per tensor.
//! Output depends only on the seed, so a chunked, parallel writer that seeds
//! each chunk from its index produces the same file on any thread count.

use half::f16;

use crate::error::GgufError;
use crate::GgmlType;

/// wyrand: a small, fast, seedable generator (not cryptographic).
#[derive(Debug, Clone)]
pub struct WyRand(u64);

impl WyRand {
    /// A generator whose stream depends only on `seed`.
    pub fn new(seed: u64) -> WyRand {
        WyRand(seed)
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = (self.0 as u128).wrapping_mul((self.0 ^ 0xe703_7ed1_a0b4_28db) as u128);
        ((t >> 64) ^ t) as u64
    }

    /// Uniform in `[0, 1)`.
    #[inline]
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Mixes several words into one seed (splitmix64 finalizer per word).
pub fn mix_seed(words: &[u64]) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64;
    for &w in words {
        let mut z = h ^ w.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h = z ^ (z >> 31);
    }
    h
}

/// The types [`fill_random`] can write.
pub const SYNTH_TYPES: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q2_K,
];

fn half_bytes(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

/// A code in `{-k..=-1, 1..=k}`, uniform.
#[inline]
fn symmetric_code(r: u64, k: u32) -> i32 {
    let v = (r % (2 * k as u64)) as i32; // 0 .. 2k-1
    if v < k as i32 {
        v - k as i32 // -k .. -1
    } else {
        v - k as i32 + 1 // 1 .. k
    }
}

/// Fills `out` (whole blocks of `ty`) with random non-zero weights of mean 0
/// and standard deviation `std`, from `seed`. F32 and F16 get uniform
/// values in `±std·√3` (never exactly zero).
pub fn fill_random(ty: GgmlType, std: f32, seed: u64, out: &mut [u8]) -> Result<(), GgufError> {
    let ts = ty.type_size();
    if !out.len().is_multiple_of(ts) {
        return Err(GgufError::InvalidInput(format!(
            "{} bytes is not a whole number of {ty} blocks ({ts} bytes)",
            out.len()
        )));
    }
    if !(std.is_finite() && std > 0.0) {
        return Err(GgufError::InvalidInput(format!(
            "weight std must be positive and finite, got {std}"
        )));
    }
    let mut rng = WyRand::new(seed);
    match ty {
        GgmlType::F32 | GgmlType::F16 => {
            let half_width = std * 3f32.sqrt();
            for b in out.chunks_exact_mut(ts) {
                let mut x = (rng.next_f32() * 2.0 - 1.0) * half_width;
                if x == 0.0 {
                    x = half_width * 0.5;
                }
                if ty == GgmlType::F32 {
                    b.copy_from_slice(&x.to_le_bytes());
                } else {
                    let h = f16::from_f32(x);
                    let h = if h.to_f32() == 0.0 {
                        f16::from_f32(half_width * 0.5)
                    } else {
                        h
                    };
                    b.copy_from_slice(&h.to_bits().to_le_bytes());
                }
            }
        }
        GgmlType::Q8_0 => {
            // Codes ±1..=127: rms sqrt(128·255/6).
            let d = half_bytes(std / (128.0f32 * 255.0 / 6.0).sqrt());
            for b in out.chunks_exact_mut(ts) {
                b[..2].copy_from_slice(&d);
                // 16 random bits per code.
                for q in b[2..].chunks_mut(4) {
                    let mut r = rng.next_u64();
                    for x in q {
                        *x = symmetric_code(r & 0xffff, 127) as i8 as u8;
                        r >>= 16;
                    }
                }
            }
        }
        GgmlType::Q4_0 => {
            // Nibble n, value n - 8 in ±1..=7: rms sqrt(20).
            let d = half_bytes(std / 20f32.sqrt());
            for b in out.chunks_exact_mut(ts) {
                b[..2].copy_from_slice(&d);
                // 16 random bits per code, two codes per byte.
                for q in b[2..18].chunks_mut(2) {
                    let mut r = rng.next_u64();
                    for x in q {
                        let lo = (symmetric_code(r & 0xffff, 7) + 8) as u8;
                        let hi = (symmetric_code((r >> 16) & 0xffff, 7) + 8) as u8;
                        *x = lo | (hi << 4);
                        r >>= 32;
                    }
                }
            }
        }
        GgmlType::Q5_0 => {
            // 5-bit q, value q - 16 in ±1..=15: rms sqrt(1240/15).
            let d = half_bytes(std / (1240.0f32 / 15.0).sqrt());
            for b in out.chunks_exact_mut(ts) {
                b[..2].copy_from_slice(&d);
                let mut qh = 0u32;
                let mut qs = [0u8; 16];
                for j in 0..32 {
                    let q = (symmetric_code(rng.next_u64() & 0xffff, 15) + 16) as u32;
                    // Element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j-16].
                    if j < 16 {
                        qs[j] |= (q & 0xf) as u8;
                    } else {
                        qs[j - 16] |= ((q & 0xf) as u8) << 4;
                    }
                    qh |= ((q >> 4) & 1) << j;
                }
                b[2..6].copy_from_slice(&qh.to_le_bytes());
                b[6..22].copy_from_slice(&qs);
            }
        }
        GgmlType::Q4_K => {
            // Every sub-block: scale 2, min 15, dmin = d, so a weight is
            // d·(2q - 15), q in 0..16: odd multiples of d up to ±15d, rms sqrt(85)·d.
            let d = std / 85f32.sqrt();
            let dh = half_bytes(d);
            // 6-bit scales and mins of 8 sub-blocks packed the way ggml's get_scale_min_k4 reads them.
            let scales = pack_q4k_scales(&[2; 8], &[15; 8]);
            for b in out.chunks_exact_mut(ts) {
                b[0..2].copy_from_slice(&dh);
                b[2..4].copy_from_slice(&dh);
                b[4..16].copy_from_slice(&scales);
                for q in b[16..144].chunks_mut(8) {
                    q.copy_from_slice(&rng.next_u64().to_le_bytes());
                }
            }
        }
        GgmlType::Q6_K => {
            // Every 16-value group: scale 2, so a weight is 2d·(q - 32), q - 32
            // in ±1..=31: rms 2·sqrt(336)·d. Block: ql[128], qh[64],
            // scales[16], d. In each half of 128 values, value l (< 32) takes
            // the low nibble of ql[l] and bits 0-1 of qh[l], value l + 32 the
            // low nibble of ql[l + 32] and bits 2-3, l + 64 the high nibble of
            // ql[l] and bits 4-5, l + 96 the high nibble of ql[l + 32] and
            // bits 6-7 (ggml's dequantize_row_q6_K).
            let d = half_bytes(std / (2.0 * 336f32.sqrt()));
            for b in out.chunks_exact_mut(ts) {
                let (ql, rest) = b.split_at_mut(128);
                let (qh, rest) = rest.split_at_mut(64);
                rest[..16].fill(2);
                rest[16..18].copy_from_slice(&d);
                for half in 0..2 {
                    for l in 0..32 {
                        let c: [u8; 4] = std::array::from_fn(|_| {
                            (symmetric_code(rng.next_u64() & 0xffff, 31) + 32) as u8
                        });
                        ql[64 * half + l] = (c[0] & 15) | ((c[2] & 15) << 4);
                        ql[64 * half + l + 32] = (c[1] & 15) | ((c[3] & 15) << 4);
                        qh[32 * half + l] = (c[0] >> 4)
                            | ((c[1] >> 4) << 2)
                            | ((c[2] >> 4) << 4)
                            | ((c[3] >> 4) << 6);
                    }
                }
            }
        }
        GgmlType::Q2_K => {
            // Every 16-value group: scale 2, min 3, dmin = d, so a weight is
            // d·(2q - 3), q in 0..4: ±d, ±3d, rms sqrt(5)·d.
            let d = half_bytes(std / 5f32.sqrt());
            for b in out.chunks_exact_mut(ts) {
                b[0..16].fill(2 | (3 << 4));
                for q in b[16..80].chunks_mut(8) {
                    q.copy_from_slice(&rng.next_u64().to_le_bytes());
                }
                b[80..82].copy_from_slice(&d);
                b[82..84].copy_from_slice(&d);
            }
        }
        other => {
            return Err(GgufError::InvalidInput(format!(
                "random blocks of {other} are not implemented (supported: {})",
                SYNTH_TYPES
                    .iter()
                    .map(|t| t.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        }
    }
    Ok(())
}

/// Packs 8 six-bit scales and mins into Q4_K's 12 bytes (the inverse of
/// ggml's `get_scale_min_k4`).
fn pack_q4k_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0xf) | ((m[j + 4] & 0xf) << 4);
    }
    s
}

/// The shape and tokenizer of a tiny, complete llama-architecture model
/// ([`TinyModel::writer`]): every tensor the graph needs, F32 weights drawn
/// from a seed, a byte-level BPE vocabulary (the 256 GPT-2 byte tokens plus
/// `<|im_start|>` and `<|im_end|>`) and optionally a chat template. For
/// tests and fuzz seeds that need a model file that loads in milliseconds;
/// the weights mean nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyModel {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Model width.
    pub n_embd: usize,
    /// FFN width.
    pub n_ff: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// `{arch}.context_length`.
    pub n_ctx_train: usize,
    /// `tokenizer.chat_template`, if any.
    pub chat_template: Option<String>,
    /// Seed of the weights.
    pub seed: u64,
}

impl Default for TinyModel {
    fn default() -> Self {
        TinyModel {
            n_layer: 2,
            n_embd: 32,
            n_ff: 64,
            n_head: 4,
            n_head_kv: 2,
            n_ctx_train: 256,
            chat_template: Some(TINY_CHAT_TEMPLATE.to_owned()),
            seed: 1,
        }
    }
}

/// The ChatML template [`TinyModel::default`] carries.
pub const TINY_CHAT_TEMPLATE: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// GPT-2's byte-level alphabet: the printable character that stands for
/// byte `b` in a token's text.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    if printable(b) {
        return char::from(b);
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).expect("valid code point")
}

impl TinyModel {
    /// Tokens of the vocabulary (256 byte tokens, then the two specials).
    pub fn vocab_size(&self) -> usize {
        258
    }

    /// Metadata and tensors of the model, ready to edit or write.
    pub fn writer(&self) -> Result<crate::GgufWriter<'static>, GgufError> {
        use crate::{Metadata, Value, ValueType};
        let head_dim = self.n_embd / self.n_head.max(1);
        let mut md = Metadata::new();
        md.insert("general.architecture", Value::String("llama".into()));
        md.insert("general.name", Value::String("tiny".into()));
        let u32v = |x: usize| Value::U32(x as u32);
        md.insert("llama.block_count", u32v(self.n_layer));
        md.insert("llama.embedding_length", u32v(self.n_embd));
        md.insert("llama.feed_forward_length", u32v(self.n_ff));
        md.insert("llama.attention.head_count", u32v(self.n_head));
        md.insert("llama.attention.head_count_kv", u32v(self.n_head_kv));
        md.insert("llama.context_length", u32v(self.n_ctx_train));
        md.insert("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
        md.insert("llama.rope.freq_base", Value::F32(10_000.0));
        md.insert("tokenizer.ggml.model", Value::String("gpt2".into()));
        md.insert("tokenizer.ggml.pre", Value::String("gpt2".into()));
        let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
        tokens.push("<|im_start|>".into());
        tokens.push("<|im_end|>".into());
        let mut types = vec![Value::I32(1); 256];
        types.extend([Value::I32(3), Value::I32(3)]);
        md.insert("tokenizer.ggml.tokens", Value::string_array(tokens));
        md.insert(
            "tokenizer.ggml.token_type",
            Value::array(ValueType::I32, types),
        );
        md.insert(
            "tokenizer.ggml.merges",
            Value::array(ValueType::String, Vec::new()),
        );
        md.insert("tokenizer.ggml.bos_token_id", Value::U32(256));
        md.insert("tokenizer.ggml.eos_token_id", Value::U32(257));
        md.insert("tokenizer.ggml.add_bos_token", Value::Bool(false));
        if let Some(t) = &self.chat_template {
            md.insert("tokenizer.chat_template", Value::String(t.clone()));
        }
        let mut w = crate::GgufWriter::new(md);
        let mut seed = self.seed;
        let mut add =
            |w: &mut crate::GgufWriter<'static>, name: String, dims: Vec<u64>, std: f32| {
                let n: u64 = dims.iter().product();
                let mut data = vec![0u8; n as usize * 4];
                seed = mix_seed(&[seed, n]);
                fill_random(GgmlType::F32, std, seed, &mut data)?;
                w.add_tensor(name, dims, GgmlType::F32, data)
            };
        let (d, ff, v) = (
            self.n_embd as u64,
            self.n_ff as u64,
            self.vocab_size() as u64,
        );
        let q = (self.n_head * head_dim) as u64;
        let kv = (self.n_head_kv * head_dim) as u64;
        let std = 1.0 / (self.n_embd.max(1) as f32).sqrt();
        add(&mut w, "token_embd.weight".into(), vec![d, v], 1.0)?;
        for l in 0..self.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}");
            add(&mut w, n("attn_norm.weight"), vec![d], 1.0)?;
            add(&mut w, n("attn_q.weight"), vec![d, q], std)?;
            add(&mut w, n("attn_k.weight"), vec![d, kv], std)?;
            add(&mut w, n("attn_v.weight"), vec![d, kv], std)?;
            add(&mut w, n("attn_output.weight"), vec![q, d], std)?;
            add(&mut w, n("ffn_norm.weight"), vec![d], 1.0)?;
            add(&mut w, n("ffn_gate.weight"), vec![d, ff], std)?;
            add(&mut w, n("ffn_up.weight"), vec![d, ff], std)?;
            add(&mut w, n("ffn_down.weight"), vec![ff, d], std)?;
        }
        add(&mut w, "output_norm.weight".into(), vec![d], 1.0)?;
        Ok(w)
    }

    /// The model as GGUF bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        let mut out = Vec::new();
        self.writer()?.write_to(&mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_blocks_are_nonzero_zero_mean_and_have_the_asked_std() {
        let n = 256 * 64;
        for ty in SYNTH_TYPES {
            let mut bytes = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
            fill_random(ty, 0.05, 7, &mut bytes).unwrap();
            let mut w = vec![0f32; n];
            crate::quant::dequantize(ty, &bytes, &mut w).unwrap();
            assert!(
                w.iter().all(|x| x.is_finite() && *x != 0.0),
                "{ty}: a zero or non-finite weight"
            );
            let mean = w.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
            let std = (w.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
            assert!(mean.abs() < 0.003, "{ty}: mean {mean}");
            assert!((std - 0.05).abs() < 0.05 * 0.03, "{ty}: std {std}");
            // Same seed, same bytes; another seed, other bytes.
            let mut again = vec![0u8; bytes.len()];
            fill_random(ty, 0.05, 7, &mut again).unwrap();
            assert_eq!(again, bytes, "{ty}");
            fill_random(ty, 0.05, 8, &mut again).unwrap();
            assert_ne!(again, bytes, "{ty}");
        }
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(fill_random(GgmlType::Q8_0, 0.1, 0, &mut [0u8; 33]).is_err());
        assert!(fill_random(GgmlType::Q8_0, 0.0, 0, &mut [0u8; 34]).is_err());
        assert!(fill_random(
            GgmlType::Q5_K,
            0.1,
            0,
            &mut vec![0u8; GgmlType::Q5_K.type_size()]
        )
        .is_err());
    }
}
