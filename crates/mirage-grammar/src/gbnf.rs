//! GBNF (llama.cpp's grammar format) to llguidance's Lark syntax.
//!
//! GBNF: `name ::= body` rules, `root` the start; bodies of string literals
//! (`"..."` with `\x`, `\u`, `\U`, `\t`, `\r`, `\n` escapes), character
//! classes (`[a-z]`, `[^"\\]`), `.` (any character), rule names, groups,
//! `|`, and the postfix operators `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`;
//! `#` comments; a rule ends at a newline outside parentheses (it may go on
//! after `::=`, or at a `|` that ends a line or opens the next one).
//!
//! In the output `root` becomes `start`; a rule that reaches no other
//! (non-terminal) rule becomes an upper-case Lark terminal, so that it is
//! matched as one lexeme by llguidance's lexer instead of character by
//! character in the parser. Lexemes are matched greedily, which is the one
//! place the meaning can differ from llama.cpp's character-level matcher
//! (a terminal like `[a-z]+` followed by a literal starting with a
//! letter); llama.cpp's converters and llguidance's own have the same
//! limit. Token references (`<[id]>`, `<name>`) are not supported.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write;

/// A GBNF grammar that could not be read or converted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("GBNF line {line}, column {column}: {message}")]
pub struct GbnfError {
    /// 1-based line.
    pub line: usize,
    /// 1-based column (characters).
    pub column: usize,
    /// What is wrong there.
    pub message: String,
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    Literal(String),
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    Any,
    Ref {
        name: String,
        at: usize,
    },
    Seq(Vec<Node>),
    Alt(Vec<Node>),
    Repeat {
        node: Box<Node>,
        min: u32,
        max: Option<u32>,
    },
}

