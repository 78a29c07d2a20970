"""Count the public names whose docstring lacks what the API reference asks for (issue 25).

For every package face in ``FACES`` (its ``__all__``, or its public names where it has none)
and every public method or property of the classes it exports, it checks: a docstring with a
one-line summary; for callables taking parameters, an ``Args:`` section; for callables that
return something (annotation other than None), a ``Returns:`` (or ``Yields:``) section; a
``>>>`` example, and whether every example line is ``+SKIP``. Constants and type aliases cannot
carry a docstring of their own and are counted apart.

    python tools/docstring_coverage.py            # totals per face
    python tools/docstring_coverage.py --list     # every name and what it lacks
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import typing
from pathlib import Path
from typing import Any

FACES = (
    "adapter",
    "viz",
    "circuits",
    "odds_ratio",
    "contextual_mlp",
    "trajectories",
    "particles",
    "atlas",
    "scale",
    "sphere",
    "testing",
    "zoo",
)
CHECKS = ("docstring", "summary", "args", "returns", "example", "runnable example")


def _public(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and not inspect.ismodule(v)
        and getattr(v, "__module__", module.__name__).startswith(module.__name__)
    ]


def _params(obj: Any) -> list[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p not in ("self", "cls")]


def _returns_value(obj: Any) -> bool:
    try:
        ann = inspect.signature(obj).return_annotation
    except (TypeError, ValueError):
        return False
    return ann not in (inspect.Signature.empty, None, "None")


def lacks(obj: Any) -> list[str]:
    """What ``obj``'s docstring lacks, by ``CHECKS`` name."""
    doc = inspect.getdoc(obj) if not isinstance(obj, property) else obj.__doc__
    if not doc:
        return list(CHECKS)
    missing = []
    lines = doc.strip().splitlines()
    first = lines[0].strip()
    if not first or (len(lines) > 1 and lines[1].strip()):  # no blank line after one summary line
        missing.append("summary")
    func = obj.fget if isinstance(obj, property) else obj
    callable_ = inspect.isfunction(func) or inspect.ismethod(func) or inspect.isclass(func)
    if callable_ and not isinstance(obj, property):
        if _params(func) and "Args:" not in doc and "Attributes:" not in doc:
            missing.append("args")
        if (
            not inspect.isclass(func)
            and _returns_value(func)
            and not ("Returns:" in doc or "Yields:" in doc)
        ):
            missing.append("returns")
    examples = [line for line in doc.splitlines() if line.strip().startswith(">>>")]
    if not examples:
        missing += ["example", "runnable example"]
    elif all("+SKIP" in line for line in examples):
        missing.append("runnable example")
    return missing


def survey(faces: tuple[str, ...] = FACES) -> dict[str, dict[str, list[str]]]:
    """``{face: {qualified name: what it lacks}}`` over every public name and method."""
    out: dict[str, dict[str, list[str]]] = {}
    for face in faces:
        module = importlib.import_module(f"tl_dynamics.{face}")
        found: dict[str, list[str]] = {}
        for name in _public(module):
            obj = getattr(module, name)
            alias = typing.get_origin(obj) is not None  # Union[...] etc.: no docstring of its own
            if alias or not (inspect.isclass(obj) or inspect.isfunction(obj) or callable(obj)):
                found[name] = ["constant"]
                continue
            found[name] = lacks(obj)
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_") or not (
                        inspect.isfunction(member)
                        or isinstance(member, (property, classmethod, staticmethod))
                    ):
                        continue
                    member = (
                        member.__func__
                        if isinstance(member, (classmethod, staticmethod))
                        else member
                    )
                    found[f"{name}.{attr}"] = lacks(member)
        out[face] = found
    return out


def missing(faces: tuple[str, ...] = FACES) -> dict[str, list[str]]:
    """``{"face.name": what it lacks}`` for every name that lacks something (constants aside)."""
    return {
        f"{face}.{name}": what
        for face, found in survey(faces).items()
        for name, what in found.items()
        if what and what != ["constant"]
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="every name and what it lacks")
    args = parser.parse_args(argv)
    result = survey()
    header = f"{'face':<15}{'names':>6}{'const':>6}" + "".join(f"{c[:12]:>14}" for c in CHECKS)
    print(header)
    totals = dict.fromkeys(("names", "constant") + CHECKS, 0)
    for face, found in result.items():
        counts = {c: sum(c in v for v in found.values()) for c in ("constant",) + CHECKS}
        n = len(found)
        totals["names"] += n
        for c, v in counts.items():
            totals[c] += v
        print(
            f"{face:<15}{n:>6}{counts['constant']:>6}" + "".join(f"{counts[c]:>14}" for c in CHECKS)
        )
        if args.list:
            for name, what in found.items():
                if what and what != ["constant"]:
                    print(f"    {name}: lacks {', '.join(what)}")
    print(
        f"{'total':<15}{totals['names']:>6}{totals['constant']:>6}"
        + "".join(f"{totals[c]:>14}" for c in CHECKS)
    )
    print(
        "(columns after 'const': names lacking that; methods and properties of exported "
        "classes included)"
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tl_dynamics
    sys.exit(main())
