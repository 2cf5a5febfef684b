//! Tool calls in the Hermes format Qwen2.5's chat template asks for (and
//! `mirage_tokenizer::ChatTemplate::render_json` writes for templates
//! without their own):
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! [`tool_call_grammar`] forces such calls (OpenAI's `tool_choice`
//! `required` or a named function), [`parse_tool_calls`] splits finished
//! output into text and calls, and [`ToolCallStream`] does the same for
//! streamed text.

use serde_json::{json, Value};

use crate::{GrammarError, GrammarSpec};

/// Where a tool call starts.
pub const CALL_OPEN: &str = "<tool_call>";
/// Where it ends.
pub const CALL_CLOSE: &str = "</tool_call>";

/// OpenAI's `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No calls (the tools are not shown to the model either).
    None,
    /// The model decides; calls it writes are parsed out.
    Auto,
    /// At least one call, to any of the tools.
    Required,
    /// A call to this function.
    Named(String),
}

/// One parsed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// The function name.
    pub name: String,
    /// Its arguments as compact JSON text (OpenAI's `arguments` string).
    pub arguments: String,
}

/// The names and parameter schemas of OpenAI-style `tools`
/// (`[{"type": "function", "function": {"name", "parameters"}}]`).
fn functions(tools: &Value) -> Result<Vec<(String, Value)>, GrammarError> {
    let list = tools
        .as_array()
        .ok_or_else(|| GrammarError::Invalid("`tools` must be an array".into()))?;
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let f = t.get("function").unwrap_or(t);
            let name = f["name"]
                .as_str()
                .filter(|n| !n.is_empty())
                .ok_or_else(|| GrammarError::Invalid(format!("tools[{i}] has no function name")))?;
            let params = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object"}),
                Some(p) => p.clone(),
            };
            Ok((name.to_string(), params))
        })
        .collect()
}

/// The grammar that makes the model answer with tool calls only: one or
/// more (`parallel`) for [`ToolChoice::Required`], to the named function
/// for [`ToolChoice::Named`]; `None` for `Auto` and `None` (free text).
/// Arguments follow each function's `parameters` schema.
pub fn tool_call_grammar(
    tools: &Value,
    choice: &ToolChoice,
    parallel: bool,
) -> Result<Option<GrammarSpec>, GrammarError> {
    let all = functions(tools)?;
    let chosen: Vec<&(String, Value)> = match choice {
        ToolChoice::None | ToolChoice::Auto => return Ok(None),
        ToolChoice::Required => all.iter().collect(),
        ToolChoice::Named(n) => all.iter().filter(|(name, _)| name == n).collect(),
    };
    if chosen.is_empty() {
        return Err(GrammarError::Invalid(match choice {
            ToolChoice::Named(n) => format!("tool_choice names `{n}`, which is not in `tools`"),
            _ => "tool_choice `required` needs at least one tool".into(),
        }));
    }
    let alternatives: Vec<Value> = chosen
        .iter()
        .map(|(name, params)| {
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": false
            })
        })
        .collect();
    let mut schema = if alternatives.len() == 1 {
        alternatives.into_iter().next().expect("one")
    } else {
        json!({"anyOf": alternatives})
    };
    schema["x-guidance"] = json!({
        "item_separator": ", ",
        "key_separator": ": ",
        "whitespace_flexible": false
    });
    let schema =
        serde_json::to_string(&schema).map_err(|e| GrammarError::Invalid(e.to_string()))?;
    let repeat = if parallel { " (\"\\n\" call)*" } else { "" };
    Ok(Some(GrammarSpec::Lark(format!(
        "%llguidance {{}}\nstart: call{repeat}\ncall: \"{CALL_OPEN}\\n\" body \"\\n{CALL_CLOSE}\"\nbody: %json {schema}\n"
    ))))
}

/// A `<tool_call>` body as a call, if it is `{"name": string, "arguments": ...}`.
fn call_of(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        // Some models write the arguments as a JSON string already.
        Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok() => s.clone(),
        Some(a) => serde_json::to_string(a).ok()?,
    };
    Some(ToolCall { name, arguments })
}

/// Splits finished output into its text (outside the call blocks, trimmed;
/// the whole text unchanged when there is no call) and its calls. A block
/// whose body is not a call stays in the text; an unclosed last block
/// counts when its body is a whole call.
pub fn parse_tool_calls(text: &str) -> (String, Vec<ToolCall>) {
    let mut stream = ToolCallStream::default();
    let mut events = stream.push(text);
    events.extend(stream.finish());
    let (mut content, mut calls) = (String::new(), Vec::new());
    for e in events {
        match e {
            ToolStreamEvent::Content(c) => content.push_str(&c),
            ToolStreamEvent::Call(c) => calls.push(c),
        }
    }
    if calls.is_empty() {
        return (text.to_string(), calls);
    }
    (content.trim().to_string(), calls)
}

/// What [`ToolCallStream`] found in the text so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolStreamEvent {
    /// Text for the reply's content.
    Content(String),
    /// A whole tool call.
    Call(ToolCall),
}

/// Finds tool calls in streamed text: text is passed on as soon as it
/// cannot be the start of `<tool_call>`; a call is reported whole once
/// its block closes. Whitespace between calls is dropped, as in
/// [`parse_tool_calls`].
#[derive(Debug, Default)]
pub struct ToolCallStream {
    pending: String,
    in_call: bool,
    calls: usize,
}

