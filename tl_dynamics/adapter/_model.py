"""``ModelAdapter``: the one object that knows how a TransformerLens model exposes attention.

What the model is and holds (specs, weights, rotations) is read by ``AdapterBase``
(``_base.py``); this module adds prompts, forward passes, hooks and per-layer capture.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from os import PathLike
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from tl_dynamics.adapter import _batch, _capture
from tl_dynamics.adapter._base import AdapterBase
from tl_dynamics.adapter._batch import Batch, Prompt
from tl_dynamics.adapter._hub import LayerState, hub_of
from tl_dynamics.adapter._layer import LayerAttention
from tl_dynamics.adapter._patch import patched
from tl_dynamics.collect import Collector
from tl_dynamics.errors import TLDynamicsError


class ModelAdapter(AdapterBase):
    """Reads attention exactly from a ``HookedTransformer`` or a ``TransformerBridge``.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> adapter = ModelAdapter(testing.tiny_model("gpt2"))      # doctest: +SKIP
        >>> layers = adapter.attention("a = b + c", reference=True)  # doctest: +SKIP
        >>> la = layers[0]                                           # doctest: +SKIP
        >>> (la.pattern() - la.reference["pattern"]).abs().max() < 1e-5  # doctest: +SKIP
        tensor(True)
    """

    @classmethod
    def of(cls, model: Any) -> "ModelAdapter":
        """The adapter for ``model``: an adapter is returned unchanged, a model is wrapped.

        Every analysis entry point accepts either, through this one function.

        Example:
            >>> from tl_dynamics import testing
            >>> ad = ModelAdapter.of(testing.tiny_model("gpt2"))
            >>> ModelAdapter.of(ad) is ad
            True
        """
        if isinstance(model, ModelAdapter):
            return model
        if not (hasattr(model, "cfg") and hasattr(model, "named_parameters")):
            hint = (f"; to load one by name or folder: tl_dynamics.load_model({str(model)!r})"
                    if isinstance(model, (str, PathLike)) else
                    "; load one with tl_dynamics.load_model(name_or_folder)")
            raise TLDynamicsError(f"expected a TransformerLens model (HookedTransformer or "
                                  f"TransformerBridge) or a ModelAdapter, got "
                                  f"{type(model).__name__}{hint}")
        return cls(model)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None when it has none)."""
        return getattr(self.model, "tokenizer", None)

    # ----------------------------------------------------------------- tokens
    def tokenize(self, prompt: Prompt | Batch, padding_side: str = "right",
                 attention_mask: Tensor | None = None) -> Batch:
        """Tokens and padding mask for a string, a list of strings, or a token tensor.

        A list of strings is padded on ``padding_side``; a token tensor with padding needs its
        ``attention_mask`` (1 = real token), since pads cannot be told apart by id. A ``Batch``
        is returned unchanged, so every entry point can take either.
        """
        return _batch.tokenize(self.model, self.n_ctx, prompt, padding_side, attention_mask)

    def str_tokens(self, batch: Batch, row: int = 0) -> list[str]:
        """The token strings of one row, padding included (use ``batch.key_valid`` to drop it)."""
        return self.decode(batch.tokens[row])

    def decode(self, ids: Sequence[int] | Tensor) -> list[str]:
        """One string per token id (the id itself, as text, when the model has no tokenizer).

        Example:
            >>> from tl_dynamics import testing
            >>> ModelAdapter(testing.tiny_model("gpt2")).decode([65, 66])
            ['a', 'b']
        """
        ids = ids.reshape(-1).tolist() if isinstance(ids, Tensor) else [int(i) for i in ids]
        tokenizer = self.tokenizer
        if tokenizer is None:
            return [str(i) for i in ids]
        return [tokenizer.decode([i]) for i in ids]

    def forward(self, batch: Batch, grad: bool = False) -> Tensor:
        """Run the model on ``batch``, passing the padding mask to the host; without gradients
        unless ``grad=True`` (e.g. for Jacobians through hooks)."""
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

    def _check_padding(self, batch: Batch | None) -> None:
        if batch is not None and batch.padded and self.info.family == "openai_gpt":
            raise TLDynamicsError(
                "padded batch on OpenAIGPTLMHeadModel: TransformerLens's bridge replaces the "
                "causal mask by the padding mask when one is passed, so its queries attend to "
                "later tokens (the Hugging Face model keeps both); pass prompts one at a time")
        if batch is None or not batch.padded or self.info.host != "hooked":
            return
        if any(not spec.causal for spec in self.specs):
            raise TLDynamicsError(
                "padded batch on a bidirectional HookedTransformer: it does not mask padding "
                "keys (its mask is applied only for causal attention), so its patterns include "
                "the pads; pass prompts one at a time, or use a TransformerBridge encoder")

    # ----------------------------------------------------------------- hooks
    @contextmanager
    def hooks(self, hooks: Sequence[tuple[str, int, Callable[[Tensor], None]]],
              on_forward_end: Callable[[], None] | None = None) -> Iterator[None]:
        """Attach ``fn(activation)`` at ``(role, layer)``; removes exactly these hooks on exit."""
        named = self.named_hooks(hooks)
        with _capture.registered(self.model, self.info.architecture, named, on_forward_end):
            yield

    @contextmanager
    def patch(self, patches: Sequence[tuple[str, int, Callable[[Tensor], Tensor | None]]]
              ) -> Iterator[None]:
        """Replace activations: ``fn(activation)`` at ``(role, layer)`` returns the replacement
        (same shape) or None to keep it; removes exactly these hooks on exit."""
        with patched(self, patches):
            yield

    @contextmanager
    def collecting(self, *collectors: Collector) -> Iterator[None]:
        """Attach ``collectors`` (``tl_dynamics.collect.Collector``) for every forward pass run
        inside: each pass calls ``start_pass(batch)``, ``on_layer(state)`` per layer it asked
        for, with one ``LayerState`` shared by every collector on the model, and ``end_pass()``.

        What a collector asks for is checked before anything is hooked (layers, learned sinks,
        residual points); hooks are removed on exit, even on errors.
        """
        hub = hub_of(self)
        self._check_padding(hub.pending)
        with ExitStack() as stack:
            for collector in collectors:
                stack.enter_context(hub.attached(collector, self))
            yield

    @contextmanager
    def capture(self, on_layer: Callable[[LayerAttention], None],
                layers: int | Sequence[int] | None = None, reference: bool = False,
                inputs: bool = False, batch: Batch | None = None,
                sinks: bool = False) -> Iterator[None]:
        """Call ``on_layer(LayerAttention)`` for each layer during every forward pass inside.

        Only one layer's tensors are held at a time. The padding mask is the pass's own (the
        ``Batch`` that ``forward`` ran, or the ``attention_mask`` the model was called with);
        ``batch``, when given, is checked for padding support only. ``reference=True`` also
        keeps the model's own scores/pattern/z/output for checking. Layers with learned
        attention sinks (GPT-OSS) are refused unless ``sinks=True``: their rows sum to less
        than 1, which the analyses built on ``LayerAttention`` do not model; with
        ``sinks=True`` the pattern, ``z`` and outputs are exact (``sink_logit``).
        """
        self._check_padding(batch)
        collector = _Calls(on_layer, self.check_attention_layers(layers), reference, inputs, sinks)
        with self.collecting(collector):
            yield

    def attention(self, prompt: Prompt | Batch, layers: int | Sequence[int] | None = None,
                  reference: bool = False, inputs: bool = False,
                  padding_side: str = "right", sinks: bool = False) -> dict[int, LayerAttention]:
        """Run the model once and return ``{layer: LayerAttention}`` for the asked layers
        (``sinks`` as in ``capture``)."""
        batch = self.tokenize(prompt, padding_side)
        out: dict[int, LayerAttention] = {}
        with self.capture(lambda la: out.__setitem__(la.layer, la), layers, reference, inputs,
                          batch, sinks):
            self.forward(batch)
        return out


class _Calls(Collector):
    """``capture``'s collector: hands each layer's ``LayerAttention`` to a function (whose ``z``
    and head outputs include a gated layer's output gate)."""

    gates, query_frames = True, False  # hands the layer on: forms no query frame itself

    def __init__(self, fn: Callable[[LayerAttention], None], layers: list[int], reference: bool,
                 inputs: bool, sinks: bool):
        self.fn, self.layers = fn, tuple(layers)
        self.reference, self.inputs, self.sinks = reference, inputs, sinks

    def on_layer(self, state: LayerState) -> None:
        if state.attention is not None and state.layer in self.layers:
            self.fn(state.attention)
