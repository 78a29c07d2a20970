"""Mixture of attention heads (JetMoE): a router picks each token's query and output experts.

``JetMoeAttention`` (its ``JetMoeMoA``) keeps ``E`` experts, each a query projection
``W_in^e`` and an output projection ``W_out^e`` over all ``n_kv`` key/value heads. For token
``i`` the router's logits ``l_i = x_i W_r`` choose its top ``k`` experts ``e_i1 .. e_ik`` (by
logit) with weights ``g_ij`` (a softmax over the ``k`` chosen logits). Slot ``j`` of token ``i``
and key/value head ``c`` make head ``h = j n_kv + c`` (docs/math.md §1.10):

    q_ih = R_i (x_i W_in^{e_ij})_c       k_jh = R_j (x_j W_K)_c       v_jh = (x_j W_V)_c
    z_ih = g_ij sum_j p_ijh v_jh         out_i = sum_h z_ih (W_out^{e_ij})_c + b

(keys and values are shared, tiled over the slots: head ``h`` reads key head ``h mod n_kv``).
TransformerLens's bridge runs the Hugging Face module and hooks its input ``x``
(``attn.hook_in``), the router's logits (``attn.experts.router.hook_out``), the shared key/value
projection (``attn.kv.hook_out``), the pattern and the output (``attn.hook_out``); no query and
no ``z``. The adapter forms the queries from ``x``, the hooked logits' top ``k`` and the experts'
own weights (``routed_qkv``), rotates them with the layer's verified ``Rotation`` (``_scored``)
and writes each head through its token's output expert (``_routed.RoutedLayerAttention``). The router
weight multiplies ``z`` like an output gate (``LayerSpec.gate == "router"``), so whatever refuses
gated layers refuses these; ``W_Q``, ``b_Q`` and ``W_O`` depend on the token and are refused too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

__all__ = [
    "ROUTED_HOOKS",
    "ROUTED_NAMES",
    "ROUTED_ROLES",
    "ROUTED_WEIGHTS",
    "ROUTER_WHAT",
    "routed_queries",
    "routed_patch_refusal",
    "routed_qkv",
    "routed_refusal",
    "routed_weight",
    "unfixed_W_O",
]

ROUTER_WHAT = (
    "router-chosen attention experts: a router picks each token's query and output projections "
    "among the layer's experts and weights each head's output by its router probability"
)
# role -> bridge hook after the block prefix (the router's logits, the shared k/v projection)
ROUTED_HOOKS = {"router": "attn.experts.router.hook_out", "kv": "attn.kv.hook_out"}
ROUTED_ROLES = ("x", "router", "kv")
# roles whose hook differs on these layers (no q or o projection): the module's input and output
ROUTED_NAMES = {"x": "attn.hook_in", "out": "attn.hook_out"}
# weights that depend on the token's experts
ROUTED_WEIGHTS = ("W_Q", "b_Q", "W_O")


def routed_refusal(spec: Any, architecture: str, what: str) -> TLDynamicsError:
    """The refusal of ``what`` (an analysis or a weight) on a layer of router-chosen experts.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> str(routed_refusal(NS(layer=0), "JetMoeForCausalLM", "W_Q"))[:69]
        'W_Q: layer 0 of JetMoeForCausalLM has router-chosen attention experts'
    """
    return TLDynamicsError(
        f"{what}: layer {spec.layer} of {architecture} has {ROUTER_WHAT}, so W_Q and W_O depend "
        "on the token and the head's output is not pattern @ v times a fixed matrix; it does not "
        "model the routing (the pattern, z and head outputs are exact: ModelAdapter.attention)"
    )


def routed_patch_refusal(spec: Any, architecture: str) -> TLDynamicsError:
    """What ``ModelAdapter.patch`` raises for ``z`` on such a layer."""
    return TLDynamicsError(
        f"cannot patch z of layer {spec.layer} of {architecture}: it has {ROUTER_WHAT}, and "
        "TransformerLens runs the Hugging Face module whole, hooking neither z nor a pattern "
        "the module would use"
    )


def _module(model: Any, layer: int) -> Any:
    return model.blocks[layer].attn.original_component


def _route(orig: Any, logits: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
    """``(experts, weights)`` ``[tokens, k]`` as ``JetMoeTopKGating`` chooses them from
    ``logits`` ``[tokens, E]`` (weights in ``like``'s dtype, as the module casts them)."""
    top_logits, experts = logits.float().topk(int(orig.top_k), dim=1)
    return experts, torch.softmax(top_logits, dim=1).type_as(like)


def _project(orig: Any, flat: Tensor, experts: Tensor) -> Tensor:
    """Each token's query per slot, ``[tokens, k, n_kv * d_head]``: the token's row through its
    slot's expert, in the module's dtype (as ``JetMoeParallelExperts`` does per expert)."""
    weight = orig.experts.input_linear.weight.detach()
    out = flat.new_zeros(*experts.shape, weight.shape[1])
    for e in range(weight.shape[0]):
        rows, slots = (experts == e).nonzero(as_tuple=True)
        if rows.numel():
            out[rows, slots] = F.linear(flat[rows], weight[e])
    return out


def routed_qkv(adapter: Any, spec: Any, st: dict[str, Tensor]) -> None:
    """Store ``q`` (unrotated), ``k``, ``v`` ``[batch, pos, head, d_head]`` and the routing
    (``experts``, ``router_gate``) of a JetMoE layer in its stash ``st``, from the hooked input,
    router logits and key/value projection."""
    missing = [r for r in ROUTED_ROLES if r not in st]
    if missing:
        raise TLDynamicsError(
            f"layer {spec.layer} of {adapter.info.architecture} routes its queries through "
            f"attention experts but the forward pass did not fire its {missing} hooks"
        )
    orig, x = _module(adapter.model, spec.layer), st["x"]
    n_batch, n_pos, n_kv, d = x.shape[0], x.shape[1], adapter.n_kv_heads, adapter.d_head
    flat = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        experts, weights = _route(orig, st["router"].reshape(flat.shape[0], -1), flat)
        q = _project(orig, flat, experts)
    key, value = st["kv"].chunk(2, dim=-1)
    slots = int(orig.top_k)
    st["q"] = q.reshape(n_batch, n_pos, slots * n_kv, d)
    st["k"] = key.reshape(n_batch, n_pos, n_kv, d).repeat(1, 1, slots, 1)
    st["v"] = value.reshape(n_batch, n_pos, n_kv, d).repeat(1, 1, slots, 1)
    st["experts"] = experts.reshape(n_batch, n_pos, slots).repeat_interleave(n_kv, dim=-1)
    st["router_gate"] = weights.float().reshape(n_batch, n_pos, slots)
    st["router_gate"] = st["router_gate"].repeat_interleave(n_kv, dim=-1)[..., None]


def routed_queries(model: Any, layer: int, x: Tensor, n_kv: int) -> Tensor:
    """The unrotated queries ``[..., head, d_head]`` of attention inputs ``x`` ``[..., d_model]``,
    each token routed by the module's own router (``ModelAdapter.unrotated_queries``)."""
    orig = _module(model, layer)
    weight = orig.experts.input_linear.weight
    flat = x.reshape(-1, x.shape[-1]).to(weight.dtype)
    with torch.no_grad():
        experts, _ = _route(orig, orig.experts.router.layer(flat), flat)
        q = _project(orig, flat, experts).float()
    return q.reshape(*x.shape[:-1], int(orig.top_k) * n_kv, -1)


def routed_weight(model: Any, layer: int, name: str, n_heads: int) -> Tensor | None:
    """``W_K``/``W_V`` ``[head, d_model, d_head]`` (the shared projection, tiled over the slots:
    head ``h`` reads key/value head ``h mod n_kv``), ``b_O`` (the experts' shared bias), None for
    the biases the layer has not."""
    orig = _module(model, layer)
    if name == "b_O":
        return orig.experts.bias.detach().float()
    if name not in ("W_K", "W_V"):
        return None  # b_K, b_V: kv_proj has no bias (W_Q, b_Q, W_O are refused before)
    weight = orig.kv_proj.weight.detach().float().chunk(2, dim=0)[name == "W_V"]
    n_kv = weight.shape[0] // orig.head_dim
    heads = weight.reshape(n_kv, orig.head_dim, -1).transpose(1, 2)  # [kv, d_model, d_head]
    return heads.repeat(n_heads // n_kv, 1, 1)


def unfixed_W_O(adapter: Any, device: torch.device) -> Tensor:
    """What ``LayerAttention.W_O`` holds on these layers: NaN (no fixed output projection; every
    reader of it refuses the layer first, and the head outputs read the experts')."""
    nan = torch.full((), float("nan"), device=device)
    return nan.expand(adapter.n_heads, adapter.d_head, adapter.d_model)
