//! Deterministic (batch-invariant) mode on the real SmolLM2 model, through
//! the facade as a library user loads it: a request's greedy tokens and its
//! logits (every bit) are the same alone and batched with three other
//! requests that sit in other rows, at other positions, with their prompts
//! split into other chunks.

use std::path::PathBuf;

use mirage::runtime::batch::{Batcher, SeqEvent};
use mirage::runtime::TokenSlot;
use mirage::{Backend, BackendChoice, Engine, EngineOptions, GenerateParams, LoadSpec, WithEngine};

fn model_path() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/smollm2-135m-instruct-q4_1.gguf");
    if p.exists() {
        return Some(p);
    }
    if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!(
            "skipping: {} is missing and MIRAGE_SKIP_MODEL_TESTS=1",
            p.display()
        );
        return None;
    }
    panic!("{} is missing: run `cargo xtask fetch-models`", p.display());
}

const TARGET: &str = "Write a haiku about the sea.";
const OTHERS: [&str; 3] = [
    "List three prime numbers and explain why each is prime.",
    "Hi",
    "Name the largest planet in the solar system.",
];
const STEPS: usize = 12;

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// One greedy step's result for the target: its token and its logits' bits.
type Trace = Vec<(u32, Vec<u32>)>;

/// The target's greedy trace alone (one sequence, whole prompt in one pass)
/// and batched with the others (target in slot 2; every pass mixes its rows
/// with other sequences' prompt chunks and decode rows, in a row order that
/// changes from pass to pass).
struct Traces;

impl WithEngine for Traces {
    type Out = (Trace, Trace);
    fn run<B: Backend>(self, engine: Engine<B>) -> (Trace, Trace) {
        let m = engine.model();
        let vocab = m.config().vocab_size;
        let enc = |p: &str| {
            let text = engine
                .render_chat(&[mirage::tokenizer::ChatMessage::new("user", p)])
                .unwrap();
            engine.encode(&text, true).unwrap()
        };
        let target = enc(TARGET);
        let others: Vec<Vec<u32>> = OTHERS.iter().map(|p| enc(p)).collect();
        let mut scratch = m.new_scratch();
        let mut logits = Vec::new();

        // Alone.
        let mut cache = m.new_kv_cache(256, 1, Default::default()).unwrap();
        let slots: Vec<TokenSlot> = (0..target.len())
            .map(|pos| TokenSlot { seq: 0, pos })
            .collect();
        m.forward(
            &target,
            &slots,
            &[target.len() - 1],
            &mut cache,
            &mut scratch,
            &mut logits,
        )
        .unwrap();
        let mut alone = Vec::new();
        for step in 0..STEPS {
            let t = argmax(&logits);
            alone.push((t, bits(&logits)));
            if step + 1 == STEPS {
                break;
            }
            let slot = TokenSlot {
                seq: 0,
                pos: target.len() + step,
            };
            m.forward(&[t], &[slot], &[0], &mut cache, &mut scratch, &mut logits)
                .unwrap();
        }

        // Batched: sequences 0, 1, 3 are the others, 2 is the target.
        let mut cache = m.new_kv_cache(256, 4, Default::default()).unwrap();
        let seq_of = [0usize, 1, 3];
        // Per other: its context so far and how much of it is in the cache.
        let mut ctx: Vec<Vec<u32>> = others.clone();
        let mut fed = [0usize; 3];
        let mut target_ctx = target.clone();
        let mut target_fed = 0;
        let mut batched = Vec::new();
        for pass in 0..STEPS + 4 {
            // (seq, tokens, first position, wants logits)
            let mut parts: Vec<(usize, Vec<u32>, usize, bool)> = Vec::new();
            for (o, c) in ctx.iter().enumerate() {
                let left = c.len() - fed[o];
                if left == 0 {
                    continue;
                }
                // Prompts go in chunks of 1, 3 or 7 rows, by sequence and pass.
                let chunk = [1, 3, 7][(o + pass) % 3].min(left);
                let done = fed[o] + chunk == c.len();
                parts.push((seq_of[o], c[fed[o]..fed[o] + chunk].to_vec(), fed[o], done));
            }
            if batched.len() < STEPS {
                // The target's prompt goes in two passes (4 rows, then the rest).
                let left = target_ctx.len() - target_fed;
                let chunk = if pass == 0 { left.min(4) } else { left };
                let done = target_fed + chunk == target_ctx.len();
                parts.insert(
                    pass % (parts.len() + 1),
                    (
                        2,
                        target_ctx[target_fed..target_fed + chunk].to_vec(),
                        target_fed,
                        done,
                    ),
                );
            }
            let (mut tokens, mut slots, mut rows, mut who) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for (seq, toks, pos0, wants) in &parts {
                for (k, &t) in toks.iter().enumerate() {
                    tokens.push(t);
                    slots.push(TokenSlot {
                        seq: *seq,
                        pos: pos0 + k,
                    });
                }
                if *wants {
                    rows.push(tokens.len() - 1);
                    who.push(*seq);
                }
            }
            if tokens.is_empty() {
                break;
            }
            m.forward(
                &tokens,
                &slots,
                &rows,
                &mut cache,
                &mut scratch,
                &mut logits,
            )
            .unwrap();
            for (seq, toks, _, _) in &parts {
                if *seq == 2 {
                    target_fed += toks.len();
                } else {
                    let o = seq_of.iter().position(|s| s == seq).unwrap();
                    fed[o] += toks.len();
                }
            }
            for (i, &seq) in who.iter().enumerate() {
                let l = &logits[i * vocab..(i + 1) * vocab];
                let t = argmax(l);
                if seq == 2 {
                    batched.push((t, bits(l)));
                    target_ctx.push(t);
                } else {
                    let o = seq_of.iter().position(|s| *s == seq).unwrap();
                    // Others keep decoding greedily until their room runs out.
                    if ctx[o].len() < 200 {
                        ctx[o].push(t);
                    }
                }
            }
        }
        (alone, batched)
    }
}