struct Parser<'a> {
    src: &'a str,
    chars: Vec<(usize, char)>,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn new(src: &'a str) -> Parser<'a> {
        Parser {
            src,
            chars: src.char_indices().collect(),
            pos: 0,
        }
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).map(|c| c.1)
    }

    fn peek_at(&self, k: usize) -> Option<char> {
        self.chars.get(self.pos + k).map(|c| c.1)
    }

    fn error_at(&self, pos: usize, message: impl Into<String>) -> GbnfError {
        let byte = self.chars.get(pos).map_or(self.src.len(), |c| c.0);
        let before = &self.src[..byte];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        GbnfError {
            line,
            column,
            message: message.into(),
        }
    }

    fn error(&self, message: impl Into<String>) -> GbnfError {
        self.error_at(self.pos, message)
    }

    /// Skips blanks and comments, and newlines when `newlines`.
    fn skip_space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '\r' | '\n' if newlines => self.pos += 1,
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.pos += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn is_word(c: char) -> bool {
        c.is_ascii_alphanumeric() || c == '-' || c == '_'
    }

    fn name(&mut self) -> Result<String, GbnfError> {
        let start = self.pos;
        while self.peek().is_some_and(Self::is_word) {
            self.pos += 1;
        }
        if start == self.pos {
            return Err(self.error("expected a rule name"));
        }
        Ok(self.chars[start..self.pos].iter().map(|c| c.1).collect())
    }

    fn hex(&mut self, digits: usize) -> Result<char, GbnfError> {
        let start = self.pos;
        let mut v = 0u32;
        for _ in 0..digits {
            let d = self
                .peek()
                .and_then(|c| c.to_digit(16))
                .ok_or_else(|| self.error(format!("expected {digits} hex digits")))?;
            v = v * 16 + d;
            self.pos += 1;
        }
        char::from_u32(v).ok_or_else(|| self.error_at(start, format!("U+{v:X} is not a character")))
    }

    /// One character of a literal or class, escapes decoded.
    fn char_lit(&mut self) -> Result<char, GbnfError> {
        let c = self
            .peek()
            .ok_or_else(|| self.error("unexpected end of grammar"))?;
        self.pos += 1;
        if c != '\\' {
            return Ok(c);
        }
        let e = self.peek().ok_or_else(|| self.error("unfinished escape"))?;
        self.pos += 1;
        Ok(match e {
            'x' => self.hex(2)?,
            'u' => self.hex(4)?,
            'U' => self.hex(8)?,
            't' => '\t',
            'r' => '\r',
            'n' => '\n',
            '\\' | '"' | '[' | ']' | '-' | '^' | '/' => e,
            _ => return Err(self.error_at(self.pos - 2, format!("unknown escape \\{e}"))),
        })
    }

    fn literal(&mut self) -> Result<Node, GbnfError> {
        self.pos += 1; // "
        let mut s = String::new();
        loop {
            match self.peek() {
                None => return Err(self.error("unterminated string literal")),
                Some('"') => {
                    self.pos += 1;
                    return Ok(Node::Literal(s));
                }
                _ => s.push(self.char_lit()?),
            }
        }
    }

    fn class(&mut self) -> Result<Node, GbnfError> {
        let open = self.pos;
        self.pos += 1; // [
        let negated = self.peek() == Some('^');
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        loop {
            match self.peek() {
                None => return Err(self.error_at(open, "unterminated character class")),
                Some(']') => {
                    self.pos += 1;
                    return Ok(Node::Class { negated, ranges });
                }
                _ => {
                    let lo = self.char_lit()?;
                    let hi =
                        if self.peek() == Some('-') && self.peek_at(1).is_some_and(|c| c != ']') {
                            self.pos += 1;
                            self.char_lit()?
                        } else {
                            lo
                        };
                    if hi < lo {
                        return Err(self.error(format!("empty range {lo:?}-{hi:?}")));
                    }
                    ranges.push((lo, hi));
                }
            }
        }
    }

    fn int(&mut self) -> Result<u32, GbnfError> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        let s: String = self.chars[start..self.pos].iter().map(|c| c.1).collect();
        s.parse()
            .map_err(|_| self.error_at(start, "expected a repetition count"))
    }

    fn alternatives(&mut self, nested: bool) -> Result<Node, GbnfError> {
        let mut alts = vec![self.sequence(nested)?];
        loop {
            // A `|` that opens a following line continues the rule too.
            let here = self.pos;
            self.skip_space(true);
            if self.peek() != Some('|') {
                self.pos = here;
                break;
            }
            self.pos += 1;
            self.skip_space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(if alts.len() == 1 {
            alts.pop().expect("one")
        } else {
            Node::Alt(alts)
        })
    }

    fn sequence(&mut self, nested: bool) -> Result<Node, GbnfError> {
        let mut items = Vec::new();
        loop {
            self.skip_space(nested);
            let Some(c) = self.peek() else { break };
            let item = match c {
                '"' => self.literal()?,
                '[' => self.class()?,
                '.' => {
                    self.pos += 1;
                    Node::Any
                }
                '(' => {
                    self.pos += 1;
                    self.skip_space(true);
                    let inner = self.alternatives(true)?;
                    self.skip_space(true);
                    if self.peek() != Some(')') {
                        return Err(self.error("expected `)`"));
                    }
                    self.pos += 1;
                    inner
                }
                '<' | '!' => return Err(self.error("token references (`<...>`) are not supported")),
                c if Self::is_word(c) => {
                    let at = self.pos;
                    let name = self.name()?;
                    Node::Ref { name, at }
                }
                _ => break,
            };
            let item = self.postfix(item)?;
            items.push(item);
        }
        Ok(if items.len() == 1 {
            items.pop().expect("one")
        } else {
            Node::Seq(items)
        })
    }

    fn postfix(&mut self, mut node: Node) -> Result<Node, GbnfError> {
        loop {
            let (min, max) = match self.peek() {
                Some('*') => (0, None),
                Some('+') => (1, None),
                Some('?') => (0, Some(1)),
                Some('{') => {
                    self.pos += 1;
                    self.skip_space(true);
                    let min = self.int()?;
                    self.skip_space(true);
                    let max = if self.peek() == Some(',') {
                        self.pos += 1;
                        self.skip_space(true);
                        if self.peek().is_some_and(|c| c.is_ascii_digit()) {
                            Some(self.int()?)
                        } else {
                            None
                        }
                    } else {
                        Some(min)
                    };
                    self.skip_space(true);
                    if self.peek() != Some('}') {
                        return Err(self.error("expected `}`"));
                    }
                    if max.is_some_and(|m| m < min) {
                        return Err(
                            self.error(format!("repetition {{{min},{}}}", max.unwrap_or(0)))
                        );
                    }
                    (min, max)
                }
                _ => return Ok(node),
            };
            self.pos += 1;
            node = Node::Repeat {
                node: Box::new(node),
                min,
                max,
            };
        }
    }

    fn rules(&mut self) -> Result<Vec<(String, usize, Node)>, GbnfError> {
        let mut rules = Vec::new();
        loop {
            self.skip_space(true);
            if self.peek().is_none() {
                return Ok(rules);
            }
            let at = self.pos;
            let name = self.name()?;
            self.skip_space(false);
            if !(self.peek() == Some(':')
                && self.peek_at(1) == Some(':')
                && self.peek_at(2) == Some('='))
            {
                return Err(self.error("expected `::=`"));
            }
            self.pos += 3;
            self.skip_space(true);
            let body = self.alternatives(false)?;
            self.skip_space(false);
            match self.peek() {
                None | Some('\n') | Some('\r') => {}
                Some(c) => return Err(self.error(format!("unexpected {c:?}"))),
            }
            rules.push((name, at, body));
        }
    }
}

