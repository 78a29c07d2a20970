"""Per-token trajectories of one batch: ``compute(model, prompt)`` -> ``Trajectory``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics.adapter import Batch, ModelAdapter, Prompt
from tl_dynamics.trajectories import _particles as P
from tl_dynamics.trajectories._points import Config, StandardizeArg, point_labels
from tl_dynamics.trajectories._walk import Walker, lens_applies




def lens_note(adapter: ModelAdapter, lens: bool, batch: Batch | None) -> str:
    """Why the next-token statistics are absent ("" when present)."""
    if not lens:
        return "next-token statistics switched off (lens=False)"
    if not lens_applies(adapter):
        return (f"not applicable: {adapter.info.architecture} is an encoder (bidirectional); "
                "it has no next token and its masked-LM head is not a final norm plus unembedding")
    if batch is None:
        return "not computed: no tokens were given for these forward passes (pass batch=...)"
    return ""


@dataclass(frozen=True)
class Trajectory:
    """Each token's path through depth for one batch of prompts.

    Points are the residual stream before each block and after the last (``labels``, e.g.
    ``resid_pre0 .. resid_post1``), with the mid-block points interleaved when ``flattened``.
    Per-token arrays are ``[batch, point(, -1 or -2), pos]`` with NaN (floats) or -1 (ints) at
    padding; per-prompt particle statistics use only ``particle_mask`` tokens.

    Attributes:
        norm, cos_final: ``|z|`` and ``cos(z, z_final)`` per point.
        step, rel_step: ``|z^(p+1) - z^(p)|`` and that divided by ``|z^(p)|`` (``point - 1``).
        turning: angle in degrees between consecutive steps (``point - 2``).
        rank: logit-lens rank of the true next token (0 = top-1), -1 without a next token.
        cos_embed, dist_embed, cos_unembed, dist_unembed: the final-normalised state against
            ``W_E[next]`` and ``W_U[:, next]``.
        settling: first point from which the next token stays top-1; ``n_points`` if never.
        cos_hist: pairwise-cosine counts in ``particles.N_BINS`` fixed bins on [-1, 1].
        clusters: ``[batch, eps, point]`` connected components of ``cos > 1 - eps``;
            merges/splits: ``[batch, eps, point - 1]`` events between consecutive points.
        erank: effective rank of the prompt's unit-vector cloud.
    """

    architecture: str
    labels: tuple[str, ...]
    eps: tuple[float, ...]
    str_tokens: tuple[tuple[str, ...], ...]
    tokens: Int[Tensor, "batch pos"]
    key_valid: Bool[Tensor, "batch pos"]
    particle_mask: Bool[Tensor, "batch pos"]
    norm: Float[Tensor, "batch point pos"]
    step: Float[Tensor, "batch step pos"]
    rel_step: Float[Tensor, "batch step pos"]
    turning: Float[Tensor, "batch turn pos"]
    cos_final: Float[Tensor, "batch point pos"]
    rank: Int[Tensor, "batch point pos"] | None
    cos_embed: Float[Tensor, "batch point pos"] | None
    dist_embed: Float[Tensor, "batch point pos"] | None
    cos_unembed: Float[Tensor, "batch point pos"] | None
    dist_unembed: Float[Tensor, "batch point pos"] | None
    settling: Int[Tensor, "batch pos"] | None
    lens_note: str
    cos_hist: Int[Tensor, "batch point bins"]
    mean_cos: Float[Tensor, "batch point"]
    clusters: Int[Tensor, "batch eps point"]
    merges: Int[Tensor, "batch eps step"]
    splits: Int[Tensor, "batch eps step"]
    erank: Float[Tensor, "batch point"]

    @property
    def n_points(self) -> int:
        return len(self.labels)

    def __repr__(self) -> str:
        return (f"Trajectory({self.architecture}, batch={self.tokens.shape[0]}, "
                f"pos={self.tokens.shape[1]}, points={self.n_points}, lens={not self.lens_note})")

    def to_dataframe(self) -> Any:
        """One row per (prompt, point, real token) with every per-token statistic."""
        from tl_dynamics.trajectories._views import trajectory_frame

        return trajectory_frame(self)

    def show(self, row: int = 0) -> Any:
        """Per-token views of one prompt: settling layer, step sizes, cosine to the final state."""
        from tl_dynamics.trajectories._views import show_trajectory

        return show_trajectory(self, row)


def _pad(x: Tensor, valid: Tensor, fill: float) -> Tensor:
    return torch.where(valid[:, None, :], x, torch.tensor(fill, dtype=x.dtype))


def build(adapter: ModelAdapter, cfg: Config, raw: dict[str, Tensor], batch: Batch,
          mask: Tensor) -> Trajectory:
    """Assemble a ``Trajectory`` from a ``PointComputer``'s stacked output."""
    valid, mask = batch.key_valid.cpu(), mask.cpu()
    nan = math.nan
    lens = {k: _pad(raw[k], valid, nan) if k in raw else None
            for k in ("cos_embed", "dist_embed", "cos_unembed", "dist_unembed")}
    pairs = raw["n_pairs"]
    empty_turn = torch.empty(valid.shape[0], 0, valid.shape[1])
    rows = tuple(tuple(adapter.str_tokens(batch, r)) for r in range(valid.shape[0]))
    return Trajectory(
        architecture=adapter.info.architecture, labels=point_labels_of(adapter, cfg),
        eps=tuple(cfg.eps), str_tokens=rows, tokens=batch.tokens.cpu(), key_valid=valid,
        particle_mask=mask, norm=_pad(raw["norm"], valid, nan),
        step=_pad(raw["step"], valid, nan), rel_step=_pad(raw["rel_step"], valid, nan),
        turning=_pad(raw["turning"], valid, nan) if "turning" in raw else empty_turn,
        cos_final=_pad(raw["cos_final"], valid, nan),
        rank=raw.get("rank"), settling=raw.get("settling"),
        lens_note=lens_note(adapter, cfg.lens, batch), cos_hist=raw["cos_hist"],
        mean_cos=torch.where(pairs > 0, raw["cos_sum"] / pairs.clamp_min(1), nan).float(),
        clusters=raw["clusters"], merges=raw["merges"], splits=raw["splits"],
        erank=raw["erank"].float(), **lens)


