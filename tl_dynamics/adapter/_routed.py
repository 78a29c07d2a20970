"""``RoutedLayerAttention``: a JetMoE layer's heads write through each query's output expert
(``_jetmoe`` forms the queries and routing; docs/math.md §1.10)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from tl_dynamics.adapter._layer import LayerAttention

__all__ = ["RoutedLayerAttention", "Routing", "routed_layer"]


def _module(model: Any, layer: int) -> Any:
    return model.blocks[layer].attn.original_component


@dataclass(frozen=True)
class Routing:
    """Each query's output experts: ``experts`` ``[batch, pos, head]`` (the expert head ``h``'s
    slot chose), ``W_O`` ``[expert, kv_head, d_head, d_model]`` and ``kv_head`` ``[head]``."""

    experts: Tensor
    W_O: Tensor
    kv_head: Tensor


@dataclass(frozen=True)
class RoutedLayerAttention(LayerAttention):
    """A ``LayerAttention`` whose heads write through their query's output expert (JetMoE):
    ``head_outputs`` reads ``routing`` (``z`` includes the router weight as ``gate``)."""

    routing: Routing | None = None

    def head_outputs(self, heads: Sequence[int] | None = None, z: Tensor | None = None) -> Tensor:
        """Per-head outputs ``z_ih (W_out^{e_ih})_c`` ``[batch, pos, head, d_model]``; over all
        heads they sum (plus ``b_O``) to the attention output."""
        if self.routing is None:
            return super().head_outputs(heads, z)
        h = self._heads(heads)
        z = self.z(heads) if z is None else z
        chosen, bank = self.routing.experts[:, :, h], self.routing.W_O
        kv = self.routing.kv_head[h]
        out = z.new_zeros(*z.shape[:3], bank.shape[-1])
        for e in range(bank.shape[0]):
            picked = (chosen == e).to(z.dtype)[..., None]
            out = out + torch.einsum("bihd,hdm->bihm", z * picked, bank[e, kv])
        return out


def routed_layer(adapter: Any, la: LayerAttention, st: dict[str, Tensor]) -> LayerAttention:
    """``la`` with its router weights as the gate on ``z`` and its output experts attached."""
    layer = la.spec.layer

    def bank() -> Tensor:
        weight = _module(adapter.model, layer).experts.output_linear.weight.detach().float()
        n_experts, d_model = weight.shape[:2]  # [E, d_model, n_kv * d_head]
        return weight.reshape(n_experts, d_model, adapter.n_kv_heads, -1).permute(0, 2, 3, 1)

    device = la.q.device
    routing = Routing(
        experts=st["experts"].to(device),
        W_O=adapter._cached(("routed_W_O", layer), bank).to(device),
        kv_head=torch.arange(adapter.n_heads, device=device) % adapter.n_kv_heads,
    )
    fields = {f.name: getattr(la, f.name) for f in dataclasses.fields(la) if f.init}
    fields["gate"] = st["router_gate"].to(device)
    return RoutedLayerAttention(**fields, routing=routing)
