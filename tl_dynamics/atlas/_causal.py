"""Causal evidence: the change in next-token loss when one head is intervened on.

Three interventions per head, each patched into the forward pass with ``ModelAdapter.patch``
(hooks removed exactly on exit):

- ``mean``: the head's ``z`` replaced by its mean over the prompt's positions, so its output is
  its mean output (mean ablation);
- ``prior``: its pattern replaced by the prior-only counterfactual ``softmax(key_prior + p)``;
- ``likelihood``: its pattern replaced by the likelihood-only ``softmax(loglik + p)``
  (``tl_dynamics.odds_ratio.counterfactual_patterns``, docs/math.md §1).

The variants of one layer run together as one batch: where the host allows it, the clean
activation entering that layer (``resid_pre``) is repeated once per variant, so the layers
before it run once for all of them; otherwise the whole prompt batch is repeated from the
input (the same numbers, at the cost of re-running the earlier layers).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from tl_dynamics import odds_ratio
from tl_dynamics.ablation import position_mean
from tl_dynamics.adapter import Batch, LayerAttention, ModelAdapter
from tl_dynamics.errors import TLDynamicsError

KINDS = ("mean", "prior", "likelihood")
# Largest number of logits (variants x batch x positions x vocabulary) held at once.
LOGIT_BUDGET = 1 << 26


def row_losses(
    logits: Tensor, batch: Batch, n_variants: int, targets: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(loss [n_variants, rows], counts [rows])``: each probe's mean next-token cross-entropy
    over its valid (token, next token) pairs whose next position is in ``targets`` (``[pos]``
    bool; all by default), and how many pairs that is (a probe with none has loss 0);
    ``logits`` is ``[n_variants * rows, pos, vocab]``. Differentiable in ``logits``.

    Example:
        >>> import torch
        >>> from tl_dynamics.adapter import Batch
        >>> tokens = torch.tensor([[0, 1, 2], [2, 1, 0]])
        >>> batch = Batch(tokens, torch.ones_like(tokens, dtype=torch.bool), "right")
        >>> loss, counts = row_losses(torch.zeros(2, 3, 4), batch, 1)
        >>> [round(x, 4) for x in loss[0].tolist()], counts.tolist()   # uniform over 4: ln 4
        ([1.3863, 1.3863], [2.0, 2.0])
    """
    tokens = batch.tokens.to(logits.device)
    valid = (batch.key_valid[:, :-1] & batch.key_valid[:, 1:]).to(logits.device)
    if targets is not None:
        valid = valid & targets[1:].to(logits.device)[None]
    valid = valid.float()
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = tokens[:, 1:].repeat(n_variants, 1)
    nll = -log_probs.gather(-1, target[..., None]).squeeze(-1).reshape(n_variants, *valid.shape)
    counts = valid.sum(-1)
    return (nll * valid).sum(-1) / counts.clamp(min=1.0), counts


def next_token_loss(
    logits: Tensor, batch: Batch, n_variants: int, targets: Tensor | None = None
) -> Tensor:
    """Mean next-token cross-entropy per variant ``[n_variants]`` over valid (token, next
    token) pairs whose next position is in ``targets`` (``[pos]`` bool; all by default);
    ``logits`` is ``[n_variants * batch, pos, vocab]`` (``row_losses`` pooled over the probes).

    Example:
        >>> import torch
        >>> from tl_dynamics.adapter import Batch
        >>> tokens = torch.tensor([[0, 1, 2]])
        >>> batch = Batch(tokens, torch.ones_like(tokens, dtype=torch.bool), "right")
        >>> float(next_token_loss(torch.zeros(1, 3, 4), batch, 1)[0])  # uniform over 4: ln 4
        1.3862943649291992
    """
    loss, counts = row_losses(logits, batch, n_variants, targets)
    return (loss * counts).sum(-1) / counts.sum().clamp(min=1.0)