def point_labels_of(adapter: ModelAdapter, cfg: Config) -> tuple[str, ...]:
    from tl_dynamics.trajectories._points import point_roles

    return point_labels(point_roles(adapter, cfg.flattened))


def compute(model: Any, prompt: Prompt | Batch, eps: Sequence[float] = P.DEFAULT_EPS,
            flattened: bool = False, lens: bool = True, standardize: StandardizeArg = None,
            skip_first: bool = False, padding_side: str = "right") -> Trajectory:
    """Trajectories of every token of ``prompt`` (one forward pass, statistics in the hooks).

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: text, a list of texts (padded on ``padding_side``), tokens, or a ``Batch``.
        eps: cluster thresholds (link tokens with ``cos > 1 - eps``).
        flattened: interleave the mid-block points (not available on parallel-block models).
        lens: compute the next-token (logit-lens) statistics (decoders only).
        standardize: None, ``"prompt"`` (per-prompt per-dimension z-scores) or a
            ``Standardizer``, applied before the particle statistics only.
        skip_first: leave each prompt's first real token out of the particle statistics.

    Example:
        >>> from tl_dynamics import testing, trajectories
        >>> traj = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x")  # doctest: +SKIP
        >>> traj.rank.shape[1] == traj.n_points                                              # doctest: +SKIP
        True
    """
    adapter = ModelAdapter.of(model)
    batch = adapter.tokenize(prompt, padding_side)
    cfg = Config(eps=tuple(eps), flattened=flattened, lens=lens, standardize=standardize,
                 skip_first=skip_first)
    out: dict[str, Any] = {}

    def sink(raw: dict[str, Tensor], b: Batch | None) -> None:
        out["raw"] = raw

    walker = Walker(adapter, cfg, sink, batch)
    walker.run(batch)
    mask = batch.key_valid
    if skip_first:
        mask = mask & ~(mask.long().cumsum(-1) == 1)
    return build(adapter, cfg, out["raw"], batch, mask)
