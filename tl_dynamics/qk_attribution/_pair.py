"""``pair``: one score's full component x component matrix (docs/math.md §10.3, §10.5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, LayerState, ModelAdapter, Prompt, ResidualSplit
from tl_dynamics.collect import Collector
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.qk_attribution import _views
from tl_dynamics.qk_attribution._core import odds_parts, pair_matrix


SAE_SIDES = ("query", "key", "both")


def check_sae_side(sae_side: str) -> str:
    if sae_side not in SAE_SIDES:
        raise TLDynamicsError(
            f"qk_attribution: sae_side {sae_side!r}; valid: {', '.join(map(repr, SAE_SIDES))}"
        )
    return sae_side


def side_residuals(split: ResidualSplit, res: Any, sae_side: str) -> tuple[Any, Any]:
    """The ``Residual`` each side is split by: the split's SAE features on ``sae_side`` (where
    the split has an SAE), the components elsewhere."""
    if split.sae is None:
        return res, res
    feats = split.features(res)
    return (
        feats if sae_side in ("query", "both") else res,
        feats if sae_side in ("key", "both") else res,
    )


def component_labels(
    names: tuple[str, ...], kinds: tuple[str, ...], token: str, pos: int, side: str
) -> list[str]:
    """The components in the researcher's words at one position: ``"token embedding of ' the'"``,
    ``"positional embedding of position 3"``, ``"L0H2 output"``; the last, the side's bias."""
    out = []
    for name in names:
        if name == "token embedding":
            out.append(f"token embedding of '{token}'")
        elif name == "positional embedding":
            out.append(f"positional embedding of position {pos}")
        else:
            out.append(name)
    return out + [f"{side} bias"]