fn refs(node: &Node, out: &mut Vec<(String, usize)>) {
    match node {
        Node::Ref { name, at } => out.push((name.clone(), *at)),
        Node::Seq(v) | Node::Alt(v) => v.iter().for_each(|n| refs(n, out)),
        Node::Repeat { node, .. } => refs(node, out),
        _ => {}
    }
}

fn class_char(c: char, out: &mut String) {
    if c.is_ascii_alphanumeric() {
        out.push(c);
    } else {
        let _ = write!(out, "\\x{{{:X}}}", c as u32);
    }
}

fn emit(node: &Node, names: &HashMap<String, String>, out: &mut String) {
    match node {
        Node::Literal(s) => {
            out.push_str(&serde_json::to_string(s).expect("a string serializes"));
        }
        Node::Class { negated, ranges } => {
            out.push_str("/[");
            if *negated {
                out.push('^');
            }
            for &(lo, hi) in ranges {
                class_char(lo, out);
                if hi != lo {
                    out.push('-');
                    class_char(hi, out);
                }
            }
            if ranges.is_empty() && !negated {
                // `[]` matches nothing; Rust's regex has no empty class.
                out.push_str("a&&b");
            }
            out.push_str("]/");
        }
        Node::Any => out.push_str("/(?s:.)/"),
        Node::Ref { name, .. } => out.push_str(&names[name]),
        Node::Seq(v) => {
            if v.is_empty() {
                out.push_str("\"\"");
            }
            for (i, n) in v.iter().enumerate() {
                if i > 0 {
                    out.push(' ');
                }
                match n {
                    // Postfix operators bind tighter than juxtaposition.
                    Node::Repeat { .. } => emit(n, names, out),
                    _ => emit_atom(n, names, out),
                }
            }
        }
        Node::Alt(v) => {
            for (i, n) in v.iter().enumerate() {
                if i > 0 {
                    out.push_str(" | ");
                }
                emit(n, names, out);
            }
        }
        Node::Repeat { node, min, max } => {
            emit_atom(node, names, out);
            match (min, max) {
                (0, None) => out.push('*'),
                (1, None) => out.push('+'),
                (0, Some(1)) => out.push('?'),
                (m, None) => {
                    let _ = write!(out, "{{{m},}}");
                }
                (m, Some(n)) => {
                    let _ = write!(out, "{{{m},{n}}}");
                }
            }
        }
    }
}

/// Emits `node` so that a postfix operator or a neighbour binds to all of it.
fn emit_atom(node: &Node, names: &HashMap<String, String>, out: &mut String) {
    match node {
        Node::Seq(v) if v.len() != 1 => {
            out.push('(');
            emit(node, names, out);
            out.push(')');
        }
        Node::Alt(_) | Node::Repeat { .. } => {
            out.push('(');
            emit(node, names, out);
            out.push(')');
        }
        _ => emit(node, names, out),
    }
}

