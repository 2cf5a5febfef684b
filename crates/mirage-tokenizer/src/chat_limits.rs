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

use std::cell::Cell;
use std::fmt::Write as _;

use minijinja::machinery::{ast, WhitespaceConfig};
use minijinja::value::{Kwargs, Rest, StringInput, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State, Value};

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

fn limit() -> u64 {
    BUDGET.with(|b| b.get().limit)
}

/// Adds `bytes` to the render's work (checked by the next [`check`]).
fn charge(bytes: u64) {
    BUDGET.with(|b| {
        let mut v = b.get();
        v.work = v.work.saturating_add(bytes);
        b.set(v);
    });
}

fn check_work() -> Result<(), Error> {
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
fn check(what: &str, size: u64) -> Result<(), Error> {
    if size > limit() {
        return Err(too_large(what, size));
    }
    charge(size);
    check_work()
}

fn check_items(what: &str, n: u64) -> Result<(), Error> {
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

/// Whether `v` is nested deeper than `limit` levels of lists, maps and
/// namespaces, contains `target` (by identity), or takes more than
/// `budget` items to find out.
fn too_deep_or_contains(v: &Value, target: &Value, limit: usize, budget: &mut u64) -> bool {
    if v.as_object().is_some() && minijinja::tests::is_sameas(v, target) {
        return true;
    }
    if !matches!(
        v.kind(),
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map
    ) {
        return false;
    }
    if limit == 0 {
        return true;
    }
    let Ok(items) = v.try_iter() else {
        return false;
    };
    let is_map = v.kind() == ValueKind::Map;
    for item in items {
        if *budget == 0 {
            return true;
        }
        *budget -= 1;
        let child = if is_map {
            v.get_item(&item).unwrap_or_default()
        } else {
            item
        };
        if too_deep_or_contains(&child, target, limit - 1, budget) {
            return true;
        }
    }
    false
}

/// What `{% set ns.attr = value %}` stores: `value`, if it neither contains
/// `ns` nor nests deeper than [`MAX_DEPTH`] (see the module doc).
fn store(value: Value, namespace: Value) -> Result<Value, Error> {
    let start = limit() / 2;
    let mut budget = start;
    let refused = too_deep_or_contains(&value, &namespace, MAX_DEPTH, &mut budget);
    charge((start - budget).saturating_mul(ITEM_WORK));
    check_work()?;
    if refused {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "a namespace may not store itself, or a value nested more than {MAX_DEPTH} levels deep"
            ),
        ));
    }
    Ok(value)
}

/// [`rendered_size`] at the render's limit, charged as work (walking a
/// value costs about its size).
fn size(v: &Value) -> u64 {
    let s = rendered_size(v, limit());
    charge(s.min(limit()));
    s
}

fn str_len(v: &Value) -> u64 {
    v.as_str().map_or_else(|| size(v), |s| s.len() as u64)
}

// ---------------------------------------------------------------------------
// Operators.

/// The checking function each operator becomes.
fn operator_function(op: ast::BinOpKind) -> Option<&'static str> {
    match op {
        ast::BinOpKind::Add => Some("__mirage_add"),
        ast::BinOpKind::Concat => Some("__mirage_concat"),
        ast::BinOpKind::Mul => Some("__mirage_mul"),
        _ => None,
    }
}

/// Where `e`'s source starts. minijinja's spans of comparisons and `if`
/// expressions start at the token before them, those of filters and tests
/// at their name and those of a second `.x`, `[i]` or call at its own
/// token, so those are found through their operands.
fn expr_start(e: &ast::Expr<'_>) -> usize {
    use ast::Expr as E;
    match e {
        E::BinOp(b) if is_comparison(b.op) => expr_start(&b.left),
        E::Compare(c) => expr_start(&c.expr),
        E::IfExpr(i) => expr_start(&i.true_expr),
        E::Filter(f) => f
            .expr
            .as_ref()
            .map_or(e.span().start_offset as usize, expr_start),
        E::Test(t) => expr_start(&t.expr),
        E::GetAttr(g) => expr_start(&g.expr),
        E::GetItem(g) => expr_start(&g.expr),
        E::Slice(s) => expr_start(&s.expr),
        E::Call(c) => expr_start(&c.expr),
        E::UnaryOp(u)
            if matches!(&u.expr, E::Test(_))
                || matches!(&u.expr, E::BinOp(b) if is_comparison(b.op)) =>
        {
            expr_start(&u.expr)
        }
        _ => e.span().start_offset as usize,
    }
}

