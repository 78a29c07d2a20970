"""The package faces' public surface (issue 25 item 5): every exported name is a decision.

A name added to or removed from a face's ``__all__`` must be added to or removed from ``SURFACE``
here, on purpose. Each exported name exists and is documented, ``__all__`` is sorted, and the
faces together export at most ``MAX_NAMES`` names.
"""

import importlib
import typing

import pytest

MAX_NAMES = 112  # 93 + regression's three (issue 32) + zoo.untrained and zoo.regression_sequences (its notebook) + viz.Result (issue 42: every result's notebook face) + qk_attribution's six and adapter.ResidualSplit (issue 41) + qk_attribution's explain, chains, their two results and QKCollector (the atlas reads marginals with it), viz.arc_diagram (issues 46, 50)
SURFACE = {
    "adapter": (
        "Batch",
        "LayerAttention",
        "LayerState",
        "ModelAdapter",
        "Prompt",
        "QueryNorm",
        "ResidualSplit",
        "Rotation",
        "masked_softmax",
        "shuffled_weights",
    ),
    "atlas": ("HeadAtlas", "compute", "report_section"),
    "circuits": (
        "CircuitsOverview",
        "composition_scores",
        "compute",
        "copying_scores",
        "offset_summary",
        "ov_circuit",
        "prompt_circuit",
        "qk_circuit",
        "qk_positivity_scores",
        "report_section",
        "token_composition",
    ),
    "collect": ("Analysis", "Collector", "ExactSum", "to_host", "torch_threads"),
    "contextual_mlp": (
        "ContextualMLP",
        "ContextualMLPs",
        "attach",
        "compute",
        "compute_rows",
        "generate_growth",
        "report_section",
    ),
    "odds_ratio": (
        "HeadStats",
        "OddsRatioResult",
        "attach",
        "barycentric",
        "composed",
        "compute",
        "counterfactual_patterns",
        "markov",
        "report_section",
        "sink_facts",
        "split_scores",
    ),
    "particles": (
        "BesideModel",
        "ParticleRun",
        "compute",
        "from_head",
        "phase_diagram",
        "phase_figure",
        "random_init",
        "report_section",
        "simulate",
    ),
    "scale": (
        "DatasetStats",
        "load_stats",
        "merge_stats",
        "ray_stats",
        "run_stats",
        "save_stats",
        "stats_page",
    ),
    "qk_attribution": (
        "ChainShapes",
        "EdgeExplanation",
        "QKAttribution",
        "QKCollector",
        "attach",
        "chains",
        "compute",
        "explain",
        "over_prompts",
        "pair",
        "report_section",
    ),
    "regression": ("RegressionResult", "compute", "report_section"),
    "trajectories": (
        "Trajectory",
        "TrajectoryStats",
        "attach",
        "block_jacobian",
        "class_probe",
        "compute",
        "report_section",
        "stream",
    ),
    "viz": (
        "Component",
        "Group",
        "Page",
        "Result",
        "arc_diagram",
        "attention_grid",
        "attention_heads",
        "attention_pattern",
        "colored_tokens",
        "colored_tokens_multi",
        "figure",
        "group",
        "heatmap",
        "html_escape",
        "line_plot",
        "notebook_bundle",
        "small_multiples",
        "table",
        "text",
        "text_neuron_activations",
        "topk_tokens",
        "visible_token",
    ),
    "zoo": ("export_gpt2", "load", "names", "regression_sequences", "untrained"),
}


@pytest.mark.parametrize("face", sorted(SURFACE))
def test_each_face_exports_exactly_its_pinned_names(face):
    module = importlib.import_module(f"tl_dynamics.{face}")
    assert tuple(module.__all__) == SURFACE[face]
    assert list(module.__all__) == sorted(module.__all__), f"{face}.__all__ is not sorted"


@pytest.mark.parametrize("face", sorted(SURFACE))
def test_every_exported_name_exists_and_is_documented(face):
    module = importlib.import_module(f"tl_dynamics.{face}")
    for name in module.__all__:
        assert hasattr(module, name), f"tl_dynamics.{face}.{name} is exported but not defined"
        obj = getattr(module, name)
        if typing.get_origin(obj) is not None:  # a type alias: the face's docstring says it
            assert f"``{name}``" in (module.__doc__ or ""), f"{face}.{name} is not documented"
        else:
            doc = (getattr(obj, "__doc__", None) or "").strip()
            assert doc and not doc.startswith(f"{name}("), f"{face}.{name} has no docstring"


def test_the_faces_export_at_most_MAX_NAMES_names():
    total = sum(len(importlib.import_module(f"tl_dynamics.{face}").__all__) for face in SURFACE)
    assert total == sum(map(len, SURFACE.values())) <= MAX_NAMES


def test_no_face_exports_cli_plumbing_registry_classes_or_private_names():
    for face in SURFACE:
        for name in importlib.import_module(f"tl_dynamics.{face}").__all__:
            assert not name.startswith("_"), (face, name)
            assert not name.endswith("Analysis") or face == "collect", (face, name)  # the base
            assert not name.startswith("cli_") and name != "report_main", (face, name)
