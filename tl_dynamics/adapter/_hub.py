"""One collector pass: every collector attached to a model shares one set of hooks and, per
layer, one ``LayerState`` (the layer's ``LayerAttention``, assembled once, with its memoised
scores and log-softmax; the pass's masks; the residual points), handed to each in turn.

A pass is what the adapter's own hooks see (``_pass``): it starts when the model's body is called
(the wrapped module of a bridge, the first block of a ``HookedTransformer``), whichever entry
point called it (``model(...)``, ``forward``, ``run_with_cache``, ``run_with_hooks``,
``generate``), and ends when the body returns. Its ``Batch`` is the one ``ModelAdapter.forward``
ran, or else the token ids the body runs and the ``attention_mask`` it is given. Collectors get
that batch in ``start_pass``; nothing else carries a padding mask to them. A hook that fires
outside a pass, a pass that never reaches its end and a pass through a KV cache are refused by
name (``TLDynamicsError``)."""

from __future__ import annotations

import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from torch import Tensor

from tl_dynamics.adapter import _capture
from tl_dynamics.adapter._batch import Batch
from tl_dynamics.adapter._collect import REFERENCE_ROLES, assemble, refuse_sinks
from tl_dynamics.adapter._gate import gate_refusal
from tl_dynamics.adapter._gemma4 import keep_kv, kv_source_roles
from tl_dynamics.adapter._layer import LayerAttention
from tl_dynamics.adapter._generate import Generation, check_stitched, measured_refusal
from tl_dynamics.adapter._pass import (
    Call,
    batch_of,
    body_hooks,
    cache_refusal,
    elsewhere_refusal,
    unfinished_refusal,
)
from tl_dynamics.adapter._postrope import extra_roles
from tl_dynamics.adapter._texts import TextLog, recording_texts, unmasked_batch
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
    stepping: bool = False  # a step of a cached generate: kept, not collected (_generate)
    check: dict[int, Tensor] = field(default_factory=dict)  # layer -> the host's pattern