/// Converts a GBNF grammar to llguidance's Lark syntax (see the module doc).
pub fn gbnf_to_lark(src: &str) -> Result<String, GbnfError> {
    let mut p = Parser::new(src);
    let rules = p.rules()?;
    // Later definitions of a name add alternatives, as in llama.cpp.
    let mut bodies: BTreeMap<String, Vec<Node>> = BTreeMap::new();
    let mut order = Vec::new();
    for (name, _, body) in &rules {
        if !bodies.contains_key(name) {
            order.push(name.clone());
        }
        bodies.entry(name.clone()).or_default().push(body.clone());
    }
    if !bodies.contains_key("root") {
        return Err(p.error_at(0, "no `root` rule"));
    }
    let bodies: BTreeMap<String, Node> = bodies
        .into_iter()
        .map(|(k, mut v)| {
            (
                k,
                if v.len() == 1 {
                    v.pop().expect("one")
                } else {
                    Node::Alt(v)
                },
            )
        })
        .collect();
    let mut deps: HashMap<&str, Vec<String>> = HashMap::new();
    for (name, body) in &bodies {
        let mut r = Vec::new();
        refs(body, &mut r);
        for (target, at) in &r {
            if !bodies.contains_key(target) {
                return Err(p.error_at(*at, format!("undefined rule `{target}`")));
            }
        }
        deps.insert(name, r.into_iter().map(|x| x.0).collect());
    }
    // Terminal rules: reach only terminal rules (a fixpoint; recursion
    // never qualifies).
    let mut terminal: HashSet<&str> = HashSet::new();
    loop {
        let before = terminal.len();
        for (name, ds) in &deps {
            if *name != "root"
                && !terminal.contains(name)
                && ds.iter().all(|d| terminal.contains(d.as_str()))
            {
                terminal.insert(name);
            }
        }
        if terminal.len() == before {
            break;
        }
    }
    let mut names = HashMap::new();
    let mut used = HashSet::new();
    for name in &order {
        let base: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .collect();
        let mut lark = if name == "root" {
            "start".to_string()
        } else if terminal.contains(name.as_str()) {
            format!("G_{}", base.to_ascii_uppercase())
        } else {
            format!("g_{base}")
        };
        let stem = lark.clone();
        let mut k = 1;
        while !used.insert(lark.clone()) {
            k += 1;
            lark = format!("{stem}_{k}");
        }
        names.insert(name.clone(), lark);
    }
    let mut out = String::from("%llguidance {}\n\n");
    for name in &order {
        out.push_str(&names[name]);
        out.push_str(": ");
        emit(&bodies[name], &names, &mut out);
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_rules_terminals_and_operators() {
        let g = r#"
# a comment
root ::= greeting ws name ("!" | "?")? item{2,3}
greeting ::= "hello" | "hi\n"
name ::= [A-Z] [a-z-]*   # trailing comment
ws ::= [ \t]+
item ::= "[" root? "]"
"#;
        let lark = gbnf_to_lark(g).unwrap();
        assert!(
            lark.contains("start: G_GREETING G_WS G_NAME (\"!\" | \"?\")? g_item{2,3}"),
            "{lark}"
        );
        assert!(lark.contains("G_GREETING: \"hello\" | \"hi\\n\""), "{lark}");
        assert!(lark.contains("G_NAME: /[A-Z]/ /[a-z\\x{2D}]/*"), "{lark}");
        assert!(lark.contains("G_WS: /[\\x{20}\\x{9}]/+"), "{lark}");
        assert!(lark.contains("g_item: \"[\" start? \"]\""), "{lark}");
    }

    #[test]
    fn rules_continue_after_bar_and_inside_groups() {
        let g = "root ::= (\n  \"a\"\n  \"b\" )\n  | \"c\"\nother ::= [^\"\\\\] .";
        let lark = gbnf_to_lark(g).unwrap();
        assert!(lark.contains("start: \"a\" \"b\" | \"c\""), "{lark}");
        assert!(
            lark.contains("G_OTHER: /[^\\x{22}\\x{5C}]/ /(?s:.)/"),
            "{lark}"
        );
    }

    #[test]
    fn errors_name_the_place() {
        let e = gbnf_to_lark("root ::= foo\n").unwrap_err();
        assert_eq!((e.line, e.column), (1, 10));
        assert!(e.message.contains("undefined rule `foo`"), "{e}");
        let e = gbnf_to_lark("start ::= \"x\"").unwrap_err();
        assert!(e.message.contains("no `root`"));
        let e = gbnf_to_lark("root ::= \"x").unwrap_err();
        assert!(e.message.contains("unterminated"), "{e}");
        let e = gbnf_to_lark("root = \"x\"").unwrap_err();
        assert!(e.message.contains("::="), "{e}");
        let e = gbnf_to_lark("root ::= [b-a]").unwrap_err();
        assert!(e.message.contains("empty range"), "{e}");
        let e = gbnf_to_lark("root ::= \"\\q\"").unwrap_err();
        assert!(e.message.contains("unknown escape"), "{e}");
        let e = gbnf_to_lark("root ::= <[12]>").unwrap_err();
        assert!(e.message.contains("token references"), "{e}");
    }
}
