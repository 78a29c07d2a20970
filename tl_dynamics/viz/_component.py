"""A rendered view: a circuitsvis React component with its props, or a trusted HTML fragment."""

from __future__ import annotations

import html
import itertools
import json
import math
import secrets
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

_ids = itertools.count()


def html_escape(text: Any) -> str:
    """Escape untrusted text (token strings, prompts, names) for HTML."""
    return html.escape(str(text), quote=True)


def escape_tokens(tokens: Any) -> list[str]:
    """Token strings escaped for circuitsvis components that insert them as raw HTML."""
    return [html_escape(t) for t in tokens]


def _plain(value: Any) -> Any:
    """Tensors/arrays to nested lists; non-finite floats to None (valid JSON)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().float().numpy()
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def props_json(props: dict[str, Any]) -> str:
    """JSON for embedding inside a <script>: ``</`` and ``<!--`` cannot end or confuse it."""
    text = json.dumps({k: _plain(v) for k, v in props.items() if v is not None})
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


@lru_cache(maxsize=1)
def bundle_js() -> str:
    """The circuitsvis browser bundle shipped inside its wheel (defines ``window.CircuitsVis``)."""
    import circuitsvis

    path = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
    return path.read_text(encoding="utf-8").replace("</script", "<\\/script")


@dataclass(frozen=True, repr=False)
class Component:
    """One view. ``name`` is a circuitsvis component (``props`` its data) or None for ``html``.

    In a notebook it displays itself offline (bundle inlined); ``Page`` embeds many components
    with the bundle loaded once.
    """

    name: str | None = None
    props: dict[str, Any] = field(default_factory=dict)
    html: str = ""
    caption: str = ""

    def __repr__(self) -> str:
        kind = self.name or f"html, {len(self.html)} chars"
        return f"Component({kind}{', ' + repr(self.caption) if self.caption else ''})"

    def fragment(self, nonce: str) -> str:
        """HTML for a page that has already loaded the bundle."""
        caption = f'<p class="caption">{html_escape(self.caption)}</p>' if self.caption else ""
        if self.name is None:
            return f'<div class="tld-html">{self.html}</div>{caption}'
        element = f"tld-cv-{next(_ids)}"
        return (f'<div class="tld-cv" id="{element}"></div>{caption}'
                f'<script nonce="{nonce}">CircuitsVis.render("{element}", '
                f"CircuitsVis.{self.name}, {props_json(self.props)});</script>")

    def _repr_html_(self) -> str:
        nonce = secrets.token_hex(8)
        if self.name is None:
            return self.fragment(nonce)
        return f'<script nonce="{nonce}">{bundle_js()}</script>' + self.fragment(nonce)

    def show(self) -> "Component":
        return self


def group(*components: Component, caption: str = "") -> "Group":
    return Group(tuple(components), caption)


@dataclass(frozen=True, repr=False)
class Group:
    """Several components shown together (e.g. a result's ``.show()``)."""

    components: tuple[Component, ...]
    caption: str = ""

    def fragment(self, nonce: str) -> str:
        head = f'<p class="caption">{html_escape(self.caption)}</p>' if self.caption else ""
        return head + "".join(c.fragment(nonce) for c in self.components)

    def __repr__(self) -> str:
        return f"Group({', '.join(map(repr, self.components))})"

    def _repr_html_(self) -> str:
        nonce = secrets.token_hex(8)
        needs_bundle = any(c.name is not None for c in self.components)
        bundle = f'<script nonce="{nonce}">{bundle_js()}</script>' if needs_bundle else ""
        return bundle + self.fragment(nonce)

    def show(self) -> "Group":
        return self