class Hub:
    """The collectors attached to one model, and the hooks that feed them."""

    def __init__(self) -> None:
        # the ModelAdapter of the attached collectors, held only while some are attached: the
        # hubs are kept per model in a weak mapping, so nothing here may keep the model alive
        self.adapter: Any = None
        self.collectors: list[Collector] = []
        self.pending: Batch | None = None  # the Batch ModelAdapter.forward is running
        self.texts = TextLog()  # the texts behind the token ids the model made while attached
        self.generation: Generation | None = None  # the steps of a cached generate running now
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
        unfinished = False
        try:
            self.check(collector)
            self.collectors.append(collector)
            self._register()
            yield
            unfinished = self._pass is not None  # the block ends normally inside a pass
        finally:
            if any(c is collector for c in self.collectors):
                self.collectors.remove(collector)
                self._register()
            if not self.collectors:
                self.adapter = None
        if unfinished:
            raise unfinished_refusal()

    def _register(self) -> None:
        if self._hooks is not None:
            self._hooks.close()
            self._hooks = None
        self._set_pass(None)
        if not self.collectors:
            self.texts = TextLog()  # nothing kept past the last attached block
            return
        ad, wanted = self.adapter, []
        attended = {la for c in self.collectors for la in c.layers}
        if self.generation is not None and ad.attention_layers:  # one layer checks the host
            attended.add(min(attended, default=ad.attention_layers[0]))
        layers = sorted(attended | {layer for c in self.collectors for _, layer in c.points})
        for layer in layers:
            roles = [r for c in self.collectors for r, l in c.points if l == layer]
            if layer in attended:
                roles += list(ATTENTION_ROLES) + extra_roles(
                    ad.specs[layer]
                )  # gate, post-rotary norms
                if any(c.reference and layer in c.layers for c in self.collectors):
                    roles += list(REFERENCE_ROLES)
                if any(c.inputs and layer in c.layers for c in self.collectors):
                    roles.append("x")
                if self.generation is not None:  # each step's pattern checks the host
                    roles.append("pattern")
            wanted += [(role, layer) for role in dict.fromkeys(roles)]
        shared_kv = kv_source_roles(ad.specs, {la for c in self.collectors for la in c.layers})
        wanted += [w for w in shared_kv if w not in wanted]  # Gemma 4: another layer's keys
        hooks = [
            (name, self._guarded(self._store(role, layer)))
            for (role, layer), name in zip(wanted, ad.hook_names(wanted))
            if name is not None
        ]
        stack = ExitStack()
        body = body_hooks(
            ad.model, ad.info.host, self._guarded(self._begin), self._guarded(self._end)
        )
        stack.enter_context(recording_texts(ad.model, self.texts))
        stack.enter_context(_capture.wrapping(ad.model, "generate", self._generating))
        stack.enter_context(
            _capture.registered(
                ad.model, ad.info.architecture, hooks, self._returned, module_hooks=body
            )
        )
        self._hooks = stack

    # ------------------------------------------------------------------ a pass
    def _begin(self, call: Call) -> None:
        """The body of a forward pass is called (``_pass``): a pass starts, whichever entry
        point ran it, with the batch the body runs."""
        unfinished = self._pass
        self._set_pass(None)
        gen = self.generation
        if unfinished is not None:
            raise unfinished_refusal()
        if gen is not None and (call.cache is not None or gen.steps):  # a cached step
            n = call.positions if call.positions is not None else 0
            gen.begin(call.cache, call.past, call.tokens, call.attention_mask, n)
            self._set_pass(_Pass(None, stepping=True))
            return
        if call.cache is not None:
            raise cache_refusal(call.cache)
        if call.embedded_elsewhere:
            raise elsewhere_refusal()
        batch = self.pending if self.pending is not None else batch_of(call, self._unmasked)
        self._open(batch)

    def _generating(self, original: Callable) -> Callable:
        """``model.generate`` while attached: its cached steps kept, then collected as one pass
        over the sequence they ran, checked against the host's own patterns (``_generate``)."""

        def generate(*args: Any, **kwargs: Any) -> Any:
            if self.generation is not None:  # called from inside a generate
                return original(*args, **kwargs)
            if self.adapter.attention_layers:  # read before hooking (it may run a probe pass)
                self.adapter.rotation(self.adapter.attention_layers[0])
            self.generation = gen = Generation()
            self._register()  # each step's pattern, to check the host with
            try:
                out = original(*args, **kwargs)
                if gen.steps:
                    self._stitched(gen)
                return out
            finally:
                self.generation = None
                if self.collectors:
                    self._register()

        return generate

    def _stitched(self, gen: Generation) -> None:
        """The steps of a cached generate as one pass to every collector."""
        asked = {la for c in self.collectors if c.reference for la in c.layers}
        state = self._open(gen.batch())
        for layer in sorted({la for _, la in gen.rows}):
            stash = gen.stitched(layer, [r for r, la in gen.rows if la == layer])
            host = stash.get("pattern") if layer in asked else stash.pop("pattern", None)
            if host is not None:
                state.check[layer] = host
            state.current, state.stash = layer, stash
            self._flush(state)
        self._end()

    def _unmasked(self, tokens: Tensor) -> Batch:
        """The batch of a pass without a mask: texts' real lengths, or a refusal (_texts)."""
        ad = self.adapter
        pad = getattr(getattr(ad.model, "tokenizer", None), "pad_token_id", None)
        return unmasked_batch(tokens, self.texts, not ad.is_encoder, pad)

    def _guarded(self, fn: Callable) -> Callable:
        """``fn``, dropping the open pass when it raises: a pass that a refusal or an error
        stopped is not collected, and is not reported unfinished by the next one."""

        def run(*args: Any) -> Any:
            try:
                return fn(*args)
            except BaseException:
                self._set_pass(None)
                raise

        return run

    def _set_pass(self, state: "_Pass | None") -> None:
        """Open (or close, None) a pass; while one is open the adapter reads its cached weights
        against the weights' version taken at the pass's start (one walk over the parameters
        per pass, not one per read: 30 reads per pass of a 30-layer model were 3% of its
        forward)."""
        self._pass = state
        ad = self.adapter
        if ad is not None:
            ad.pass_weights(state is not None)

    def _open(self, batch: Batch | None) -> _Pass:
        state = _Pass(batch)
        self._set_pass(state)
        for c in list(self.collectors):
            c.start_pass(batch)
        return state

    def _returned(self) -> None:
        """The model's own call returned: a pass still open never reached its end."""
        if self._pass is not None:
            self._set_pass(None)
            raise unfinished_refusal()

    def _store(self, role: str, layer: int):
        def fn(activation: Tensor) -> None:
            state = self._pass
            if state is None:
                raise TLDynamicsError(
                    f"a tl_dynamics hook ({role!r} of layer {layer}) fired outside a forward "
                    "pass the adapter saw start: attach() collects whole forward passes of the "
                    "model (model(...), forward, run_with_cache, run_with_hooks, generate), not "
                    "a block or layer run on its own, nor a pass resumed from a residual stream with "
                    "start_at_layer"
                )
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
        if state.stepping and self.generation is not None:  # kept for the stitched pass
            wrong = self.generation.keep(layer, stash)
            if wrong is not None:
                raise measured_refusal(self.adapter, self.generation, layer, wrong)
            return
        wanting = [
            c for c in self.collectors if layer in c.layers or any(l == layer for _, l in c.points)
        ]
        batch = state.batch
        keep_kv(self.adapter.specs, layer, stash, state.shared)  # for a later layer (Gemma 4)
        attention = None
        if any(layer in c.layers for c in wanting) or layer in state.check:
            attention = assemble(self.adapter, layer, stash, batch, state.shared)
            n = tuple(attention.q.shape[:2])  # [batch, pos] as scored (hooks differ in layout)
            if batch is not None and tuple(batch.tokens.shape) != n:
                raise TLDynamicsError(
                    f"the forward pass runs tokens of shape {n} but the batch "
                    f"given has {tuple(batch.tokens.shape)}"
                )
            if layer in state.check:  # the stitched steps' pattern is the model's (_generate)
                check_stitched(self.generation, layer, attention, state.check[layer])
        points = {r: stash[r] for r in POINT_ROLES if r in stash}
        ls = LayerState(layer, batch, attention, points, state.shared)
        for c in wanting:
            c.on_layer(ls)

    def _end(self) -> None:
        state = self._pass
        self._set_pass(None)
        if state is None:
            return
        if state.stepping:
            self._flush(state)
            if self.generation is not None:
                self.generation.end()
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
