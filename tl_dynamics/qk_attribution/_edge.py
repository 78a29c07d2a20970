"""``EdgeExplanation``: the chain of causes of one attention edge, its sentence, table and view;
``shape_of``: the chain's shape, the same for edges that work the same way (docs/math.md §10.8)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from tl_dynamics import viz
from tl_dynamics.qk_attribution._chain import Link

OWN_KINDS = ("embedding", "mlp")  # components read from their own position alone


def _top(link: Link) -> int:
    return link.ranked()[0]


def _carried(link: Link, side: str, at: int) -> str:
    """Where the leading part of a side's link comes from, in relative terms: ``"the token at
    src"`` (an embedding or MLP there), ``"L0H0 <- the token at src-1"`` (a head whose leading
    source's leading part is one), or the leading part's kind."""
    i = _top(link)
    kind, layer, head, n = link.keys[i]
    where = side if n == at else f"{side}{n - at:+d}"
    if kind in OWN_KINDS:
        return f"the token at {where}"
    if kind == "head" and i in link.children:
        child = link.children[i]
        j = _top(child)
        ckind, _, _, m = child.keys[j]
        if ckind == "source" and j in child.children:
            inner = _carried(child.children[j], side, at)
            return f"L{layer}H{head} <- {inner}"
        return f"L{layer}H{head} <- {ckind}"
    return kind


def shape_of(key: Link, query: Link, src: int, dest: int) -> str:
    """The chain's shape: what leads the key and the query, positions relative to the edge
    (``"key: L0H0 <- the token at src-1 | query: the token at dest"``)."""
    return f"key: {_carried(key, 'src', src)} | query: {_carried(query, 'dest', dest)}"


@dataclass(frozen=True)
class EdgeExplanation(viz.Result):
    """Why one head attends from ``dest`` to ``src``: the key-side and query-side links of the
    score's lift over the row's average key (both total ``numbers["lift"]``), each expanded back
    through the heads among its leaders (``Link.children``). ``numbers``: the ``score`` (with the
    position term), its ``lift``, the ``attention``. Made by ``qk_attribution.explain``."""

    layer: int
    head: int
    dest: int
    src: int
    tokens: tuple[str, ...]
    key: Link
    query: Link
    numbers: dict[str, float]

    def links(self):
        """Every link of the chain, the key side's then the query side's."""
        yield from self.key.walk()
        yield from self.query.walk()

    @property
    def shape(self) -> str:
        """``shape_of`` this edge's chain."""
        return shape_of(self.key, self.query, self.src, self.dest)

    def _side(self, link: Link, what: str) -> str:
        i = _top(link)
        name, _ = link.parts[i]
        text = f"{what} is led by {name} ({link.share(i):.2f} of the lift)"
        if i in link.children:
            child = link.children[i]
            j = _top(child)
            text += f", which moved there what it read {child.parts[j][0]}"
            text += f" ({child.share(j):.2f} of its part)"
            if j in child.children:
                grand = child.children[j]
                g = _top(grand)
                text += f": mostly {grand.parts[g][0]} ({grand.share(g):.2f})"
        return text

    @property
    def sentence(self) -> str:
        """The chain in words, from the same links as the table."""
        t = self.tokens
        return (
            f"L{self.layer}H{self.head} attends from {t[self.dest]!r} ({self.dest}) to "
            f"{t[self.src]!r} ({self.src}) with {self.numbers['attention']:.2f} of its attention "
            f"(score {self.numbers['score']:.2f}, {self.numbers['lift']:.2f} above the row's "
            f"average key). {self._side(self.key, 'The key')}. "
            f"{self._side(self.query, 'The query')}."
        )

    def to_dataframe(self) -> pd.DataFrame:
        """One row per part of every link: the side, the link (``what``), its ``total``, the
        ``part``, its ``value`` and ``share`` of the total, and the link's ``error``."""
        rows = []
        for side, root in (("key", self.key), ("query", self.query)):
            for link in root.walk():
                for (part, value), key in zip(link.parts, link.keys):
                    rows.append(
                        dict(
                            side=side,
                            what=link.label,
                            total=link.total,
                            part=part,
                            kind=key[0],
                            position=key[3],
                            value=value,
                            share=value / link.total if link.total else np.nan,
                            error=link.error,
                        )
                    )
        return pd.DataFrame(rows)

    def _arcs(self) -> list[tuple[int, int, float, str]]:
        """``(from, to, weight, hover)``: the edge itself, then each expanded head's leading
        source moving its value into the position the link reads."""
        arcs = [
            (
                self.src,
                self.dest,
                self.numbers["attention"],
                f"L{self.layer}H{self.head}: {self.numbers['attention']:.2f} of its attention",
            )
        ]
        for side, root in (("key", self.key), ("query", self.query)):
            for link in root.walk():
                for i, child in link.children.items():
                    if link.keys[i][0] != "head":
                        continue
                    _, layer, head, at = link.keys[i]
                    j = _top(child)
                    kind, _, _, m = child.keys[j]
                    if kind == "source":
                        share = link.share(i)
                        arcs.append(
                            (m, at, abs(share) if np.isfinite(share) else 0.0,
                             f"L{layer}H{head} moved {self.tokens[m]!r} ({m}) to {at}: "
                             f"{share:.2f} of the {side}-side lift")
                        )  # fmt: skip
        return arcs

    def show(self) -> viz.Group:
        """The sentence, the positions as a graph (arcs weighted by share, hover naming each
        component) and the table of every link."""
        frame = self.to_dataframe()
        order = np.argsort(-frame["value"].abs().to_numpy(), kind="stable")
        return viz.group(
            viz.text(self.sentence),
            viz.arc_diagram(
                list(self.tokens),
                self._arcs(),
                title=f"L{self.layer}H{self.head}: {self.dest} -> {self.src}",
                caption=(
                    "Positions as nodes; the edge explained, and each head on the chain moving "
                    "what it read at a source position to the position the link reads (width: "
                    "its share of that side's lift; hover names it). docs/math.md §10.8."
                ),
            ),
            viz.table(
                frame.iloc[order[:40]],
                caption="Every link's largest parts (each link's parts sum to its total)",
            ),
        )
