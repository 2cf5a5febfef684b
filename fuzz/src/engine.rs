//! The fuzzing loop, and the shared page through which a worker process
//! tells its supervisor what it is running.
//!
//! [`fuzz`] runs in the calling process: it loads the corpus (the target's
//! seeds, `fuzz/corpus/NAME/`, and any extra folders), then repeatedly picks
//! an input, mutates it and runs it, keeping the mutants that reach new
//! coverage (saved to the working corpus folder when one is given). A panic
//! ends it with a [`Finding`]. Aborts and hangs cannot be caught in
//! process: `mirage-fuzz run` runs the loop in a child that publishes each
//! input on a [`SharedPage`] before running it, so the supervisor can save
//! the input that killed or stalled the child.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::coverage::Coverage;
use crate::{mutate, Rng, Target};

/// How long one run of [`fuzz`] lasts and where it reads and writes.
#[derive(Debug, Clone)]
pub struct Options {
    /// Executions to run (mutants; the corpus replay comes on top).
    pub execs: u64,
    /// Stop after this long even if `execs` are not done.
    pub max_time: Option<Duration>,
    /// Seed of the mutation stream.
    pub seed: u64,
    /// Folders whose files join the corpus (missing ones are skipped).
    pub corpus_dirs: Vec<PathBuf>,
    /// Where inputs that reach new coverage are saved, if anywhere.
    pub save_dir: Option<PathBuf>,
    /// Print a status line every this long.
    pub status_every: Option<Duration>,
}

/// What a finished run did.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Executions run (replayed corpus included).
    pub execs: u64,
    /// Wall-clock seconds.
    pub secs: f64,
    /// Corpus size at the end.
    pub corpus: usize,
    /// Coverage features reached (0 without instrumentation).
    pub features: usize,
    /// Coverage counters in the binary (0 without instrumentation).
    pub counters: usize,
    /// Allocations the cap refused (all handled: the run went on).
    pub refused_allocations: u64,
    /// Largest live heap seen, in bytes.
    pub peak_live_bytes: usize,
}

/// An input that made the target panic.
#[derive(Debug, Clone)]
pub struct Finding {
    /// The input.
    pub input: Vec<u8>,
    /// The panic message.
    pub message: String,
}

/// The page a worker shares with its supervisor: execution count, the
/// input being run (or mutated), what is being done with it, and the size
/// of an allocation the cap refused meanwhile. Layout (native-endian u64
/// words): `[execs, input_len, refused, phase, ..]`, input bytes from
/// [`SharedPage::HEADER`].
pub struct SharedPage {
    map: memmap2::MmapMut,
}

static PAGE: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
const PHASE_RUNNING: u64 = 1;
const PHASE_MUTATING: u64 = 2;

/// Records a refused allocation on the shared page, if there is one (the
/// allocator calls this; it must not allocate).
pub fn note_refused_allocation(size: u64) {
    let p = PAGE.load(Ordering::Relaxed);
    if !p.is_null() {
        // SAFETY: PAGE points at a live, 8-aligned mapping of at least
        // HEADER bytes while a SharedPage is installed.
        unsafe { (*(p.add(16) as *const AtomicU64)).store(size, Ordering::Relaxed) };
    }
}

impl SharedPage {
    /// Bytes before the input.
    pub const HEADER: usize = 64;

    /// Creates `path` with room for inputs of `max_len` bytes and maps it
    /// (supervisor side).
    pub fn create(path: &Path, max_len: usize) -> std::io::Result<SharedPage> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        f.set_len((Self::HEADER + max_len) as u64)?;
        Self::map(&f)
    }

    /// Maps the page the supervisor created (worker side).
    pub fn open(path: &Path) -> std::io::Result<SharedPage> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        Self::map(&f)
    }

    fn map(f: &std::fs::File) -> std::io::Result<SharedPage> {
        // SAFETY: a file of our own, mapped by the two processes that use it.
        let map = unsafe { memmap2::MmapMut::map_mut(f)? };
        if map.len() < Self::HEADER {
            return Err(std::io::Error::other("shared page too short"));
        }
        Ok(SharedPage { map })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the mapping is page-aligned and longer than HEADER.
        unsafe { &*(self.map.as_ptr().add(8 * i) as *const AtomicU64) }
    }

    /// Executions the worker has finished.
    pub fn execs(&self) -> u64 {
        self.word(0).load(Ordering::Acquire)
    }

    /// The input the worker is running (or ran last).
    pub fn input(&self) -> Vec<u8> {
        let n = (self.word(1).load(Ordering::Acquire) as usize).min(self.map.len() - Self::HEADER);
        self.map[Self::HEADER..Self::HEADER + n].to_vec()
    }

    /// The allocation the cap refused while running it (0: none).
    pub fn refused(&self) -> u64 {
        self.word(2).load(Ordering::Acquire)
    }

    /// Whether the input was being mutated (a harness bug) rather than run
    /// when the worker stopped.
    pub fn was_mutating(&self) -> bool {
        self.word(3).load(Ordering::Acquire) == PHASE_MUTATING
    }

    /// Makes this the page the allocator reports to (worker side).
    pub fn install(&mut self) {
        PAGE.store(self.map.as_mut_ptr(), Ordering::Release);
    }

    fn publish(&mut self, input: &[u8], phase: u64) {
        let n = input.len().min(self.map.len() - Self::HEADER);
        self.map[Self::HEADER..Self::HEADER + n].copy_from_slice(&input[..n]);
        self.word(1).store(n as u64, Ordering::Release);
        self.word(2).store(0, Ordering::Release);
        self.word(3).store(phase, Ordering::Release);
    }

    fn done(&self) {
        self.word(0).fetch_add(1, Ordering::AcqRel);
    }
}