fn is_comparison(op: ast::BinOpKind) -> bool {
    use ast::BinOpKind as K;
    matches!(op, K::Eq | K::Ne | K::Lt | K::Lte | K::Gt | K::Gte | K::In)
}

/// Length of the comparison operator `rest` starts with (`not in` with the
/// spaces between), if it starts with one.
fn comparison_operator_len(rest: &[u8]) -> Option<usize> {
    let word_end = |n: usize| {
        rest.get(n)
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || *c == b'_'))
    };
    if rest.starts_with(b"==")
        || rest.starts_with(b"!=")
        || rest.starts_with(b"<=")
        || rest.starts_with(b">=")
    {
        Some(2)
    } else if rest.starts_with(b"<") || rest.starts_with(b">") {
        Some(1)
    } else if rest.starts_with(b"in") && word_end(2) {
        Some(2)
    } else if rest.starts_with(b"not") && word_end(3) {
        let mut n = 3;
        while rest.get(n).is_some_and(|c| c.is_ascii_whitespace()) {
            n += 1;
        }
        (n > 3 && rest[n..].starts_with(b"in") && word_end(n + 2)).then_some(n + 2)
    } else {
        None
    }
}

fn operator_char(op: ast::BinOpKind) -> u8 {
    match op {
        ast::BinOpKind::Add => b'+',
        ast::BinOpKind::Concat => b'~',
        _ => b'*',
    }
}

/// One edit of the source: text inserted at `at` (replacing `remove` bytes).
struct Edit {
    at: usize,
    /// Order among edits at the same offset: closing parentheses first,
    /// then opening calls of longer spans before shorter ones.
    order: (u8, std::cmp::Reverse<usize>),
    remove: usize,
    text: std::borrow::Cow<'static, str>,
}

/// The source with every `+`, `~` and `*` rewritten into a checking call,
/// and the length of its longest literal text segment.
pub(crate) fn rewrite_operators(
    source: &str,
    ws: WhitespaceConfig,
) -> Result<(String, usize), Error> {
    let ast = minijinja::machinery::parse(source, "chat", minijinja::syntax::SyntaxConfig, ws)?;
    let mut w = Walker {
        source: source.as_bytes(),
        edits: Vec::new(),
        max_raw: 0,
        error: None,
    };
    w.stmt(&ast);
    if let Some(e) = w.error {
        return Err(e);
    }
    let mut edits = w.edits;
    edits.sort_by_key(|e| (e.at, e.order));
    let mut out = String::with_capacity(source.len() + edits.len() * 16);
    let mut pos = 0;
    for e in &edits {
        if e.at < pos {
            return Err(Error::new(
                ErrorKind::SyntaxError,
                format!("overlapping expressions at byte {}", e.at),
            ));
        }
        out.push_str(&source[pos..e.at]);
        out.push_str(&e.text);
        pos = e.at + e.remove;
    }
    out.push_str(&source[pos..]);
    Ok((out, w.max_raw))
}

struct Walker<'s> {
    source: &'s [u8],
    edits: Vec<Edit>,
    max_raw: usize,
    error: Option<Error>,
}

