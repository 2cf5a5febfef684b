//! Bounds on what a chat template may compute.
//!
//! A template in a model file is untrusted code. minijinja bounds loop
//! counts with fuel and nesting with a recursion limit, but not the size of
//! the strings and lists a template builds: `{% set ns.s = ns.s ~ ns.s %}`
//! forty times asks for a terabyte, and one `indent`, `batch` or `format`
//! with a huge number asks for it in one step. Allocation failure aborts the
//! process, so every such size is checked *before* the allocation:
//!
//! - **Operators.** Before compiling, every `a + b`, `a ~ b` and `a * b` in
//!   the source is rewritten into a call of a checking function
//!   (`__mirage_add(a , b)`, found through minijinja's parser, so strings
//!   and nesting are respected). The function estimates the result's
//!   rendered size from its operands and refuses one over the render's
//!   limit, then computes it with minijinja's own operator.
//! - **Filters and methods** that can grow their input by a number
//!   (`replace`, `join`, `indent`, `tojson`, `format`, `batch`, `slice`,
//!   `pprint`, `list`, `split`, `lines`, and the Python string methods
//!   `replace`, `format`, `join`, `split`, `splitlines`) are wrapped with the
//!   same check; the others produce at most a small multiple of their input.
//! - **Namespaces** are the one mutable value: `{% set ns.a = ns %}` would
//!   make a value that contains itself, which printing, comparing or
//!   sizing recurses into without end (a stack overflow). The value of every
//!   `{% set X.Y = ... %}` is checked to be nested at most [`MAX_DEPTH`]
//!   levels deep (a cycle is infinitely deep) before it is stored.
//! - **Output.** Every `{{ ... }}`, in the result or inside a macro or
//!   `{% set %}` block, is counted against the limit; the result is written
//!   through a writer that stops at it.
//! - **Literal text** in a loop is bounded by fuel: each emit costs one unit,
//!   so fuel is at most [`RAW_TEXT_BUDGET`] over the longest literal segment.
//! - **Work.** Fuel counts instructions, but one `~` may copy a megabyte: a
//!   loop appending to a growing string costs the square of its length. So
//!   the bytes each checked operation builds or walks are added up, and a
//!   render stops at [`WORK_PER_LIMIT`] times its limit. Comparisons and
//!   `in` walk their operands in one instruction too (`i in range(65535)`
//!   in a loop of 65,535 is four billion steps), so every operand of a
//!   comparison is rewritten into `__mirage_walk(operand)`, which charges
//!   its size; so do the `in` test and the filters that walk a sequence.
//!
//! The limit of one render is [`BASE_LIMIT`] plus [`LIMIT_PER_INPUT_BYTE`]
//! per byte of the conversation (roles, contents, BOS/EOS): room for any
//! real template's wrapping, far below what would exhaust memory.

/// Limit of a render before the conversation's size is added.
pub const BASE_LIMIT: u64 = 1 << 20;
/// Limit added per byte of the conversation.
pub const LIMIT_PER_INPUT_BYTE: u64 = 16;
/// Most items a sequence built by a filter or operator may hold.
pub const MAX_ITEMS: u64 = 1 << 20;
/// Bytes of literal template text a render may emit (fuel is derived from it).
pub const RAW_TEXT_BUDGET: u64 = 256 << 20;
/// Most fuel (minijinja instructions) a render may use.
pub const MAX_FUEL: u64 = 5_000_000;
/// Nesting of calls and blocks: low enough for a 2 MiB thread stack.
pub const RECURSION_LIMIT: usize = 100;
/// Bytes a render may build or walk in checked operations, per byte of its
/// limit.
pub const WORK_PER_LIMIT: u64 = 64;
/// Work charged for visiting one item of a list or map (what walking it
/// costs, in bytes copied).
const ITEM_WORK: u64 = 64;
/// Deepest nesting of lists, maps and namespaces a namespace may store.
pub const MAX_DEPTH: usize = 32;
/// Longest template source accepted.
pub const MAX_SOURCE_BYTES: usize = 1 << 20;

mod budget;
mod checks;
mod rewrite;

pub(crate) use budget::{formatter, with_limit, CappedString};
pub(crate) use checks::{install, method};
pub(crate) use rewrite::rewrite_operators;
