"""One collector pass: every collector attached to a model shares one set of hooks and, per
layer, one ``LayerState`` (the layer's ``LayerAttention``, assembled once, with its memoised
scores and log-softmax; the pass's masks; the residual points), handed to each in turn.

The adapter knows where a pass starts and ends (the model's own forward pre- and post-hooks), and
its ``Batch``: the one ``ModelAdapter.forward`` ran, or else the token ids and ``attention_mask``
the model was called with (text is tokenised as the model tokenises it). Collectors get that
batch in ``start_pass``; nothing else carries a padding mask to them."""

from __future__ import annotations

import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor

from tl_dynamics.adapter import _capture
from tl_dynamics.adapter._batch import Batch
from tl_dynamics.adapter._collect import REFERENCE_ROLES, assemble, refuse_sinks
from tl_dynamics.adapter._gate import gate_refusal
from tl_dynamics.adapter._gemma4 import keep_kv, kv_source_roles
from tl_dynamics.adapter._layer import LayerAttention
from tl_dynamics.adapter._postrope import extra_roles
from tl_dynamics.collect import Collector
from tl_dynamics.errors import TLDynamicsError

ATTENTION_ROLES = ("q", "k", "v", "rot_q", "rot_k", "cos", "sin")
POINT_ROLES = ("resid_pre", "resid_mid", "resid_post")


@dataclass(frozen=True)
class LayerState:
    """What every attached collector reads of one layer of one forward pass.

    Args:
        layer: The layer's index.
        batch: The pass's tokens and padding (None when the model was called with something that
            is not token ids or text).
        attention: The layer's ``LayerAttention`` (None when no collector asked for this
            layer's attention).
        points: The residual states asked for at this layer, role -> ``[batch, pos, d_model]``.
        shared: A memo that lives for the pass, where collectors keep what every layer of the pass
            shares (mask facts).

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> from tl_dynamics.collect import Collector
        >>> class Keep(Collector):
        ...     layers, states = (1,), []
        ...     def on_layer(self, state):
        ...         self.states.append(state)
        >>> adapter, keep = ModelAdapter(testing.cached_model("gpt2")), Keep()
        >>> with adapter.collecting(keep):
        ...     _ = adapter.forward(adapter.tokenize("a b"))
        >>> state = keep.states[0]
        >>> state.layer, state.attention.n_heads, state.batch.tokens.shape
        (1, 4, torch.Size([1, 3]))
    """

    layer: int
    batch: Batch | None
    attention: LayerAttention | None
    points: dict[str, Tensor]
    shared: dict[Any, Any]


@dataclass
class _Pass:
    batch: Batch | None
    shared: dict[Any, Any] = field(default_factory=dict)
    current: int | None = None
    stash: dict[str, Tensor] = field(default_factory=dict)


