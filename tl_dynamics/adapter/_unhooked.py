"""Softmax attention that TransformerLens wraps without query, key or pattern hooks.

RecurrentGemma's local attention (``RecurrentGemmaAttention``, inside the whole-layer
``RecurrentGemmaBlockBridge``, which hooks only the residual stream) and NemotronH's attention
(``NemotronHAttention``, inside an ``SSM2MixerBridge``, which hooks only its input and output)
run the Hugging Face module as it is. Nothing the bridge fires holds what they score, so the
adapter reads it from that module with torch hooks, under *points* named like hook points
(``blocks.{layer}.tl_dynamics_unhooked.{role}``) that ``_capture.registered`` and ``_patch``
register as torch hooks, removed on exit exactly as host hooks are:

- ``x``: the input of ``q_proj`` (what W_Q reads); ``q``/``k``/``v``: the outputs of
  ``q_proj``/``k_proj``/``v_proj`` as ``[batch, pos, head, d_head]`` (grouped K/V heads kept);
- ``cos``/``sin``: the tables the module's own ``rotary_emb`` returns for the position ids it
  receives (RecurrentGemma: partial rotary on the first ``head_dim / 2`` coordinates, rotate-half
  layout); ``rot_q``/``rot_k``: ``q`` and ``k`` rotated by the modeling file's own
  ``apply_rotary_pos_emb`` with those tables, i.e. exactly what the module scores;
- ``z``: the input of ``o_proj`` per head; ``out``: its output;
- ``pattern`` (and ``scores``: the layer's ``scores_hook`` is ``"pattern"``): the attention
  weights the module returns (eager attention; nothing fires under SDPA).

The score recipe (scale ``module.scaling = head_dim**-0.5``, causal, RecurrentGemma's window
``attention_window_size`` from the module, no soft-cap, no bias) is read from the module into
a ``LayerSpec`` with ``unhooked=True``; W_Q/W_K/W_V/W_O and their biases come from the module's
own ``nn.Linear`` weights. The recurrent (RG-LRU) and Mamba layers stay non-attention layers.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import Tensor

from tl_dynamics.adapter import _readers
from tl_dynamics.adapter._kinds import _hf_layer
from tl_dynamics.adapter._readers import required
from tl_dynamics.adapter._spec import LayerSpec
from tl_dynamics.errors import TLDynamicsError

__all__ = [
    "UNHOOKED_ATTENTION",
    "hf_attention",
    "is_point",
    "point_name",
    "register",
    "register_patch",
    "unhooked_family",
    "unhooked_param",
    "unhooked_spec",
]

# Hugging Face attention modules wrapped without attention hooks, tested exact against the
# Hugging Face model itself (tests/test_unhooked.py, tests/test_architectures.py)
UNHOOKED_ATTENTION = {
    "RecurrentGemmaAttention": "recurrent_gemma",
    "NemotronHAttention": "nemotron_h",
}
_POINT = "tl_dynamics_unhooked"
ROLES = ("x", "q", "k", "v", "cos", "sin", "rot_q", "rot_k", "z", "out", "pattern", "scores")
_PARAMS = {"W_Q": "q_proj", "W_K": "k_proj", "W_V": "v_proj", "W_O": "o_proj"}
HookFn = Callable[[Tensor], Any]


def hf_attention(model: Any, layer: int) -> Any:
    """The Hugging Face softmax-attention module of ``blocks[layer]`` that the bridge wraps
    without attention hooks (NemotronH's mixer, RecurrentGemma's temporal block), or None."""
    mixer = getattr(model.blocks[layer], "mixer", None)
    module = getattr(mixer, "original_component", None)
    if module is None:
        module = getattr(_hf_layer(model, layer), "temporal_block", None)
    return module if "Attention" in type(module).__name__ else None


def unhooked_family(model: Any) -> str | None:
    """The family of the first unhooked attention module, or None where the model has none or
    it is not verified (its layers then keep the kind ``"unhooked_attention"``, which no
    attention analysis reads, while the residual-stream analyses run)."""
    for layer in range(len(model.blocks)):
        module = hf_attention(model, layer)
        if module is not None:
            return UNHOOKED_ATTENTION.get(type(module).__name__)
    return None


def unhooked_spec(model: Any, layer: int, architecture: str) -> LayerSpec:
    """The ``LayerSpec`` of an unhooked attention layer, read from its Hugging Face module."""
    module = hf_attention(model, layer)
    where = f"layer {layer} of {architecture}"
    if module is None or type(module).__name__ not in UNHOOKED_ATTENTION:
        raise TLDynamicsError(f"{where}: no verified unhooked attention module")
    impl = required(module, "config._attn_implementation", "eager, sdpa, ...")
    if impl not in ("eager", "sdpa", None):
        raise TLDynamicsError(
            f"unsupported {architecture}: layer {layer} runs {impl!r} attention; the adapter "
            "reproduces eager and SDPA attention only"
        )
    d_head = int(module.head_dim)
    shape = (module.q_proj.out_features // d_head, d_head)
    if shape != (int(model.cfg.n_heads), int(model.cfg.d_head)):
        raise TLDynamicsError(
            f"unsupported {architecture}: {where} has {shape[0]} heads of width {shape[1]} "
            f"(its q_proj) but TransformerLens's config says {model.cfg.n_heads} of width "
            f"{model.cfg.d_head}"
        )
    rotary = getattr(module, "rotary_emb", None)
    rotary_dim = None
    if rotary is not None:
        if required(rotary, "rope_type", "default or a scaled RoPE") != "default":
            raise TLDynamicsError(
                f"unsupported {architecture}: {where} uses rope type {rotary.rope_type!r}; "
                "only the default rotary is verified"
            )
        rotary_dim = 2 * int(rotary.inv_freq.numel())
    return LayerSpec(
        layer=layer,
        scale=_readers.scale(module, "*", d_head),
        softcap=None,
        window=_readers.window(module, layer, _readers.text_config(model)),
        causal=_readers.causal(module, "*", None),
        rotary="half" if rotary is not None else "none",
        rotary_dim=rotary_dim,
        rotary_base=None,
        alibi="none",
        scores_hook="pattern",
        qk_norm=False,
        unhooked=True,
    )


def unhooked_param(model: Any, layer: int, name: str) -> Tensor | None:
    """``W_Q``/``W_K``/``W_V`` ``[head, d_model, d_head]`` (grouped K/V heads not expanded),
    ``W_O`` ``[head, d_head, d_model]``, ``b_Q``/``b_K``/``b_V`` ``[head, d_head]`` or ``b_O``
    ``[d_model]`` (None where the projection has no bias) from the module's own projections."""
    module = hf_attention(model, layer)
    linear = getattr(module, _PARAMS["W_" + name[-1]])
    d_head = int(module.head_dim)
    if name.startswith("b_"):
        bias = getattr(linear, "bias", None)
        if bias is None:
            return None
        bias = bias.detach().float()
        return bias if name == "b_O" else bias.reshape(-1, d_head)
    weight = linear.weight.detach().float()  # [out, in]
    if name == "W_O":  # [d_model, head * d_head] -> [head, d_head, d_model]
        return weight.T.reshape(-1, d_head, weight.shape[0])
    return weight.reshape(-1, d_head, weight.shape[1]).transpose(1, 2)


