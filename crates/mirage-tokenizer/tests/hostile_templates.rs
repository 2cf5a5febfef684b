//! Chat templates come from model files: a hostile one must end in a
//! template error, never in an abort, a hang or a huge allocation. Each
//! case below asked for terabytes (or ran forever) before rendering was
//! bounded; each must now fail fast with a message that says why.

use mirage_tokenizer::{ChatMessage, ChatTemplate, TokenizerError};

fn render(source: &str) -> Result<String, TokenizerError> {
    let t = ChatTemplate::new(source, "<s>", "</s>")?;
    t.render(&[ChatMessage::new("user", "hello")], true)
}

/// The render failed with a template error containing `needle`, quickly.
fn refused(source: &str, needle: &str) {
    let t0 = std::time::Instant::now();
    match render(source) {
        Err(TokenizerError::Template(m)) => {
            assert!(m.contains(needle), "{source}\n  -> {m}")
        }
        Err(e) => panic!("{source}: not a template error: {e}"),
        Ok(out) => panic!("{source}: rendered {} bytes", out.len()),
    }
    assert!(
        t0.elapsed().as_secs_f64() < 5.0,
        "{source}: took {:?}",
        t0.elapsed()
    );
}

#[test]
fn a_string_doubled_forty_times_is_refused() {
    let doubling = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}";
    refused(doubling, "limit");
    let plus = doubling.replace("ns.s ~ ns.s", "ns.s + ns.s");
    refused(&plus, "limit");
    let unrolled = format!(
        "{{% set s = 'x' %}}{}{{{{ s }}}}",
        "{% set s = s ~ s %}".repeat(40)
    );
    refused(&unrolled, "limit");
    refused(
        "{% macro d(s, n) %}{% if n > 0 %}{{ d(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro %}{{ d('x', 40) }}",
        "limit",
    );
    refused(
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}",
        "limit",
    );
}

#[test]
fn doubling_through_captured_output_is_refused() {
    // No operator at all: each block emits the previous value twice.
    let source = format!(
        "{{% set s = 'xxxxxxxx' %}}{}{{{{ s|length }}}}",
        "{% set s %}{{ s }}{{ s }}{% endset %}".repeat(40)
    );
    refused(&source, "limit");
}

#[test]
fn one_step_amplifiers_are_refused() {
    refused("{{ 'x' * 100000000 }}", "limit");
    refused("{{ ([1] * 1000000000)|length }}", "items");
    refused("{{ 'a\nb'|indent(1000000000000) }}", "limit");
    refused("{{ '%999999999999d'|format(1) }}", "limit");
    refused("{{ '{:>999999999999}'.format(1) }}", "limit");
    refused(
        "{% set b = 'y' * 100000 %}{{ 'abcdefghij'.replace('', b) }}",
        "limit",
    );
    refused(
        "{% set b = 'y' * 100000 %}{{ 'abcdefghij'|replace('', b) }}",
        "limit",
    );
    refused("{{ range(10)|batch(1000000000000000000)|list }}", "items");
    refused("{{ range(10)|slice(1000000000000000000)|list }}", "items");
    refused(
        "{% set s = 'x' * 500000 %}{{ [s, s, s, s, s]|join(s) }}",
        "limit",
    );
    refused(
        "{% set s = 'x' * 500000 %}{{ s.join([s, s, s, s, s]) }}",
        "limit",
    );
    refused(
        "{% set s = 'x' * 100000 %}{{ [s, s, s, s, s, s, s, s, s, s, s, s]|tojson(indent=1000000) }}",
        "limit",
    );
}

#[test]
fn endless_loops_run_out_of_fuel() {
    refused(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "fuel",
    );
    // Literal text emitted in a loop into a block's output.
    let text = "x".repeat(4096);
    refused(
        &format!("{{% set s %}}{{% for i in range(100000) %}}{{% for j in range(100000) %}}{text}{{% endfor %}}{{% endfor %}}{{% endset %}}{{{{ s|length }}}}"),
        "fuel",
    );
}

