//! A multi-turn chat with the model's chat template: each line of stdin is
//! a user turn (or each argument after the model, when given). The session
//! keeps the conversation's KV cache, so each turn only runs its new
//! tokens; it runs on a worker thread it was moved into, as a session of a
//! server or GUI would.
//!
//! `echo "Hi! Who are you?" | cargo run --release -p mirage --example chat -- models/smollm2-135m-instruct-q4_1.gguf`
use std::io::{BufRead, Write};
use std::sync::mpsc;

use mirage::{BackendChoice, ChatMessage, GenerateParams, LoadedEngine};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args.next().ok_or("usage: chat MODEL.gguf [MESSAGE...]")?;
    let given: Vec<String> = args.collect();
    let turns: Vec<String> = if given.is_empty() {
        std::io::stdin().lock().lines().collect::<Result<_, _>>()?
    } else {
        given
    };

    let engine = LoadedEngine::load(&model, BackendChoice::Auto)?;
    let session = engine.session()?;
    let (tx, rx) = mpsc::channel::<String>();
    // The session owns what it needs, so it moves into the worker.
    let worker = std::thread::spawn(move || -> Result<(), mirage::Error> {
        let mut session = session;
        let mut history = vec![ChatMessage::new("system", "You are a helpful assistant.")];
        let params = GenerateParams {
            max_tokens: 96,
            ..Default::default()
        };
        for user in rx {
            println!("user: {user}");
            history.push(ChatMessage::new("user", user));
            let context = engine.encode(&engine.render_chat(&history)?, true)?;
            print!("assistant: ");
            let reply = session.generate_from(&context, &params, |piece| {
                print!("{piece}");
                let _ = std::io::stdout().flush();
                true
            })?;
            println!();
            history.push(ChatMessage::new("assistant", reply.text));
        }
        Ok(())
    });
    for turn in turns.into_iter().filter(|t| !t.trim().is_empty()) {
        tx.send(turn)?;
    }
    drop(tx);
    worker.join().map_err(|_| "the chat thread panicked")??;
    Ok(())
}
