"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, Youtu): q, k and v as scored,
and the layer's low-rank factors (docs/math.md §1.7).

In latent attention the query and key of head ``h`` are each the concatenation of a non-rotary
part, decompressed from a low-rank latent, and a rotary part:

    q_h = [q_h^nope ; R_i q_h^rope],   k_jh = [k_jh^nope ; R_j k_j^rope]

where the key's rotary part ``k_j^rope`` is one vector per position shared by every head. So
``<q_h, k_jh> = <q_h^nope, k_jh^nope> + <R_i q_h^rope, R_j k_j^rope>``, and the q/k head width
(nope + rope) differs from the value head width. TransformerLens's ``MLAAttentionBridge``
recomputes this attention and fires ``hook_q``/``hook_k`` on the concatenated, rotated q and k
(``[batch, head, pos, d_qk]``, shared rotary key already broadcast to every head) and
``hook_v`` on the values (``[batch, head, pos, d_v]``); its ``hook_z`` is the flat
``[batch, pos, head * d_v]`` input of the output projection. This module turns those into the
``[batch, pos, head, d]`` layout ``LayerAttention`` uses, and reads ``W_O`` per head from the
output projection, so the pattern, ``z`` and head outputs recompute exactly.

``LatentFactors`` holds the factors (row vectors, ``x`` the attention input):

    u = x A_q + a_q,   q = (g_q * u / rho(u)) B_q          (q_proj models: q = x B_q + b)
    c = x A_kv + a_kv, k^nope = (g_kv * c / rho(c)) B_k,  v = (g_kv * c / rho(c)) B_v
    k^rope = x A_r + a_r                                    (one per position, every head)

with ``rho(u) = sqrt(mean(u^2) + eps)`` the latent RMS norms. The gains fold into one matrix
per head (``W_Q = A_q diag(g_q) B_q``, ``W_K = [A_kv diag(g_kv) B_k ; A_r]``, ``W_V = A_kv
diag(g_kv) B_v``), exactly; the per-token scales ``1/rho`` are not a matrix: the query is
``(x W_Q + b_Q) / rho_q(x)`` exactly (``query_norm``), the non-rotary key and the value carry
``1/rho_kv(y)`` and the rotary key none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.adapter import _switches
from tl_dynamics.adapter._qknorm import QueryNorm
from tl_dynamics.adapter._rotary import Rotation
from tl_dynamics.errors import TLDynamicsError

__all__ = [
    "LATENT_BRIDGES",
    "LatentFactors",
    "latent_qkv",
    "latent_rotation",
    "latent_weight",
    "latent_z_patch",
    "read_latent",
]

# Bridges whose q/k/v hooks fire on [batch, head, pos, d] after rotary (see module doc).
LATENT_BRIDGES = {"MLAAttentionBridge"}
# Relative error within which a norm module must match g * u / rho(u), and the rotation the
# model's rotated queries (float32 rounding: ~1e-7; a wrong convention: order 1); a model in
# half precision: _HALF_ULPS units of its precision (as the rotary check, _rotation.py).
_RTOL = 1e-4
_HALF_ULPS = 8


def _tolerance(dtype: torch.dtype) -> float:
    """``_RTOL``, or ``_HALF_ULPS`` units of ``dtype``'s precision where that is coarser."""
    return max(_RTOL, _HALF_ULPS * torch.finfo(dtype).eps) if dtype.is_floating_point else _RTOL


