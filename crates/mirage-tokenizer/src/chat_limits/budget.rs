//! The budget of the render running on this thread: its limit, the bytes
//! it has emitted and the work it has done, the size bounds charged against
//! it, and the writer its output goes through.

use std::cell::Cell;
use std::fmt::Write as _;

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Output, State, Value};

use super::{ITEM_WORK, MAX_DEPTH, MAX_ITEMS, WORK_PER_LIMIT};

/// What the render running on this thread may still do.
#[derive(Debug, Clone, Copy)]
struct Budget {
    /// Largest value or output, in bytes.
    limit: u64,
    /// Bytes emitted so far.
    emitted: u64,
    /// Bytes built or walked so far by checked operations.
    work: u64,
}

thread_local! {
    static BUDGET: Cell<Budget> = const {
        Cell::new(Budget { limit: u64::MAX, emitted: 0, work: 0 })
    };
}

/// Runs `f` with `limit` as this thread's render limit.
pub(crate) fn with_limit<T>(limit: u64, f: impl FnOnce() -> T) -> T {
    let fresh = Budget {
        limit,
        emitted: 0,
        work: 0,
    };
    let saved = BUDGET.with(|b| b.replace(fresh));
    let out = f();
    BUDGET.with(|b| b.set(saved));
    out
}

pub(super) fn limit() -> u64 {
    BUDGET.with(|b| b.get().limit)
}

/// Adds `bytes` to the render's work (checked by the next [`check`]).
pub(super) fn charge(bytes: u64) {
    BUDGET.with(|b| {
        let mut v = b.get();
        v.work = v.work.saturating_add(bytes);
        b.set(v);
    });
}

pub(super) fn check_work() -> Result<(), Error> {
    let b = BUDGET.with(|b| b.get());
    let max = b.limit.saturating_mul(WORK_PER_LIMIT);
    if b.work > max {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "the template does too much work: its operations built or walked {} bytes, over the limit of {max}",
                b.work
            ),
        ));
    }
    Ok(())
}

fn too_large(what: &str, size: u64) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "{what} would be {size} bytes, over this render's limit of {} bytes",
            limit()
        ),
    )
}

/// Refuses a result of `size` bytes over the limit; charges it as work.
pub(super) fn check(what: &str, size: u64) -> Result<(), Error> {
    if size > limit() {
        return Err(too_large(what, size));
    }
    charge(size);
    check_work()
}

pub(super) fn check_items(what: &str, n: u64) -> Result<(), Error> {
    if n > MAX_ITEMS {
        Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("{what} would hold {n} items, over the limit of {MAX_ITEMS}"),
        ))
    } else {
        charge(n.saturating_mul(ITEM_WORK));
        check_work()
    }
}

/// An upper bound on the bytes `v` renders to (as text, or as the repr of
/// a container), or anything above `cap` once it is known to exceed it.
/// Stops walking as soon as the bound passes `cap`, so the cost is at most
/// about `cap / 2` items.
pub(crate) fn rendered_size(v: &Value, cap: u64) -> u64 {
    fn walk(v: &Value, quoted: bool, depth: usize, cap: u64, acc: &mut u64) {
        if *acc > cap {
            return;
        }
        if depth > 2 * MAX_DEPTH {
            // Deeper than anything a namespace may store: a value that
            // contains itself, or one built to be walked forever.
            *acc = u64::MAX;
            return;
        }
        match v.kind() {
            ValueKind::String => {
                let n = v.as_str().map_or(0, |s| s.len() as u64);
                // Inside a container a string is quoted and escaped
                // (`\u{1}` is 6 bytes for 1).
                *acc += if quoted { 6 * n + 2 } else { n };
            }
            ValueKind::Bytes => *acc += 4 * v.as_bytes().map_or(0, |b| b.len() as u64) + 3,
            ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
                *acc += 2;
                let Ok(items) = v.try_iter() else {
                    *acc += 64;
                    return;
                };
                let is_map = v.kind() == ValueKind::Map;
                for item in items {
                    *acc += 2;
                    walk(&item, true, depth + 1, cap, acc);
                    if is_map {
                        *acc += 2;
                        if let Ok(value) = v.get_item(&item) {
                            walk(&value, true, depth + 1, cap, acc);
                        }
                    }
                    if *acc > cap {
                        return;
                    }
                }
            }
            // Numbers, booleans, none, undefined, macros and other objects
            // render in a few dozen bytes.
            _ => *acc += 64,
        }
    }
    let mut acc = 0;
    walk(v, false, 0, cap, &mut acc);
    acc
}

/// [`rendered_size`] at the render's limit, charged as work (walking a
/// value costs about its size).
pub(super) fn size(v: &Value) -> u64 {
    let s = rendered_size(v, limit());
    charge(s.min(limit()));
    s
}

pub(super) fn str_len(v: &Value) -> u64 {
    v.as_str().map_or_else(|| size(v), |s| s.len() as u64)
}

/// Counts what every `{{ ... }}` emits (also into macro and `set` block
/// output) against the render's limit, then writes it as minijinja would.
pub(crate) fn formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    let n = size(value);
    check_work()?;
    let mut b = BUDGET.with(|b| b.get());
    b.emitted = b.emitted.saturating_add(n);
    if b.emitted > b.limit {
        return Err(too_large("the template's output", b.emitted));
    }
    BUDGET.with(|c| c.set(b));
    minijinja::escape_formatter(out, state, value)
}

/// A `fmt::Write` that refuses to grow past `cap` bytes.
pub(crate) struct CappedString {
    pub(crate) text: String,
    pub(crate) cap: usize,
    pub(crate) overflowed: bool,
}

impl std::fmt::Write for CappedString {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        if self.text.len() + s.len() > self.cap {
            self.overflowed = true;
            return Err(std::fmt::Error);
        }
        self.text.push_str(s);
        Ok(())
    }
}

impl std::io::Write for CappedString {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let s = std::str::from_utf8(buf)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        self.write_str(s)
            .map_err(|_| std::io::Error::other("output over the render's limit"))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendered_size_bounds_text_and_stops_early() {
        assert_eq!(rendered_size(&Value::from("abc"), 100), 3);
        let big: Vec<Value> = (0..1000).map(|_| Value::from("x".repeat(100))).collect();
        let v = Value::from(big);
        assert!(rendered_size(&v, u64::MAX) >= 1000 * 100);
        assert!(rendered_size(&v, 1000) < 2000, "stops once past the cap");
        let mut s = String::new();
        write!(s, "{v}").unwrap();
        assert!(rendered_size(&v, u64::MAX) >= s.len() as u64);
    }
}
