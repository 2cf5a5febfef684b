//! Chat templates (`tokenizer.chat_template`) rendered with minijinja.
//!
//! Hugging Face renders these Jinja templates with `trim_blocks` and `lstrip_blocks` on and adds
//! `raise_exception`; the templates call Python string methods (`.strip()`, `.startswith()`, ...),
//! which minijinja-contrib's `pycompat` callback supplies, and `tojson`, which is Python's
//! `json.dumps` there (`", "` / `": "` separators, non-ASCII kept, key order kept).
//!
//! [`ChatTemplate::render`] takes plain role/content messages; [`ChatTemplate::render_json`] takes
//! OpenAI-style JSON messages (assistant `tool_calls`, `tool` results) and the `tools` list, for
//! templates that render tools (Qwen2.5's). For templates that do not,
//! [`ChatTemplate::supports_tools`] is false and [`ChatTemplate::render_json`] writes the tools into
//! the system message in the same `<tools>` / `<tool_call>` format (Hermes style, as Qwen2.5's
//! template does), and tool calls and results into assistant and user text.
//!
//! A template comes from the model file and is untrusted: what one render may compute is bounded
//! (fuel, recursion, and the size of every string, list and output it builds: see
//! [`crate::chat_limits`]), and a template that does not parse, or a render over those bounds, is a
//! [`TokenizerError::Template`] naming the problem.

use minijinja::machinery::WhitespaceConfig;
use minijinja::{Environment, ErrorKind, Value};

use crate::chat_limits;
use serde::Serialize;

use crate::TokenizerError;