impl Walker<'_> {
    fn stmts(&mut self, body: &[ast::Stmt<'_>]) {
        for s in body {
            self.stmt(s);
        }
    }

    fn stmt(&mut self, s: &ast::Stmt<'_>) {
        use ast::Stmt as S;
        match s {
            S::Template(t) => self.stmts(&t.children),
            S::EmitExpr(e) => self.expr(&e.expr),
            S::EmitRaw(r) => self.max_raw = self.max_raw.max(r.raw.len()),
            S::ForLoop(f) => {
                self.expr(&f.target);
                self.expr(&f.iter);
                if let Some(e) = &f.filter_expr {
                    self.expr(e);
                }
                self.stmts(&f.body);
                self.stmts(&f.else_body);
            }
            S::IfCond(i) => {
                self.expr(&i.expr);
                self.stmts(&i.true_body);
                self.stmts(&i.false_body);
            }
            S::WithBlock(w) => {
                for (a, b) in &w.assignments {
                    self.expr(a);
                    self.expr(b);
                }
                self.stmts(&w.body);
            }
            S::Set(s) => {
                self.expr(&s.target);
                if matches!(s.target, ast::Expr::GetAttr(_)) {
                    self.namespace_store(&s.target, &s.expr);
                }
                self.expr(&s.expr);
            }
            S::SetBlock(s) => {
                self.expr(&s.target);
                if let Some(f) = &s.filter {
                    self.expr(f);
                }
                self.stmts(&s.body);
            }
            S::AutoEscape(a) => {
                self.expr(&a.enabled);
                self.stmts(&a.body);
            }
            S::FilterBlock(f) => {
                self.expr(&f.filter);
                self.stmts(&f.body);
            }
            S::Block(b) => self.stmts(&b.body),
            S::Import(i) => {
                self.expr(&i.expr);
                self.expr(&i.name);
            }
            S::FromImport(i) => {
                self.expr(&i.expr);
                for (a, b) in &i.names {
                    self.expr(a);
                    if let Some(b) = b {
                        self.expr(b);
                    }
                }
            }
            S::Extends(e) => self.expr(&e.name),
            S::Include(i) => self.expr(&i.name),
            S::Macro(m) => self.macro_decl(m),
            S::CallBlock(c) => {
                self.call(&c.call);
                self.macro_decl(&c.macro_decl);
            }
            S::Continue(_) | S::Break(_) => {}
            S::Do(d) => self.call(&d.call),
        }
    }

    fn macro_decl(&mut self, m: &ast::Macro<'_>) {
        for e in m.args.iter().chain(&m.defaults) {
            self.expr(e);
        }
        self.stmts(&m.body);
    }

    fn call(&mut self, c: &ast::Call<'_>) {
        self.expr(&c.expr);
        self.args(&c.args);
    }

    fn args(&mut self, args: &[ast::CallArg<'_>]) {
        for a in args {
            match a {
                ast::CallArg::Pos(e)
                | ast::CallArg::Kwarg(_, e)
                | ast::CallArg::PosSplat(e)
                | ast::CallArg::KwargSplat(e) => self.expr(e),
            }
        }
    }

    fn expr(&mut self, e: &ast::Expr<'_>) {
        use ast::Expr as E;
        match e {
            E::Var(_) | E::Const(_) => {}
            E::Slice(s) => {
                self.expr(&s.expr);
                for x in [&s.start, &s.stop, &s.step].into_iter().flatten() {
                    self.expr(x);
                }
            }
            E::UnaryOp(u) => self.expr(&u.expr),
            E::BinOp(b) => {
                self.binop(b);
                if is_comparison(b.op) {
                    self.comparison(
                        expr_start(&b.left),
                        b.left.span().end_offset as usize,
                        &[b.span().end_offset as usize],
                    );
                }
                self.expr(&b.left);
                self.expr(&b.right);
            }
            E::Compare(c) => {
                let mut ends: Vec<usize> = c
                    .ops
                    .iter()
                    .map(|op| op.expr.span().end_offset as usize)
                    .collect();
                if let Some(last) = ends.last_mut() {
                    *last = c.span().end_offset as usize;
                }
                self.comparison(
                    expr_start(&c.expr),
                    c.expr.span().end_offset as usize,
                    &ends,
                );
                self.expr(&c.expr);
                for op in &c.ops {
                    self.expr(&op.expr);
                }
            }
            E::IfExpr(i) => {
                self.expr(&i.test_expr);
                self.expr(&i.true_expr);
                if let Some(f) = &i.false_expr {
                    self.expr(f);
                }
            }
            E::Filter(f) => {
                if let Some(x) = &f.expr {
                    self.expr(x);
                }
                self.args(&f.args);
            }
            E::Test(t) => {
                self.expr(&t.expr);
                self.args(&t.args);
            }
            E::GetAttr(g) => self.expr(&g.expr),
            E::GetItem(g) => {
                self.expr(&g.expr);
                self.expr(&g.subscript_expr);
            }
            E::Call(c) => self.call(c),
            E::List(l) => {
                for x in &l.items {
                    self.expr(x);
                }
            }
            E::Map(m) => {
                for x in m.keys.iter().chain(&m.values) {
                    self.expr(x);
                }
            }
        }
    }

    /// `{% set NS.Y = VALUE %}` becomes
    /// `{% set NS.Y = __mirage_store(VALUE, NS) %}`. VALUE starts after the
    /// `=` that follows the target (its own span may start later, at a
    /// filter's name) and ends where its span ends.
    fn namespace_store(&mut self, target: &ast::Expr<'_>, value: &ast::Expr<'_>) {
        let ast::Expr::GetAttr(attr) = target else {
            return;
        };
        let ast::Expr::Var(ns) = &attr.expr else {
            self.error = Some(Error::new(
                ErrorKind::SyntaxError,
                "only `{% set name.attr = ... %}` assigns to a namespace",
            ));
            return;
        };
        let end = value.span().end_offset as usize;
        let mut at = target.span().end_offset as usize;
        while at < end && self.source[at].is_ascii_whitespace() {
            at += 1;
        }
        if at >= end || self.source[at] != b'=' {
            self.error = Some(Error::new(
                ErrorKind::SyntaxError,
                format!("cannot locate the value of the assignment at byte {at}"),
            ));
            return;
        }
        at += 1;
        while at < end && self.source[at].is_ascii_whitespace() {
            at += 1;
        }
        // One longer than the span, so that an operator spanning the whole
        // value opens inside this call and closes before it.
        let len = end - at + 1;
        self.edits.push(Edit {
            at,
            order: (1, std::cmp::Reverse(len)),
            remove: 0,
            text: "__mirage_store(".into(),
        });
        self.edits.push(Edit {
            at: end,
            order: (0, std::cmp::Reverse(usize::MAX - len)),
            remove: 0,
            text: format!(", {})", ns.id).into(),
        });
    }

    /// `A op B op C` (`==`, `!=`, `<`, `<=`, `>`, `>=`, `in`, `not in`)
    /// becomes `__mirage_walk(A) op __mirage_walk(B) op __mirage_walk(C)`.
    /// The chain starts at `start`; its first operand ends at `first_end`
    /// and each following one at `ends[i]` (the last one ends the chain).
    /// Each operator is the first non-space byte after the previous operand
    /// that is not the `)` of a parenthesized operand.
    fn comparison(&mut self, start: usize, first_end: usize, ends: &[usize]) {
        let mut operand_start = start;
        let mut operand_end = first_end;
        for &next_end in ends {
            let (at, close) = self.operator_after(operand_end, next_end);
            let Some(op_len) = comparison_operator_len(&self.source[at..next_end]) else {
                self.error = Some(Error::new(
                    ErrorKind::SyntaxError,
                    format!("cannot locate the comparison at byte {at}"),
                ));
                return;
            };
            self.wrap(operand_start, close, "__mirage_walk(");
            operand_start = at + op_len;
            while operand_start < next_end && self.source[operand_start].is_ascii_whitespace() {
                operand_start += 1;
            }
            operand_end = next_end;
        }
        self.wrap(operand_start, operand_end, "__mirage_walk(");
    }

    /// Where the operator after an operand ending at `operand_end` starts
    /// (the first byte before `end` that is neither space nor the `)` of a
    /// parenthesized operand), and where the operand's parentheses end.
    fn operator_after(&self, operand_end: usize, end: usize) -> (usize, usize) {
        let (mut at, mut close) = (operand_end, operand_end);
        while at < end && (self.source[at].is_ascii_whitespace() || self.source[at] == b')') {
            at += 1;
            if self.source[at - 1] == b')' {
                close = at;
            }
        }
        (at, close)
    }

    /// Encloses `source[start..end]` in `open` ... `)`. At one offset,
    /// closing parentheses come first, shorter (inner) spans first, then
    /// openings of longer (outer) spans before shorter ones.
    fn wrap(&mut self, start: usize, end: usize, open: &'static str) {
        let len = end - start;
        self.edits.push(Edit {
            at: start,
            order: (1, std::cmp::Reverse(len)),
            remove: 0,
            text: open.into(),
        });
        self.edits.push(Edit {
            at: end,
            order: (0, std::cmp::Reverse(usize::MAX - len)),
            remove: 0,
            text: ")".into(),
        });
    }

    /// `LEFT op RIGHT` becomes `__fn(LEFT , RIGHT)`; the operator is found
    /// by [`Self::operator_after`].
    fn binop(&mut self, b: &ast::Spanned<ast::BinOp<'_>>) {
        let Some(function) = operator_function(b.op) else {
            return;
        };
        let span = b.span();
        let (start, end) = (span.start_offset as usize, span.end_offset as usize);
        let (at, _) = self.operator_after(b.left.span().end_offset as usize, end);
        if at >= end || self.source[at] != operator_char(b.op) {
            self.error = Some(Error::new(
                ErrorKind::SyntaxError,
                format!("cannot locate the operator of the expression at byte {start}"),
            ));
            return;
        }
        let open: &'static str = match function {
            "__mirage_add" => "__mirage_add(",
            "__mirage_concat" => "__mirage_concat(",
            _ => "__mirage_mul(",
        };
        self.wrap(start, end, open);
        self.edits.push(Edit {
            at,
            order: (1, std::cmp::Reverse(0)),
            remove: 1,
            text: ",".into(),
        });
    }
}

