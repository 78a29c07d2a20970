"""Citations that resolve inside the page: every "§N" a page shows links to that section of
docs/math.md, carried collapsed (``<details>``) at the end of the page, with the sections those
sections cite in turn, so the page needs neither the repository nor the network.

The sections are markdown; ``markdown_html`` renders the few constructs docs/math.md uses
(headings, paragraphs, lists, indented formula blocks, ``code``, **bold**, *italic*), escaping
everything else.
"""

from __future__ import annotations

import re

from tl_dynamics import docs
from tl_dynamics.viz._component import html_escape

# Text between tags is linked; scripts (JSON data, code), SVG figures and tags are left alone.
_SKIP = re.compile(
    r"(<script\b.*?</script>|<svg\b.*?</svg>|<style\b.*?</style>|<[^>]*>)",
    re.DOTALL | re.IGNORECASE,
)
_INLINE = (
    (re.compile(r"\*\*([^*]+)\*\*"), r"<b>\1</b>"),
    (re.compile(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])"), r"<i>\1</i>"),
)


def anchor(number: str) -> str:
    """The element id of a section: ``math-2-3`` for §2.3."""
    return "math-" + number.replace(".", "-")


def link(html: str, known: set[str], found: list[str]) -> str:
    """``html`` with each "§N" outside tags, scripts and SVG linked to its section (when
    docs/math.md has it); the numbers linked are appended to ``found``."""

    def one(match: re.Match[str]) -> str:
        number = match.group(1)
        if number not in known:
            return match.group(0)
        if number not in found:
            found.append(number)
        return f'<a class="tld-cite" href="#{anchor(number)}">{match.group(0)}</a>'

    pieces = _SKIP.split(html)
    return "".join(p if i % 2 else docs.CITATION.sub(one, p) for i, p in enumerate(pieces))


def _inline(text: str) -> str:
    """Escaped text with `code` spans, then **bold** and *italic* outside them."""
    out = []
    for i, piece in enumerate(re.split(r"`([^`]+)`", text)):
        if i % 2:
            out.append(f"<code>{html_escape(piece)}</code>")
            continue
        piece = html_escape(piece)
        for pattern, repl in _INLINE:
            piece = pattern.sub(repl, piece)
        out.append(piece)
    return "".join(out)


def markdown_html(text: str) -> str:
    """A section of docs/math.md as HTML (the constructs it uses; everything escaped)."""
    out, para, items, code = [], [], [], []

    def flush() -> None:
        if para:
            out.append(f"<p>{_inline(' '.join(para))}</p>")
            para.clear()
        if items:
            out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in items) + "</ul>")
            items.clear()
        if code:
            out.append(f"<pre>{html_escape(chr(10).join(code).rstrip())}</pre>")
            code.clear()

    for line in text.splitlines():
        heading = re.match(r"^(#{1,4}) (.*)$", line)
        if heading:
            flush()
            level = min(6, len(heading.group(1)) + 2)
            out.append(f"<h{level}>{_inline(heading.group(2))}</h{level}>")
        elif line.startswith("    ") and not items and not para:
            code.append(line[4:])
        elif not line.strip():
            if code:
                code.append("")
            else:
                flush()
        elif re.match(r"^\s*[-*] ", line) or re.match(r"^\s*\d+\. ", line):
            if code or para:
                flush()
            items.append(re.sub(r"^\s*([-*]|\d+\.) ", "", line))
        elif items and line.startswith(" "):
            items[-1] += " " + line.strip()
        else:
            if code:
                flush()
            para.append(line.strip())
    flush()
    return "\n".join(out)


def closure(numbers: list[str], parts: dict[str, docs.Section]) -> list[str]:
    """The cited sections and every section they cite, in turn, in docs/math.md's order."""
    todo, seen = list(numbers), set()
    while todo:
        number = todo.pop()
        if number in seen or number not in parts:
            continue
        seen.add(number)
        todo.extend(docs.cited(parts[number].text))
    return [n for n in parts if n in seen]


def _heading_ids(html: str) -> str:
    """Subsection headings inside a carried top-level section get their own ids (``math-2-3``),
    so a link to a subsection lands inside its section's block, with no second copy."""
    return re.sub(
        r"<h(\d)>(\d+\.\d+) ",
        lambda m: f'<h{m.group(1)} id="{anchor(m.group(2))}">{m.group(2)} ',
        html,
    )


def appendix(numbers: list[str]) -> str:
    """The cited sections, collapsed, as a last page section (empty when nothing is cited). A
    subsection whose top-level section is carried is read inside it, not repeated."""
    if not numbers:
        return ""
    parts = docs.sections()
    known = set(parts)
    chosen = closure(numbers, parts)
    blocks = []
    for number in chosen:
        if "." in number and number.split(".")[0] in chosen:
            continue  # inside its section's block
        section = parts[number]
        body = link(markdown_html(section.text.split("\n", 1)[1]), known, [])
        body = _heading_ids(body) if "." not in number else body
        blocks.append(
            f'<details class="tld-math" id="{anchor(number)}"><summary>docs/math.md '
            f"§{number} {html_escape(section.title)}</summary>{body}</details>"
        )
    return (
        '<section id="tld-maths-cited"><h2>Maths cited on this page</h2><p class="intro">The '
        "sections of docs/math.md (tl_dynamics's maths reference) this page cites, and those "
        "they cite; open one to read it. Every \u00a7 on the page links here.</p>"
        + "".join(blocks)
        + "</section>"
    )


# Opens a collapsed section when a citation is followed (nonce'd page script; no inline handler).
OPEN_JS = r"""
(function () {
function reveal(el) { var box = el && el.closest('details.tld-math'); if (box) box.open = true; return box; }
function open() { var id = decodeURIComponent(location.hash.slice(1)), el = id && document.getElementById(id);
  if (reveal(el)) el.scrollIntoView(); }
window.addEventListener('hashchange', open);
document.addEventListener('click', function (e) { var a = e.target.closest && e.target.closest('a.tld-cite');
  if (a) reveal(document.getElementById(a.getAttribute('href').slice(1))); });
open();
})();
"""