def point_name(role: str, layer: int) -> str | None:
    """The point of ``role`` in an unhooked attention layer (None for roles it has not)."""
    return f"blocks.{layer}.{_POINT}.{role}" if role in ROLES else None


def is_point(name: str) -> bool:
    """Whether the hook name ``name`` is a point of this module (``point_name``)."""
    return f".{_POINT}." in name


def _parse(model: Any, name: str) -> tuple[Any, str]:
    head, role = name.split(f".{_POINT}.")
    module = hf_attention(model, int(head.split(".")[1]))
    if module is None:
        raise TLDynamicsError(f"point {name!r}: the layer has no unhooked attention module")
    return module, role


def _heads(t: Tensor, d_head: int) -> Tensor:
    return t.reshape(*t.shape[:-1], -1, d_head)


def _rotated(module: Any, fn: HookFn, role: str) -> list[Any]:
    """``fn`` on ``q``/``k`` rotated by the modeling file's own ``apply_rotary_pos_emb``."""
    rotate = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
    if rotate is None or getattr(module, "rotary_emb", None) is None:
        raise TLDynamicsError(f"{type(module).__name__} has no rotary function to read {role}")
    seen: dict[str, Tensor] = {}
    d = int(module.head_dim)

    def keep(which: str):
        return lambda _m, _i, out: seen.__setitem__(which, out)

    def tables(_m: Any, _i: Any, out: Any) -> None:
        q, k = seen.pop("q", None), seen.pop("k", None)
        if q is None or k is None:
            return
        q, k = _heads(q, d).transpose(1, 2), _heads(k, d).transpose(1, 2)
        rot_q, rot_k = rotate(q, k, out[0], out[1])
        fn((rot_q if role == "rot_q" else rot_k).transpose(1, 2))

    return [
        module.q_proj.register_forward_hook(keep("q")),
        module.k_proj.register_forward_hook(keep("k")),
        module.rotary_emb.register_forward_hook(tables),
    ]