const TEMPLATE_NAME: &str = "chat";

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// "system", "user", "assistant", ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template plus the BOS/EOS strings it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    supports_tools: bool,
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`, which is what transformers'
/// `tojson` filter calls.
pub fn python_json(value: &serde_json::Value, indent: Option<usize>) -> String {
    fn string(s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    fn go(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        let newline = |out: &mut String, depth: usize| {
            if let Some(n) = indent {
                out.push('\n');
                out.push_str(&" ".repeat(n * depth));
            }
        };
        // Python: ", " between items without indent, "," with it.
        let sep = if indent.is_some() { "," } else { ", " };
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
                (Some(i), _, _) => out.push_str(&i.to_string()),
                (_, Some(u), _) => out.push_str(&u.to_string()),
                (_, _, Some(f)) => out.push_str(&python_float(f)),
                _ => out.push_str(&n.to_string()),
            },
            J::String(s) => string(s, out),
            J::Array(a) if a.is_empty() => out.push_str("[]"),
            J::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(sep);
                    }
                    newline(out, depth + 1);
                    go(x, indent, depth + 1, out);
                }
                newline(out, depth);
                out.push(']');
            }
            J::Object(m) if m.is_empty() => out.push_str("{}"),
            J::Object(m) => {
                out.push('{');
                for (i, (k, x)) in m.iter().enumerate() {
                    if i > 0 {
                        out.push_str(sep);
                    }
                    newline(out, depth + 1);
                    string(k, out);
                    out.push_str(": ");
                    go(x, indent, depth + 1, out);
                }
                newline(out, depth);
                out.push('}');
            }
        }
    }
    let mut out = String::new();
    go(value, indent, 0, &mut out);
    out
}

/// Python's `repr(float)` for finite values (`1.0`, `0.5`, `1e-07`, `1e+16`).
fn python_float(f: f64) -> String {
    if !f.is_finite() {
        return if f.is_nan() {
            "NaN".into()
        } else if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let exp = if f == 0.0 {
        0
    } else {
        f.abs().log10().floor() as i32
    };
    if (-5..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        // Shortest round-trip digits in exponent form, Python's style (e-07, e+16).
        let s = format!("{f:e}");
        let (m, e) = s.split_once('e').unwrap_or((&s, "0"));
        let e: i32 = e.parse().unwrap_or(0);
        format!("{m}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
    }
}

fn template_error(e: minijinja::Error) -> TokenizerError {
    // Include the chain of causes: minijinja wraps the root error of a failed call.
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    TokenizerError::Template(message)
}

/// Runs a call into minijinja, turning a panic inside it into an error:
/// minijinja 2.24 panics on some templates (reversing an empty string or
/// list, `''[::-1]`), and a template from a model file must not take the
/// process down.
fn engine_call<T>(f: impl FnOnce() -> Result<T, minijinja::Error>) -> Result<T, minijinja::Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("a panic");
        Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("the template engine failed: {what}"),
        ))
    })
}

impl ChatTemplate {
    /// Compile `source`; `bos_token` / `eos_token` are the texts the template sees under those names.
    pub fn new(
        source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, TokenizerError> {
        if source.len() > chat_limits::MAX_SOURCE_BYTES {
            return Err(TokenizerError::Template(format!(
                "the template has {} bytes, more than the {} accepted",
                source.len(),
                chat_limits::MAX_SOURCE_BYTES
            )));
        }
        let ws = WhitespaceConfig {
            keep_trailing_newline: false,
            lstrip_blocks: true,
            trim_blocks: true,
        };
        let (checked_source, longest_text) =
            engine_call(|| chat_limits::rewrite_operators(source, ws)).map_err(template_error)?;
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(chat_limits::method);
        env.set_formatter(chat_limits::formatter);
        env.set_recursion_limit(chat_limits::RECURSION_LIMIT);
        // Each emit of literal text costs one unit of fuel: this bounds the
        // text a loop can emit into a macro's or block's output.
        let fuel =
            (chat_limits::RAW_TEXT_BUDGET / longest_text.max(1) as u64).min(chat_limits::MAX_FUEL);
        env.set_fuel(Some(fuel));
        chat_limits::install(&mut env);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        engine_call(|| env.add_template_owned(TEMPLATE_NAME, checked_source))
            .map_err(template_error)?;
        // A template renders tools when it reads the `tools` variable.
        let supports_tools = env
            .get_template(TEMPLATE_NAME)
            .map(|t| t.undeclared_variables(false).contains("tools"))
            .unwrap_or(false);
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            supports_tools,
        })
    }

    /// Read `tokenizer.chat_template` and the BOS/EOS token texts from a GGUF file.
    pub fn from_gguf(file: &mirage_gguf::GgufFile) -> Result<ChatTemplate, TokenizerError> {
        let meta = crate::gguf::TokenizerMetadata::read(file)?;
        let source = meta
            .chat_template
            .as_deref()
            .ok_or(TokenizerError::MissingKey("tokenizer.chat_template"))?;
        let text_of = |id: Option<u32>| {
            id.and_then(|id| meta.tokens.get(id as usize))
                .cloned()
                .unwrap_or_default()
        };
        ChatTemplate::new(source, &text_of(meta.bos_id), &text_of(meta.eos_id))
    }

    /// Render a conversation; with `add_generation_prompt` the text ends where the assistant's reply
    /// begins (e.g. `<|im_start|>assistant\n`).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(template_error)?;
        let input: u64 = messages
            .iter()
            .map(|m| (m.role.len() + m.content.len() + 16) as u64)
            .sum::<u64>()
            + (self.bos_token.len() + self.eos_token.len()) as u64;
        let limit = chat_limits::BASE_LIMIT
            .saturating_add(input.saturating_mul(chat_limits::LIMIT_PER_INPUT_BYTE));
        let mut out = chat_limits::CappedString {
            text: String::new(),
            cap: usize::try_from(limit).unwrap_or(usize::MAX),
            overflowed: false,
        };
        let rendered = chat_limits::with_limit(limit, || {
            engine_call(|| {
                template.render_captured_to(
                    minijinja::context! {
                        messages => messages,
                        add_generation_prompt => add_generation_prompt,
                        bos_token => &self.bos_token,
                        eos_token => &self.eos_token,
                    },
                    &mut out,
                )
            })
            .map(|_| ())
        });
        if out.overflowed {
            return Err(TokenizerError::Template(format!(
                "the output would exceed this render's limit of {limit} bytes"
            )));
        }
        rendered.map_err(template_error)?;
        Ok(out.text)
    }
}

impl ChatTemplate {
    /// Whether the template itself renders a `tools` list.
    pub fn supports_tools(&self) -> bool {
        self.supports_tools
    }

    /// Renders OpenAI-style messages (a JSON array of objects with `role`, `content` — a string or
    /// null — and, for assistants, `tool_calls: [{"function": {"name", "arguments"}}]`, where
    /// `arguments` is an object; `tool` messages carry results) with an optional `tools` list
    /// (OpenAI's `[{"type": "function", "function": {...}}]`). Templates that do not render tools
    /// get them in the system message instead (see the module doc).
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let tools = tools.filter(|t| t.as_array().is_some_and(|a| !a.is_empty()));
        let rewritten;
        let messages = if tools.is_some() && !self.supports_tools
            || has_tool_turns(messages) && !self.supports_tools
        {
            rewritten = hermes_messages(messages, tools);
            &rewritten
        } else {
            messages
        };
        let tools = tools.filter(|_| self.supports_tools);
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(template_error)?;
        // The same output and time bounds as `render`, by the size of the input.
        let input = (messages.to_string().len()
            + tools.map_or(0, |t| t.to_string().len())
            + self.bos_token.len()
            + self.eos_token.len()) as u64;
        let limit = chat_limits::BASE_LIMIT
            .saturating_add(input.saturating_mul(chat_limits::LIMIT_PER_INPUT_BYTE));
        let mut out = chat_limits::CappedString {
            text: String::new(),
            cap: usize::try_from(limit).unwrap_or(usize::MAX),
            overflowed: false,
        };
        let messages = Value::from_serialize(messages);
        let tools = tools.map(Value::from_serialize);
        let rendered = chat_limits::with_limit(limit, || {
            engine_call(|| {
                template.render_captured_to(
                    minijinja::context! {
                        messages => messages,
                        tools => tools,
                        add_generation_prompt => add_generation_prompt,
                        bos_token => &self.bos_token,
                        eos_token => &self.eos_token,
                    },
                    &mut out,
                )
            })
            .map(|_| ())
        });
        if out.overflowed {
            return Err(TokenizerError::Template(format!(
                "the output would exceed this render's limit of {limit} bytes"
            )));
        }
        rendered.map_err(template_error)?;
        Ok(out.text)
    }
}

fn has_tool_turns(messages: &serde_json::Value) -> bool {
    messages.as_array().is_some_and(|ms| {
        ms.iter()
            .any(|m| m["role"] == "tool" || m.get("tool_calls").is_some_and(|t| !t.is_null()))
    })
}

/// The tool instructions Qwen2.5's template writes, for templates without their own.
fn hermes_tool_system(system: &str, tools: &serde_json::Value) -> String {
    let mut s = String::from(system);
    if !s.is_empty() {
        s.push_str("\n\n");
    }
    s.push_str("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>");
    for t in tools.as_array().into_iter().flatten() {
        s.push('\n');
        s.push_str(&python_json(t, None));
    }
    s.push_str("\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
    s
}

/// Plain role/content messages carrying tools, tool calls and tool results as text.
fn hermes_messages(
    messages: &serde_json::Value,
    tools: Option<&serde_json::Value>,
) -> serde_json::Value {
    use serde_json::{json, Value as J};
    let text = |m: &J| m["content"].as_str().unwrap_or("").to_string();
    let mut out: Vec<J> = Vec::new();
    let ms = messages.as_array().cloned().unwrap_or_default();
    let mut rest = &ms[..];
    if let Some(tools) = tools {
        let system = match ms.first() {
            Some(m) if m["role"] == "system" => {
                rest = &ms[1..];
                text(m)
            }
            _ => String::new(),
        };
        out.push(json!({"role": "system", "content": hermes_tool_system(&system, tools)}));
    }
    for m in rest {
        if m["role"] == "tool" {
            let block = format!("<tool_response>\n{}\n</tool_response>", text(m));
            // Consecutive results share one user turn.
            match out.last_mut() {
                Some(last) if last["role"] == "user" && last.get("tool_results").is_some() => {
                    let c = format!("{}\n{block}", last["content"].as_str().unwrap_or(""));
                    last["content"] = J::String(c);
                }
                _ => out.push(json!({"role": "user", "content": block, "tool_results": true})),
            }
        } else if let Some(calls) = m.get("tool_calls").and_then(J::as_array) {
            let mut c = text(m);
            for call in calls {
                let f = call.get("function").unwrap_or(call);
                if !c.is_empty() {
                    c.push('\n');
                }
                c.push_str(&format!(
                    "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
                    python_json(&f["name"], None),
                    python_json(&f["arguments"], None)
                ));
            }
            out.push(json!({"role": m["role"].clone(), "content": c}));
        } else {
            out.push(json!({"role": m["role"].clone(), "content": text(m)}));
        }
    }
    for m in &mut out {
        if let Some(o) = m.as_object_mut() {
            o.remove("tool_results");
        }
    }
    J::Array(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_with_python_methods_and_block_trimming() {
        let t = ChatTemplate::new(
            "{% for m in messages %}\n  {{ m.role.upper() }}:{{ m.content.strip() }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let out = t
            .render(&[ChatMessage::new("user", "  hi  ")], true)
            .unwrap();
        // Same output as Python jinja2 with trim_blocks + lstrip_blocks.
        assert_eq!(out, "  USER:hi\nA:");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("no system role"), "{err}");
    }
}
