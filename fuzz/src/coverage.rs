//! Coverage feedback from LLVM's SanitizerCoverage inline 8-bit counters.
//!
//! Built with
//! `RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=3
//! -Cllvm-args=-sanitizer-coverage-inline-8bit-counters"` (stable rustc
//! options), every compiled module keeps one byte counter per edge of its
//! control flow and, before `main`, calls
//! [`__sanitizer_cov_8bit_counters_init`] with the counters' range. After
//! each execution the engine reads them ([`Coverage::take_new`]): a counter
//! that is non-zero in a hit-count bucket (1, 2, 3, 4-7, 8-15, 16-31,
//! 32-127, 128+) no earlier input reached is a new feature, and the input
//! that found it joins the corpus; then the counters are zeroed. This is
//! what libFuzzer does with the same counters, without its runtime (which
//! needs nightly). Without the flags nothing registers and there is no
//! feedback.

use std::sync::atomic::{AtomicUsize, Ordering};

const MAX_REGIONS: usize = 1 << 14;

static REGION_COUNT: AtomicUsize = AtomicUsize::new(0);
static REGION_START: [AtomicUsize; MAX_REGIONS] = [const { AtomicUsize::new(0) }; MAX_REGIONS];
static REGION_END: [AtomicUsize; MAX_REGIONS] = [const { AtomicUsize::new(0) }; MAX_REGIONS];

/// Called by each instrumented module's constructor with its counters.
///
/// # Safety
/// `start..stop` must be the module's counter array, valid for the whole
/// run (LLVM's constructors guarantee both).
#[no_mangle]
pub unsafe extern "C" fn __sanitizer_cov_8bit_counters_init(start: *mut u8, stop: *mut u8) {
    let i = REGION_COUNT.fetch_add(1, Ordering::SeqCst);
    if i < MAX_REGIONS && !start.is_null() && stop > start {
        REGION_START[i].store(start as usize, Ordering::SeqCst);
        REGION_END[i].store(stop as usize, Ordering::SeqCst);
    }
}

fn regions() -> impl Iterator<Item = &'static mut [u8]> {
    let n = REGION_COUNT.load(Ordering::SeqCst).min(MAX_REGIONS);
    (0..n).filter_map(|i| {
        let (s, e) = (
            REGION_START[i].load(Ordering::SeqCst),
            REGION_END[i].load(Ordering::SeqCst),
        );
        // SAFETY: registered by LLVM's constructor for this module; the
        // counters live for the whole program (see the init function).
        (e > s).then(|| unsafe { std::slice::from_raw_parts_mut(s as *mut u8, e - s) })
    })
}

/// Whether this binary was built with the counters.
pub fn instrumented() -> bool {
    regions().next().is_some()
}

fn bucket(c: u8) -> u8 {
    match c {
        0 => 0,
        1 => 1,
        2 => 2,
        3 => 4,
        4..=7 => 8,
        8..=15 => 16,
        16..=31 => 32,
        32..=127 => 64,
        _ => 128,
    }
}

/// The features (counter, bucket) every input so far reached.
#[derive(Debug, Default)]
pub struct Coverage {
    seen: Vec<u8>,
    features: usize,
}

impl Coverage {
    /// Empty; zeroes the counters so the first execution starts clean.
    pub fn new() -> Coverage {
        let mut c = Coverage::default();
        let total: usize = regions().map(|r| r.len()).sum();
        c.seen = vec![0; total];
        for r in regions() {
            r.fill(0);
        }
        c
    }

    /// Counts the features the last execution reached that no earlier one
    /// did, records them, and zeroes the counters.
    pub fn take_new(&mut self) -> usize {
        let mut new = 0;
        let mut base = 0;
        for r in regions() {
            let seen = &mut self.seen[base..base + r.len()];
            for (chunk, seen) in r.chunks_mut(8).zip(seen.chunks_mut(8)) {
                // Most counters stay zero: skip them eight at a time.
                if chunk.len() == 8 && u64::from_ne_bytes(chunk.try_into().expect("8")) == 0 {
                    continue;
                }
                for (c, s) in chunk.iter_mut().zip(seen.iter_mut()) {
                    let b = bucket(*c);
                    if b & !*s != 0 {
                        *s |= b;
                        new += 1;
                    }
                    *c = 0;
                }
            }
            base += r.len();
        }
        self.features += new;
        new
    }

    /// Features found so far.
    pub fn features(&self) -> usize {
        self.features
    }

    /// Counters in the binary (0 without instrumentation).
    pub fn counters(&self) -> usize {
        self.seen.len()
    }
}
