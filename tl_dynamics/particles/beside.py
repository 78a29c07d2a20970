"""The idealised flow beside a real model: particles seeded from one head and from the prompt's
own token states, next to the model's depth-wise cluster counts on that prompt."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

from tl_dynamics.errors import TLDynamicsError

from .result import ParticleRun
from .seeding import HeadDynamics, from_head
from .simulation import simulate
from .views import FigureView


@dataclass(frozen=True)
class BesideModel:
    """A simulation seeded from ``(layer, head)`` beside the model's own clustering.

    ``model_clusters[p]`` is the number of clusters (``cos > 1 - eps``) among the prompt's
    tokens at depth point ``p`` (``point_labels``), from ``tl_dynamics.trajectories``;
    ``run`` integrates (SA) in ``d_model`` dimensions with ``Q, K, V, beta`` from the head,
    starting from the same tokens' normalised states at the input of ``layer``.
    """

    layer: int
    head: int
    eps: float
    tokens: tuple[str, ...]
    point_labels: tuple[str, ...]
    model_clusters: np.ndarray
    head_dynamics: HeadDynamics
    run: ParticleRun

    def to_dataframe(self) -> pd.DataFrame:
        model = pd.DataFrame({"source": "model", "axis": "depth point",
                              "position": list(self.point_labels),
                              "clusters": self.model_clusters.astype(float)})
        sim = pd.DataFrame({"source": "simulation", "axis": "time",
                            "position": [f"{t:.3g}" for t in self.run.times.tolist()],
                            "clusters": self.run.cluster_counts(self.eps)[:, 0].double().numpy()})
        return pd.concat([model, sim], ignore_index=True)

    def show(self) -> FigureView:
        fig = Figure(figsize=(10, 3.6))
        left, right = fig.subplots(1, 2)
        left.plot(range(len(self.model_clusters)), self.model_clusters, marker="o")
        left.set_xticks(range(len(self.point_labels)), self.point_labels, rotation=45, fontsize=7)
        left.set_ylabel(f"clusters (eps={self.eps:g})")
        left.set_title(f"model: {len(self.tokens)} tokens through depth")
        right.plot(self.run.times.numpy(), self.run.cluster_counts(self.eps)[:, 0].numpy(), color="C1")
        right.set_xlabel("time t")
        right.set_title(f"(SA) seeded from L{self.layer}H{self.head}, beta={self.head_dynamics.beta:.3g}")
        fig.tight_layout()
        return FigureView(fig, f"Depth-wise clustering of the prompt's tokens (left) beside the "
                               f"idealised flow of the same tokens under head L{self.layer}H{self.head} (right)")


def beside_model(model: Any, prompt: Any, layer: int = 0, head: int = 0, eps: float = 0.05,
                 t_max: float = 20.0, radius: float | None = None) -> BesideModel:
    """Seed the particle system from ``(layer, head)`` and the prompt's tokens; set it beside
    the model's own cluster counts through depth (first prompt of a batch).

    ``radius`` scales ``beta = c * radius**2`` (default ``sqrt(d_model)``: the norm of a
    LayerNorm output, so that beta is the model's own score scale on its real inputs).

    Example:
        >>> from tl_dynamics import testing, particles
        >>> result = particles.beside_model(testing.tiny_model("gpt2"), "a b c d e f")  # doctest: +SKIP
        >>> result.show()                                                             # doctest: +SKIP
    """
    from tl_dynamics import trajectories
    from tl_dynamics.adapter import Batch, ModelAdapter

    adapter = model if isinstance(model, ModelAdapter) else ModelAdapter(model)
    adapter.check_layer(layer)
    adapter.check_head(head, layer)
    batch = adapter.tokenize(prompt)
    batch = Batch(batch.tokens[:1], batch.key_valid[:1], batch.padding_side)
    traj = trajectories.compute(adapter, batch, eps=(eps,), lens=False)
    states: dict[str, torch.Tensor] = {}
    with adapter.hooks([("resid_pre", layer, lambda t: states.__setitem__("x", t.detach()))]):
        adapter.forward(batch)
    valid = batch.key_valid[0]
    x = states["x"][0][valid].double()
    if x.shape[0] < 2:
        raise TLDynamicsError(f"beside_model needs a prompt of at least 2 tokens, got {x.shape[0]}")
    x0 = (x / x.norm(dim=-1, keepdim=True))[None]
    dynamics = from_head(adapter, layer, head,
                         radius=math.sqrt(adapter.d_model) if radius is None else radius)
    run = simulate(x0, **dynamics.kwargs(), t_max=t_max, eps=eps)
    tokens = tuple(t for t, ok in zip(adapter.str_tokens(batch), valid.tolist()) if ok)
    return BesideModel(layer=layer, head=head, eps=eps, tokens=tokens,
                       point_labels=tuple(traj.labels),
                       model_clusters=traj.clusters[0, 0].numpy(), head_dynamics=dynamics, run=run)


def report_section(page: Any, adapter: Any, batch: Any) -> None:
    """Report page: the flow seeded from layer 0, head 0 beside the model's clustering."""
    from tl_dynamics import viz

    result = beside_model(adapter, batch, layer=0, head=0, t_max=10.0)
    view = result.show()
    page.add_section("Idealised particle dynamics", [
        viz.Component(html=view.html(), caption=view.caption)],
        intro="Geshkovski et al.'s self-attention dynamics on the sphere, with Q, K, V and beta "
              "from one head and the prompt's own tokens as the initial particles, beside the "
              "number of token clusters the real model forms through its layers. The idealised "
              "flow drops biases, LayerNorm, MLPs and the other heads.")
