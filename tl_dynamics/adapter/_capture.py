"""Hook registration: attach only our own hooks and remove exactly those on exit, even when the
forward pass raises. Knows hook points by name only (names come from ``AdapterBase.hook_name``);
names of ``_unhooked`` points become torch hooks on the Hugging Face module they name.

A *probe* pass (the self-check's short forward pass, which also reads the rotations:
``_probepass``) is invisible to every other tl_dynamics hook on the model: collectors and patches
attached around it neither see nor change it, so reading a rotation while an analysis is
attached leaves that analysis intact."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from torch import Tensor

from tl_dynamics.adapter import _unhooked
from tl_dynamics.errors import TLDynamicsError

HookFn = Callable[[Tensor], None]
_PROBING: "weakref.WeakSet[Any]" = weakref.WeakSet()  # models running a probe pass now


def probing(model: Any) -> bool:
    """Whether ``model`` is running a tl_dynamics probe pass (other tl_dynamics hooks stand by)."""
    return model in _PROBING


@contextmanager
def registered(
    model: Any,
    architecture: str,
    hooks: Sequence[tuple[str, HookFn]],
    on_forward_end: Callable[[], None] | None = None,
    probe: bool = False,
    module_hooks: Sequence[tuple[Any, str, Callable]] = (),
) -> Iterator[None]:
    """Attach ``fn(activation)`` at each named hook point of ``model``; remove exactly these on
    exit, and call ``on_forward_end()`` after each call of the model itself (``model(...)``).

    ``module_hooks``: ``(module, "pre" | "post", fn)``, torch hooks on other modules (where a
    pass starts and ends, ``_pass``): ``fn(args, kwargs)`` before the module runs, ``fn()``
    after it returns.

    ``probe=True``: these hooks belong to a probe pass run inside the block; while it runs,
    every other tl_dynamics hook on the model stands by (and these fire only then).

    Hooks the user attached before are left alone. An exception raised by ``fn`` reaches the
    caller as itself, with a note naming the hook point, after every hook here is removed: a
    bug in a collector must read as a bug, not as a refusal.
    ``architecture`` names the model in errors.
    """
    hook_dict = model.hook_dict
    silenced: list[tuple[Any, str, Any]] = []
    owned: list[tuple[Any, Any]] = []  # (hook point, LensHandle)
    torch_handles = []

    def wrap(name: str, fn: HookFn):
        def hook(activation: Tensor, hook: Any = None) -> None:
            if probing(model) != probe:
                return None
            try:
                fn(activation)
            except Exception as exc:  # the exception itself, with the hook point named
                if hasattr(exc, "add_note") and not getattr(exc, "_tld_noted", False):
                    exc.add_note(f"(raised inside the tl_dynamics hook at {name!r})")
                    exc._tld_noted = True  # type: ignore[attr-defined]
                raise
            return None

        return hook

    try:
        for name, fn in hooks:
            if _unhooked.is_point(name):  # torch hooks on a module the host does not hook
                torch_handles.extend(_unhooked.register(model, name, wrap(name, fn)))
                continue
            if name not in hook_dict:
                raise TLDynamicsError(
                    f"hook point {name!r} does not exist on this {architecture} model"
                )
            point = hook_dict[name]
            before = list(point.fwd_hooks)
            point.add_hook(wrap(name, fn), dir="fwd")
            owned.extend((point, h) for h in point.fwd_hooks if all(h is not b for b in before))
        for module, kind, fn in module_hooks:
            torch_handles.append(_module_hook(model, module, kind, fn, probe))
        if on_forward_end is not None:
            torch_handles.append(
                model.register_forward_hook(
                    lambda *_: None if probing(model) != probe else on_forward_end()
                )
            )
        if probe:
            _PROBING.add(model)
            ours = {h.hook.id for _, h in owned} | {getattr(h, "id", None) for h in torch_handles}
            silenced = _silence_others(model, ours)
        yield
    finally:
        if probe:
            _PROBING.discard(model)
            for module, attribute, hooks_dict in silenced:  # the user's hooks, back in place
                setattr(module, attribute, hooks_dict)
        for point, handle in owned:
            handle.hook.remove()
            point.fwd_hooks = [h for h in point.fwd_hooks if h is not handle]
        for handle in torch_handles:
            handle.remove()


def _module_hook(model: Any, module: Any, kind: str, fn: Callable, probe: bool) -> Any:
    """A torch hook on ``module`` that calls ``fn`` unless a probe pass of the other kind runs."""
    if kind == "pre":
        return module.register_forward_pre_hook(
            lambda _module, args, kwargs: None if probing(model) != probe else fn(args, kwargs),
            with_kwargs=True,
        )
    return module.register_forward_hook(lambda *_: None if probing(model) != probe else fn())


def _silence_others(model: Any, ours: set) -> list[tuple[Any, str, Any]]:
    """Hide every hook on ``model``'s hook points that is not in ``ours`` (the user's own:
    ``add_hook``, ``hooks()``, ``run_with_hooks``) for a probe pass: ``(hook point, attribute,
    hooks)`` to put back. The probe pass is then invisible to the user's hooks as theirs are to
    it; torch hooks on the host's own modules (its machinery) are left alone."""
    hidden = []
    for module in dict.fromkeys(model.hook_dict.values()):
        for attribute in ("_forward_hooks", "_forward_pre_hooks"):
            hooks = getattr(module, attribute, None)
            if hooks and any(key not in ours for key in hooks):
                hidden.append((module, attribute, hooks))
                setattr(
                    module, attribute, OrderedDict((k, v) for k, v in hooks.items() if k in ours)
                )
    return hidden


@contextmanager
def wrapping(model: Any, name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """``model.<name>`` replaced by ``wrap(original)`` for the block (an attribute on the
    instance, removed on exit; the class's method is untouched)."""
    original = getattr(model, name, None)
    if original is None or not callable(original):
        yield
        return
    had = name in vars(model)
    vars(model)[name] = wrap(original)
    try:
        yield
    finally:
        if had:
            vars(model)[name] = original
        else:
            vars(model).pop(name, None)
