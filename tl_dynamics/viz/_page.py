"""A standalone HTML page that renders with no network: the circuitsvis bundle and the runtime
inlined once, a Content-Security-Policy that forbids every network request and inline event
handlers, a table of contents, and views drawn lazily as they scroll into view."""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

from tl_dynamics import docs, files
from tl_dynamics.viz import _cite, _component
from tl_dynamics.viz._component import Component, bundle_js, html_escape
from tl_dynamics.viz._group import Group
from tl_dynamics.viz._runtime import RUNTIME_JS

Item = Union[Component, Group]

_STYLE = """
html { overflow-x: hidden; }
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1180px; padding: 0 16px;
       color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
section, .tld-view, .tld-html { max-width: 100%; overflow-x: auto; }
.caption { color: #555; font-size: .9em; } .meta { color: #555; } .intro { max-width: 75ch; }
.warning { background: #fff4e5; border-left: 4px solid #e69500; padding: .4em .8em; }
.toc { background: #f7f7f7; padding: .5em 1em; display: inline-block; }
.toc ol { margin: .2em 0; padding-left: 1.4em; }
.tld-scroll { max-width: 100%; overflow-x: auto; }
.tld-table { border-collapse: collapse; font-size: .85em; }
.tld-table td, .tld-table th { border: 1px solid #ddd; padding: 2px 6px; text-align: right;
                               white-space: pre; }
.tld-figure { max-width: 100%; height: auto; } .tld-view { margin: 12px 0; }
pre { white-space: pre-wrap; }
.tld-hm-grid { display: grid; grid-template-columns: auto auto; justify-content: start; gap: 2px; }
.tld-hm-canvas, .tld-heads-canvas { image-rendering: pixelated; display: block; }
.tld-heads-canvas { cursor: pointer; }
.tld-hm-title { font-weight: 600; margin: 4px 0; }
.tld-hm-rows .tld-lab { max-width: 110px; text-align: right; padding-right: 3px; }
.tld-hm-cols { display: flex; max-height: 72px; }
.tld-lab { overflow: hidden; white-space: pre; text-overflow: ellipsis; font-family: monospace;
           font-size: 11px; box-sizing: border-box; }
.tld-vert { writing-mode: vertical-rl; transform: rotate(180deg); text-align: right; max-height: 72px; }
.tld-heads-grid { display: flex; gap: 4px; } .tld-heads-rows .tld-lab { width: 36px; }
.tld-axes, .tld-tip, .tld-note { font-size: .85em; color: #555; margin: 2px 0; }
.tld-tip { font-family: monospace; white-space: pre-wrap; min-height: 1.3em; }
.tld-row { display: flex; flex-wrap: wrap; gap: 8px 28px; align-items: flex-start; }
.tld-cell { flex: 0 1 auto; min-width: 260px; max-width: 100%; }
.tld-cell .caption { max-width: 360px; }
.tld-math { margin: .3em 0; } .tld-math summary { cursor: pointer; font-weight: 600; }
.tld-math pre { background: #f7f7f7; padding: .3em .6em; }
.tld-legend { display: flex; align-items: center; gap: 6px; font-size: .8em; color: #444; flex-wrap: wrap; }
"""


def _anchor(title: str, taken: set[str]) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "section"
    anchor, n = base, 2
    while anchor in taken:
        anchor, n = f"{base}-{n}", n + 1
    taken.add(anchor)
    return anchor


@dataclass
class Section:
    """One section: a title (and anchor in the table of contents), a plain-words intro, an
    optional maths citation (e.g. ``"docs/math.md §3"``) and its views."""

    title: str
    items: list[Item] = field(default_factory=list)
    intro: str = ""
    math: str = ""


