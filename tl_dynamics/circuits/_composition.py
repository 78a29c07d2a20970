"""Q-, K- and V-composition scores for every pair of heads in different layers.

For an earlier head ``h1`` and a later head ``h2`` (row-vector convention):

    Q: |W_OV^h1 W_QK^h2|_F,  K: |W_OV^h1 (W_QK^h2)^T|_F,  V: |W_OV^h1 W_OV^h2|_F,

each divided by ``|W_OV^h1|_F |M^h2|_F``, with ``W_OV = W_V W_O`` and ``W_QK = W_Q W_K^T``
(biases, LayerNorm and rotary rotations left out, as in Elhage et al. 2021). All pairs are
computed at once from Gram matrices, one per head and side: with ``W_OV^h1 = W_V W_O`` and
``S^T S = W_V^T W_V`` (``d_head``-sized), ``|W_OV Y|_F = |S W_O Y|_F``; likewise on the later side; ``|X Y|_F^2 = <X^T X, Y Y^T>``, so a pair costs
one ``d_model^2`` inner product and no ``d_model x d_model`` product is formed per pair.

The baseline is the same score for random matrices of the same shapes: ``BASELINE_SAMPLES``
independent draws (seed ``BASELINE_SEED``) of standard normal factors ``[d_model, d_head]``
and ``[d_head, d_model]`` on each side. A pair is called composing only when its score exceeds
the baseline mean by more than ``CHANCE_Z`` baseline standard deviations; otherwise the score
cannot tell composition from chance. (The Frobenius score is known to miss real circuits: on
one induction model the K-composition of its previous-token and induction heads sat at the
random baseline, 0.089 trained against 0.089 at initialisation; on the shipped ``induction-2l``
it flags the strongest previous-token head but leaves two others that the circuit uses within
the baseline. The token-level circuits in ``token_composition`` separate the whole circuit.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from tl_dynamics import viz
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.circuits._build import latent_notes
from tl_dynamics.circuits._views import Panel, head_labels, heatmaps, symmetric_limits
from tl_dynamics.errors import TLDynamicsError

BASELINE_SAMPLES = 200
BASELINE_SEED = 0
CHANCE_Z = 3.0
KINDS = ("Q", "K", "V")


def left_factors(
    W_V: Float[Tensor, "n d_model d_head"], W_O: Float[Tensor, "n d_head d_model"]
) -> Float[Tensor, "n d_head d_model"]:
    """``X`` with ``X^T X = W_OV^T W_OV``: ``S W_O`` where ``S^T S = W_V^T W_V``."""
    return gram_root(W_V) @ W_O


def right_factors(
    kind: str, W_Q: Tensor, W_K: Tensor, W_V: Tensor, W_O: Tensor
) -> Float[Tensor, "n d_head d_model"]:
    """``X`` with ``X^T X = M M^T``, ``M`` the later head's ``W_QK`` (Q), ``W_QK^T`` (K) or
    ``W_OV`` (V): e.g. ``M = W_Q W_K^T`` gives ``X = S_K W_Q^T`` with ``S_K^T S_K = W_K^T W_K``."""
    if kind == "Q":
        outer, inner = W_Q, W_K
    elif kind == "K":
        outer, inner = W_K, W_Q
    else:
        outer, inner = W_V, W_O.transpose(1, 2)
    return gram_root(inner) @ outer.transpose(1, 2)


def gram_root(W: Float[Tensor, "n d_model d_head"]) -> Float[Tensor, "n d_head d_head"]:
    """``S`` with ``S^T S = W^T W``: the transposed Cholesky factor of the small Gram matrix, or
    ``Lambda^(1/2) U^T`` from its eigendecomposition where it is singular (a QR factor would do,
    but batched QR and float32 ``eigh`` are slow on CPU)."""
    gram = W.transpose(1, 2) @ W
    factor, info = torch.linalg.cholesky_ex(gram)
    root = factor.transpose(1, 2)
    bad = info != 0
    if bad.any():
        lam, U = torch.linalg.eigh(gram[bad].double())
        root[bad] = (lam.clamp_min(0).sqrt()[..., :, None] * U.transpose(1, 2)).to(root.dtype)
    return root


def grams(X: Float[Tensor, "n r d"]) -> Float[Tensor, "n d_d"]:
    """``X^T X`` per head, flattened (one batched product: faster on CPU than forming only
    the blocks above the diagonal)."""
    return (X.transpose(1, 2) @ X).flatten(1)


def pair_scores(
    left: Float[Tensor, "n1 r d"], right: Float[Tensor, "n2 r d"], left_grams: Tensor | None = None
) -> Float[Tensor, "n1 n2"]:
    """Normalised Frobenius norms ``<G_L, G_R>^(1/2) /
    (tr G_L tr G_R)^(1/2)`` with ``G = X^T X``, for every pair of rows of ``left``, ``right``."""
    if left_grams is None:
        left_grams = grams(left)
    inner = left_grams @ grams(right).T
    norms = left.square().sum((1, 2))[:, None] * right.square().sum((1, 2))[None]
    return inner.clamp_min(0).sqrt() / norms.clamp_min(torch.finfo(norms.dtype).tiny).sqrt()


def random_baseline(
    d_model: int, d_head: int, n_samples: int = BASELINE_SAMPLES, seed: int = BASELINE_SEED
) -> Float[Tensor, " n_samples"]:
    """Scores ``|X Y|_F / (|X|_F |Y|_F)`` of independent ``X = A B``, ``Y = C D`` with standard
    normal ``A, C: [d_model, d_head]`` and ``B, D: [d_head, d_model]``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for start in range(0, n_samples, 50):
        n = min(50, n_samples - start)
        a, c = (torch.randn(n, d_model, d_head, generator=gen) for _ in range(2))
        b, d = (torch.randn(n, d_head, d_model, generator=gen) for _ in range(2))
        # |A (B C) D|^2 = tr(G_A M G_D M^T) with M = B C, G_A = A^T A, G_D = D D^T (d_head-sized)
        m = b @ c
        g_a, g_d = a.transpose(1, 2) @ a, d @ d.transpose(1, 2)
        num = (m * (g_a @ m @ g_d)).sum((1, 2))
        den = torch.einsum("nij,nji->n", g_a, b @ b.transpose(1, 2)) * torch.einsum(
            "nij,nji->n", c.transpose(1, 2) @ c, g_d
        )
        out.append((num / den).sqrt())
    return torch.cat(out)


