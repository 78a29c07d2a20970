"""``HookedTransformer`` checkpoint -> ``TransformerBridge.boot_native`` keys, for TransformerLens 3.x.

TransformerLens 4.x ships this as ``transformer_lens.utilities.tl_checkpoint_conversion.
convert_tl_checkpoint`` and the zoo uses that one there; 3.x has a native bridge but no
converter. This covers the parameters the zoo's models have (no GQA, no gated MLP).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tl_dynamics.errors import TLDynamicsError


def _heads_in(
    t: torch.Tensor,
) -> torch.Tensor:  # [n_heads, d_model, d_head] -> [(n_heads d_head), d_model]
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])


def _heads_out(
    t: torch.Tensor,
) -> torch.Tensor:  # [n_heads, d_head, d_model] -> [d_model, (n_heads d_head)]
    return t.reshape(-1, t.shape[2]).T


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.T


# Checked in order: ".b_Q" must match before the LayerNorm fallback ".b".
_SUFFIXES: list[tuple[str, str, Callable[[torch.Tensor], torch.Tensor]]] = [
    (".W_Q", ".q.weight", _heads_in),
    (".W_K", ".k.weight", _heads_in),
    (".W_V", ".v.weight", _heads_in),
    (".W_O", ".o.weight", _heads_out),
    (".b_Q", ".q.bias", _flat),
    (".b_K", ".k.bias", _flat),
    (".b_V", ".v.bias", _flat),
    (".b_O", ".o.bias", _same),
    (".W_in", ".in.weight", _transpose),
    (".b_in", ".in.bias", _same),
    (".W_out", ".out.weight", _transpose),
    (".b_out", ".out.bias", _same),
    (".W_U", ".weight", _transpose),
    (".b_U", ".bias", _same),
    (".W_E", ".weight", _same),
    (".W_pos", ".weight", _same),
    (".w", ".weight", _same),
    (".b", ".bias", _same),
]


def convert_tl_checkpoint(state_dict: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """Same contract as TransformerLens 4.x's converter of that name, for the zoo's models."""
    if getattr(cfg, "n_key_value_heads", None) not in (None, cfg.n_heads):
        raise TLDynamicsError("the TransformerLens 3.x checkpoint converter does not handle GQA")
    converted = {}
    for key, tensor in state_dict.items():
        if key.endswith((".mask", ".IGNORE")):
            continue
        for old, new, convert in _SUFFIXES:
            if key.endswith(old):
                converted[key[: -len(old)] + new] = convert(tensor).contiguous()
                break
        else:
            raise TLDynamicsError(f"cannot convert checkpoint key {key!r} for the bridge")
    return converted