@dataclass(frozen=True)
class PairAttribution(viz.Result):
    """One score ``s_ij`` of one head split over (query component, key component) pairs.

    ``matrix[a, b] = c <Q^a_i, K^b_j>``; ``matrix.sum() + position == raw`` (the pre-cap score;
    ``score`` is after the soft-cap where the layer has one). ``parts`` holds the odds-ratio parts
    per component (``query_term``, ``likelihood_query`` over query components, ``key_prior``,
    ``likelihood_key`` over key components; docs/math.md §10.5).
    """

    layer: int
    head: int
    row: int
    dest: int
    src: int
    dest_token: str
    src_token: str
    query_labels: tuple[str, ...]
    key_labels: tuple[str, ...]
    matrix: np.ndarray
    position: float
    raw: float
    score: float
    softcap: float | None
    parts: dict[str, np.ndarray]

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (query component, key component): its part of the score."""
        A, B = self.matrix.shape
        a, b = np.indices((A, B)).reshape(2, -1)
        return pd.DataFrame(
            dict(
                query_component=np.array(self.query_labels, dtype=object)[a],
                key_component=np.array(self.key_labels, dtype=object)[b],
                score_part=self.matrix.reshape(-1),
            )
        )

    def show(self) -> viz.Component:
        """The component x component map, hover naming both components."""
        cap = (
            f" The layer soft-caps its scores at {self.softcap:g}: the parts add up to the "
            f"pre-cap score {self.raw:.4g} (after the cap: {self.score:.4g})."
            if self.softcap is not None
            else ""
        )
        caption = (
            f"Score of L{self.layer}H{self.head} from destination {self.dest} "
            f"('{self.dest_token}') to source {self.src} ('{self.src_token}'): the parts sum to "
            f"{self.matrix.sum():.4g}, plus the position term {self.position:.4g}, = {self.raw:.4g}."
            f"{cap} docs/math.md §10.3."
        )
        return _views.pair_map(
            self.matrix,
            self.query_labels,
            self.key_labels,
            f"L{self.layer}H{self.head}: score {self.dest} -> {self.src}",
            caption,
        )


class _PairCollector(Collector):
    inputs = True

    def __init__(self, split: ResidualSplit, head: int, sae_side: str):
        self.split, self.head, self.sae_side = split, head, sae_side
        self.layers, self.points = split.layers, split.points
        self.kept: dict[int, dict[str, Any]] = {}
        self.out: dict[str, Any] = {}

    def start_pass(self, batch: Any) -> None:
        self.batch, self.kept = batch, {}

    def on_layer(self, state: LayerState) -> None:
        self.kept[state.layer] = self.split.keep(state)
        if state.layer != self.split.layer or state.attention is None:
            return
        la, res = state.attention, self.split.gather(self.kept, self.batch)
        h = self.head
        bias = la.bias([h])
        qres, kres = side_residuals(self.split, res, self.sae_side)
        self.out = dict(
            Q=self.split.queries(qres, [h])[..., 0, :],
            K=self.split.keys(kres, [h])[..., 0, :],
            names=(qres.names, qres.kinds, kres.names, kres.kinds),
            raw=la.raw_scores([h])[:, 0],
            score=la.scores([h])[:, 0],
            bias=None if bias is None else bias[:, 0].expand(la.allowed.shape),
            allowed=la.allowed,
            scale=la.scale,
            softcap=la.softcap,
        )


def pair(
    model: Any,
    prompt: Prompt | Batch,
    layer: int,
    head: int,
    dest: int,
    src: int,
    *,
    row: int = 0,
    sae: Any = None,
    sae_side: str = "both",
) -> PairAttribution:
    """One score's full component x component matrix (docs/math.md §10.3).

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: anything ``adapter.tokenize`` takes.
        layer: the attention layer.
        head: the head.
        dest: the destination (query) position.
        src: the source (key) position; it must be one the destination may attend to.
        row: the prompt, for a batch of several.
        sae: a SAELens SAE on ``blocks.<layer>.hook_resid_pre``: split ``sae_side`` into its
            active features (``"SAE feature 1234"``), decoder bias and error term instead of
            components, still exactly (docs/math.md §10.7).
        sae_side: ``"query"``, ``"key"`` or ``"both"``.

    Returns:
        A ``PairAttribution``.

    Example:
        >>> from tl_dynamics import qk_attribution, testing
        >>> p = qk_attribution.pair(testing.cached_model("gpt2"), "a b c a b", 1, 0, dest=4, src=2)
        >>> bool(abs(p.matrix.sum() + p.position - p.raw) < 1e-4)
        True
        >>> p.query_labels[0], p.key_labels[2]
        ("token embedding of ' a'", 'L0H0 output')
    """
    adapter = ModelAdapter.of(model)
    layer = adapter.check_attention_layers([layer])[0]
    head = adapter.check_heads([head])[0]
    batch = adapter.tokenize(prompt)
    b, n = batch.tokens.shape
    for what, value, limit in (("row", row, b), ("dest", dest, n), ("src", src, n)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
            raise TLDynamicsError(f"qk_attribution.pair: {what} {value!r}; valid: 0..{limit - 1}")
    split = ResidualSplit(adapter, layer, sae=sae)
    collector = _PairCollector(split, head, check_sae_side(sae_side))
    with torch.no_grad(), adapter.collecting(collector):
        adapter.forward(batch)
    out = collector.out
    if not bool(out["allowed"][row, dest, src]):
        raise TLDynamicsError(
            f"qk_attribution.pair: destination {dest} may not attend to source {src} (masked: "
            "causal, window or padding)"
        )
    Qi, Kj = out["Q"][:, row, dest], out["K"][:, row, src]
    toks = adapter.str_tokens(batch, row)
    bias = out["bias"]
    qn, qk, kn, kk = out["names"]
    return PairAttribution(
        layer=layer,
        head=head,
        row=row,
        dest=dest,
        src=src,
        dest_token=toks[dest],
        src_token=toks[src],
        query_labels=tuple(component_labels(qn, qk, toks[dest], dest, "query")),
        key_labels=tuple(component_labels(kn, kk, toks[src], src, "key")),
        matrix=pair_matrix(Qi, Kj, out["scale"]).cpu().numpy(),
        position=0.0 if bias is None else float(bias[row, dest, src]),
        raw=float(out["raw"][row, dest, src]),
        score=float(out["score"][row, dest, src]),
        softcap=out["softcap"],
        parts={k: v.cpu().numpy() for k, v in odds_parts(Qi, Kj, out["scale"]).items()},
    )
