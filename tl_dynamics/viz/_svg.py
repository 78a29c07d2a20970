"""Vector figures for papers: heat maps and attention maps as standalone SVG, written in Python
from a component's own data, with the page's colours, legend, labels and title.

Colours match the page's runtime (``_runtime.py``): the same colour stops, the same ranges and
square-root spacing for attention (``_specs``), grey (226, 226, 226) for masked or undefined
cells. Small maps are one ``<rect>`` per cell; maps of more than ``RECT_LIMIT`` cells embed their
cells as one lossless PNG (``image-rendering: pixelated``) under vector labels, so a 512-token
pattern stays a small file. Line plots are SVG already (``_plots``); ``compose`` adds captions.
"""

from __future__ import annotations

import base64
import io
import re
import textwrap
from typing import Any, Sequence

import numpy as np

from tl_dynamics.viz._component import html_escape
from tl_dynamics.viz._encode import as_array, downsample_max
from tl_dynamics.viz._specs import THUMB_CELLS
from tl_dynamics.viz._specs import _scale as scale_of

MAPS = {
    "blues": ((247, 251, 255), (198, 219, 239), (107, 174, 214), (33, 113, 181), (8, 48, 107)),
    "viridis": ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)),
    "rdbu": ((178, 24, 43), (244, 165, 130), (247, 247, 247), (146, 197, 222), (33, 102, 172)),
}
GREY = (226, 226, 226)
RECT_LIMIT = 4096
_FONT = "font-family:sans-serif"
Block = tuple[str, float, float]  # an SVG element string, its width and height


def _ramp(stops: Sequence[tuple[int, int, int]], t: np.ndarray) -> np.ndarray:
    x = np.clip(t, 0.0, 1.0) * (len(stops) - 1)
    i = np.minimum(len(stops) - 2, np.floor(x)).astype(int)
    f = (x - i)[..., None]
    table = np.asarray(stops, dtype=float)
    return np.rint(table[i] + (table[i + 1] - table[i]) * f).astype(np.uint8)


def colours(values: Any, lo: float, hi: float, scale: str, cmap: str) -> np.ndarray:
    """RGB bytes ``[..., 3]`` for ``values`` as the page draws them (grey where not finite).

    Example:
        >>> colours([0.0, 1.0, float("nan")], 0.0, 1.0, "linear", "viridis").tolist()
        [[68, 1, 84], [253, 231, 37], [226, 226, 226]]
    """
    arr = np.asarray(values, dtype=float)
    t = np.clip((np.nan_to_num(arr, nan=lo) - lo) / ((hi - lo) or 1.0), 0.0, 1.0)
    if scale == "sqrt":  # the page quantises sqrt(t) and squares it back: the same colour
        t = np.sqrt(t) ** 2
    if cmap == "rdbu":
        m = max(abs(lo), abs(hi)) or 1.0
        t = 0.5 + 0.5 * (lo + (hi - lo) * t) / m
    out = _ramp(MAPS.get(cmap, MAPS["blues"]), t)
    out[~np.isfinite(arr)] = GREY
    return out


def _hex(rgb: Sequence[int]) -> str:
    return "#" + "".join(f"{int(c):02x}" for c in rgb)


def _fmt(v: float) -> str:
    a = abs(v)
    return f"{v:.2e}" if a != 0 and (a < 1e-3 or a >= 1e4) else f"{v:.3g}"


def _text(
    x: float,
    y: float,
    body: str,
    size: float = 10,
    anchor: str = "start",
    extra: str = "",
    bold: bool = False,
) -> str:
    weight = ";font-weight:bold" if bold else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" {extra}'
        f'style="{_FONT};font-size:{size:g}px{weight}">{html_escape(body)}</text>'
    )


def _cells(rgb: np.ndarray, x0: float, y0: float, s: float) -> str:
    rows, cols = rgb.shape[:2]
    if rows * cols > RECT_LIMIT:
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(rgb), "RGB").save(buffer, format="PNG")
        data = base64.b64encode(buffer.getvalue()).decode("ascii")
        return (
            f'<image x="{x0:.1f}" y="{y0:.1f}" width="{cols * s:.2f}" height="{rows * s:.2f}" '
            f'preserveAspectRatio="none" style="image-rendering:pixelated" '
            f'href="data:image/png;base64,{data}"/>'
        )
    return "".join(
        f'<rect x="{x0 + c * s:.2f}" y="{y0 + r * s:.2f}" width="{s:.2f}" '
        f'height="{s:.2f}" fill="{_hex(rgb[r, c])}"/>'
        for r in range(rows)
        for c in range(cols)
    )


