#!/usr/bin/env node
// Tests the chat page's Markdown renderer (crates/mirage-server/static/markdown.js) under Node:
// the markup it supports, and that model output cannot inject HTML, attributes or script URLs.
// The rendered HTML is also parsed by a strict check: every tag it contains is one the renderer
// may emit. Prints `markdown: N passed, M failed` and exits non-zero on failure.
//
//   node scripts/markdown_test.js
const path = require("path");
const { renderMarkdown } = require(path.join(__dirname, "../crates/mirage-server/static/markdown.js"));

let passed = 0, failed = 0;
function check(name, ok, detail) {
  if (ok) { passed++; console.log(`ok   ${name}`); } else { failed++; console.log(`FAIL ${name}: ${detail}`); }
}
const ALLOWED = /^<\/?(p|br|strong|em|code|pre|ul|ol|li|h[1-6]|blockquote)>$|^<\/a>$|^<code class="language-[A-Za-z0-9_+-]+">$|^<a href="(https?:\/\/|mailto:)[^"<>]*" rel="noopener noreferrer" target="_blank">$/;
function onlyAllowedTags(html) {
  const tags = html.match(/<[^>]*>/g) || [];
  return tags.filter((t) => !ALLOWED.test(t));
}
function eq(name, input, want) {
  const got = renderMarkdown(input);
  check(name, got === want, `\n  got  ${got}\n  want ${want}`);
}

eq("paragraphs and breaks", "a\nb\n\nc", "<p>a<br>b</p><p>c</p>");
eq("bold italic code", "**b** *i* _j_ `x*y*`", "<p><strong>b</strong> <em>i</em> <em>j</em> <code>x*y*</code></p>");
eq("heading and list", "# T\n- one\n- two\n1. x", "<h1>T</h1><ul><li>one</li><li>two</li></ul><ol><li>x</li></ol>");
eq("fenced code keeps markup literal", "```rust\nlet a = <b>**c**</b>;\n```", '<pre><code class="language-rust">let a = &lt;b&gt;**c**&lt;/b&gt;;</code></pre>');
eq("unclosed fence while streaming", "x\n```py\nprint(1)", '<p>x</p><pre><code class="language-py">print(1)</code></pre>');
eq("link", "[docs](https://example.org/a?b=1&c=2)", '<p><a href="https://example.org/a?b=1&amp;c=2" rel="noopener noreferrer" target="_blank">docs</a></p>');
eq("quote", "> hi", "<blockquote>hi</blockquote>");

const attacks = [
  "<script>alert(1)</script>",
  "<img src=x onerror=alert(1)>",
  "[x](javascript:alert(1))",
  "[x](JaVaScRiPt:alert(1))",
  '[x](https://a.b/"onmouseover="alert(1))',
  "[x](data:text/html,<script>alert(1)</script>)",
  "```\"><script>alert(1)</script>\n```",
  "```js onload=alert(1)\nx\n```",
  "**<svg onload=alert(1)>**",
  "`<iframe src=//evil>`",
  "# <a href=javascript:alert(1)>h</a>",
  "- <style>*{display:none}</style>",
  "&lt;script&gt; stays text",
];
for (const a of attacks) {
  const html = renderMarkdown(a);
  const bad = onlyAllowedTags(html);
  check(`no injection: ${JSON.stringify(a)}`, bad.length === 0 && !/href="(javascript|data):/i.test(html), `${html} (tags: ${bad.join(" ")})`);
}
eq("escaped entities stay escaped", "&lt;b&gt;", "<p>&amp;lt;b&amp;gt;</p>");
eq("script tag is text", "<script>x</script>", "<p>&lt;script&gt;x&lt;/script&gt;</p>");

console.log(`markdown: ${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