/// minijinja's own operators, applied after the size check (one compiled
/// expression each, in an environment of their own).
fn apply(op: &'static str, a: Value, b: Value) -> Result<Value, Error> {
    use std::sync::OnceLock;
    static ENV: OnceLock<Environment<'static>> = OnceLock::new();
    type Expr = minijinja::Expression<'static, 'static>;
    static EXPRS: OnceLock<[Expr; 2]> = OnceLock::new();
    let exprs = EXPRS.get_or_init(|| {
        let env = ENV.get_or_init(Environment::new);
        ["a + b", "a * b"].map(|s| env.compile_expression(s).expect("valid"))
    });
    let e = match op {
        "+" => &exprs[0],
        _ => &exprs[1],
    };
    e.eval(minijinja::context! { a => a, b => b })
}

fn is_seq(v: &Value) -> bool {
    matches!(v.kind(), ValueKind::Seq | ValueKind::Iterable)
}

fn add(a: Value, b: Value) -> Result<Value, Error> {
    // Two strings, the common case: what minijinja's `+` does, without
    // evaluating an expression.
    if let (ValueKind::String, ValueKind::String) = (a.kind(), b.kind()) {
        if let (Some(x), Some(y)) = (a.as_str(), b.as_str()) {
            check("the result of `+`", x.len() as u64 + y.len() as u64)?;
            return Ok(Value::from([x, y].concat()));
        }
    }
    if a.kind() == ValueKind::String || is_seq(&a) {
        check("the result of `+`", size(&a).saturating_add(size(&b)))?;
        if is_seq(&a) {
            let n = a.len().unwrap_or(0) as u64 + b.len().unwrap_or(0) as u64;
            check_items("the result of `+`", n)?;
        }
    }
    apply("+", a, b)
}