def legend(
    x0: float, y0: float, lo: float, hi: float, scale: str, cmap: str, name: str, key: str
) -> Block:
    """The colour bar with its range and what the colours mean (as the page's legend)."""
    t = np.linspace(0.0, 1.0, 33)
    rgb = colours(lo + (hi - lo) * (t * t if scale == "sqrt" else t), lo, hi, "linear", cmap)
    stops = "".join(f'<stop offset="{o:.3f}" stop-color="{_hex(c)}"/>' for o, c in zip(t, rgb))
    low = _fmt(lo)
    x = x0 + 6 * len(low) + 4
    words = name + (" (colour spaced by square root)" if scale == "sqrt" else "")
    words += "; grey: masked or not defined"
    body = (
        f'<defs><linearGradient id="{key}">{stops}</linearGradient></defs>'
        + _text(x0, y0 + 9, low, 10)
        + f'<rect x="{x:.1f}" y="{y0:.1f}" width="160" height="10" '
        f'fill="url(#{key})" stroke="#999" stroke-width="0.5"/>'
        + _text(x + 164, y0 + 9, _fmt(hi), 10)
        + _text(x + 170 + 6 * len(_fmt(hi)), y0 + 9, words, 10)
    )
    return f"<g>{body}</g>", x + 176 + 6 * len(_fmt(hi)) + 5.2 * len(words) - x0, 14.0


def panel(
    values: Any,
    x0: float,
    y0: float,
    lo: float,
    hi: float,
    scale: str,
    cmap: str,
    title: str = "",
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    mask: bool = False,
    cell: float = 16.0,
    max_px: float = 480.0,
) -> Block:
    """One map: title, row labels at the left, column labels below (vertical), cells."""
    arr = np.array(as_array(values), dtype=float)
    rows, cols = arr.shape
    if mask:
        arr[np.triu(np.ones((rows, cols), dtype=bool), 1)] = np.nan
    s = min(cell, max_px / max(rows, cols, 1))
    show = s >= 9
    font = min(11.0, s - 1)
    left = (
        min(110.0, 6.6 * font / 11 * max((len(x) for x in row_labels), default=0) + 6)
        if show and row_labels
        else 0.0
    )
    below = (
        min(72.0, 6.6 * font / 11 * max((len(x) for x in col_labels), default=0) + 6)
        if show and col_labels
        else 0.0
    )
    top = 16.0 if title else 0.0
    parts = [_text(x0, y0 + 12, title, 12, bold=True)] if title else []
    gx, gy = x0 + left, y0 + top
    parts.append(_cells(colours(arr, lo, hi, scale, cmap), gx, gy, s))
    if show and row_labels:
        parts += [
            _text(
                gx - 3,
                gy + (r + 0.5) * s + font * 0.35,
                _clip(lab, 18),
                font,
                "end",
                'font-family="monospace" ',
            )
            for r, lab in enumerate(row_labels)
        ]
    if show and col_labels:
        for c, lab in enumerate(col_labels):
            x, y = gx + (c + 0.5) * s + font * 0.35, gy + rows * s + 3
            parts.append(
                _text(
                    x, y, _clip(lab, 12), font, "end", f'transform="rotate(-90 {x:.1f} {y:.1f})" '
                )
            )
    return "".join(parts), left + cols * s, top + rows * s + below


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _caption(caption: str, x0: float, y0: float, width: float) -> Block:
    lines = textwrap.wrap(caption, max(30, int(width / 6.2))) if caption else []
    body = "".join(
        _text(x0, y0 + 13 * (i + 1), line, 10.5, extra='fill="#555" ')
        for i, line in enumerate(lines)
    )
    return body, width, 13.0 * len(lines) + (6.0 if lines else 0.0)


def document(
    blocks: Sequence[Block], caption: str = "", pad: float = 8.0, label: str = "figure"
) -> str:
    """Blocks stacked top to bottom (each placed with a nested ``<svg>``), then the caption."""
    width = max([w for _, w, _ in blocks] + [280.0]) + 2 * pad
    parts, y = [], pad
    for body, w, h in blocks:
        parts.append(
            f'<svg x="{pad:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
            f'overflow="visible">{body}</svg>'
        )
        y += h + 8
    text, _, h = _caption(caption, pad, y - 4, width - 2 * pad)
    height = y - 8 + h + pad
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" '
        f'aria-label="{html_escape(label)}"><rect width="100%" height="100%" fill="#fff"/>'
        + "".join(parts)
        + text
        + "</svg>"
    )


