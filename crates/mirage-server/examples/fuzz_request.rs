//! A mutation loop over the fuzz target "JSON body to a validated request"
//! (`mirage_server::fuzz_request`), on stable Rust: valid request bodies of
//! the API tests as seeds, mutated by byte flips, insertions, deletions,
//! splices between inputs and JSON-aware edits (a value replaced by one of
//! another type, a huge number, deep nesting, an unsupported field). Every
//! panic is caught, counted and its input saved; the slowest execution and
//! the largest single allocation are reported (a hang or an allocation
//! sized by the input shows there).
//!
//! ```sh
//! cargo run --release -p mirage-server --example fuzz_request -- [ITERATIONS] [SEED] [CRASH_DIR]
//! ```
//!
//! `tests/fuzz_request.rs` runs the same loop for a few thousand inputs.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The system allocator, recording the largest single request.
struct Counting;

static LARGEST_ALLOCATION: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Valid bodies of both endpoints (from the API tests), the corpus's start.
pub const SEEDS: &[&str] = &[
    r#"{"model":"smollm2","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":24,"temperature":0,"stream":false}"#,
    r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi"}]},{"role":"assistant","content":null},{"role":"tool","content":"42","tool_call_id":"c1"}],"stream":true,"stream_options":{"include_usage":true},"stop":["\n","END"],"seed":7}"#,
    r#"{"messages":[{"role":"developer","content":"x"}],"top_p":0.9,"top_k":40,"min_p":0.05,"presence_penalty":0.5,"frequency_penalty":-0.3,"repetition_penalty":1.1,"max_completion_tokens":100,"n":1}"#,
    r#"{"prompt":"One, two, three, four,","max_tokens":12,"temperature":0,"stop":"five"}"#,
    r#"{"prompt":[1,2,3,4],"echo":false,"stream":true,"seed":-5}"#,
    r#"{"prompt":["Once upon a time"],"echo":true,"max_tokens":900,"temperature":0.8,"user":"u"}"#,
    r#"{"prompt":[[15,16]],"logit_bias":{},"best_of":1,"suffix":""}"#,
    r#"{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":{"name":"p","strict":true,"schema":{"type":"object","properties":{"a":{"type":"integer"}}}}},"logprobs":true,"top_logprobs":3}"#,
    r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"x\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"2"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],"tool_choice":"required","parallel_tool_calls":false}"#,
    r#"{"prompt":"x","logprobs":5,"stream":true}"#,
    r#"{"input":["a","b"],"encoding_format":"base64","model":"m"}"#,
    r#"{"messages":[{"role":"user","content":"hi"}],"functions":[{"name":"f"}],"logit_bias":{"1":2}}"#,
];

/// Bytes that make interesting JSON when spliced in.
const TOKENS: &[&str] = &[
    "null",
    "true",
    "false",
    "0",
    "-1",
    "1e309",
    "-0",
    "18446744073709551616",
    "1.5",
    "\"\"",
    "[]",
    "{}",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "[[[[[[[[[[",
    "]]]]]]]]]]",
    "{\"a\":",
    ",",
    ":",
    "\"",
    "\"messages\"",
    "\"prompt\"",
    "\"n\"",
    "\"max_tokens\"",
    "\"tools\"",
    "\"role\"",
    "\"content\"",
    "4294967296",
    "NaN",
    "\u{feff}",
    "\u{10ffff}",
    "\\",
];

/// A small deterministic generator (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

fn random_value(rng: &mut Rng, depth: usize) -> serde_json::Value {
    use serde_json::{json, Value};
    match rng.below(if depth > 3 { 6 } else { 9 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.below(2) == 0),
        2 => json!(rng.next_u64() as i64),
        3 => json!(
            (rng.next_u64() as f64 / u64::MAX as f64 - 0.5) * 10f64.powi(rng.below(12) as i32 - 4)
        ),
        4 => json!("x".repeat(rng.below(300))),
        5 => json!(
            [
                "user",
                "system",
                "assistant",
                "tool",
                "developer",
                "robot",
                ""
            ][rng.below(7)]
        ),
        6 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_value(rng, depth + 1))
                .collect(),
        ),
        7 => {
            let keys = [
                "role",
                "content",
                "type",
                "text",
                "include_usage",
                "name",
                "tool_calls",
            ];
            Value::Object(
                (0..rng.below(4))
                    .map(|_| {
                        (
                            keys[rng.below(keys.len())].to_string(),
                            random_value(rng, depth + 1),
                        )
                    })
                    .collect(),
            )
        }
        _ => {
            // Deep nesting.
            let mut v = Value::Null;
            for _ in 0..rng.below(200) {
                v = Value::Array(vec![v]);
            }
            v
        }
    }
}

/// A JSON-aware edit: set a field (top level or in a message) to a random
/// value, or remove one.
fn json_edit(input: &[u8], rng: &mut Rng) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(input).ok()?;
    let fields = [
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stream",
        "stream_options",
        "n",
        "echo",
        "tools",
        "tool_choice",
        "response_format",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "model",
        "user",
        "suffix",
        "best_of",
        "extra",
    ];
    let field = fields[rng.below(fields.len())];
    let target = match v.get_mut("messages").and_then(|m| m.as_array_mut()) {
        Some(msgs) if !msgs.is_empty() && rng.below(3) == 0 => {
            let i = rng.below(msgs.len());
            &mut msgs[i]
        }
        _ => &mut v,
    };
    let obj = target.as_object_mut()?;
    if rng.below(4) == 0 {
        obj.remove(field);
    } else {
        obj.insert(field.to_string(), random_value(rng, 0));
    }
    serde_json::to_vec(&v).ok()
}

