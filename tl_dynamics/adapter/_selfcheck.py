"""The self-check when a model is adapted: every weight finite first (``_finite.check_finite``:
a NaN or infinite parameter is refused naming the tensor, not blamed on a layer's reading), then
one probe pass (``_probepass``: ``PROBE_TOKENS`` tokens,
one row, no grad, stopped after the last attention layer), whose recomputed pattern and ``z`` are
compared with the model's own on every attention layer (its hooks; on delegating bridges and
unhooked layers the Hugging Face module's own attention weights). A layer that disagrees by more
than ``tolerance(dtype)`` is refused by name, with its reading, before any analysis runs. The same
pass is the rotation probe: every rotary layer's ``Rotation`` is read and verified against the
rotated queries it fired there (``_rotation``), so a rotary model is not run a second time.

The probe cannot see what needs more than ``PROBE_TOKENS`` positions: a window of 8 tokens or
more (every real one), RoPE scaling that starts past the original context, a long-context
switch (Ministral 3's query scaling), padding (one unpadded row). Those are covered by the
readers (``_readers``: windows per layer, layer types honoured) and the flag refusals
(``_flags``), and by the exactness tests on prompts longer than the tiny models' windows.

One probe per model object: the result is kept (weakly) under the model, its layer readings and
its weights' version, so constructing many adapters over one model probes once. A model whose
own forward pass fails in the installed host is refused by name (``_probepass.host_failures``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tl_dynamics.adapter import _capture, _finite, _readers
from tl_dynamics.adapter._batch import Batch
from tl_dynamics.adapter._collect import REFERENCE_ROLES, assemble
from tl_dynamics.adapter._gemma4 import keep_kv, kv_source_roles
from tl_dynamics.adapter._hub import ATTENTION_ROLES, hub_of
from tl_dynamics.adapter._postrope import extra_roles
from tl_dynamics.adapter._probepass import (
    PROBE_TOKENS,
    probe_pass,
    probe_tokens,
    rotation_layers,
    rotation_probe,
)
from tl_dynamics.adapter._rotation import PROBE_ROLES
from tl_dynamics.adapter._tolerance import TOLERANCE, tolerance
from tl_dynamics.adapter._weights import weights_version
from tl_dynamics.errors import TLDynamicsError

__all__ = ["PROBE_TOKENS", "TOLERANCE", "probe_tokens", "tolerance", "verify"]

_VERIFIED: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def verify(adapter: Any) -> None:
    """Run the self-check on ``adapter`` (once per model, readings and weights), or refuse the
    first layer whose reading does not reproduce the model's own pattern or ``z``."""
    model = adapter.model
    if _capture.probing(model) or hub_of(adapter).collectors:
        return  # inside a pass, or while an analysis is attached: it would see the probe
    if adapter._params is None:
        adapter._params = list(model.parameters())
    key = (tuple(adapter.specs), adapter.info.compat, weights_version(adapter._params))
    if _VERIFIED.get(model) == key:
        return
    _finite.check_finite(model)  # a NaN weight named as such, not as a wrong reading
    if not adapter.attention_layers:
        return
    tokens = probe_tokens(int(model.cfg.d_vocab), adapter.n_ctx)
    layers = adapter.attention_layers
    rotary, half = rotation_layers(adapter, PROBE_ROLES)
    wanted = [(role, layer) for layer in layers for role in _roles(adapter.specs[layer])]
    wanted += kv_source_roles(adapter.specs, set(layers))  # Gemma 4: another layer's keys
    wanted += [(role, layer) for layer in rotary for role in PROBE_ROLES]
    got, received = probe_pass(adapter, tokens, list(dict.fromkeys(wanted)), half)
    adapter._cached(  # the rotation probe is this pass: the rotations below are read from it
        ("probe", PROBE_ROLES), lambda: rotation_probe(adapter, PROBE_ROLES, (got, received))
    )
    batch = Batch(tokens, torch.ones_like(tokens, dtype=torch.bool), "right")
    shared: dict = {}
    tol = tolerance(adapter.dtype)
    with torch.no_grad():
        for layer in layers:  # read and verified against this pass's rotated queries
            adapter.rotation(layer)
        for layer in sorted(got):
            keep_kv(adapter.specs, layer, got[layer], shared)  # for a later layer (Gemma 4)
            if layer not in layers:
                continue
            la = assemble(adapter, layer, dict(got[layer]), batch, shared)
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


def _roles(spec: Any) -> list[str]:
    """What the self-check reads of an attention layer: what ``capture(reference=True)`` reads
    (``_hub``), but the summed output (not compared; on a HookedTransformer it fires after the
    attention module, where the probe pass may have stopped). Rotary layers add ``PROBE_ROLES``."""
    reference = [role for role in REFERENCE_ROLES if role != "out"]
    return list(ATTENTION_ROLES) + extra_roles(spec) + reference


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
