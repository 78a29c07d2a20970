"""Assembling one layer's ``LayerAttention`` from its hook outputs (the hub, ``_hub.py``, stashes
them and calls ``assemble`` when the layer is done, so only one layer's tensors are alive at a
time). Masks and position ids are built once per forward pass, in the pass's shared memo."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import Tensor

from tl_dynamics.adapter import _rotary
from tl_dynamics.adapter._base import AdapterBase
from tl_dynamics.adapter._batch import Batch
from tl_dynamics.adapter._gate import layer_gate, sub_norm_gate
from tl_dynamics.adapter._gemma4 import shared_kv
from tl_dynamics.adapter._host import alibi_slopes, mpt_alibi_slopes
from tl_dynamics.adapter._jetmoe import routed_qkv, unfixed_W_O
from tl_dynamics.adapter._layer import LayerAttention
from tl_dynamics.adapter._postrope import postrope_qk
from tl_dynamics.adapter._routed import routed_layer
from tl_dynamics.adapter._scored import scored_qkv
from tl_dynamics.adapter._spec import LayerSpec
from tl_dynamics.errors import TLDynamicsError

REFERENCE_ROLES = ("scores", "pattern", "z", "out")


def masks(
    adapter: AdapterBase, spec: LayerSpec, key_valid: Tensor, n_pos: int, shared: dict
) -> tuple[Tensor, Tensor, Tensor]:
    """``(allowed, query_valid, key_pos)`` for a layer's mask kind, built once per pass (the
    same tensors for every layer with the same causal flag and window)."""
    key = ("masks", spec.causal, spec.window, n_pos)
    if key not in shared:
        n_batch = key_valid.shape[0]
        positions = torch.arange(n_pos, device=key_valid.device)
        allowed = key_valid[:, None, :].expand(n_batch, n_pos, n_pos)
        if spec.causal:
            allowed = allowed & (positions[None, :] <= positions[:, None])
        if spec.window is not None:
            allowed = allowed & (positions[None, :] > positions[:, None] - spec.window)
            if not spec.causal:  # a bidirectional window is two-sided (Gemma 3): |i - j| < w
                allowed = allowed & (positions[None, :] < positions[:, None] + spec.window)
        query_valid = key_valid & allowed.any(-1)
        key_pos = shared.get(("key_pos", n_pos))
        if key_pos is None:
            key_pos = shared[("key_pos", n_pos)] = (
                key_valid.long().cumsum(-1) - 1
            ) * key_valid.long()
        shared[key] = (allowed, query_valid, key_pos)
    return shared[key]


def assemble(
    adapter: AdapterBase,
    layer: int,
    st: dict[str, Tensor],
    batch: Batch | None,
    shared: dict | None = None,
) -> LayerAttention:
    """The ``LayerAttention`` of ``layer`` from its stashed hook outputs ``st``; ``shared`` is the
    pass's memo (masks are formed once there)."""
    shared = {} if shared is None else shared
    spec = adapter.specs[layer]
    if spec.gate == "router":  # JetMoE: q from each token's query expert, k/v shared (_jetmoe)
        routed_qkv(adapter, spec, st)
    shared_kv(spec, st, shared)  # Gemma 4: keys and values of an earlier layer
    missing = [r for r in ("q", "k", "v") if r not in st]
    if missing:
        raise TLDynamicsError(f"layer {layer}: the forward pass did not fire the {missing} hooks")
    q, k, v = (st[r].float() for r in ("q", "k", "v"))
    q, k, v = scored_qkv(adapter, spec, st, q, k, v, batch and batch.key_valid)  # _scored
    n_batch, n_pos = q.shape[0], q.shape[1]
    key_valid = shared.get(("key_valid", n_batch, n_pos))
    if key_valid is None:
        if batch is not None and tuple(batch.key_valid.shape) == (n_batch, n_pos):
            key_valid = batch.key_valid.to(q.device)
        else:
            key_valid = torch.ones(n_batch, n_pos, dtype=torch.bool, device=q.device)
        shared[("key_valid", n_batch, n_pos)] = key_valid

    if spec.rotary in ("hooked", "half") and "rot_q" in st:
        q, k = st["rot_q"].float(), st["rot_k"].float()
    elif spec.rotary == "half":
        if "cos" not in st:
            raise TLDynamicsError(
                f"layer {layer} of {adapter.info.architecture} is rotary but fired "
                "neither rotated q/k hooks nor cos/sin hooks"
            )
        cos, sin = st["cos"].float()[:, :, None], st["sin"].float()[:, :, None]  # the model's own
        q, k = _rotary.apply(q, cos, sin, "half"), _rotary.apply(k, cos, sin, "half")
    elif spec.rotary == "interleaved":
        rotation, positions = adapter.rotation(layer), adapter.positions(key_valid)
        if rotation is None:
            raise TLDynamicsError(
                f"layer {layer} of {adapter.info.architecture} is rotary "
                "(interleaved) but has no rotation"
            )
        q, k = rotation.rotate(q, positions), rotation.rotate(k, positions)
    elif spec.rotary == "hooked":
        raise TLDynamicsError(f"layer {layer}: rotary model did not fire its rotated q/k hooks")
    if spec.postrope:  # HunYuan: normalised after rotary, read from the norm's hooks
        q, k = postrope_qk(spec, st, adapter.info.architecture)
    k, v = adapter.expand_kv(k), adapter.expand_kv(v)

    allowed, query_valid, key_pos = masks(adapter, spec, key_valid, n_pos, shared)
    bias = None
    if spec.alibi == "key":
        slopes = alibi_slopes(adapter.n_heads).to(key_pos.device)
        bias = slopes[None, :, None, None] * key_pos[:, None, None, :].float()
    elif spec.alibi == "falcon":  # bf16 slopes * positions, added as (q.k + a) * c + a / sqrt(d)
        slopes = alibi_slopes(adapter.n_heads).to(key_pos.device).bfloat16()
        a = (slopes[None, :, None, None] * key_pos[:, None, None, :]).float()
        bias = a * spec.scale + a / math.sqrt(q.shape[-1])
    elif spec.alibi == "mpt":
        slopes = mpt_alibi_slopes(adapter.n_heads).to(q.device)
        positions = torch.arange(n_pos, device=q.device)
        bias = (slopes[:, None, None] * (positions - (n_pos - 1)).float())[None]
    elif spec.alibi == "relative":
        bias = hooked_alibi(adapter.model, layer, n_pos, adapter.n_heads)[None]

    if spec.clip is not None:  # clip_qkv: the hooks fire before the clamp (rot_q/rot_k after)
        q = q if "rot_q" in st else q.clamp(-spec.clip, spec.clip)
        k = k if "rot_k" in st else k.clamp(-spec.clip, spec.clip)
        v = v.clamp(-spec.clip, spec.clip)
    routed = spec.gate == "router"  # JetMoE: an output expert per query (_jetmoe)
    W_O = unfixed_W_O(adapter, q.device) if routed else adapter.W_O(layer)
    b_O = adapter.b_O(layer)
    reference = {r: st[r].float() for r in REFERENCE_ROLES if r in st}
    if "x" in st:
        reference["x"] = adapter.attention_input(layer, st["x"].float())
    sink = None
    if spec.sinks:  # read live from the module that adds them (GPT-OSS; HookedTransformer's attn)
        attn = adapter.model.blocks[layer].attn
        owner = getattr(attn, "original_component", None) or attn
        sink = owner.sinks.detach().float().to(q.device)
    la = LayerAttention(
        spec=spec,
        q=q,
        k=k,
        v=v,
        position_bias=bias,
        allowed=allowed,
        query_valid=query_valid,
        W_O=W_O,
        b_O=b_O,
        reference=reference,
        sink_logit=sink,
        gate=layer_gate(adapter, spec, st),
    )
    if spec.gate == "sub_norm":  # BitNet: the norm over all heads of z, as a multiplier (_gate)
        la = replace(la, gate=sub_norm_gate(adapter, layer, la.z()))
    return routed_layer(adapter, la, st) if routed else la


