"""The corpus: prompts with where they came from, checked one by one, cut into numbered batches.

A prompt longer than the model's context, a line that is not UTF-8, or text with a lone
surrogate (from JSON escapes) is handled by the ``on_long`` policy: ``"error"`` (default) stops
before any work on it with the file and line, ``"skip"`` leaves it out, ``"truncate"`` keeps the
longest prefix that fits (undecodable lines cannot be cut, so they are left out). What was left
out or cut is counted per batch, so the counts merge like the statistics.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, overload

from tl_dynamics import files
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._validate import SKIP_KEYS

Prompts = str | os.PathLike | Sequence[str]
ON_LONG = ("error", "skip", "truncate")


def is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".ndjson", ".json")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def iter_records(prompts: Prompts | Iterable[str]) -> Iterator[tuple[str, str | None]]:
    """``(where, text)`` for every prompt: ``where`` is ``"FILE:LINE"`` or ``"prompt I"``;
    ``text`` is None for a line that is not valid UTF-8 (or holds a lone surrogate)."""
    if not isinstance(prompts, (str, os.PathLike)):
        if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
            raise TLDynamicsError(
                f"prompts must be a corpus file path or a list of strings, got "
                f"{type(prompts).__name__}"
            )
        for i, text in enumerate(prompts):
            if not isinstance(text, str) or not text:
                raise TLDynamicsError(
                    f"prompt {i} is {text!r}: every prompt must be a non-empty string"
                )
            yield f"prompt {i}", text if _encodable(text) else None
        return
    path = Path(prompts)
    if not files.is_file(path):
        raise TLDynamicsError(
            f"prompts file {str(path)!r} does not exist (give a text file, one "
            "prompt per line, or JSON lines with a 'text' field)"
        )
    with path.open("rb") as handle:
        yield from file_records(str(path), handle, is_jsonl(path))


def file_records(
    name: str, lines: Iterable[bytes], jsonl: bool
) -> Iterator[tuple[str, str | None]]:
    """``iter_records`` of a file's raw lines (``bytes`` ending in ``\\n``, as iterating a file
    opened in binary mode gives them), named ``name`` in ``"FILE:LINE"``; a Ray worker parses
    the bytes of a file it read with this, so both read a file alike."""
    for number, raw in enumerate(lines, 1):
        where = f"{name}:{number}"
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            yield where, None
            continue
        if not line.strip():
            continue
        if not jsonl:
            yield where, line
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise TLDynamicsError(
                f"{where}: not a JSON object (JSON lines need one object per "
                'line, e.g. {"text": "..."})'
            ) from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text:
            raise TLDynamicsError(f"{where}: no non-empty string 'text' field")
        yield where, text if _encodable(text) else None


def iter_prompts(prompts: Prompts) -> Iterator[str]:
    """The prompts of a corpus, lazily: a text file (one prompt per line; blank lines are
    skipped), JSON lines (``.jsonl``/``.ndjson``/``.json``: one object with a ``text`` field
    per line), or a sequence of strings. A line that is not UTF-8 is an error naming it."""
    for where, text in iter_records(prompts):
        if text is None:
            raise TLDynamicsError(_undecodable(where))
        yield text


def _undecodable(where: str) -> str:
    return (
        f"{where}: not valid UTF-8 text (or a lone surrogate); fix the line, or pass "
        "--on-bad-lines skip to leave such lines out"
    )


def count_prompts(prompts: Prompts) -> int:
    if isinstance(prompts, (str, os.PathLike)):
        return sum(1 for _ in iter_records(prompts))
    return len(prompts)


@dataclass
class PromptCheck:
    """Applies the ``on_long`` policy: ``n_tokens(text)`` counts a prompt's tokens (as the
    batch tokenizer does, BOS included) and ``n_ctx`` is the model's context."""

    policy: str
    n_ctx: int
    n_tokens: Callable[[str], int]
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_KEYS, 0))

    def __post_init__(self) -> None:
        if self.policy not in ON_LONG:
            raise TLDynamicsError(f"on_long {self.policy!r}: valid are {', '.join(ON_LONG)}")

    def _fits(self, text: str) -> bool:
        # a token covers at least one byte, so short texts need no tokenizing (+4: room for the
        # special tokens a tokenizer adds, BOS, CLS/SEP)
        return len(text.encode("utf-8")) + 4 <= self.n_ctx or self.n_tokens(text) <= self.n_ctx

    def __call__(self, where: str, text: str | None) -> str | None:
        """The text to use, or None when it is left out (counted)."""
        if text is None:
            if self.policy == "error":
                raise TLDynamicsError(_undecodable(where))
            self.counts["skipped_undecodable"] += 1
            return None
        if self._fits(text):
            return text
        if self.policy == "error":
            raise TLDynamicsError(
                f"{where}: the prompt has {self.n_tokens(text)} tokens but this model's context "
                f"is {self.n_ctx}; pass --on-bad-lines truncate (keep the first tokens that fit) or "
                "--on-bad-lines skip (leave such prompts out)"
            )
        if self.policy == "skip":
            self.counts["skipped_long"] += 1
            return None
        self.counts["truncated"] += 1
        return self._truncate(text)

    def _truncate(self, text: str) -> str:
        """The longest prefix (in characters) whose tokens fit the context."""
        lo, hi = 0, len(text)  # text[:lo] fits (or is empty), text[:hi] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.n_tokens(text[:mid]) <= self.n_ctx:
                lo = mid
            else:
                hi = mid
        if lo == 0:
            raise TLDynamicsError(
                "cannot truncate a prompt to this model's context: even its "
                "first character does not fit"
            )
        return text[:lo]

    def take(self) -> dict[str, int]:
        """The counts since the last ``take`` (and reset them)."""
        out, self.counts = self.counts, {key: 0 for key in SKIP_KEYS}
        return out


@overload
def batches(
    prompts: Prompts | Iterable[str], batch_size: int, check: None = None
) -> Iterator[tuple[int, list[str]]]: ...
@overload
def batches(
    prompts: Prompts | Iterable[str], batch_size: int, check: PromptCheck
) -> Iterator[tuple[int, list[str], dict[str, int]]]: ...
def batches(
    prompts: Prompts | Iterable[str], batch_size: int, check: PromptCheck | None = None
) -> Iterator[tuple[int, list[str]] | tuple[int, list[str], dict[str, int]]]:
    """``(index, prompts)`` for every batch of the corpus, in order; with ``check``,
    ``(index, prompts, counts)`` with what the policy left out or cut while filling the batch
    (trailing lines left out after the last full batch come as one batch without prompts)."""
    chunk: list[str] = []
    index = 0
    for where, text in iter_records(prompts):
        if check is None:
            if text is None:
                raise TLDynamicsError(_undecodable(where))
            chunk.append(text)
        else:
            kept = check(where, text)
            if kept is not None:
                chunk.append(kept)
        if len(chunk) == batch_size:
            yield (index, chunk) if check is None else (index, chunk, check.take())
            index, chunk = index + 1, []
    if check is None:
        if chunk:
            yield index, chunk
        return
    counts = check.take()
    if chunk or any(counts.values()):
        yield index, chunk, counts


def token_counter(adapter: Any) -> Callable[[str], int]:
    """Tokens of one prompt as the batch tokenizer makes them (BOS included)."""
    model = adapter.model

    def count(text: str) -> int:
        return int(model.to_tokens(text, truncate=False).shape[-1])

    return count
