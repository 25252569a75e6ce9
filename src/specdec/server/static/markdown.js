// A small Markdown renderer that builds DOM nodes: every piece of model or imported text reaches
// the page through textContent or createTextNode, never as HTML, so `<script>` or `<img onerror>`
// in an answer is shown as the characters it is. Covers what chat answers use: fenced code blocks
// (an unclosed fence while streaming runs to the end), headings, lists, quotes, rules, paragraphs,
// and inline code, bold, italics and http(s) links.
"use strict";

(function () {
  const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*\d{1,9}[.)]\s+(.*)$/;
  const QUOTE = /^\s*>\s?(.*)$/;
  const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|\*(?=\S)([^*]*?\S)\*|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/;

  function el(tag, cls) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    return node;
  }

  function safeUrl(text) {
    try {
      const url = new URL(text);
      return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
    } catch (e) {
      return null;
    }
  }

  // Inline spans of `text` appended to `parent`.
  function inline(parent, text) {
    let rest = text;
    while (rest) {
      const m = INLINE.exec(rest);
      if (!m) {
        parent.appendChild(document.createTextNode(rest));
        return;
      }
      if (m.index) parent.appendChild(document.createTextNode(rest.slice(0, m.index)));
      if (m[1]) {
        const code = el("code");
        code.textContent = m[2];
        parent.appendChild(code);
      } else if (m[3] !== undefined) {
        const strong = el("strong");
        inline(strong, m[3]);
        parent.appendChild(strong);
      } else if (m[4] !== undefined) {
        const em = el("em");
        inline(em, m[4]);
        parent.appendChild(em);
      } else {
        const href = safeUrl(m[6]);
        if (href) {
          const a = el("a");
          a.href = href;
          a.rel = "noopener noreferrer nofollow";
          a.target = "_blank";
          a.textContent = m[5];
          parent.appendChild(a);
        } else {
          parent.appendChild(document.createTextNode(m[0]));
        }
      }
      rest = rest.slice(m.index + m[0].length);
    }
  }

  function codeBlock(lang, lines) {
    const figure = el("div", "code-block");
    if (lang) {
      const label = el("span", "code-lang");
      label.textContent = lang;
      figure.appendChild(label);
    }
    const pre = el("pre");
    const code = el("code");
    code.textContent = lines.join("\n");
    pre.appendChild(code);
    pre.tabIndex = 0; // a wide block scrolls by keyboard too
    figure.appendChild(pre);
    return figure;
  }

  function list(tag, items) {
    const node = el(tag);
    for (const item of items) {
      const li = el("li");
      inline(li, item);
      node.appendChild(li);
    }
    return node;
  }

  // Consecutive lines matching `re`, from `i`: [their captured texts, the next index].
  function run(lines, i, re) {
    const out = [];
    let m;
    while (i < lines.length && (m = re.exec(lines[i]))) {
      out.push(m[1]);
      i += 1;
    }
    return [out, i];
  }

  function isBlockStart(line) {
    return FENCE.test(line) || HEADING.test(line) || BULLET.test(line) || NUMBERED.test(line) ||
      QUOTE.test(line) || RULE.test(line);
  }

  // `text` as a DocumentFragment.
  function render(text) {
    const out = document.createDocumentFragment();
    const lines = String(text).split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        i += 1;
      } else if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const body = [];
        i += 1;
        while (i < lines.length && !(lines[i].trim().startsWith(fence[0].repeat(fence.length)) &&
                                     !lines[i].trim().replace(/[`~]/g, ""))) {
          body.push(lines[i]);
          i += 1;
        }
        i += 1; // the closing fence (or past the end)
        out.appendChild(codeBlock(m[2], body));
      } else if (RULE.test(line)) {
        out.appendChild(el("hr"));
        i += 1;
      } else if ((m = HEADING.exec(line))) {
        // Answers sit under the page's h1 and each message's h2-less article: start at h3.
        const h = el("h" + Math.min(6, m[1].length + 2));
        inline(h, m[2]);
        out.appendChild(h);
        i += 1;
      } else if (BULLET.test(line)) {
        let items;
        [items, i] = run(lines, i, BULLET);
        out.appendChild(list("ul", items));
      } else if (NUMBERED.test(line)) {
        let items;
        [items, i] = run(lines, i, NUMBERED);
        out.appendChild(list("ol", items));
      } else if (QUOTE.test(line)) {
        let inner;
        [inner, i] = run(lines, i, QUOTE);
        const quote = el("blockquote");
        quote.appendChild(render(inner.join("\n")));
        out.appendChild(quote);
      } else {
        const para = [line];
        i += 1;
        while (i < lines.length && lines[i].trim() && !isBlockStart(lines[i])) {
          para.push(lines[i]);
          i += 1;
        }
        const p = el("p");
        inline(p, para.join("\n"));
        out.appendChild(p);
      }
    }
    return out;
  }

  window.SpecdecMarkdown = { render: render };
})();
