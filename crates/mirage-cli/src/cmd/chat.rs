//! `mirage-cli chat`: an interactive terminal chat.
//!
//! On a terminal the input line has editing and history (rustyline; the
//! history file is `chat_history` under the user's data folder, e.g.
//! `~/.local/share/mirage/`). When stdin is not a terminal, lines are read
//! as they come and nothing is remembered. When the next turn would not fit
//! the context, the oldest turns are dropped (the system prompt is kept) and
//! stderr says so.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use mirage::{Backend, Engine, StopReason, WithEngine};
use mirage_tokenizer::ChatMessage;
use rustyline::error::ReadlineError;

use super::generate::{ModelArgs, SamplingArgs};

/// Arguments of `chat`.
#[derive(Debug, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// System prompt (kept when old turns are dropped to fit the context).
    #[arg(long, alias = "system-prompt")]
    system: Option<String>,
}

/// Runs `chat`: one user message per line; `/exit` quits, `/reset`
/// forgets the conversation.
pub fn run(args: ChatArgs) -> anyhow::Result<()> {
    args.model.with_engine(Chat(&args))
}

struct Chat<'a>(&'a ChatArgs);

impl WithEngine for Chat<'_> {
    type Out = anyhow::Result<()>;
    fn run<B: Backend>(self, engine: Engine<B>) -> anyhow::Result<()> {
        chat_with(&engine, self.0)
    }
}

/// Where user lines come from.
enum Input {
    /// A terminal: line editing, history kept in `history` (if a data folder exists).
    Terminal {
        editor: Box<rustyline::DefaultEditor>,
        history: Option<PathBuf>,
    },
    /// A pipe or file: plain lines, no history.
    Plain(std::io::StdinLock<'static>),
}

impl Input {
    fn open() -> anyhow::Result<Input> {
        if !std::io::stdin().is_terminal() {
            return Ok(Input::Plain(std::io::stdin().lock()));
        }
        let config = rustyline::Config::builder()
            .max_history_size(1000)?
            .auto_add_history(false)
            .build();
        let mut editor = Box::new(
            rustyline::DefaultEditor::with_config(config).context("starting the line editor")?,
        );
        let history = dirs::data_dir().map(|d| d.join("mirage").join("chat_history"));
        if let Some(path) = &history {
            // A missing history file is the normal first run.
            let _ = editor.load_history(path);
        }
        Ok(Input::Terminal { editor, history })
    }

    /// The next line, or `None` at end of input (Ctrl-D, Ctrl-C, EOF).
    fn next_line(&mut self) -> anyhow::Result<Option<String>> {
        match self {
            Input::Terminal { editor, .. } => match editor.readline("> ") {
                Ok(line) => {
                    if !line.trim().is_empty() {
                        let _ = editor.add_history_entry(line.as_str());
                    }
                    Ok(Some(line))
                }
                Err(ReadlineError::Eof | ReadlineError::Interrupted) => Ok(None),
                Err(e) => Err(e).context("reading a line"),
            },
            Input::Plain(stdin) => {
                let mut line = String::new();
                if stdin.read_line(&mut line).context("reading stdin")? == 0 {
                    return Ok(None);
                }
                Ok(Some(line))
            }
        }
    }

