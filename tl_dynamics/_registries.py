"""The registries the command line's help and first checks read, without importing torch.

``report --sections`` takes the names of ``tl_dynamics.report.SECTIONS``; ``stats --analyses``
and ``--on-bad-lines`` take ``DatasetStats.ANALYSES`` and ``DatasetStats.ON_LONG``; ``--eps``
defaults to ``sphere.TRAJECTORY_EPS_GRID``. Importing those modules costs torch and
TransformerLens (seconds), so each value is read from its module's source (``ast``: the
registry as written, never a copy of it) and, should the source no longer say it in that
form, from the imported module itself (slower, never wrong). tests/test_cli_help.py holds each
reading to the imported value.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Any, Callable

PACKAGE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def _tree(relative: str) -> ast.Module | None:
    try:
        return ast.parse((PACKAGE / relative).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _assigned(tree: ast.Module, name: str) -> ast.expr | None:
    """The value assigned to module-level ``name`` (``NAME = ...`` or ``NAME: T = ...``)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id == name and node.value is not None:
                return node.value
    return None


def literal(relative: str, name: str, imported: Callable[[], Any]) -> tuple[Any, ...]:
    """The literal tuple ``name`` of the module at ``relative`` (under tl_dynamics/), or
    ``imported()`` where the source does not hold it as a literal."""
    tree = _tree(relative)
    value = None if tree is None else _assigned(tree, name)
    try:
        found = ast.literal_eval(value) if value is not None else None
    except ValueError:
        found = None
    return tuple(found) if isinstance(found, (tuple, list)) else tuple(imported())


def _imported_sections() -> tuple[str, ...]:
    from tl_dynamics import report

    return tuple(analysis.name for analysis in report.SECTIONS)


def _sections_from_source() -> tuple[str, ...] | None:
    """``report.SECTIONS`` as written: each entry a class made by
    ``_registered(<analysis package>, ...)``, named after the package."""
    tree = _tree("report.py")
    value = None if tree is None else _assigned(tree, "SECTIONS")
    if tree is None or not isinstance(value, (ast.Tuple, ast.List)):
        return None
    packages: dict[str, str] = {}  # local name -> tl_dynamics subpackage
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "tl_dynamics" and not node.level:
            packages.update({a.asname or a.name: a.name for a in node.names})
    made: dict[str, str] = {}  # class name -> section name
    for node in tree.body:
        call = node.value if isinstance(node, ast.Assign) else None
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "_registered"
            and call.args
            and isinstance(call.args[0], ast.Name)
            and call.args[0].id in packages
        ):
            for target in node.targets:  # type: ignore[union-attr]
                if isinstance(target, ast.Name):
                    made[target.id] = packages[call.args[0].id]
    names = [made.get(e.id) if isinstance(e, ast.Name) else None for e in value.elts]
    return None if not names or None in names else tuple(n for n in names if n)


def section_names() -> tuple[str, ...]:
    """The names of ``tl_dynamics.report.SECTIONS``, in page order."""
    return _sections_from_source() or _imported_sections()


def _stats_class() -> Any:
    from tl_dynamics.scale import DatasetStats

    return DatasetStats


def stats_analyses() -> tuple[str, ...]:
    """``DatasetStats.ANALYSES``: what ``tl-dynamics stats --analyses`` takes."""
    return literal("scale/_validate.py", "ANALYSES", lambda: _stats_class().ANALYSES)


def bad_line_policies() -> tuple[str, ...]:
    """``DatasetStats.ON_LONG``: what ``tl-dynamics stats --on-bad-lines`` takes."""
    return literal("scale/_corpus.py", "ON_LONG", lambda: _stats_class().ON_LONG)


def eps_grid() -> tuple[float, ...]:
    """``sphere.TRAJECTORY_EPS_GRID``: the default ``--eps`` of ``tl-dynamics stats``."""

    def imported() -> tuple[float, ...]:
        from tl_dynamics import sphere

        return sphere.TRAJECTORY_EPS_GRID

    return literal("sphere.py", "TRAJECTORY_EPS_GRID", imported)
