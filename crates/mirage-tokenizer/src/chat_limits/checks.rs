//! The checking functions the rewritten source calls, and the filters and
//! methods that check a result's size before building it.

use minijinja::value::{Kwargs, Rest, StringInput, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};

use super::budget::{charge, check, check_items, check_work, limit, size, str_len};
use super::{ITEM_WORK, MAX_DEPTH};

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
/// `ns` nor nests deeper than [`MAX_DEPTH`] (see the module doc of `chat_limits`).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_size_counts_widths() {
        assert!(format_size("%999999999999d", &[]) >= 999_999_999_999);
        assert!(format_size("{:>50}", &[Value::from("ab")]) >= 52);
    }
}