fn concat(a: Value, b: Value) -> Result<Value, Error> {
    check("the result of `~`", size(&a).saturating_add(size(&b)))?;
    // minijinja's `~` (`ops::string_concat`).
    Ok(Value::from(format!("{a}{b}")))
}

fn mul(a: Value, b: Value) -> Result<Value, Error> {
    let (item, times) = if a.is_number() { (&b, &a) } else { (&a, &b) };
    if item.kind() == ValueKind::String || is_seq(item) {
        // Not a count (negative, fractional): minijinja's error.
        if let Ok(n) = u64::try_from(times.clone()) {
            if is_seq(item) {
                // Repeating is lazy: even `[] * n` takes n steps to walk.
                let len = item.len().unwrap_or(0).max(1) as u64;
                check_items("the result of `*`", len.saturating_mul(n))?;
            }
            check("the result of `*`", size(item).saturating_mul(n))?;
        }
    }
    apply("*", a, b)
}

// ---------------------------------------------------------------------------
// Filters and methods.

/// Occurrences of `from` in `s` (Python and minijinja count `len + 1` for
/// an empty pattern).
fn occurrences(s: &str, from: &str) -> u64 {
    if from.is_empty() {
        s.chars().count() as u64 + 1
    } else {
        s.matches(from).count() as u64
    }
}

