//! MIRAGE's fuzz harness, on stable Rust.
//!
//! A **target** is one file `src/targets/NAME.rs` defining
//! `pub fn target() -> Target` (the build script lists the files, so adding
//! a target is adding that file). A target names its seeds, the function
//! that runs one input (a panic is a finding), and optionally a
//! structure-aware mutator and a dictionary of words for the byte mutator:
//!
//! ```ignore
//! use crate::{Rng, Target};
//!
//! pub fn target() -> Target {
//!     Target {
//!         name: "example",
//!         about: "bytes through the parser; whatever parses re-serializes",
//!         seeds: || vec![b"seed".to_vec()],
//!         run,
//!         mutate: None,
//!         dictionary: &[b"{", b"}"],
//!         max_len: 4096,
//!     }
//! }
//!
//! fn run(data: &[u8]) {
//!     // Call the code under test; assert what must hold; never abort.
//! }
//! ```
//!
//! The engine ([`engine`]) keeps a corpus, mutates inputs (byte-level
//! havoc, splicing, dictionary words, and the target's own mutator), and
//! keeps an input when it reaches code no earlier input reached. Coverage
//! comes from LLVM's SanitizerCoverage 8-bit counters, which stable rustc
//! emits with `-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-…`
//! ([`coverage`]; `cargo xtask fuzz` sets the flags). Without them (an
//! ordinary build, such as the CI smoke test) the engine still runs, as a
//! mutation loop without feedback.
//!
//! Every binary that links this crate gets its allocator ([`alloc`]): an
//! allocation over the cap (1 GiB by default), or one that would take the
//! live total over it, is refused, so an infallible one aborts (a finding)
//! and a fallible one (`try_reserve`) returns its error.
//!
//! `mirage-fuzz run TARGET` runs the engine in a child process and watches
//! it: a panic, an abort (a refused allocation included) or an input that
//! runs longer than the timeout is saved under `fuzz/artifacts/TARGET/` and
//! reported with the command that replays it.
#![deny(missing_docs)]

pub mod alloc;
pub mod coverage;
pub mod engine;
pub mod mutate;
pub mod structure;

/// The fuzz targets, one module per file in `src/targets/` (each file's
/// module doc says what its target checks).
#[allow(missing_docs)]
pub mod targets {
    include!(concat!(env!("OUT_DIR"), "/targets.rs"));
}

#[global_allocator]
static ALLOCATOR: alloc::CappedAlloc = alloc::CappedAlloc;

/// One fuzz target (see the crate doc).
#[derive(Clone, Copy)]
pub struct Target {
    /// Name on the command line: the file's name.
    pub name: &'static str,
    /// What one execution checks, in a line.
    pub about: &'static str,
    /// Inputs to start from, besides the files in `fuzz/corpus/NAME/`.
    pub seeds: fn() -> Vec<Vec<u8>>,
    /// Runs one input; a panic is a finding.
    pub run: fn(&[u8]),
    /// A structure-aware mutation of an input (used for half of the
    /// mutations when given).
    pub mutate: Option<fn(&mut Vec<u8>, &mut Rng)>,
    /// Words the byte mutator inserts or overwrites with.
    pub dictionary: &'static [&'static [u8]],
    /// Longest input the engine makes.
    pub max_len: usize,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").field("name", &self.name).finish()
    }
}

/// The target called `name`.
pub fn find_target(name: &str) -> Option<Target> {
    targets::all().into_iter().find(|t| t.name == name)
}

/// A small, fast, seedable generator (wyrand).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator whose stream depends only on `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = (self.0 as u128).wrapping_mul((self.0 ^ 0xe703_7ed1_a0b4_28db) as u128);
        ((t >> 64) ^ t) as u64
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// True with probability `1 / n`.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    /// One of `items` (panics on an empty slice).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// A number that often breaks size arithmetic: 0, 1, powers of two and
    /// their neighbours, the integer limits.
    pub fn interesting(&mut self) -> u64 {
        const V: [u64; 14] = [
            0,
            1,
            2,
            3,
            16,
            255,
            256,
            65535,
            1 << 31,
            (1 << 32) - 1,
            1 << 32,
            1 << 40,
            i64::MAX as u64,
            u64::MAX,
        ];
        match self.below(3) {
            0 => V[self.below(V.len())],
            1 => 1u64 << self.below(64),
            _ => (1u64 << self.below(64))
                .wrapping_add(self.below(3) as u64)
                .wrapping_sub(1),
        }
    }
}
