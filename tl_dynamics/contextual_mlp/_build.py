"""Entry points: ``compute`` (one prompt row), ``compute_rows`` (every row of a batch in one
forward pass), ``attach`` (during your own runs) and ``from_layer`` (one head of a captured layer).

``layers`` and ``heads`` follow the one convention of every analysis (``docs/developing.md``):
an index, a list of them, or None (all); the heads are taken in every selected layer.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any, Iterator, Sequence

import torch

from tl_dynamics.adapter import Batch, LayerAttention, ModelAdapter, Prompt
from tl_dynamics.contextual_mlp._frame import RotaryFrame, build_frames, check_inputs
from tl_dynamics.contextual_mlp._mlp import ContextualMLP
from tl_dynamics.contextual_mlp._mlps import ContextualMLPs
from tl_dynamics.errors import TLDynamicsError


def _check_row(row: int, n_rows: int) -> int:
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < n_rows:
        raise TLDynamicsError(f"row {row!r} is out of range: the batch has {n_rows} rows "
                              f"(valid: 0..{n_rows - 1})")
    return row


def from_layer(adapter: ModelAdapter, la: LayerAttention, head: int, row: int = 0,
               frame: RotaryFrame | None = None, tokens: torch.Tensor | None = None,
               str_tokens: Sequence[str] | None = None) -> ContextualMLP:
    """Build one head's ``ContextualMLP`` from a captured layer (``inputs=True`` needed).

    For those who capture layers themselves (``adapter.capture``/``attention``); ``compute`` and
    ``attach`` do this for you. ``frame`` is the row's verified rotary frame (from
    ``build_frames``); required for rotary layers. With ``reference=True`` captures the result
    can check its own exactness.
    """
    return _from_layer(adapter, la, head, row, frame, tokens, str_tokens, None)


def _row_tensors(la: LayerAttention, row: int, tokens: torch.Tensor | None
                 ) -> dict[str, torch.Tensor | None]:
    """One row's copies of what every head of the layer shares (``x``, masks, tokens): taken
    once per row and layer, not once per head (at 1,024 tokens, 144 copies of ``x`` were 453 MB
    and a third of ``result()``'s time; issue 15). Nothing mutates them."""
    return {"x": la.reference["x"][row].clone(), "allowed": la.allowed[row].clone(),
            "query_valid": la.query_valid[row].clone(),
            "tokens": None if tokens is None else tokens[row].clone()}


def _from_layer(adapter: ModelAdapter, la: LayerAttention, head: int, row: int,
                frame: RotaryFrame | None, tokens: torch.Tensor | None,
                str_tokens: Sequence[str] | None, outgoing: torch.Tensor | None,
                shared: dict[str, torch.Tensor | None] | None = None) -> ContextualMLP:
    """``from_layer`` with the head's outgoing weights ``v_j W_O`` given (None: computed) and
    the row's shared copies (``_row_tensors``; None: taken here)."""
    la.require_no_sinks("contextual_mlp.from_layer")
    head = adapter.check_head(head, la.layer)
    n_batch, n_pos = la.q.shape[:2]
    row = _check_row(row, n_batch)
    check_inputs(adapter, la)
    if frame is None:
        if la.spec.rotary != "none":
            raise TLDynamicsError(f"layer {la.layer} is rotary: pass its verified frame "
                                  "(contextual_mlp.build_frames) or use compute()")
        frame = RotaryFrame()
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
    shared = _row_tensors(la, row, tokens) if shared is None else shared
    return ContextualMLP(
        layer=la.layer, head=head, row=row, architecture=adapter.info.architecture,
        tokens=shared["tokens"], str_tokens=names, x=shared["x"], keys=la.k[row, :, head].clone(),
        outgoing=(la.v[row, :, head] @ la.W_O[head]) if outgoing is None else outgoing,
        W_Q=adapter.W_Q(la.layer)[head], b_Q=adapter.b_Q(la.layer)[head],
        scale=la.scale, softcap=la.softcap, allowed=shared["allowed"],
        query_valid=shared["query_valid"], bias=None if bias is None else bias.clone(),
        frame=frame, reference_pattern=ref_pattern, reference_output=ref_output,
        query_norm=adapter.query_norm(la.layer))


class ContextualMLPCollector:
    """What ``attach`` yields: collects the MLPs of the selected heads on every forward pass run
    while attached (of the rows ``rows``, every row when None).

    ``result(row, forward_pass)`` is a ``ContextualMLPs`` like ``compute``'s; ``results()`` gives
    one per row; ``mlps`` everything collected, in collection order (pass, layer, row, head).

    During the forward pass only the captured layer is kept (its ``q``, ``k``, ``v``, ``W_O``,
    masks and attention input); the rotary frames are verified and the ``ContextualMLP`` objects
    are built when a result is asked for, so attaching costs little more than the capture
    (issue 15). A frame that does not reproduce the model's query raises then.
    """

    def __init__(self, adapter: ModelAdapter, layers: list[int], heads: list[int],
                 rows: list[int] | None = None, batch: Batch | None = None,
                 reference: bool = False):
        self.adapter, self.layers, self.heads = adapter, layers, heads
        self.rows, self.batch, self.reference = rows, batch, reference
        # per pass, the captured layers in order, with the batch that was given for them
        self._passes: list[list[tuple[LayerAttention, Batch | None]]] = []
        self._seen: set[int] = set()

    def on_layer(self, la: LayerAttention) -> None:
        """The capture callback: one layer of one forward pass (kept, built when asked)."""
        if not self._passes or la.layer in self._seen:
            self._passes.append([])
            self._seen = set()
        self._seen.add(la.layer)
        if self.rows is not None:
            for r in self.rows:
                _check_row(r, la.q.shape[0])
        if self._passes[-1]:  # every layer's mask is usually the same: keep one copy
            prev = self._passes[-1][-1][0].allowed
            if prev.shape == la.allowed.shape and torch.equal(prev, la.allowed):
                la = replace(la, allowed=prev)
        self._passes[-1].append((la, self.batch))

    def _rows(self, la: LayerAttention) -> list[int]:
        return list(range(la.q.shape[0])) if self.rows is None else list(self.rows)

    def _build(self, la: LayerAttention, batch: Batch | None, rows: list[int],
               masks: dict[tuple[int, int], torch.Tensor] | None = None
               ) -> dict[int, dict[tuple[int, int], ContextualMLP]]:
        """The MLPs of ``rows`` of one captured layer; ``masks`` shares each row's mask copy
        between the layers of a pass (keyed by the captured mask and the row)."""
        key_valid = batch.key_valid if batch is not None else la.allowed.any(dim=1)
        frames = build_frames(self.adapter, la, key_valid, rows=rows)
        tokens = None if batch is None else batch.tokens
        masks = {} if masks is None else masks
        out: dict[int, dict[tuple[int, int], ContextualMLP]] = {}
        for row in rows:
            names = self.adapter.str_tokens(batch, row) if batch is not None else None
            # this row's outgoing weights v_j W_O of every selected head, in one product
            outgoing = torch.einsum("jhd,hdm->hjm", la.v[row][:, self.heads], la.W_O[self.heads])
            shared = _row_tensors(la, row, tokens)
            # one copy of a row's mask for every layer of the pass (the collector keeps one)
            shared["allowed"] = masks.setdefault((id(la.allowed), row), shared["allowed"])
            for i, head in enumerate(self.heads):
                out.setdefault(row, {})[(la.layer, head)] = _from_layer(
                    self.adapter, la, head, row, frames[row], tokens, names, outgoing[i], shared)
        return out

    def _pass(self, forward_pass: int, rows: list[int] | None = None
              ) -> dict[int, dict[tuple[int, int], ContextualMLP]]:
        by_row: dict[int, dict[tuple[int, int], ContextualMLP]] = {}
        masks: dict[tuple[int, int], torch.Tensor] = {}
        for la, batch in self._passes[forward_pass]:
            wanted = [r for r in self._rows(la) if rows is None or r in rows]
            for row, mlps in self._build(la, batch, wanted, masks).items():
                by_row.setdefault(row, {}).update(mlps)
        return by_row

    def capture(self) -> AbstractContextManager:
        """The per-layer capture that collects (hooks removed on exit, even on errors)."""
        return self.adapter.capture(self.on_layer, self.layers, reference=self.reference,
                                    inputs=True, batch=self.batch)

    @property
    def n_passes(self) -> int:
        """Forward passes seen so far."""
        return len(self._passes)

    @property
    def mlps(self) -> tuple[ContextualMLP, ...]:
        out: list[ContextualMLP] = []
        for layers in self._passes:
            masks: dict[tuple[int, int], torch.Tensor] = {}
            for la, batch in layers:
                for mlps in self._build(la, batch, self._rows(la), masks).values():
                    out.extend(mlps.values())
        return tuple(out)

    def result(self, row: int = 0, forward_pass: int = 0) -> ContextualMLPs:
        """The MLPs of prompt row ``row`` in forward pass ``forward_pass`` (the first by default)."""
        if not self._passes:
            raise TLDynamicsError("nothing was collected: run a forward pass inside the attach block")
        if isinstance(forward_pass, bool) or not isinstance(forward_pass, int) or \
                not -len(self._passes) <= forward_pass < len(self._passes):
            raise TLDynamicsError(f"forward_pass {forward_pass!r} is out of range: {len(self._passes)} "
                                  f"pass(es) were collected")
        collected = sorted({r for la, _ in self._passes[forward_pass] for r in self._rows(la)})
        if row not in collected:
            raise TLDynamicsError(f"row {row!r} was not collected; collected rows: {collected}")
        mlps = self._pass(forward_pass, [row])[row]
        return ContextualMLPs(architecture=self.adapter.info.architecture, row=row,
                              str_tokens=next(iter(mlps.values())).str_tokens, mlps=dict(mlps))

    def results(self, forward_pass: int = 0) -> list[ContextualMLPs]:
        """One ``ContextualMLPs`` per collected row of forward pass ``forward_pass``."""
        if not self._passes:
            return []
        by_row = self._pass(forward_pass)
        return [ContextualMLPs(architecture=self.adapter.info.architecture, row=row,
                               str_tokens=next(iter(by_row[row].values())).str_tokens,
                               mlps=dict(by_row[row])) for row in sorted(by_row)]


@contextmanager
def attach(model: Any, *, layers: int | Sequence[int] | None = None,
           heads: int | Sequence[int] | None = None, batch: Batch | None = None,
           reference: bool = False) -> Iterator[ContextualMLPCollector]:
    """Build the contextual MLPs of the selected heads during every forward pass in the block.

    Yields a ``ContextualMLPCollector``: ``collector.result(row=0)`` is a ``ContextualMLPs`` as
    ``compute`` returns. ``batch`` gives tokens (for labels) and the padding mask of inputs you
    run yourself. Hooks are removed on exit, even on errors.

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
    collector = ContextualMLPCollector(adapter, adapter.check_layers(layers),
                                       adapter.check_heads(heads), None, batch, reference)
    with collector.capture():
        yield collector


def _run(model: Any, prompt: Prompt | Batch, layers: int | Sequence[int] | None,
         heads: int | Sequence[int] | None, rows: list[int] | None, reference: bool,
         padding_side: str) -> ContextualMLPCollector:
    adapter = ModelAdapter.of(model)
    layer_list, head_list = adapter.check_layers(layers), adapter.check_heads(heads)
    batch = adapter.tokenize(prompt, padding_side)
    for row in rows or []:
        _check_row(row, batch.tokens.shape[0])
    collector = ContextualMLPCollector(adapter, layer_list, head_list, rows, batch, reference)
    with collector.capture():
        adapter.forward(batch)
    return collector


def compute(model: Any, prompt: Prompt | Batch, *, layers: int | Sequence[int] | None = None,
            heads: int | Sequence[int] | None = None, row: int = 0, reference: bool = True,
            padding_side: str = "right") -> ContextualMLPs:
    """The contextual MLPs of the selected heads on prompt row ``row`` (one forward pass).

    ``result[layer, head]`` is one head's ``ContextualMLP``; with ``reference`` the model's own
    head outputs and patterns are kept so each can check its exactness.

    Example:
        >>> from tl_dynamics import contextual_mlp, testing
        >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=0, heads=1)[0, 1]
        >>> mlp.exactness().max_output_error < 1e-5
        True
    """
    return _run(model, prompt, layers, heads, [row], reference, padding_side).result(row)


def compute_rows(model: Any, prompt: Prompt | Batch, *, layers: int | Sequence[int] | None = None,
                 heads: int | Sequence[int] | None = None, reference: bool = True,
                 padding_side: str = "right") -> list[ContextualMLPs]:
    """Like ``compute`` for every row of a batch at once (one forward pass): one
    ``ContextualMLPs`` per row.

    Example:
        >>> from tl_dynamics import contextual_mlp, testing
        >>> rows = contextual_mlp.compute_rows(testing.tiny_model("gpt2"), ["a b c", "d"], layers=1, heads=0)
        >>> [r.row for r in rows], [len(r[1, 0].positions) for r in rows]  # the second is padded
        ([0, 1], [4, 2])
    """
    return _run(model, prompt, layers, heads, None, reference, padding_side).results()
