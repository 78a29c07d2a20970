"""Measurements written into the model cards, taken on a loaded TransformerLens model."""

from __future__ import annotations

from typing import Any

import torch

HEAD_KINDS = ("previous_token_head", "induction_head", "duplicate_token_head")


@torch.no_grad()
def next_token_logprobs(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """``[batch, pos, d_vocab]`` log-probabilities of the next token."""
    return model(tokens).log_softmax(-1)


@torch.no_grad()
def masked_loss(model: Any, tokens: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean next-token cross-entropy over the positions where ``mask`` (``[batch, pos-1]``) holds."""
    logp = next_token_logprobs(model, tokens)[:, :-1]
    nll = -logp.gather(-1, tokens[:, 1:, None])[..., 0]
    return nll[mask].mean().item()


@torch.no_grad()
def head_scores(model: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
    """TransformerLens's ``detect_head`` scores (``[n_layers, n_heads]``, mean over prompts,
    default ``"mul"`` measure: the share of each head's attention on the expected positions)."""
    from transformer_lens.head_detector import detect_head

    return {kind: detect_head(model, prompts, kind) for kind in HEAD_KINDS}


def scores_table(scores: dict[str, torch.Tensor]) -> str:
    """Markdown table, one row per head."""
    kinds = list(scores)
    n_layers, n_heads = scores[kinds[0]].shape
    lines = ["| head | " + " | ".join(k.replace("_", " ") for k in kinds) + " |"]
    lines.append("|---|" + "---|" * len(kinds))
    for layer in range(n_layers):
        for head in range(n_heads):
            cells = " | ".join(f"{scores[k][layer, head].item():.3f}" for k in kinds)
            lines.append(f"| L{layer}H{head} | {cells} |")
    return "\n".join(lines)


@torch.no_grad()
def greedy_completion(model: Any, prompt: str, new_tokens: int) -> str:
    """The prompt continued greedily by ``new_tokens`` tokens (host-agnostic: plain forward calls)."""
    tokens = model.to_tokens(prompt)
    for _ in range(new_tokens):
        nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return model.to_string(tokens[0, 1:])
