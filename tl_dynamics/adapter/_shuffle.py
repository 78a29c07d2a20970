"""``shuffled_weights``: the "same weights, no structure" control the atlas compares with.

A copy of the model whose every parameter has its entries permuted at random (seeded), so each
matrix keeps its distribution of values (norms, scale) and loses what training arranged.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tl_dynamics.adapter._model import ModelAdapter
from tl_dynamics.errors import TLDynamicsError


def shuffled_weights(adapter: "ModelAdapter", seed: int = 0) -> "ModelAdapter":
    """A new adapter over a copy of ``adapter``'s model whose parameters each have their
    entries permuted at random (seeded by ``seed``).

    Tied parameters stay tied (each tensor is shuffled once). The original is not touched.
    Normalise a model first with ``ModelAdapter.of``.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter, shuffled_weights
        >>> ad = ModelAdapter(testing.tiny_model("gpt2"))
        >>> sh = shuffled_weights(ad, seed=1)
        >>> same_values = sh.W_E.flatten().sort().values.equal(ad.W_E.flatten().sort().values)
        >>> same_values, sh.W_E.equal(ad.W_E)
        (True, False)
    """
    if not (hasattr(adapter, "info") and hasattr(adapter, "model")):
        raise TLDynamicsError(f"shuffled_weights needs a ModelAdapter (use ModelAdapter.of(model)), "
                              f"got {type(adapter).__name__}")
    clone = copy.deepcopy(adapter.model)
    generator = torch.Generator().manual_seed(int(seed))
    seen: set[int] = set()
    with torch.no_grad():
        for param in clone.parameters():
            if id(param) in seen or param.numel() < 2:
                continue
            seen.add(id(param))
            flat = param.detach().reshape(-1)
            order = torch.randperm(flat.numel(), generator=generator).to(flat.device)
            param.copy_(flat[order].reshape(param.shape))
    return type(adapter)(clone.eval())
