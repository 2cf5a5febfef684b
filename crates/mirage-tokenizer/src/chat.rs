//! Chat templates (`tokenizer.chat_template`) rendered with minijinja.
//!
//! Hugging Face renders these Jinja templates with `trim_blocks` and `lstrip_blocks` on and adds
//! `raise_exception`; the templates call Python string methods (`.strip()`, `.startswith()`, ...),
//! which minijinja-contrib's `pycompat` callback supplies. `tools` is left undefined (no tool use).
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
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
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
