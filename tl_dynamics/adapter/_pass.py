"""Where a forward pass starts and ends on each host, and what it runs, read from the module that
every entry point has to call (``_hub.py`` turns these into a pass's start and end).

TransformerLens's own entry points do not all go through the model's ``__call__``:
``run_with_cache`` and ``run_with_hooks`` on a bridge call ``self.forward`` (so the model's
forward pre- and post-hooks never fire), ``HookedTransformer.generate`` calls ``self.forward``.
Every one of them runs the *body*, though, through its ``__call__``:

- a ``TransformerBridge`` (3.x and 4.x, booted from transformers or natively) calls the wrapped
  module (``original_model``) with the token ids, the ``attention_mask`` it applies and its KV
  cache arguments; its forward hook fires when that module returns;
- a ``HookedTransformer`` embeds the tokens (``embed``) and calls ``blocks[0]`` with the
  ``attention_mask`` it applies (its own, for a left-padding tokenizer) and the block's KV cache
  entry; ``blocks[-1]``'s forward hook fires when the last block returns.

So a pass starts when the body is called, with what the body is called with, and ends when the
body returns, whichever wrapper called it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from tl_dynamics.adapter._batch import Batch
from tl_dynamics.errors import TLDynamicsError

# the arguments through which a KV cache (or a recurrent state) enters the body
CACHE_ARGUMENTS = ("past_key_values", "cache_params", "past_kv_cache_entry")


@dataclass(frozen=True)
class Call:
    """What the body of one forward pass was called with.

    Args:
        tokens: The token ids ``[batch, pos]`` (or ``[pos]``); None for a pass run on
            embeddings or a residual stream.
        attention_mask: The mask the model applies, as given to the body (None: none).
        cache: The name of the KV-cache argument the pass reads or fills (None: no cache).
        embedded_elsewhere: The residual stream was embedded outside the pass from other token
            ids than it runs (``HookedTransformer.generate``): its token ids are unknown.
        past: The cache object the pass reads (None: none).
        positions: How many positions the pass runs (None: unknown).
    """

    tokens: Tensor | None
    attention_mask: Tensor | None
    cache: str | None = None
    embedded_elsewhere: bool = False
    past: Any = None  # the cache object the pass reads (``_generate.CACHE_READS``)
    positions: int | None = None  # how many positions the pass runs


def _cache_of(kwargs: dict) -> str | None:
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return name
    return "use_cache" if kwargs.get("use_cache") is True else None


def body_hooks(
    model: Any, host: str, begin: Callable[[Call], None], end: Callable[[], None]
) -> list[tuple[Any, str, Callable]]:
    """``(module, "pre" | "post", fn)``: the torch hooks that call ``begin(Call)`` when the body
    of a forward pass is called and ``end()`` when it returns (``_capture.registered`` attaches
    them, with ``fn(args, kwargs)`` for "pre" and ``fn()`` for "post")."""
    if host == "hooked":
        return _hooked_hooks(model, begin, end)
    body = getattr(model, "original_model", None)
    if body is None:
        raise TLDynamicsError(
            f"this {type(model).__name__} wraps no module (original_model) whose call starts "
            "its forward passes, so attach() cannot follow them; boot it with "
            "boot_transformers or boot_native"
        )

    blocks = list(getattr(model, "blocks", None) or [])

    def start(args: tuple, kwargs: dict) -> None:
        resumed = _resumed_at(blocks)
        if resumed is not None:
            raise resumed_refusal(resumed)
        tokens = args[0] if args else kwargs.get("input_ids")
        cache = _cache_of(kwargs)
        n = int(tokens.shape[-1]) if isinstance(tokens, Tensor) else None
        begin(Call(tokens, kwargs.get("attention_mask"), cache, False, kwargs.get(cache or ""), n))

    return [(body, "pre", start), (body, "post", end)]


def _resumed_at(blocks: list) -> int | None:
    """The block a bridge's pass resumes at (``forward(residual, start_at_layer=k)``), or None.

    TransformerLens 4.x runs such a pass through the whole body, from the residual given as
    ``inputs_embeds``, and arms every block with ``_start_at_layer_idx``: block ``k`` swaps the
    residual back in, and blocks ``0..k-1`` run on the residual as if it were embeddings, their
    outputs discarded. TransformerLens 3.x's bridge refuses ``start_at_layer`` itself (no such
    attribute)."""
    index = getattr(blocks[0], "_start_at_layer_idx", None) if blocks else None
    return int(index) if isinstance(index, int) else None


def resumed_refusal(layer: int) -> TLDynamicsError:
    """The refusal of a pass resumed from a residual stream at block ``layer``."""
    discarded = (
        f"; the bridge also runs the blocks before block {layer} on that residual as if it were "
        "embeddings, their outputs discarded"
        if layer > 0
        else ""
    )
    return TLDynamicsError(
        f"a forward pass resumed from a residual stream at block {layer} "
        f"(start_at_layer={layer}) inside attach(): the token ids behind the residual are "
        f"unknown{discarded}, so attach() refuses it rather than collect its layers; run the "
        "whole model on the tokens (model(tokens)) inside attach()"
    )


def _hooked_hooks(
    model: Any, begin: Callable[[Call], None], end: Callable[[], None]
) -> list[tuple[Any, str, Callable]]:
    embedded: list[Tensor] = []  # the token ids embedded since the last pass started

    def embed(args: tuple, kwargs: dict) -> None:
        tokens = args[0] if args else kwargs.get("tokens")
        if isinstance(tokens, Tensor):
            embedded[:] = [tokens if tokens.ndim == 2 else tokens[None]]

    def start(args: tuple, kwargs: dict) -> None:
        residual = args[0] if args else kwargs.get("resid_pre")
        tokens = embedded[0] if embedded else None
        embedded.clear()
        shape = tuple(residual.shape[:2]) if isinstance(residual, Tensor) else None
        elsewhere = tokens is not None and tuple(tokens.shape) != shape
        cache = _cache_of(kwargs)
        begin(
            Call(
                None if elsewhere else tokens,
                kwargs.get("attention_mask"),
                cache,
                elsewhere,
                kwargs.get(cache or ""),
                None if shape is None else shape[1],
            )
        )

    return [
        (model.embed, "pre", embed),
        (model.blocks[0], "pre", start),
        (model.blocks[len(model.blocks) - 1], "post", end),
    ]


def batch_of(call: Call, unmasked: Callable[[Tensor], Batch] | None = None) -> Batch | None:
    """The ``Batch`` a pass's body runs: its token ids, valid where its ``attention_mask`` is 1;
    without a mask, ``unmasked(tokens)`` (``_texts.unmasked_batch``: the real lengths of texts
    the model tokenized, or a refusal), else every token; None for a pass run on embeddings or a
    residual stream."""
    x, mask = call.tokens, call.attention_mask
    if not isinstance(x, Tensor) or x.is_floating_point() or x.ndim not in (1, 2):
        return None
    tokens = x if x.ndim == 2 else x[None]
    if mask is None:
        if unmasked is not None:
            return unmasked(tokens)
        return Batch(tokens, torch.ones_like(tokens, dtype=torch.bool), "right")
    valid = mask.reshape(tokens.shape).bool()
    side = "right" if bool(valid[:, 0].all()) else "left"  # one read, at the pass start
    return Batch(tokens, valid, side)


def cache_refusal(argument: str) -> TLDynamicsError:
    """The refusal of a pass through a KV cache outside ``generate`` (docs/math.md §3.6)."""
    return TLDynamicsError(
        f"a forward pass with the KV cache ({argument}) outside generate inside attach(): a "
        "cached pass runs only the new tokens, whose queries are scored against keys and values "
        "of passes the adapter did not follow, so attach() refuses it rather than score them "
        "against the new keys alone (docs/math.md §3.6); call model.generate (its cached steps "
        "are collected), or run model(tokens) on the whole sequence inside attach()"
    )


def elsewhere_refusal() -> TLDynamicsError:
    """The refusal of a pass over a residual stream embedded outside it from other tokens."""
    return TLDynamicsError(
        "this forward pass runs a residual stream embedded outside it from other tokens "
        "(TransformerLens 3.x's HookedTransformer.generate without the KV cache embeds the "
        "tokens itself and runs each step with forward(residual, start_at_layer=0)), so the "
        "token ids it scores are unknown and attach() refuses it: generate with the KV cache "
        "(use_past_kv_cache=True, whose steps are collected), or run model(tokens) on the "
        "generated sequence inside attach()"
    )


def unfinished_refusal() -> TLDynamicsError:
    """The refusal of a pass that started and never reached its end."""
    return TLDynamicsError(
        "a forward pass inside attach() stopped before its end (stop_at_layer, or an exception "
        "raised inside the model and caught inside the block): attach() collects whole passes, "
        "so it was not collected; run the whole model"
    )
