"""Reading one layer's ``Rotation`` from the model, and checking it against the model itself.

Where the rotation comes from, per host:

- ``"half"`` layers on a ``TransformerBridge``: the ``cos``/``sin`` the layer fires in the probe
  pass (``_probepass``, the self-check's own) give the width and magnitude; the frequencies are
  the model's own float32 ``inv_freq`` buffer whose tables reproduce those hooks (else they are
  fitted from the hooks), so rope scalings that change the frequencies are included;
- ``"interleaved"`` layers (GPT-J, TransformerLens native): width and base from the layer's
  spec, with the native model's own cached tables where it keeps them;
- ``"hooked"`` layers (HookedTransformer): its own ``rotary_cos``/``rotary_sin`` tables; the pair
  layout is the one that reproduces its rotated queries.

Wherever the model fires its rotated queries (``hook_rot_q``), the rotation must reproduce them
from the layer input (``x W_Q + b_Q``, normalised on qk-norm layers) in the probe pass, else a
``TLDynamicsError`` is raised rather than a wrong rotation returned.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from tl_dynamics.adapter._mla import latent_rotation
from tl_dynamics.adapter._rotary import Layout, Rotation
from tl_dynamics.adapter._spec import LayerSpec
from tl_dynamics.errors import TLDynamicsError

PROBE_ROLES = ("x", "rot_q", "cos", "sin")
# The model's rotated queries must be reproduced to this relative error: float32 rounding of a
# [d_model] x [d_model, d_head] product and a rotation (seen <= 2e-7); a wrong layout, width or
# frequency gives errors of order 1. Half-precision models: HALF_ULPS units of their precision.
MATCH_RTOL = 1e-4
HALF_ULPS = 8
# A frequency buffer is the layer's own when its float32 tables equal the fired cos/sin to this
# (or to the fired tables' own precision, when the model runs in half precision).
TABLE_ATOL = 1e-6


def _tolerance(floor: float, like: Tensor, ulps: float) -> float:
    """``floor``, or ``ulps`` units of ``like``'s precision where that is coarser."""
    return max(floor, ulps * torch.finfo(like.dtype).eps) if like.is_floating_point() else floor


Buffers = Callable[[], list[tuple[str, Tensor]]]  # the model's inv_freq buffers, by name
Probe = Callable[[Sequence[str]], dict[str, Tensor]]  # roles -> one probe pass's activations
Queries = Callable[[Tensor], Tensor]  # attention input [b, p, d_model] -> unrotated q [b, p, h, d]


def inv_freq_buffers(model: Any) -> list[tuple[str, Tensor]]:
    """The model's own rotary frequency buffers (``*inv_freq``) by name, in module order: walked
    once per adapter (``ModelAdapter.rotation`` keeps them), not once per layer."""
    owner = getattr(model, "original_model", model)
    return [(name, b) for name, b in owner.named_buffers() if name.endswith("inv_freq")]


def read_rotation(
    spec: LayerSpec,
    model: Any,
    probe: Probe,
    queries: Queries,
    where: str,
    buffers: Buffers | None = None,
) -> Rotation | None:
    """The verified ``Rotation`` of the layer ``spec`` describes, or None where it has none.

    ``probe(roles)`` gives the layer's activations in the probe pass (``_probepass``: the
    self-check's 8 tokens) for the roles it fires (``x`` as the attention input W_Q reads);
    ``queries`` maps that input to the unrotated query. ``where`` names the layer in errors.
    ``buffers()``: the model's ``inv_freq`` buffers (``inv_freq_buffers``, read when needed).
    Candidates are formed one at a time, the next only where the last does not verify.
    """
    buffers = buffers or (lambda: inv_freq_buffers(model))
    if spec.latent:  # rotary on the last coordinates, hooked already rotated (_mla)
        return latent_rotation(spec.layer, model, probe(PROBE_ROLES), queries, where)
    if spec.rotary == "none":
        return None
    got = probe(PROBE_ROLES)
    if spec.rotary == "interleaved":
        candidates: Iterable[Rotation] = [_interleaved(spec, model, buffers, where)]
    elif spec.rotary == "half":
        candidates = _half_candidates(spec, buffers, got, where)
    else:
        candidates = _hooked(spec, model, where)
    return _verified(candidates, got, queries, where)