fn load<V: WithEngine>(deterministic: bool, threads: usize, n_ctx: usize, v: V) -> V::Out {
    let model = model_path().expect("model");
    let spec = LoadSpec::new(&model)
        .backend(BackendChoice::Cpu)
        .options(EngineOptions {
            n_ctx,
            threads,
            deterministic,
            ..Default::default()
        });
    mirage::load(&spec, v).unwrap()
}

/// Where two traces first differ: (step, token alone, token batched,
/// logits differing in their bits), or None.
fn first_difference(a: &Trace, b: &Trace) -> Option<(usize, u32, u32, usize)> {
    a.iter().zip(b).enumerate().find_map(|(i, (x, y))| {
        let differing = x.1.iter().zip(&y.1).filter(|(p, q)| p != q).count();
        (x.0 != y.0 || differing > 0).then_some((i, x.0, y.0, differing))
    })
}

#[test]
fn deterministic_mode_gives_the_same_bits_alone_and_batched() {
    if model_path().is_none() {
        return;
    }
    let (alone, batched) = load(true, 2, 256, Traces);
    assert_eq!(alone.len(), STEPS);
    assert_eq!(batched.len(), STEPS, "the target did not run all its steps");
    if let Some((step, a, b, n)) = first_difference(&alone, &batched) {
        panic!(
            "deterministic mode: step {step}: token {a} alone, {b} batched; {n} logits differ in their bits"
        );
    }
    // Nor do the thread count and the context size change a bit.
    let (one_thread, _) = load(true, 1, 512, Traces);
    if let Some((step, a, b, n)) = first_difference(&alone, &one_thread) {
        panic!(
            "deterministic mode: step {step}: token {a} with 2 threads, {b} with 1 thread and another \
             context size; {n} logits differ in their bits"
        );
    }
}

/// The greedy text of the target through the batcher (the server's
/// scheduler), alone and with three other requests joining at other steps.
struct BatcherText {
    with_others: bool,
}

impl WithEngine for BatcherText {
    type Out = String;
    fn run<B: Backend>(self, engine: Engine<B>) -> String {
        let enc = |p: &str| {
            let text = engine
                .render_chat(&[mirage::tokenizer::ChatMessage::new("user", p)])
                .unwrap();
            engine.encode(&text, true).unwrap()
        };
        let params = GenerateParams {
            max_tokens: 16,
            ..Default::default()
        };
        // Small passes, so that prompts are split and mixed with decode rows.
        let mut b = Batcher::new(&engine, 4, 5).unwrap();
        let mut events = Vec::new();
        let mut target_slot = None;
        let mut text = String::new();
        let mut pending: Vec<Vec<u32>> = if self.with_others {
            OTHERS.iter().map(|p| enc(p)).collect()
        } else {
            Vec::new()
        };
        // One other joins first, then the target, then the rest one per step.
        if let Some(p) = (!pending.is_empty()).then(|| pending.remove(0)) {
            b.add(p, &params).unwrap();
            b.step(&mut events).unwrap();
        }
        target_slot.get_or_insert(b.add(enc(TARGET), &params).unwrap());
        loop {
            if let Some(p) = (!pending.is_empty()).then(|| pending.remove(0)) {
                b.add(p, &params).unwrap();
            }
            events.clear();
            b.step(&mut events).unwrap();
            let mut finished = false;
            for e in &events {
                match e {
                    SeqEvent::Text { slot, text: t } if Some(*slot) == target_slot => {
                        text.push_str(t)
                    }
                    SeqEvent::Finished { slot, .. } if Some(*slot) == target_slot => {
                        finished = true
                    }
                    _ => {}
                }
            }
            if finished {
                return text;
            }
        }
    }
}

#[test]
fn deterministic_batcher_text_is_the_same_alone_and_with_others() {
    if model_path().is_none() {
        return;
    }
    let alone = load(true, 2, 256, BatcherText { with_others: false });
    let together = load(true, 2, 256, BatcherText { with_others: true });
    assert!(!alone.is_empty());
    assert_eq!(alone, together);
}
