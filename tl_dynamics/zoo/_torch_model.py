"""A plain-torch transformer whose ``state_dict`` is a TransformerLens checkpoint.

The zoo trains its models with this module rather than with a host model: it needs only
torch, runs the same under TransformerLens 3.x and 4.x, and skips hook overhead. Its
parameter names and shapes are exactly those of ``HookedTransformer.state_dict()``
(``embed.W_E``, ``blocks.0.attn.W_Q`` as ``[n_heads, d_model, d_head]``, ...), so the saved
file loads into ``HookedTransformer`` directly and into ``TransformerBridge.boot_native``
through ``convert_tl_checkpoint``. Supported configuration: learned absolute positions,
``normalization_type`` ``"LN"`` or ``None``, ``attn_only``, ``act_fn`` ``"gelu_new"`` or
``"relu"``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tl_dynamics.errors import TLDynamicsError

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class _LayerNorm(nn.Module):
    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d_model))
        self.b = nn.Parameter(torch.zeros(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.w.shape, self.w, self.b, self.eps)


class _Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_head: int):
        super().__init__()
        self.W_Q = nn.Parameter(torch.empty(n_heads, d_model, d_head))
        self.W_K = nn.Parameter(torch.empty(n_heads, d_model, d_head))
        self.W_V = nn.Parameter(torch.empty(n_heads, d_model, d_head))
        self.W_O = nn.Parameter(torch.empty(n_heads, d_head, d_model))
        self.b_Q = nn.Parameter(torch.zeros(n_heads, d_head))
        self.b_K = nn.Parameter(torch.zeros(n_heads, d_head))
        self.b_V = nn.Parameter(torch.zeros(n_heads, d_head))
        self.b_O = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [batch, pos, d_model] -> q, k, v: [batch, head, pos, d_head]
        q = torch.einsum("bpm,hmd->bhpd", x, self.W_Q) + self.b_Q[None, :, None]
        k = torch.einsum("bpm,hmd->bhpd", x, self.W_K) + self.b_K[None, :, None]
        v = torch.einsum("bpm,hmd->bhpd", x, self.W_V) + self.b_V[None, :, None]
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.einsum("bhpd,hdm->bpm", z, self.W_O) + self.b_O


class _MLP(nn.Module):
    def __init__(self, d_model: int, d_mlp: int, act_fn: str):
        super().__init__()
        self.W_in = nn.Parameter(torch.empty(d_model, d_mlp))
        self.b_in = nn.Parameter(torch.zeros(d_mlp))
        self.W_out = nn.Parameter(torch.empty(d_mlp, d_model))
        self.b_out = nn.Parameter(torch.zeros(d_model))
        self.act = _ACTIVATIONS[act_fn]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x @ self.W_in + self.b_in) @ self.W_out + self.b_out


class _Block(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        d_model, ln = cfg["d_model"], cfg["normalization_type"] == "LN"
        self.attn_only = cfg["attn_only"]
        self.ln1 = _LayerNorm(d_model, cfg["eps"]) if ln else nn.Identity()
        self.attn = _Attention(d_model, cfg["n_heads"], cfg["d_head"])
        if not self.attn_only:
            self.ln2 = _LayerNorm(d_model, cfg["eps"]) if ln else nn.Identity()
            self.mlp = _MLP(d_model, cfg["d_mlp"], cfg["act_fn"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        if not self.attn_only:
            x = x + self.mlp(self.ln2(x))
        return x


class _Embed(nn.Module):
    def __init__(self, d_vocab: int, d_model: int):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(d_vocab, d_model))


class _PosEmbed(nn.Module):
    def __init__(self, n_ctx: int, d_model: int):
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(n_ctx, d_model))


class _Unembed(nn.Module):
    def __init__(self, d_model: int, d_vocab: int):
        super().__init__()
        self.W_U = nn.Parameter(torch.empty(d_model, d_vocab))
        self.b_U = nn.Parameter(torch.zeros(d_vocab))


class TorchTransformer(nn.Module):
    """Decoder-only transformer with TransformerLens parameter names.

    ``cfg`` is the zoo's TL config dict (the content of ``config.json``).
    ``forward(tokens)`` maps ``[batch, pos]`` token ids to ``[batch, pos, d_vocab]`` logits.
    """

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        if cfg.get("positional_embedding_type", "standard") != "standard":
            raise TLDynamicsError(
                f"positional_embedding_type={cfg['positional_embedding_type']!r} "
                "is not supported by the zoo's training model; use 'standard'"
            )
        if cfg["normalization_type"] not in ("LN", None):
            raise TLDynamicsError(
                f"normalization_type={cfg['normalization_type']!r} is not supported; use 'LN' or None"
            )
        if not cfg["attn_only"] and cfg["act_fn"] not in _ACTIVATIONS:
            raise TLDynamicsError(
                f"act_fn={cfg['act_fn']!r} is not supported; use one of {sorted(_ACTIVATIONS)}"
            )
        d_model = cfg["d_model"]
        self.embed = _Embed(cfg["d_vocab"], d_model)
        self.pos_embed = _PosEmbed(cfg["n_ctx"], d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg["n_layers"]))
        if cfg["normalization_type"] == "LN":
            self.ln_final = _LayerNorm(d_model, cfg["eps"])
        self.unembed = _Unembed(d_model, cfg["d_vocab"])
        self._init_weights(cfg["n_layers"], d_model)

    def _init_weights(self, n_layers: int, d_model: int) -> None:
        std = 0.8 / math.sqrt(d_model)  # HookedTransformer's default initializer_range
        for name, p in self.named_parameters():
            if name.endswith((".W_O", ".W_out")):
                nn.init.normal_(p, std=std / math.sqrt(2 * n_layers))
            elif p.ndim >= 2:
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed.W_E[tokens] + self.pos_embed.W_pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        if hasattr(self, "ln_final"):
            x = self.ln_final(x)
        return x @ self.unembed.W_U + self.unembed.b_U
