"""Per-prompt circuits: a head's QK and OV tables restricted to one prompt's tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.circuits._build import checked_head, keys, ov_notes, qk_notes, queries, values
from tl_dynamics.circuits._views import Panel, heatmaps
from tl_dynamics.errors import TLDynamicsError


@dataclass(frozen=True)
class PromptCircuit(viz.Result):
    """One head's circuits on a prompt's tokens.

    ``qk[i, j]``: the score query token ``i`` gives key token ``j`` through the tokens alone
    (plus learned positions / the rotary offset ``i - j`` when ``positions``); ``allowed[i, j]``
    whether the model lets ``i`` attend to ``j``. ``ov[i, j]``: the logit of token ``j`` that
    attending to token ``i`` writes (direct path).
    """

    layer: int
    head: int
    tokens: tuple[str, ...]
    token_ids: Int[Tensor, " pos"]
    qk: Float[Tensor, "pos pos"]
    ov: Float[Tensor, "pos pos"]
    allowed: Bool[Tensor, "pos pos"]
    positions: bool
    notes: tuple[str, ...]
    architecture: str

    def __repr__(self) -> str:
        return f"PromptCircuit(L{self.layer}H{self.head}, {len(self.tokens)} tokens, positions={self.positions})"

    def pattern(self) -> Float[Tensor, "pos pos"]:
        """Softmax of ``qk`` over allowed keys: the pattern these circuits alone would give."""
        masked = self.qk.masked_fill(~self.allowed, float("-inf"))
        return torch.softmax(masked, -1).nan_to_num(0.0)

    def to_dataframe(self):
        import pandas as pd

        n = len(self.tokens)
        i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        frame = pd.DataFrame(
            dict(
                i=i.reshape(-1).numpy(),
                j=j.reshape(-1).numpy(),
                token_i=[self.tokens[a] for a in i.reshape(-1).tolist()],
                token_j=[self.tokens[b] for b in j.reshape(-1).tolist()],
                qk=self.qk.reshape(-1).numpy(),
                ov=self.ov.reshape(-1).numpy(),
                allowed=self.allowed.reshape(-1).numpy(),
            )
        )
        frame.attrs.update(layer=self.layer, head=self.head, positions=self.positions)
        return frame

    def show(self) -> viz.Group:
        """The pattern these circuits alone would give (circuitsvis) and heat maps of the QK
        table (disallowed keys blank) and the OV table."""
        labels = [f"{k}:{t!r}" for k, t in enumerate(self.tokens)]
        qk = self.qk.masked_fill(~self.allowed, float("nan")).numpy()
        name = f"L{self.layer}H{self.head}"
        return viz.group(
            viz.attention_pattern(
                list(self.tokens),
                self.pattern(),
                caption=f"{name}: softmax of the per-prompt QK circuit",
            ),
            heatmaps(
                [
                    Panel(f"QK {name} (query row, key column)", qk, labels, labels),
                    Panel(
                        f"OV {name} (source row, output token column)",
                        self.ov.numpy().astype(np.float32),
                        labels,
                        labels,
                    ),
                ],
                caption=f"Per-prompt circuits of {name}"
                f"{' with positions' if self.positions else ''}",
            ),
        )


def prompt_circuit(
    model: Any, prompt: Any, layer: int, head: int, positions: bool = True, biases: bool = True
) -> PromptCircuit:
    """QK and OV tables of one head restricted to the tokens of ``prompt`` (one row).

    With ``positions`` the inputs are ``W_E + W_pos`` on models with learned positions, and
    query ``i`` and key ``j`` are rotated by their positions on rotary layers (so entry
    ``[i, j]`` is the circuit at offset ``i - j``); without, tokens alone.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: one prompt (text, ``[1, pos]`` token ids or a one-row ``Batch``).
        layer: the head's layer.
        head: the head's index.
        positions: include learned positions / rotary offsets.
        biases: include ``b_Q``, ``b_K`` and ``b_V``.

    Returns:
        ``PromptCircuit``: ``qk`` and ``ov`` ``[pos, pos]``, ``allowed`` ``[pos, pos]`` (the mask)
        and the prompt's ``tokens``.

    Example:
        >>> from tl_dynamics import circuits, testing
        >>> pc = circuits.prompt_circuit(testing.tiny_model("llama"), "a = b", 1, 0)
        >>> pc.qk.shape, pc.ov.shape, len(pc.tokens)
        (torch.Size([4, 4]), torch.Size([4, 4]), 4)
    """
    adapter = ModelAdapter.of(model)
    layer, head = checked_head(adapter, layer, head)
    batch = adapter.tokenize(prompt)
    if batch.tokens.shape[0] != 1:
        raise TLDynamicsError(
            f"prompt_circuit takes one prompt, got a batch of {batch.tokens.shape[0]}"
        )
    keep = batch.key_valid[0]
    ids = batch.tokens[0][keep]
    n = len(ids)
    pos = torch.arange(n)
    rows = adapter.W_E[ids]
    if positions and adapter.W_pos is not None:
        rows = rows + adapter.W_pos[pos]
    q = queries(adapter, layer, head, rows, biases)
    k = keys(adapter, layer, head, rows, biases)
    rmap = adapter.rotation(layer)
    if positions and rmap is not None:
        q, k = rmap.rotate(q, pos), rmap.rotate(k, pos)
    spec = adapter.specs[layer]
    allowed = torch.ones(n, n, dtype=torch.bool)
    if spec.causal:
        allowed &= pos[None, :] <= pos[:, None]
    if spec.window is not None:
        allowed &= pos[None, :] > pos[:, None] - spec.window
        if not spec.causal:  # bidirectional: two-sided window
            allowed &= pos[None, :] < pos[:, None] + spec.window
    ov = values(adapter, layer, head, rows, biases) @ (
        adapter.W_O(layer)[head] @ adapter.W_U[:, ids]
    )
    notes = qk_notes(adapter, layer, biases, None) + ov_notes(adapter, biases, layer)[:1]
    if positions and (rmap is not None or adapter.W_pos is not None):
        notes.append(
            "Positions included: "
            + (
                "rotary offsets i - j."
                if rmap is not None
                else "learned position embeddings added to W_E."
            )
        )
    tokens = adapter.decode(ids)
    return PromptCircuit(
        layer,
        head,
        tuple(tokens),
        ids.cpu(),
        (q @ k.T).cpu(),
        ov.cpu(),
        allowed,
        positions,
        tuple(dict.fromkeys(notes)),
        adapter.info.architecture,
    )