    /// Writes the history file (a failure is a warning: the chat itself worked).
    fn save(&mut self) {
        if let Input::Terminal {
            editor,
            history: Some(path),
        } = self
        {
            let saved = path
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .map_err(anyhow::Error::from)
                .and_then(|()| editor.save_history(path).map_err(anyhow::Error::from));
            if let Err(e) = saved {
                tracing::warn!("could not save the chat history to {}: {e}", path.display());
            }
        }
    }
}

/// Drops the oldest turns of `history` until `fits` accepts it. Leading
/// system messages and the last message (the turn about to be answered)
/// are kept; a user message is dropped together with the replies that
/// follow it. Returns how many messages were dropped, or an error when even
/// the system prompt and the last message alone do not fit.
pub fn shift_context(
    history: &mut Vec<ChatMessage>,
    mut fits: impl FnMut(&[ChatMessage]) -> anyhow::Result<bool>,
) -> anyhow::Result<usize> {
    let first = history.iter().take_while(|m| m.role == "system").count();
    let mut dropped = 0;
    while !fits(history)? {
        let last = history.len() - 1;
        if first >= last {
            bail!("the message alone does not fit the context: use a larger --ctx-size or a shorter message");
        }
        // One turn: the oldest message and everything up to the next user message.
        let mut end = first + 1;
        while end < last && history[end].role != "user" {
            end += 1;
        }
        history.drain(first..end);
        dropped += end - first;
    }
    Ok(dropped)
}

fn roles(history: &[ChatMessage]) -> String {
    history
        .iter()
        .map(|m| m.role.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn chat_with<B: Backend>(engine: &Engine<B>, args: &ChatArgs) -> anyhow::Result<()> {
    if let Some(why) = engine.chat_template_error() {
        bail!("{}: {why}", args.model.model.display());
    }
    let params = args.sampling.params();
    let n_ctx = engine.n_ctx();
    // Room kept for the reply: the asked-for tokens, but at most half the context
    // so that a long --max-tokens does not leave no room for the conversation.
    let reply_room = params.max_tokens.min(n_ctx / 2);
    let mut session = engine.session()?;
    let fresh = || -> Vec<ChatMessage> {
        args.system
            .iter()
            .map(|s| ChatMessage::new("system", s.as_str()))
            .collect()
    };
    let mut history = fresh();
    eprintln!(
        "chat with {} on {}, {n_ctx} positions (/exit to quit, /reset to start over)",
        args.model.model.display(),
        engine.backend_name()
    );
    let mut input = Input::open()?;
    let plain = matches!(input, Input::Plain(_));
    let mut stdout = std::io::stdout();
    loop {
        if plain {
            eprint!("> ");
        }
        let Some(line) = input.next_line()? else {
            break;
        };
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history = fresh();
                session.reset();
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage::new("user", line));
        let shifted = shift_context(&mut history, |h| {
            let text = engine.render_chat(h)?;
            Ok(engine.encode(&text, true)?.len() + reply_room <= n_ctx)
        });
        match shifted {
            Ok(0) => {}
            Ok(n) => eprintln!(
                "(context shift: dropped the {n} oldest messages to fit {n_ctx} positions; kept {})",
                if args.system.is_some() {
                    "the system prompt and the latest turns"
                } else {
                    "the latest turns"
                }
            ),
            Err(e) => {
                history.pop();
                eprintln!("error: {e:#}");
                continue;
            }
        }
        let text = engine.render_chat(&history)?;
        // Re-tokenize the whole conversation; the session reuses the
        // cached prefix, so only what changed runs through the model.
        let context = engine.encode(&text, true)?;
        tracing::debug!(
            "prompt: {} tokens, roles: {}",
            context.len(),
            roles(&history)
        );
        let out = session.generate_from(&context, &params, |piece| {
            stdout
                .write_all(piece.as_bytes())
                .and_then(|_| stdout.flush())
                .is_ok()
        })?;
        println!();
        eprintln!(
            "[{} tokens, prompt {:.1} tok/s, decode {:.1} tok/s]",
            out.stats.generated_tokens,
            out.stats.prompt_tok_s(),
            out.stats.decode_tok_s()
        );
        if out.stats.stop_reason == StopReason::ContextFull {
            eprintln!("(the reply filled the context; older turns are dropped next time)");
        }
        history.push(ChatMessage::new("assistant", out.text.trim()));
    }
    input.save();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conversation() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "sys"),
            ChatMessage::new("user", "u1"),
            ChatMessage::new("assistant", "a1"),
            ChatMessage::new("user", "u2"),
            ChatMessage::new("assistant", "a2"),
            ChatMessage::new("user", "u3"),
        ]
    }

    fn contents(h: &[ChatMessage]) -> Vec<&str> {
        h.iter().map(|m| m.content.as_str()).collect()
    }

    #[test]
    fn shifting_drops_whole_old_turns_and_keeps_the_system_prompt() {
        let mut h = conversation();
        let n = shift_context(&mut h, |h| Ok(h.len() <= 4)).unwrap();
        assert_eq!(n, 2);
        assert_eq!(contents(&h), ["sys", "u2", "a2", "u3"]);
        let mut h = conversation();
        assert_eq!(shift_context(&mut h, |h| Ok(h.len() <= 2)).unwrap(), 4);
        assert_eq!(contents(&h), ["sys", "u3"]);
        // Nothing to do when it fits.
        let mut h = conversation();
        assert_eq!(shift_context(&mut h, |_| Ok(true)).unwrap(), 0);
        assert_eq!(h.len(), 6);
    }

    #[test]
    fn a_message_that_cannot_fit_is_an_error_not_a_loop() {
        let mut h = conversation();
        let err = shift_context(&mut h, |_| Ok(false)).unwrap_err();
        assert!(err.to_string().contains("--ctx-size"), "{err}");
        assert_eq!(contents(&h), ["sys", "u3"]);
        // Without a system prompt the last message is still kept.
        let mut h = conversation().split_off(1);
        assert_eq!(shift_context(&mut h, |h| Ok(h.len() <= 1)).unwrap(), 4);
        assert_eq!(contents(&h), ["u3"]);
    }
}