@dataclass(frozen=True)
class LatentFactors:
    """The low-rank factors of one latent-attention layer, float32 (see the module doc).

    Rotary coordinates are in the order the layer's ``Rotation`` rotates them (``rope_order``
    lists the Hugging Face coordinate at each place: DeepSeek-V3's interleaved pairs
    ``(2k, 2k+1)`` become ``(k, k + d_rope/2)``, the same permutation for q and k, so every
    score is unchanged); ``ModelAdapter.rotation`` rotates the last ``d_rope`` coordinates.

    Attributes:
        A_q, a_q, g_q, eps_q: the query down-projection ``[d_model, r_q]``, its bias, the
            latent norm's gain and epsilon; None on models with a plain ``q_proj``.
        B_q: ``[head, r_q, d_qk]`` (``[head, d_model, d_qk]`` with a plain ``q_proj``);
            b_q its bias (zeros but for a ``q_proj`` bias).
        A_kv, a_kv, g_kv, eps_kv: the key/value down-projection ``[d_model, r_kv]``, bias,
            latent norm gain and epsilon. B_k ``[head, r_kv, d_nope]``, B_v ``[head, r_kv, d_v]``.
        A_r, a_r: the shared rotary key projection ``[d_model, d_rope]`` and bias.
    """

    layer: int
    d_nope: int
    d_rope: int
    A_q: Tensor | None
    a_q: Tensor | None
    g_q: Tensor | None
    eps_q: float
    B_q: Tensor
    b_q: Tensor
    A_kv: Tensor
    a_kv: Tensor
    g_kv: Tensor
    eps_kv: float
    B_k: Tensor
    B_v: Tensor
    A_r: Tensor
    a_r: Tensor
    rope_order: tuple[int, ...]

    @property
    def n_heads(self) -> int:
        return self.B_q.shape[0]

    def query_rms(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "..."]:
        """``rho_q(x)``: the RMS of the query latent (ones where there is no latent)."""
        if self.A_q is None or self.a_q is None:
            return torch.ones(x.shape[:-1], dtype=x.dtype, device=x.device)
        return _rms(x @ self.A_q.to(x) + self.a_q.to(x), self.eps_q)

    def key_rms(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "..."]:
        """``rho_kv(x)``: the RMS of the key/value latent."""
        return _rms(x @ self.A_kv.to(x) + self.a_kv.to(x), self.eps_kv)

    def queries(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... head d_qk"]:
        """The queries of every head before rotary, as the model computes them."""
        if self.A_q is None or self.a_q is None or self.g_q is None:
            return torch.einsum("...m,hmd->...hd", x, self.B_q.to(x)) + self.b_q.to(x)
        u = x @ self.A_q.to(x) + self.a_q.to(x)
        n = u / _rms(u, self.eps_q)[..., None] * self.g_q.to(x)
        return torch.einsum("...r,hrd->...hd", n, self.B_q.to(x)) + self.b_q.to(x)

    def keys(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... head d_qk"]:
        """The keys of every head before rotary (the rotary part the same for every head)."""
        nope = torch.einsum("...r,hrd->...hd", self._kv_latent(x), self.B_k.to(x))
        rope = (x @ self.A_r.to(x) + self.a_r.to(x))[..., None, :].expand(*nope.shape[:-1], -1)
        return torch.cat((nope, rope), dim=-1)

    def values(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... head d_v"]:
        return torch.einsum("...r,hrd->...hd", self._kv_latent(x), self.B_v.to(x))

    def _kv_latent(self, x: Tensor) -> Tensor:
        c = x @ self.A_kv.to(x) + self.a_kv.to(x)
        return c / _rms(c, self.eps_kv)[..., None] * self.g_kv.to(x)

    def weight(self, name: str) -> Tensor:
        """``W_Q``/``W_K``/``W_V`` (``[head, d_model, d]``) or ``b_Q``/``b_K``/``b_V``
        (``[head, d]``): the factors with the latent norms' gains folded in."""
        n = self.n_heads
        if name in ("W_Q", "b_Q"):
            if self.A_q is None or self.a_q is None or self.g_q is None:
                return self.B_q if name == "W_Q" else self.b_q
            down = self.A_q * self.g_q if name == "W_Q" else self.a_q * self.g_q
            return torch.einsum("...r,hrd->h...d", down, self.B_q) + (
                0 if name == "W_Q" else self.b_q
            )
        down = self.A_kv * self.g_kv if name.startswith("W") else self.a_kv * self.g_kv
        if name in ("W_V", "b_V"):
            return torch.einsum("...r,hrd->h...d", down, self.B_v)
        rope = self.A_r if name == "W_K" else self.a_r
        nope = torch.einsum("...r,hrd->h...d", down, self.B_k)
        return torch.cat((nope, rope.expand(n, *rope.shape)), dim=-1)

    def query_norm(self) -> QueryNorm | None:
        """The query's division by ``rho_q(x)`` as a ``QueryNorm`` (scope ``"latent"``), so that
        ``norm.apply_heads(x W_Q + b_Q, x)`` is the query exactly; None without a latent."""
        if self.A_q is None or self.a_q is None:
            return None
        return QueryNorm("latent", torch.ones(1), self.eps_q, down=self.A_q, down_bias=self.a_q)

    def score_parts(
        self, la: Any, heads: Sequence[int] | None = None
    ) -> tuple[Float[Tensor, "batch head pos pos"], Float[Tensor, "batch head pos pos"]]:
        """``(non-rotary, rotary)`` parts of the raw scores of ``la`` (this layer, captured):
        ``c <q^nope_ih, k^nope_jh>`` and ``c <R_i q^rope_ih, R_j k^rope_j>`` with the rotary key
        shared by every head. They sum to ``la.raw_scores(heads)``, the model's scores."""
        h = slice(None) if heads is None else list(heads)
        q, k, d = la.q[:, :, h], la.k[:, :, h], self.d_nope
        nope = torch.einsum("bihd,bjhd->bhij", q[..., :d], k[..., :d]) * la.scale
        rope = torch.einsum("bihd,bjhd->bhij", q[..., d:], k[..., d:]) * la.scale
        return nope, rope


def _rms(u: Tensor, eps: float) -> Tensor:
    return torch.sqrt(u.pow(2).mean(-1) + eps)


def _module(module: Any) -> Any:
    return getattr(module, "original_component", None) or module  # a bridge wrapper: its module


def _linear(module: Any, where: str, name: str) -> tuple[Tensor, Tensor | None]:
    inner = _module(module)
    weight = getattr(inner, "weight", None)
    if not isinstance(weight, Tensor):
        raise TLDynamicsError(f"{where}: its latent attention has no {name} weight to read")
    bias = getattr(inner, "bias", None)
    return weight.detach().float().T, None if bias is None else bias.detach().float()


def _norm(module: Any, width: int, where: str, name: str) -> tuple[Tensor, float]:
    """``(gain, eps)`` of a latent RMS norm, checked to compute ``g * u / rho(u)``."""
    inner = _module(module)
    weight = getattr(inner, "weight", None)
    eps = getattr(inner, "variance_epsilon", getattr(inner, "eps", None))
    if not isinstance(weight, Tensor) or eps is None:
        raise TLDynamicsError(
            f"{where}: cannot read its latent norm {name} ({type(inner).__name__}: no weight/eps)"
        )
    gain = weight.detach().float()
    u = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(gain.device)
    with torch.no_grad():
        want = inner(u.to(weight.dtype)).float()
    err = float((u / _rms(u, float(eps))[:, None] * gain - want).abs().max() / want.abs().max())
    if err > _tolerance(weight.dtype):
        raise TLDynamicsError(
            f"{where}: its latent norm {name} ({type(inner).__name__}) is not "
            f"an RMS norm with gain w (relative error {err:.3g})"
        )
    return gain, float(eps)


def read_latent(model: Any, layer: int, architecture: str) -> LatentFactors:
    """The ``LatentFactors`` of ``layer``, read from the Hugging Face module the bridge wraps."""
    where = f"layer {layer} of {architecture}"
    hf = _module(model.blocks[layer].attn)
    try:
        d_nope, d_rope = int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim)
        d_v, r_kv = int(hf.v_head_dim), int(hf.kv_lora_rank)
    except (AttributeError, TypeError):
        raise TLDynamicsError(
            f"{where}: its latent attention module {type(hf).__name__} does not "
            "give its head widths (qk_nope_head_dim, qk_rope_head_dim, "
            "v_head_dim, kv_lora_rank)"
        ) from None
    d_qk = d_nope + d_rope
    order = list(range(d_rope))
    if _switches.rope_interleave(hf):  # pairs (2k, 2k+1)
        order = order[0::2] + order[1::2]
    cols = list(range(d_nope)) + [d_nope + i for i in order]
    for name in ("q_b_proj", "kv_b_proj"):
        if getattr(_module(getattr(hf, name, None)), "bias", None) is not None:
            raise TLDynamicsError(
                f"{where}: its latent up-projection {name} has a bias, added "
                "after the latent norm; not supported"
            )
    if getattr(hf, "q_lora_rank", None) is None:  # a plain q_proj: the query is linear in x
        W, b = _linear(hf.q_proj, where, "q_proj")
        n_heads = W.shape[1] // d_qk
        A_q = a_q = g_q = None
        eps_q = 0.0
        B_q = W.reshape(W.shape[0], n_heads, d_qk).permute(1, 0, 2)[..., cols]
        b_q = (
            torch.zeros(n_heads, d_qk, device=W.device)
            if b is None
            else b.reshape(n_heads, d_qk)[:, cols]
        )
    else:
        A_q, a_q = _linear(hf.q_a_proj, where, "q_a_proj")
        a_q = torch.zeros(A_q.shape[1], device=A_q.device) if a_q is None else a_q
        g_q, eps_q = _norm(hf.q_a_layernorm, A_q.shape[1], where, "q_a_layernorm")
        W, _ = _linear(hf.q_b_proj, where, "q_b_proj")
        n_heads = W.shape[1] // d_qk
        B_q = W.reshape(W.shape[0], n_heads, d_qk).permute(1, 0, 2)[..., cols]
        b_q = torch.zeros(n_heads, d_qk, device=W.device)
    A, a = _linear(hf.kv_a_proj_with_mqa, where, "kv_a_proj_with_mqa")
    a = torch.zeros(A.shape[1], device=A.device) if a is None else a
    g_kv, eps_kv = _norm(hf.kv_a_layernorm, r_kv, where, "kv_a_layernorm")
    W, _ = _linear(hf.kv_b_proj, where, "kv_b_proj")
    kv = W.reshape(r_kv, n_heads, d_nope + d_v).permute(1, 0, 2)
    rope = [r_kv + i for i in order]
    return LatentFactors(
        layer,
        d_nope,
        d_rope,
        A_q,
        a_q,
        g_q,
        eps_q,
        B_q.contiguous(),
        b_q.contiguous(),
        A[:, :r_kv].contiguous(),
        a[:r_kv],
        g_kv,
        eps_kv,
        kv[..., :d_nope].contiguous(),
        kv[..., d_nope:].contiguous(),
        A[:, rope].contiguous(),
        a[rope],
        tuple(order),
    )


def latent_rotation(
    layer: int, model: Any, got: dict[str, Tensor], queries: Callable[[Tensor], Tensor], where: str
) -> Rotation:
    """The rotation of a latent layer's last ``d_rope`` q/k coordinates, verified against the
    rotated queries the model fires (``got``: a probe pass's ``x`` and ``rot_q``); ``queries``
    maps the attention input to the unrotated queries in the factors' order."""
    if "x" not in got or "rot_q" not in got:
        raise TLDynamicsError(
            f"{where}: its latent attention fired no rotated queries "
            "(hook_rot_q), so its rotation cannot be checked"
        )
    scored = got["rot_q"].float()
    d_rope = scored.shape[-1]
    q = queries(got["x"].float())
    d_nope = q.shape[-1] - d_rope
    q, scored = q[..., d_nope:], scored.reshape(*q.shape[:-1], d_rope)
    frequencies, magnitudes = [], [1.0]
    for module in getattr(model, "original_model", model).modules():
        buffer = getattr(module, "inv_freq", None)
        if isinstance(buffer, Tensor) and buffer.numel() == d_rope // 2:
            frequencies.append(buffer.detach().double().cpu())
            magnitudes.insert(0, _switches.rotary_magnitude(module))
    if "cos" in got:
        magnitudes.insert(0, float(got["cos"].flatten()[0]))
    positions = torch.arange(q.shape[1], device=q.device).expand(q.shape[:2])
    errors: dict[str, float] = {}
    for inv_freq in frequencies[:1]:
        for layout in ("half", "interleaved"):
            for magnitude in dict.fromkeys(magnitudes):
                rotation = Rotation(layer, layout, d_rope, inv_freq, magnitude)
                err = float(
                    (rotation.rotate(q, positions) - scored).abs().max()
                    / scored.abs().max().clamp_min(1e-30)
                )
                errors[f"{layout} x{magnitude:.4g}"] = err
                if err <= _tolerance(got["rot_q"].dtype):
                    return Rotation(layer, layout, d_rope, inv_freq, magnitude, start=d_nope)
    raise TLDynamicsError(
        f"{where}: the model's rotated latent queries are not reproduced by a "
        f"rotation of its rotary frequencies (relative errors {errors})"
    )


def latent_qkv(
    spec: Any, st: dict[str, Tensor], q: Tensor, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, k, v)`` as ``[batch, pos, head, d]`` on latent-attention layers (``spec.latent``);
    unchanged elsewhere. Also lays the stashed reference ``z`` out per head (``d_v`` wide)."""
    if not getattr(spec, "latent", False):
        return q, k, v
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if "z" in st:
        st["z"] = st["z"].reshape(*st["z"].shape[:2], v.shape[2], v.shape[3])
    return q, k, v


def latent_W_O(model: Any, layer: int, n_heads: int) -> Tensor:
    """``W_O`` of a latent-attention layer, ``[head, d_v, d_model]``, from the output
    projection's own weight (``o_proj``: ``[d_model, head * d_v]``), as float32."""
    weight = model.blocks[layer].attn.o.original_component.weight.detach().float()
    return weight.T.reshape(n_heads, -1, weight.shape[0])


def latent_z_patch(
    fn: Callable[[Tensor], Tensor | None], n_heads: int
) -> Callable[[Tensor], Tensor | None]:
    """A ``z`` patch for a latent-attention layer: ``fn`` sees and returns ``z`` per head
    (``[batch, pos, head, d_v]``), whatever layout the host's ``hook_z`` has (the flat input of
    the output projection, which TransformerLens splits with the config's ``d_head``)."""

    def patch(activation: Tensor) -> Tensor | None:
        out = fn(activation.reshape(*activation.shape[:2], n_heads, -1))
        return None if out is None else out.reshape(out.shape[0], *activation.shape[1:])

    return patch


def latent_weight(
    model: Any,
    layer: int,
    name: str,
    bias_shape: tuple[int, ...] | None,
    n_heads: int,
    factors: Callable[[], LatentFactors | None],
) -> Tensor:
    """``W_O`` (per head) or ``b_O`` (zeros where it has none) of a latent-attention layer, from
    its output projection; ``W_Q``/``W_K``/``W_V`` and their biases from its ``factors`` with
    the latent norms' gains folded in (``LatentFactors.weight``)."""
    if name == "W_O":
        return latent_W_O(model, layer, n_heads)
    if name == "b_O":
        o_proj = model.blocks[layer].attn.o.original_component
        if o_proj.bias is not None:
            return o_proj.bias.detach().float()
        shape = bias_shape if bias_shape is not None else tuple(o_proj.weight.shape[:1])
        return torch.zeros(shape, device=o_proj.weight.device)
    read = factors()
    if read is None:
        raise TLDynamicsError(f"layer {layer} has no latent attention factors")
    return read.weight(name)
