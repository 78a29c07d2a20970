"""Hook registration: attach only our own hooks and remove exactly those on exit, even when the
forward pass raises. Knows hook points by name only (names come from ``AdapterBase.hook_name``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

HookFn = Callable[[Tensor], None]


@contextmanager
def registered(model: Any, architecture: str, hooks: Sequence[tuple[str, HookFn]],
               on_forward_end: Callable[[], None] | None = None) -> Iterator[None]:
    """Attach ``fn(activation)`` at each named hook point of ``model``; remove exactly these on
    exit, and call ``on_forward_end()`` after each forward pass.

    Hooks the user attached before are left alone. An exception raised by ``fn`` is re-raised
    as a ``TLDynamicsError`` naming the hook point, after every hook here is removed.
    ``architecture`` names the model in errors.
    """
    hook_dict = model.hook_dict
    owned: list[tuple[Any, Any]] = []  # (hook point, LensHandle)
    torch_handles = []

    def wrap(name: str, fn: HookFn):
        def hook(activation: Tensor, hook: Any = None) -> None:
            try:
                fn(activation)
            except TLDynamicsError:
                raise
            except Exception as exc:  # re-raised with the hook point named
                raise TLDynamicsError(f"error inside tl_dynamics hook at {name!r}: "
                                      f"{type(exc).__name__}: {exc}") from exc
            return None
        return hook

    try:
        for name, fn in hooks:
            if name not in hook_dict:
                raise TLDynamicsError(f"hook point {name!r} does not exist on this "
                                      f"{architecture} model")
            point = hook_dict[name]
            before = list(point.fwd_hooks)
            point.add_hook(wrap(name, fn), dir="fwd")
            owned.extend((point, h) for h in point.fwd_hooks if all(h is not b for b in before))
        if on_forward_end is not None:
            torch_handles.append(model.register_forward_hook(lambda *_: on_forward_end()))
        yield
    finally:
        for point, handle in owned:
            handle.hook.remove()
            point.fwd_hooks = [h for h in point.fwd_hooks if h is not handle]
        for handle in torch_handles:
            handle.remove()
