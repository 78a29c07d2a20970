"""The idealised flow beside a real model: particles seeded from heads and from the prompt's
own token states, next to the model's depth-wise cluster counts on that prompt."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch

from tl_dynamics import trajectories, viz
from tl_dynamics.adapter import Batch, ModelAdapter, Prompt
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.particles._result import ParticleRun
from tl_dynamics.particles._seeding import HeadDynamics, from_head
from tl_dynamics.particles._simulation import DEFAULT_TOL, simulate
from tl_dynamics.particles._views import beside_figure

BESIDE_EPS = 0.05
"""The closeness threshold of ``compute``: tokens are eps-close when ``cos > 1 - 0.05``."""


@dataclass(frozen=True)
class BesideModel(viz.Result):
    """Head-seeded simulations, one run per ``(layer, head)``, beside the model's own clustering.

    ``model_clusters[p]`` is the number of clusters (``cos > 1 - eps``) among the prompt's
    tokens at depth point ``p`` (``point_labels``), from ``tl_dynamics.trajectories``. Run
    ``r`` of ``run`` integrates (SA) in ``d_model`` dimensions with ``Q, K, V, beta`` from head
    ``pairs[r]`` (``head_dynamics[r]``), starting from the same tokens' normalised states at the
    input of that head's layer. Built by ``particles.compute``.

    Attributes:
        pairs: the ``(layer, head)`` of each run.
        eps: the closeness threshold.
        tokens: the prompt's tokens placed as particles.
        point_labels: the model's depth points (``resid_pre0``, ...).
        model_clusters: ``[point]`` the model's cluster counts through depth.
        head_dynamics: each run's ``Q, K, V, beta`` and provenance.
        run: the ``ParticleRun`` of every head (``runs = len(pairs)``).
        zero_tokens: tokens left out because their state is the zero vector.

    Example:
        >>> from tl_dynamics import particles, testing
        >>> side = particles.compute(testing.tiny_model("gpt2"), "a b c d e f", layers=0, heads=0)
        >>> side.pairs, side.model_clusters.tolist(), side.run.n  # 7 tokens, each its own cluster
        (((0, 0),), [7, 7, 7], 7)
    """

    pairs: tuple[tuple[int, int], ...]
    eps: float
    tokens: tuple[str, ...]
    point_labels: tuple[str, ...]
    model_clusters: np.ndarray
    head_dynamics: tuple[HeadDynamics, ...]
    run: ParticleRun
    zero_tokens: tuple[str, ...] = ()  # tokens left out: their state is the zero vector

    @property
    def names(self) -> tuple[str, ...]:
        """``L{layer}H{head}`` of each run.

        Example:
            >>> from tl_dynamics import particles, testing
            >>> side = particles.compute(testing.tiny_model("gpt2"), "a b c d e f", layers=0, heads=0)
            >>> side.names
            ('L0H0',)
        """
        return tuple(f"L{layer}H{head}" for layer, head in self.pairs)

    def to_dataframe(self) -> pd.DataFrame:
        """Long form: the model's clusters per depth point, then each run's per record time.

        Returns:
            A pandas DataFrame with columns ``source`` (``"model"`` or ``"simulation"``),
            ``head``, ``axis``, ``position`` and ``clusters``.

        Example:
            >>> from tl_dynamics import particles, testing
            >>> side = particles.compute(testing.tiny_model("gpt2"), "a b c d e f", layers=0, heads=0)
            >>> frame = side.to_dataframe()
            >>> frame["source"].value_counts().to_dict()
            {'simulation': 101, 'model': 3}
        """
        model = pd.DataFrame(
            {
                "source": "model",
                "head_name": "",
                "axis": "depth point",
                "position": list(self.point_labels),
                "clusters": self.model_clusters.astype(float),
            }
        )
        counts = self.run.cluster_counts(self.eps).double().numpy()
        sims = [
            pd.DataFrame(
                {
                    "source": "simulation",
                    "head_name": name,
                    "axis": "time",
                    "position": [f"{t:.3g}" for t in self.run.times.tolist()],
                    "clusters": counts[:, r],
                }
            )
            for r, name in enumerate(self.names)
        ]
        return pd.concat([model, *sims], ignore_index=True)

    def caption(self) -> str:
        """What the figure shows, in words, with the numbers that say what happened.

        Returns:
            The caption text.

        Example:
            >>> from tl_dynamics import particles, testing
            >>> side = particles.compute(testing.tiny_model("gpt2"), "a b c d e f", layers=0, heads=0)
            >>> side.caption().startswith("Clusters among the prompt's 7 tokens")
            True
        """
        n = len(self.tokens)
        counts = self.run.cluster_counts(self.eps)
        start, end = int(counts[0].max()), int(counts[-1].min())
        t_end = float(self.run.times[-1])
        cos0, cos1 = (float(self.run.mean_cosine[k].mean()) for k in (0, -1))
        drift = f"the mean pairwise cosine goes from {cos0:.2f} to {cos1:.2f}"
        flow = (
            f"no two tokens come within eps by t = {t_end:g}, so the count stays at {n} (every "
            f"token alone) while {drift}"
            if end == n
            else f"the flow merges {start} clusters into {end} by t = {t_end:g} (fewest over runs) "
            f"and {drift}"
        )
        model = f"{int(self.model_clusters.min())}..{int(self.model_clusters.max())}"
        return (
            f"Clusters among the prompt's {n} tokens (cos > 1 - {self.eps:g}): through the "
            f"model's depth (left: {model}) and under the idealised (SA) flow seeded from "
            f"{', '.join(self.names[:6])}{', ...' if len(self.names) > 6 else ''} (middle; "
            f"right: its mean pairwise cosine). Dashed: {n}, every token its own cluster. "
            f"Here {flow}."
            + (
                f" Left out of the flow: {list(self.zero_tokens)!r}, whose "
                "state is the zero vector (no direction on the sphere)."
                if self.zero_tokens
                else ""
            )
        )

    def show(self) -> viz.Group:
        """The model's clusters through depth beside the flow's over time, and its mean cosine.

        Inline SVG plots: the model's cluster counts per depth point, each run's cluster counts over
        time, and the flow's mean pairwise cosine.

        Returns:
            A ``viz.Group``.

        Example:
            >>> from tl_dynamics import particles, testing
            >>> side = particles.compute(testing.tiny_model("gpt2"), "a b c d e f", layers=0, heads=0)
            >>> type(side.show()).__name__
            'Group'
        """
        counts = self.run.cluster_counts(self.eps).numpy().astype(float)
        return beside_figure(
            self.point_labels,
            self.model_clusters,
            len(self.tokens),
            self.run.times.numpy(),
            counts,
            self.run.mean_cosine.numpy(),
            self.names,
            self.eps,
            self.caption(),
        )


def _states(adapter: ModelAdapter, batch: Batch, layers: list[int]) -> dict[int, torch.Tensor]:
    """The residual stream at the input of each of ``layers`` (one forward pass)."""
    states: dict[int, torch.Tensor] = {}

    def keep(layer: int) -> Any:
        return lambda t: states.__setitem__(layer, t.detach())

    with adapter.hooks([("resid_pre", layer, keep(layer)) for layer in layers]):
        adapter.forward(batch)
    return states


def compute(
    model: Any,
    prompt: Prompt | Batch,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    eps: float = BESIDE_EPS,
    t_max: float = 20.0,
    radius: float | None = None,
    tol: float = DEFAULT_TOL,
) -> BesideModel:
    """Seed the particle system from heads and the prompt's tokens, beside the model's clustering.

    The first prompt's tokens, at the input of each head's layer, are the initial particles; the
    model's own cluster counts of the same tokens through depth are set beside the flow.
    ``layers`` and ``heads`` select as in every analysis (index, list, or None for all; the
    heads in every selected layer): one run per ``(layer, head)``, all in one batched
    simulation. ``radius`` scales ``beta = c * radius**2`` (default ``sqrt(d_model)``: the norm
    of a LayerNorm output, so that beta is the model's own score scale on its real inputs).

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: text, a list of texts (the first is used), token ids or a ``Batch``.
        layers: a layer index, a list of them, or None (all layers).
        heads: a head index, a list of them, or None (all heads), in every selected layer.
        eps: the closeness threshold (``cos > 1 - eps``).
        t_max: simulated time.
        radius: the radius that sets ``beta`` (None: ``sqrt(d_model)``).
        tol: the integrator's local error per step (``simulate``'s ``tol``; a head with sharp
            attention makes the flow stiff, and its steps short).

    Returns:
        A ``BesideModel``.

    Example:
        >>> from tl_dynamics import testing, particles
        >>> side = particles.compute(testing.tiny_model("gpt2"), "a b c d e f", layers=0,
        ...                          heads=[0, 1], t_max=5.0)
        >>> side.names, side.run.n_runs, side.run.d
        (('L0H0', 'L0H1'), 2, 64)
    """
    adapter = ModelAdapter.of(model)
    chosen_layers, chosen_heads = adapter.check_layers(layers), adapter.check_heads(heads)
    pairs = tuple((layer, head) for layer in chosen_layers for head in chosen_heads)
    if not pairs:
        raise TLDynamicsError(
            "compute needs at least one layer and one head, got an empty "
            f"selection (layers={layers!r}, heads={heads!r})"
        )
    batch = adapter.tokenize(prompt)
    batch = Batch(batch.tokens[:1], batch.key_valid[:1], batch.padding_side)
    traj = trajectories.compute(adapter, batch, eps=(eps,), lens=False)
    states = _states(adapter, batch, sorted(set(chosen_layers)))
    valid = batch.key_valid[0]
    if int(valid.sum()) < 2:
        raise TLDynamicsError(
            f"particles.compute needs a prompt of at least 2 tokens, got {int(valid.sum())}"
        )
    # A token whose state is the zero vector has no direction on the sphere (e.g. GPT-OSS's BOS:
    # its embedding row is the padding row, all zeros): it is left out, by name, not normalised
    # into NaN.
    placed = valid.clone()
    for layer in set(chosen_layers):
        placed &= (states[layer][0].norm(dim=-1) > 0).to(placed.device)
    all_tokens = adapter.str_tokens(batch)
    dropped = tuple(all_tokens[i] for i in range(len(all_tokens)) if valid[i] and not placed[i])
    if int(placed.sum()) < 2:
        raise TLDynamicsError(
            f"particles.compute needs at least 2 tokens with a non-zero state "
            f"at the input of layers {chosen_layers}; {len(dropped)} of the "
            f"prompt's {int(valid.sum())} are the zero vector ({dropped!r})"
        )
    valid = placed
    r = math.sqrt(adapter.d_model) if radius is None else radius
    dynamics = tuple(from_head(adapter, layer, head, radius=r) for layer, head in pairs)
    x0 = []
    for layer, _ in pairs:
        x = states[layer][0][valid.to(states[layer].device)].double().cpu()
        x0.append(x / x.norm(dim=-1, keepdim=True))
    if len(pairs) == 1:
        run = simulate(x0[0][None], **dynamics[0].kwargs(), t_max=t_max, eps=eps, tol=tol)
    else:
        run = simulate(
            torch.stack(x0),
            torch.tensor([h.beta for h in dynamics]),
            torch.stack([h.Q for h in dynamics]),
            torch.stack([h.K for h in dynamics]),
            _stacked_values(dynamics),
            t_max=t_max,
            eps=eps,
            tol=tol,
        )
    tokens = tuple(t for t, ok in zip(all_tokens, valid.tolist()) if ok)
    return BesideModel(
        pairs=pairs,
        eps=eps,
        tokens=tokens,
        point_labels=tuple(traj.labels),
        model_clusters=traj.clusters[0, 0].numpy(),
        head_dynamics=dynamics,
        run=run,
        zero_tokens=dropped,
    )


def _stacked_values(dynamics: tuple[HeadDynamics, ...]) -> Any:
    """Every run's ``V`` for ``simulate``: the heads' ``(W_V, W_O)`` stacked where all are
    factored with one width, else the dense ``V`` matrices."""
    factors = [h.V_factors for h in dynamics]
    if all(f is not None for f in factors) and len({f[0].shape for f in factors if f}) == 1:
        return tuple(torch.stack([f[i] for f in factors if f]) for i in (0, 1))
    return torch.stack([h.V for h in dynamics])


def beside_model(
    model: Any,
    prompt: Prompt | Batch,
    layer: int = 0,
    head: int = 0,
    eps: float = BESIDE_EPS,
    t_max: float = 20.0,
    radius: float | None = None,
    tol: float = DEFAULT_TOL,
) -> BesideModel:
    """``compute`` for one head: ``compute(model, prompt, layers=layer, heads=head, ...)``.

    Example:
        >>> from tl_dynamics import testing
        >>> result = beside_model(testing.tiny_model("gpt2"), "a b c d e f", t_max=5.0)
        >>> result.names
        ('L0H0',)
    """
    if not isinstance(layer, int) or not isinstance(head, int):
        raise TLDynamicsError(
            f"particles: the beside-model view takes one layer and one head (integers), got "
            f"layer={layer!r}, head={head!r}; for several use particles.compute"
        )
    return compute(model, prompt, layers=layer, heads=head, eps=eps, t_max=t_max, radius=radius)