#[test]
fn unbounded_recursion_stops_within_a_small_stack() {
    // Server and worker threads have 2 MiB stacks.
    let h = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(|| render("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}"))
        .unwrap();
    match h.join().expect("no stack overflow") {
        Err(TokenizerError::Template(m)) => assert!(m.contains("recursion"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_syntax_error_is_a_template_error_naming_it() {
    match ChatTemplate::new("{% for m in messages %}{{ m.content }", "", "") {
        Err(TokenizerError::Template(m)) => assert!(m.contains("syntax error"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn long_real_conversations_still_render() {
    // A ChatML template over 2,000 messages of 1 KB: far inside the limits.
    let t = ChatTemplate::new(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "",
        "",
    )
    .unwrap();
    let msgs: Vec<ChatMessage> = (0..2000)
        .map(|i| {
            ChatMessage::new(
                if i % 2 == 0 { "user" } else { "assistant" },
                "w".repeat(1000),
            )
        })
        .collect();
    let out = t.render(&msgs, true).unwrap();
    // Per message `<|im_start|>` ROLE `\n` CONTENT `<|im_end|>\n`, then the prompt.
    let per = |role: usize| 12 + role + 1 + 1000 + 10 + 1;
    assert_eq!(out.len(), 1000 * per(4) + 1000 * per(9) + 22);
}

/// Found by the fuzzer: a namespace stored into itself made every later
/// walk of it (printing, `~`, comparing) recurse until the stack overflowed.
#[test]
fn a_namespace_holding_itself_or_nested_without_end_is_refused() {
    let h = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(|| {
            for source in [
                "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
                "{% set ns = namespace(s=1) %}{% set ns.s = ns %}{{ ns }}",
                "{% set ns = namespace(s=1) %}{% set ns.s = [1, {'a': ns}] %}{{ ns == ns }}",
                "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l }}",
            ] {
                match render(source) {
                    Err(TokenizerError::Template(m)) => {
                        assert!(m.contains("namespace may not store"), "{source}\n  -> {m}")
                    }
                    other => panic!("{source}: {other:?}"),
                }
            }
        })
        .unwrap();
    h.join().expect("no stack overflow");
}

/// Found by the fuzzer: minijinja 2.24 panics reversing an empty string or
/// list (`''[::-1]`, index out of bounds). A panic inside the template
/// engine is a template error, like any other failure of the template.
#[test]
fn a_panic_inside_the_template_engine_is_a_template_error() {
    for source in [
        "{{ ''[::-1] }}",
        "{{ messages[5:][::-1] }}",
        "{{ 'abc'[9:][::-1] }}",
    ] {
        match render(source) {
            Err(TokenizerError::Template(m)) => assert!(m.contains("index out of bounds"), "{m}"),
            other => panic!("{source}: {other:?}"),
        }
    }
    // Reversing what is not empty works.
    assert_eq!(render("{{ 'abc'[::-1] }}").unwrap(), "cba");
}

/// Found by the fuzzer: each `~` copies its operands, so a loop that grows a
/// string by appending to it costs the square of its length (25 s here
/// before: 65,535 appends to a string growing to 330 KB). The bytes a render
/// builds are bounded like the bytes it emits.
#[test]
fn quadratic_string_building_is_refused_fast() {
    refused(
        "{% set ns = namespace(s='x') %}{% for i in range(65535) %}{% set ns.s = ns.s ~ s ~ ns.s is defined %}{% endfor %}s }}",
        "work",
    );
    refused(
        "{% set ns = namespace(l=[]) %}{% set big = range(50000)|list %}{% for i in range(100000) %}{% set ns.l = big %}{% endfor %}",
        "work",
    );
}

/// Found by the fuzzer: `in` over a range, a comparison of long lists and
/// the filters that walk a sequence each take one instruction of fuel but
/// as many steps as the value has items, so a loop of them ran for hours.
#[test]
fn walking_a_long_sequence_in_a_loop_is_refused_fast() {
    for source in [
        "{% set ns = namespace(s='x') %}{% for i in range(65535) %}{% set ns.s =i in range(65535) %}{% set ns.s =ns.s is defined %}{% endfor %}s }}",
        "{% set r = range(65535) %}{% for i in range(65535) %}{% if i not in r %}x{% endif %}{% endfor %}",
        "{% set r = range(65535)|list %}{% for i in range(65535) %}{% if r == r %}{% endif %}{% endfor %}",
        "{% set r = range(65535) %}{% for i in range(65535) %}{% if 1 < 2 < r|length %}{% endif %}{{ r|sum }}{% endfor %}",
        "{% set r = range(65535) %}{% for i in range(65535) %}{% if i is in(r) %}{% endif %}{% endfor %}",
    ] {
        refused(source, "work");
    }
    assert_eq!(
        render("{{ 2 in [1, 2] }} {{ 3 not in [1, 2] }} {{ 1 < 2 <= 2 }} {{ (1) == (1) }} {{ 'a' not  in 'abc' }}")
            .unwrap(),
        "True True True True False"
    );
}

/// Found by the fuzzer: `[] * n` is a lazy sequence that yields nothing but
/// takes n steps to find that out, so any walk of it with a huge n hangs.
#[test]
fn repeating_a_sequence_a_huge_number_of_times_is_refused() {
    for source in [
        "{% for x in [] * 1000000000000 %}{% endfor %}",
        "{{ ([] * 1000000000000) ~ 'x' }}",
        "{{ ([1] * 1000000000000)|length }}",
    ] {
        refused(source, "items");
    }
    refused("{{ [] * 18446744073709551615 }}", "items");
    assert_eq!(
        render("{{ ([1, 2] * 3)|join(',') }}").unwrap(),
        "1,2,1,2,1,2"
    );
}

#[test]
fn rendering_with_tools_is_bounded_too() {
    let t = ChatTemplate::new(
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}{{ tools|length }}",
        "<s>",
        "</s>",
    )
    .unwrap();
    let messages = serde_json::json!([{"role": "user", "content": "hello"}]);
    let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
    let t0 = std::time::Instant::now();
    match t.render_json(&messages, Some(&tools), true) {
        Err(TokenizerError::Template(m)) => assert!(m.contains("limit"), "{m}"),
        other => panic!("not refused: {:?}", other.map(|s| s.len())),
    }
    assert!(t0.elapsed().as_secs_f64() < 5.0, "took {:?}", t0.elapsed());
}
