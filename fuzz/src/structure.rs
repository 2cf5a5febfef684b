//! Structure-aware mutations the targets share: GGUF files (metadata values,
//! tensor tables) and Jinja template text. A byte mutation of a model file
//! mostly lands in tensor data, and a byte mutation of an artifact mostly
//! breaks a checksum; these change what the parsers and loaders look at and
//! write a file that still parses, so the checks behind the parser run.

use std::borrow::Cow;

use mirage_gguf::{GgmlType, GgufFile, GgufWriter, Value, ValueType};

use crate::Rng;

/// Keys the loaders read, for the mutator to add or change.
const KEYS: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "llama.block_count",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.attention.value_length",
    "llama.rope.dimension_count",
    "llama.context_length",
    "llama.vocab_size",
    "llama.rope.freq_base",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.rope.scaling.original_context_length",
    "llama.attention.layer_norm_rms_epsilon",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.chat_template",
];

const STRINGS: &[&str] = &[
    "llama", "qwen2", "qwen3", "gpt2", "llama3", "qwen2", "smollm", "none", "linear", "yarn", "",
    "x",
];

fn random_value(rng: &mut Rng) -> Value {
    let n = rng.interesting();
    match rng.below(9) {
        0 => Value::U32(n as u32),
        1 => Value::I32(n as i32),
        2 => Value::U64(n),
        3 => Value::I64(n as i64),
        4 => Value::F32(*rng.pick(&[0.0, -1.0, 1e-6, 4.0, f32::NAN, f32::INFINITY, 1e30])),
        5 => Value::Bool(rng.one_in(2)),
        6 => Value::String((*rng.pick(STRINGS)).into()),
        7 => Value::U8(n as u8),
        _ => Value::array(ValueType::U32, vec![Value::U32(n as u32); rng.below(4)]),
    }
}

/// Name, dims, type and bytes of one tensor being rewritten.
type Tensor<'a> = (String, Vec<u64>, GgmlType, Cow<'a, [u8]>);

/// The small llama model the GGUF targets start from: small enough that
/// most mutations land in metadata and the tensor table, not in weights.
pub fn tiny_model() -> mirage_gguf::synth::TinyModel {
    mirage_gguf::synth::TinyModel {
        n_layer: 2,
        n_embd: 8,
        n_ff: 16,
        n_head: 2,
        n_head_kv: 1,
        n_ctx_train: 64,
        ..Default::default()
    }
}

