"""Per-layer capture: stash one layer's hook outputs, assemble its ``LayerAttention`` when it is
done, and hand it to a callback, so only one layer's tensors are alive at a time."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from tl_dynamics.adapter import _rotary
from tl_dynamics.adapter._base import AdapterBase
from tl_dynamics.adapter._batch import Batch
from tl_dynamics.adapter._host import LayerSpec, alibi_slopes, mpt_alibi_slopes
from tl_dynamics.adapter._layer import LayerAttention
from tl_dynamics.adapter._scored import scored_qkv
from tl_dynamics.errors import TLDynamicsError

HookFn = Callable[[Tensor], None]
REFERENCE_ROLES = ("scores", "pattern", "z", "out")


class LayerCollector:
    """Stashes one layer's hook outputs and assembles a ``LayerAttention`` when it is done.

    A layer is done when a hook of another layer fires or the forward pass ends, so at most
    one layer's tensors are held at a time.
    """

    def __init__(self, adapter: AdapterBase, layers: Sequence[int],
                 on_layer: Callable[[LayerAttention], None], reference: bool,
                 inputs: bool, batch: Batch | None):
        self.adapter, self.layers, self.on_layer = adapter, list(layers), on_layer
        self.reference, self.inputs, self.batch = reference, inputs, batch
        self.current: int | None = None
        self.stash: dict[str, Tensor] = {}

    def hooks(self) -> list[tuple[str, HookFn]]:
        roles = ["q", "k", "v", "rot_q", "rot_k", "cos", "sin"]
        roles += list(REFERENCE_ROLES) if self.reference else []
        roles += ["x"] if self.inputs else []
        out = []
        for layer in self.layers:
            for role in roles:
                name = self.adapter.hook_name(role, layer)
                if name is not None:
                    out.append((name, self._store(role, layer)))
        return out

    def _store(self, role: str, layer: int) -> HookFn:
        def fn(activation: Tensor) -> None:
            if self.current is not None and self.current != layer:
                self.flush()
            self.current = layer
            keep = activation.detach()
            self.stash[role] = keep.clone() if role in REFERENCE_ROLES else keep
        return fn

    def flush(self) -> None:
        if self.current is None:
            return
        layer, stash = self.current, self.stash
        self.current, self.stash = None, {}
        self.on_layer(assemble(self.adapter, layer, stash, self.batch))


def assemble(adapter: AdapterBase, layer: int, st: dict[str, Tensor],
             batch: Batch | None) -> LayerAttention:
    spec = adapter.specs[layer]
    missing = [r for r in ("q", "k", "v") if r not in st]
    if missing:
        raise TLDynamicsError(f"layer {layer}: the forward pass did not fire the {missing} hooks")
    q, k, v = (st[r].float() for r in ("q", "k", "v"))
    q, k, v = scored_qkv(adapter, spec, st, q, k, v, batch and batch.key_valid)  # _scored
    n_batch, n_pos = q.shape[0], q.shape[1]
    if batch is not None and tuple(batch.key_valid.shape) == (n_batch, n_pos):
        key_valid = batch.key_valid.to(q.device)
    else:
        key_valid = torch.ones(n_batch, n_pos, dtype=torch.bool, device=q.device)

    if spec.rotary in ("hooked", "half") and "rot_q" in st:
        q, k = st["rot_q"].float(), st["rot_k"].float()
    elif spec.rotary == "half":
        if "cos" not in st:
            raise TLDynamicsError(f"layer {layer} of {adapter.info.architecture} is rotary but fired "
                                  "neither rotated q/k hooks nor cos/sin hooks")
        cos, sin = st["cos"].float()[:, :, None], st["sin"].float()[:, :, None]  # the model's own
        q, k = _rotary.apply(q, cos, sin, "half"), _rotary.apply(k, cos, sin, "half")
    elif spec.rotary == "interleaved":
        rotation, positions = adapter.rotation(layer), adapter.positions(key_valid)
        q, k = rotation.rotate(q, positions), rotation.rotate(k, positions)
    elif spec.rotary == "hooked":
        raise TLDynamicsError(f"layer {layer}: rotary model did not fire its rotated q/k hooks")
    k, v = adapter.expand_kv(k), adapter.expand_kv(v)

    positions = torch.arange(n_pos, device=q.device)
    allowed = key_valid[:, None, :].expand(n_batch, n_pos, n_pos)
    if spec.causal:
        allowed = allowed & (positions[None, :] <= positions[:, None])
    if spec.window is not None:
        allowed = allowed & (positions[None, :] > positions[:, None] - spec.window)
        if not spec.causal:  # a bidirectional window is two-sided (Gemma 3): |i - j| < w
            allowed = allowed & (positions[None, :] < positions[:, None] + spec.window)
    query_valid = key_valid & allowed.any(-1)

    bias = None
    key_pos = (key_valid.long().cumsum(-1) - 1) * key_valid.long()
    if spec.alibi == "key":
        slopes = alibi_slopes(adapter.n_heads).to(key_pos.device)
        bias = slopes[None, :, None, None] * key_pos[:, None, None, :].float()
    elif spec.alibi == "falcon":  # bf16 slopes * positions, added as (q.k + a) * c + a / sqrt(d)
        slopes = alibi_slopes(adapter.n_heads).to(key_pos.device).bfloat16()
        a = (slopes[None, :, None, None] * key_pos[:, None, None, :]).float()
        bias = a * spec.scale + a / math.sqrt(q.shape[-1])
    elif spec.alibi == "mpt":
        slopes = mpt_alibi_slopes(adapter.n_heads).to(q.device)
        bias = (slopes[:, None, None] * (positions - (n_pos - 1)).float())[None]
    elif spec.alibi == "relative":
        bias = adapter.hooked_alibi(layer, n_pos)[None]

    W_O, b_O = adapter.W_O(layer), adapter.b_O(layer)
    reference = {r: st[r].float() for r in REFERENCE_ROLES if r in st}
    if "x" in st:
        reference["x"] = adapter.attention_input(layer, st["x"].float())
    sink = None
    if spec.sinks:  # read live from the module that adds them (GPT-OSS; HookedTransformer's attn)
        attn = adapter.model.blocks[layer].attn
        owner = getattr(attn, "original_component", None) or attn
        sink = owner.sinks.detach().float().to(q.device)
    return LayerAttention(spec=spec, q=q, k=k, v=v, position_bias=bias, allowed=allowed,
                          query_valid=query_valid, W_O=W_O, b_O=b_O, reference=reference,
                          sink_logit=sink)


def refuse_sinks(specs: Sequence[LayerSpec], layers: Sequence[int], architecture: str) -> None:
    """Refuse layers with learned attention sinks unless the caller asked for them.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> refuse_sinks([NS(layer=0, sinks=True)], [0], "GptOssForCausalLM")
        Traceback (most recent call last):
        ...
        tl_dynamics.errors.TLDynamicsError: unsupported GptOssForCausalLM for this analysis: layers [0] have learned attention sinks (a per-head logit joins every softmax denominator, p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h)), so rows sum to less than 1), which the analyses built on LayerAttention (odds-ratio split, contextual MLP, sink statistics, atlas, reports) do not model; ModelAdapter.attention(..., sinks=True) gives the exact pattern, z and outputs
    """
    sunk = [layer for layer in layers if specs[layer].sinks]
    if sunk:
        raise TLDynamicsError(
            f"unsupported {architecture} for this analysis: layers {sunk} have learned attention "
            "sinks (a per-head logit joins every softmax denominator, p_ij = exp(s_ij) / "
            "(sum_j exp(s_ij) + exp(sink_h)), so rows sum to less than 1), which the analyses "
            "built on LayerAttention (odds-ratio split, contextual MLP, sink statistics, atlas, "
            "reports) do not model; ModelAdapter.attention(..., sinks=True) gives the exact "
            "pattern, z and outputs")
