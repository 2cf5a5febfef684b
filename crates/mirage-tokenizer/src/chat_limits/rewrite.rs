//! The source rewrite run before compiling: every `+`, `~` and `*` becomes
//! a call of its checking function, every comparison operand a
//! `__mirage_walk(...)`, and every namespace assignment a
//! `__mirage_store(...)` (see the module doc of `chat_limits`).

use minijinja::machinery::{ast, WhitespaceConfig};
use minijinja::{Error, ErrorKind};

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
}
