"""The causal weight of each head on the analysed targets: the change in next-token loss at the
measured destinations when the head is mean-ablated (docs/math.md §8.4, §9.5).

A reading says which predictor a head's output is closest to; it does not say that the model's
prediction needs the head. This is the number that does: for every measured destination ``t``
whose next token is real, the head's ``z`` is replaced by its mean over the prompt's real
positions (mean ablation, as the atlas does: ``tl_dynamics.ablation``) and the next-token loss at ``t`` is compared with
the clean pass's. The effect is the mean over those destinations, with a 95% interval over the
units (``evidence``), all prompts included (nothing is fitted).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.ablation import pooled_effect, position_mean

# Largest number of logits (replicas x batch x positions x vocabulary) held at once.
LOGIT_BUDGET = 1 << 25


def _nll(logits: Tensor, tokens: Tensor, b: Tensor, t: Tensor) -> Tensor:
    """Next-token loss at destinations ``(b, t)`` of each replica: ``[replicas, n]``."""
    rows = tokens.shape[0]
    reps = logits.shape[0] // rows
    lp = torch.log_softmax(logits.float().reshape(reps, rows, *logits.shape[1:])[:, b, t], -1)
    target = tokens[b, t + 1].to(lp.device)
    return -lp.gather(-1, target.expand(reps, -1)[..., None])[..., 0]


def ablation_effects(
    adapter: ModelAdapter,
    batch: Batch,
    layers: Sequence[int],
    heads: Sequence[int],
    dest_b: Tensor,
    dest_t: Tensor,
    unit: Tensor,
    n_boot: int,
    seed: int,
) -> np.ndarray:
    """``[layer, head, 3]``: each head's mean-ablation change in next-token loss (nats) at the
    measured destinations with a next real token, and its 95% interval over the units; NaN for
    a model without a next-token loss or without such destinations."""
    out = np.full((len(layers), len(heads), 3), np.nan)
    if adapter.is_encoder:
        return out
    valid = batch.key_valid.to(dest_b.device)
    n_pos = valid.shape[1]
    has_next = (dest_t + 1 < n_pos) & valid[dest_b, (dest_t + 1).clamp(max=n_pos - 1)]
    b, t, u = dest_b[has_next], dest_t[has_next], unit[has_next]
    if b.numel() == 0:
        return out
    tokens = batch.tokens
    with torch.no_grad():
        clean = _nll(adapter.forward(batch), tokens, b, t)[0]
    rows, vocab = tokens.shape[0], int(adapter.W_U.shape[-1])
    step = max(1, LOGIT_BUDGET // max(1, rows * n_pos * vocab))
    keyed = torch.unique(u, return_inverse=True)
    n_units, index = int(keyed[0].numel()), keyed[1].cpu().numpy()
    count = np.bincount(index, minlength=n_units).astype(float)
    for i, layer in enumerate(layers):
        deltas = []
        for start in range(0, len(heads), step):
            part = list(heads[start : start + step])
            k = len(part)

            def mean_ablate(z: Tensor, part: list[int] = part) -> Tensor:
                z = z.clone()  # [k * rows, pos, head, d]: replica r ablates head part[r]
                for r, h in enumerate(part):
                    sl = z[r * rows : (r + 1) * rows, :, h : h + 1]
                    mean = position_mean(sl, batch.key_valid)
                    z[r * rows : (r + 1) * rows, :, h : h + 1] = mean.expand_as(sl)
                return z

            grown = Batch(tokens.repeat(k, 1), batch.key_valid.repeat(k, 1), batch.padding_side)
            with torch.no_grad(), adapter.patch([("z", layer, mean_ablate)]):
                logits = adapter.forward(grown)
            deltas.append(_nll(logits, tokens, b, t) - clean[None])
        d = torch.cat(deltas).double().cpu().numpy()  # [heads, n]
        per_unit = np.stack([np.bincount(index, weights=row, minlength=n_units) for row in d])
        est, low, high = pooled_effect(per_unit.T, count, n_boot, seed)  # over the units
        out[i, :, 0], out[i, :, 1], out[i, :, 2] = est, low, high
    return out