def register(model: Any, name: str, fn: HookFn) -> list[Any]:
    """Torch hooks that call ``fn(activation)`` at the point ``name``; their handles (the caller
    removes them)."""
    module, role = _parse(model, name)
    d = int(module.head_dim)
    if role == "x":
        return [module.q_proj.register_forward_pre_hook(lambda _m, args: fn(args[0]))]
    if role in ("q", "k", "v"):
        proj = getattr(module, f"{role}_proj")
        return [proj.register_forward_hook(lambda _m, _i, out: fn(_heads(out, d)))]
    if role in ("cos", "sin"):
        rotary = getattr(module, "rotary_emb", None)
        if rotary is None:
            return []
        index = 0 if role == "cos" else 1
        return [rotary.register_forward_hook(lambda _m, _i, out: fn(out[index]))]
    if role in ("rot_q", "rot_k"):
        return [] if getattr(module, "rotary_emb", None) is None else _rotated(module, fn, role)
    if role == "z":
        return [module.o_proj.register_forward_pre_hook(lambda _m, args: fn(_heads(args[0], d)))]
    if role == "out":
        return [module.o_proj.register_forward_hook(lambda _m, _i, out: fn(out))]

    def weights(_m: Any, _i: Any, out: Any) -> None:
        if isinstance(out, tuple) and len(out) > 1 and isinstance(out[1], Tensor):
            fn(out[1])

    return [module.register_forward_hook(weights)]  # pattern, scores


def register_patch(
    model: Any, name: str, fn: HookFn, standby: Callable[[], bool] = lambda: False
) -> list[Any]:
    """Torch hooks that replace the activation at ``name`` by ``fn(activation)`` (None keeps
    it): ``z`` (the input of ``o_proj``) and ``pattern`` (the module's output is recomputed as
    ``o_proj((pattern @ v) per head)``, through ``o_proj`` so a ``z`` patch applies after it,
    as on hooked hosts). Other roles are refused. While ``standby()`` (a probe pass) nothing
    is patched."""
    module, role = _parse(model, name)
    d = int(module.head_dim)
    if role == "z":

        def patch_z(_m: Any, args: tuple) -> tuple | None:
            z = args[0]
            out = fn(_heads(z, d))
            return None if out is None else (out.reshape(z.shape), *args[1:])

        return [module.o_proj.register_forward_pre_hook(patch_z)]
    if role != "pattern":
        raise TLDynamicsError(
            f"point {name!r}: {type(module).__name__} is wrapped without hooks; only its 'z' "
            "and 'pattern' can be patched"
        )
    seen: dict[str, Tensor] = {}

    def patch_pattern(_m: Any, _i: Any, out: Any) -> Any:
        v = seen.pop("v", None)
        if standby():
            return None
        if not (isinstance(out, tuple) and isinstance(out[1], Tensor)) or v is None:
            raise TLDynamicsError(
                f"patching the pattern of {type(module).__name__} needs eager attention (the "
                "module returns no attention weights under SDPA); load the model with "
                "attn_implementation='eager' to patch it"
            )
        pattern = fn(out[1])
        if pattern is None:
            return None
        v = _heads(v, d).transpose(1, 2)  # [batch, kv_head, pos, d]
        v = torch.repeat_interleave(v, pattern.shape[1] // v.shape[1], dim=1)
        z = torch.matmul(pattern.to(v.dtype), v).transpose(1, 2)
        return (module.o_proj(z.reshape(*z.shape[:2], -1)), pattern, *out[2:])

    return [
        module.v_proj.register_forward_hook(lambda _m, _i, out: seen.__setitem__("v", out)),
        module.register_forward_hook(patch_pattern),
    ]
