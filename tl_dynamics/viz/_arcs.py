"""``arc_diagram``: token positions as nodes on a line, arcs between them (inline SVG, no script)."""

from __future__ import annotations

from typing import Sequence

from tl_dynamics.viz._component import Component, html_escape, visible_token

MAX_NODES = 64  # positions drawn: those the arcs touch, with neighbours, at most this many
STEP = 34.0  # pixels between nodes


def _shown(n: int, arcs: Sequence[tuple[int, int, float, str]]) -> list[int]:
    """The positions drawn: every arc's ends and their neighbours, then the rest in order, at
    most ``MAX_NODES``."""
    keep = {p + d for a, b, _, _ in arcs for p in (a, b) for d in (-1, 0, 1)}
    chosen = sorted(p for p in keep if 0 <= p < n)
    rest = [p for p in range(n) if p not in keep]
    return sorted(chosen + rest[: max(0, MAX_NODES - len(chosen))])[:MAX_NODES]


def arc_diagram(
    tokens: Sequence[str],
    arcs: Sequence[tuple[int, int, float, str]],
    title: str = "",
    caption: str = "",
) -> Component:
    """Token positions as nodes on a line, and arcs between them (an inline SVG view).

    Each node is labelled with its (escaped) token; each arc runs from one position to another,
    its width the weight (0..1), its hover text the label.

    Args:
        tokens: the token of each position.
        arcs: ``(from, to, weight, label)``.
        title: drawn above.
        caption: text under the view.

    Returns:
        A ``Component`` of kind ``"arc_diagram"`` (inline SVG).

    Example:
        >>> view = arc_diagram(["a", "<b>", "c"], [(0, 2, 0.8, "L1H0 attends")], title="t")
        >>> "&lt;b&gt;" in view.html and "<title>L1H0 attends</title>" in view.html
        True
    """
    nodes = _shown(len(tokens), arcs)
    x = {p: 20.0 + STEP * i for i, p in enumerate(nodes)}
    height, base = 190.0, 150.0
    width = 40.0 + STEP * max(len(nodes) - 1, 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="tld-arcs" width="{width:.0f}" '
        f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}">',
        f'<text x="4" y="14" font-size="12" font-weight="bold">{html_escape(title)}</text>',
    ]
    for a, b, weight, label in arcs:
        if a not in x or b not in x:
            continue
        x0, x1 = x[a], x[b]
        rise = min(base - 24.0, 18.0 + 0.5 * abs(x1 - x0))
        w = 1.0 + 6.0 * max(0.0, min(1.0, float(weight)))
        parts.append(
            f'<path d="M {x0:.1f} {base:.1f} Q {(x0 + x1) / 2:.1f} {base - 2 * rise:.1f} '
            f'{x1:.1f} {base:.1f}" fill="none" stroke="#b2182b" stroke-opacity="0.7" '
            f'stroke-width="{w:.1f}"><title>{html_escape(label)}</title></path>'
        )
    for p in nodes:
        tok = html_escape(visible_token(tokens[p]))
        parts.append(
            f'<circle cx="{x[p]:.1f}" cy="{base:.1f}" r="3" fill="#333">'
            f"<title>{p}: {tok}</title></circle>"
            f'<text x="{x[p]:.1f}" y="{base + 14:.1f}" font-size="10" text-anchor="middle">'
            f"{tok[:6]}</text>"
            f'<text x="{x[p]:.1f}" y="{base + 26:.1f}" font-size="8" fill="#777" '
            f'text-anchor="middle">{p}</text>'
        )
    parts.append("</svg>")
    return Component(html="".join(parts), caption=caption, kind="arc_diagram")
