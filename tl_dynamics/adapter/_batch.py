"""Prompts as tokens: ``Batch`` (tokens and which of them are real) and how text becomes one."""

from __future__ import annotations

import warnings

from dataclasses import dataclass
from typing import Any, Sequence, Union

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from tl_dynamics.adapter._switches import prepend_bos
from tl_dynamics.errors import TLDynamicsError, UnknownTokenWarning

Prompt = Union[str, Sequence[str], Tensor]
PADDING_SIDES = ("left", "right")


@dataclass(frozen=True)
class Batch:
    """Tokens and which of them are real (not padding).

    ``key_valid`` is built from the tokenizer's padding, never from the pad id (which is often the
    BOS id). ``ModelAdapter.tokenize`` makes one from a text, a list of texts or a token tensor.

    Args:
        tokens: The token ids, ``[batch, pos]``.
        key_valid: True on real tokens, False on padding, ``[batch, pos]``.
        padding_side: ``"left"`` or ``"right"``: where the padding of shorter rows went.
        bos_prepended: Whether a BOS token was prepended to each text (the tokenizer's policy,
            ``ModelAdapter.tokenize`` of text); None where token ids were given.

    Example:
        >>> b = Batch(torch.tensor([[5, 6, 0]]), torch.tensor([[True, True, False]]), "right")
        >>> b.padded
        True
    """

    tokens: Int[Tensor, "batch pos"]
    key_valid: Bool[Tensor, "batch pos"]
    padding_side: str
    bos_prepended: bool | None = None

    def begins_with_bos(self, bos_id: int | None) -> tuple[bool, ...]:
        """Per row: whether its first real token is ``bos_id`` (prepended, or the prompt's own).

        Args:
            bos_id: The tokenizer's BOS id (None: no BOS, every row False).

        Returns:
            One bool per row.

        Example:
            >>> b = Batch(torch.tensor([[0, 5], [7, 0]]), torch.tensor([[True, True], [True, False]]), "right")
            >>> b.begins_with_bos(0)
            (True, False)
        """
        if bos_id is None:
            return (False,) * self.tokens.shape[0]
        first = self.key_valid.long().argmax(-1, keepdim=True)  # the first real position
        starts = self.tokens.gather(-1, first)[:, 0] == bos_id
        return tuple(bool(x) for x in (starts & self.key_valid.any(-1)).tolist())

    @property
    def padded(self) -> bool:
        """Whether some row has padding (some ``key_valid`` entry is False).

        Example:
            >>> Batch(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.bool), "right").padded
            False
        """
        return not bool(self.key_valid.all())

    def real_tokens(self, row: int = 0) -> Int[Tensor, " pos"]:
        """The token ids of one row with its padding removed.

        Args:
            row: The row of the batch.

        Returns:
            The real token ids, ``[n_real]``.

        Example:
            >>> b = Batch(torch.tensor([[5, 6, 0]]), torch.tensor([[True, True, False]]), "right")
            >>> b.real_tokens(0).tolist()
            [5, 6]
        """
        return self.tokens[row][self.key_valid[row]]


def model_device(model: Any) -> torch.device:
    """The device of the model's first parameter (the CPU for a model without any)."""
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return torch.device("cpu") if param is None else param.device


