"""A standalone HTML page that renders with no network: the circuitsvis bundle inlined once,
a Content-Security-Policy that forbids every network request and inline event handlers."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from tl_dynamics.viz._component import Component, Group, bundle_js, html_escape

Item = Union[Component, Group]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
.caption { color: #555; font-size: .9em; } .meta { color: #555; }
.tld-table { border-collapse: collapse; font-size: .85em; }
.tld-table td, .tld-table th { border: 1px solid #ddd; padding: 2px 6px; text-align: right; }
.tld-figure { max-width: 100%; } .tld-cv { margin: 12px 0; } pre { white-space: pre-wrap; }
"""


@dataclass
class Section:
    title: str
    items: list[Item] = field(default_factory=list)
    intro: str = ""


@dataclass
class Page:
    """Collects sections of components and writes one offline HTML file.

    Example:
        >>> from tl_dynamics import viz
        >>> page = viz.Page("demo")
        >>> page.add_section("Tokens", [viz.colored_tokens(["<BOS>", "a"], [0.0, 1.0])])
        >>> page.write("/tmp/demo.html")                       # doctest: +SKIP
    """

    title: str
    meta: list[tuple[str, str]] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    failed_sections: list[str] = field(default_factory=list)

    def add_section(self, title: str, items: list[Item], intro: str = "") -> Section:
        section = Section(title, list(items), intro)
        self.sections.append(section)
        return section

    def to_html(self) -> str:
        nonce = secrets.token_hex(16)
        csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; "
               "img-src data:; font-src data:")
        meta = "".join(f"<li><b>{html_escape(k)}</b>: {html_escape(v)}</li>" for k, v in self.meta)
        body = []
        for section in self.sections:
            body.append(f"<section><h2>{html_escape(section.title)}</h2>")
            if section.intro:
                body.append(f'<p class="intro">{html_escape(section.intro)}</p>')
            body.extend(item.fragment(nonce) for item in section.items)
            body.append("</section>")
        return (
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
            f"<title>{html_escape(self.title)}</title><style>{_STYLE}</style>"
            f'<script nonce="{nonce}">{bundle_js()}</script></head><body>'
            f"<h1>{html_escape(self.title)}</h1><ul class=\"meta\">{meta}</ul>"
            + "".join(body) + "</body></html>\n")

    def write(self, path: Union[str, os.PathLike]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_html(), encoding="utf-8")
        return path