/// Mutates one thing of a parsed GGUF and writes it again; `false` when the
/// input does not parse or the writer refuses the result.
pub fn mutate_gguf(data: &mut Vec<u8>, rng: &mut Rng) -> bool {
    let Ok(file) = GgufFile::from_bytes(data.clone()) else {
        return false;
    };
    // Rewriting writes the declared alignment's padding (up to 4 GiB).
    if file.alignment() > 1 << 16 {
        return false;
    }
    let mut md = file.metadata().clone();
    let mut tensors: Vec<Tensor<'_>> = file
        .tensor_views()
        .map(|v| {
            (
                v.info.name.clone(),
                v.info.dims.clone(),
                v.info.ty,
                Cow::Borrowed(v.data),
            )
        })
        .collect();
    let keys: Vec<String> = md.iter().map(|(k, _)| k.to_string()).collect();
    match rng.below(10) {
        0 | 1 => {
            // A number where the loaders read one.
            let key = *rng.pick(KEYS);
            md.insert(key, random_value(rng));
        }
        2 if !keys.is_empty() => {
            let key = rng.pick(&keys).clone();
            let v = md.get(&key).cloned();
            let new = match v {
                Some(Value::String(s)) if key == "tokenizer.chat_template" => {
                    let mut t = s.into_bytes();
                    mutate_template(&mut t, rng);
                    Value::String(String::from_utf8_lossy(&t).into_owned())
                }
                Some(Value::Array(mut a)) if !a.values.is_empty() => {
                    match rng.below(3) {
                        0 => a.values.truncate(rng.below(a.values.len())),
                        1 => {
                            let i = rng.below(a.values.len());
                            let x = a.values[i].clone();
                            a.values.insert(rng.below(a.values.len()), x);
                        }
                        _ => {
                            let i = rng.below(a.values.len());
                            if let Value::String(s) = &mut a.values[i] {
                                s.push_str(rng.pick::<&str>(&["<|im_end|>", " ", "Ġ", "\u{0}"]));
                            } else {
                                a.values[i] = random_value(rng);
                            }
                        }
                    }
                    Value::Array(a)
                }
                _ => random_value(rng),
            };
            md.insert(key, new);
        }
        3 if !keys.is_empty() => {
            let key = rng.pick(&keys).clone();
            md.remove(&key);
        }
        4 | 5 if !tensors.is_empty() => {
            // New dims (and data of the right size) for one tensor.
            let i = rng.below(tensors.len());
            let mut dims = tensors[i].1.clone();
            if dims.is_empty() || rng.one_in(4) {
                dims.push(1 + rng.below(4) as u64);
            } else {
                let d = rng.below(dims.len());
                dims[d] = *rng.pick(&[0, 1, 2, 3, 4, 8, 16, 32, 64, 256, 1 << 20]);
            }
            let ty = if rng.one_in(3) {
                *rng.pick(&GgmlType::ALL)
            } else {
                tensors[i].2
            };
            let bytes = ty.bytes_for(dims.iter().product()).unwrap_or(u64::MAX);
            if bytes > 1 << 20 {
                return false;
            }
            let fill = rng.next_u64() as u8;
            tensors[i] = (
                tensors[i].0.clone(),
                dims,
                ty,
                Cow::Owned(vec![fill; bytes as usize]),
            );
        }
        6 if !tensors.is_empty() => {
            let i = rng.below(tensors.len());
            tensors.remove(i);
        }
        7 if !tensors.is_empty() => {
            // Rename: another block, another role.
            let i = rng.below(tensors.len());
            let name = &tensors[i].0;
            let new = match name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
                Some((_, rest)) if rng.one_in(2) => {
                    format!("blk.{}.{rest}", rng.pick(&[0, 1, 2, 3, 7, 1000]))
                }
                _ => (*rng.pick(&[
                    "token_embd.weight",
                    "output.weight",
                    "output_norm.weight",
                    "blk.0.attn_q.bias",
                    "blk.0.attn_q_norm.weight",
                    "blk.0.ffn_up.weight",
                ]))
                .to_string(),
            };
            if tensors.iter().all(|t| t.0 != new) {
                tensors[i].0 = new;
            }
        }
        8 if !tensors.is_empty() => {
            // Random values in one tensor (NaN, huge, denormal).
            let i = rng.below(tensors.len());
            let mut bytes = tensors[i].3.to_vec();
            for _ in 0..1 + rng.below(8) {
                if !bytes.is_empty() {
                    let at = rng.below(bytes.len());
                    bytes[at] = *rng.pick(&[0xff, 0x7f, 0x80, 0x00, 0x01]);
                }
            }
            tensors[i].3 = Cow::Owned(bytes);
        }
        _ => {
            let key = *rng.pick(KEYS);
            md.insert(key, random_value(rng));
        }
    }
    // The writer pads to the declared alignment (up to 4 GiB): keep it small.
    if md
        .get("general.alignment")
        .and_then(|v| v.as_u64())
        .is_some_and(|a| a > 1 << 16)
    {
        return false;
    }
    let mut w = GgufWriter::new(md);
    for (name, dims, ty, bytes) in tensors {
        if w.add_tensor(name, dims, ty, bytes).is_err() {
            return false;
        }
    }
    let mut out = Vec::new();
    if w.write_to(&mut out).is_err() {
        return false;
    }
    *data = out;
    true
}

