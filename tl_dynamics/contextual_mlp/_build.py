"""Entry points: ``compute`` (one call), ``compute_layer`` and ``attach`` (during your own runs)."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Sequence

import torch

from tl_dynamics.adapter import Batch, LayerAttention, ModelAdapter, Prompt
from tl_dynamics.contextual_mlp._frame import RotaryFrame, build_frames, check_inputs, cos_sin_hooks
from tl_dynamics.contextual_mlp._mlp import ContextualMLP
from tl_dynamics.errors import TLDynamicsError




def from_layer(adapter: ModelAdapter, la: LayerAttention, head: int, row: int = 0,
               frame: RotaryFrame | None = None, tokens: torch.Tensor | None = None,
               str_tokens: Sequence[str] | None = None) -> ContextualMLP:
    """Build one head's ``ContextualMLP`` from a captured layer (``inputs=True`` needed).

    ``frame`` is the row's verified rotary frame (from ``build_frames``); required for rotary
    layers. With ``reference=True`` captures the result can check its own exactness.
    """
    head = adapter.check_head(head, la.layer)
    n_batch, n_pos = la.q.shape[:2]
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < n_batch:
        raise TLDynamicsError(f"row {row!r} is out of range: the batch has {n_batch} rows "
                              f"(valid: 0..{n_batch - 1})")
    check_inputs(adapter, la)
    if frame is None:
        if la.spec.rotary != "none":
            raise TLDynamicsError(f"layer {la.layer} is rotary: pass its verified frame "
                                  "(contextual_mlp.build_frames) or use compute()")
        frame = RotaryFrame("none")
    bias = la.bias([head])
    if bias is not None:
        bias = bias.expand(n_batch, 1, n_pos, n_pos)[row, 0]
    ref_pattern, ref_output = None, None
    if "pattern" in la.reference:
        ref_pattern = la.reference["pattern"][row, head]
    if "z" in la.reference:
        z = la.reference["z"].reshape(n_batch, n_pos, adapter.n_heads, adapter.d_head)
        ref_output = z[row, :, head] @ la.W_O[head]
    names = tuple(str_tokens) if str_tokens is not None else tuple(str(i) for i in range(n_pos))
    return ContextualMLP(
        layer=la.layer, head=head, row=row, architecture=adapter.info.architecture,
        tokens=None if tokens is None else tokens[row].clone(), str_tokens=names,
        x=la.reference["x"][row].clone(), keys=la.k[row, :, head].clone(),
        outgoing=la.source_outputs([head])[row, :, 0].clone(),
        W_Q=adapter.W_Q(la.layer)[head], b_Q=adapter.b_Q(la.layer)[head],
        scale=la.scale, softcap=la.softcap, allowed=la.allowed[row].clone(),
        query_valid=la.query_valid[row].clone(), bias=None if bias is None else bias.clone(),
        frame=frame, reference_pattern=ref_pattern, reference_output=ref_output,
        query_norm=adapter.query_norm(la.layer))


def _layer_mlps(adapter: ModelAdapter, la: LayerAttention, heads: list[int], captured: dict,
                batch: Batch | None) -> list[ContextualMLP]:
    key_valid = batch.key_valid if batch is not None else la.allowed.any(dim=1)
    frames = build_frames(adapter, la, key_valid, captured)
    out = []
    for row in range(la.q.shape[0]):
        names = adapter.str_tokens(batch, row) if batch is not None else None
        for head in heads:
            out.append(from_layer(adapter, la, head, row, frames[row],
                                  None if batch is None else batch.tokens, names))
    return out


@contextmanager
def attach(model: Any, layers: int | Sequence[int] | None = None,
           heads: int | Sequence[int] | None = None, batch: Batch | None = None,
           reference: bool = False) -> Iterator[list[ContextualMLP]]:
    """Collect ``ContextualMLP`` objects during every forward pass inside the block.

    Yields a list that fills with one MLP per (forward pass, layer, batch row, head). ``batch``
    gives tokens (for labels) and the padding mask of inputs you run yourself. Hooks are removed
    on exit, even on errors.

    Example:
        >>> from tl_dynamics import contextual_mlp, testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad = ModelAdapter(testing.tiny_model("llama"))
        >>> with contextual_mlp.attach(ad, layers=1, heads=[0, 2]) as mlps:
        ...     _ = ad.forward(ad.tokenize("x = 1"))
        >>> [(m.layer, m.head) for m in mlps]
        [(1, 0), (1, 2)]
    """
    adapter = ModelAdapter.of(model)
    layer_list = adapter.check_layers(layers)
    head_list = adapter.check_heads(heads)
    captured: dict = {}
    collected: list[ContextualMLP] = []

    def on_layer(la: LayerAttention) -> None:
        collected.extend(_layer_mlps(adapter, la, head_list, captured, batch))

    with ExitStack() as stack:
        stack.enter_context(adapter.hooks(cos_sin_hooks(adapter, layer_list, captured)))
        stack.enter_context(adapter.capture(on_layer, layer_list, reference=reference, inputs=True,
                                            batch=batch))
        yield collected


def compute_layer(model: Any, prompt: Prompt | Batch, layer: int,
                  heads: int | Sequence[int] | None = None, reference: bool = True,
                  padding_side: str = "right") -> list[ContextualMLP]:
    """Every asked head of ``layer`` on every row of ``prompt`` (one forward pass).

    Returns the MLPs in (row, head) order.
    """
    adapter = ModelAdapter.of(model)
    adapter.check_layer(layer)
    batch = adapter.tokenize(prompt, padding_side)
    with attach(adapter, [layer], heads, batch=batch, reference=reference) as mlps:
        adapter.forward(batch)
    return list(mlps)


def compute(model: Any, prompt: Prompt | Batch, layer: int, head: int, row: int = 0,
            reference: bool = True, padding_side: str = "right") -> ContextualMLP:
    """One head's contextual MLP on one prompt row.

    Example:
        >>> from tl_dynamics import contextual_mlp, testing
        >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layer=0, head=1)
        >>> mlp.exactness().max_output_error < 1e-5
        True
    """
    adapter = ModelAdapter.of(model)
    adapter.check_layer(layer)
    adapter.check_head(head, layer)
    batch = adapter.tokenize(prompt, padding_side)
    n_rows = batch.tokens.shape[0]
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < n_rows:
        raise TLDynamicsError(f"row {row!r} is out of range: the prompt has {n_rows} rows "
                              f"(valid: 0..{n_rows - 1})")
    mlps = compute_layer(adapter, batch, layer, [head], reference, padding_side)
    return mlps[row]
