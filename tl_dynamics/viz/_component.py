"""A rendered view: a circuitsvis React component with its props, or a trusted HTML fragment."""

from __future__ import annotations

import html
import itertools
import json
import math
import secrets
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.viz._runtime import RUNTIME_JS
from tl_dynamics.viz._specs import CANVAS_KINDS, canvas_spec, cv_spec

_ids = itertools.count()
# Element ids carry a per-process prefix: a notebook keeps outputs of earlier kernels on the
# same page, and their counters started at 0 too.
_PROCESS = secrets.token_hex(3)
# Writes a view to a file (``viz._export.save``, registered when ``tl_dynamics.viz`` loads: it
# builds pages, which are made of components, so this module cannot import it).
WRITERS: dict[str, Callable[..., Any]] = {}


def html_escape(text: Any) -> str:
    """Escape untrusted text (token strings, prompts, names) for HTML.

    Args:
        text: Anything; it is converted with ``str`` first.

    Returns:
        The text with ``&``, ``<``, ``>`` and both quotes escaped.

    Example:
        >>> html_escape('<b title="x">')
        '&lt;b title=&quot;x&quot;&gt;'
    """
    return html.escape(str(text), quote=True)


_WHITESPACE = str.maketrans({"\n": "\u23ce", "\r": "\u240d", "\t": "\u21e5"})


def visible_token(token: Any) -> str:
    """A token as a label a reader can see.

    Newline becomes a return symbol, tab an arrow, a token of spaces middle dots, the empty token an
    empty-set sign; other text is unchanged.

    Args:
        token: A token string (anything is converted with ``str``).

    Returns:
        The label.

    Example:
        >>> [visible_token(t) for t in ["\\n", "    ", " the", "", "a\\tb"]]
        ['⏎', '····', ' the', '∅', 'a⇥b']
    """
    text = str(token)
    if text == "":
        return "\u2205"
    if text.strip(" ") == "":
        return "\u00b7" * len(text)
    return text.translate(_WHITESPACE)


def escape_tokens(tokens: Any) -> list[str]:
    """Token strings escaped for circuitsvis components that insert them as raw HTML, with
    whitespace made visible (``visible_token``)."""
    return [html_escape(visible_token(t)) for t in tokens]


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
    """JSON for a ``<script type="application/json">`` block: every ``<`` is written ``\\u003c``
    (inside JSON strings, the only place one can occur), so nothing can close or confuse it."""
    text = json.dumps({k: _plain(v) for k, v in props.items() if v is not None})
    return text.replace("<", "\\u003c")


@lru_cache(maxsize=1)
def bundle_js() -> str:
    """The circuitsvis browser bundle shipped inside its wheel (defines ``window.CircuitsVis``)."""
    import circuitsvis

    path = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
    return path.read_text(encoding="utf-8").replace("</script", "<\\/script")