@dataclass(frozen=True)
class CompositionScores(viz.Result):
    """Composition scores ``[kind, layer1, head1, layer2, head2]`` (NaN unless layer1 < layer2),
    against a random baseline of the same shapes.

    ``excess`` is the score minus the baseline mean; ``beyond_chance`` marks the pairs that
    exceed the baseline by more than ``z`` baseline standard deviations: only those can be
    told from chance by this score.
    """

    kinds: tuple[str, ...]
    scores: Float[Tensor, "kind layer1 head1 layer2 head2"]
    baseline_mean: float
    baseline_std: float
    n_samples: int
    seed: int
    z: float
    notes: tuple[str, ...]
    architecture: str

    def __repr__(self) -> str:
        return (
            f"CompositionScores({'/'.join(self.kinds)}, {self.scores.shape[1]} layers x "
            f"{self.scores.shape[2]} heads, baseline {self.baseline_mean:.3f} ± "
            f"{self.baseline_std:.3f})"
        )

    def of(self, kind: str) -> Float[Tensor, "layer1 head1 layer2 head2"]:
        if kind not in self.kinds:
            raise TLDynamicsError(
                f"composition kind {kind!r} was not computed; computed: {list(self.kinds)}"
            )
        return self.scores[self.kinds.index(kind)]

    @property
    def excess(self) -> Tensor:
        return self.scores - self.baseline_mean

    @property
    def beyond_chance(self) -> Tensor:
        return self.excess > self.z * self.baseline_std

    def summary(self) -> str:
        """Plain-language verdict per kind: how many pairs the score can tell from chance."""
        lines = [
            f"Random baseline ({self.n_samples} samples, seed {self.seed}): "
            f"{self.baseline_mean:.4f} ± {self.baseline_std:.4f}."
        ]
        for i, kind in enumerate(self.kinds):
            valid = ~torch.isnan(self.scores[i])
            n_pairs, n_hit = int(valid.sum()), int(self.beyond_chance[i][valid].sum())
            top = float(self.scores[i][valid].max()) if n_pairs else float("nan")
            by_chance = n_pairs * 0.5 * math.erfc(self.z / math.sqrt(2))  # normal tail
            verdict = (
                "this score cannot tell any of them from chance"
                if n_hit == 0
                else f"{n_hit} pair(s) exceed it by more than {self.z:g} standard deviations "
                f"(about {by_chance:.1f} would by chance alone); this score cannot tell "
                f"the other {n_pairs - n_hit} from chance"
            )
            lines.append(f"{kind}-composition: {n_pairs} head pairs, highest {top:.4f}; {verdict}.")
        return "\n".join(lines)

    def to_dataframe(self):
        import pandas as pd

        idx = (~torch.isnan(self.scores)).nonzero().tolist()
        rows = [
            dict(
                kind=self.kinds[k],
                layer1=l1,
                head1=h1,
                layer2=l2,
                head2=h2,
                score=float(self.scores[k, l1, h1, l2, h2]),
            )
            for k, l1, h1, l2, h2 in idx
        ]
        frame = pd.DataFrame(rows, columns=["kind", "layer1", "head1", "layer2", "head2", "score"])
        frame["baseline_mean"], frame["baseline_std"] = self.baseline_mean, self.baseline_std
        frame["excess"] = frame["score"] - self.baseline_mean
        frame["z"] = frame["excess"] / self.baseline_std
        frame["beyond_chance"] = frame["z"] > self.z
        return frame

    def show(self) -> viz.Component:
        """Heat maps of score minus baseline, earlier heads (rows) by later heads (columns)."""
        return heatmaps(self.panels(), caption=self.summary().replace("\n", " "))

    def panels(self) -> list[Panel]:
        n_layers, n_heads = self.scores.shape[1], self.scores.shape[2]
        rows, cols = list(range(n_layers - 1)), list(range(1, n_layers))
        blocks = [
            self.excess[i][rows][:, :, cols]
            .reshape(len(rows) * n_heads, len(cols) * n_heads)
            .numpy()
            for i in range(len(self.kinds))
        ]
        limits = symmetric_limits(blocks)  # one colour scale for all kinds
        return [
            Panel(
                f"{kind}-composition minus baseline",
                block,
                head_labels(rows, n_heads),
                head_labels(cols, n_heads),
                "later head",
                "earlier head",
                limits,
            )
            for kind, block in zip(self.kinds, blocks)
        ]


