"""Command-line values checked in one place (a bottom-layer module): every command's
``--threads``, positive counts and token ids give the same clear message."""

from __future__ import annotations

import os
import re
import logging
from pathlib import Path
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


# A head as ``tl-dynamics report --heads`` and ``tl-dynamics heads --heads`` write it.
HEAD = re.compile(r"^(?:L(\d+)H(\d+)|(\d+)\.(\d+))$", re.IGNORECASE)


def head_pairs(text: str) -> list[tuple[int, int]]:
    """``"L3H4,L5H1"`` or ``"3.4 5.1"`` as ``[(3, 4), (5, 1)]``; anything else names the part.

    >>> head_pairs("L3H4, 5.1")
    [(3, 4), (5, 1)]
    """
    heads = []
    for part in (p for p in re.split(r"[\s,]+", text.strip()) if p):
        match = HEAD.match(part)
        if not match:
            raise TLDynamicsError(
                f"--heads {part!r}: write a head as L<layer>H<head> or "
                "<layer>.<head>, e.g. L3H4 or 3.4"
            )
        a, b, c, d = match.groups()
        heads.append((int(a or c), int(b or d)))
    if not heads:
        raise TLDynamicsError("--heads is empty: e.g. --heads L3H4")
    return heads


def refuse_near_name(name: str, names: list[str], shipped: list[str]) -> None:
    """A model name a typo away from one of ``names`` (``induction_2l``) is an error naming the
    close one, before any hub attempt (which would print transformers' OSError about a
    repository); a name with ``/`` (a hub repository) is left alone.

    >>> refuse_near_name("gpt2", ["code-2l", "induction-2l"], ["code-2l"])
    >>> refuse_near_name("induction_2l", ["code-2l", "induction-2l"], ["code-2l", "induction-2l"])
    Traceback (most recent call last):
    ...
    tl_dynamics.errors.TLDynamicsError: model 'induction_2l' is not a shipped model, a folder or a tiny-random model: did you mean 'induction-2l'? (shipped: code-2l, induction-2l; a hub name is tried only when no shipped name is this close)
    """
    import difflib

    close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.8)
    if close and "/" not in name:
        raise TLDynamicsError(
            f"model {name!r} is not a shipped model, a folder or a tiny-random model: did you "
            f"mean {close[0]!r}? (shipped: {', '.join(shipped)}; a hub name is tried only when "
            "no shipped name is this close)"
        )


# What a file's suffix says it holds: an output whose suffix names another format is refused.
FORMATS = {
    ".html": "an HTML page",
    ".htm": "an HTML page",
    ".safetensors": "a safetensors file",
    ".json": "JSON",
    ".jsonl": "JSON lines",
    ".txt": "text",
    ".csv": "CSV",
    ".tsv": "TSV",
    ".md": "Markdown",
    ".png": "a PNG image",
    ".svg": "an SVG image",
    ".pdf": "a PDF",
    ".pt": "a torch pickle",
    ".pth": "a torch pickle",
    ".bin": "raw bytes",
    ".npy": "a NumPy array",
    ".npz": "NumPy arrays",
    ".pkl": "a pickle",
    ".parquet": "a Parquet table",
    ".ipynb": "a notebook",
    ".py": "Python source",
}


def check_suffix(path: str, wanted: tuple[str, ...], what: str = "--out") -> None:
    """Refuse an output path whose suffix names another format than the one written (a
    statistics file named ``s.json`` would hold safetensors bytes); no suffix, or one that
    names no format, is left alone.

    >>> check_suffix("page.html", (".html", ".htm"))
    >>> check_suffix("s.json", (".safetensors",))
    Traceback (most recent call last):
    ...
    tl_dynamics.errors.TLDynamicsError: --out 's.json': this writes a safetensors file, but the name says JSON; name it 's.safetensors'
    """
    suffix = os.path.splitext(path)[1]
    if suffix.lower() in wanted or suffix.lower() not in FORMATS:
        return
    raise TLDynamicsError(
        f"{what} {path!r}: this writes {FORMATS[wanted[0]]}, but the name says "
        f"{FORMATS[suffix.lower()]}; name it {path[: -len(suffix)] + wanted[0]!r}"
    )


def check_placement_text(device: str, dtype: str) -> None:
    """``--device`` and ``--dtype`` as text, before torch is imported (whether CUDA is there is
    asked after: ``tl_dynamics.devices.placement``)."""
    from tl_dynamics import devices

    text = str(device).strip()
    if text not in ("auto", "cpu") and not re.fullmatch(r"cuda(?::\d+)?", text):
        raise TLDynamicsError(
            f"--device {text!r}: valid are {', '.join(devices.DEVICE_CHOICES)} "
            "(N: a CUDA device index, from 0)"
        )
    if str(dtype).strip() not in devices.DTYPE_CHOICES:
        raise TLDynamicsError(f"--dtype {dtype!r}: valid are {', '.join(devices.DTYPE_CHOICES)}")


def check_corpus(text: str, what: str = "--prompts") -> None:
    """A corpus file that exists and holds at least one non-blank line (read until the first
    one), before the model loads: an empty corpus would write a 0-prompt file."""
    path = os.path.expanduser(text)
    hint = "give a text file, one prompt per line, or JSON lines with a 'text' field"
    if not os.path.isfile(path):
        raise TLDynamicsError(f"{what} {text!r} does not exist ({hint})")
    try:
        with open(path, "rb") as handle:
            if any(line.decode("utf-8", "replace").strip() for line in handle):
                return
    except OSError as exc:
        raise TLDynamicsError(f"{what} {text!r}: cannot be read ({exc.strerror or exc})") from None
    raise TLDynamicsError(f"{what} {text!r} holds no prompt: every line is blank ({hint})")


def prompt_texts(
    given: list[str] | None, file: str | None, default: str
) -> str | tuple[str, ...] | None:
    """The prompts of ``--prompt`` (repeatable) or ``--prompts FILE`` (one per line, blank lines
    skipped): one text, a tuple of several, or None (neither given: ``default`` is used). Read
    and checked before torch is imported; an empty prompt or file is an error naming it.

    Example:
        >>> prompt_texts(["a b"], None, "the default"), prompt_texts(["a", "b"], None, "")
        ('a b', ('a', 'b'))
    """
    texts: list[str] = []
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise TLDynamicsError(f"--prompts {file}: no such file (one prompt per line)")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise TLDynamicsError(f"--prompts {file}: cannot be read as UTF-8 text: {err}") from err
        texts = [line for line in lines if line.strip()]
        if not texts:
            raise TLDynamicsError(f"--prompts {file}: the file holds no prompt (one per line)")
    for text in given or ():
        if not text.strip():
            raise TLDynamicsError(
                f"--prompt is empty: give some text, or leave --prompt out for {default}"
            )
        texts.append(text)
    if not texts:
        return None
    return texts[0] if len(texts) == 1 else tuple(texts)
