"""Results are notebook objects (issue 42 item 5): every result class shares ``viz.Result``, so
a bare result at the end of a cell renders a summary table and its view, its ``repr`` is a few
lines (not the arrays), and no ``to_dataframe()`` column shadows a DataFrame attribute
(``df.head`` must stay the method). Also: every public subpackage is an attribute of
``tl_dynamics`` and listed by ``dir(tl_dynamics)``.

Cost: one of each result on the tiny random GPT-2, about 15 s on a loaded 2-core machine.
"""

import ast
import importlib
import pkgutil
from pathlib import Path

import pandas as pd
import pytest
import torch

import tl_dynamics
from tl_dynamics import (
    atlas,
    circuits,
    contextual_mlp,
    odds_ratio,
    particles,
    qk_attribution,
    regression,
    testing,
    trajectories,
    viz,
)

PACKAGE = Path(tl_dynamics.__file__).parent
PROMPT = "a = b + c\nd = a"
# what a column must not be called: a public DataFrame attribute (df.head, df.index, df.T, ...)
SHADOWED = {name for name in dir(pd.DataFrame) if not name.startswith("_")}


def result_classes() -> list[tuple[str, str]]:
    """``(module, class)`` of every class in tl_dynamics with ``show`` or ``to_dataframe``
    (read from the source: a new result class is found without a list to update)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "viz":  # the views themselves (Component, Group)
            continue
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
                if methods & {"show", "to_dataframe"}:
                    found.append((module.removesuffix(".__init__"), node.name))
    return found


@pytest.mark.parametrize("module, name", result_classes())
def test_every_result_class_is_a_notebook_result(module, name):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, viz.Result), f"{module}.{name} does not list viz.Result in its bases"
    assert callable(getattr(cls, "_repr_html_", None))


@pytest.fixture(scope="module")
def results():
    """One of each result, on the tiny random GPT-2 (2 layers, 4 heads)."""
    torch.manual_seed(0)
    model = testing.cached_model("gpt2")
    qk = circuits.qk_circuit(model, 1, 0)
    mlps = contextual_mlp.compute(model, PROMPT, layers=1, heads=0)
    mlp = mlps[1, 0]
    odds = odds_ratio.compute(model, PROMPT, layers=0)
    traj = trajectories.compute(model, PROMPT)
    gen = torch.Generator().manual_seed(0)
    return {
        "HeadAtlas": atlas.compute(model, n_seq=2, seq_len=6),
        "CircuitsOverview": circuits.compute(model, PROMPT, layers=1, heads=0, n_samples=10),
        "Circuit": qk,
        "TokenTopK": qk.topk(3, rows=[0, 1, 2]),
        "CompositionScores": circuits.composition_scores(model, n_samples=10),
        "OffsetSummary": circuits.offset_summary(testing.cached_model("llama"), 1, 0, range(4)),
        "PromptCircuit": circuits.prompt_circuit(model, PROMPT, 1, 0),
        "HeadScores": circuits.copying_scores(model),
        "TokenComposition": circuits.token_composition(model, "K", (1, 0), [(0, 0)], rows=[0, 1]),
        "ContextualMLPs": mlps,
        "ContextualMLP": mlp,
        "Neurons": mlp.neurons(3),
        "Evaluation": mlp.evaluate(mlp.x[3], 3),
        "Exactness": mlp.exactness(),
        "Readout": mlp.written_tokens(contextual_mlp_adapter(model), 3, k=3),
        "Growth": contextual_mlp.generate_growth(model, PROMPT, 1, 0, max_new_tokens=2),
        "OddsRatioResult": odds,
        "Decomposition": odds[0],
        "HeadStats": odds.stats,
        "LabelEvidence": odds.stats.label_evidence(),
        "QKAttribution": qk_attribution.compute(model, PROMPT, layers=1, heads=0),
        "PairAttribution": qk_attribution.pair(model, PROMPT, 1, 0, dest=3, src=1),
        "PromptSummary": qk_attribution.over_prompts(
            model, ["a b a b", "c d c d", "e f e f"], 1, heads=0, n_boot=20
        ),
        "EdgeExplanation": qk_attribution.explain(model, PROMPT, 1, 0, dest=3),
        "ChainShapes": qk_attribution.chains(
            model, ["a b a b", "c d c d"], 1, 0, positions=None, n_boot=20
        ),
        "BarycentricView": odds_ratio.barycentric(model, PROMPT, 0, 0),
        "ChainSummary": odds_ratio.markov(model, PROMPT, 0, 0),
        "BesideModel": particles.compute(model, "a b c d e f", layers=0, heads=0),
        "ParticleRun": particles.simulate(particles.random_init(2, 6, 2, gen), t_max=2.0),
        "PhaseDiagram": particles.phase_diagram([1.0], [0.0, 1.0], n=4, runs=2, generator=gen),
        "RegressionResult": regression.compute(model, "a b c d e f g h", layers=0),
        "Trajectory": traj,
        "TrajectoryStats": traj.stats,
        "JacobianSpectrum": trajectories.block_jacobian(model, PROMPT, 0, k=2),
        "ClassProbe": trajectories.class_probe(
            model,
            ["x = 1", "y = 2", "z = 3", "def f():", "def g():", "def h():"],
            [0] * 3 + [1] * 3,
        ),
    }


def contextual_mlp_adapter(model):
    from tl_dynamics.adapter import ModelAdapter

    return ModelAdapter.of(model)


def test_the_fixture_holds_every_public_result_class(results):
    built = {type(r).__name__ for r in results.values()}
    public = {n for _, n in result_classes()} - {"MLPReadouts", "RunTables"}  # bases, built above
    assert public <= built, sorted(public - built)


def test_a_repr_is_a_few_lines_and_never_the_arrays(results):
    for name, result in results.items():
        text = repr(result)
        assert len(text.splitlines()) <= 20, (name, text)
        assert len(text) <= 2000 and "tensor(" not in text and "array(" not in text, (name, text)


def test_a_bare_result_renders_a_summary_table_and_its_view(results):
    for name, result in results.items():
        html = result._repr_html_()
        assert "<table" in html, name  # the summary
        if hasattr(result, "show"):
            view = result.show()
            inner = view.components if isinstance(view, viz.Group) else [view]
            assert all(c.html in html for c in inner if isinstance(c, viz.Component)), name


def test_no_dataframe_column_shadows_a_dataframe_attribute(results):
    for name, result in results.items():
        if not hasattr(result, "to_dataframe"):
            continue
        frame = result.to_dataframe()
        names = set(frame.columns) | {n for n in frame.index.names if n}
        assert not names & SHADOWED, (name, sorted(names & SHADOWED))
    frame = results["HeadAtlas"].to_dataframe()
    assert callable(frame.head) and len(frame[frame.head_index == 0]) == 2  # 2 layers


def test_every_public_subpackage_is_an_attribute_and_listed():
    public = {
        m.name for m in pkgutil.iter_modules(tl_dynamics.__path__) if not m.name.startswith("_")
    }
    assert {"regression", "sphere", "atlas", "viz"} <= public
    listed = set(dir(tl_dynamics))
    for name in sorted(public):
        assert name in listed, name
        assert getattr(tl_dynamics, name) is importlib.import_module(f"tl_dynamics.{name}")
    with pytest.raises(AttributeError, match="has no attribute 'bogus'"):
        tl_dynamics.bogus  # noqa: B018


def test_a_row_of_a_later_pass_points_to_forward_pass():
    model = testing.cached_model("gpt2")
    with contextual_mlp.attach(model, layers=1, heads=0) as collector:
        model("a = b")
        model("c = d")
    with pytest.raises(
        tl_dynamics.TLDynamicsError,
        match=r"row 1 was not collected in forward pass 0; its rows: \[0\]; 2 forward passes "
        r"were collected, each its own rows: pick one with forward_pass= \(0..1\), e.g. "
        r"result\(row=0, forward_pass=1\)",
    ):
        collector.result(row=1)
    assert collector.result(row=0, forward_pass=1).keys() == [(1, 0)]


def test_progress_bars_in_a_kernel_without_ipywidgets_do_not_warn():
    """tqdm.auto in a Jupyter kernel (``ipykernel.zmqshell`` loaded) without ipywidgets warns
    "IProgress not found" at its first import; after ``import tl_dynamics`` it does not. The
    control, without it, does (checked in a fresh interpreter each: the import is cached)."""
    import importlib.util
    import subprocess
    import sys

    pytest.importorskip("ipykernel", reason="a Jupyter kernel is part of the test extra")
    if importlib.util.find_spec("ipywidgets") is not None:
        pytest.skip("ipywidgets is installed: tqdm.auto draws widgets and has nothing to warn")

    def warned(first: str) -> str:
        script = (
            "import warnings\nimport ipykernel.zmqshell\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            f"    {first}\n"
            "    from tqdm.auto import tqdm\n"
            "    sum(tqdm(range(3), disable=True))\n"
            "print([str(w.message) for w in caught])\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
            cwd=PACKAGE.parent,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "IProgress not found" in warned("pass")  # the control: the warning is real
    assert "IProgress not found" not in warned("import tl_dynamics")