fn replace_size(s: &str, from: &str, to: &str, count: Option<u64>) -> u64 {
    let n = occurrences(s, from).min(count.unwrap_or(u64::MAX));
    (s.len() as u64).saturating_add(n.saturating_mul(to.len() as u64))
}

fn join_size(items: &Value, joiner: u64) -> Result<u64, Error> {
    let n = items.len().unwrap_or(0) as u64;
    check_items("`join`", n)?;
    Ok(size(items).saturating_add(n.saturating_mul(joiner)))
}

/// An upper bound on what a printf or `str.format` string renders to: its
/// own length, its arguments', and every number in it read as a width.
fn format_size(fmt: &str, args: &[Value]) -> u64 {
    let mut total = fmt.len() as u64;
    for a in args {
        total = total.saturating_add(size(a));
    }
    let mut digits = 0u64;
    for c in fmt.chars().chain(std::iter::once(' ')) {
        match c.to_digit(10) {
            Some(d) => digits = digits.saturating_mul(10).saturating_add(d as u64),
            None => {
                total = total.saturating_add(digits);
                digits = 0;
            }
        }
    }
    total
}

/// Registers the checking operators and filters on `env`.
pub(crate) fn install(env: &mut Environment<'_>) {
    env.add_function("__mirage_add", add);
    env.add_function("__mirage_concat", concat);
    env.add_function("__mirage_mul", mul);
    env.add_function("__mirage_store", store);
    env.add_function("__mirage_walk", |v: Value| -> Result<Value, Error> {
        walked(&v)?;
        Ok(v)
    });
    env.add_test("in", |state: &State, v: &Value, other: &Value| {
        walked(other)?;
        minijinja::tests::is_in(state, v, other)
    });
    install_walking_filters(env);
    env.add_filter("string", |state: &State, v: &Value| {
        check("`string`", size(v))?;
        minijinja::filters::string(state, v)
    });
    env.add_filter(
        "replace",
        |state: &State, v: StringInput<'_>, from: StringInput<'_>, to: StringInput<'_>| {
            check(
                "`replace`",
                replace_size(v.as_str(), from.as_str(), to.as_str(), None),
            )?;
            minijinja::filters::replace(state, v, from, to)
        },
    );
    env.add_filter(
        "join",
        |state: &State, v: &Value, joiner: Option<StringInput<'_>>| {
            let j = joiner.as_ref().map_or(0, |j| j.as_str().len() as u64);
            check("`join`", join_size(v, j)?)?;
            minijinja::filters::join(state, v, joiner)
        },
    );
    env.add_filter(
        "indent",
        |v: StringInput<'_>,
         width: Option<usize>,
         first: Option<bool>,
         blank: Option<bool>,
         kwargs: Kwargs| {
            let w = match width {
                Some(w) => w as u64,
                None => kwargs.get::<Option<usize>>("width")?.unwrap_or(4) as u64,
            };
            let lines = v.as_str().lines().count() as u64 + 1;
            check(
                "`indent`",
                (v.as_str().len() as u64).saturating_add(lines.saturating_mul(w)),
            )?;
            minijinja::filters::indent(v, width, first, blank, kwargs)
        },
    );
    // Python's `json.dumps` output (what Hugging Face's templates see), its
    // size checked before it is built.
    env.add_filter(
        "tojson",
        |v: &Value, indent: Option<Value>, kwargs: Kwargs| -> Result<Value, Error> {
            let indent = match indent {
                Some(i) => Some(i),
                None => kwargs.get::<Option<Value>>("indent")?,
            };
            kwargs.assert_all_used()?;
            let indent = indent
                .map(|i| {
                    usize::try_from(i).map_err(|_| {
                        Error::new(
                            ErrorKind::InvalidOperation,
                            "`tojson`: indent is not a count",
                        )
                    })
                })
                .transpose()?;
            // Each item may get a line of `indent` spaces per nesting level;
            // escapes take at most 6 bytes for 1.
            let s = size(v);
            let items = s / 2 + 1;
            let per_level = indent.unwrap_or(2) as u64;
            check(
                "`tojson`",
                s.saturating_mul(6).saturating_add(
                    items.saturating_mul(per_level.saturating_mul(32).saturating_add(1)),
                ),
            )?;
            let json = serde_json::to_value(v)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            Ok(Value::from_safe_string(crate::chat::python_json(
                &json, indent,
            )))
        },
    );
    env.add_filter("format", |state: &State, fmt: &Value, args: Rest<Value>| {
        check("`format`", format_size(fmt.as_str().unwrap_or(""), &args))?;
        minijinja::filters::format(state, fmt, args)
    });
    env.add_filter(
        "batch",
        |state: &State, v: Value, count: usize, fill: Option<Value>| {
            check_items("`batch`", count as u64)?;
            minijinja::filters::batch(state, v, count, fill)
        },
    );
    env.add_filter(
        "slice",
        |state: &State, v: Value, count: usize, fill: Option<Value>| {
            check_items("`slice`", count as u64)?;
            // Every slice may be padded to the longest one.
            let longest = v.len().unwrap_or(0) as u64 / (count.max(1) as u64) + 1;
            check_items("`slice`", longest.saturating_mul(count as u64))?;
            minijinja::filters::slice(state, v, count, fill)
        },
    );
    env.add_filter("pprint", |v: &Value| {
        // Pretty printing indents each item by its depth.
        let s = size(v);
        check("`pprint`", s.saturating_mul(8))?;
        Ok::<_, Error>(minijinja::filters::pprint(v))
    });
    env.add_filter("list", |state: &State, v: Value| {
        check_items(
            "`list`",
            str_len(&v).min(v.len().unwrap_or(usize::MAX) as u64),
        )?;
        minijinja::filters::list(state, v)
    });
    env.add_filter(
        "split",
        |v: &Value, sep: Option<std::sync::Arc<str>>, max: Option<i64>| {
            check_items("`split`", str_len(v))?;
            minijinja::filters::split(v, sep, max)
        },
    );
    env.add_filter("lines", |v: &Value| {
        check_items("`lines`", str_len(v))?;
        minijinja::filters::lines(v)
    });
}

