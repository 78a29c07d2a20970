"""What a pass without an attention mask really read: the real lengths of the texts the model
tokenized itself, or a refusal where its token ids carry padding nobody can tell apart.

A batch of texts given to the model (``model(["a", "b c"])``, ``run_with_cache`` of a list) is
tokenized by the model's own ``to_tokens`` and, padded on the right, run **without** an attention
mask (TransformerLens 4.3's bridge and 3.x's ``HookedTransformer`` pad with the pad id, often the
BOS id too). In a causal model a real token never attends to the padding after it, so the pads
change no real number, but they are not text: every statistic must leave them out, as queries
and as keys. While an analysis is attached the adapter keeps the texts each ``to_tokens`` call
turned into token ids (``TextLog``, wrapping the model's ``to_tokens`` for the attached block
only and returning exactly what it returns), and a pass whose token ids are those knows each
row's real length (each text tokenized alone: its ids are the start of its row, or the end of a
left-padded one).

Where the model read the padding (texts padded on the left, or any padding in a bidirectional
model, without a mask) the statistics cannot be those of the texts: refused by name. A token
tensor from elsewhere whose rows end (or start) in runs of the pad id of different lengths, with
no mask, is refused too: the pads cannot be told from real pad-id tokens, and the mask says it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from tl_dynamics.adapter._batch import Batch
from tl_dynamics.adapter._capture import wrapping
from tl_dynamics.errors import TLDynamicsError


class TextLog:
    """The texts behind the last token ids the model's ``to_tokens`` made while attached."""

    def __init__(self) -> None:
        self.tokens: Tensor | None = None
        self.texts: list[str] = []
        self.alone: Callable[[str], Tensor] | None = None  # one text tokenized as the call did

    def record(self, tokens: Any, texts: list[str], alone: Callable[[str], Tensor]) -> None:
        if isinstance(tokens, Tensor):
            self.tokens, self.texts, self.alone = tokens, texts, alone

    def lengths_of(self, tokens: Tensor) -> list[tuple[int, str]] | None:
        """``(length, side)`` of each row of ``tokens`` when they are the token ids of the
        texts last recorded (None otherwise): each text alone is the start ("right") or the end
        ("left") of its row."""
        made = self.tokens
        if made is None or self.alone is None or tuple(made.shape) != tuple(tokens.shape):
            return None
        if made.data_ptr() != tokens.data_ptr() and not torch.equal(made.cpu(), tokens.cpu()):
            return None
        rows = []
        for text, row in zip(self.texts, tokens.cpu()):
            alone = self.alone(text).reshape(-1).cpu()
            n = int(alone.shape[0])
            if n <= row.shape[0] and torch.equal(row[:n], alone):
                rows.append((n, "right"))
            elif n <= row.shape[0] and torch.equal(row[row.shape[0] - n :], alone):
                rows.append((n, "left"))
            else:
                return None
        return rows


def recording_texts(model: Any, log: TextLog) -> Any:
    """A context manager wrapping ``model.to_tokens`` for the block (``_capture.wrapping``): every
    call is the original's, result and all, and ``log`` keeps its texts."""

    def wrap(original: Callable) -> Callable:
        def to_tokens(input: Any, *args: Any, **kwargs: Any) -> Any:
            tokens = original(input, *args, **kwargs)
            texts = input  # one text is one row, never padded: only batches of texts are kept
            if (
                isinstance(texts, (list, tuple))
                and len(texts) > 1
                and all(isinstance(t, str) for t in texts)
            ):
                alone_kwargs = {k: v for k, v in kwargs.items() if k != "padding_side"}

                def alone(text: str) -> Tensor:
                    return original(text, *args, **alone_kwargs)

                log.record(tokens, list(texts), alone)
            return tokens

        return to_tokens

    return wrapping(model, "to_tokens", wrap)


def unmasked_batch(tokens: Tensor, log: TextLog, causal: bool, pad_id: int | None) -> Batch:
    """The ``Batch`` of a pass that runs ``tokens`` ``[batch, pos]`` without an attention mask:
    real lengths from ``log`` where the model tokenized texts; every token real where nothing is
    padded; a ``TLDynamicsError`` where the model read padding or the padding is unknowable."""
    everything = torch.ones_like(tokens, dtype=torch.bool)
    rows = log.lengths_of(tokens)
    n = tokens.shape[1]
    if rows is not None:
        padded = [(i, length, side) for i, (length, side) in enumerate(rows) if length < n]
        if not padded:
            return Batch(tokens, everything, "right")
        left = [i for i, _, side in padded if side == "left"]
        if left or not causal:
            raise read_padding(left, causal)
        valid = torch.arange(n)[None, :] < torch.tensor([length for length, _ in rows])[:, None]
        return Batch(tokens, valid.to(tokens.device), "right")
    runs = _pad_runs(tokens, pad_id)
    if runs is not None:
        raise unknown_padding(*runs, pad_id)
    return Batch(tokens, everything, "right")


def _pad_runs(tokens: Tensor, pad_id: int | None) -> tuple[str, list[int]] | None:
    """``(side, runs)`` where the rows end (or start) in runs of ``pad_id`` of different
    lengths (the look of a padded batch), else None. One read of the device (both sides at
    once), and only for a batch of several rows without a mask."""
    if pad_id is None or tokens.shape[0] < 2:
        return None
    is_pad = (tokens == pad_id).long()
    runs = torch.stack([is_pad.flip(-1).cumprod(-1).sum(-1), is_pad.cumprod(-1).sum(-1)])
    right, left = runs.tolist()
    for side, run in (("right", right), ("left", left)):
        if max(run) > min(run):
            return side, run
    return None


def read_padding(left_rows: list[int], causal: bool) -> TLDynamicsError:
    """The refusal of texts whose padding the model itself read (no attention mask)."""
    where = (
        f"padded on the left (rows {left_rows})"
        if left_rows
        else "padded, in a bidirectional model"
    )
    return TLDynamicsError(
        f"a batch of texts {where} ran without an attention mask inside attach(): the model's "
        "real tokens attended to the padding, so its numbers are not those of the texts and "
        "attach() refuses them; pass the mask (tokens = model.to_tokens(texts, "
        "padding_side='left'); model(tokens, attention_mask=mask) with the tokenizer's mask), "
        "pad on the right, or run the texts through the analysis's compute() / "
        "collector.forward"
    )


def unknown_padding(side: str, runs: list[int], pad_id: int | None) -> TLDynamicsError:
    """The refusal of a token batch that looks padded and comes without a mask."""
    return TLDynamicsError(
        f"a batch of token ids whose rows {'end' if side == 'right' else 'start'} in runs of the "
        f"pad token (id {pad_id}) of different lengths {runs}, and no attention_mask, inside "
        "attach(): padding cannot be told from real tokens of that id, so attach() refuses "
        "rather than count padding as text; pass the mask the tokenizer made "
        "(model(tokens, attention_mask=mask), with mask = tokenizer(texts, padding=True)"
        "['attention_mask'], or torch.ones_like(tokens) if those ids are real tokens), or give "
        "the texts themselves (model(texts))"
    )
