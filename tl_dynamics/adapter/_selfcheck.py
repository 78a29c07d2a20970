"""The self-check when a model is adapted: one short probe (``PROBE_TOKENS`` tokens, one row, no
grad) through ``ModelAdapter.attention(..., reference=True)``, whose recomputed pattern and ``z``
are compared with the model's own on every attention layer (its hooks; on delegating bridges
and unhooked layers the Hugging Face module's own attention weights). A layer that disagrees by
more than ``tolerance(dtype)`` is refused by name, with its reading, before any analysis runs.

The probe cannot see what needs more than ``PROBE_TOKENS`` positions: a window of 8 tokens or
more (every real one), RoPE scaling that starts past the original context, a long-context
switch (Ministral 3's query scaling), padding (one unpadded row). Those are covered by the
readers (``_readers``: windows per layer, layer types honoured) and the flag refusals
(``_flags``), and by the exactness tests on prompts longer than the tiny models' windows.

One probe per model object: the result is kept (weakly) under the model, its layer readings and
its weights' version, so constructing many adapters over one model probes once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tl_dynamics.adapter import _capture, _readers
from tl_dynamics.adapter._hub import hub_of
from tl_dynamics.adapter._weights import weights_version
from tl_dynamics.errors import TLDynamicsError

PROBE_TOKENS = 8
# largest |difference| allowed in a pattern entry; z is allowed this times max(1, max |z|)
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
_VERIFIED: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def tolerance(dtype: torch.dtype) -> float:
    """The self-check's tolerance on a pattern entry for weights of ``dtype``.

    Example:
        >>> tolerance(torch.float32), tolerance(torch.bfloat16)
        (0.001, 0.05)
    """
    return TOLERANCE.get(dtype, TOLERANCE[torch.float32])


def probe_tokens(d_vocab: int, n_ctx: int) -> torch.Tensor:
    """The probe's token ids: one row of ``min(PROBE_TOKENS, n_ctx)`` distinct-looking ids.

    Example:
        >>> probe_tokens(512, 64).tolist()
        [[11, 250, 489, 216, 455, 182, 421, 148]]
    """
    n = min(PROBE_TOKENS, n_ctx)
    return ((torch.arange(n) * 7919 + 11) % d_vocab)[None]


def verify(adapter: Any) -> None:
    """Run the self-check on ``adapter`` (once per model, readings and weights), or refuse the
    first layer whose reading does not reproduce the model's own pattern or ``z``."""
    model = adapter.model
    if _capture.probing(model) or hub_of(adapter).collectors:
        return  # inside a pass, or while an analysis is attached: it would see the probe
    if adapter._params is None:
        adapter._params = list(model.parameters())
    key = (tuple(adapter.specs), adapter.info.compat, weights_version(adapter._params))
    if _VERIFIED.get(model) == key or not adapter.attention_layers:
        return
    tokens = probe_tokens(int(model.cfg.d_vocab), adapter.n_ctx)
    with torch.no_grad():
        layers = adapter.attention(tokens, reference=True, sinks=True)
        tol = tolerance(adapter.dtype)
        for layer, la in layers.items():
            pattern = la.pattern()
            err = _worst(pattern, la.reference.get("pattern"))
            what = "pattern"
            if err <= tol and "z" in la.reference:
                ref = la.reference["z"]
                err = _worst(la.z(pattern=pattern), ref) / max(1.0, float(ref.abs().max()))
                what = "z (relative to its largest entry)"
            if err > tol:
                raise _refusal(adapter, layer, what, err, tol, tokens.shape[1])
    _drop_weight_copies(adapter)
    _VERIFIED[model] = key


def _drop_weight_copies(adapter: Any) -> None:
    """Forget the float32 weight copies the probe read (embedding, ``W_Q``, ``W_O``, ...): the
    adapter reads them again when an analysis asks; rotations and the probe's tables stay."""
    for key in [k for k, v in adapter._cache.items() if isinstance(v, torch.Tensor)]:
        del adapter._cache[key]


def _worst(got: torch.Tensor, want: torch.Tensor | None) -> float:
    if want is None:
        return 0.0
    diff = (got.float() - want.float().to(got.device)).abs()
    return float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0


def _refusal(
    adapter: Any, layer: int, what: str, err: float, tol: float, n: int
) -> TLDynamicsError:
    spec = adapter.specs[layer]
    reading = (
        f"scale {spec.scale:.6g}, window {spec.window}, soft-cap {spec.softcap}, causal "
        f"{spec.causal}, rotary {spec.rotary} (dim {spec.rotary_dim}, base {spec.rotary_base}), "
        f"ALiBi {spec.alibi}"
    )
    return TLDynamicsError(
        f"layer {layer} of {adapter.info.architecture} is refused: the adapter's reading of it "
        f"({reading}) does not reproduce the model's own {what} on a {n}-token probe "
        f"(largest difference {err:.3g}, tolerance {tol:g}). Installed: {_readers.installed()}; "
        f"the tests ran on {_readers.tested_on()}. ModelAdapter(model, verify=False) skips "
        "this check, but the layer's numbers would not be the model's"
    )