def refuse_sinks(specs: Sequence[LayerSpec], layers: Sequence[int], architecture: str) -> None:
    """Refuse layers with learned attention sinks unless the caller asked for them.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> refuse_sinks([NS(layer=0, sinks=True)], [0], "GptOssForCausalLM")
        Traceback (most recent call last):
        ...
        tl_dynamics.errors.TLDynamicsError: unsupported GptOssForCausalLM for this analysis: layers [0] have learned attention sinks (a per-head logit joins every softmax denominator, p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h)), so rows sum to less than 1), which this caller does not model (the odds-ratio split, the contextual MLP, the atlas and the report do: docs/math.md §2.6, §3.7); ModelAdapter.attention(..., sinks=True) gives the exact pattern, z and outputs
    """
    sunk = [layer for layer in layers if specs[layer].sinks]
    if sunk:
        raise TLDynamicsError(
            f"unsupported {architecture} for this analysis: layers {sunk} have learned attention "
            "sinks (a per-head logit joins every softmax denominator, p_ij = exp(s_ij) / "
            "(sum_j exp(s_ij) + exp(sink_h)), so rows sum to less than 1), which this caller "
            "does not model (the odds-ratio split, the contextual MLP, the atlas and the report "
            "do: docs/math.md §2.6, §3.7); ModelAdapter.attention(..., sinks=True) gives the "
            "exact pattern, z and outputs"
        )


def hooked_alibi(model: Any, layer: int, n_pos: int, n_heads: int) -> Tensor:
    """HookedTransformer's own ALiBi bias ``[head, pos, pos]`` for ``layer``, as its last
    forward pass added it. HookedTransformer caches the bias at the longest context seen
    and slices its *last* rows, so after a longer prompt each row carries a constant shift
    (softmax-invariant); reading its buffer reproduces its scores exactly either way."""
    buffer = getattr(model.blocks[layer].attn, "alibi", None)
    if isinstance(buffer, Tensor) and buffer.shape[-1] >= n_pos:
        return buffer[:, -n_pos:, :n_pos].detach().float()
    # TransformerLens 3.x (HookedTransformer), which pyright does not see: .venv has 4.x
    from transformer_lens.components import AbstractAttention  # pyright: ignore[reportMissingImports]

    return AbstractAttention.create_alibi_bias(n_heads, n_pos, "cpu").float()