def inline_block(svg: str) -> Block:
    """An SVG written by ``_plots`` as a block (its own width and height)."""
    w = float(re.search(r'width="([\d.]+)"', svg).group(1))  # type: ignore[union-attr]
    h = float(re.search(r'height="([\d.]+)"', svg).group(1))  # type: ignore[union-attr]
    return svg, w, h


def heatmap_blocks(props: dict[str, Any], key: str) -> list[Block]:
    """A ``viz.heatmap``: map, axis titles and legend."""
    arr = as_array(props["values"])
    lo, hi, scale, cmap = scale_of(arr, props.get("minValue"), props.get("maxValue"))
    scale = "linear"  # heatmap() quantises linearly (pack_u8's default)
    cmap = props.get("cmap") or cmap
    body = panel(
        arr,
        0,
        0,
        lo,
        hi,
        scale,
        cmap,
        props.get("title", ""),
        props.get("rowLabels"),
        props.get("colLabels"),
        bool(props.get("mask")),
        float(props.get("cell") or 16),
    )
    axes = (
        _text(
            0,
            10,
            f"{props.get('rowTitle') or 'row'} down, {props.get('colTitle') or 'column'} across",
            10,
            extra='fill="#555" ',
        ),
        200.0,
        13.0,
    )
    return [body, axes, legend(0, 0, lo, hi, scale, cmap, props.get("valueName") or "value", key)]


def heads_blocks(name: str, props: dict[str, Any], key: str) -> list[Block]:
    """Attention maps: one panel per head (``AttentionHeads``, ``AttentionPattern``), or every
    head's thumbnail in a layer x head grid and the selected head in full (``AttentionGrid``)."""
    tokens = props.get("tokens")
    mask = bool(props.get("maskUpperTri"))
    full: dict[Any, Any]  # head -> pattern; the grid's keys are strings (JSON), the others ints
    if name == "AttentionGrid":
        thumbs, full = as_array(props["thumbs"]), props["full"]
        names, columns = props["attentionHeadNames"], int(props.get("columns") or len(thumbs))
    else:
        att = as_array(props["attention"])
        att = att[None] if name == "AttentionPattern" else att
        thumbs = np.stack([downsample_max(a, THUMB_CELLS) for a in att]) if len(att) > 1 else att
        full = dict(enumerate(att))  # the page keeps every head of an AttentionHeads in full
        names = props.get("attentionHeadNames") or [f"head {h}" for h in range(len(att))]
        columns = min(len(att), 4) if len(att) > 1 else 1
    lo, hi, scale, cmap = scale_of(
        thumbs if name == "AttentionGrid" else att, props.get("minValue"), props.get("maxValue")
    )
    blocks: list[Block] = []
    if len(thumbs) > 1:
        size = max(1.0, 64.0 / max(thumbs.shape[1:]))
        row_names = props.get("rowNames")
        left = 40.0 if row_names else 0.0
        parts, w_max, h_max = [], 0.0, 0.0
        for h, thumb in enumerate(thumbs):
            r, c = divmod(h, columns)
            body, w, ht = panel(
                thumb,
                left + c * 76,
                r * 84,
                lo,
                hi,
                scale,
                cmap,
                _clip(str(names[h]), 12),
                mask=mask,
                cell=size,
                max_px=64,
            )
            parts.append(body)
            w_max, h_max = max(w_max, left + c * 76 + w), max(h_max, r * 84 + ht)
        for r, label in enumerate(row_names or []):
            parts.append(_text(0, r * 84 + 50, str(label), 10, extra='font-family="monospace" '))
        blocks.append(("".join(parts), w_max, h_max))
    selected = int(props.get("selected") or 0)
    chosen = selected if selected in {int(k) for k in full} else next(iter(map(int, full)), None)
    if chosen is not None:
        pattern = as_array(full[chosen] if chosen in full else full[str(chosen)])
        title = str(names[chosen]) if len(thumbs) > 1 or names[chosen] else ""
        blocks.append(
            panel(pattern, 0, 0, lo, hi, scale, cmap, title, tokens, tokens, mask, 16.0, 560.0)
        )
    blocks.append(
        (
            _text(0, 10, "destination (query) down, source (key) across", 10, extra='fill="#555" '),
            260.0,
            13.0,
        )
    )
    value = props.get("valueName") or ("attention weight" if scale == "sqrt" else "value")
    blocks.append(legend(0, 0, lo, hi, scale, cmap, value, key))
    return blocks