/// One mutation of `input` (`corpus` for splices).
pub fn mutate(input: &[u8], corpus: &[Vec<u8>], rng: &mut Rng) -> Vec<u8> {
    let mut out = input.to_vec();
    // Mostly one edit (inputs stay close to valid requests), sometimes a few.
    let edits = if rng.below(4) == 0 {
        2 + rng.below(3)
    } else {
        1
    };
    for _ in 0..edits {
        match rng.below(8) {
            0 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] ^= 1 << rng.below(8);
            }
            1 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] = rng.next_u64() as u8;
            }
            2 if !out.is_empty() => {
                let i = rng.below(out.len());
                let n = rng.below(16).min(out.len() - i);
                out.drain(i..i + n);
            }
            3 => {
                let i = rng.below(out.len() + 1);
                let t = TOKENS[rng.below(TOKENS.len())].as_bytes();
                out.splice(i..i, t.iter().copied());
            }
            4 => {
                // Splice: a head of this input and a tail of another.
                let other = &corpus[rng.below(corpus.len())];
                let a = rng.below(out.len() + 1);
                let b = rng.below(other.len() + 1);
                out.truncate(a);
                out.extend_from_slice(&other[b..]);
            }
            5 if !out.is_empty() => {
                // Repeat a slice.
                let i = rng.below(out.len());
                let n = rng.below(64).min(out.len() - i);
                let piece = out[i..i + n].to_vec();
                for _ in 0..rng.below(8) {
                    out.splice(i..i, piece.iter().copied());
                }
            }
            _ => {
                if let Some(edited) = json_edit(&out, rng) {
                    out = edited;
                }
            }
        }
    }
    out.truncate(1 << 16);
    out
}

/// What a run found.
#[derive(Debug, Default)]
pub struct Report {
    pub executions: u64,
    pub panics: Vec<Vec<u8>>,
    pub slowest: Duration,
    pub largest_allocation: usize,
    pub elapsed: Duration,
    /// Inputs that validated as a chat or a completion request.
    pub valid: u64,
}

/// Runs `iterations` mutated inputs (seeds first); the corpus grows with
/// inputs that still parse as JSON objects, so mutations stack.
pub fn run(iterations: u64, seed: u64) -> Report {
    let mut rng = Rng::new(seed);
    let mut corpus: Vec<Vec<u8>> = SEEDS.iter().map(|s| s.as_bytes().to_vec()).collect();
    let mut report = Report::default();
    let t0 = Instant::now();
    // A panic is a finding here, not a crash: keep the default hook quiet.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for i in 0..iterations {
        let input = if (i as usize) < SEEDS.len() {
            SEEDS[i as usize].as_bytes().to_vec()
        } else {
            // Half from the seeds, so that the corpus does not drift away
            // from valid requests.
            let base = if rng.below(2) == 0 {
                &corpus[rng.below(SEEDS.len())]
            } else {
                &corpus[rng.below(corpus.len())]
            };
            mutate(base, &corpus, &mut rng)
        };
        let t = Instant::now();
        let outcome = std::panic::catch_unwind(|| mirage_server::fuzz_request(&input));
        report.slowest = report.slowest.max(t.elapsed());
        report.executions += 1;
        match outcome {
            Err(_) => report.panics.push(input),
            Ok(()) => {
                let valid = mirage_server::api::validate_chat(&input, 512, 0).is_ok()
                    || mirage_server::api::validate_completion(&input, 512, 0).is_ok();
                report.valid += valid as u64;
                let object = serde_json::from_slice::<serde_json::Value>(&input)
                    .is_ok_and(|v| v.is_object());
                if object && corpus.len() < 4096 && rng.below(8) == 0 {
                    corpus.push(input);
                }
            }
        }
    }
    std::panic::set_hook(hook);
    report.elapsed = t0.elapsed();
    report.largest_allocation = LARGEST_ALLOCATION.load(Ordering::Relaxed);
    report
}

#[allow(dead_code)] // the test includes this file for `run` only
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let iterations: u64 = args
        .get(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let seed: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1);
    let crash_dir = args
        .get(3)
        .cloned()
        .unwrap_or_else(|| "target/fuzz-request-crashes".into());
    let r = run(iterations, seed);
    println!(
        "fuzz_request: {} executions in {:.1} s ({:.0}/s), seed {seed}: {} panics, {} valid requests, \
         slowest execution {:.2} ms, largest allocation {} bytes",
        r.executions,
        r.elapsed.as_secs_f64(),
        r.executions as f64 / r.elapsed.as_secs_f64(),
        r.panics.len(),
        r.valid,
        r.slowest.as_secs_f64() * 1e3,
        r.largest_allocation
    );
    if !r.panics.is_empty() {
        std::fs::create_dir_all(&crash_dir).expect("crash dir");
        for (i, p) in r.panics.iter().enumerate().take(100) {
            std::fs::write(format!("{crash_dir}/crash-{i}.json"), p).expect("write crasher");
        }
        eprintln!("inputs that panicked: {crash_dir}/");
        std::process::exit(1);
    }
    // A gigabyte for one request would be an allocation sized by the input.
    if r.largest_allocation > 1 << 30 || r.slowest > Duration::from_secs(1) {
        eprintln!("an allocation over 1 GiB or an execution over 1 s");
        std::process::exit(1);
    }
}
