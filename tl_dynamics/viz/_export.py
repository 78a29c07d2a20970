"""Figures for papers: any view saved as ``.html`` (a standalone offline page), ``.svg`` (heat
maps, attention maps and line plots, written in Python by ``_svg``) or ``.png``.

PNGs are rendered by a headless Chromium (Debian's ``chromium``, driven by playwright-python;
no browser is downloaded): an SVG view is rasterised from the same SVG the ``.svg`` file holds,
any other view is drawn by the page's own runtime and cropped to its content. A matplotlib
``viz.figure`` is written from its own PNG, with no browser.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.viz import _component, _svg
from tl_dynamics.viz._component import Component
from tl_dynamics.viz._group import Group
from tl_dynamics.viz._page import Page

FORMATS = (".html", ".svg", ".png")
SVG_KINDS = (
    "heatmap",
    "attention_pattern",
    "attention_heads",
    "attention_grid",
    "line_plot",
    "small_multiples",
)
CHROMIUM_ENV = "TL_DYNAMICS_CHROMIUM"
_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
Item = Union[Component, Group]


def kind_of(item: Item) -> str:
    """A view's kind in snake case: ``heatmap``, ``attention_grid``, ``line_plot``, ``table``..."""
    if isinstance(item, Group):
        return "group"
    if item.name:
        return re.sub(r"(?<!^)(?=[A-Z])", "_", item.name).lower()
    return item.kind or "html"


def has_svg(item: Item) -> bool:
    """Whether ``.svg`` is written for this view (a group: when all of its views have one)."""
    if isinstance(item, Group):
        return all(has_svg(c) for c in item.components)
    return kind_of(item) in SVG_KINDS


def _blocking(item: Item) -> str:
    """For a group, which member has no ``.svg`` (its place, kind and caption), else ``""``."""
    if not isinstance(item, Group):
        return ""
    for i, member in enumerate(_flat(item)):
        if not has_svg(member):
            caption = f" {member.caption[:60]!r}" if member.caption else ""
            return (
                f" whose member {i} of {len(_flat(item))} (a {kind_of(member)}{caption}) has no "
                ".svg (use .components to save the others)"
            )
    return ""


def _blocks(component: Component, key: str) -> list[_svg.Block]:
    kind = kind_of(component)
    if kind in ("line_plot", "small_multiples"):
        return [_svg.inline_block(component.html)]
    if kind == "heatmap":
        return _svg.heatmap_blocks(component.props, key)
    return _svg.heads_blocks(str(component.name), component.props, key)


def to_svg(item: Item) -> str:
    """The view as a standalone SVG document (its caption below it)."""
    if not has_svg(item):
        raise TLDynamicsError(
            f"this view is a {kind_of(item)}{_blocking(item)}: .svg is written for "
            f"{', '.join(SVG_KINDS)} (and groups of them only); save it as .html or .png"
        )
    parts = _flat(item)  # a group's views, nested groups included
    blocks = [b for i, c in enumerate(parts) for b in _blocks(c, f"tld-legend-{i}")]
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        + _svg.document(blocks, item.caption, label=item.caption or kind_of(item))
        + "\n"
    )


def to_html(item: Item, title: str = "") -> str:
    """The view alone on a standalone offline page (``viz.Page``'s machinery)."""
    page = Page(title or item.caption or kind_of(item).replace("_", " "))
    page.add_section("", [item])
    return page.to_html()


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise TLDynamicsError(
            f"cannot save a view as {path.name!r}: give a file ending in {', '.join(FORMATS)}"
        )
    return suffix


def save(item: Item, path: Union[str, os.PathLike], renderer: "Renderer | None" = None) -> Path:
    """Write ``item`` to ``path``; the format follows the suffix (``FORMATS``)."""
    path = Path(path)
    suffix = _suffix(path)
    if suffix == ".svg":
        text = to_svg(item)  # refuses before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".html":
        path.write_text(to_html(item), encoding="utf-8")
    elif suffix == ".svg":
        path.write_text(text, encoding="utf-8")
    elif isinstance(item, Component) and item.kind == "figure":
        data = re.search(r'base64,([A-Za-z0-9+/=]+)"', item.html)
        path.write_bytes(base64.b64decode(data.group(1)))  # type: ignore[union-attr]
    elif renderer is not None:
        renderer.png(item, path)
    else:
        with Renderer() as own:
            own.png(item, path)
    return path


