"""Token-level composition circuits: virtual weights through earlier heads.

A later head ``h2`` reads, at the key (K), query (Q) or value (V) side, what earlier heads
``h1`` wrote from the token they attended to. Summing the paths through a set of earlier
heads (each assumed to attend fully to one token ``B``):

    K: query token A -> c (E_A W_Q + b_Q) R;   key from B -> sum_h1 (E_B W_V1 + b_V1) W_O1 W_K + b_K
    Q: query from B -> c (sum_h1 (E_B W_V1 + b_V1) W_O1 W_Q + b_Q) R;   key token A -> E_A W_K + b_K
    V: source from B -> (sum_h1 (E_B W_V1 + b_V1) W_O1 W_V + b_V) W_O W_U  (logits)

For an induction circuit the earlier heads are previous-token heads: the K-path scores query
token ``A`` against keys whose *previous* token is ``B``, and the induction head should prefer
``B = A``. ``TokenComposition.fraction`` is the share of tokens whose best-scoring key (or
output) is their own.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, Sequence

from jaxtyping import Int
from torch import Tensor
from transformer_lens import FactoredMatrix

from tl_dynamics import viz
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.circuits import _topk
from tl_dynamics.circuits._build import (
    checked_head,
    keys,
    latent_notes,
    norm_note,
    qk_notes,
    queries,
    rotation,
    values,
)
from tl_dynamics.circuits._circuit import Circuit
from tl_dynamics.circuits._labels import labels, vocabulary
from tl_dynamics.errors import TLDynamicsError

PATHS = ("K", "Q", "V")


def _earlier(
    adapter, earlier: Sequence[tuple[int, int]], later_layer: int
) -> tuple[tuple[int, int], ...]:
    if not earlier:
        raise TLDynamicsError("earlier must name at least one (layer, head) before the later head")
    out = []
    for item in earlier:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TLDynamicsError(f"earlier heads must be (layer, head) pairs, got {item!r}")
        layer, head = checked_head(adapter, int(item[0]), int(item[1]))
        if layer >= later_layer:
            raise TLDynamicsError(
                f"earlier head L{layer}H{head} is not before the later head's "
                f"layer {later_layer} (valid earlier layers: 0..{later_layer - 1})"
            )
        out.append((layer, head))
    return tuple(out)


def _through(adapter, earlier, rows: Tensor, into: Tensor, biases: bool) -> Tensor:
    """``sum_h1 (rows W_V1 + b_V1) W_O1 @ into`` for ``into`` ``[d_model, d_head2]``."""
    terms = (
        values(adapter, layer, head, rows, biases) @ (adapter.W_O(layer)[head] @ into)
        for layer, head in earlier
    )
    return functools.reduce(operator.add, terms)  # earlier is never empty (_earlier)


def composition_circuit(
    model: Any,
    path: str,
    later: tuple[int, int],
    earlier: Sequence[tuple[int, int]],
    biases: bool = True,
    offset: int | None = None,
) -> Circuit:
    """The token x token circuit of ``later`` with one side read through ``earlier`` heads.

    ``path="K"``: rows are query tokens, columns the token the earlier heads moved into the key
    position; ``"Q"``: rows are the token moved into the query position, columns key tokens;
    ``"V"``: rows are the moved source token, columns output tokens (logits).

    Example:
        >>> from tl_dynamics import zoo
        >>> m = zoo.load("induction-2l")
        >>> c = composition_circuit(m, "K", (1, 2), [(0, h) for h in range(4)])
        >>> c.own_best_fraction() > 0.9
        True
    """
    adapter = ModelAdapter.of(model)
    if path not in PATHS:
        raise TLDynamicsError(f"path {path!r} is not valid; valid: {list(PATHS)}")
    layer, head = checked_head(adapter, *later)
    via = _earlier(adapter, earlier, layer)
    E = adapter.W_E
    if path == "V":
        if offset is not None:
            raise TLDynamicsError("offset applies to the K and Q paths only")
        A = _through(adapter, via, E, adapter.W_V(layer)[head], biases)
        if biases:
            A = A + adapter.b_V(layer)[head]
        B = adapter.W_O(layer)[head] @ adapter.W_U
        notes = [
            f"b_V of every head {'included' if biases else 'left out'}; b_O, b_U and the "
            "final LayerNorm left out.",
            norm_note(adapter),
            *latent_notes(adapter, [layer, *(l for l, _ in via)], "OV"),
        ]
        return Circuit(
            "V-composition OV",
            layer,
            head,
            FactoredMatrix(A, B),
            "token",
            "output token",
            None,
            tuple(notes),
            adapter.info.architecture,
            via,
            vocabulary(adapter),
        )
    rot, offset = rotation(adapter, layer, offset)
    spec = adapter.specs[layer]
    if path == "K":
        A = queries(adapter, layer, head, E, biases, rot)
        B = _through(adapter, via, E, adapter.W_K(layer)[head], biases)
        B = B + adapter.b_K(layer)[head] if biases else B
    else:
        q = _through(adapter, via, E, adapter.W_Q(layer)[head], biases)
        q = q + adapter.b_Q(layer)[head] if biases else q
        A = q * spec.scale if rot is None else (q * spec.scale) @ rot
        B = keys(adapter, layer, head, E, biases)
    notes = qk_notes(adapter, layer, biases, offset)
    notes.append(
        f"Earlier heads {', '.join(f'L{l}H{h}' for l, h in via)} are each taken to "
        "attend fully to the moved token; b_V included with the biases, b_O left out."
    )
    return Circuit(
        f"{path}-composition QK",
        layer,
        head,
        FactoredMatrix(A, B.T),
        "token",
        "token",
        offset,
        tuple(notes),
        adapter.info.architecture,
        via,
        vocabulary(adapter),
    )


@dataclass(frozen=True)
class TokenComposition(viz.Result):
    """How often a token-level composition circuit picks each token's own match."""

    path: str
    circuit: Circuit
    rows: Int[Tensor, " n"]
    best: Int[Tensor, " n"]
    fraction: float
    chance: float

    def __repr__(self) -> str:
        return (
            f"TokenComposition({self.circuit.name}: own match best for "
            f"{self.fraction:.1%} of {len(self.rows)} tokens, chance {self.chance:.1%})"
        )

    def summary(self) -> str:
        side = {"K": "key", "Q": "query-side token", "V": "output"}[self.path]
        return (
            f"{self.circuit.name}: for {self.fraction:.1%} of {len(self.rows)} tokens the best "
            f"{side} is the token's own match (chance: {self.chance:.1%})."
        )

    def to_dataframe(self):
        import pandas as pd

        vocab = self.circuit.vocab
        return pd.DataFrame(
            dict(
                token=self.rows.numpy(),
                token_label=labels("token", self.rows, vocab),
                best=self.best.numpy(),
                best_label=labels("token", self.best, vocab),
                own=(self.best == self.rows).numpy(),
            )
        )

    def show(self, rows: int = 20) -> viz.Group:
        """The verdict and the top-k view of the first ``rows`` tokens."""
        return viz.group(
            viz.text(self.summary()),
            self.circuit.topk(7, self.rows[:rows]).show(),
            caption=self.circuit.name,
        )