def _half_candidates(
    spec: LayerSpec, buffers: Buffers, got: dict[str, Tensor], where: str
) -> Iterator[Rotation]:
    first = _from_hooks(spec, buffers, got, where)
    yield first
    yield from _adjacent_pairs(first, got)
    yield from _undoubled(spec, buffers, got)
    # NanoChat rotates the other way: sin negated (verified, last)
    yield Rotation(first.layer, "half", first.rotary_dim, -first.inv_freq, first.magnitude)


def inv_freq_from_base(rotary_dim: int, base: float) -> Tensor:
    """``1 / base^(2k / rotary_dim)`` computed in float32 as the Hugging Face and GPT-J code
    does, returned as float64 (exactly those float32 values)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return (1.0 / (float(base) ** exponents)).double()


def _interleaved(spec: LayerSpec, model: Any, buffers: Buffers, where: str) -> Rotation:
    if spec.rotary_dim is not None and spec.rotary_base is None:  # Llama 4: the model's own
        for name, buffer in buffers():
            if name.endswith("rotary_emb.inv_freq") and buffer.numel() == spec.rotary_dim // 2:
                return Rotation(
                    spec.layer,
                    "interleaved",
                    int(spec.rotary_dim),
                    buffer.detach().double().cpu(),
                    1.0,
                )
    if spec.rotary_dim is None or spec.rotary_base is None:
        raise TLDynamicsError(
            f"{where} is rotary (interleaved) but its rotary width or base is "
            f"unknown (rotary_dim={spec.rotary_dim}, base={spec.rotary_base})"
        )
    attn = model.blocks[spec.layer].attn
    native = getattr(getattr(attn, "original_component", None), "rotary", None)
    table = None
    if native is not None and hasattr(native, "cos_cached"):
        table = (native.cos_cached.detach(), native.sin_cached.detach())
    return Rotation(
        spec.layer,
        "interleaved",
        int(spec.rotary_dim),
        inv_freq_from_base(int(spec.rotary_dim), spec.rotary_base),
        1.0,
        table,
    )


def _fitted(layout: Layout, cos: Tensor, sin: Tensor) -> tuple[Tensor, float]:
    """``(inv_freq, magnitude)`` from tables at positions 0 and 1 (float64 arithmetic)."""
    pick = slice(0, cos.shape[-1] // 2) if layout == "half" else slice(0, None, 2)
    c, s = cos.double(), sin.double()
    return torch.atan2(s[1, pick], c[1, pick]), float(c[0, 0])


def _from_hooks(spec: LayerSpec, buffers: Buffers, got: dict[str, Tensor], where: str) -> Rotation:
    if "cos" not in got or "sin" not in got:
        raise TLDynamicsError(
            f"{where} is rotary but fires no cos/sin hooks, so its rotation cannot be read"
        )
    n_pos, n_rot = got["cos"].shape[-2:]
    cos = got["cos"].reshape(-1, n_pos, n_rot)[0].cpu()  # [pos, rotary_dim], on the CPU
    sin = got["sin"].reshape(-1, n_pos, n_rot)[0].cpu()
    inv_freq, magnitude = _fitted("half", cos, sin)
    positions = torch.arange(n_pos)
    for _, buffer in buffers():  # the model's own float32 frequencies, where they fit exactly
        if buffer.numel() != n_rot // 2:
            continue
        candidate = Rotation(spec.layer, "half", n_rot, buffer.detach().double().cpu(), magnitude)
        mine_cos, mine_sin = candidate.cos_sin(positions)
        err = max((mine_cos - cos.float()).abs().max(), (mine_sin - sin.float()).abs().max())
        if err <= _tolerance(TABLE_ATOL, cos, 1):
            return candidate
    return Rotation(spec.layer, "half", n_rot, inv_freq, magnitude)


def _adjacent_pairs(half: Rotation, got: dict[str, Tensor]) -> list[Rotation]:
    """Adjacent-pair candidates for bridges that rotate pairs ``(2k, 2k+1)`` with the fired
    cos/sin (tried after ``half``, kept only if they reproduce the rotated queries): GLM/ERNIE
    expand half-layout tables, Cohere fires interleaved ones."""
    n_pos, n_rot = got["cos"].shape[-2:]
    cos = got["cos"].reshape(-1, n_pos, n_rot)[0].cpu()
    sin = got["sin"].reshape(-1, n_pos, n_rot)[0].cpu()
    inv_freq, magnitude = _fitted("interleaved", cos, sin)
    return [
        Rotation(half.layer, "interleaved", half.rotary_dim, half.inv_freq, half.magnitude),
        Rotation(half.layer, "interleaved", half.rotary_dim, inv_freq, magnitude),
    ]


def _undoubled(spec: LayerSpec, buffers: Buffers, got: dict[str, Tensor]) -> list[Rotation]:
    """A half-layout candidate for tables that hold each frequency once (GPT-OSS fires
    ``cos``/``sin`` of width ``rotary_dim / 2`` and rotates ``(x_k, x_{k + rotary_dim/2})``):
    tried last, kept only if it reproduces the rotated queries."""
    n_pos, n_rot = got["cos"].shape[-2:]
    cos = got["cos"].reshape(-1, n_pos, n_rot)[0].double().cpu()
    sin = got["sin"].reshape(-1, n_pos, n_rot)[0].double().cpu()
    if n_pos < 2:
        return []
    inv_freq, magnitude = torch.atan2(sin[1], cos[1]), float(cos[0, 0])
    for _, buffer in buffers():
        if buffer.numel() == n_rot:  # the model's own float32 values
            inv_freq = buffer.detach().double().cpu()
            break
    return [Rotation(spec.layer, "half", 2 * n_rot, inv_freq, magnitude)]


def _hooked(spec: LayerSpec, model: Any, where: str) -> list[Rotation]:
    attn = model.blocks[spec.layer].attn
    cos, sin = getattr(attn, "rotary_cos", None), getattr(attn, "rotary_sin", None)
    if not isinstance(cos, Tensor) or not isinstance(sin, Tensor) or cos.shape[0] < 2:
        raise TLDynamicsError(f"{where} is rotary but keeps no rotary_cos/rotary_sin tables")
    table = (cos.detach(), sin.detach())
    out = []
    for layout in ("half", "interleaved"):
        inv_freq, magnitude = _fitted(layout, table[0].cpu(), table[1].cpu())
        out.append(Rotation(spec.layer, layout, int(cos.shape[-1]), inv_freq, magnitude, table))
    return out


def _verified(
    candidates: Iterable[Rotation], got: dict[str, Tensor], queries: Queries, where: str
) -> Rotation:
    candidates = iter(candidates)
    if "x" not in got or "rot_q" not in got:
        return next(candidates)  # the model shows no rotated query; the exactness tests check it
    q = queries(got["x"].float())
    scored = got["rot_q"].float().reshape(q.shape)
    tolerance = _tolerance(MATCH_RTOL, got["rot_q"], HALF_ULPS)
    positions = torch.arange(q.shape[1], device=q.device).expand(q.shape[:2])
    errors, width = {}, None
    for rotation in candidates:
        width = rotation.rotary_dim if width is None else width
        if rotation.rotary_dim > q.shape[-1]:
            continue  # an undoubled candidate wider than the head
        err = (rotation.rotate(q, positions) - scored).abs().max() / scored.abs().max().clamp_min(
            1e-30
        )
        errors[rotation.layout] = float(err)
        if errors[rotation.layout] <= tolerance:
            return rotation
    raise TLDynamicsError(
        f"{where}: the model's rotated queries are not reproduced by its rotary tables (relative "
        f"errors {errors} for width {width}); a rope scaling that changes "
        "with the sequence (dynamic NTK) is not supported"
    )
