"""The collector base every attached analysis subclasses, and the analysis registry's base.

The adapter drives collectors (``ModelAdapter.collecting``): for each forward pass it calls
``start_pass(batch)`` once, ``on_layer(state)`` once per layer a collector asked for, with one
``LayerState`` shared by every collector attached to the model (the layer's ``LayerAttention``,
computed once, its memoised scores and log-softmax, the pass's masks, the residual points), and
``end_pass()`` after the model's forward returns. Nothing is guessed from layer indices."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Sequence

from tl_dynamics.collect._fused import Fused
from tl_dynamics.collect._policy import launch_bound
from tl_dynamics.errors import TLDynamicsError


class Collector(ABC):
    """What the adapter calls during the forward passes run while it is attached.

    A subclass says what it reads with these attributes (set in ``__init__`` or on the class):

    - ``layers``: attention layers whose ``state.attention`` (a ``LayerAttention``) it reads;
    - ``points``: residual points ``(role, layer)`` it reads from ``state.points`` (roles
      ``"resid_pre"``, ``"resid_mid"``, ``"resid_post"``);
    - ``inputs``: whether it needs the attention input ``x`` (``reference["x"]``);
    - ``reference``: whether it needs the model's own scores, pattern, ``z`` and output;
    - ``sinks``: whether it models learned attention sinks (otherwise such layers are refused
      when it is attached);
    - ``gates``: whether it models an output gate on ``z`` (gated attention), or reads nothing
      the gate enters (otherwise gated layers are refused when it is attached);
    - ``query_frames``: whether it forms queries from the attention input ``x`` (None: as
      ``inputs``), so layers whose query is not ``x W_Q``, normalised and rotated, are refused.

    An exception raised by a collector's own code reaches the caller as itself (with a note
    naming the hook point), after every hook is removed.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> class Layers(Collector):
        ...     def __init__(self):
        ...         self.layers, self.seen = (0, 1), []
        ...     def on_layer(self, state):
        ...         self.seen.append(state.layer)
        >>> ad = ModelAdapter(testing.tiny_model("gpt2"))
        >>> c = Layers()
        >>> with ad.collecting(c):
        ...     _ = ad.forward(ad.tokenize("a b c"))
        >>> c.seen
        [0, 1]
    """

    # Whether work on a device is planned in few large launches (a GPU) or in cache-sized
    # pieces (the CPU): ``tl_dynamics/collect/_policy.py``. A static method, so that collectors
    # and the kernels they call (``sphere``, the analyses' statistics) share one rule.
    launch_bound = staticmethod(launch_bound)
    # A pure per-pass function of the collected tensors, run compiled where that pays (a GPU):
    # ``Collector.fused(fn)``, ``tl_dynamics/collect/_fused.py``.
    fused = Fused

    layers: Sequence[int] = ()
    points: Sequence[tuple[str, int]] = ()
    inputs: bool = False
    reference: bool = False
    sinks: bool = False
    gates: bool = False
    query_frames: bool | None = None

    def start_pass(self, batch: Any) -> None:  # noqa: B027 (optional hook, empty by default)
        """A forward pass starts; ``batch`` (a ``tl_dynamics.adapter.Batch``) holds its tokens
        and padding mask (None when the model was called with something that is not token ids
        or text)."""

    @abstractmethod
    def on_layer(self, state: Any) -> None:
        """One layer of the pass (only layers in ``layers`` or with a point in ``points``):
        ``state`` is the ``tl_dynamics.adapter.LayerState`` every collector shares."""

    def end_pass(self) -> None:  # noqa: B027 (optional hook, empty by default)
        """The forward pass has returned (every layer was delivered)."""

    @staticmethod
    def no_passes(analysis: str) -> TLDynamicsError:
        """The one error of every attached analysis asked for a result before any forward pass
        ran inside its ``attach()`` block: no data is never a number.

        Example:
            >>> str(Collector.no_passes("odds_ratio")).split(";")[0]
            'odds_ratio.attach(): no forward pass has run inside attach()'
        """
        return TLDynamicsError(
            f"{analysis}.attach(): no forward pass has run inside attach(); run the model on some "
            "prompts inside the block (model(tokens), forward, run_with_cache, run_with_hooks "
            "or generate)"
        )


class Analysis(ABC):
    """One analysis package's entry points, as ``tl_dynamics.report.SECTIONS`` lists them.

    ``compute(model, prompt, *, layers=None, heads=None, ...)`` is the one-call entry point,
    ``attach`` (None where the analysis cannot stream) the context manager whose collector is a
    ``Collector``, and ``report_section(page, adapter, batch)`` adds its section to a report;
    ``prompts`` says whether that section reads ``"all"`` the report's prompts or the ``"first"``.
    """

    name: ClassVar[str]
    prompts: ClassVar[str] = "all"
    compute: ClassVar[Callable[..., Any]]
    attach: ClassVar[Callable[..., Any] | None] = None
    report_section: ClassVar[Callable[..., None]]
