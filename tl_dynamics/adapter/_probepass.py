"""The probe pass: one short forward pass of the model on ``probe_tokens`` (``PROBE_TOKENS``
tokens, one row, no grad) that reads what a layer fires, for the self-check at load
(``_selfcheck``) and for reading rotations (``_rotation``). The self-check's pass serves both:
its captured inputs, rotated queries and cos/sin tables are the rotation probe's, so a rotary
model is probed once.

It is invisible to every other tl_dynamics hook (``_capture.registered(..., probe=True)``), and
it stops once the last layer it reads has fired everything asked of it: a forward hook on that
layer's attention module ends the pass when it returns (every hook inside it has fired, or never
will), unless a hook asked of the layer outside that module has not fired yet (then the layer's
``resid_post`` ends it, else the model's end), so the layers after it, the final norm and the
unembedding are never run. The stop is an exception of its own (a ``BaseException``, which
no ``except Exception`` in the host swallows), caught here; the hooks are removed on every path.

An exception raised by the model's own forward pass (not a refusal of ours, not an error inside a
tl_dynamics hook) becomes a ``TLDynamicsError`` saying that the installed host cannot run the
model, the original chained (``host_failures``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from tl_dynamics.adapter import _capture, _readers
from tl_dynamics.adapter._batch import model_device
from tl_dynamics.adapter._modrope import module_rotated_queries
from tl_dynamics.errors import TLDynamicsError

PROBE_TOKENS = 8
Got = dict[int, dict[str, Tensor]]  # layer -> role -> what the layer fired


class _Stop(BaseException):
    """Ends a probe pass once the last layer it reads has fired (caught by ``probe_pass``)."""


def probe_tokens(d_vocab: int, n_ctx: int) -> Tensor:
    """The probe's token ids: one row of ``min(PROBE_TOKENS, n_ctx)`` distinct-looking ids.

    Example:
        >>> probe_tokens(512, 64).tolist()
        [[11, 250, 489, 216, 455, 182, 421, 148]]
    """
    n = min(PROBE_TOKENS, n_ctx)
    return ((torch.arange(n) * 7919 + 11) % d_vocab)[None]


@contextmanager
def host_failures(adapter: Any) -> Iterator[None]:
    """Turn an exception raised by the model's own forward pass into a ``TLDynamicsError`` saying
    that the installed host cannot run the model, the original chained (e.g. TransformerLens
    4.3's CodeGen bridge reads ``embed_positions``, which transformers 5.24 removed). Refusals of
    ours and errors raised inside a tl_dynamics hook (a bug of ours) pass as themselves."""
    try:
        yield
    except TLDynamicsError:
        raise
    except Exception as exc:
        if getattr(exc, "_tld_noted", False):  # raised inside a tl_dynamics hook (_capture)
            raise
        raise TLDynamicsError(
            f"{adapter.info.architecture}: the model's own forward pass fails in the installed "
            f"host ({type(exc).__name__}: {exc}), so nothing of it can be read or analysed. "
            f"Installed: {_readers.installed()}; the tests ran on {_readers.tested_on()}. It "
            "needs a TransformerLens and transformers pair that runs this architecture; report "
            "the failure to TransformerLens"
        ) from exc


def probe_pass(
    adapter: Any, tokens: Tensor, wanted: Sequence[tuple[str, int]], tables: Sequence[int] = ()
) -> tuple[Got, Got]:
    """``(got, module_tables)``: what each layer fired for the ``(role, layer)`` in ``wanted``
    (the last firing, cloned), and the ``position_embeddings=(cos, sin)`` that the Hugging Face
    attention module of each layer in ``tables`` received, in one probe pass on ``tokens``."""
    model, got, received = adapter.model, {}, {}
    names = adapter.hook_names(list(wanted))
    asked = [(role, layer, name) for (role, layer), name in zip(wanted, names) if name is not None]
    if not asked and not tables:
        return got, received
    last = max([layer for _, layer, _ in asked] + list(tables))
    inside = f"blocks.{last}.attn."  # these fire inside the attention module, or never
    pending = {name for _, layer, name in asked if layer == last and not name.startswith(inside)}

    def store(role: str, layer: int, name: str):
        def fn(t: Tensor) -> None:
            got.setdefault(layer, {})[role] = t.detach().clone()
            pending.discard(name)

        return fn

    def table(layer: int):
        def fn(_args: tuple, kwargs: dict) -> None:
            pair = kwargs.get("position_embeddings")
            if isinstance(pair, tuple) and len(pair) == 2 and layer not in received:
                received[layer] = {"cos": pair[0].detach().clone(), "sin": pair[1].detach().clone()}

        return fn

    def stop(_: Tensor) -> None:
        raise _Stop

    def stop_when_done() -> None:
        if not pending:
            raise _Stop

    hooks: list[tuple[str, Callable[[Tensor], None]]]
    hooks = [(name, store(role, layer, name)) for role, layer, name in asked]
    end = adapter.hook_name("resid_post", last)
    if end is not None and end not in {name for _, _, name in asked}:
        hooks.append((end, stop))  # the layer's block returned: everything of it has fired
    module_hooks: list[tuple[Any, str, Callable[..., None]]] = [
        (orig, "pre", table(layer))
        for layer in tables
        if (orig := _original(model, layer)) is not None
    ]
    attn = getattr(model.blocks[last], "attn", None)
    if isinstance(attn, torch.nn.Module):
        module_hooks.append((attn, "post", stop_when_done))
    with (
        host_failures(adapter),
        _capture.registered(
            model, adapter.info.architecture, hooks, probe=True, module_hooks=module_hooks
        ),
        torch.no_grad(),
    ):
        try:
            model(tokens.to(model_device(model)))
        except _Stop:
            pass
    return got, received


def _original(model: Any, layer: int) -> Any:
    return getattr(getattr(model.blocks[layer], "attn", None), "original_component", None)


def rotation_layers(adapter: Any, roles: Sequence[str]) -> tuple[list[int], list[int]]:
    """``(rotary, half)``: the layers a rotation probe reads, and those of them whose Hugging Face
    module's own tables it also reads (half layout; only where it asks for ``cos``)."""
    rotary = [s.layer for s in adapter.specs if s.rotary != "none" or s.latent]
    half = [s.layer for s in adapter.specs if s.rotary == "half"] if "cos" in roles else []
    return rotary, half


def rotation_probe(
    adapter: Any, roles: Sequence[str], captured: tuple[Got, Got] | None = None
) -> Got:
    """The rotation probe of every rotary layer: the ``roles`` it fires (from ``captured``, the
    ``probe_pass`` of the self-check, which asked for them, or from a probe pass of its own), and
    on half-layout layers that fire no rotary hooks the tables their Hugging Face module received
    and the queries its own rotary function rotates (``_modrope``)."""
    layers, half = rotation_layers(adapter, roles)
    if captured is None:
        tokens = probe_tokens(int(adapter.model.cfg.d_vocab), adapter.n_ctx)
        captured = probe_pass(adapter, tokens, [(r, la) for la in layers for r in roles], half)
    got, received = captured
    out = {la: {r: t for r, t in got.get(la, {}).items() if r in roles} for la in layers}
    for layer in half:
        if not {"cos", "rot_q"} & set(out[layer]) and layer in received:
            out[layer].update(received[layer])
            module_rotated_queries(adapter, layer, out[layer])
    return out