def token_composition(
    model: Any,
    path: str,
    later: tuple[int, int],
    earlier: Sequence[tuple[int, int]],
    rows: Sequence[int] | Tensor | None = None,
    biases: bool = True,
    offset: int | None = None,
) -> TokenComposition:
    """How often a token-level composition circuit picks each token's own match.

    The token x token circuit of ``later`` with one side read through the ``earlier`` heads
    (each taken to attend fully to the moved token), and the share of ``rows`` whose best
    column is their own token, streamed over the vocabulary. ``path="K"``: rows are query
    tokens, columns the token the earlier heads moved into the key position; ``"Q"``: rows are
    the token moved into the query position, columns key tokens; ``"V"``: rows are the moved
    source token, columns output tokens (logits).

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        path: ``"K"``, ``"Q"`` or ``"V"``.
        later: the later head as ``(layer, head)``.
        earlier: the earlier heads as ``(layer, head)`` pairs, all in layers before ``later``.
        rows: ``[n]`` token ids to read (None: the whole vocabulary).
        biases: include the heads' biases.
        offset: rotary layers, K and Q paths only: query minus key position.

    Returns:
        ``TokenComposition``: ``fraction`` of rows whose best column is their own token, the
        ``chance`` level, ``best`` ``[n]`` and the ``circuit``.

    Example:
        >>> from tl_dynamics import circuits, zoo
        >>> tc = circuits.token_composition(zoo.load("induction-2l"), "K", (1, 2),
        ...                                 [(0, h) for h in range(4)])
        >>> tc.fraction > 0.9 > 0.1 > tc.chance
        True
    """
    circuit = composition_circuit(model, path, later, earlier, biases, offset)
    fraction, best, ids = _topk.own_best_fraction(circuit.matrix, rows)
    return TokenComposition(
        path, circuit, ids.cpu(), best.cpu(), fraction, 1.0 / circuit.matrix.rdim
    )
