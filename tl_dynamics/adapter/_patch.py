"""Activation patching: hooks that *replace* an activation, removed exactly on exit.

``ModelAdapter.patch`` is the one place a tl_dynamics hook returns a value: ``fn(activation)``
gives the replacement (a tensor of the same shape, or None to keep the activation). A
replacement may also repeat the batch rows (``[k * batch, ...]``) to run ``k`` variants of the
rest of the forward pass at once; hosts that carry a batch-shaped mask past the hook point
(Hugging Face bridges) then fail in the forward pass, and the caller repeats the input instead. Like
``ModelAdapter.hooks`` it addresses hook points by role and layer, leaves hooks the user
attached alone, and removes exactly its own, even when the forward pass raises.

``shuffled_weights`` makes the "same weights, no structure" control the atlas compares with:
a copy of the model whose every parameter has its entries permuted at random (seeded), so each
matrix keeps its distribution of values (norms, scale) and loses what training arranged.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter._model import ModelAdapter

PatchFn = Callable[[Tensor], "Tensor | None"]


@contextmanager
def patched(adapter: "ModelAdapter", patches: Sequence[tuple[str, int, PatchFn]]) -> Iterator[None]:
    """Attach replacing hooks ``(role, layer, fn)``; remove exactly these on exit."""
    named = []
    for role, layer, fn in patches:
        name = adapter.hook_name(role, adapter.check_layer(layer))
        if name is None:
            raise TLDynamicsError(f"this {adapter.info.architecture} model has no {role!r} hook "
                                  f"in layer {layer}")
        named.append((name, fn))
    hook_dict = adapter.model.hook_dict
    owned: list[tuple[Any, Any]] = []

    def wrap(name: str, fn: PatchFn):
        def hook(activation: Tensor, hook: Any = None) -> Tensor | None:
            try:
                out = fn(activation)
            except TLDynamicsError:
                raise
            except Exception as exc:  # re-raised with the hook point named
                raise TLDynamicsError(f"error inside tl_dynamics patch at {name!r}: "
                                      f"{type(exc).__name__}: {exc}") from exc
            if out is None:
                return None
            rows = activation.shape[0]
            if tuple(out.shape[1:]) != tuple(activation.shape[1:]) or out.shape[0] % max(rows, 1):
                raise TLDynamicsError(f"patch at {name!r} returned shape {tuple(out.shape)}; the "
                                      f"activation has shape {tuple(activation.shape)} (valid: the "
                                      f"same shape, or its rows repeated along the batch)")
            return out.to(device=activation.device, dtype=activation.dtype)
        return hook

    try:
        for name, fn in named:
            point = hook_dict[name]
            before = list(point.fwd_hooks)
            point.add_hook(wrap(name, fn), dir="fwd")
            owned.extend((point, h) for h in point.fwd_hooks if all(h is not b for b in before))
        yield
    finally:
        for point, handle in owned:
            handle.hook.remove()
            point.fwd_hooks = [h for h in point.fwd_hooks if h is not handle]


def shuffled_weights(adapter: "ModelAdapter", seed: int = 0) -> "ModelAdapter":
    """A new adapter over a copy of ``adapter``'s model whose parameters each have their
    entries permuted at random (seeded by ``seed``).

    Tied parameters stay tied (each tensor is shuffled once). The original is not touched.
    Normalise a model first with ``ModelAdapter.of``.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter, shuffled_weights
        >>> ad = ModelAdapter(testing.tiny_model("gpt2"))
        >>> sh = shuffled_weights(ad, seed=1)
        >>> same_values = sh.W_E.flatten().sort().values.equal(ad.W_E.flatten().sort().values)
        >>> same_values, sh.W_E.equal(ad.W_E)
        (True, False)
    """
    if not (hasattr(adapter, "info") and hasattr(adapter, "model")):
        raise TLDynamicsError(f"shuffled_weights needs a ModelAdapter (use ModelAdapter.of(model)), "
                              f"got {type(adapter).__name__}")
    clone = copy.deepcopy(adapter.model)
    generator = torch.Generator().manual_seed(int(seed))
    seen: set[int] = set()
    with torch.no_grad():
        for param in clone.parameters():
            if id(param) in seen or param.numel() < 2:
                continue
            seen.add(id(param))
            flat = param.detach().reshape(-1)
            order = torch.randperm(flat.numel(), generator=generator).to(flat.device)
            param.copy_(flat[order].reshape(param.shape))
    return type(adapter)(clone.eval())
