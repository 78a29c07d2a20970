"""Class attractors: context-pooled states per layer, a linear probe per layer, class vectors.

The seed's argument: a linear classifier on time-averaged ("context-pooled") features says
the pooled state of a class sits near that class's vector. Per trajectory point we pool each
prompt's real tokens (mean), standardise with the training prompts' statistics, fit a
closed-form ridge regression onto centred one-hot targets (no extra dependency), and report the
held-out accuracy, the probe's class vectors, and how close each pooled state is to its class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.trajectories._points import in_depth_order, point_labels, point_roles
from tl_dynamics.trajectories._collect import batches as _batches

DEFAULT_RIDGE = 1.0


@dataclass(frozen=True)
class ClassProbe(viz.Result):
    """Per-point linear probes on context-pooled states.

    Attributes:
        accuracy: held-out accuracy per point ``[point]``.
        train_accuracy: ``[point]``.
        class_vectors: the probe's weight per class, in standardised state space
            ``[point, class, d_model]``.
        centroids: class means of the standardised pooled states ``[point, class, d_model]``.
        attraction: per prompt and point, distance of its standardised pooled state to its own
            class centroid divided by the distance to the nearest other centroid
            ``[prompt, point]`` (< 1: closer to its own class; pooled states of one class
            gathering round one point is what an attractor would look like).
        vector_cos: cosine of each centred pooled state with its own class vector
            ``[prompt, point]``.
    """

    architecture: str
    labels: tuple[str, ...]
    classes: tuple[Any, ...]
    y: tuple[int, ...]
    test: tuple[bool, ...]
    accuracy: Float[Tensor, " point"]
    train_accuracy: Float[Tensor, " point"]
    class_vectors: Float[Tensor, "point cls d_model"]
    centroids: Float[Tensor, "point cls d_model"]
    attraction: Float[Tensor, "prompt point"]
    vector_cos: Float[Tensor, "prompt point"]
    ridge: float

    def to_dataframe(self) -> Any:
        import pandas as pd

        test = torch.tensor(self.test)
        return pd.DataFrame(
            {
                "point": in_depth_order(self.labels, self.labels),
                "heldout_accuracy": self.accuracy.tolist(),
                "train_accuracy": self.train_accuracy.tolist(),
                "mean_attraction": self.attraction.mean(0).tolist(),
                "heldout_attraction": self.attraction[test].mean(0).tolist(),
                "mean_vector_cos": self.vector_cos.mean(0).tolist(),
            }
        ).set_index("point")

    def show(self) -> Any:
        from tl_dynamics import viz

        return viz.table(
            self.to_dataframe(),
            caption=(
                f"class attractors: ridge probe per point on context-pooled states, "
                f"{len(self.classes)} classes, {sum(self.test)} held-out prompts"
            ),
        )


def pooled_states(
    model: Any, prompts: Sequence[str], batch_size: int = 16, flattened: bool = False
) -> Float[Tensor, "prompt point d_model"]:
    """Mean over each prompt's real tokens of the residual state at every trajectory point."""
    adapter = ModelAdapter.of(model)
    roles = point_roles(adapter, flattened)
    out: list[Tensor] = []
    for batch in _batches(adapter, prompts, batch_size, "right"):
        w = batch.key_valid[..., None].float()
        per: list[Tensor] = []

        def make(w: Tensor, per: list[Tensor]) -> Callable[[Tensor], None]:
            def fn(z: Tensor) -> None:
                wz = w.to(z.device)
                per.append(((z.detach().float() * wz).sum(1) / wz.sum(1)).cpu())

            return fn

        with adapter.hooks([(r, layer, make(w, per)) for r, layer in roles]):
            adapter.forward(batch)
        out.append(torch.stack(per, dim=1))
    return torch.cat(out)