impl ToolCallStream {
    /// Calls found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Takes the next piece of text.
    pub fn push(&mut self, piece: &str) -> Vec<ToolStreamEvent> {
        self.pending.push_str(piece);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(end) = self.pending.find(CALL_CLOSE) else {
                    return out;
                };
                let body = self.pending[..end].to_string();
                self.pending.drain(..end + CALL_CLOSE.len());
                self.in_call = false;
                match call_of(&body) {
                    Some(c) => {
                        self.calls += 1;
                        out.push(ToolStreamEvent::Call(c));
                    }
                    None => out.push(ToolStreamEvent::Content(format!(
                        "{CALL_OPEN}{body}{CALL_CLOSE}"
                    ))),
                }
                continue;
            }
            if let Some(start) = self.pending.find(CALL_OPEN) {
                let before: String = self.pending.drain(..start).collect();
                if !before.trim().is_empty() {
                    out.push(ToolStreamEvent::Content(before));
                }
                self.pending.drain(..CALL_OPEN.len());
                self.in_call = true;
                continue;
            }
            // Hold back a suffix that may still grow into `<tool_call>`,
            // and trailing whitespace (it may only precede a call).
            let mut safe = self.pending.len();
            for k in (1..CALL_OPEN.len()).rev() {
                if self.pending.ends_with(&CALL_OPEN[..k]) {
                    safe -= k;
                    break;
                }
            }
            let kept = self.pending[..safe].trim_end().len();
            if kept > 0 && (self.calls == 0 || !self.pending[..kept].trim().is_empty()) {
                let text: String = self.pending.drain(..kept).collect();
                out.push(ToolStreamEvent::Content(text));
            }
            return out;
        }
    }

    /// The end of the text: whatever was held back.
    pub fn finish(&mut self) -> Vec<ToolStreamEvent> {
        let rest = std::mem::take(&mut self.pending);
        if self.in_call {
            self.in_call = false;
            if let Some(c) = call_of(&rest) {
                self.calls += 1;
                return vec![ToolStreamEvent::Call(c)];
            }
            return vec![ToolStreamEvent::Content(format!("{CALL_OPEN}{rest}"))];
        }
        if rest.is_empty() || (self.calls > 0 && rest.trim().is_empty()) {
            return Vec::new();
        }
        vec![ToolStreamEvent::Content(rest)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_calls_and_keeps_other_text() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse_tool_calls(text);
        assert_eq!(content, "Let me check.");
        assert_eq!(
            calls,
            vec![
                ToolCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\":\"Paris\"}".into()
                },
                ToolCall {
                    name: "now".into(),
                    arguments: "{}".into()
                },
            ]
        );
        // No calls: the text as it is. A broken body stays text.
        assert_eq!(parse_tool_calls("  hi \n"), ("  hi \n".into(), vec![]));
        let broken = "<tool_call>\nnot json\n</tool_call>";
        assert_eq!(parse_tool_calls(broken), (broken.into(), vec![]));
        // An unclosed final call still counts when its body is whole.
        let (c, calls) =
            parse_tool_calls("<tool_call>\n{\"name\": \"now\", \"arguments\": \"{}\"}\n");
        assert_eq!((c.as_str(), calls.len()), ("", 1));
    }

    #[test]
    fn streaming_finds_the_same_calls_whatever_the_pieces() {
        let text = "Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": \"<b>\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>\n";
        let whole = parse_tool_calls(text);
        for size in [1, 2, 3, 5, 7, 64] {
            let mut s = ToolCallStream::default();
            let mut events = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            for chunk in chars.chunks(size) {
                events.extend(s.push(&chunk.iter().collect::<String>()));
            }
            events.extend(s.finish());
            let content: String = events
                .iter()
                .filter_map(|e| match e {
                    ToolStreamEvent::Content(c) => Some(c.as_str()),
                    _ => None,
                })
                .collect();
            let calls: Vec<ToolCall> = events
                .into_iter()
                .filter_map(|e| match e {
                    ToolStreamEvent::Call(c) => Some(c),
                    _ => None,
                })
                .collect();
            assert_eq!(
                (content.trim().to_string(), calls.clone()),
                whole,
                "size {size}"
            );
            assert!(!content.contains('<'), "size {size}: {content:?}");
        }
        // Plain text streams through unchanged, a lone `<` included.
        let mut s = ToolCallStream::default();
        let mut out = String::new();
        for p in ["a <", "b> c", " <tool", "s> d\n"] {
            for e in s.push(p) {
                if let ToolStreamEvent::Content(c) = e {
                    out.push_str(&c);
                }
            }
        }
        for e in s.finish() {
            if let ToolStreamEvent::Content(c) = e {
                out.push_str(&c);
            }
        }
        assert_eq!(out, "a <b> c <tools> d\n");
    }

    #[test]
    fn grammars_for_each_choice() {
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}}
        ]);
        assert!(tool_call_grammar(&tools, &ToolChoice::Auto, true)
            .unwrap()
            .is_none());
        assert!(tool_call_grammar(&tools, &ToolChoice::None, true)
            .unwrap()
            .is_none());
        let Some(GrammarSpec::Lark(g)) =
            tool_call_grammar(&tools, &ToolChoice::Required, true).unwrap()
        else {
            panic!()
        };
        assert!(g.contains("anyOf") && g.contains("(\"\\n\" call)*"), "{g}");
        let Some(GrammarSpec::Lark(g)) =
            tool_call_grammar(&tools, &ToolChoice::Named("now".into()), false).unwrap()
        else {
            panic!()
        };
        assert!(
            !g.contains("anyOf") && !g.contains("get_weather") && !g.contains(")*"),
            "{g}"
        );
        let e = tool_call_grammar(&tools, &ToolChoice::Named("nope".into()), false).unwrap_err();
        assert!(e.to_string().contains("`nope`"), "{e}");
        assert!(tool_call_grammar(&json!({}), &ToolChoice::Required, true).is_err());
    }
}