@dataclass(frozen=True, repr=False)
class Component:
    """One view: a circuitsvis component with its props, or a trusted HTML fragment.

    In a notebook it displays itself offline (the bundle inlined); ``Page`` embeds many components
    with the bundle loaded once. The builders (``heatmap``, ``colored_tokens``, ...) make them.

    Args:
        name: The circuitsvis (or canvas) component's name, or None for an ``html`` view.
        props: The component's data.
        html: The fragment of an ``html`` view (trusted: builders escape what they put there).
        caption: Text under the view.
        kind: For an ``html`` view: ``"line_plot"``, ``"small_multiples"``, ``"figure"``,
            ``"table"`` or ``"text"``.

    Example:
        >>> from tl_dynamics import viz
        >>> viz.colored_tokens(["a", "b"], [0.0, 1.0], caption="demo")
        Component(ColoredTokens, 'demo')
    """

    name: str | None = None
    props: dict[str, Any] = field(default_factory=dict)
    html: str = ""
    caption: str = ""
    kind: str = ""  # for an html view: "line_plot", "small_multiples", "figure", "table", "text"

    def __repr__(self) -> str:
        kind = self.name or f"html, {len(self.html)} chars"
        return f"Component({kind}{', ' + repr(self.caption) if self.caption else ''})"

    def fragment(self, nonce: str) -> str:
        """HTML of the view for a page that has loaded the bundle and the runtime.

        An empty placeholder and its data (a JSON block, never executed); the runtime draws it when it
        scrolls into view.

        Args:
            nonce: The page's script nonce (unused by the view itself, kept for ``Group``).

        Returns:
            The HTML fragment.

        Example:
            >>> Component(html="<p>x</p>", caption="c", kind="text").fragment("n")
            '<div class="tld-html"><p>x</p></div><p class="caption">c</p>'
        """
        caption = f'<p class="caption">{html_escape(self.caption)}</p>' if self.caption else ""
        if self.name is None:
            return f'<div class="tld-html">{self.html}</div>{caption}'
        spec, height = self._spec()
        element = f"tld-v-{_PROCESS}-{next(_ids)}"
        return (
            f'<div class="tld-view" id="{element}" style="min-height:{height}px"></div>'
            f'<script type="application/json" id="{element}-data">{props_json(spec)}</script>'
            f"{caption}"
        )

    def section_html(self, title: str = "") -> str:
        """An HTML fragment for another page: a ``<section>`` with the view and its caption.

        The view (an inline image or table) and its caption as ``<figcaption>``, every text escaped.
        Views drawn by circuitsvis need its script: save them (``save``) or add them to a ``Page``.

        Args:
            title: A heading for the section (escaped); none when empty.

        Returns:
            The HTML fragment.

        Example:
            >>> figure = Component(html="<p>1 &lt; 2</p>", caption="a & b", kind="text")
            >>> figure.section_html("x < y")
            '<section class="tl-dynamics-figure"><h3>x &lt; y</h3><figure><p>1 &lt; 2</p><figcaption>a &amp; b</figcaption></figure></section>'
        """
        if self.name is not None:
            raise TLDynamicsError(
                f"section_html: {self!r} is drawn by circuitsvis, which an HTML "
                "fragment cannot carry; use save('view.html') or a viz.Page"
            )
        head = f"<h3>{html_escape(title)}</h3>" if title else ""
        return (
            f'<section class="tl-dynamics-figure">{head}<figure>{self.html}'
            f"<figcaption>{html_escape(self.caption)}</figcaption></figure></section>"
        )

    def _spec(self) -> tuple[dict[str, Any], int]:
        if self.name in CANVAS_KINDS:
            return canvas_spec(self.name, self.props)
        return cv_spec(str(self.name), self.props)

    def fragment_spec(self) -> dict[str, Any]:
        """What the page's runtime receives for this view (arrays packed; see ``_specs``).

        Returns:
            The JSON-ready spec: the component's name and its packed props.

        Example:
            >>> from tl_dynamics import viz
            >>> sorted(viz.heatmap([[0.0, 1.0]]).fragment_spec())[:2]
            ['cell', 'cmap']
        """
        return self._spec()[0]

    def _repr_html_(self) -> str:
        return standalone_html([self])

    def needs_bundle(self) -> bool:
        """Whether circuitsvis draws the view (a page then inlines its bundle).

        Returns:
            False for the views the page's runtime draws (heat maps, html), True otherwise.

        Example:
            >>> from tl_dynamics import viz
            >>> viz.colored_tokens(["a"], [1.0]).needs_bundle(), viz.heatmap([[1.0]]).needs_bundle()
            (True, False)
        """
        return self.name is not None and self.name not in CANVAS_KINDS

    def show(self) -> "Component":
        """The view itself, for a notebook cell to display (``display(view.show())`` or the last line).

        Returns:
            This component.

        Example:
            >>> from tl_dynamics import viz
            >>> view = viz.text("hello")
            >>> view.show() is view
            True
        """
        return self

    def save(self, path: Any) -> Path:
        """Write the view to a file whose suffix says the format.

        ``.html`` is a standalone offline page, ``.svg`` is for heat maps, attention maps and line
        plots, ``.png`` is rendered with headless Chromium (see ``viz._export``).

        Args:
            path: The file to write (its folder must exist).

        Returns:
            The path written.

        Example:
            >>> import tempfile, pathlib
            >>> out = pathlib.Path(tempfile.mkdtemp()) / "map.svg"
            >>> from tl_dynamics import viz
            >>> viz.heatmap([[0.0, 1.0]], ["L0"], ["H0", "H1"], title="demo").save(out).name
            'map.svg'
        """
        return WRITERS["save"](self, path)


# Notebook outputs: circuitsvis's ~1.3 MB bundle goes with the first view of a kernel session
# that needs it; later outputs find ``window.CircuitsVis`` in the same front end (the runtime
# waits for it). "every" inlines it in every output (front ends that isolate each output, such
# as Colab, get that automatically).
_BUNDLE = {"mode": "once", "sent": False}


def notebook_bundle(mode: str) -> str:
    """How notebook outputs carry the circuitsvis script.

    ``"once"`` (the default) sends it with the first view of the kernel session, and later views use
    it; ``"every"`` inlines it in each output, for a front end that isolates outputs, or a notebook
    whose first output was cleared.

    Args:
        mode: ``"once"`` or ``"every"``.

    Returns:
        The previous mode.

    Example:
        >>> notebook_bundle("every"), notebook_bundle("once")
        ('once', 'every')
    """
    if mode not in ("once", "every"):
        raise TLDynamicsError(f"notebook_bundle({mode!r}): valid modes are 'once' and 'every'")
    before, _BUNDLE["mode"] = _BUNDLE["mode"], mode
    return str(before)


def _send_bundle() -> bool:
    if _BUNDLE["mode"] == "every" or "google.colab" in sys.modules or not _BUNDLE["sent"]:
        _BUNDLE["sent"] = True
        return True
    return False


def standalone_html(components: list[Any], caption: str = "") -> str:
    """Components with the runtime (and the circuitsvis bundle when one needs it and this kernel
    session has not sent it yet; see ``notebook_bundle``): a notebook cell's output."""
    nonce = secrets.token_hex(8)
    needs = any(c.needs_bundle() for c in components)
    bundle = f'<script nonce="{nonce}">{bundle_js()}</script>' if needs and _send_bundle() else ""
    head = f'<p class="caption">{html_escape(caption)}</p>' if caption else ""
    return (
        bundle
        + f'<script nonce="{nonce}">{RUNTIME_JS}</script>'
        + head
        + "".join(c.fragment(nonce) for c in components)
        + f'<script nonce="{nonce}">TLD.start();</script>'
    )
