"""Every head's mean-ablation effect estimated from one forward and one backward pass:
attribution patching (Nanda 2023; AtP, Kramár et al. 2024, "AtP*: An efficient and scalable
method for localizing LLM behaviour to components").

Mean-ablating head ``h`` replaces its ``z`` (``[pos, d_head]`` per probe) by its mean over the
probe's real positions ``z_bar``. To first order the loss changes by

    delta_hat(h) = sum_i (z_bar - z_i) . dL/dz_i

so one backward pass of the loss gives every head's estimate at once. The loss is the same mean
next-token loss over the same target positions as the exact ablation (``_causal``), per probe,
so the estimate has an interval over the probes like the exact number. It is a linearisation:
where the rest of the network responds non-linearly to the head (a later softmax saturating,
a norm rescaling) it can misjudge a head, so the atlas runs the exact ablation for the heads the
estimate ranks first and for the heads the user names, shows both, and measures their agreement
(``HeadAtlas.atp_agreement``). Latent-attention layers (whose ``z`` the host reshapes) give no
gradient at the hook and are left NaN.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from torch import Tensor

from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.atlas._causal import row_losses


def atp_deltas(
    adapter: ModelAdapter,
    batch: Batch,
    layers: Sequence[int],
    target: Tensor | None,
) -> np.ndarray:
    """``[probe, layer, head]``: each head's attribution-patching estimate of its mean-ablation
    change in next-token loss on each probe (nats), on the positions ``target`` (``[pos]``
    bool, None: all); NaN on layers not in ``layers`` or without a gradient at ``z``.

    Example:
        >>> from tl_dynamics import zoo
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad = ModelAdapter(zoo.load("induction-2l"))
        >>> est = atp_deltas(ad, ad.tokenize(["ABCDABCD", "XYZXYZ"]), [0, 1], None)
        >>> est.shape, bool(np.isfinite(est).all())
        ((2, 2, 4), True)
    """
    kept: dict[int, Tensor] = {}

    def leaf(x: Tensor) -> Tensor:
        return x.detach().requires_grad_(True)  # the graph starts here: no parameter gradients

    def keep(layer: int):
        def fn(z: Tensor) -> Tensor:
            # returned as the replacement, so it is the tensor the rest of the pass reads (some
            # hosts fire the hook on a side copy and go on with their own when it returns None)
            used = z.clone()
            if used.requires_grad:
                used.retain_grad()
            kept[layer] = used
            return used

        return fn

    first = min(adapter.attention_layers)
    patches = [("resid_pre", first, leaf)] + [("z", layer, keep(layer)) for layer in layers]
    with adapter.patch(patches):
        logits = adapter.forward(batch, grad=True)
        losses = row_losses(logits, batch, 1, target)[0][0]  # [rows]
        losses.sum().backward()  # each probe's gradient is its own loss's: rows do not mix
    out = np.full((batch.tokens.shape[0], adapter.n_layers, adapter.n_heads), np.nan)
    valid = batch.key_valid
    for layer, z in kept.items():
        if z.grad is None:
            continue
        v = valid.to(z.device, z.dtype)[:, :, None, None]
        zbar = (z.detach() * v).sum(1, keepdim=True) / v.sum(1, keepdim=True).clamp(min=1.0)
        est = ((zbar - z.detach()) * z.grad * v).sum((1, 3))  # [b, head]
        out[:, layer] = est.double().cpu().numpy()
    return out
