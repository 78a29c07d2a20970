"""``ModelAdapter``: the one object that knows how a TransformerLens model exposes attention.

What the model is and holds (specs, weights, rotations) is read by ``AdapterBase``
(``_base.py``); this module adds prompts, forward passes, hooks and per-layer capture.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from tl_dynamics.adapter import _batch, _capture, _selfcheck
from tl_dynamics.adapter._base import AdapterBase
from tl_dynamics.adapter._core import refuse_non_model
from tl_dynamics.adapter._batch import Batch, Prompt
from tl_dynamics.adapter._calls import Calls
from tl_dynamics.adapter._hub import hub_of
from tl_dynamics.adapter._layer import LayerAttention
from tl_dynamics.adapter._patch import patched
from tl_dynamics.collect import Collector


class ModelAdapter(AdapterBase):
    """Reads attention exactly from a ``HookedTransformer`` or a ``TransformerBridge``.

    Analyses ask it for "the query of head h in layer l as scored" and never spell hook names;
    every analysis entry point takes a model or an adapter (``ModelAdapter.of``). An architecture
    or flag it cannot reproduce exactly is refused at construction with a ``TLDynamicsError``.

    At construction it checks itself (``_selfcheck``): one probe of at most 8 tokens, whose
    recomputed pattern and ``z`` must match the model's own on every attention layer; a layer
    that does not is refused by name. The probe runs once per model (and weights).

    Args:
        model: A TransformerLens model (``HookedTransformer`` on 3.x, ``TransformerBridge``).
        verify: Run the self-check (default). ``False`` skips it: nothing then checks that the
            adapter's reading of each layer reproduces the model's values.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
        >>> layers = adapter.attention("a = b + c", reference=True)
        >>> la = layers[0]
        >>> bool((la.pattern() - la.reference["pattern"]).abs().max() < 1e-5)
        True
    """

    def __init__(self, model: Any, verify: bool = True):
        super().__init__(model)
        if verify:
            _selfcheck.verify(self)

    @classmethod
    def of(cls, model: Any) -> "ModelAdapter":
        """The adapter for ``model``: an adapter is returned unchanged, a model is wrapped.

        Every analysis entry point accepts either, through this one function.

        Args:
            model: A TransformerLens model or a ``ModelAdapter``.

        Returns:
            A ``ModelAdapter``.

        Example:
            >>> from tl_dynamics import testing
            >>> ad = ModelAdapter.of(testing.cached_model("gpt2"))
            >>> ModelAdapter.of(ad) is ad
            True
        """
        if isinstance(model, ModelAdapter):
            return model
        refuse_non_model(model)
        return cls(model)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None when it has none).

        Example:
            >>> from tl_dynamics import testing
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> adapter.tokenizer.decode([65])
            'a'
        """
        return getattr(self.model, "tokenizer", None)

    # ----------------------------------------------------------------- tokens
    def tokenize(
        self,
        prompt: Prompt | Batch,
        padding_side: str = "right",
        attention_mask: Tensor | None = None,
    ) -> Batch:
        """Tokens and padding mask for a string, a list of strings, or a token tensor.

        A list of strings is padded on ``padding_side``; a token tensor with padding needs its
        ``attention_mask``, since pads cannot be told apart by id. A ``Batch`` is returned unchanged,
        so every entry point can take either.

        Args:
            prompt: A text, a list of texts, token ids ``[batch, pos]`` or ``[pos]``, or a ``Batch``.
            padding_side: ``"right"`` or ``"left"``: where shorter texts are padded.
            attention_mask: For a token tensor: 1 on real tokens, 0 on padding, ``[batch, pos]``.

        Returns:
            The ``Batch``: tokens ``[batch, pos]`` and ``key_valid`` ``[batch, pos]``.

        Example:
            >>> from tl_dynamics import testing
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> batch = adapter.tokenize(["a b", "def f(x): return x"])
            >>> batch.tokens.shape, batch.key_valid.sum(1).tolist()
            (torch.Size([2, 8]), [3, 8])
        """
        return _batch.tokenize(self.model, self.n_ctx, prompt, padding_side, attention_mask)

    def str_tokens(self, batch: Batch, row: int = 0) -> list[str]:
        """The token strings of one row, padding included (use ``batch.key_valid`` to drop it).

        Args:
            batch: A ``Batch`` from ``tokenize``.
            row: The row.

        Returns:
            One string per position, ``[pos]``.

        Example:
            >>> from tl_dynamics import testing
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> adapter.str_tokens(adapter.tokenize("def f(x)"))
            ['<|endoftext|>', 'def', ' f', '(', 'x', ')']
        """
        return self.decode(batch.tokens[row])

    def decode(self, ids: Sequence[int] | Tensor) -> list[str]:
        """One string per token id (the id itself, as text, when the model has no tokenizer).

        Args:
            ids: Token ids, a sequence or a tensor of any shape (flattened).

        Returns:
            The token strings.

        Example:
            >>> from tl_dynamics import testing
            >>> ModelAdapter(testing.cached_model("gpt2")).decode([65, 66])
            ['a', 'b']
        """
        ids = ids.reshape(-1).tolist() if isinstance(ids, Tensor) else [int(i) for i in ids]
        tokenizer = self.tokenizer
        if tokenizer is None:
            return [str(i) for i in ids]
        return [tokenizer.decode([i]) for i in ids]

    def forward(self, batch: Batch, grad: bool = False) -> Tensor:
        """Run the model on ``batch``, passing the padding mask to the host.

        Without gradients unless ``grad=True`` (e.g. for Jacobians through hooks). Collectors attached
        with ``collecting`` see the pass.

        Args:
            batch: A ``Batch`` from ``tokenize``.
            grad: Keep the autograd graph.

        Returns:
            The model's logits, ``[batch, pos, d_vocab]``.

        Example:
            >>> from tl_dynamics import testing
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> adapter.forward(adapter.tokenize("a b")).shape
            torch.Size([1, 3, 512])
        """
        kwargs: dict[str, Any] = {}
        self._check_padding(batch)
        device = _batch.model_device(self.model)  # a Batch built by hand may sit elsewhere
        if batch.padded:
            kwargs["attention_mask"] = batch.key_valid.long().to(device)
        hub = hub_of(self)
        before, hub.pending = hub.pending, batch  # the pass's Batch, for every collector
        try:
            with torch.set_grad_enabled(grad):
                return self.model(batch.tokens.to(device), **kwargs)
        finally:
            hub.pending = before

    # ----------------------------------------------------------------- hooks
    @contextmanager
    def hooks(
        self,
        hooks: Sequence[tuple[str, int, Callable[[Tensor], None]]],
        on_forward_end: Callable[[], None] | None = None,
    ) -> Iterator[None]:
        """Attach read-only hooks ``fn(activation)`` at ``(role, layer)`` for the passes run inside.

        Exactly these hooks are removed on exit. Roles are the adapter's names (``"resid_pre"``,
        ``"q"``, ``"pattern"``, ...), never the host's hook names.

        Args:
            hooks: ``(role, layer, fn)`` triples.
            on_forward_end: Called when each forward pass returns.

        Returns:
            A context manager.

        Example:
            >>> from tl_dynamics import testing
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> seen = []
            >>> with adapter.hooks([("resid_pre", 1, lambda t: seen.append(tuple(t.shape)))]):
            ...     _ = adapter.forward(adapter.tokenize("a b"))
            >>> seen
            [(1, 3, 64)]
        """
        named = self.named_hooks(hooks)
        with _capture.registered(self.model, self.info.architecture, named, on_forward_end):
            yield

    @contextmanager
    def patch(
        self, patches: Sequence[tuple[str, int, Callable[[Tensor], Tensor | None]]]
    ) -> Iterator[None]:
        """Replace activations for the passes run inside.

        ``fn(activation)`` at ``(role, layer)`` returns the replacement (same shape) or None to keep
        it; exactly these hooks are removed on exit.

        Args:
            patches: ``(role, layer, fn)`` triples.

        Returns:
            A context manager.

        Example:
            >>> from tl_dynamics import testing
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> batch = adapter.tokenize("a b")
            >>> with adapter.patch([("resid_pre", 1, lambda t: 2 * t)]):
            ...     patched = adapter.forward(batch)
            >>> patched.equal(adapter.forward(batch))
            False
        """
        with patched(self, patches):
            yield

    @contextmanager
    def collecting(self, *collectors: Collector) -> Iterator[None]:
        """Attach collectors for every forward pass run inside.

        Each pass calls ``start_pass(batch)``, ``on_layer(state)`` per layer a collector asked for,
        with one ``LayerState`` shared by every collector on the model, and ``end_pass()``. What a
        collector asks for is checked before anything is hooked (layers, learned sinks, residual
        points); hooks are removed on exit, even on errors.

        Args:
            *collectors: ``tl_dynamics.collect.Collector`` instances.

        Returns:
            A context manager.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.collect import Collector
            >>> class Norms(Collector):
            ...     points = (("resid_post", 0),)
            ...     def on_layer(self, state):
            ...         self.shape = tuple(state.points["resid_post"].shape)
            >>> adapter, norms = ModelAdapter(testing.cached_model("gpt2")), Norms()
            >>> with adapter.collecting(norms):
            ...     _ = adapter.forward(adapter.tokenize("a b"))
            >>> norms.shape
            (1, 3, 64)
        """
        hub = hub_of(self)
        self._check_padding(hub.pending)
        with ExitStack() as stack:
            for collector in collectors:
                stack.enter_context(hub.attached(collector, self))
            yield

    @contextmanager
    def capture(
        self,
        on_layer: Callable[[LayerAttention], None],
        layers: int | Sequence[int] | None = None,
        reference: bool = False,
        inputs: bool = False,
        batch: Batch | None = None,
        sinks: bool = False,
    ) -> Iterator[None]:
        """Call ``on_layer(LayerAttention)`` for each layer during every forward pass inside.

        Only one layer's tensors are held at a time. The padding mask is the pass's own (the
        ``Batch`` that ``forward`` ran, or the ``attention_mask`` the model was called with);
        ``batch``, when given, is checked for padding support only. ``reference=True`` also
        keeps the model's own scores/pattern/z/output for checking. Layers with learned
        attention sinks (GPT-OSS) are refused unless ``sinks=True``: their rows sum to less
        than 1, which a caller that did not say it handles them would read as a full softmax;
        with ``sinks=True`` the pattern, ``z`` and outputs are exact (``sink_logit``).

        Args:
            on_layer: Called with each asked layer's ``LayerAttention``.
            layers: A layer, a list of layers, or None for every attention layer.
            reference: Also keep the model's own scores, pattern, ``z`` and output for checking.
            inputs: Also keep the attention input ``x`` (``reference["x"]``).
            batch: Checked for padding support only (the pass's own mask is used).
            sinks: Accept layers with learned sinks.

        Returns:
            A context manager.

        Example:
            >>> from tl_dynamics import testing
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> shapes = []
            >>> with adapter.capture(lambda la: shapes.append(tuple(la.q.shape)), layers=[1]):
            ...     _ = adapter.forward(adapter.tokenize("a b"))
            >>> shapes
            [(1, 3, 4, 16)]
        """
        self._check_padding(batch)
        collector = Calls(on_layer, self.check_attention_layers(layers), reference, inputs, sinks)
        with self.collecting(collector):
            yield

    def attention(
        self,
        prompt: Prompt | Batch,
        layers: int | Sequence[int] | None = None,
        reference: bool = False,
        inputs: bool = False,
        padding_side: str = "right",
        sinks: bool = False,
    ) -> dict[int, LayerAttention]:
        """Run the model once and return each asked layer's ``LayerAttention``.

        Args:
            prompt: A text, a list of texts, token ids or a ``Batch``.
            layers: A layer, a list of layers, or None for every attention layer.
            reference: Also keep the model's own activations (as in ``capture``).
            inputs: Also keep the attention input ``x``.
            padding_side: Where shorter texts are padded.
            sinks: Accept layers with learned sinks (as in ``capture``).

        Returns:
            ``{layer: LayerAttention}``.

        Example:
            >>> from tl_dynamics import testing
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> sorted(adapter.attention("a b"))
            [0, 1]
        """
        batch = self.tokenize(prompt, padding_side)
        out: dict[int, LayerAttention] = {}
        with self.capture(
            lambda la: out.__setitem__(la.layer, la), layers, reference, inputs, batch, sinks
        ):
            self.forward(batch)
        return out
