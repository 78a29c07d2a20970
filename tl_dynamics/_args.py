"""Command-line values checked in one place (a bottom-layer module): every command's
``--threads``, positive counts and token ids give the same clear message."""

from __future__ import annotations

import os
import re
import logging
from typing import Literal, overload

from tl_dynamics.errors import TLDynamicsError


def cores() -> int:
    return os.cpu_count() or 1


@overload
def threads_arg(text: str, allow_auto: Literal[False] = False) -> int: ...
@overload
def threads_arg(text: str, allow_auto: bool) -> int | str: ...
def threads_arg(text: str, allow_auto: bool = False) -> int | str:
    """``--threads``: a positive integer (a warning above the machine's cores: more threads
    than cores only slows torch down), or ``auto`` where allowed."""
    text = str(text).strip()
    if allow_auto and text == "auto":
        return "auto"
    if not text.isdigit() or int(text) < 1:
        valid = "a positive integer or 'auto'" if allow_auto else "a positive integer"
        raise TLDynamicsError(
            f"--threads {text!r}: give {valid} (this machine has {cores()} cores)"
        )
    n = int(text)
    if n > cores():
        logging.getLogger("tl_dynamics").warning(
            "tl-dynamics: warning: --threads %d is more than this machine's %d cores; torch runs "
            "slower with more threads than cores",
            n,
            cores(),
        )
    return n


@overload
def positive_arg(value: int, what: str) -> int: ...
@overload
def positive_arg(value: None, what: str) -> None: ...
def positive_arg(value: int | None, what: str) -> int | None:
    """A count option that must be positive when given (no silent fallback to a default)."""
    if value is not None and value < 1:
        raise TLDynamicsError(
            f"{what} {value}: give a positive integer (or leave {what} out for the default)"
        )
    return value


def token_ids(text: str, what: str = "--prompt-ids") -> list[int]:
    """Token ids separated by spaces or commas (each checked against the vocabulary later)."""
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if not parts or not all(p.isascii() and p.isdigit() for p in parts):
        raise TLDynamicsError(
            f"{what} {text!r}: expected non-negative integers separated by "
            'spaces or commas, e.g. "0 3 11"'
        )
    return [int(p) for p in parts]


def check_vocab(ids: list[int], d_vocab: int, what: str = "--prompt-ids") -> list[int]:
    """Refuse ids outside ``0..d_vocab-1`` by value, before any work."""
    bad = [i for i in ids if not 0 <= i < d_vocab]
    if bad:
        shown = ", ".join(str(i) for i in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise TLDynamicsError(
            f"{what}: token ids {shown} are outside this model's vocabulary "
            f"(valid: 0..{d_vocab - 1})"
        )
    return ids
