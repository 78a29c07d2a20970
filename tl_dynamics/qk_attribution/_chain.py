"""The chain of causes of one attention edge, as exact links (docs/math.md §10.8): pure tensors
read from one pass, no model calls.

A quantity read from the stream at position ``n`` through a fixed linear map is a dot product
``x . w`` with a *readout vector* ``w``: the key side of a score ``c <q_i, k_j>`` reads the stream
at ``j`` through ``w = c M_key[j] q_i``, the query side the stream at ``i`` through
``w = c M_query[i] (k_j - k_bar)``. A head's output at ``n`` is a pattern-weighted sum of values,
``o_n = sum_m p_nm v_m W_O``, and each value is the stream at ``m`` through the frozen norm and
``W_V``: so ``o_n . w = sum_m sum_c part_c(m) . w'_m + bias``, with ``w'_m = p_nm M_value[m]
(W_O w)``, exactly. Each ``Link`` is one such split: its parts sum to its total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class Link:
    """One quantity split exactly into parts; ``children`` expand the leading parts further.

    ``parts`` are ``(label, value)``; ``keys`` say what each part is, for the chain's shape:
    ``(kind, layer, head, position)``, kind ``"embedding"``, ``"position"``, ``"head"``, ``"bias"``,
    ``"mlp"``, ``"source"`` (a source position of a head's output), ``"baseline"`` (the row's
    average key, subtracted), ``"value bias"``.
    """

    label: str
    total: float
    parts: tuple[tuple[str, float], ...]
    keys: tuple[tuple[str, int, int, int], ...]
    children: dict[int, "Link"] = field(default_factory=dict)  # part index -> its expansion

    @property
    def error(self) -> float:
        """``|sum(parts) - total|`` relative to the largest of ``|total|`` and the parts."""
        size = max([abs(self.total)] + [abs(v) for _, v in self.parts] + [1e-30])
        return abs(sum(v for _, v in self.parts) - self.total) / size

    def ranked(self) -> list[int]:
        """The parts' indices, largest value first (the baseline and biases included)."""
        return sorted(range(len(self.parts)), key=lambda i: -self.parts[i][1])

    def share(self, i: int) -> float:
        """Part ``i`` over the total (NaN where the total is not positive)."""
        return self.parts[i][1] / self.total if self.total > 0 else float("nan")

    def walk(self):
        """This link and every link under it, depth first."""
        yield self
        for child in self.children.values():
            yield from child.walk()


@dataclass
class Pass:
    """What one pass delivered, for one prompt ``row``: each layer's ``Residual`` (its parts) and
    head maps on demand, the patterns, ``z`` and ``W_O`` of the earlier layers, and names."""

    residual: Callable[[int], Any]  # layer -> Residual
    maps: Callable[[int, int], dict[str, Tensor]]  # (layer, head) -> ResidualSplit.maps
    origins: Callable[[int], tuple[tuple[str, int, int], ...]]  # layer -> part origins
    pattern: dict[int, Tensor]  # layer -> [head, q, k] of prompt ``row``
    gated: dict[int, bool]
    W_O: dict[int, Tensor]  # layer -> [head, d_head, d_model]
    tokens: list[str]
    row: int


def _vector(res, c: int, row: int, n: int) -> Tensor:
    """Part ``c`` of a ``Residual`` at position ``n`` of prompt ``row``, ``[d_model]``."""
    coef, basis = res.coefficients[c][row, n], res.bases[c]
    return coef if basis is None else coef @ basis


def _name(origin: tuple[str, int, int], n: int, tokens: list[str]) -> str:
    kind, layer, head = origin
    tok = repr(tokens[n]) if 0 <= n < len(tokens) else "?"
    if kind == "embedding":
        return f"token embedding of {tok} at {n}"
    if kind == "position":
        return f"positional embedding at {n}"
    if kind == "head":
        return f"L{layer}H{head} output at {n}"
    if kind == "mlp":
        return f"L{layer} MLP output at {n}"
    return f"L{layer} attention bias at {n}"


def stream_link(p: Pass, layer: int, n: int, w: Tensor, label: str, depth: int, top: int) -> Link:
    """``stream(n) . w``, the stream entering ``layer`` at position ``n`` read through ``w``,
    split over the parts that wrote it; at ``depth`` 2 or more, the ``top`` leading head outputs
    expanded (``head_link``)."""
    res = p.residual(layer)
    origins = p.origins(layer)
    values = [float(_vector(res, c, p.row, n) @ w) for c in range(len(origins))]
    total = float(res.stream[p.row, n].float() @ w)
    parts = tuple((_name(o, n, p.tokens), v) for o, v in zip(origins, values))
    keys = tuple((o[0], o[1], o[2], n) for o in origins)
    link = Link(label, total, parts, keys)
    if depth > 1:
        for c in link.ranked()[:top]:
            kind, l2, h2 = origins[c]
            if kind == "head" and not p.gated.get(l2, False):
                link.children[c] = head_link(p, l2, h2, n, w, depth, top, values[c])
    return link


def head_link(
    p: Pass, layer: int, head: int, n: int, w: Tensor, depth: int, top: int, total: float
) -> Link:
    """``o_n . w`` for head ``head`` of ``layer`` at position ``n`` (``total``: that head's part
    of the stream as the parent link read it), split over its source positions (``p_nm v_m W_O .
    w``) and its value bias; the ``top`` leading sources expanded into the parts of the stream
    there (``stream_link``, one depth less)."""
    attn = p.pattern[layer][head, n]  # [k]
    maps = p.maps(layer, head)
    u = p.W_O[layer][head].float() @ w  # [d_head]: the readout of a value
    res = p.residual(layer)
    read = maps["value"][p.row] @ u  # [pos, d_model]: value map then u, per source position
    sources = torch.nonzero(attn > 0).flatten().tolist()
    values = [float(attn[m] * (res.stream[p.row, m].float() @ read[m])) for m in sources]
    bias = float(attn.sum() * (maps["value_bias"] @ u))
    parts = tuple((f"from {repr(p.tokens[m])} at {m}", v) for m, v in zip(sources, values)) + (
        ("value bias", bias),
    )
    keys = tuple(("source", layer, head, m) for m in sources) + (("value bias", layer, head, n),)
    link = Link(f"L{layer}H{head} output at {n}", total, parts, keys)
    # its leading sources, each split over the parts of the stream there
    for i in link.ranked()[:top]:
        if i < len(sources):
            m = sources[i]
            link.children[i] = stream_link(
                p,
                layer,
                m,
                attn[m] * read[m],
                f"L{layer}H{head}'s value at {m}",
                depth - 1,
                top,
            )
    return link
