"""The analysis contract (docs/developing.md), checked on every analysis package: ``compute`` and
``report_section`` exported, ``layers``/``heads`` keyword parameters, frozen results that show
themselves as ``viz`` components and tabulate as DataFrames, ``attach`` collectors whose
``result()`` has ``compute``'s type, and imports that respect package boundaries (no private
module or name of another package, no import circle inside a package)."""

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pandas as pd
import pytest

from helpers import adapter_for
from tl_dynamics import testing, viz

ANALYSES = [
    "circuits",
    "odds_ratio",
    "contextual_mlp",
    "trajectories",
    "particles",
    "qk_attribution",
]
ROOT = Path(__file__).resolve().parents[1] / "tl_dynamics"
# Analyses of the residual stream (not of attention heads) take ``layers`` only; docs/developing.md.
RESIDUAL_STREAM = {"trajectories"}
# A small selection keeps the runs cheap: layer 1 of the 2-layer tiny GPT-2, heads 0 and 1.
SELECTION = {"layers": 1, "heads": [0, 1]}


def package(name):
    return importlib.import_module(f"tl_dynamics.{name}")


def compute_kwargs(fn):
    """The selection, for the parameters ``fn`` has (so a missing one fails only its own test)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in SELECTION.items() if k in params}


@pytest.fixture(scope="module")
def tiny():
    adapter = adapter_for("gpt2")
    return adapter, adapter.tokenize(testing.PROMPTS[0])


@pytest.mark.parametrize("name", ANALYSES)
def test_exports_compute_and_report_section(name):
    pkg = package(name)
    for fn in ("compute", "report_section"):
        assert callable(getattr(pkg, fn, None)), f"tl_dynamics.{name} exports no callable {fn}"
        assert fn in pkg.__all__, f"tl_dynamics.{name}.__all__ lacks {fn}"
    assert list(pkg.__all__) == sorted(pkg.__all__), f"tl_dynamics.{name}.__all__ is not sorted"


@pytest.mark.parametrize("name", ANALYSES)
def test_compute_and_attach_take_layers_and_heads_as_keywords(name):
    pkg = package(name)
    for fn in ("compute", "attach"):
        if fn == "attach" and not hasattr(pkg, "attach"):
            continue
        params = inspect.signature(getattr(pkg, fn)).parameters
        keys = ("layers",) if name in RESIDUAL_STREAM else ("layers", "heads")
        if name in RESIDUAL_STREAM:
            assert "heads" not in params, f"tl_dynamics.{name}.{fn} reads no heads: drop 'heads'"
        for key in keys:
            assert key in params and params[key].kind is inspect.Parameter.KEYWORD_ONLY, (
                f"tl_dynamics.{name}.{fn} has no keyword-only parameter {key!r}: {list(params)}"
            )
            assert params[key].default is None, (
                f"tl_dynamics.{name}.{fn}: {key} must default to None"
            )


@pytest.mark.parametrize("name", ANALYSES)
def test_results_are_frozen_and_show_and_tabulate_themselves(name, tiny):
    adapter, batch = tiny
    compute = package(name).compute
    result = compute(adapter, batch, **compute_kwargs(compute))
    assert dataclasses.is_dataclass(result) and result.__dataclass_params__.frozen, (
        f"tl_dynamics.{name}.compute returns {type(result).__name__}, not a frozen dataclass"
    )
    shown = result.show()
    assert isinstance(shown, (viz.Component, viz.Group)), (
        f"{type(result).__name__}.show() returns {type(shown).__name__}, not a viz component"
    )
    table = result.to_dataframe()
    assert isinstance(table, pd.DataFrame) and len(table) > 0


@pytest.mark.parametrize("name", [n for n in ANALYSES if n != "circuits"])  # circuits reads weights
def test_attach_collects_the_same_result_type_as_compute(name, tiny):
    adapter, batch = tiny
    pkg = package(name)
    if not hasattr(pkg, "attach"):
        pytest.skip(f"tl_dynamics.{name} does not stream (no attach)")
    expected = type(pkg.compute(adapter, batch, **compute_kwargs(pkg.compute)))
    with pkg.attach(adapter, **compute_kwargs(pkg.attach)) as collector:
        adapter.forward(batch)
    assert type(collector.result()) is expected


# ------------------------------------------------------------------ import boundaries
def modules():
    """``{dotted name: path}`` of every module of tl_dynamics (a package by its ``__init__``)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = modules()


def imported(name, path):
    """``(module, imported name or None)`` for every import of tl_dynamics in the module,
    relative imports resolved; lazy and TYPE_CHECKING imports count too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((full, None) if full in MODULES else (base, alias.name))
        elif isinstance(node, ast.Import):
            out.extend((alias.name, None) for alias in node.names)
    return [(m, n) for m, n in out if m.split(".")[0] == "tl_dynamics"]


def owner(module):
    """The package a module belongs to (``tl_dynamics.odds_ratio._collect`` -> ``tl_dynamics.odds_ratio``)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def private_part(module):
    return next((p for p in module.split(".") if p.startswith("_") and p != "__main__"), None)


@pytest.mark.parametrize("name", ANALYSES)
def test_no_module_imports_a_private_module_or_name_of_another_package(name):
    mine = f"tl_dynamics.{name}"
    bad = []
    for module, path in MODULES.items():
        if owner(module) != mine:
            continue
        for target, alias in imported(module, path):
            if owner(target) == mine:
                continue
            if private_part(target) or (alias is not None and alias.startswith("_")):
                bad.append(f"{module} -> {target}{'' if alias is None else ' import ' + alias}")
    assert not bad, "private imports across packages:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", ANALYSES)
def test_no_import_circle_inside_the_package(name):
    mine = f"tl_dynamics.{name}"
    graph = {
        m: {t for t, _ in imported(m, p) if owner(t) == mine and t != m and t != mine}
        for m, p in MODULES.items()
        if owner(m) == mine and m != mine
    }

    def reaches(start, goal, seen):
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)):
                return True
        return False

    circles = sorted(m for m in graph if reaches(m, m, set()))
    assert not circles, f"modules of {mine} on an import circle: {circles}"