def chromium_path() -> str:
    """The Chromium PNGs are rendered with: ``$TL_DYNAMICS_CHROMIUM``, else ``chromium`` on the
    PATH (Debian: ``apt-get install chromium``)."""
    found = (
        os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    if not found or not os.path.exists(found):
        raise TLDynamicsError(
            "PNG export renders with a headless Chromium and none was found: "
            f"install Debian's (apt-get install chromium) or set {CHROMIUM_ENV} "
            "to a Chromium executable; .html and .svg need no browser"
        )
    return found


class Renderer:
    """One headless Chromium for many PNGs (``with Renderer() as r: r.png(view, path)``);
    ``scale`` is the device pixel ratio (2: crisp in print)."""

    def __init__(self, scale: float = 2.0) -> None:
        self.scale = scale
        self._pw: Any = None
        self._browser: Any = None

    def __enter__(self) -> "Renderer":
        executable = chromium_path()
        try:
            from playwright.sync_api import sync_playwright
        except ImportError:
            raise TLDynamicsError(
                "PNG export drives Chromium with playwright-python, which is "
                "not installed: pip install playwright (no browser download "
                "is needed; it uses the system chromium)"
            ) from None
        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(executable_path=executable, args=_FLAGS)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._browser.close()
        self._pw.stop()

    def png(self, item: Item, path: Path) -> None:
        """Render ``item`` and write it as a PNG cropped to its content."""
        if has_svg(item):
            svg = to_svg(item).split("\n", 1)[1]
            html = (
                f'<!DOCTYPE html><html><body style="margin:0;background:#fff">{svg}</body></html>'
            )
            shot = self._shoot(html, "svg")
        else:
            shot = self._shoot(to_html(item), "section")
        path.write_bytes(_crop(shot, int(8 * self.scale)))

    def _shoot(self, html: str, selector: str) -> bytes:
        tab = self._browser.new_page(
            viewport={"width": 1280, "height": 1000}, device_scale_factor=self.scale
        )
        errors: list[str] = []
        tab.on("pageerror", lambda e: errors.append(str(e)))
        try:
            tab.set_content(html)
            views = "[...document.querySelectorAll('.tld-view')]"
            for i in range(tab.evaluate(f"{views}.length")):
                tab.evaluate(f"{views}[{i}].scrollIntoView()")
                tab.wait_for_function(
                    f"() => ['done', 'error'].includes({views}[{i}].dataset.state)", timeout=60_000
                )
            failed = tab.evaluate(
                f"{views}.filter(v => v.dataset.state === 'error').map(v => v.textContent)"
            )
            if failed or errors:
                raise TLDynamicsError(f"the view did not draw: {(failed + errors)[0]}")
            tab.evaluate("window.scrollTo(0, 0)")
            tab.wait_for_timeout(200)  # React commits asynchronously
            return tab.locator(selector).first.screenshot()
        finally:
            tab.close()


def _crop(png: bytes, margin: int) -> bytes:
    """The screenshot cut to its non-white content plus ``margin`` pixels."""
    import io

    from PIL import Image, ImageChops

    image = Image.open(io.BytesIO(png)).convert("RGB")
    box = ImageChops.difference(image, Image.new("RGB", image.size, (255, 255, 255))).getbbox()
    if box:
        content = image.crop(box)
        image = Image.new(
            "RGB", (content.width + 2 * margin, content.height + 2 * margin), (255, 255, 255)
        )
        image.paste(content, (margin, margin))
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def _slug(text: str, limit: int = 40) -> str:
    """Lower-case words joined by ``-``, cut at a word boundary within ``limit`` characters."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if len(slug) > limit:
        cut = slug[: limit + 1].rfind("-")
        slug = slug[: cut if cut > 0 else limit]
    return slug


def _label(component: Component) -> str:
    props = component.props
    for key in ("title", "valueName"):
        if props.get(key):
            return str(props[key])
    return component.caption


def _flat(item: Item) -> list[Component]:
    if isinstance(item, Group):
        return [c for part in item.components for c in _flat(part)]
    return [item]


def figures(sections: Sequence[Any]) -> Iterator[tuple[str, Component]]:
    """``(file stem, view)`` for every figure of a page's sections (groups opened, text left
    out), named ``NN-section_MM-kind-label``: readable and in page order."""
    for s, section in enumerate(sections, 1):
        views = [v for item in section.items for v in _flat(item) if kind_of(v) != "text"]
        for v, view in enumerate(views, 1):
            label = _slug(_label(view))
            yield (
                (
                    f"{s:02d}-{_slug(section.title) or 'section'}_{v:02d}-"
                    f"{kind_of(view).replace('_', '-')}{'-' + label if label else ''}"
                ),
                view,
            )


def save_figures(
    sections: Sequence[Any],
    folder: Union[str, os.PathLike],
    formats: Sequence[str] = ("png", "svg"),
) -> list[Path]:
    """Every figure of the sections into ``folder``, as PNG and as SVG where the view has one."""
    wanted = [f".{f.lstrip('.').lower()}" for f in formats]
    bad = [f for f in wanted if f not in FORMATS]
    if bad or not wanted:
        raise TLDynamicsError(f"figure formats {list(formats)!r}: choose from png, svg, html")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    chosen = list(figures(sections))
    needs_browser = ".png" in wanted and any(v.kind != "figure" for _, v in chosen)
    renderer = Renderer() if needs_browser else None
    if renderer is not None:
        renderer.__enter__()
    try:
        for stem, view in chosen:
            for suffix in wanted:
                if suffix != ".svg" or has_svg(view):
                    written.append(save(view, folder / f"{stem}{suffix}", renderer))
    finally:
        if renderer is not None:
            renderer.__exit__(None, None, None)
    return written


_component.WRITERS.update(save=save, figures=save_figures)
