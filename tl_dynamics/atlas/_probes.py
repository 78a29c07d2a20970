"""Probe prompts built from token ids: repeated random sequences (no tokenizer needed).

Each repeated probe is ``[prefix] R R`` with ``R`` a sequence of ``seq_len`` token ids drawn
uniformly (seeded) from the model's vocabulary, special tokens left out when the model has a
tokenizer. ``prefix`` is the model's BOS (or CLS) token where its tokenizer names one. On the
second copy a query at ``i`` finds its own token at ``i - seq_len`` (duplicate-token target)
and the token that followed it at ``i - seq_len + 1`` (induction target).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor

from tl_dynamics.adapter import Batch, ModelAdapter, Prompt
from tl_dynamics.errors import TLDynamicsError

N_SEQ = 16  # probes: the units of every role's interval (at least evidence.MIN_UNITS)
SEQ_LEN = 20
SEED = 0


@dataclass(frozen=True)
class Probes:
    """The probe batches: ``repeat`` (repeated random sequences) and ``natural`` (the user's
    prompts, or ``repeat`` itself by default) for sinks, locality and the causal losses."""

    repeat: Batch
    natural: Batch
    seq_len: int
    offset: int  # 1 when a prefix token leads each repeated probe, else 0
    user_prompts: bool

    @property
    def first_copy(self) -> range:
        return range(self.offset, self.offset + self.seq_len)

    @property
    def second_copy(self) -> range:
        return range(self.offset + self.seq_len, self.offset + 2 * self.seq_len)


def _special_ids(adapter: ModelAdapter) -> set[int]:
    tokenizer = adapter.tokenizer
    return (
        set(getattr(tokenizer, "all_special_ids", None) or []) if tokenizer is not None else set()
    )


def _prefix_id(adapter: ModelAdapter) -> int | None:
    tokenizer = adapter.tokenizer
    if tokenizer is None:
        return None
    for name in ("bos_token_id", "cls_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return None


def repeated_tokens(
    adapter: ModelAdapter, n_seq: int = N_SEQ, seq_len: int = SEQ_LEN, seed: int = SEED
) -> tuple[Int[Tensor, "batch pos"], int]:  # noqa: F722
    """``n_seq`` probes ``[prefix] R R`` of random ids, and the prefix length (0 or 1).

    Example:
        >>> from tl_dynamics import zoo
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> tokens, offset = repeated_tokens(ModelAdapter(zoo.load("induction-2l")), 2, 5)
        >>> tokens.shape, offset, bool((tokens[:, 1:6] == tokens[:, 6:11]).all())
        (torch.Size([2, 11]), 1, True)
    """
    if not isinstance(n_seq, int) or n_seq < 1:
        raise TLDynamicsError(f"n_seq must be a positive number of probe sequences, got {n_seq!r}")
    prefix = _prefix_id(adapter)
    offset = 0 if prefix is None else 1
    if not isinstance(seq_len, int) or seq_len < 2 or offset + 2 * seq_len > adapter.n_ctx:
        raise TLDynamicsError(
            f"seq_len {seq_len!r} does not fit: a probe is {offset} + 2 x seq_len "
            f"tokens and this model's context is {adapter.n_ctx} "
            f"(valid: 2..{(adapter.n_ctx - offset) // 2})"
        )
    vocab = int(adapter.W_E.shape[0])
    special = _special_ids(adapter)
    pool = torch.tensor([i for i in range(vocab) if i not in special], dtype=torch.long)
    if len(pool) < 2:
        raise TLDynamicsError(
            f"the vocabulary has {len(pool)} ordinary tokens; probes need 2 or more"
        )
    generator = torch.Generator().manual_seed(int(seed))
    picks = pool[torch.randint(len(pool), (n_seq, seq_len), generator=generator)]
    parts = [picks, picks]
    if prefix is not None:
        parts.insert(0, torch.full((n_seq, 1), prefix, dtype=torch.long))
    return torch.cat(parts, dim=1), offset


def build_probes(
    adapter: ModelAdapter,
    prompts: Prompt | Batch | None = None,
    n_seq: int = N_SEQ,
    seq_len: int = SEQ_LEN,
    seed: int = SEED,
) -> Probes:
    """The repeated probes, and ``prompts`` (anything ``adapter.tokenize`` takes) as the
    natural probes; without ``prompts`` the repeated probes serve for both."""
    tokens, offset = repeated_tokens(adapter, n_seq, seq_len, seed)
    repeat = adapter.tokenize(tokens)
    natural = repeat if prompts is None else adapter.tokenize(prompts)
    return Probes(
        repeat=repeat,
        natural=natural,
        seq_len=seq_len,
        offset=offset,
        user_prompts=prompts is not None,
    )