def tokenize(
    model: Any,
    n_ctx: int,
    prompt: Prompt | Batch,
    padding_side: str = "right",
    attention_mask: Tensor | None = None,
) -> Batch:
    """``ModelAdapter.tokenize``: tokens and padding mask of ``prompt`` for ``model``."""
    if isinstance(prompt, Batch):
        return prompt
    if padding_side not in PADDING_SIDES:
        raise TLDynamicsError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if isinstance(prompt, Tensor):
        tokens = prompt[None] if prompt.ndim == 1 else prompt
        if tokens.ndim != 2 or tokens.is_floating_point():
            raise TLDynamicsError(
                f"token tensor must be integer [batch, pos] or [pos], got "
                f"{tuple(prompt.shape)} {prompt.dtype}"
            )
        vocab = int(getattr(getattr(model, "cfg", None), "d_vocab", 0) or 0)
        if vocab and tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            bad = tokens[(tokens < 0) | (tokens >= vocab)].unique()[:5].tolist()
            raise TLDynamicsError(
                f"token ids {bad} are outside this model's vocabulary (valid: 0..{vocab - 1})"
            )
        tokens = tokens.to(model_device(model))  # where the host's own to_tokens puts text
        if attention_mask is None:
            key_valid = torch.ones_like(tokens, dtype=torch.bool)
        else:
            key_valid = attention_mask.reshape(tokens.shape).bool().to(tokens.device)
    else:
        if not isinstance(prompt, (str, list, tuple)):
            raise TLDynamicsError(
                f"prompt must be a string, a list of strings, a token tensor or a "
                f"Batch, got {type(prompt).__name__}"
            )
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not texts or any(not isinstance(t, str) for t in texts):
            raise TLDynamicsError(
                "prompt must be a non-empty string, a non-empty list of strings, or a token tensor"
            )
        if any(t == "" for t in texts):
            raise TLDynamicsError("prompt is empty: give at least one character of text")
        if getattr(model, "tokenizer", None) is None:
            raise TLDynamicsError("this model has no tokenizer: pass a token tensor instead")
        tokens = model.to_tokens(texts, padding_side=padding_side, truncate=False)
        key_valid = (
            _padding_mask(model, tokens, padding_side)
            if len(texts) > 1
            else torch.ones_like(tokens, dtype=torch.bool)
        )
        _warn_unknown(model.tokenizer, texts, tokens, key_valid)
    if tokens.shape[1] == 0:
        raise TLDynamicsError("prompt is empty: it has zero tokens")
    if tokens.shape[1] > n_ctx:
        raise TLDynamicsError(
            f"prompt has {tokens.shape[1]} tokens but this model's context "
            f"is {n_ctx} tokens (valid: 1..{n_ctx})"
        )
    bos = None if isinstance(prompt, Tensor) else prepend_bos(model)
    return Batch(tokens=tokens, key_valid=key_valid, padding_side=padding_side, bos_prepended=bos)


def _warn_unknown(tokenizer: Any, texts: list[str], tokens: Tensor, key_valid: Tensor) -> None:
    """``UnknownTokenWarning`` naming the characters (else the words) of each text that the
    tokenizer maps to its unknown token; nothing where it has none, or where that id doubles as
    BOS, EOS or padding (GPT-2's byte-level BPE keeps every character)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    others = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad")}
    if not isinstance(unk, int) or unk in others:
        return
    hit = ((tokens == unk) & key_valid).any(-1).tolist()
    for text, has_unk in zip(texts, hit):
        if not has_unk:
            continue

        def unknown(piece: str) -> bool:
            return unk in tokenizer.encode(piece, add_special_tokens=False)

        culprits = [c for c in sorted(set(text)) if unknown(c)]
        culprits = culprits or [w for w in dict.fromkeys(text.split()) if unknown(w)]
        shown = ", ".join(repr(c) for c in culprits[:12]) + (" ..." if len(culprits) > 12 else "")
        warnings.warn(
            f"the tokenizer maps {shown} in the prompt {text[:60]!r} to its unknown token "
            f"{getattr(tokenizer, 'unk_token', '<unk>')!r}: the model sees a placeholder there "
            "(adapter.str_tokens shows what was kept); use characters in its vocabulary",
            UnknownTokenWarning,
            stacklevel=4,
        )


def _padding_mask(model: Any, tokens: Tensor, padding_side: str) -> Tensor:
    from transformer_lens.utilities.tokenize_utils import get_attention_mask

    prepend = prepend_bos(model)
    return get_attention_mask(model.tokenizer, tokens, prepend, padding_side=padding_side).bool()
