"""``shuffled_weights``: the "same weights, no structure" control the atlas compares with.

A copy of the model whose every parameter has its entries permuted at random (seeded), so each
matrix keeps its distribution of values (norms, scale) and loses what training arranged.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch

from tl_dynamics.adapter._model import ModelAdapter
from tl_dynamics.errors import TLDynamicsError


def shuffled_weights(adapter: "ModelAdapter", seed: int = 0) -> "ModelAdapter":
    """A new adapter over a copy of the model whose parameters each have their entries permuted.

    The permutation is random, seeded by ``seed``. Tied parameters stay tied (each tensor is
    shuffled once). The original is not touched. Normalise a model first with ``ModelAdapter.of``.

    Args:
        adapter: A ``ModelAdapter``.
        seed: Seeds the permutations.

    Returns:
        A ``ModelAdapter`` over the shuffled copy.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter, shuffled_weights
        >>> ad = ModelAdapter(testing.cached_model("gpt2"))
        >>> sh = shuffled_weights(ad, seed=1)
        >>> same_values = sh.W_E.flatten().sort().values.equal(ad.W_E.flatten().sort().values)
        >>> same_values, sh.W_E.equal(ad.W_E)
        (True, False)
    """
    if not (hasattr(adapter, "info") and hasattr(adapter, "model")):
        raise TLDynamicsError(
            f"shuffled_weights needs a ModelAdapter (use ModelAdapter.of(model)), "
            f"got {type(adapter).__name__}"
        )
    generator = torch.Generator().manual_seed(int(seed))
    # Each parameter is shuffled into the copy directly: deepcopy finds it in ``memo`` (by the
    # original's id, so tied parameters stay one tensor) and copies the rest of the model.
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for param in adapter.model.parameters():
            if id(param) in memo or param.numel() < 2:
                continue
            flat = param.detach().reshape(-1)
            # int32 draws the same permutation as int64, in about half the time
            order = torch.randperm(flat.numel(), generator=generator, dtype=torch.int32)
            memo[id(param)] = torch.nn.Parameter(
                flat[order.to(flat.device, torch.long)].reshape(param.shape),
                requires_grad=param.requires_grad,
            )
    clone = copy.deepcopy(adapter.model, memo)
    _drop_hooks_into_the_original(adapter.model, clone)
    return type(adapter)(clone.eval())


_WEAK = (weakref.ProxyType, weakref.CallableProxyType, weakref.ReferenceType)


def _drop_hooks_into_the_original(original: torch.nn.Module, clone: torch.nn.Module) -> None:
    """``deepcopy`` copies a module's hook functions by reference, closures included: a hook that
    TransformerLens wired at a forward (a bridge block's capture hooks, which hold weak proxies
    of the block's attention and its ``hook_mlp_in``) would write into the original from the
    copy, and raise ``ReferenceError`` once the original is gone. Such hooks are dropped from the
    copy, and the blocks marked unwired so that TransformerLens wires the copy's own at its
    first forward."""
    owned = {id(m) for m in original.modules()}

    def into_original(hook: Any) -> bool:
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, _WEAK) or id(value) in owned:
                return True
        return False

    for module in clone.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, hook in hooks.items() if into_original(hook)]:
                del hooks[key]
        if getattr(module, "_capture_hooks_wired", False):  # TransformerLens 4.x bridge blocks
            # plain attributes (not tensors or modules): they live in the instance's __dict__
            module.__dict__.update(_capture_hooks_wired=False, _capture_hook_handles=[])
