"""A griffe extension for the API reference (mkdocs.yml): docstring examples render as code.

The docstrings write ``Example:`` (Google style's singular), or put ``>>>`` lines in the text
without a header; griffe's Google parser reads only ``Examples:`` as code, and would render the
others as Markdown (where ``[0.33, 0.67]`` looks like a cross-reference). This rewrites both to
an ``Examples:`` section before parsing. The docstrings themselves stay as they are (they run as
doctests).
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_HEADER = re.compile(r"^(\s*)Example:\s*$")
_SECTION = re.compile(r"^\s*[A-Z][A-Za-z ]*:\s*$")


def examples_as_sections(text: str) -> str:
    """``Example:`` headers as ``Examples:``, bare top-level ``>>>`` blocks under one."""
    lines = [_HEADER.sub(r"\1Examples:", line) for line in text.splitlines()]
    out: list[str] = []
    in_section = False
    bare = False
    for line in lines:
        if _SECTION.match(line) and not line.startswith(" "):
            in_section = True
        if not in_section and not bare and line.startswith(">>>"):
            if out and out[-1].strip():
                out.append("")
            out.append("Examples:")
            bare = True
        if bare:
            if not line.strip():
                bare = False
                out.append(line)
                continue
            out.append("    " + line)
            continue
        out.append(line)
    return "\n".join(out)


class ExamplesAsCode(Extension):
    """Rewrite each docstring's examples before griffe parses it."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = examples_as_sections(obj.docstring.value)