std::thread_local! {
    /// Where the last panic on this thread happened (set by [`quiet_panics`]'s hook).
    static PANIC_AT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Replaces the panic hook with one that only records where a panic
/// happened: libraries under test may catch panics of their own (the chat
/// template engine does), and the default hook would print a message and a
/// backtrace for each one, millions of times, slowing the run down a
/// hundredfold. A panic that reaches [`run_one`] is still a finding, with
/// its message and location.
pub fn quiet_panics() {
    std::panic::set_hook(Box::new(|info| {
        let at = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()));
        PANIC_AT.with(|p| *p.borrow_mut() = at);
    }));
}

/// Runs `input`, returning the panic message (and where it happened) if it
/// panicked.
pub fn run_one(target: &Target, input: &[u8]) -> Result<(), String> {
    catch_unwind(AssertUnwindSafe(|| (target.run)(input))).map_err(|p| {
        let message = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic with a non-string payload".into());
        match PANIC_AT.with(|at| at.borrow_mut().take()) {
            Some(at) => format!("{message} (at {at})"),
            None => message,
        }
    })
}

/// The files of `dir` (none when it does not exist), in name order.
pub fn read_dir_inputs(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(PathBuf, Vec<u8>)> = entries
        .filter_map(|e| {
            let p = e.ok()?.path();
            let name = p.file_name()?.to_string_lossy().into_owned();
            if !p.is_file() || name.starts_with('.') || name.ends_with(".md") {
                return None;
            }
            let bytes = std::fs::read(&p).ok()?;
            Some((p, bytes))
        })
        .collect();
    out.sort();
    out
}

fn short_hash(data: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(&sha2::Sha256::digest(data)[..8])
}

/// Fuzzes `target` in this process (see the module doc). With `page`,
/// each input is published before it runs.
pub fn fuzz(
    target: &Target,
    opts: &Options,
    mut page: Option<&mut SharedPage>,
) -> Result<Report, Finding> {
    quiet_panics();
    let t0 = Instant::now();
    crate::alloc::reset_peak();
    let refused_before = crate::alloc::refused_count();
    let mut rng = Rng::new(opts.seed ^ 0x4d49_5241_4745_465a);
    let mut coverage = Coverage::new();
    let mut corpus: Vec<Vec<u8>> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut candidates = (target.seeds)();
    for dir in &opts.corpus_dirs {
        candidates.extend(read_dir_inputs(dir).into_iter().map(|(_, b)| b));
    }
    let mut execs = 0u64;
    let run = |input: &[u8], page: &mut Option<&mut SharedPage>| -> Result<(), Finding> {
        if let Some(p) = page.as_deref_mut() {
            p.publish(input, PHASE_RUNNING);
        }
        let r = run_one(target, input);
        if let Some(p) = page.as_deref_mut() {
            p.done();
        }
        r.map_err(|message| Finding {
            input: input.to_vec(),
            message,
        })
    };
    // Replay everything first: the corpus keeps what adds coverage (all of
    // it without instrumentation).
    let instrumented = coverage.counters() > 0;
    for c in candidates {
        if c.len() > target.max_len || !seen.insert(short_hash(&c)) {
            continue;
        }
        run(&c, &mut page)?;
        execs += 1;
        if coverage.take_new() > 0 || !instrumented || corpus.is_empty() {
            corpus.push(c);
        }
    }
    if corpus.is_empty() {
        corpus.push(Vec::new());
    }
    let mut last_status = Instant::now();
    let mut mutant = Vec::new();
    for i in 0..opts.execs {
        if opts.max_time.is_some_and(|m| t0.elapsed() >= m) {
            break;
        }
        let parent = rng.below(corpus.len());
        mutant.clear();
        mutant.extend_from_slice(&corpus[parent]);
        if let Some(p) = page.as_deref_mut() {
            p.publish(&mutant, PHASE_MUTATING);
        }
        match target.mutate {
            Some(m) if rng.one_in(2) => {
                m(&mut mutant, &mut rng);
                mutant.truncate(target.max_len);
            }
            _ => {
                let other = &corpus[rng.below(corpus.len())];
                mutate::havoc(
                    &mut mutant,
                    other,
                    target.dictionary,
                    target.max_len,
                    &mut rng,
                );
            }
        }
        run(&mutant, &mut page)?;
        execs += 1;
        if coverage.take_new() > 0 {
            if let Some(dir) = &opts.save_dir {
                let _ = std::fs::create_dir_all(dir);
                let _ = std::fs::write(dir.join(short_hash(&mutant)), &mutant);
            }
            corpus.push(mutant.clone());
        }
        if let Some(every) = opts.status_every {
            if last_status.elapsed() >= every {
                last_status = Instant::now();
                let secs = t0.elapsed().as_secs_f64();
                eprintln!(
                    "{}: {} execs ({:.0}/s), corpus {}, features {}, peak heap {} MiB",
                    target.name,
                    i + 1,
                    execs as f64 / secs,
                    corpus.len(),
                    coverage.features(),
                    crate::alloc::peak() >> 20
                );
            }
        }
    }
    Ok(Report {
        execs,
        secs: t0.elapsed().as_secs_f64(),
        corpus: corpus.len(),
        features: coverage.features(),
        counters: coverage.counters(),
        refused_allocations: crate::alloc::refused_count() - refused_before,
        peak_live_bytes: crate::alloc::peak(),
    })
}