/// Charges walking `v` (its size) as work.
fn walked(v: &Value) -> Result<(), Error> {
    size(v);
    check_work()
}

/// The filters that walk a whole sequence in one step, each charged the
/// size of what it walks first.
fn install_walking_filters(env: &mut Environment<'_>) {
    use minijinja::filters as f;
    env.add_filter("sum", |s: &State, v: Value| {
        walked(&v)?;
        f::sum(s, v)
    });
    env.add_filter("min", |s: &State, v: Value| {
        walked(&v)?;
        f::min(s, v)
    });
    env.add_filter("max", |s: &State, v: Value| {
        walked(&v)?;
        f::max(s, v)
    });
    env.add_filter("sort", |s: &State, v: Value, k: Kwargs| {
        walked(&v)?;
        f::sort(s, v, k)
    });
    env.add_filter("unique", |s: &State, v: Value, k: Kwargs| {
        walked(&v)?;
        f::unique(s, v, k)
    });
    env.add_filter("reverse", |v: &Value| {
        walked(v)?;
        f::reverse(v)
    });
    env.add_filter("last", |v: Value| {
        walked(&v)?;
        f::last(v)
    });
    env.add_filter("dictsort", |v: &Value, k: Kwargs| {
        walked(v)?;
        f::dictsort(v, k)
    });
    env.add_filter("items", |v: &Value| {
        walked(v)?;
        f::items(v)
    });
    env.add_filter("groupby", |v: Value, a: Option<&str>, k: Kwargs| {
        walked(&v)?;
        f::groupby(v, a, k)
    });
    env.add_filter(
        "select",
        |s: &State, v: Value, t: Option<std::borrow::Cow<'_, str>>, a: Rest<Value>| {
            walked(&v)?;
            f::select(s, v, t, a)
        },
    );
    env.add_filter(
        "reject",
        |s: &State, v: Value, t: Option<std::borrow::Cow<'_, str>>, a: Rest<Value>| {
            walked(&v)?;
            f::reject(s, v, t, a)
        },
    );
    env.add_filter(
        "selectattr",
        |s: &State,
         v: Value,
         attr: std::borrow::Cow<'_, str>,
         t: Option<std::borrow::Cow<'_, str>>,
         a: Rest<Value>| {
            walked(&v)?;
            f::selectattr(s, v, attr, t, a)
        },
    );
    env.add_filter(
        "rejectattr",
        |s: &State,
         v: Value,
         attr: std::borrow::Cow<'_, str>,
         t: Option<std::borrow::Cow<'_, str>>,
         a: Rest<Value>| {
            walked(&v)?;
            f::rejectattr(s, v, attr, t, a)
        },
    );
    env.add_filter("map", |s: &State, v: Value, a: Rest<Value>| {
        walked(&v)?;
        f::map(s, v, a)
    });
}