class Hub:
    """The collectors attached to one model, and the hooks that feed them."""

    def __init__(self) -> None:
        # the ModelAdapter of the attached collectors, held only while some are attached: the
        # hubs are kept per model in a weak mapping, so nothing here may keep the model alive
        self.adapter: Any = None
        self.collectors: list[Collector] = []
        self.pending: Batch | None = None  # the Batch ModelAdapter.forward is running
        self._pass: _Pass | None = None
        self._hooks: ExitStack | None = None

    # ------------------------------------------------------------------ attaching
    def check(self, collector: Collector) -> None:
        """Refuse, before anything is hooked, what ``collector`` asks for and cannot have: other
        layer kinds, learned sinks (unless ``collector.sinks``), gated layers (unless
        ``collector.gates``: it models the output gate on ``z``, or reads no value), and, when it
        forms queries from the attention input (``query_frames``, by default ``inputs``), layers
        whose query is not the rotation of ``N(x W_Q)`` (``ModelAdapter.query_norm`` refuses)."""
        ad = self.adapter
        layers = ad.check_attention_layers(list(collector.layers)) if collector.layers else []
        if not collector.sinks:
            refuse_sinks(ad.specs, layers, ad.info.architecture)
        gated = [layer for layer in layers if ad.specs[layer].gate is not None]
        if gated and not collector.gates:  # it does not model an output gate
            raise gate_refusal(ad.specs[gated[0]], ad.info.architecture, type(collector).__name__)
        frames = collector.inputs if collector.query_frames is None else collector.query_frames
        if frames:  # it forms queries from x
            for layer in layers:
                ad.query_norm(layer)  # refuses a query that is not N(x W_Q) rotated (_postrope)
        for role, layer in collector.points:
            if role not in POINT_ROLES:
                raise TLDynamicsError(
                    f"unknown residual point {role!r}; valid: {list(POINT_ROLES)}"
                )
            ad.check_layer(layer)
        for (role, layer), name in zip(collector.points, ad.hook_names(list(collector.points))):
            if name is None:
                raise TLDynamicsError(
                    f"{ad.info.architecture} has no {role!r} point at layer {layer}"
                )
        for layer in layers:  # read before hooking: reading may run a probe forward pass
            ad.rotation(layer)

    @contextmanager
    def attached(self, collector: Collector, adapter: Any) -> Iterator[None]:
        if any(c is collector for c in self.collectors):  # attached already (a nested block)
            yield
            return
        if not self.collectors:
            self.adapter = adapter
        try:
            self.check(collector)
            self.collectors.append(collector)
            self._register()
            yield
        finally:
            if any(c is collector for c in self.collectors):
                self.collectors.remove(collector)
                self._register()
            if not self.collectors:
                self.adapter = None

    def _register(self) -> None:
        if self._hooks is not None:
            self._hooks.close()
            self._hooks = None
        self._pass = None
        if not self.collectors:
            return
        ad, wanted = self.adapter, []
        layers = sorted(
            {la for c in self.collectors for la in c.layers}
            | {layer for c in self.collectors for _, layer in c.points}
        )
        for layer in layers:
            roles = [r for c in self.collectors for r, l in c.points if l == layer]
            if any(layer in c.layers for c in self.collectors):
                roles += list(ATTENTION_ROLES) + extra_roles(
                    ad.specs[layer]
                )  # gate, post-rotary norms
                if any(c.reference and layer in c.layers for c in self.collectors):
                    roles += list(REFERENCE_ROLES)
                if any(c.inputs and layer in c.layers for c in self.collectors):
                    roles.append("x")
            wanted += [(role, layer) for role in dict.fromkeys(roles)]
        shared_kv = kv_source_roles(ad.specs, {la for c in self.collectors for la in c.layers})
        wanted += [w for w in shared_kv if w not in wanted]  # Gemma 4: another layer's keys
        hooks = [
            (name, self._store(role, layer))
            for (role, layer), name in zip(wanted, ad.hook_names(wanted))
            if name is not None
        ]
        stack = ExitStack()
        stack.enter_context(
            _capture.registered(
                ad.model, ad.info.architecture, hooks, self._end, on_forward_start=self._start
            )
        )
        self._hooks = stack

    # ------------------------------------------------------------------ a pass
    def _start(self, args: tuple, kwargs: dict) -> None:
        if self._pass is not None:  # a pass that never ended (an exception inside the model)
            self._pass = None
        batch = self.pending if self.pending is not None else self._batch_of(args, kwargs)
        self._open(batch)

    def _open(self, batch: Batch | None) -> _Pass:
        self._pass = _Pass(batch)
        for c in list(self.collectors):
            c.start_pass(batch)
        return self._pass

    def _batch_of(self, args: tuple, kwargs: dict) -> Batch | None:
        """The Batch of a call the user made: token ids (with ``attention_mask`` when given)
        or text, tokenised as the model does; None for anything else."""
        x = args[0] if args else kwargs.get("input", kwargs.get("tokens"))
        mask = kwargs.get("attention_mask")
        ad = self.adapter
        if isinstance(x, Tensor) and not x.is_floating_point() and x.ndim in (1, 2):
            tokens = x if x.ndim == 2 else x[None]
            if mask is None:
                return Batch(tokens, torch.ones_like(tokens, dtype=torch.bool), "right")
            valid = mask.reshape(tokens.shape).bool()
            side = "right" if bool(valid[:, 0].all()) else "left"  # one read, at the pass start
            return Batch(tokens, valid, side)
        if isinstance(x, (str, list, tuple)) and ad.tokenizer is not None:
            side = kwargs.get("padding_side") or getattr(ad.tokenizer, "padding_side", "right")
            try:
                return ad.tokenize(x, padding_side=side)
            except TLDynamicsError:
                return None
        return None

    def _store(self, role: str, layer: int):
        def fn(activation: Tensor) -> None:
            state = self._pass if self._pass is not None else self._open(None)
            if state.current is not None and state.current != layer:
                self._flush(state)
            state.current = layer
            keep = activation.detach() if activation.requires_grad else activation
            state.stash[role] = keep.clone() if role in REFERENCE_ROLES else keep

        return fn

    def _flush(self, state: _Pass) -> None:
        layer, stash = state.current, state.stash
        state.current, state.stash = None, {}
        if layer is None:
            return
        wanting = [
            c for c in self.collectors if layer in c.layers or any(l == layer for _, l in c.points)
        ]
        batch = state.batch
        keep_kv(self.adapter.specs, layer, stash, state.shared)  # for a later layer (Gemma 4)
        attention = None
        if any(layer in c.layers for c in wanting):
            attention = assemble(self.adapter, layer, stash, batch, state.shared)
            n = tuple(attention.q.shape[:2])  # [batch, pos] as scored (hooks differ in layout)
            if batch is not None and tuple(batch.tokens.shape) != n:
                raise TLDynamicsError(
                    f"the forward pass runs tokens of shape {n} but the batch "
                    f"given has {tuple(batch.tokens.shape)}"
                )
        points = {r: stash[r] for r in POINT_ROLES if r in stash}
        ls = LayerState(layer, batch, attention, points, state.shared)
        for c in wanting:
            c.on_layer(ls)

    def _end(self) -> None:
        state, self._pass = self._pass, None
        if state is None:
            return
        self._flush(state)
        for c in list(self.collectors):
            c.end_pass()


_HUBS: "weakref.WeakKeyDictionary[Any, Hub]" = weakref.WeakKeyDictionary()


def hub_of(adapter: Any) -> Hub:
    """The one hub of ``adapter``'s model (adapters of the same model share it)."""
    hub = _HUBS.get(adapter.model)
    if hub is None:
        hub = _HUBS[adapter.model] = Hub()
    return hub
