"""Line plots as inline SVG written in Python: no matplotlib, no script, a few KB each.

Labels are laid out on a fixed grid (titles above the plot area, y range at its left, x ticks
below, thinned to fit and slanted), so nothing overlaps whatever the values. Every point carries
a ``<title>`` with its exact value, which the browser shows on hover. Untrusted text (names,
labels) is escaped.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
from jaxtyping import Float

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.viz._component import Component, html_escape

# Distinct colours for series (Tableau 10); more series cycle through them.
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)
_FONT = "font-family:sans-serif"
# Anchors of a viridis-like sequential scale (dark purple -> yellow), for ordered series.
_SEQUENTIAL = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))


def sequential_colour(t: float) -> str:
    """A colour of the sequential scale at ``t`` in [0, 1] (0: dark purple, 1: yellow).

    Example:
        >>> sequential_colour(0.0), sequential_colour(1.0)
        ('#440154', '#fde725')
    """
    t = min(1.0, max(0.0, float(t))) * (len(_SEQUENTIAL) - 1)
    i = min(int(t), len(_SEQUENTIAL) - 2)
    a, b = _SEQUENTIAL[i], _SEQUENTIAL[i + 1]
    rgb = (round(x + (y - x) * (t - i)) for x, y in zip(a, b))
    return "#" + "".join(f"{c:02x}" for c in rgb)


def _fmt(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else "n/a"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(1, limit - 1)] + "\u2026"


def _series(values: Any, n: int, name: str) -> Float[np.ndarray, " n"]:
    arr = np.asarray(values.detach().cpu() if hasattr(values, "detach") else values, dtype=float)
    if arr.shape != (n,):
        raise TLDynamicsError(
            f"series {name!r} has shape {arr.shape}; expected ({n},), one value per x label"
        )
    return arr


Series = tuple[str, np.ndarray, str, bool]  # name, values, colour, dashed


def _panel(
    x_labels: Sequence[str],
    series: Sequence[Series],
    title: str,
    x0: float,
    y0: float,
    width: float,
    height: float,
    y_title: str = "",
    max_ticks: int = 8,
    x_values: np.ndarray | None = None,
    y_range: tuple[float, float] | None = None,
    x_title: str = "",
) -> list[str]:
    """SVG elements of one panel whose outer box starts at ``(x0, y0)``; x positions evenly
    spaced, or proportional to ``x_values`` when given."""
    left, top, bottom = 54.0, 24.0, 52.0 + (12.0 if x_title else 0.0)
    pw, ph = width - left - 8.0, height - top - bottom
    px, py = x0 + left, y0 + top
    finite = np.concatenate([s[np.isfinite(s)] for _, s, _, _ in series] or [np.zeros(0)])
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if y_range is not None:
        lo, hi = float(y_range[0]), float(y_range[1])
    if hi - lo < 1e-12 * max(1.0, abs(hi)):
        pad = max(0.5, abs(hi) * 1e-6)  # 0.5 is lost beside a value of 1e300
        lo, hi = lo - pad, hi + pad
    n = len(x_labels)
    if x_values is not None and n > 1 and float(x_values[-1]) > float(x_values[0]):
        span = float(x_values[-1]) - float(x_values[0])
        xs = [px + pw * (float(v) - float(x_values[0])) / span for v in x_values]
    else:
        xs = [px + (pw * i / (n - 1) if n > 1 else pw / 2) for i in range(n)]

    def y_of(v: float) -> float:
        return py + ph * (1.0 - (v - lo) / (hi - lo))

    out = [
        f'<text class="tld-svg-lab" x="{x0 + width / 2:.1f}" y="{y0 + 13:.1f}" '
        f'text-anchor="middle" style="{_FONT};font-size:11px;font-weight:bold">'
        f"{html_escape(_clip(title, int(width / 7)))}</text>",
        f'<rect x="{px:.1f}" y="{py:.1f}" width="{pw:.1f}" height="{ph:.1f}" fill="none" '
        f'stroke="#bbb"/>',
    ]
    for v in (lo, hi):
        out.append(
            f'<text class="tld-svg-lab" x="{px - 4:.1f}" y="{y_of(v) + 3:.1f}" '
            f'text-anchor="end" style="{_FONT};font-size:9px">{_fmt(v)}</text>'
        )
    if y_title:
        out.append(
            f'<text x="{x0 + 9:.1f}" y="{py + ph / 2:.1f}" text-anchor="middle" '
            f'transform="rotate(-90 {x0 + 9:.1f} {py + ph / 2:.1f})" '
            f'style="{_FONT};font-size:9px">{html_escape(y_title)}</text>'
        )
    if x_title:
        out.append(
            f'<text class="tld-svg-lab" x="{px + pw / 2:.1f}" y="{y0 + height - 4:.1f}" '
            f'text-anchor="middle" style="{_FONT};font-size:9px">'
            f"{html_escape(x_title)}</text>"
        )
    # Slanted at 40 degrees, neighbouring tick labels stay apart when their baselines are at
    # least 12 px apart: spacing * sin(40) >= 12, so at most one tick per 19 px.
    max_ticks = max(2, min(max_ticks, int(pw // 19) + 1))
    step = max(1, -(-n // max_ticks))
    ticks = list(range(0, n, step))
    if x_values is not None:  # ticks at evenly spaced positions, not evenly spaced samples
        ticks = sorted(
            {
                int(np.argmin(np.abs(np.asarray(xs) - (px + pw * k / (max_ticks - 1)))))
                for k in range(max_ticks)
            }
        )
    for i in ticks:
        tx, ty = xs[i], py + ph + 10
        out.append(
            f'<text x="{tx:.1f}" y="{ty:.1f}" text-anchor="end" '
            f'transform="rotate(-40 {tx:.1f} {ty:.1f})" '
            f'style="{_FONT};font-size:8px">{html_escape(_clip(x_labels[i], 14))}</text>'
        )
    for name, values, colour, dashed in series:
        dash = ' stroke-dasharray="4 3"' if dashed else ""
        runs: list[list[str]] = [[]]
        for x, v in zip(xs, values):
            if math.isfinite(v):
                runs[-1].append(f"{x:.1f},{y_of(v):.1f}")
            elif runs[-1]:
                runs.append([])  # a gap where the value is not defined
        for run in runs:
            if len(run) > 1:
                out.append(
                    f'<polyline points="{" ".join(run)}" fill="none" stroke="{colour}" '
                    f'stroke-width="1.4"{dash}/>'
                )
        for x, v, label in zip(xs, values, x_labels):
            if math.isfinite(v) and not dashed:  # a dashed series is a reference line: no dots
                out.append(
                    f'<circle cx="{x:.1f}" cy="{y_of(v):.1f}" r="2.2" fill="{colour}">'
                    f"<title>{html_escape(name)} at {html_escape(label)}: {v:.6g}</title>"
                    f"</circle>"
                )
    return out


def _svg(
    parts: list[str], width: float, height: float, caption: str, kind: str, title: str = ""
) -> Component:
    body = "".join(parts)
    return Component(
        html=f'<svg class="tld-figure tld-svg" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" '
        f'aria-label="{html_escape(caption or "plot")}">{body}</svg>',
        caption=caption,
        kind=kind,
        props={"title": title} if title else {},
    )


def line_plot(
    x_labels: Sequence[str],
    series: Mapping[str, Any],
    title: str = "",
    y_title: str = "",
    caption: str = "",
    width: int = 560,
    height: int = 260,
    x_values: Any = None,
    y_range: tuple[float, float] | None = None,
    x_title: str = "",
    dashed: Sequence[str] = (),
    ordered: bool = False,
) -> Component:
    """Several named series over the same x axis in one panel, with a legend (inline SVG).

    The x axis is categorical (``x_labels`` evenly spaced) unless ``x_values`` place the points.

    Args:
        x_labels: One label per x position, ``[n]``.
        series: Named series, each ``[n]`` (NaN leaves a gap).
        title: Title above the panel.
        y_title: Name of the y axis.
        caption: Text under the plot.
        width: Width in pixels (the legend included).
        height: Height in pixels.
        x_values: Increasing numbers, one per label, ``[n]``, that place the points.
        y_range: ``(low, high)`` of the y axis (default: from the data).
        x_title: Name of the x axis.
        dashed: Names of series drawn dashed, without dots (reference lines).
        ordered: Colour the series along a sequential scale (e.g. depth: dark first, yellow last)
            instead of distinct colours.

    Returns:
        A ``Component`` of kind ``"line_plot"`` (its ``html`` is the SVG).

    Example:
        >>> line_plot(["a", "b", "c"], {"up": [0, 1, 2], "down": [2, 1, float("nan")]}).kind
        'line_plot'
    """
    labels = [str(x) for x in x_labels]
    if not labels or not series:
        raise TLDynamicsError("line_plot needs at least one x label and one series")
    n = len(series)
    colour = (
        (lambda i: sequential_colour(i / max(n - 1, 1)))
        if ordered
        else (lambda i: PALETTE[i % len(PALETTE)])
    )
    drawn = [
        (str(k), _series(v, len(labels), str(k)), colour(i), str(k) in dashed)
        for i, (k, v) in enumerate(series.items())
    ]
    xv = None if x_values is None else _series(x_values, len(labels), "x_values")
    legend_w = 150.0
    parts = _panel(
        labels,
        drawn,
        title,
        0.0,
        0.0,
        width - legend_w,
        height,
        y_title,
        x_values=xv,
        y_range=y_range,
        x_title=x_title,
    )
    for i, (name, _, colour, dashed_line) in enumerate(drawn):
        y = 24.0 + 14.0 * i
        dash = ' stroke-dasharray="4 3"' if dashed_line else ""
        parts.append(
            f'<line x1="{width - legend_w + 8:.1f}" y1="{y - 3:.1f}" '
            f'x2="{width - legend_w + 24:.1f}" y2="{y - 3:.1f}" stroke="{colour}" '
            f'stroke-width="2"{dash}/><text x="{width - legend_w + 28:.1f}" y="{y:.1f}" '
            f'class="tld-svg-lab" style="{_FONT};font-size:9px">'
            f"{html_escape(_clip(name, 22))}</text>"
        )
    total_h = max(float(height), 24.0 + 14.0 * len(drawn))
    return _svg(parts, float(width), total_h, caption, "line_plot", title)


def small_multiples(
    x_labels: Sequence[str],
    panels: Mapping[str, Any],
    columns: int = 4,
    caption: str = "",
    panel_width: int = 270,
    panel_height: int = 150,
) -> Component:
    """One small line plot per named series, all over the same x labels, ``columns`` to a row.

    Each panel has its own y range, written at its left.

    Args:
        x_labels: One label per x position, ``[n]``.
        panels: Named series, each ``[n]``.
        columns: Panels per row.
        caption: Text under the plots.
        panel_width: Width of one panel in pixels.
        panel_height: Height of one panel in pixels.

    Returns:
        A ``Component`` of kind ``"small_multiples"`` (its ``html`` is the SVG).

    Example:
        >>> small_multiples(["p0", "p1"], {"norm": [1.0, 2.0], "rank": [3.0, 2.5]}).html[:4]
        '<svg'
    """
    labels = [str(x) for x in x_labels]
    if not labels or not panels:
        raise TLDynamicsError("small_multiples needs at least one x label and one panel")
    if columns < 1:
        raise TLDynamicsError(f"small_multiples: columns must be at least 1, got {columns}")
    parts: list[str] = []
    for i, (name, values) in enumerate(panels.items()):
        row, col = divmod(i, columns)
        parts += _panel(
            labels,
            [(str(name), _series(values, len(labels), str(name)), PALETTE[0], False)],
            str(name),
            float(col * panel_width),
            float(row * panel_height),
            float(panel_width),
            float(panel_height),
            max_ticks=6,
        )
    rows = -(-len(panels) // columns)
    return _svg(
        parts,
        float(min(columns, len(panels)) * panel_width),
        float(rows * panel_height),
        caption,
        "small_multiples",
    )
