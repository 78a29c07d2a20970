"""Docstrings (issue 25 item 1): every example runs, and the finished faces document every name.

Every module under ``tl_dynamics/`` runs its ``>>>`` examples as doctests, one test per module;
an example that needs a GPU or the network carries ``+SKIP`` on those lines only. Modules that
need an optional dependency that is not installed (e.g. ray, sae-lens) are skipped by name with
the reason, never silently; ``tl_dynamics.__main__`` (it runs the CLI when imported) is
the one module left out. ``COMPLETE_FACES`` lists the faces whose every public name and every
public method of an exported class has a summary line, ``Args:`` and ``Returns:`` where they
apply, and a runnable example (``tools/docstring_coverage.py``); a face joins by one line.
"""

import doctest
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import tl_dynamics
from tl_dynamics.errors import TLDynamicsError

ROOT = Path(__file__).resolve().parents[1]
COMPLETE_FACES = (
    "adapter",
    "viz",
    "sphere",
    "testing",
    "zoo",
    "scale",
    "circuits",
    "odds_ratio",
    "contextual_mlp",
    "trajectories",
    "particles",
    "atlas",
)
# module -> the optional dependency it imports at module level (skipped with this reason if absent)
OPTIONAL = {"tl_dynamics.scale._ray": "ray"}
# how ``ray_stats(ray_address="local")`` says a loaded machine could not start its cluster
RAY_COULD_NOT_START = "Ray could not start a local cluster"

# ``python -m tl_dynamics`` runs the CLI when imported; it has no docstring to run
SCRIPTS = {"tl_dynamics.__main__"}
MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(tl_dynamics.__path__, "tl_dynamics.")
    if info.name not in SCRIPTS
)


def _import(name: str):
    dependency = OPTIONAL.get(name)
    if dependency is not None:
        pytest.importorskip(dependency, reason=f"{name} needs the optional {dependency}")
    return importlib.import_module(name)


class _Runner(doctest.DocTestRunner):
    """A doctest runner that keeps the exceptions examples raised."""

    def __init__(self, **options):
        super().__init__(**options)
        self.raised: list[BaseException] = []

    def report_unexpected_exception(self, out, test, example, exc_info):
        self.raised.append(exc_info[1])
        super().report_unexpected_exception(out, test, example, exc_info)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = _import(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = _Runner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        runner.run(test)
    for exc in runner.raised:  # a machine too busy to start Ray: said, never a failure
        if isinstance(exc, TLDynamicsError) and str(exc).startswith(RAY_COULD_NOT_START):
            pytest.skip(str(exc))
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_the_module_list_is_the_package():
    """walk_packages found every module file (none hidden by a failed import)."""
    files = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "tl_dynamics").rglob("*.py")
    }
    assert files == set(MODULES) | SCRIPTS | {"tl_dynamics"}


def test_complete_faces_document_every_public_name():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        coverage = importlib.import_module("docstring_coverage")
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert coverage.missing(COMPLETE_FACES) == {}