def composition_scores(
    model: Any,
    kinds: Sequence[str] = KINDS,
    n_samples: int = BASELINE_SAMPLES,
    seed: int = BASELINE_SEED,
    z: float = CHANCE_Z,
    progress: bool = False,
) -> CompositionScores:
    """Q-, K- and V-composition scores of all head pairs across layers, vectorised.

    Frobenius composition scores (Elhage et al. 2021) of every earlier head into every later
    head, beside a random baseline of heads of the same shapes; ``summary()`` says which pairs
    clear it by ``z`` standard deviations.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        kinds: which of ``"Q"``, ``"K"``, ``"V"`` to score.
        n_samples: random-baseline samples.
        seed: seed of the random baseline.
        z: standard deviations above the baseline mean that count as composition.
        progress: show a progress bar.

    Returns:
        ``CompositionScores``: ``scores`` ``[kind, n_layers, n_heads, n_layers, n_heads]`` (NaN
        where the pair is not earlier-to-later), the baseline mean and standard deviation.

    Example:
        >>> from tl_dynamics import circuits, zoo
        >>> comp = circuits.composition_scores(zoo.load("induction-2l"), n_samples=20)
        >>> comp.scores.shape
        torch.Size([3, 2, 4, 2, 4])
        >>> print(comp.summary().splitlines()[2])  # doctest: +ELLIPSIS
        K-composition: 16 head pairs, highest ...
    """
    adapter = ModelAdapter.of(model)
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise TLDynamicsError(
            f"composition kinds {bad or list(kinds)!r} are not valid; valid: {list(KINDS)}"
        )
    if not isinstance(n_samples, int) or n_samples < 2:
        raise TLDynamicsError(f"n_samples={n_samples!r}: the baseline needs at least 2 samples")
    L, H = adapter.n_layers, adapter.n_heads
    scores = torch.full((len(kinds), L, H, L, H), float("nan"))
    att = adapter.attention_layers  # hybrids: pairs of attention layers only (others stay NaN)
    if len(att) > 1:
        W = {
            name: torch.stack([getattr(adapter, name)(l) for l in att])
            for name in ("W_Q", "W_K", "W_V", "W_O")
        }
        left = left_factors(W["W_V"][:-1].flatten(0, 1), W["W_O"][:-1].flatten(0, 1))
        left_g = grams(left)
        for i2 in tqdm(range(1, len(att)), desc="composition", disable=not progress, leave=False):
            weights = [W[name][i2] for name in ("W_Q", "W_K", "W_V", "W_O")]
            sides = [right_factors(kind, *weights) for kind in kinds]
            rank = max(side.shape[1] for side in sides)  # latent attention: q/k wider than v
            right = torch.cat(
                [torch.nn.functional.pad(side, (0, 0, 0, rank - side.shape[1])) for side in sides]
            )  # zero rows leave X^T X unchanged
            block = pair_scores(left[: i2 * H], right, left_g[: i2 * H])  # [i2*H, kinds*H]
            per = block.reshape(i2, H, len(kinds), H).permute(2, 0, 1, 3).cpu()  # [kinds, i2, H, H]
            for i1 in range(i2):
                scores[:, att[i1], :, att[i2], :] = per[:, i1]
            del right, block
    width = adapter.W_V(att[0]).shape[-1] if att else adapter.d_head  # the heads' value width
    base = random_baseline(adapter.d_model, width, n_samples, seed)
    notes = (
        "Weights only: biases, LayerNorm and rotary rotations are left out.",
        f"Random baseline: {n_samples} draws (seed {seed}) of standard normal factors of the "
        f"same shapes; for pairs within {z:g} baseline standard deviations of it the score cannot tell composition from chance.",
        "A Frobenius score near the baseline does not rule composition out: it weighs every "
        "direction equally; check token-level circuits (token_composition).",
        *latent_notes(adapter, att),
    )
    if att and adapter.W_Q(att[0]).shape[-1] != width:
        notes += (
            f"The baseline's factors are {width} wide (the value width); the query/key "
            f"factors of these latent-attention heads are {adapter.W_Q(att[0]).shape[-1]} "
            "wide (a random pair's mean score depends on d_model only).",
        )
    return CompositionScores(
        kinds,
        scores,
        float(base.mean()),
        float(base.std()),
        n_samples,
        seed,
        float(z),
        notes,
        adapter.info.architecture,
    )
