"""Copying (OV) and positivity (QK) scores for every head, from ``d_head x d_head`` factors.

For ``M = E W B`` (``E``: the embedding rows, ``[d_vocab, d_model]``) the nonzero eigenvalues
of the vocabulary-sized circuit equal those of the small factor, computed here without any
vocabulary-sized product: ``(E^T E)`` or ``(W_U E)`` (``d_model x d_model``) is formed once and
shared by every head. Biases enter through a column of ones appended to ``E``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from jaxtyping import Complex, Float
from torch import Tensor
from transformer_lens import FactoredMatrix

from tl_dynamics import viz
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.circuits._build import latent_notes, norm_note, rotation
from tl_dynamics.circuits._circuit import positivity
from tl_dynamics.circuits._composition import CHANCE_Z
from tl_dynamics.circuits._views import Panel, heatmaps
from tl_dynamics.errors import TLDynamicsError

# Random heads for the chance level of a positivity score (seeded: the same every call).
CHANCE_SAMPLES = 200
CHANCE_SEED = 0


def positivity_baseline(
    spectrum: Float[Tensor, " n"],
    d_head: int,
    n_samples: int = CHANCE_SAMPLES,
    seed: int = CHANCE_SEED,
) -> Float[Tensor, " n_samples"]:
    """Positivity of random heads reading the model's own embedding product ``G`` (``W_U E``
    for copying, ``E^T E`` for QK): the spectrum of ``B G A`` for independent standard normal
    ``A: [., d_head]``, ``B: [d_head, .]``. Rotating Gaussian factors leaves them Gaussian, so
    only ``G``'s singular values (``spectrum``) matter: ``B diag(spectrum) A``. Symmetric about
    0 (``B -> -B`` flips it); wider when ``G`` has few large directions. docs/math.md §4.3.

    Example:
        >>> import torch
        >>> base = positivity_baseline(torch.ones(32), 8, n_samples=100)
        >>> base.shape, bool(base.abs().max() < 1)
        (torch.Size([100]), True)
    """
    gen = torch.Generator().manual_seed(seed)
    sv = spectrum.detach().double().cpu()
    a = torch.randn(n_samples, len(sv), d_head, generator=gen, dtype=torch.float64)
    b = torch.randn(n_samples, d_head, len(sv), generator=gen, dtype=torch.float64)
    return positivity(torch.linalg.eigvals((b * sv) @ a)).float()


@dataclass(frozen=True)
class HeadScores(viz.Result):
    """One score per head (``[len(layers), n_heads]``) with each head's spectrum.

    ``kind`` is ``"OV copying"`` (``sum(Re lambda)/sum(|lambda|)`` of ``W_E W_V W_O W_U``;
    near 1: the head copies the token it attends to into the logits) or ``"QK positivity"``
    (the same for ``W_E W_Q W_K^T W_E^T``; near 1: tokens attend to themselves).
    """

    kind: str
    layers: tuple[int, ...]
    scores: Float[Tensor, "layer head"]
    eigenvalues: Complex[Tensor, "layer head d_head"]
    offset: int | None
    notes: tuple[str, ...]
    architecture: str
    chance: float | None = None

    def __repr__(self) -> str:
        return f"HeadScores({self.kind}, layers {list(self.layers)}, heads {self.scores.shape[1]})"

    def score(self, layer: int, head: int) -> float:
        if layer not in self.layers:
            raise TLDynamicsError(
                f"layer {layer} was not scored; scored layers: {list(self.layers)}"
            )
        return float(self.scores[self.layers.index(layer), head])

    def best(self, layer: int) -> int:
        """The head of ``layer`` with the highest score (whether or not it clears ``chance``:
        see ``beyond_chance``)."""
        if layer not in self.layers:
            raise TLDynamicsError(
                f"layer {layer} was not scored; scored layers: {list(self.layers)}"
            )
        return int(self.scores[self.layers.index(layer)].argmax())

    def beyond_chance(self, layer: int, head: int) -> bool:
        """Whether the head's score is positive beyond ``chance``: the mean plus ``CHANCE_Z``
        standard deviations of random heads' scores (``positivity_baseline``; docs/math.md §4.3).
        Only such a head copies (OV) or attends to its own token (QK)."""
        return self.chance is not None and self.score(layer, head) > self.chance

    def verdict(self, layer: int) -> str:
        """One sentence on the best head of ``layer``, naming it only if it clears chance."""
        head = self.best(layer)
        value, does = (
            self.score(layer, head),
            (
                "copies the token it attends to"
                if self.kind == "OV copying"
                else "attends to its own token"
            ),
        )
        if self.beyond_chance(layer, head):
            return (
                f"L{layer}H{head} has the highest {self.kind} score in layer {layer} "
                f"({value:.3f}, above the chance level {self.chance:.3f}): it {does}."
            )
        if self.chance is None:
            return f"L{layer}H{head}: {self.kind} score {value:.3f} (no chance level computed)."
        return (
            f"No head in layer {layer} {does}: the highest {self.kind} score is {value:.3f} "
            f"(L{layer}H{head}), not above the chance level {self.chance:.3f} of random heads."
        )

    def to_dataframe(self):
        import pandas as pd

        rows = []
        for i, layer in enumerate(self.layers):
            for head in range(self.scores.shape[1]):
                lam = self.eigenvalues[i, head]
                rows.append(
                    dict(
                        layer=layer,
                        head_index=head,
                        score=float(self.scores[i, head]),
                        trace=float(lam.real.sum()),
                        abs_sum=float(lam.abs().sum()),
                        largest_abs_eigenvalue=float(lam.abs().max()),
                    )
                )
        frame = pd.DataFrame(rows)
        frame.attrs.update(kind=self.kind, offset=self.offset)
        return frame

    def show(self) -> viz.Component:
        """Heat map of the scores, layers by heads, from -1 to 1."""
        return heatmaps([self.panel()], caption=f"{self.kind} per head: sum(Re λ)/sum(|λ|)")

    def panel(self) -> Panel:
        return Panel(
            self.kind,
            self.scores.numpy(),
            [f"L{l}" for l in self.layers],
            [f"H{h}" for h in range(self.scores.shape[1])],
            "head",
            "layer",
            (-1.0, 1.0),
        )


def chance_level(gram: Tensor, d_head: int) -> float:
    """``mean + CHANCE_Z * std`` of ``positivity_baseline`` for the embedding product ``gram``."""
    base = positivity_baseline(torch.linalg.svdvals(gram.detach().double().cpu()), d_head)
    return float(base.mean() + CHANCE_Z * base.std())


def _embedding(adapter, biases: bool) -> Tensor:
    E = adapter.W_E
    return (
        torch.cat([E, torch.ones(E.shape[0], 1, dtype=E.dtype, device=E.device)], dim=1)
        if biases
        else E
    )


def _augmented(weight: Tensor, bias: Tensor, biases: bool) -> Tensor:
    """``[head, d_model (+1), d_head]``: the bias as an extra input row."""
    return torch.cat([weight, bias[:, None, :]], dim=1) if biases else weight


def _checked_layers(adapter, layers: int | Sequence[int] | None) -> list[int]:
    return adapter.check_attention_layers(layers)


def copying_scores(
    model: Any, layers: int | Sequence[int] | None = None, biases: bool = True, chance: bool = True
) -> HeadScores:
    """OV copying score of every head: eigenvalue positivity of ``W_E W_V W_O W_U``.

    Computed from its ``d_head x d_head`` factor ``W_O (W_U W_E) W_V`` (no vocabulary-sized
    matrix is formed). ``chance=False`` skips the chance level (``CHANCE_SAMPLES`` random heads;
    most of the cost on small models): ``.chance`` is None.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        layers: a layer index, a list of them, or None (all attention layers).
        biases: include ``b_V``.
        chance: also compute the chance level of the score.

    Returns:
        ``HeadScores``: ``scores`` ``[n_layers_selected, n_heads]`` in ``[-1, 1]`` (+1 copies),
        the eigenvalues, notes and the chance level.

    Example:
        >>> from tl_dynamics import circuits, zoo
        >>> scores = circuits.copying_scores(zoo.load("induction-2l"), chance=False)
        >>> scores.scores.shape, bool(scores.scores[1].min() > 0.9)  # the induction heads copy
        (torch.Size([2, 4]), True)
    """
    adapter = ModelAdapter.of(model)
    layers = _checked_layers(adapter, layers)
    key = ("copying_scores", tuple(layers), bool(biases), bool(chance))
    return adapter.memo(key, lambda: _copying_scores(adapter, layers, biases, chance))


def _copying_scores(
    adapter: ModelAdapter, layers: list[int], biases: bool, chance: bool
) -> HeadScores:
    E = _embedding(adapter, biases)
    if adapter.W_U.shape[1] != E.shape[0]:
        raise TLDynamicsError(
            f"the copying score needs the unembedding to cover the embedding's "
            f"vocabulary: W_E has {E.shape[0]} rows, W_U has "
            f"{adapter.W_U.shape[1]} columns"
        )
    UE = adapter.W_U @ E  # [d_model, d_model (+1)]
    eig = []
    for layer in layers:
        A = _augmented(adapter.W_V(layer), adapter.b_V(layer), biases)
        B = adapter.W_O(layer) @ UE
        eig.append(FactoredMatrix(A, B).eigenvalues)
    eig = torch.stack(eig).cpu()
    notes = (
        f"b_V {'included' if biases else 'left out'}; b_O, b_U and the final LayerNorm left out.",
        norm_note(adapter),
        *latent_notes(adapter, layers, "OV"),
    )
    width = adapter.W_V(layers[0]).shape[-1]  # d_head (the value width on latent attention)
    return HeadScores(
        "OV copying",
        tuple(layers),
        positivity(eig),
        eig,
        None,
        notes,
        adapter.info.architecture,
        chance_level(UE, width) if chance else None,
    )


def qk_positivity_scores(
    model: Any,
    layers: int | Sequence[int] | None = None,
    offset: int | None = None,
    biases: bool = True,
    chance: bool = True,
) -> HeadScores:
    """Positivity of every head's full QK circuit ``W_E W_Q R_offset W_K^T W_E^T``.

    Computed from ``W_K^T (W_E^T W_E) W_Q R`` (rotary layers: at ``offset``, 0 by default); +1
    means a head attends to the same token.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        layers: a layer index, a list of them, or None (all attention layers).
        offset: rotary layers only: query position minus key position (None: 0).
        biases: include ``b_Q`` and ``b_K``.
        chance: also compute the chance level (as in ``copying_scores``).

    Returns:
        ``HeadScores``: ``scores`` ``[n_layers_selected, n_heads]`` in ``[-1, 1]``.

    Example:
        >>> from tl_dynamics import circuits, zoo
        >>> scores = circuits.qk_positivity_scores(zoo.load("induction-2l"), layers=0, chance=False)
        >>> scores.scores.shape, scores.layers
        (torch.Size([1, 4]), (0,))
    """
    adapter = ModelAdapter.of(model)
    layers = _checked_layers(adapter, layers)
    key = ("qk_positivity_scores", tuple(layers), offset, bool(biases), bool(chance))
    return adapter.memo(key, lambda: _qk_positivity_scores(adapter, layers, offset, biases, chance))


def _qk_positivity_scores(
    adapter: ModelAdapter, layers: list[int], offset: int | None, biases: bool, chance: bool
) -> HeadScores:
    E = _embedding(adapter, biases)
    gram = E.T @ E
    eig, used = [], None
    for layer in layers:
        rot, used_here = rotation(adapter, layer, offset)
        used = used_here if used_here is not None else used
        scale = adapter.specs[layer].scale
        A = _augmented(adapter.W_Q(layer), adapter.b_Q(layer), biases) * scale
        A = A if rot is None else A @ rot
        B = _augmented(adapter.W_K(layer), adapter.b_K(layer), biases).transpose(1, 2) @ gram
        eig.append(FactoredMatrix(A, B).eigenvalues)
    eig = torch.stack(eig).cpu()
    notes = [f"b_Q, b_K {'included' if biases else 'left out'}.", norm_note(adapter)]
    if used is not None:
        notes.append(f"Rotary layers at offset {used} (query minus key position).")
    if any(adapter.specs[l].qk_norm for l in layers):
        notes.append("q/k normalisation (qk_norm) is left out of the bilinear circuit.")
    notes += latent_notes(adapter, layers)
    width = adapter.W_Q(layers[0]).shape[-1]  # d_head (nope + rope on latent attention)
    return HeadScores(
        "QK positivity",
        tuple(layers),
        positivity(eig),
        eig,
        used,
        tuple(notes),
        adapter.info.architecture,
        chance_level(gram, width) if chance else None,
    )
