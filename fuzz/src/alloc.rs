//! The harness's global allocator: the system allocator with a cap on one
//! allocation and on the live total ([`set_cap`], 1 GiB by default).
//!
//! A request over the cap gets a null pointer, as an out-of-memory system
//! would give: `try_reserve` and other fallible paths return their error,
//! and an infallible allocation aborts the process (Rust's
//! `handle_alloc_error`), which the supervisor reports as a finding. The
//! size of the last refused request is kept ([`last_refused`]) so a
//! report can say which allocation it was.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

static CAP: AtomicUsize = AtomicUsize::new(1 << 30);
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static LAST_REFUSED: AtomicU64 = AtomicU64::new(0);
static REFUSED: AtomicU64 = AtomicU64::new(0);

/// Sets the cap (bytes) on one allocation and on the live total.
pub fn set_cap(bytes: usize) {
    CAP.store(bytes, Ordering::Relaxed);
}

/// The cap in bytes.
pub fn cap() -> usize {
    CAP.load(Ordering::Relaxed)
}

/// Bytes allocated and not yet freed.
pub fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// The largest live total seen since the last [`reset_peak`].
pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts measuring the peak again from the live total.
pub fn reset_peak() {
    PEAK.store(live(), Ordering::Relaxed);
}

/// Size of the last refused request (0: none).
pub fn last_refused() -> u64 {
    LAST_REFUSED.load(Ordering::Relaxed)
}

/// How many requests were refused.
pub fn refused_count() -> u64 {
    REFUSED.load(Ordering::Relaxed)
}

/// Whether `size` more bytes may be handed out; counts them if so.
fn take(size: usize) -> bool {
    let cap = CAP.load(Ordering::Relaxed);
    if size > cap {
        refuse(size);
        return false;
    }
    let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
    if live > cap {
        LIVE.fetch_sub(size, Ordering::Relaxed);
        refuse(size);
        return false;
    }
    PEAK.fetch_max(live, Ordering::Relaxed);
    true
}

fn refuse(size: usize) {
    LAST_REFUSED.store(size as u64, Ordering::Relaxed);
    REFUSED.fetch_add(1, Ordering::Relaxed);
    crate::engine::note_refused_allocation(size as u64);
}

/// The capped system allocator (see the module doc).
pub struct CappedAlloc;

// SAFETY: every call forwards to `System` with the caller's layout; the
// accounting only decides whether to forward.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !take(layout.size()) {
            return std::ptr::null_mut();
        }
        let p = System.alloc(layout);
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !take(layout.size()) {
            return std::ptr::null_mut();
        }
        let p = System.alloc_zeroed(layout);
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > old && !take(new_size - old) {
            return std::ptr::null_mut();
        }
        let p = System.realloc(ptr, layout, new_size);
        if p.is_null() {
            if new_size > old {
                LIVE.fetch_sub(new_size - old, Ordering::Relaxed);
            }
        } else if new_size < old {
            LIVE.fetch_sub(old - new_size, Ordering::Relaxed);
        }
        p
    }
}
