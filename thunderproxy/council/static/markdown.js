// A small Markdown renderer for the council's answers. Safety first: the text is HTML-escaped
// before any markup is added, and links are kept only for http(s) URLs, so nothing a model
// writes can inject markup or script. Covers what answers use: headings, paragraphs, lists,
// block quotes, fenced code, rules, tables' raw text, **bold**, *italic*, `code`, links.
"use strict";

(function (global) {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  // Inline markup on already-escaped text. Code spans are cut out first so that nothing
  // inside them is formatted.
  function inline(escaped) {
    const codes = [];
    let text = escaped.replace(/`([^`\n]+)`/g, (_, code) => {
      codes.push(code);
      return "\u0000" + (codes.length - 1) + "\u0000";
    });
    text = text
      .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/__([^_\n]+)__/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>")
      .replace(/(^|[^_\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>")
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g,
        '<a href="$2" rel="noopener noreferrer nofollow" target="_blank">$1</a>');
    return text.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + codes[Number(i)] + "</code>");
  }

  function render(source) {
    const lines = escapeHtml(source || "").replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let paragraph = [];
    let list = null; // { tag, items }
    let quote = [];

    const flushParagraph = () => {
      if (paragraph.length) out.push("<p>" + paragraph.map(inline).join("<br>") + "</p>");
      paragraph = [];
    };
    const flushList = () => {
      if (list) {
        out.push("<" + list.tag + ">" + list.items.map((i) => "<li>" + inline(i) + "</li>").join("") + "</" + list.tag + ">");
      }
      list = null;
    };
    const flushQuote = () => {
      if (quote.length) out.push("<blockquote>" + render.unescaped(quote.join("\n")) + "</blockquote>");
      quote = [];
    };
    const flushAll = () => { flushParagraph(); flushList(); flushQuote(); };

    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
      if (fence) {
        flushAll();
        const code = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
        const lang = fence[1] ? ' class="language-' + fence[1] + '"' : "";
        out.push("<pre><code" + lang + ">" + code.join("\n") + "</code></pre>");
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*?)\s*#*\s*$/);
      if (heading) {
        flushAll();
        const level = heading[1].length;
        out.push("<h" + level + ">" + inline(heading[2]) + "</h" + level + ">");
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flushAll(); out.push("<hr>"); continue; }
      const quoted = line.match(/^\s*&gt;\s?(.*)$/);
      if (quoted) { flushParagraph(); flushList(); quote.push(quoted[1]); continue; }
      flushQuote();
      const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
      const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (bullet || numbered) {
        flushParagraph();
        const tag = bullet ? "ul" : "ol";
        if (!list || list.tag !== tag) { flushList(); list = { tag, items: [] }; }
        list.items.push((bullet || numbered)[1]);
        continue;
      }
      if (!line.trim()) { flushAll(); continue; }
      if (list && /^\s{2,}\S/.test(line)) { list.items[list.items.length - 1] += " " + line.trim(); continue; }
      flushList();
      paragraph.push(line);
    }
    flushAll();
    return out.join("\n");
  }

  // Block quotes hold already-escaped text; render it without escaping it twice.
  render.unescaped = (escaped) => {
    const decode = { "&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&#39;": "'" };
    return render(escaped.replace(/&(amp|lt|gt|quot|#39);/g, (m) => decode[m]));
  };

  global.CouncilMarkdown = { render, escapeHtml };
})(window);
