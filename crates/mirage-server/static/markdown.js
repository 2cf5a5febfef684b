// A small Markdown renderer for model output on the chat page, safe by
// construction: the text is HTML-escaped before any markup is added, and
// the only markup added is a fixed set of tags without attributes, except
// <a href> (http, https and mailto URLs only, themselves escaped) and
// <code class="language-X"> (X limited to [A-Za-z0-9_+-]).
//
// Supported: ``` fenced code blocks (an unclosed fence runs to the end, as
// while a reply streams), `inline code`, **bold**, *italic* and _italic_,
// # to ###### headings, - / * / + and 1. lists, > quotes, [text](url)
// links, paragraphs and line breaks.
(function (root) {
  "use strict";

  function escapeHtml(s) {
    return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  // Inline markup over already-escaped text (code spans first, so that
  // their content is left alone).
  function inline(escaped) {
    const codes = [];
    let s = escaped.replace(/`([^`\n]+)`/g, (_, c) => {
      codes.push("<code>" + c + "</code>");
      return "\u0000" + (codes.length - 1) + "\u0000";
    });
    s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (m, label, url) => {
      // `url` is escaped text: &amp; etc. stay escaped inside the attribute.
      if (!/^(https?:\/\/|mailto:)/i.test(url)) return m;
      return '<a href="' + url + '" rel="noopener noreferrer" target="_blank">' + label + "</a>";
    });
    s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^_\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => codes[Number(i)]);
  }

  function renderMarkdown(text) {
    const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [];
    let list = null; // "ul" | "ol"
    const flushPara = () => {
      if (para.length) out.push("<p>" + para.map((l) => inline(escapeHtml(l))).join("<br>") + "</p>");
      para = [];
    };
    const closeList = () => {
      if (list) out.push("</" + list + ">");
      list = null;
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = /^\s*```\s*([A-Za-z0-9_+-]*)/.exec(line);
      if (fence) {
        flushPara();
        closeList();
        const body = [];
        i++;
        while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) body.push(lines[i++]);
        const cls = fence[1] ? ' class="language-' + fence[1] + '"' : "";
        out.push("<pre><code" + cls + ">" + escapeHtml(body.join("\n")) + "</code></pre>");
        continue;
      }
      const heading = /^(#{1,6})\s+(.*)$/.exec(line);
      const bullet = /^\s*[-*+]\s+(.*)$/.exec(line);
      const numbered = /^\s*\d+[.)]\s+(.*)$/.exec(line);
      const quote = /^\s*>\s?(.*)$/.exec(line);
      if (heading) {
        flushPara();
        closeList();
        const n = heading[1].length;
        out.push("<h" + n + ">" + inline(escapeHtml(heading[2])) + "</h" + n + ">");
      } else if (bullet || numbered) {
        flushPara();
        const kind = bullet ? "ul" : "ol";
        if (list !== kind) {
          closeList();
          out.push("<" + kind + ">");
          list = kind;
        }
        out.push("<li>" + inline(escapeHtml((bullet || numbered)[1])) + "</li>");
      } else if (quote) {
        flushPara();
        closeList();
        out.push("<blockquote>" + inline(escapeHtml(quote[1])) + "</blockquote>");
      } else if (line.trim() === "") {
        flushPara();
        closeList();
      } else {
        closeList();
        para.push(line);
      }
    }
    flushPara();
    closeList();
    return out.join("");
  }

  root.renderMarkdown = renderMarkdown;
  root.escapeHtml = escapeHtml;
  if (typeof module !== "undefined" && module.exports) module.exports = { renderMarkdown, escapeHtml };
})(typeof window !== "undefined" ? window : globalThis);
