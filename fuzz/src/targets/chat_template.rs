//! A chat template (from a model file: untrusted) compiled and rendered
//! over a conversation. Input: the template, then optionally a NUL byte and
//! NUL-separated message contents (alternating user/assistant). A hostile
//! template must end in a template error: not a panic, an abort, a hang or
//! an allocation over the cap.

use mirage_tokenizer::{ChatMessage, ChatTemplate};

use crate::{Rng, Target};

pub fn target() -> Target {
    Target {
        name: "chat_template",
        about: "chat template compile and render (bounded: size, fuel, recursion)",
        seeds,
        run,
        mutate: Some(mutate),
        dictionary: &[b"{{", b"}}", b"{%", b"%}", b" ~ ", b"|join", b"namespace(", b"range("],
        max_len: 1 << 14,
    }
}

fn seeds() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = vec![
        mirage_gguf::synth::TINY_CHAT_TEMPLATE.as_bytes().to_vec(),
        b"{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}[{{ m.role|upper }}] {{ m.content.strip() }}{% if not loop.last %}\n{% endif %}{% endfor %}{{ eos_token }}\0hello\0world".to_vec(),
        b"{% set ns = namespace(out='', n=0) %}{% for m in messages %}{% set ns.out = ns.out ~ m.content %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.out|tojson }} {{ ns.n }}".to_vec(),
        b"{% macro render(x, depth=0) %}{% if x is mapping %}{% for k, v in x|items %}{{ k }}={{ render(v, depth + 1) }};{% endfor %}{% else %}{{ x }}{% endif %}{% endmacro %}{{ render({'a': {'b': 1}, 'c': [1, 2]}) }}{{ messages|map(attribute='content')|join(', ') }}".to_vec(),
        b"{% set s %}{% for m in messages|reverse %}{{ m.content|replace('a', 'b')|indent(2) }}{% endfor %}{% endset %}{{ s|length }}{{ messages|selectattr('role', 'equalto', 'user')|list|length }}{{ '%s-%d'|format('x', 3) }}".to_vec(),
        b"{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}".to_vec(),
    ];
    // The real models' templates, when the models are fetched.
    let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
    for name in [
        "smollm2-135m-instruct-q4_1.gguf",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ] {
        if let Ok(f) = mirage_gguf::GgufFile::open(models.join(name)) {
            if let Some(t) = f.metadata().get_str("tokenizer.chat_template") {
                out.push(t.as_bytes().to_vec());
            }
        }
    }
    out
}

fn mutate(data: &mut Vec<u8>, rng: &mut Rng) {
    let split = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    let mut template = data[..split].to_vec();
    crate::structure::mutate_template(&mut template, rng);
    template.extend_from_slice(&data[split..]);
    *data = template;
}

fn run(data: &[u8]) {
    let mut parts = data.split(|&b| b == 0);
    let source = String::from_utf8_lossy(parts.next().unwrap_or(&[])).into_owned();
    let mut messages: Vec<ChatMessage> = parts
        .take(8)
        .enumerate()
        .map(|(i, c)| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            ChatMessage::new(role, String::from_utf8_lossy(c))
        })
        .collect();
    if messages.is_empty() {
        messages = vec![
            ChatMessage::new("system", "You are helpful."),
            ChatMessage::new("user", "Hello, <b>world</b> & 'quotes'"),
            ChatMessage::new("assistant", "Hi!"),
            ChatMessage::new("user", "2+2?"),
        ];
    }
    let Ok(t) = ChatTemplate::new(&source, "<s>", "</s>") else {
        return;
    };
    let _ = t.render(&messages, true);
    let _ = t.render(&messages[..1], false);
}