/// Pieces of Jinja the template mutator inserts.
pub const JINJA: &[&str] = &[
    "{{ ",
    " }}",
    "{% ",
    " %}",
    "{%- ",
    " -%}",
    "{# c #}",
    "{% for m in messages %}",
    "{% endfor %}",
    "{% if ",
    "{% else %}",
    "{% endif %}",
    "{% set ns = namespace(s='x', n=0) %}",
    "{% set ns.s = ns.s ~ ns.s %}",
    "{% set ns.n = ns.n + 1 %}",
    "{% set s %}",
    "{% endset %}",
    "{% macro f(x, n=1) %}",
    "{% endmacro %}",
    "f(x ~ x, n - 1)",
    "{% call f(1) %}",
    "{% endcall %}",
    "caller()",
    "{% raw %}",
    "{% endraw %}",
    "{% filter upper %}",
    "{% endfilter %}",
    "{% with a = 1 %}",
    "{% endwith %}",
    "loop.index",
    "loop.first",
    "loop.cycle('a', 'b')",
    "messages[0]['content']",
    "m['role']",
    "m.content",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    " ~ ",
    " + ",
    " * ",
    " // ",
    " ** ",
    " % ",
    "-",
    "not ",
    " and ",
    " or ",
    " in ",
    " is defined",
    " if ",
    " else ",
    "(",
    ")",
    "[",
    "]",
    "[::-1]",
    "[1:]",
    ",",
    ":",
    "|length",
    "|join(', ')",
    "|tojson",
    "|tojson(indent=4)",
    "|trim",
    "|upper",
    "|list",
    "|string",
    "|replace('a', 'bb')",
    "|indent(4)",
    "|batch(2)",
    "|slice(3)",
    "|format(1)",
    "|first",
    "|last",
    "|selectattr('role', 'equalto', 'user')",
    "|map(attribute='content')",
    "|items",
    "|dictsort",
    "|default('d')",
    "|reverse",
    "|sort",
    "|unique",
    "|pprint",
    "|split",
    "|lines",
    "|int",
    "|round",
    ".strip()",
    ".split(',')",
    ".replace('', 'x')",
    ".format(1)",
    ".join(['a','b'])",
    ".startswith('a')",
    ".upper()",
    ".items()",
    ".get('k')",
    "range(",
    "range(100000)",
    "dict(a=1)",
    "namespace(",
    "raise_exception('no')",
    "'str'",
    "\"s\"",
    "1000000000",
    "1e308",
    "-1",
    "0",
    "none",
    "true",
    "[1, 2]",
    "{'a': 1}",
    "*args",
    "**kw",
];

/// Mutates template text: inserts a Jinja piece, replaces a number with a
/// large one, duplicates or deletes a span.
pub fn mutate_template(text: &mut Vec<u8>, rng: &mut Rng) {
    let at = rng.below(text.len() + 1);
    match rng.below(5) {
        0 | 1 => {
            let piece = rng.pick(JINJA).as_bytes();
            text.splice(at..at, piece.iter().copied());
        }
        2 => {
            // A number becomes a large one.
            if let Some(p) = text[at..].iter().position(|b| b.is_ascii_digit()) {
                let start = at + p;
                let end = text[start..]
                    .iter()
                    .position(|b| !b.is_ascii_digit())
                    .map_or(text.len(), |e| start + e);
                let n = rng.interesting().to_string();
                text.splice(start..end, n.bytes());
            }
        }
        3 if !text.is_empty() => {
            let n = 1 + rng.below((text.len() - at.min(text.len() - 1)).min(64));
            let at = at.min(text.len() - 1);
            let chunk = text[at..(at + n).min(text.len())].to_vec();
            text.splice(at..at, chunk);
        }
        _ if !text.is_empty() => {
            let at = at.min(text.len() - 1);
            let n = 1 + rng.below((text.len() - at).min(32));
            text.drain(at..at + n);
        }
        _ => text.extend_from_slice(rng.pick(JINJA).as_bytes()),
    }
}
