"""What a statistics file was computed from, as hashes that merge like the statistics: the
prompts (``prompt_hash``, order-free), the prompts in their batches and order (``batch_hash``),
and the model's fingerprints compared by name (``fingerprint_changes``)."""

from __future__ import annotations

import hashlib
from typing import Iterable

__all__ = ["FINGERPRINTS", "batch_hash", "fingerprint_changes", "prompt_hash"]

_HASH_MOD = 1 << 256
FINGERPRINTS = ("weights", "config", "tokenizer")


def prompt_hash(prompts: Iterable[str], start: int = 0) -> int:
    """Order-independent hash of a list of prompts: the sum of their SHA-256 modulo 2**256,
    so the hash of a corpus is the sum of the hashes of its shards."""
    total = start
    for text in prompts:
        total += int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest(), "big")
    return total % _HASH_MOD


def batch_hash(texts: Iterable[str], start: int = 0) -> int:
    """``start`` plus the SHA-256 of one batch's prompts in their order (each length-prefixed),
    modulo 2**256: the sum over a run's batches is its ``batches_hash``.

    What decides the bits of the statistics is which prompts form each batch, in which order
    (each batch is padded to its longest prompt and its float totals summed in row order);
    which batch is summed first is not (the sums across batches are exact). So the sum over
    batches changes with any reordering that changes a number, and merges like the statistics.

    Example:
        >>> batch_hash(["a", "b"]) == batch_hash(["b", "a"]), prompt_hash(["a", "b"]) == prompt_hash(["b", "a"])
        (False, True)
    """
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return (start + int.from_bytes(digest.digest(), "big")) % _HASH_MOD


def fingerprint_changes(mine: dict[str, str] | None, theirs: dict[str, str] | None) -> list[str]:
    """The fingerprints that differ, in words (``the model's weights``, ...)."""
    words = {
        "weights": "the model's weights",
        "config": "the model's configuration",
        "tokenizer": "the tokenizer",
    }
    if mine is None or theirs is None:
        return [] if mine is theirs else ["fingerprints (one side has none)"]
    return [
        f"{words[k]} (fingerprint {mine[k][:12]}... vs {theirs[k][:12]}...)"
        for k in FINGERPRINTS
        if mine.get(k) != theirs.get(k)
    ]
