"""Entry points and the collector: ``compute`` (one prompt row), ``compute_rows`` (every row of a
batch in one forward pass) and ``attach`` (during your own runs; its ``ContextualMLPCollector`` is
driven by the adapter). Each head's MLP is built by ``_from_layer`` (``from_layer``: one head of a
captured layer).

``layers`` and ``heads`` follow the one convention of every analysis (``docs/developing.md``):
an index, a list of them, or None (all); the heads are taken in every selected layer.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from tl_dynamics.adapter import Batch, LayerAttention, LayerState, ModelAdapter, Prompt
from tl_dynamics.collect import Collector
from tl_dynamics.contextual_mlp._frame import RotaryFrame, build_frames
from tl_dynamics.contextual_mlp._from_layer import _check_row, _from_layer, _row_tensors
from tl_dynamics.contextual_mlp._mlp import ContextualMLP
from tl_dynamics.contextual_mlp._mlps import ContextualMLPs, LazyMLPs
from tl_dynamics.errors import TLDynamicsError


class ContextualMLPCollector(Collector):
    """What ``attach`` yields: collects the MLPs of the selected heads on every forward pass run
    while attached (of the rows ``rows``, every row when None).

    ``result(row, forward_pass)`` is a ``ContextualMLPs`` like ``compute``'s; ``results()`` gives
    one per row; ``mlps`` everything collected, in collection order (pass, layer, row, head).

    During the forward pass only the captured layer is kept (its ``q``, ``k``, ``v``, ``W_O``,
    masks and attention input, references to what the model computed). Nothing is formed at
    ``result()`` either: each head's MLP, its outgoing weights ``v_j W_O`` and the verification
    of its layer's rotary frame are formed when that head is first read, so collecting and
    asking for a result cost next to nothing (issue 21). A frame that does not reproduce the
    model's query raises then, before any number of that layer is given.
    """

    inputs = True
    sinks = True  # a learned sink is one more neuron (docs/math.md §3.7)

    def __init__(
        self,
        adapter: ModelAdapter,
        layers: list[int],
        heads: list[int],
        rows: list[int] | None = None,
        reference: bool = False,
    ):
        self.adapter, self.layers, self.heads = adapter, tuple(layers), list(heads)
        self.rows, self.reference = rows, reference
        # per pass, the captured layers in order, with the pass's batch
        self._passes: list[list[tuple[LayerAttention, Batch | None]]] = []
        self._batch: Batch | None = None

    def start_pass(self, batch: Batch | None) -> None:
        self._passes.append([])
        self._batch = batch

    def on_layer(self, state: LayerState) -> None:
        """One layer of one forward pass (kept, built when asked)."""
        la = state.attention
        if la is None or la.layer not in self.layers:
            return
        if self.rows is not None:
            for r in self.rows:
                _check_row(r, la.q.shape[0])
        self._passes[-1].append((la, self._batch))

    def _rows(self, la: LayerAttention) -> list[int]:
        return list(range(la.q.shape[0])) if self.rows is None else list(self.rows)

    def _frames(
        self, la: LayerAttention, batch: Batch | None, rows: list[int]
    ) -> list[RotaryFrame]:
        key_valid = batch.key_valid if batch is not None else la.allowed.any(dim=1)
        return build_frames(self.adapter, la, key_valid, rows=rows)

    def _build(
        self, la: LayerAttention, batch: Batch | None, rows: list[int]
    ) -> dict[int, dict[tuple[int, int], ContextualMLP]]:
        """The MLPs of the selected heads on ``rows`` of one captured layer."""
        heads = self.heads
        frames = self._frames(la, batch, rows)
        tokens = None if batch is None else batch.tokens
        out: dict[int, dict[tuple[int, int], ContextualMLP]] = {}
        for row in rows:
            names = self.adapter.str_tokens(batch, row) if batch is not None else None
            # this row's outgoing weights v_j W_O of the heads asked for, in one product
            outgoing = torch.einsum("jhd,hdm->hjm", la.v[row][:, heads], la.W_O[heads])
            shared = _row_tensors(la, row, tokens)
            for i, head in enumerate(heads):
                out.setdefault(row, {})[(la.layer, head)] = _from_layer(
                    self.adapter, la, head, row, frames[row], tokens, names, outgoing[i], shared
                )
        return out

    @property
    def n_passes(self) -> int:
        """Forward passes seen so far."""
        return len(self._passes)

    @property
    def mlps(self) -> tuple[ContextualMLP, ...]:
        out: list[ContextualMLP] = []
        for layers in self._passes:
            for la, batch in layers:
                for mlps in self._build(la, batch, self._rows(la)).values():
                    out.extend(mlps.values())
        return tuple(out)

    def _check_pass(self, forward_pass: int) -> None:
        if not self._passes:
            raise Collector.no_passes("contextual_mlp")
        if (
            isinstance(forward_pass, bool)
            or not isinstance(forward_pass, int)
            or not -len(self._passes) <= forward_pass < len(self._passes)
        ):
            raise TLDynamicsError(
                f"forward_pass {forward_pass!r} is out of range: {len(self._passes)} "
                f"pass(es) were collected"
            )

    def result(self, row: int = 0, forward_pass: int = 0) -> ContextualMLPs:
        """The MLPs of prompt row ``row`` in forward pass ``forward_pass`` (the first by default),
        each formed when first read."""
        self._check_pass(forward_pass)
        layers = self._passes[forward_pass]
        collected = sorted({r for la, _ in layers for r in self._rows(la)})
        if row not in collected:
            n = len(self._passes)
            later = (
                f"; {n} forward passes were collected, each its own rows: pick one with "
                f"forward_pass= (0..{n - 1}), e.g. result(row={collected[0]}, forward_pass=1)"
                if n > 1
                else ""
            )
            raise TLDynamicsError(
                f"row {row!r} was not collected in forward pass {forward_pass}; its rows: "
                f"{collected}{later}"
            )
        return self._lazy(layers, row)

    def _lazy(self, layers: list[tuple[LayerAttention, Batch | None]], row: int) -> ContextualMLPs:
        by_layer = {la.layer: (la, batch) for la, batch in layers}
        la, batch = layers[0]
        names = (
            tuple(self.adapter.str_tokens(batch, row))
            if batch is not None
            else tuple(str(i) for i in range(la.q.shape[1]))
        )
        # per layer, what its heads share, prepared once: the verified frame and the row's
        # copies of x, masks and tokens (one copy for every head, not one per head)
        prepared: dict[int, tuple[RotaryFrame, dict[str, torch.Tensor | None]]] = {}

        def form(layer: int, head: int) -> ContextualMLP:
            la, batch = by_layer[layer]
            tokens = None if batch is None else batch.tokens
            if layer not in prepared:
                prepared[layer] = (
                    self._frames(la, batch, [row])[row],
                    _row_tensors(la, row, tokens),
                )
            frame, shared = prepared[layer]
            return _from_layer(self.adapter, la, head, row, frame, tokens, names, None, shared)

        keys = [(layer, head) for layer in by_layer for head in self.heads]
        return ContextualMLPs(
            architecture=self.adapter.info.architecture,
            row=row,
            str_tokens=names,
            mlps=LazyMLPs(keys, form),
        )

    def results(self, forward_pass: int = 0) -> list[ContextualMLPs]:
        """One ``ContextualMLPs`` per collected row of forward pass ``forward_pass``."""
        if not self._passes:
            return []
        self._check_pass(forward_pass)
        layers = self._passes[forward_pass]
        rows = sorted({r for la, _ in layers for r in self._rows(la)})
        return [self._lazy(layers, row) for row in rows]


@contextmanager
def attach(
    model: Any,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    reference: bool = False,
) -> Iterator[ContextualMLPCollector]:
    """Build the contextual MLPs of the selected heads during every forward pass in the block.

    Yields a ``ContextualMLPCollector``: ``collector.result(row=0)`` is a ``ContextualMLPs`` as
    ``compute`` returns. Each pass's tokens (for labels) and padding mask are its own (the
    ``attention_mask`` your model call was given, or ``ModelAdapter.forward``'s batch). Hooks
    are removed on exit, even on errors.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        layers: a layer index, a list of them, or None (all attention layers).
        heads: a head index, a list of them, or None (all heads), in every selected layer.
        reference: keep the model's own head outputs and patterns (for ``exactness``).

    Returns:
        A context manager yielding the collector.

    Example:
        >>> from tl_dynamics import contextual_mlp, testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad = ModelAdapter(testing.tiny_model("llama"))
        >>> with contextual_mlp.attach(ad, layers=1, heads=[0, 2]) as collector:
        ...     _ = ad.forward(ad.tokenize("x = 1"))
        >>> collector.result().keys()
        [(1, 0), (1, 2)]
    """
    adapter = ModelAdapter.of(model)
    collector = ContextualMLPCollector(
        adapter, adapter.check_attention_layers(layers), adapter.check_heads(heads), None, reference
    )
    with adapter.collecting(collector):
        yield collector


def _run(
    model: Any,
    prompt: Prompt | Batch,
    layers: int | Sequence[int] | None,
    heads: int | Sequence[int] | None,
    rows: list[int] | None,
    reference: bool,
    padding_side: str,
) -> ContextualMLPCollector:
    adapter = ModelAdapter.of(model)
    layer_list, head_list = adapter.check_attention_layers(layers), adapter.check_heads(heads)
    batch = adapter.tokenize(prompt, padding_side)
    for row in rows or []:
        _check_row(row, batch.tokens.shape[0])
    collector = ContextualMLPCollector(adapter, layer_list, head_list, rows, reference)
    with adapter.collecting(collector):
        adapter.forward(batch)
    return collector


def compute(
    model: Any,
    prompt: Prompt | Batch,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    row: int = 0,
    reference: bool = True,
    padding_side: str = "right",
) -> ContextualMLPs:
    """The contextual MLPs of the selected heads on prompt row ``row`` (one forward pass).

    ``result[layer, head]`` is one head's ``ContextualMLP``; with ``reference`` the model's own
    head outputs and patterns are kept so each can check its exactness.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: text, a list of texts, ``[batch, pos]`` token ids or a ``Batch``.
        layers: a layer index, a list of them, or None (all attention layers).
        heads: a head index, a list of them, or None (all heads), in every selected layer.
        row: which prompt of the batch.
        reference: keep the model's own head outputs and patterns.
        padding_side: where a list of texts is padded.

    Returns:
        A ``ContextualMLPs``.

    Example:
        >>> from tl_dynamics import contextual_mlp, testing
        >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=0, heads=1)[0, 1]
        >>> mlp.exactness().max_output_error < 1e-5
        True
    """
    return _run(model, prompt, layers, heads, [row], reference, padding_side).result(row)


def compute_rows(
    model: Any,
    prompt: Prompt | Batch,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    reference: bool = True,
    padding_side: str = "right",
) -> list[ContextualMLPs]:
    """Like ``compute`` for every row of a batch at once (one forward pass).

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: a list of texts, ``[batch, pos]`` token ids or a ``Batch``.
        layers: a layer index, a list of them, or None (all attention layers).
        heads: a head index, a list of them, or None (all heads).
        reference: keep the model's own head outputs and patterns.
        padding_side: where a list of texts is padded.

    Returns:
        One ``ContextualMLPs`` per row.

    Example:
        >>> from tl_dynamics import contextual_mlp, testing
        >>> rows = contextual_mlp.compute_rows(testing.tiny_model("gpt2"), ["a b c", "d"], layers=1, heads=0)
        >>> [r.row for r in rows], [len(r[1, 0].positions) for r in rows]  # the second is padded
        ([0, 1], [4, 2])
    """
    return _run(model, prompt, layers, heads, None, reference, padding_side).results()