/// The Python string methods templates call (minijinja-contrib's pycompat),
/// with the growing ones checked first.
pub(crate) fn method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let arg = |i: usize| args.get(i).and_then(|a| a.as_str()).unwrap_or("");
        match method {
            "replace" => {
                let count = args
                    .get(2)
                    .and_then(|c| i64::try_from(c.clone()).ok())
                    .filter(|&c| c >= 0)
                    .map(|c| c as u64);
                check("`str.replace`", replace_size(s, arg(0), arg(1), count))?;
            }
            "format" => check("`str.format`", format_size(s, args))?,
            "join" => {
                if let Some(items) = args.first() {
                    check("`str.join`", join_size(items, s.len() as u64)?)?;
                }
            }
            "split" | "splitlines" => check_items("`str.split`", s.len() as u64 + 1)?,
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
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

    fn ws() -> WhitespaceConfig {
        WhitespaceConfig::default()
    }

    #[test]
    fn operators_become_checking_calls_with_nesting_and_strings_kept() {
        let (out, raw) = rewrite_operators(
            "A{{ (a ~ '~)') ~ c|upper ~ (d) }}{{ x + -y * 2 }}{% set s = [1] + [2] %}BB",
            ws(),
        )
        .unwrap();
        assert_eq!(
            out,
            "A{{ __mirage_concat(__mirage_concat((__mirage_concat(a , '~)')) , c|upper) , (d)) }}\
             {{ __mirage_add(x , __mirage_mul(-y , 2)) }}{% set s = __mirage_add([1] , [2]) %}BB"
        );
        assert_eq!(raw, 2);
        let (out, _) =
            rewrite_operators("{% set ns.s = ns.s ~ x|trim %}{% set y = 1 + 2 %}", ws()).unwrap();
        assert_eq!(
            out,
            "{% set ns.s = __mirage_store(__mirage_concat(ns.s , x|trim), ns) %}{% set y = __mirage_add(1 , 2) %}"
        );
    }

    #[test]
    fn comparison_operands_are_charged_as_walks() {
        let (out, _) = rewrite_operators(
            "{% if m[0]['role'].x == 'x' and b not in c|list %}{% endif %}{{ 1 < x <= 3 }}{{ (a) in (b) }}{{ a ~ b in c }}",
            ws(),
        )
        .unwrap();
        assert_eq!(
            out,
            "{% if __mirage_walk(m[0]['role'].x) == __mirage_walk('x') and __mirage_walk(b) not in __mirage_walk(c|list) %}{% endif %}\
             {{ __mirage_walk(1) < __mirage_walk(x) <= __mirage_walk(3) }}{{ (__mirage_walk(a)) in __mirage_walk((b)) }}\
             {{ __mirage_walk(__mirage_concat(a , b)) in __mirage_walk(c) }}"
        );
    }

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

    #[test]
    fn format_size_counts_widths() {
        assert!(format_size("%999999999999d", &[]) >= 999_999_999_999);
        assert!(format_size("{:>50}", &[Value::from("ab")]) >= 52);
    }
}
