//! `mirage-cli chat`: an interactive terminal chat with history.

use std::io::{BufRead, Write};

use anyhow::Context;
use clap::Args;
use mirage::{Backend, Engine, WithEngine};
use mirage_tokenizer::ChatMessage;

use super::generate::{ModelArgs, SamplingArgs};

/// Arguments of `chat`.
#[derive(Debug, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// System prompt.
    #[arg(long)]
    system: Option<String>,
}

/// Runs `chat`: one user message per stdin line; `/exit` quits, `/reset`
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

fn chat_with<B: Backend>(engine: &Engine<B>, args: &ChatArgs) -> anyhow::Result<()> {
    if let Some(why) = engine.chat_template_error() {
        anyhow::bail!("{}: {why}", args.model.model.display());
    }
    let params = args.sampling.params();
    let mut session = engine.session()?;
    let fresh = || -> Vec<ChatMessage> {
        args.system
            .iter()
            .map(|s| ChatMessage::new("system", s.as_str()))
            .collect()
    };
    let mut history = fresh();
    eprintln!(
        "chat with {} on {} (/exit to quit, /reset to start over)",
        args.model.model.display(),
        engine.backend_name()
    );
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line).context("reading stdin")? == 0 {
            break;
        }
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
        let text = engine.render_chat(&history)?;
        // Re-tokenize the whole conversation; the session reuses the
        // cached prefix, so only the new turn runs through the model.
        let context = engine.encode(&text, true)?;
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
        history.push(ChatMessage::new("assistant", out.text.trim()));
    }
    Ok(())
}
