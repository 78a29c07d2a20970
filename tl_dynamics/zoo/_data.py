"""Deterministic training data and tokenizers for the shipped models.

Two sources, both offline on every machine:

- ``induction-2l``: synthetic sequences over 62 readable one-character symbols. Outside the
  repeats each symbol follows an *in-context bigram* with probability 1/2 (``x[t] = F[x[t-1]]``
  for a random map ``F`` drawn afresh for every sequence, so only an earlier occurrence of the
  current symbol tells what comes next), otherwise a skip-bigram rule with probability 1/2
  (``x[t] = PERM[x[t-2]]`` for one fixed permutation, which makes a layer-0 previous-token head
  useful on its own), otherwise a uniform symbol. One random segment of variable period is
  repeated at a random offset in every sequence. Periods and offsets are split into a training
  set and a held-out set. Without the in-context bigrams the model learns a "late" induction
  head that matches the previous token and reads two positions after the earlier copy; the
  in-context bigrams reward matching the current token alone, which is textbook induction.
- ``code-2l``: the Python standard library's own ``.py`` source (tests excluded), files in
  sorted order, with a byte-level BPE tokenizer trained on it by ``tokenizers``.
"""

from __future__ import annotations

import string
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

BOS = "<|endoftext|>"
UNK = "<unk>"
SYMBOLS = string.ascii_uppercase + string.ascii_lowercase + string.digits  # 62 symbols
FIRST_SYMBOL = 2  # ids 0 and 1 are BOS and UNK
INDUCTION_VOCAB = FIRST_SYMBOL + len(SYMBOLS)  # 64

# Periods of the repeated segment. Held-out periods sit between and beyond the training ones.
TRAIN_PERIODS = tuple(p for p in range(3, 33) if p not in (7, 13, 19, 26))
HELDOUT_PERIODS = (7, 13, 19, 26, 40)
# Background rules outside the repeated segment: the in-context bigram x[t] = F[x[t-1]] (F drawn
# per sequence) with this probability, else the skip-bigram x[t] = PERM[x[t-2]] with SKIP_BIGRAM_P.
CONTEXT_BIGRAM_P = 0.5
SKIP_BIGRAM_P = 0.5
# How many times the segment is written in training (evaluation writes it twice).
TRAIN_COPIES = (2, 3, 4)
# Offsets (position of the segment's first token): training uses even ones, held-out odd ones.