class CausalRunner:
    """Runs the interventions of the asked heads on one prompt batch."""

    def __init__(
        self,
        adapter: ModelAdapter,
        batch: Batch,
        captures: dict[int, LayerAttention],
        targets: dict[str, Tensor | None],
    ):
        if adapter.is_encoder:
            raise TLDynamicsError(
                f"the causal evidence is a next-token loss, which the encoder "
                f"{adapter.info.architecture} does not have"
            )
        self.adapter, self.batch, self.captures, self.targets = adapter, batch, captures, targets
        self.expand: bool | None = False if batch.padded else None  # None: try it once
        with torch.no_grad():
            logits = adapter.forward(batch)
        # per target set: each probe's clean loss [rows] and its number of target pairs
        self.clean_rows: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor] = {}
        for name, t in targets.items():
            loss, counts = row_losses(logits, batch, 1, t)
            self.clean_rows[name], self.counts[name] = loss[0], counts
        self.clean = {
            name: float((self.clean_rows[name] * c).sum() / c.sum().clamp(min=1.0))
            for name, c in self.counts.items()
        }

    def _replacements(self, la: LayerAttention, heads: list[int]) -> dict[str, Tensor]:
        out = {"mean": position_mean(la.z(heads), self.batch.key_valid)[:, 0]}  # [b, head, d]
        sink = None if la.sink_logit is None else la.sink_logit[heads]  # a virtual key (§2.6)
        parts = odds_ratio.split_scores(
            la.q[:, :, heads], la.k[:, :, heads], la.scale, la.bias(heads), sink=sink
        )
        out["prior"], out["likelihood"] = odds_ratio.counterfactual_patterns(parts, la.allowed)
        return out

    def _forward(
        self,
        layer: int,
        variants: list[tuple[int, int, str]],
        repl: dict[str, Tensor],
        expand: bool,
    ) -> Tensor:
        """Loss ``[variant, target set, row]`` per variant ``(head, index into repl, kind)``."""
        n_rows, k = self.batch.tokens.shape[0], len(variants)

        def grow(x: Tensor) -> Tensor:
            return x.repeat(k, *([1] * (x.ndim - 1)))

        def patch_z(z: Tensor) -> Tensor:
            z = z.clone()
            for r, (head, i, kind) in enumerate(variants):
                if kind == "mean":
                    z[r * n_rows : (r + 1) * n_rows, :, head] = repl["mean"][:, None, i].to(z.dtype)
            return z

        def patch_pattern(p: Tensor) -> Tensor:
            p = p.clone()
            for r, (head, i, kind) in enumerate(variants):
                if kind != "mean":
                    p[r * n_rows : (r + 1) * n_rows, head] = repl[kind][:, i].to(p.dtype)
            return p

        patches = [("z", layer, patch_z), ("pattern", layer, patch_pattern)]
        batch = self.batch
        if expand:
            patches.insert(0, ("resid_pre", layer, grow))
        else:
            batch = Batch(
                tokens=grow(batch.tokens),
                key_valid=grow(batch.key_valid),
                padding_side=batch.padding_side,
            )
        with torch.no_grad(), self.adapter.patch(patches):
            logits = self.adapter.forward(batch)
        if logits.shape[0] != k * n_rows:
            raise TLDynamicsError(
                f"patched forward returned {logits.shape[0]} rows, expected {k * n_rows}"
            )
        return torch.stack(
            [row_losses(logits, self.batch, k, t)[0] for t in self.targets.values()], 1
        )

    def _chunk(self) -> int:
        rows, pos = self.batch.tokens.shape
        per_variant = rows * pos * int(self.adapter.W_U.shape[-1])
        return max(1, LOGIT_BUDGET // max(1, per_variant))

    def layer_deltas(self, layer: int, heads: Sequence[int]) -> dict[tuple[str, str], np.ndarray]:
        """``{(kind, target set): [len(heads), rows]}`` loss changes per probe (patched minus
        clean)."""
        heads = list(heads)
        repl = self._replacements(self.captures[layer], heads)
        variants = [(head, i, kind) for i, head in enumerate(heads) for kind in KINDS]
        losses: list[Tensor] = []
        step = self._chunk()
        for start in range(0, len(variants), step):
            part = variants[start : start + step]
            if self.expand is None:
                try:
                    losses.append(self._forward(layer, part, repl, expand=True))
                    self.expand = True
                    continue
                except Exception:  # the host carries a batch-shaped tensor past the hook
                    self.expand = False
            losses.append(self._forward(layer, part, repl, expand=self.expand))
        rows = self.batch.tokens.shape[0]
        loss = (
            torch.cat(losses)
            .reshape(len(heads), len(KINDS), len(self.targets), rows)
            .double()
            .cpu()
            .numpy()
        )
        return {
            (kind, name): loss[:, j, t] - self.clean_rows[name].double().cpu().numpy()[None]
            for j, kind in enumerate(KINDS)
            for t, name in enumerate(self.targets)
        }


def causal_deltas(
    adapter: ModelAdapter,
    batch: Batch,
    captures: dict[int, LayerAttention],
    selected: dict[int, list[int]],
    targets: dict[str, Tensor | None],
) -> tuple[dict[tuple[str, str], np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], bool]:
    """``({(kind, target set): [rows, n_layers, n_heads]}, clean loss per target set [rows],
    target pairs per target set [rows], whether the layer prefix was shared)``: every probe's
    loss change, NaN for heads not asked for. ``targets`` names sets of predicted positions
    (``[pos]`` bool, or None for all)."""
    runner = CausalRunner(adapter, batch, captures, targets)
    rows = batch.tokens.shape[0]
    out = {
        (kind, name): np.full((rows, adapter.n_layers, adapter.n_heads), np.nan)
        for kind in KINDS
        for name in targets
    }
    for layer, heads in selected.items():
        if heads:
            for key, value in runner.layer_deltas(layer, heads).items():
                out[key][:, layer, heads] = value.T
    clean = {k: v.double().cpu().numpy() for k, v in runner.clean_rows.items()}
    counts = {k: v.double().cpu().numpy() for k, v in runner.counts.items()}
    return out, clean, counts, bool(runner.expand)
