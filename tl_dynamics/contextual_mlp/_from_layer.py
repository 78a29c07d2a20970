"""``from_layer``: one head's ``ContextualMLP`` built from a captured layer (what ``compute``
and ``attach``'s collector do for every selected head), and the row checks they share."""

from __future__ import annotations

from typing import Sequence

import torch

from tl_dynamics.adapter import LayerAttention, ModelAdapter
from tl_dynamics.contextual_mlp._frame import RotaryFrame, check_inputs
from tl_dynamics.contextual_mlp._mlp import ContextualMLP
from tl_dynamics.errors import TLDynamicsError


def _check_row(row: int, n_rows: int) -> int:
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < n_rows:
        raise TLDynamicsError(
            f"row {row!r} is out of range: the batch has {n_rows} rows (valid: 0..{n_rows - 1})"
        )
    return row


def from_layer(
    adapter: ModelAdapter,
    la: LayerAttention,
    head: int,
    row: int = 0,
    frame: RotaryFrame | None = None,
    tokens: torch.Tensor | None = None,
    str_tokens: Sequence[str] | None = None,
) -> ContextualMLP:
    """Build one head's ``ContextualMLP`` from a captured layer (``inputs=True`` needed).

    For those who capture layers themselves (``adapter.capture``/``attention``); ``compute`` and
    ``attach`` do this for you. ``frame`` is the row's verified rotary frame (from
    ``build_frames``); required for rotary layers. With ``reference=True`` captures the result
    can check its own exactness.
    """
    return _from_layer(adapter, la, head, row, frame, tokens, str_tokens, None)


def _row_tensors(
    la: LayerAttention, row: int, tokens: torch.Tensor | None
) -> dict[str, torch.Tensor | None]:
    """One row's copies of what every head of the layer shares (``x``, masks, tokens): taken
    once per row and layer, not once per head (at 1,024 tokens, 144 copies of ``x`` were 453 MB
    and a third of ``result()``'s time; issue 15). Nothing mutates them."""
    return {
        "x": la.reference["x"][row].clone(),
        "allowed": la.allowed[row].clone(),
        "query_valid": la.query_valid[row].clone(),
        "tokens": None if tokens is None else tokens[row].clone(),
    }


def _from_layer(
    adapter: ModelAdapter,
    la: LayerAttention,
    head: int,
    row: int,
    frame: RotaryFrame | None,
    tokens: torch.Tensor | None,
    str_tokens: Sequence[str] | None,
    outgoing: torch.Tensor | None,
    shared: dict[str, torch.Tensor | None] | None = None,
) -> ContextualMLP:
    """``from_layer`` with the head's outgoing weights ``v_j W_O`` given (None: computed) and
    the row's shared copies (``_row_tensors``; None: taken here)."""
    la.require_ungated("contextual_mlp.from_layer")  # outgoing weights v_j W_O: no gate
    head = adapter.check_head(head, la.layer)
    n_batch, n_pos = la.q.shape[:2]
    row = _check_row(row, n_batch)
    check_inputs(adapter, la)
    if frame is None:
        if la.spec.rotary != "none" or la.spec.latent:
            raise TLDynamicsError(
                f"layer {la.layer} is rotary: pass its verified frame "
                "or use contextual_mlp.compute or attach, which verify it"
            )
        frame = RotaryFrame()
    bias = la.bias([head])
    if bias is not None:
        bias = bias.expand(n_batch, 1, n_pos, n_pos)[row, 0]
    ref_pattern, ref_output = None, None
    if "pattern" in la.reference:
        ref_pattern = la.reference["pattern"][row, head]
    if "z" in la.reference:
        z = la.reference["z"].reshape(n_batch, n_pos, adapter.n_heads, la.v.shape[-1])
        ref_output = z[row, :, head] @ la.W_O[head]
    names = tuple(str_tokens) if str_tokens is not None else tuple(str(i) for i in range(n_pos))
    shared = _row_tensors(la, row, tokens) if shared is None else shared
    return ContextualMLP(
        layer=la.layer,
        head=head,
        row=row,
        architecture=adapter.info.architecture,
        tokens=shared["tokens"],
        str_tokens=names,
        x=shared["x"],
        keys=la.k[row, :, head].clone(),
        outgoing=(la.v[row, :, head] @ la.W_O[head]) if outgoing is None else outgoing,
        W_Q=adapter.W_Q(la.layer)[head],
        b_Q=adapter.b_Q(la.layer)[head],
        scale=la.scale,
        softcap=la.softcap,
        allowed=shared["allowed"],
        query_valid=shared["query_valid"],
        bias=None if bias is None else bias.clone(),
        frame=frame,
        reference_pattern=ref_pattern,
        reference_output=ref_output,
        query_norm=adapter.query_norm(la.layer),
        sink_logit=None if la.sink_logit is None else float(la.sink_logit[head]),
    )
