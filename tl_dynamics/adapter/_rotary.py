"""Rotary position embeddings, for the architectures whose hooks show q and k unrotated."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_half(x: Float[Tensor, "batch pos head d_head"], cos: Float[Tensor, "batch pos rot"],
               sin: Float[Tensor, "batch pos rot"], inverse: bool = False) -> Tensor:
    """Llama/NeoX style: rotate the first ``cos.shape[-1]`` dims of each head by halves."""
    rot = cos.shape[-1]
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    if inverse:
        sin = -sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def interleaved_cos_sin(positions: Tensor, rotary_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """GPT-J style sinusoids for adjacent pairs, each repeated twice: ``[batch, pos, rotary_dim]``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    angles = positions.float()[..., None] * inv_freq
    return (torch.repeat_interleave(torch.cos(angles), 2, dim=-1),
            torch.repeat_interleave(torch.sin(angles), 2, dim=-1))


def apply_interleaved(x: Float[Tensor, "batch pos head d_head"], cos: Tensor, sin: Tensor,
                      inverse: bool = False) -> Tensor:
    """GPT-J style (rotate_every_two) on the first ``cos.shape[-1]`` dims of each head."""
    rot = cos.shape[-1]
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    if inverse:
        sin = -sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    pairs = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2)
    return torch.cat((x_rot * cos + pairs * sin, x_pass), dim=-1)


def positions_from_mask(key_valid: Tensor) -> Tensor:
    """Position ids as the hosts derive them: arange, shifted past left padding."""
    mask = key_valid.long()
    derived = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    arange = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    needs = ((derived != arange) & (mask != 0)).any(dim=1, keepdim=True)
    return torch.where(needs, derived, arange)