@dataclass
class Page:
    """Collects sections of views and writes one offline HTML file.

    Args:
        title: The page's title.
        meta: ``(key, value)`` lines listed under the title.
        sections: The sections (``add_section`` appends one).
        failed_sections: Titles of sections that could not be built (the report lists them).
        warnings: Warnings shown at the top of the page.
        results: What one section computed for a later one of the same page, by name (never
            drawn): the QK-attribution section shows the heads the atlas section marked.

    Example:
        >>> from tl_dynamics import viz
        >>> page = viz.Page("demo")
        >>> section = page.add_section("Tokens", [viz.colored_tokens(["<BOS>", "a"], [0.0, 1.0])])
        >>> import tempfile, pathlib
        >>> page.write(pathlib.Path(tempfile.mkdtemp()) / "demo.html").name
        'demo.html'
    """

    title: str
    meta: list[tuple[str, str]] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    failed_sections: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict, repr=False)

    def add_section(
        self, title: str, items: Sequence[Item], intro: str = "", math: str = ""
    ) -> Section:
        """Append a section of views.

        Args:
            title: The section's heading (and its entry in the table of contents).
            items: The views (components or groups).
            intro: A plain-words paragraph under the heading.
            math: A maths citation, e.g. ``"docs/math.md §3"`` (linked to the page's appendix).

        Returns:
            The ``Section`` added.

        Example:
            >>> from tl_dynamics import viz
            >>> page = viz.Page("demo")
            >>> page.add_section("Words", [viz.text("hello")], intro="A greeting.").title
            'Words'
        """
        section = Section(title, list(items), intro, math)
        self.sections.append(section)
        return section

    def to_html(self) -> str:
        """The page as one HTML document.

        Every "§N" it shows links to that section of docs/math.md, which the page carries collapsed at
        its end (with the sections those cite; see ``_cite``).

        Returns:
            The HTML text (no network request: scripts inlined, a Content-Security-Policy).

        Example:
            >>> from tl_dynamics import viz
            >>> page = viz.Page("demo")
            >>> _ = page.add_section("Words", [viz.text("see docs/math.md §2")])
            >>> html = page.to_html()
            >>> html.startswith("<!DOCTYPE html>"), 'id="tld-maths-cited"' in html
            (True, True)
        """
        nonce = secrets.token_hex(16)
        csp = (
            f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; "
            "img-src data:; font-src data:"
        )
        meta = "".join(f"<li><b>{html_escape(k)}</b>: {html_escape(v)}</li>" for k, v in self.meta)
        warnings = "".join(f'<p class="warning">{html_escape(w)}</p>' for w in self.warnings)
        taken: set[str] = set()
        anchors = [_anchor(section.title, taken) for section in self.sections]
        body, needs_bundle = [], False
        for anchor, section in zip(anchors, self.sections):
            heading = f"<h2>{html_escape(section.title)}</h2>" if section.title else ""
            body.append(f'<section id="{anchor}">{heading}')
            if section.intro or section.math:
                cite = (
                    f' <span class="cite">(maths: {html_escape(section.math)})</span>'
                    if section.math
                    else ""
                )
                body.append(f'<p class="intro">{html_escape(section.intro)}{cite}</p>')
            body.extend(item.fragment(nonce) for item in section.items)
            needs_bundle = needs_bundle or any(item.needs_bundle() for item in section.items)
            body.append("</section>")
        cited: list[str] = []
        known = set(docs.sections()) if any("\u00a7" in part for part in body) else set()
        text = _cite.link("".join(body), known, cited)
        maths = _cite.appendix(cited)
        entries = [(a, s.title) for a, s in zip(anchors, self.sections)]
        entries += [("tld-maths-cited", "Maths cited on this page")] if maths else []
        toc = "".join(f'<li><a href="#{a}">{html_escape(t)}</a></li>' for a, t in entries)
        bundle = f'<script nonce="{nonce}">{bundle_js()}</script>' if needs_bundle else ""
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html_escape(self.title)}</title><style>{_STYLE}</style>{bundle}"
            f'<script nonce="{nonce}">{RUNTIME_JS}</script></head><body>'
            f'<h1>{html_escape(self.title)}</h1>{warnings}<ul class="meta">{meta}</ul>'
            + (f'<nav class="toc"><b>Contents</b><ol>{toc}</ol></nav>' if len(entries) > 1 else "")
            + text
            + maths
            + f'<script nonce="{nonce}">TLD.start();</script>'
            + (f'<script nonce="{nonce}">{_cite.OPEN_JS}</script>' if maths else "")
            + "</body></html>\n"
        )

    def save_figures(
        self, folder: Union[str, os.PathLike], formats: tuple[str, ...] = ("png", "svg")
    ) -> list[Path]:
        """Write every figure of the page into a folder.

        Files are named ``NN-section_MM-kind-label.png`` (and ``.svg`` for heat maps, attention maps and
        line plots). Text views are left out; PNGs need a headless Chromium (``viz._export``).

        Args:
            folder: The folder to write (made if missing).
            formats: Which of ``"png"`` and ``"svg"`` to write.

        Returns:
            The files written.

        Example:
            >>> import tempfile
            >>> from tl_dynamics import viz
            >>> page = viz.Page("demo")
            >>> _ = page.add_section("Map", [viz.heatmap([[0.0, 1.0]], title="m")])
            >>> [p.name for p in page.save_figures(tempfile.mkdtemp(), formats=("svg",))]
            ['01-map_01-heatmap-m.svg']
        """
        return _component.WRITERS["figures"](self.sections, folder, formats)

    def write(self, path: Union[str, os.PathLike]) -> Path:
        """Write the page to an HTML file (atomically: a temporary file renamed into place).

        Args:
            path: The file to write.

        Returns:
            The path written.

        Example:
            >>> import tempfile, pathlib
            >>> from tl_dynamics import viz
            >>> out = viz.Page("demo").write(pathlib.Path(tempfile.mkdtemp()) / "page.html")
            >>> out.read_text().count("<h1>demo</h1>")
            1
        """
        # atomic: a temporary file in the same folder, renamed into place
        return files.write_text(Path(path), self.to_html())