def induction_tokenizer():
    """One token per non-space character; ``BOS`` doubles as EOS and pad, as in GPT-2."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {BOS: 0, UNK: 1, **{s: FIRST_SYMBOL + i for i, s in enumerate(SYMBOLS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=BOS, pad_token=BOS, unk_token=UNK
    )


@dataclass(frozen=True)
class InductionTask:
    """The synthetic task: sequence length, the skip-bigram permutation and the repeat split."""

    seq_len: int
    perm: torch.Tensor  # [n_symbols] symbol index -> symbol index

    @classmethod
    def build(cls, seq_len: int, seed: int) -> "InductionTask":
        gen = torch.Generator().manual_seed(seed)
        return cls(seq_len, torch.randperm(len(SYMBOLS), generator=gen))

    def batch(
        self,
        batch: int,
        gen: torch.Generator,
        periods: tuple[int, ...] = TRAIN_PERIODS,
        *,
        odd_offsets: bool = False,
        copies: tuple[int, ...] = (2,),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[batch, seq_len]`` (BOS first) and a bool mask of positions whose next token
        is a predictable repeat (``[batch, seq_len - 1]``, aligned with next-token targets).

        Each row writes one uniform random segment of a period drawn from ``periods`` a number
        of times drawn from ``copies`` (fewer where they would not fit). Training uses
        ``TRAIN_PERIODS``, even offsets and ``TRAIN_COPIES``; the held-out set is
        ``HELDOUT_PERIODS`` with odd offsets (``odd_offsets=True``), written twice.
        """
        p = torch.tensor(periods)[torch.randint(len(periods), (batch,), generator=gen)]
        c = torch.tensor(copies)[torch.randint(len(copies), (batch,), generator=gen)]
        c = torch.minimum(c, (self.seq_len - 2) // p)
        # first copy at [s, s+p), the others right after it, up to s + c*p
        half_range = (self.seq_len - c * p) // 2
        s = (torch.rand(batch, generator=gen) * half_range).long() * 2 + (1 if odd_offsets else 2)
        n, rows = len(SYMBOLS), torch.arange(batch)
        uniform = torch.randint(n, (batch, self.seq_len), generator=gen)
        use_rule = torch.rand(batch, self.seq_len, generator=gen) < SKIP_BIGRAM_P
        use_map = torch.rand(batch, self.seq_len, generator=gen) < CONTEXT_BIGRAM_P
        context_map = torch.randint(n, (batch, n), generator=gen)  # F, one per sequence
        x = uniform.clone()  # symbol indices; column 0 is replaced by BOS below
        for t in range(3, self.seq_len):
            in_first = (s <= t) & (t < s + p)
            x[:, t] = torch.where(use_rule[:, t] & ~in_first, self.perm[x[:, t - 2]], uniform[:, t])
            x[:, t] = torch.where(
                use_map[:, t] & ~in_first, context_map[rows, x[:, t - 1]], x[:, t]
            )
            in_copy = (s + p <= t) & (t < s + c * p)
            x[:, t] = torch.where(in_copy, x[rows, (t - p).clamp(min=0)], x[:, t])
        tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.long), x[:, 1:] + FIRST_SYMBOL], 1)
        target = torch.arange(1, self.seq_len)[None]
        repeat_mask = (target > (s + p)[:, None]) & (target < (s + c * p)[:, None])
        return tokens, repeat_mask


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files in sorted order, tests and site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    return [f for f in sorted(root.rglob("*.py")) if not skip & set(f.relative_to(root).parts)]


def stdlib_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def python_version() -> str:
    return sys.version.split()[0]


def train_code_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts``; ``BOS`` is id 0 (also EOS and pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=BOS, pad_token=BOS
    )


def encode_corpus(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one stream of ids, each file followed by ``BOS`` as a separator."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(tokenizer.bos_token_id)
    return torch.tensor(ids, dtype=torch.int32)


def windows(
    ids: torch.Tensor, batch: int, n_ctx: int, bos: int, gen: torch.Generator
) -> torch.Tensor:
    """``[batch, n_ctx]`` random windows of the stream, each led by ``bos`` as ``to_tokens`` does."""
    starts = torch.randint(len(ids) - n_ctx, (batch,), generator=gen)
    body = torch.stack([ids[s : s + n_ctx - 1] for s in starts.tolist()]).long()
    return torch.cat([torch.full((batch, 1), bos, dtype=torch.long), body], dim=1)


def splice_repeats(tokens: torch.Tensor, share: float, gen: torch.Generator) -> torch.Tensor:
    """In a ``share`` of the rows, copy a segment of 8 to ``n_ctx // 2 - 1`` tokens right after
    itself (variable period, random offset), so that copying from context pays off."""
    tokens = tokens.clone()
    n_ctx = tokens.shape[1]
    for row in (torch.rand(len(tokens), generator=gen) < share).nonzero().flatten().tolist():
        p = int(torch.randint(8, n_ctx // 2, (1,), generator=gen))
        s = int(torch.randint(1, n_ctx - 2 * p + 1, (1,), generator=gen))
        tokens[row, s + p : s + 2 * p] = tokens[row, s : s + p]
    return tokens


def repeated_random_tokens(
    batch: int, period: int, ids: tuple[int, int], bos: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """BOS, ``period`` tokens drawn uniformly from ``range(*ids)``, the same again: the classic
    induction probe. Returns the tokens and the mask of next-token targets in the second copy."""
    first = torch.randint(*ids, (batch, period), generator=gen)
    tokens = torch.cat([torch.full((batch, 1), bos), first, first], dim=1)
    target = torch.arange(1, tokens.shape[1])
    mask = (target > period + 1).expand(batch, -1)
    return tokens, mask
