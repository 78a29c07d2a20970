"""Activation patching: hooks that *replace* an activation, removed exactly on exit.

``ModelAdapter.patch`` is the one place a tl_dynamics hook returns a value: ``fn(activation)``
gives the replacement (a tensor of the same shape, or None to keep the activation). A
replacement may also repeat the batch rows (``[k * batch, ...]``) to run ``k`` variants of the
rest of the forward pass at once; hosts that carry a batch-shaped mask past the hook point
(Hugging Face bridges) then fail in the forward pass, and the caller repeats the input instead. Like
``ModelAdapter.hooks`` it addresses hook points by role and layer, leaves hooks the user
attached alone, and removes exactly its own, even when the forward pass raises.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from torch import Tensor

from tl_dynamics.adapter._base import AdapterBase
from tl_dynamics.adapter._capture import probing
from tl_dynamics.adapter._jetmoe import routed_patch_refusal
from tl_dynamics.adapter._mla import latent_z_patch
from tl_dynamics.adapter._unhooked import is_point, register_patch
from tl_dynamics.errors import TLDynamicsError

PatchFn = Callable[[Tensor], "Tensor | None"]


@contextmanager
def patched(adapter: AdapterBase, patches: Sequence[tuple[str, int, PatchFn]]) -> Iterator[None]:
    """Attach replacing hooks ``(role, layer, fn)``; remove exactly these on exit. A patch the
    host would discard is refused (``refuse_discarded``)."""
    for role, layer, _ in patches:
        refuse_discarded(adapter, role, adapter.check_layer(layer))
    patches = [
        (
            role,
            layer,
            latent_z_patch(fn, adapter.n_heads)
            if role == "z" and adapter.specs[adapter.check_layer(layer)].latent
            else fn,
        )
        for role, layer, fn in patches
    ]
    named = adapter.named_hooks(patches)
    hook_dict = adapter.model.hook_dict
    owned: list[tuple[Any, Any]] = []
    torch_handles: list[Any] = []  # unhooked attention (_unhooked)

    def wrap(name: str, fn: PatchFn):
        def hook(activation: Tensor, hook: Any = None) -> Tensor | None:
            if probing(adapter.model):  # a rotation probe pass: leave it unpatched
                return None
            try:
                out = fn(activation)
            except TLDynamicsError:
                raise
            except Exception as exc:  # re-raised with the hook point named
                raise TLDynamicsError(
                    f"error inside tl_dynamics patch at {name!r}: {type(exc).__name__}: {exc}"
                ) from exc
            if out is None:
                return None
            rows = activation.shape[0]
            if tuple(out.shape[1:]) != tuple(activation.shape[1:]) or out.shape[0] % max(rows, 1):
                raise TLDynamicsError(
                    f"patch at {name!r} returned shape {tuple(out.shape)}; the "
                    f"activation has shape {tuple(activation.shape)} (valid: the "
                    f"same shape, or its rows repeated along the batch)"
                )
            return out.to(device=activation.device, dtype=activation.dtype)

        return hook

    try:
        for name, fn in named:
            if is_point(name):
                torch_handles.extend(
                    register_patch(
                        adapter.model, name, wrap(name, fn), lambda: probing(adapter.model)
                    )
                )
                continue
            point = hook_dict[name]
            before = list(point.fwd_hooks)
            point.add_hook(wrap(name, fn), dir="fwd")
            owned.extend((point, h) for h in point.fwd_hooks if all(h is not b for b in before))
        yield
    finally:
        for point, handle in owned:
            handle.hook.remove()
            point.fwd_hooks = [h for h in point.fwd_hooks if h is not handle]
        for handle in torch_handles:
            handle.remove()


def refuse_discarded(adapter: AdapterBase, role: str, layer: int) -> None:
    """Refuse a patch whose replacement the host would not use: the pattern of a layer whose
    bridge runs the Hugging Face module whole and fires ``hook_pattern`` after it (its edits are
    discarded: the output is unchanged), and ``z`` of a JetMoE layer (no hook holds it). Layers
    read without TransformerLens hooks (``_unhooked``) recompute their output from a patched
    pattern, so they patch."""
    spec = adapter.specs[layer]
    if role == "z" and spec.gate == "router":
        raise routed_patch_refusal(spec, adapter.info.architecture)
    inside = getattr(getattr(adapter.model.blocks[layer], "attn", None), "original_component", None)
    if (
        role == "pattern"
        and spec.scores_hook == "pattern"
        and spec.is_attention
        and not spec.unhooked
    ):
        if not getattr(inside, "accepts_pattern_fn", False):  # TransformerLens native: inside
            raise TLDynamicsError(
                f"cannot patch the pattern of layer {layer} of {adapter.info.architecture}: "
                "TransformerLens runs its Hugging Face attention module whole and fires "
                "hook_pattern after the module has used the pattern, so a patched pattern "
                "would not change the layer's output"
            )
