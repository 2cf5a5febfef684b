//! How much memory a new buffer may take, and fallible allocation of the
//! buffers whose size comes from input (context length, sequence count).
//!
//! [`available_bytes`] (from `mirage_gguf::resident`, which sizes resident
//! model copies by it) is the kernel's estimate of memory that can be
//! allocated without swapping (`MemAvailable` in `/proc/meminfo`), lowered
//! to the room left under the process's cgroup v2 limit
//! (`/sys/fs/cgroup/memory.max` minus `memory.current`) when one is set.
//! These are the only files the runtime reads besides the model; where
//! neither exists (not Linux) the answer is unknown and only the allocation
//! itself can fail.

use crate::error::RuntimeError;

pub use mirage_gguf::resident::available_bytes;

/// `bytes` in decimal units with one decimal (`65.5 TB`), for messages.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "kB", "MB", "GB", "TB", "PB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Refuses `needed` bytes for `what` when more than [`available_bytes`]
/// (and passes when the system does not say).
pub fn check_fits(what: impl FnOnce() -> String, needed: u64) -> Result<(), RuntimeError> {
    match available_bytes() {
        Some(available) if needed > available => Err(RuntimeError::OutOfMemory {
            what: what(),
            needed,
            available,
        }),
        _ => Ok(()),
    }
}

/// Types whose all-zero bit pattern is a valid value (so a zeroed
/// allocation is an initialized vector).
///
/// # Safety
/// Implement only for types for which all-zero bytes are a valid value.
pub unsafe trait Zeroable: Copy {}
// SAFETY: all-zero bits are 0 (or +0.0) for each of these.
unsafe impl Zeroable for f32 {}
unsafe impl Zeroable for half::f16 {}
unsafe impl Zeroable for i8 {}
unsafe impl Zeroable for u8 {}
unsafe impl Zeroable for u32 {}
unsafe impl Zeroable for usize {}

/// `n` zeros, or [`RuntimeError::OutOfMemory`] when the allocator refuses
/// (never an abort). Large blocks come zeroed from the system without
/// being touched, as `vec![0; n]` does, so untouched memory stays
/// uncommitted.
pub fn try_zeroed_vec<T: Zeroable>(n: usize, what: &str) -> Result<Vec<T>, RuntimeError> {
    let oom = |needed: u64| RuntimeError::OutOfMemory {
        what: what.to_string(),
        needed,
        available: available_bytes().unwrap_or(0),
    };
    if n == 0 || std::mem::size_of::<T>() == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| oom(u64::MAX))?;
    // SAFETY: the layout has a non-zero size (n > 0, T not zero-sized).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
    if ptr.is_null() {
        return Err(oom(layout.size() as u64));
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout
    // of `[T; n]` (so capacity n, T's alignment), and all `n` values are
    // initialized: zero bits are a valid T (`Zeroable`).
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_bytes_is_decimal_with_one_decimal() {
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(65_536_000_000_000), "65.5 TB");
        assert_eq!(human_bytes(1_500_000), "1.5 MB");
    }

    #[test]
    fn zeroed_vectors_are_zero_and_impossible_ones_are_errors() {
        let v: Vec<f32> = try_zeroed_vec(1000, "test").unwrap();
        assert!(v.len() == 1000 && v.iter().all(|&x| x == 0.0));
        let e = try_zeroed_vec::<f32>(usize::MAX / 2, "huge").unwrap_err();
        assert!(matches!(e, RuntimeError::OutOfMemory { .. }), "{e}");
        assert!(try_zeroed_vec::<u8>(0, "none").unwrap().is_empty());
    }
}
