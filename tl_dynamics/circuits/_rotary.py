"""The rotation a rotary layer applies between a query and a key, read from the model.

With rotary embeddings the score between a query at position ``i`` and a key at position ``j``
is ``c (x_i W_Q + b_Q) R_{i-j} (x_j W_K + b_K)^T``: it depends on the relative offset
``delta = i - j`` through a ``d_head x d_head`` rotation ``R_delta`` (row-vector convention,
``R_a R_b^T = R_{a-b}``). ``RotaryMap`` holds the layout, rotary width, frequencies and
magnitude of that rotation as the model itself uses them:

- ``"half"`` layers on a ``TransformerBridge``: frequencies and magnitude are read from the
  model's own ``cos``/``sin`` at positions 0 and 1 (one two-token forward pass), so rope
  scalings that change the frequencies are included;
- ``"interleaved"`` (GPT-J): width and base from the layer spec, as the adapter applies them;
- ``"hooked"`` (HookedTransformer): width and base from the layer spec; the pair layout
  (rotate-half or adjacent pairs) is the one that reproduces the model's own rotated queries.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from tl_dynamics.adapter import _rotary
from tl_dynamics.errors import TLDynamicsError

from tl_dynamics.adapter import ModelAdapter

# A HookedTransformer's rotated queries must be reproduced to this relative error (float32
# sin/cos tables against float64 angles) for a pair layout to count as the model's own.
LAYOUT_RTOL = 1e-4
_PROBE_POSITIONS = 8


@dataclass(frozen=True)
class RotaryMap:
    """One layer's rotary rotation.

    Attributes:
        layer: the layer it was read from.
        layout: ``"half"`` (pairs ``(k, k + rotary_dim/2)``) or ``"interleaved"`` (pairs
            ``(2k, 2k+1)``).
        rotary_dim: how many leading dims of each head are rotated (the rest pass through).
        inv_freq: angle per position of each pair, ``[rotary_dim / 2]`` (float64).
        magnitude: factor the model multiplies both cos and sin by (1 unless a rope scaling
            rescales them); scores carry its square.
    """

    layer: int
    layout: Literal["half", "interleaved"]
    rotary_dim: int
    inv_freq: Tensor
    magnitude: float = 1.0

    def cos_sin(self, positions: Int[Tensor, " pos"]) -> tuple[Tensor, Tensor]:
        """``cos``/``sin`` tables ``[1, pos, rotary_dim]`` in the layout's order."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cos(angles), torch.sin(angles)
        if self.layout == "half":
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        else:
            cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        return (self.magnitude * cos)[None].float(), (self.magnitude * sin)[None].float()

    def rotate(self, x: Float[Tensor, "pos ... d_head"],
               positions: Int[Tensor, " pos"]) -> Float[Tensor, "pos ... d_head"]:
        """Rotate vectors as the model rotates a query or key at ``positions`` (dim 0 of ``x``)."""
        shape = x.shape
        flat = x.reshape(1, shape[0], -1, shape[-1])  # [1, pos, rest, d_head]
        cos, sin = (t.to(x.device) for t in self.cos_sin(positions.cpu()))
        apply = _rotary.apply_half if self.layout == "half" else _rotary.apply_interleaved
        return apply(flat.float(), cos, sin)[0].reshape(shape)

    def matrix(self, offset: int, d_head: int) -> Float[Tensor, "d_head d_head"]:
        """``R_offset``: ``score = c q R_offset k^T`` for unrotated ``q`` (query at ``i``) and
        ``k`` (key at ``i - offset``), magnitude included."""
        eye = torch.eye(d_head, dtype=torch.float32)
        rotated = self.rotate(eye[None], torch.tensor([offset]))[0]
        return rotated * self.magnitude


def rotary_map(adapter: ModelAdapter, layer: int) -> RotaryMap | None:
    """The layer's ``RotaryMap``, or None where the layer has no rotary embedding."""
    spec = adapter.specs[adapter.check_layer(layer)]
    if spec.rotary == "none":
        return None
    if spec.rotary == "interleaved":
        return _from_base(layer, "interleaved", spec.rotary_dim, spec.rotary_base)
    if spec.rotary == "half":
        return _from_cos_sin(adapter, layer)
    return _hooked(adapter, layer, spec.rotary_dim, spec.rotary_base)


