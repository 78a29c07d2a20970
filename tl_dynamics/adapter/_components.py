"""The residual stream entering a layer, split exactly into the parts that wrote it, and those
parts carried into the layer's queries and keys with the pass's own norm scale (docs/math.md §9).

``ResidualSplit(adapter, layer)`` says what a pass must deliver (``layers``, ``points``) and,
from the ``LayerState`` of each layer, gathers a ``Residual``: the token embedding, the learned
positional embedding, each earlier head's ``z_h W_O[h]``, each earlier attention bias ``b_O`` and
each earlier MLP's output, which sum to the stream the layer reads. ``queries``/``keys`` map every
part through the frozen input norm, ``W_Q``/``W_K`` and rotary, so every query and key of the
layer is an exact sum of per-part vectors plus one bias part. What cannot be split exactly is
refused by name before any pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.adapter._frozennorm import InputNorm, read_input_norm
from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter._hub import LayerState
    from tl_dynamics.adapter._model import ModelAdapter

# Families whose residual split is exact in tests/test_qk_attribution_exact.py (both hosts),
# and the reason for the families that are refused.
VERIFIED_SPLIT = (
    "bloom", "gpt2", "gptj", "gptneo", "gptneox", "hooked", "llama", "mistral", "native", "olmo",
    "opt", "phi", "phi3", "qwen2", "stablelm",
)  # fmt: skip
_POST_NORM = (
    "a norm on each attention output before it joins the residual stream (post-attention norm), "
    "so head outputs do not add up to the stream"
)
REFUSED_SPLIT = {
    "gemma2": _POST_NORM,
    "gemma3": _POST_NORM,
    "olmo2": _POST_NORM,
    "bert": "post-LayerNorm blocks (the stream is renormalised after every block)",
    "roberta": "post-LayerNorm blocks (the stream is renormalised after every block)",
}
# Relative error (to the largest entry) within which the pass's own stream must match the sum
# of its parts, per model dtype (float32 reorders sums; half precision rounds at ~1e-3..1e-2).
SPLIT_RTOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.float16: 2e-2, torch.bfloat16: 5e-2}
_LAYER_FLAGS = {
    "latent": "multi-head latent attention",
    "gate": "an output gate on z",
    "postrope": "q/k normalised after rotary",
    "clip": "clip_qkv (q, k, v clamped: not linear)",
    "unhooked": "attention the host wraps without hooks",
    "vnorm": "q, k and v normalised per head",
    "kv_from": "keys and values shared from another layer",
    "prenorm": "a q/k norm the bridge leaves to the adapter",
    "sinks": "learned attention sinks",
    "qk_norm": "q/k normalisation (QK-norm)",
}


def _rtol(dtype: torch.dtype) -> float:
    return SPLIT_RTOL.get(dtype, 5e-2)


def _rel(a: Tensor, b: Tensor, valid: Tensor) -> float:
    """``max |a - b| / max |b|`` over the valid positions ``[batch, pos]``."""
    if not bool(valid.any()):
        return 0.0
    diff, ref = (a - b)[valid], b[valid]
    return float(diff.abs().max() / ref.abs().max().clamp_min(1e-30))


@dataclass(frozen=True)
class Residual:
    """The parts of the stream entering one layer on one pass, and the layer's frozen norm.

    ``coefficients[c] @ bases[c]`` (``bases[c]`` None: the coefficients are the vectors) is part
    ``c`` ``[batch, pos, d_model]``; the parts sum to ``stream``. ``scale`` is the input norm's
    per-position ``s`` on this pass; ``errors`` the checks made while gathering (relative).
    """

    layer: int
    names: tuple[str, ...]
    kinds: tuple[str, ...]
    coefficients: list[Tensor]
    bases: list[Tensor | None]
    stream: Float[Tensor, "batch pos d_model"]
    scale: Float[Tensor, "batch pos"]
    positions: Tensor
    valid: Tensor
    errors: dict[str, float] = field(default_factory=dict)

    def vectors(self) -> Float[Tensor, "part batch pos d_model"]:
        """Every part as residual vectors (memory: parts x stream; for checks and small models)."""
        return torch.stack(
            [c if b is None else c @ b for c, b in zip(self.coefficients, self.bases)]
        )

    def project(
        self, W: Float[Tensor, "d_model n"], extra: int = 0
    ) -> Float[Tensor, "part batch pos n"]:
        """``part @ W`` for every part, without forming the parts in ``d_model``, written into
        one buffer (``extra`` more slots left uninitialised at its end)."""
        out = W.new_empty(len(self.coefficients) + extra, *self.scale.shape, W.shape[1])
        for i, (coef, basis) in enumerate(zip(self.coefficients, self.bases)):
            torch.matmul(coef, W if basis is None else basis @ W, out=out[i])
        return out


class ResidualSplit:
    """What one attention layer reads, split into the components that wrote it (docs/math.md §9).

    Built once per adapter and layer; refuses (``TLDynamicsError``) what it cannot split exactly:
    unverified families, post-attention norms, hybrids, latent or gated attention, QK-norm.

    Args:
        adapter: A ``ModelAdapter``.
        layer: The attention layer whose input is split.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
        >>> split = ResidualSplit(ModelAdapter(testing.cached_model("gpt2")), 1)
        >>> split.names[:4]
        ('token embedding', 'positional embedding', 'L0H0 output', 'L0H1 output')
        >>> split.names[-2:]
        ('L0H3 output', 'L0 MLP output')
    """

    def __init__(self, adapter: "ModelAdapter", layer: int):
        self.adapter = adapter
        self.layer = layer = adapter.check_layer(layer)
        adapter.check_attention_layers([layer])
        arch, info = adapter.info.architecture, adapter.info
        self._refuse(adapter, layer, arch, info.family)
        model = adapter.model
        self.norm: InputNorm = read_input_norm(
            model.blocks[layer].ln1, adapter.d_model, f"layer {layer} of {arch}"
        )
        cfg = model.cfg
        self.learned_positions = adapter.W_pos is not None
        pos_module = getattr(getattr(model, "pos_embed", None), "original_component", None)
        self.position_offset = int(getattr(pos_module, "offset", 0) or 0)  # OPT: 2
        attn_only = bool(getattr(cfg, "attn_only", False))
        self.mlp = tuple(
            not attn_only and getattr(model.blocks[l], "mlp", None) is not None
            for l in range(layer)
        )
        names = adapter.hook_names([("resid_mid", l) for l in range(layer)])
        self.sequential = tuple(name is not None for name in names)
        kinds: list[tuple[str, str]] = [("token embedding", "embedding")]
        if self.learned_positions:
            kinds.append(("positional embedding", "embedding"))
        self.attn_bias = tuple(bool(adapter.b_O(l).abs().max() > 0) for l in range(layer))
        for l in range(layer):
            kinds += [(f"L{l}H{h} output", "head") for h in range(adapter.n_heads)]
            if self.attn_bias[l]:
                kinds.append((f"L{l} attention bias", "bias"))
            if self.mlp[l]:
                kinds.append((f"L{l} MLP output", "mlp"))
        self.names = tuple(n for n, _ in kinds)
        self.kinds = tuple(k for _, k in kinds)

    @staticmethod
    def _refuse(adapter: "ModelAdapter", layer: int, arch: str, family: str) -> None:
        if family in REFUSED_SPLIT:
            raise TLDynamicsError(
                f"qk attribution: the residual stream of {arch} cannot be split exactly into "
                f"its components: {REFUSED_SPLIT[family]}"
            )
        if family not in VERIFIED_SPLIT:
            raise TLDynamicsError(
                f"qk attribution: the residual split of {arch} (attention family {family!r}) has "
                f"not been verified to be exact; verified families: {list(VERIFIED_SPLIT)}"
            )
        if adapter.post_norm is not None:
            raise TLDynamicsError(
                f"qk attribution: the residual stream of {arch} cannot be split exactly into its "
                f"components: {_POST_NORM} (post_norm={adapter.post_norm!r})"
            )
        if getattr(adapter.model.cfg, "positional_embedding_type", None) == "shortformer":
            raise TLDynamicsError(
                f"qk attribution: {arch} adds its positional embedding to queries and keys only "
                "(shortformer), not to the residual stream; not modelled"
            )
        for l in range(layer + 1):
            spec = adapter.specs[l]
            if not spec.is_attention:
                raise TLDynamicsError(
                    f"qk attribution: layer {l} of {arch} is a {spec.kind!r} layer; the residual "
                    "split models attention and MLP blocks only (hybrids are refused)"
                )
            for flag, what in _LAYER_FLAGS.items():
                if getattr(spec, flag) not in (None, False):
                    raise TLDynamicsError(
                        f"qk attribution: layer {l} of {arch} has {what} ({flag}); the exact "
                        "split of its scores is not modelled"
                    )

    @property
    def layers(self) -> tuple[int, ...]:
        """The attention layers a pass must deliver: every layer up to this one."""
        return tuple(range(self.layer + 1))

    @property
    def points(self) -> tuple[tuple[str, int], ...]:
        """The residual points a pass must deliver."""
        pts = [("resid_pre", l) for l in range(self.layer + 1)]
        pts += [("resid_mid", l) for l in range(self.layer) if self.sequential[l]]
        return tuple(pts)

    def keep(self, state: "LayerState") -> dict[str, Tensor]:
        """What this split needs of one layer of a pass (called as each layer is delivered):
        the residual points, and for earlier layers ``z``, ``W_O`` and ``b_O`` (not the
        pattern), for this layer the attention input ``x`` where it was kept."""
        l, kept = state.layer, {k: v.float() for k, v in state.points.items()}
        la = state.attention
        if la is not None and l < self.layer:
            kept.update(z=la.z(), W_O=la.W_O, b_O=la.b_O)
        elif la is not None and "x" in la.reference:
            kept["x"] = la.reference["x"]
        return kept

    def gather(self, kept: dict[int, dict[str, Tensor]], batch: Any) -> Residual:
        """The parts of this pass's stream from what ``keep`` kept of each layer; checks each
        earlier layer's attention output against the stream, and the frozen norm against the
        attention input ``x`` where it was kept."""
        ad, L = self.adapter, self.layer
        missing = [l for l in self.layers if l not in kept]
        if missing:
            raise TLDynamicsError(f"qk attribution: the pass did not deliver layers {missing}")
        pre = {l: kept[l]["resid_pre"] for l in range(L + 1)}
        valid = batch.key_valid.to(pre[0].device)
        positions = ad.positions(batch).to(pre[0].device)
        coefs: list[Tensor] = []
        bases: list[Tensor | None] = []
        errors: dict[str, float] = {}
        tol = _rtol(ad.dtype)
        W_pos = ad.W_pos
        token = pre[0]
        if self.learned_positions and W_pos is not None:
            token = pre[0] - W_pos[positions + self.position_offset]
            coefs += [token, pre[0] - token]
            bases += [None, None]
        else:
            coefs.append(token)
            bases.append(None)
        for l in range(L):
            z, W_O, b_O = kept[l]["z"], kept[l]["W_O"], kept[l]["b_O"]
            attn = torch.einsum("bihd,hdm->bim", z, W_O) + b_O
            for h in range(z.shape[2]):
                coefs.append(z[:, :, h])
                bases.append(W_O[h])
            if self.attn_bias[l]:
                coefs.append(torch.ones(*z.shape[:2], 1, device=z.device))
                bases.append(b_O[None])
            if self.sequential[l]:
                mid = kept[l]["resid_mid"]
                errors[f"L{l} attention"] = _rel(attn, mid - pre[l], valid)
                mlp = pre[l + 1] - mid
            else:
                mlp = pre[l + 1] - pre[l] - attn
                if not self.mlp[l]:
                    errors[f"L{l} attention"] = _rel(attn, pre[l + 1] - pre[l], valid)
            if self.mlp[l]:
                coefs.append(mlp)
                bases.append(None)
        for what, err in errors.items():
            if err > tol:
                raise TLDynamicsError(
                    f"qk attribution: on {ad.info.architecture}, {what}'s output does not add to "
                    f"the residual stream as sum_h z_h W_O[h] + b_O (relative error {err:.2e} > "
                    f"{tol:g}), so the stream cannot be split exactly"
                )
        scale = self.norm.scale(pre[L])
        x = kept[L].get("x")
        if x is not None:
            err = _rel(self.norm.apply(pre[L], scale), x.float(), valid)
            errors["input norm"] = err
            if err > tol:
                raise TLDynamicsError(
                    f"qk attribution: the input norm of layer {L} of {ad.info.architecture}, with "
                    f"its scale frozen, does not reproduce the attention input (relative error "
                    f"{err:.2e} > {tol:g})"
                )
        return Residual(
            L, self.names, self.kinds, coefs, bases, pre[L], scale, positions, valid, errors
        )

    def _frozen(self, res: Residual, W: Tensor, b: Tensor, heads: Sequence[int]) -> Tensor:
        """``[part + 1, batch, pos, head, d_head]``: each part through the frozen norm and
        ``W`` ``[head, d_model, d_head]``, the last the bias part (``shift W + b``), rotated."""
        nh, d = len(heads), W.shape[-1]
        flat = W[list(heads)].permute(1, 0, 2).reshape(W.shape[1], nh * d)
        out = res.project(self.norm.fold(flat), extra=1)
        out[:-1] /= res.scale[None, ..., None]
        shift = self.norm.shift
        out[-1] = b[list(heads)].reshape(-1) + (0.0 if shift is None else shift.to(flat) @ flat)
        out = out.reshape(-1, *res.scale.shape, nh, d)
        rotation = self.adapter.rotation(self.layer)
        if rotation is None:
            return out
        positions = res.positions.expand(out.shape[0], *res.positions.shape)
        return rotation.rotate(out, positions)

    def queries(self, res: Residual, heads: Sequence[int]) -> Tensor:
        """Every part's share of the queries of ``heads``, ``[part + 1, batch, pos, head,
        d_head]`` (the last: the query bias); they sum to the queries as scored."""
        ad = self.adapter
        return self._frozen(res, ad.W_Q(self.layer), ad.b_Q(self.layer), heads)

    def keys(self, res: Residual, heads: Sequence[int]) -> Tensor:
        """Every part's share of the keys of ``heads``, ``[part + 1, batch, pos, head, d_head]``
        (the last: the key bias); the heads of one key/value group share one computation."""
        ad = self.adapter
        group = max(1, ad.n_heads // ad.n_kv_heads)
        kv = [h // group for h in heads]
        uniq = sorted(set(kv))
        out = self._frozen(res, ad.W_K(self.layer), ad.b_K(self.layer), [g * group for g in uniq])
        return out if len(uniq) == len(kv) else out[:, :, :, [uniq.index(g) for g in kv]]
