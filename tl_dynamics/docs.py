"""The maths reference, ``docs/math.md``, wherever tl_dynamics is installed.

``docs/math.md`` in the repository is the one source: a wheel carries a copy made when it is
built (``setup.py`` copies it into the package's ``data`` folder), and a checkout reads the file
itself. Code, notebooks and report pages cite it as "docs/math.md §N" or "§N.M"; report pages
carry the sections they cite (``viz.Page``), and in a notebook ``docs.math("2.3")`` shows one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Union

from tl_dynamics.errors import TLDynamicsError

CHECKOUT = Path(__file__).resolve().parent.parent / "docs" / "math.md"
PACKAGED = Path(__file__).resolve().parent / "data" / CHECKOUT.name  # the wheel's copy
CITATION = re.compile(r"§\s?(\d+(?:\.\d+)?)")  # "§2" or "§2.3", as tests/test_math_doc.py reads
_HEADING = re.compile(r"^(##|###) (\d+(?:\.\d+)?)\.? (.+)$", re.MULTILINE)

__all__ = ["MathText", "math"]


class MathText(str):
    """Markdown text that a notebook displays as rendered markdown (a ``str`` otherwise)."""

    def _repr_markdown_(self) -> str:
        return str(self)


@dataclass(frozen=True)
class Section:
    """One numbered part of the reference: ``number`` ("2" or "2.3"), ``title``, and ``text``,
    its markdown from its heading up to the next heading of the same or a higher level."""

    number: str
    title: str
    text: str


def source() -> Path:
    """The file read: the wheel's copy when installed, else the checkout's ``docs/math.md``."""
    for path in (PACKAGED, CHECKOUT):
        if path.is_file():
            return path
    raise TLDynamicsError(
        f"docs/math.md is not installed: neither {PACKAGED} nor {CHECKOUT} "
        "exists (reinstall tl-dynamics)"
    )


@lru_cache(maxsize=4)
def _read(path: Path, stamp: float) -> str:
    return path.read_text(encoding="utf-8")


def text() -> str:
    """The whole reference as markdown."""
    path = source()
    return _read(path, path.stat().st_mtime)


def sections() -> dict[str, Section]:
    """Every numbered section and subsection by number, in order.

    Example:
        >>> parts = sections()
        >>> parts["2.3"].title, parts["2"].text.startswith("## 2. ")
        ('Sink statistics', True)
    """
    body = text()
    heads = list(_HEADING.finditer(body))
    out = {}
    for i, head in enumerate(heads):
        level = len(head.group(1))
        end = next((h.start() for h in heads[i + 1 :] if len(h.group(1)) <= level), len(body))
        out[head.group(2)] = Section(
            head.group(2), head.group(3).strip(), body[head.start() : end].rstrip() + "\n"
        )
    return out


def cited(text: str) -> list[str]:
    """The section numbers ``text`` cites ("§2", "§2.3"), in order of first citation."""
    return list(dict.fromkeys(m.group(1) for m in CITATION.finditer(text)))


def math(section: Union[str, int, float, None] = None) -> MathText:
    """``docs/math.md``, or one section of it (``"2"``, ``"2.3"``, ``"§2.3"``, ``2``), as
    markdown; a notebook renders it.

    Example:
        >>> from tl_dynamics import docs
        >>> docs.math("2.3").splitlines()[0]
        '### 2.3 Sink statistics'
        >>> docs.math("sinks")                                         # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        tl_dynamics.errors.TLDynamicsError: docs/math.md has no §sinks; valid: 1, 2, ...
    """
    if section is None:
        return MathText(text())
    key = str(section).strip().lstrip("§").strip()
    parts = sections()
    if key not in parts:
        tops = [n for n in parts if "." not in n]
        raise TLDynamicsError(
            f"docs/math.md has no §{key}; valid: {', '.join(tops)} and their "
            "numbered subsections, e.g. '2.3'"
        )
    return MathText(parts[key].text)