def _from_base(layer: int, layout: Literal["half", "interleaved"], rotary_dim: int | None,
               base: float | None) -> RotaryMap:
    if rotary_dim is None or base is None:
        raise TLDynamicsError(f"layer {layer} is rotary ({layout}) but its rotary width or base "
                              f"is unknown (rotary_dim={rotary_dim}, rotary_base={base})")
    inv_freq = 1.0 / (float(base) ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    return RotaryMap(layer, layout, int(rotary_dim), inv_freq)


def _probe(adapter: ModelAdapter, layer: int, roles: list[str], n_pos: int) -> dict[str, Tensor]:
    """Run ``n_pos`` tokens through the model and keep the activations of ``roles`` in ``layer``."""
    missing = [r for r in roles if adapter.hook_name(r, layer) is None]
    if missing:
        raise TLDynamicsError(
            f"layer {layer} of {adapter.info.architecture} is rotary but fires no {missing} hook, "
            "so its rotation cannot be read; the QK circuit at an offset needs the rotary "
            "frequencies (ask for them to be added to the adapter's LayerSpec)")
    got: dict[str, Tensor] = {}
    hooks = [(role, layer, (lambda r: lambda a: got.__setitem__(r, a.detach().double()))(role))
             for role in roles]
    n_vocab = adapter.W_E.shape[0]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, n_vocab, (2, n_pos), generator=gen)
    with adapter.hooks(hooks):
        adapter.forward(adapter.tokenize(tokens))
    return got


def _from_cos_sin(adapter: ModelAdapter, layer: int) -> RotaryMap:
    got = _probe(adapter, layer, ["cos", "sin"], 2)
    cos = got["cos"].reshape(-1, 2, got["cos"].shape[-1])[0]  # [pos, rotary_dim]
    sin = got["sin"].reshape(-1, 2, got["sin"].shape[-1])[0]
    half = cos.shape[-1] // 2
    magnitude = float(cos[0, 0])
    inv_freq = torch.atan2(sin[1, :half], cos[1, :half])
    return RotaryMap(layer, "half", int(cos.shape[-1]), inv_freq, magnitude)


def _hooked(adapter: ModelAdapter, layer: int, rotary_dim: int | None,
            base: float | None) -> RotaryMap:
    got = _probe(adapter, layer, ["q", "rot_q"], _PROBE_POSITIONS)
    q, rot_q = got["q"].float(), got["rot_q"].float()  # [batch, pos, head, d_head]
    norm = adapter.query_norm(layer)
    if norm is not None:  # qk-norm: hook_q is before the norm, hook_rot_q after it
        q = norm.apply_heads(q)
    positions = torch.arange(q.shape[1])
    errors = {}
    for layout in ("half", "interleaved"):
        rmap = _from_base(layer, layout, rotary_dim, base)
        mine = rmap.rotate(q.transpose(0, 1), positions).transpose(0, 1)
        errors[layout] = float((mine - rot_q).norm() / rot_q.norm().clamp_min(1e-30))
        if errors[layout] < LAYOUT_RTOL:
            return rmap
    raise TLDynamicsError(
        f"layer {layer}: the model's rotated queries match neither rotary layout with "
        f"rotary_dim={rotary_dim}, base={base} (relative errors {errors}); a rope scaling "
        "(NTK, YaRN, dynamic) is not supported for HookedTransformer QK circuits")


def offsets_checked(offsets: int | list[int] | range, n_ctx: int) -> list[int]:
    """Validate relative offsets (``0 <= delta < n_ctx``)."""
    items = [offsets] if isinstance(offsets, int) else list(offsets)
    bad = [d for d in items if not isinstance(d, int) or isinstance(d, bool) or abs(d) >= n_ctx]
    if not items or bad:
        raise TLDynamicsError(f"offsets {bad or items!r} are not valid relative positions "
                              f"(query minus key): valid are integers with |delta| < n_ctx = {n_ctx}")
    return items




_MAPS: "weakref.WeakKeyDictionary[ModelAdapter, dict[int, RotaryMap | None]]" = weakref.WeakKeyDictionary()


def cached_rotary_map(adapter: ModelAdapter, layer: int) -> RotaryMap | None:
    """``rotary_map``, remembered per adapter (reading it may cost a short forward pass)."""
    per_layer = _MAPS.setdefault(adapter, {})
    if layer not in per_layer:
        per_layer[layer] = rotary_map(adapter, layer)
    return per_layer[layer]