def _split(y: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = max(1, int(round(len(idx) * test_fraction)))
        if len(idx) - n_test < 1:
            raise TLDynamicsError(
                f"class {c!r} has {len(idx)} prompt(s): need at least 2 per class "
                "(one to train, one to test)"
            )
        test[idx[:n_test]] = True
    return test


def class_probe(
    model: Any,
    prompts: Sequence[str],
    labels: Sequence[Any],
    ridge: float = DEFAULT_RIDGE,
    test_fraction: float = 0.25,
    seed: int = 0,
    batch_size: int = 16,
    flattened: bool = False,
) -> ClassProbe:
    """Fit a ridge probe per trajectory point on labelled prompts; held-out accuracy per point.

    Each prompt's states are pooled over its tokens at every point and standardised; a ridge
    regression on one-hot labels is fitted on a split and scored on the held-out prompts.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompts: the prompts (a list of texts).
        labels: one label per prompt (at least 2 classes, 2 prompts each).
        ridge: ridge penalty.
        test_fraction: share of each class held out.
        seed: seed of the split.
        batch_size: prompts per forward pass.
        flattened: interleave the mid-block points.

    Returns:
        ``ClassProbe``: ``accuracy`` and ``train_accuracy`` ``[point]``, ``class_vectors`` and
        ``centroids`` ``[point, class, d_model]``, ``attraction`` ``[prompt, point]``.

    Example:
        >>> from tl_dynamics import testing
        >>> probe = class_probe(testing.tiny_model("gpt2"),
        ...     ["x = 1", "y = 2", "z = 3", "def f():", "def g():", "def h():"],
        ...     ["assign"] * 3 + ["def"] * 3)
        >>> probe.accuracy.shape, probe.classes
        (torch.Size([3]), ('assign', 'def'))
    """
    if isinstance(prompts, str) or len(prompts) != len(labels):
        raise TLDynamicsError(
            f"class_probe needs a list of prompts and one label each, got "
            f"{'a string' if isinstance(prompts, str) else len(prompts)} prompts "
            f"and {len(labels)} labels"
        )
    classes = tuple(sorted(set(labels), key=str))
    if len(classes) < 2:
        raise TLDynamicsError(f"class_probe needs at least 2 classes, got {list(classes)}")
    if not 0.0 < test_fraction < 1.0 or not ridge >= 0:
        raise TLDynamicsError(
            f"test_fraction must be in (0, 1) and ridge >= 0, got {test_fraction!r}, {ridge!r}"
        )
    adapter = ModelAdapter.of(model)
    y = np.array([classes.index(lab) for lab in labels])
    test = _split(y, test_fraction, seed)
    x_all = pooled_states(adapter, prompts, batch_size, flattened).double()  # [n, P, d]
    yt = torch.tensor(y)
    tr = torch.tensor(~test)
    onehot = torch.nn.functional.one_hot(yt, len(classes)).double()
    n_points = x_all.shape[1]
    acc, tr_acc, vecs, cents, attr, vcos = [], [], [], [], [], []
    for p in range(n_points):
        x = x_all[:, p]
        mu, sd = x[tr].mean(0), x[tr].std(0, unbiased=False).clamp_min(1e-6)
        xs = (x - mu) / sd
        t = onehot[tr] - onehot[tr].mean(0)
        a = xs[tr]
        w = torch.linalg.solve(a.T @ a + ridge * torch.eye(a.shape[1], dtype=a.dtype), a.T @ t)
        pred = (xs @ w).argmax(1)
        acc.append((pred[~tr] == yt[~tr]).double().mean())
        tr_acc.append((pred[tr] == yt[tr]).double().mean())
        cent = torch.stack([xs[tr][yt[tr] == c].mean(0) for c in range(len(classes))])
        dist = torch.cdist(xs, cent)  # [n, C]
        own = dist.gather(1, yt[:, None])[:, 0]
        other = dist.scatter(1, yt[:, None], float("inf")).amin(1)
        attr.append(own / other.clamp_min(1e-12))
        own_vec = w.T[yt]
        vcos.append(torch.nn.functional.cosine_similarity(xs, own_vec, dim=1))
        vecs.append(w.T)
        cents.append(cent)
    return ClassProbe(
        architecture=adapter.info.architecture,
        labels=point_labels(point_roles(adapter, flattened)),
        classes=classes,
        y=tuple(int(v) for v in y),
        test=tuple(bool(v) for v in test),
        accuracy=torch.stack(acc).float(),
        train_accuracy=torch.stack(tr_acc).float(),
        class_vectors=torch.stack(vecs).float(),
        centroids=torch.stack(cents).float(),
        attraction=torch.stack(attr, 1).float(),
        vector_cos=torch.stack(vcos, 1).float(),
        ridge=float(ridge),
    )
