"""Every analysis on a CUDA model: it runs unchanged and gives the CPU's numbers (issue 15).

One tiny random model per architecture is booted twice from the same seed, once kept on the CPU
and once moved to the device under test (``cuda``; ``TL_DYNAMICS_TEST_DEVICE`` names another).
Each analysis's ``compute`` (and ``attach`` where it streams) runs on both, and every tensor of
the two results (walked through dataclass fields, dicts and lists) must agree: same shape and
dtype, values within float32 tolerance, and no tensor left on a device other than the model's
or the CPU. Without a CUDA device the whole module is skipped.
"""

import dataclasses
import os
from collections.abc import Mapping

import numpy as np
import pandas as pd
import pytest
import torch

from tl_dynamics import (
    atlas,
    circuits,
    contextual_mlp,
    odds_ratio,
    particles,
    report,
    testing,
    trajectories,
)
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.collect import ExactSum
from tl_dynamics.circuits import _build
from tl_dynamics.contextual_mlp import _growth
from tl_dynamics.contextual_mlp import _readout
from tl_dynamics.odds_ratio import _collect
from tl_dynamics.trajectories import _jacobian

DEVICE = os.environ.get("TL_DYNAMICS_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE.startswith("cuda") and not torch.cuda.is_available(),
    reason="needs a CUDA device (torch.cuda.is_available() is False)",
)

# Float32 on two devices: matmuls sum in different orders (measured on an H100: <= 2e-6 of the
# largest value on these tiny models); statistics built from them agree to about that. Relative
# to each tensor's largest absolute value.
RTOL = 1e-4
# Discrete outputs (cluster counts, histogram bins, labels, argmax tokens) may flip where a value
# sits within rounding of a threshold: at most this share of the entries of a tensor may differ.
DISCRETE_SHARE = 0.02
ARCHS = ("gpt2", "llama")  # learned positions; rotary with grouped K/V
PROMPTS = list(testing.PROMPTS)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request) -> tuple[ModelAdapter, ModelAdapter]:
    cpu = ModelAdapter(testing.tiny_model(request.param))
    dev = ModelAdapter(testing.tiny_model(request.param).to(DEVICE))
    assert next(dev.model.parameters()).device.type == torch.device(DEVICE).type
    return cpu, dev


def _skip(obj) -> bool:
    return (
        isinstance(obj, (ModelAdapter, torch.nn.Module))
        or callable(obj)
        and not dataclasses.is_dataclass(obj)
    )


def tensors(obj, path: str = "", out: dict | None = None, seen: set | None = None) -> dict:
    """Every tensor, array and data frame reachable from ``obj`` by dataclass fields, dict values,
    list items and plain attributes, keyed by its path."""
    out = {} if out is None else out
    seen = set() if seen is None else seen
    if isinstance(obj, (torch.Tensor, np.ndarray, pd.DataFrame, pd.Series)):
        out[path] = obj
        return out
    if isinstance(obj, ExactSum):  # its limbs are exact: compare the sums, rounded once
        out[f"{path}.value()"] = obj.value()
        return out
    if (
        obj is None
        or isinstance(obj, (str, bytes, int, float, bool, complex, torch.dtype, torch.device))
        or _skip(obj)
        or id(obj) in seen
    ):
        return out
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj):
        items = [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, Mapping):  # dicts, and lazy mappings formed on look-up (LazyMLPs)
        items = [(repr(k), obj[k]) for k in obj]
    elif isinstance(obj, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("tl_dynamics"):
        items = list(vars(obj).items())
    else:
        return out
    for name, value in items:
        tensors(value, f"{path}.{name}", out, seen)
    return out


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, (pd.DataFrame, pd.Series)):
        return x.select_dtypes("number").to_numpy() if isinstance(x, pd.DataFrame) else x.to_numpy()
    return np.asarray(x)


def assert_same(got, want, what: str = "result") -> None:
    """``got`` (from the device model) equals ``want`` (from the CPU model) tensor by tensor."""
    got_t, want_t = tensors(got), tensors(want)
    assert want_t, f"{what}: nothing to compare"
    assert sorted(got_t) == sorted(want_t), what
    dev = torch.device(DEVICE).type
    for path, w in want_t.items():
        g = got_t[path]
        assert type(g) is type(w), (what, path)
        if isinstance(g, torch.Tensor):
            assert g.device.type in (dev, "cpu"), (what, path, g.device)
            assert w.device.type == "cpu", (what, path, w.device)
            assert g.dtype == w.dtype, (what, path, g.dtype, w.dtype)
        if isinstance(g, pd.DataFrame):
            assert list(g.columns) == list(w.columns), (what, path)
            text = [c for c in w.columns if c not in w.select_dtypes("number").columns]
            for col in text:
                mismatch = np.mean([str(x) != str(y) for x, y in zip(g[col], w[col])])
                assert mismatch <= DISCRETE_SHARE, (what, path, col, mismatch)
        a, b = _as_numpy(g), _as_numpy(w)
        if path.endswith("eigenvalues"):  # LAPACK's order moves with the last bits of the input
            a, b = np.sort(a, axis=-1), np.sort(b, axis=-1)
        assert a.shape == b.shape, (what, path, a.shape, b.shape)
        if a.size == 0:
            continue
        if a.dtype.kind in "fc":
            a, b = (
                a.astype(np.complex128 if a.dtype.kind == "c" else np.float64),
                b.astype(np.complex128 if b.dtype.kind == "c" else np.float64),
            )
            assert np.array_equal(np.isnan(a), np.isnan(b)), (what, path, "NaN positions differ")
            ok = np.isfinite(a) & np.isfinite(b)
            assert np.array_equal(a[~ok & ~np.isnan(a)], b[~ok & ~np.isnan(b)]), (what, path)
            scale = max(1.0, float(np.abs(b[ok]).max())) if ok.any() else 1.0
            err = float(np.abs(a[ok] - b[ok]).max()) if ok.any() else 0.0
            assert err <= RTOL * scale, (what, path, err, scale)
        elif a.dtype.kind in "biu":
            mismatch = float((a != b).mean())
            assert mismatch <= DISCRETE_SHARE, (what, path, mismatch)
        else:
            mismatch = float((a.astype(str) != b.astype(str)).mean())
            assert mismatch <= DISCRETE_SHARE, (what, path, mismatch)


def both(pair, fn):
    cpu, dev = pair
    return fn(dev), fn(cpu)


def test_model_and_tokens_live_on_the_device(pair):
    _, dev = pair
    batch = dev.tokenize(PROMPTS)
    logits = dev.forward(batch)
    assert logits.device.type == torch.device(DEVICE).type
    for la in dev.attention(batch).values():
        assert la.q.device.type == torch.device(DEVICE).type


def test_odds_ratio_compute_and_attach(pair):
    assert_same(
        *both(pair, lambda ad: odds_ratio.compute(ad, PROMPTS, keep_tensors=True)),
        "odds_ratio.compute",
    )
    assert_same(
        *both(pair, lambda ad: odds_ratio.compute(ad, PROMPTS, keep_tensors=False).to_dataframe()),
        "odds_ratio.compute(keep_tensors=False).to_dataframe",
    )

    def attached(ad):
        batch = ad.tokenize(PROMPTS)
        with odds_ratio.attach(ad) as collector:
            ad.forward(batch)
        return collector.result()

    assert_same(*both(pair, attached), "odds_ratio.attach")
    assert_same(*both(pair, lambda ad: odds_ratio.markov(ad, PROMPTS, 1, 0)), "odds_ratio.markov")
    assert_same(*both(pair, lambda ad: odds_ratio.composed(ad, PROMPTS)), "odds_ratio.composed")
    assert_same(
        *both(pair, lambda ad: odds_ratio.barycentric(ad, PROMPTS, 1, 0)), "odds_ratio.barycentric"
    )


def test_contextual_mlp_compute_attach_and_readouts(pair):
    def computed(ad):
        result = contextual_mlp.compute(ad, PROMPTS[1])
        mlp = result[1, 0]
        return {
            "result": result,
            "frame": result.to_dataframe(),
            "exact": mlp.exactness(),
            "vocab": _readout.evaluate_vocab(mlp, ad, 3),
            "tokens": _readout.evaluate_tokens(mlp, ad, [1, 2, 3], 3),
            "read": _readout.read_tokens(mlp, ad, 3, k=5),
            "written": _readout.written_tokens(mlp, ad, k=5),
            "growth": _growth.growth(mlp, 3),
        }

    got, want = both(pair, computed)
    assert_same(got, want, "contextual_mlp.compute")
    assert float(got["exact"].output_error.max()) <= 1e-4

    def attached(ad):
        batch = ad.tokenize(PROMPTS)
        with contextual_mlp.attach(ad) as collector:
            ad.forward(batch)
        return [collector.result(row=r) for r in range(2)]

    assert_same(*both(pair, attached), "contextual_mlp.attach")
    assert_same(
        *both(pair, lambda ad: contextual_mlp.compute_rows(ad, PROMPTS)),
        "contextual_mlp.compute_rows",
    )


@pytest.mark.parametrize("lens", [False, "view", True])
def test_trajectories_compute_and_attach(pair, lens):
    assert_same(
        *both(pair, lambda ad: trajectories.compute(ad, PROMPTS, lens=lens)),
        f"trajectories.compute(lens={lens})",
    )

    def attached(ad):
        batch = ad.tokenize(PROMPTS)
        with trajectories.attach(ad, lens=lens) as collector:
            ad.forward(batch)
        return collector.result()

    assert_same(*both(pair, attached), f"trajectories.attach(lens={lens})")


def test_trajectories_jacobian_and_probe(pair):
    assert_same(
        *both(pair, lambda ad: trajectories.block_jacobian(ad, PROMPTS[0], 0, k=3)),
        "trajectories.block_jacobian",
    )
    assert_same(
        *both(pair, lambda ad: _jacobian.dense_block_jacobian(ad, PROMPTS[0], 0)),
        "trajectories.dense_block_jacobian",
    )
    prompts = [
        f"x = {i} + {i % 3}" if i % 2 else f"print(os.path.join('a', '{i}'))" for i in range(8)
    ]
    labels = [i % 2 for i in range(len(prompts))]
    assert_same(
        *both(pair, lambda ad: trajectories.class_probe(ad, prompts, labels)),
        "trajectories.class_probe",
    )


def test_circuits(pair):
    def computed(ad):
        overview = circuits.compute(ad, PROMPTS[0], n_samples=10)
        qk = circuits.qk_circuit(ad, 1, 0)
        return {
            "overview": overview,
            "frame": overview.to_dataframe(),
            "topk": qk.topk(k=3, rows=[1, 2, 3]).to_dataframe(),
            "ov": circuits.ov_circuit(ad, 1, 0).topk(k=3, rows=[1, 2]).to_dataframe(),
        }

    assert_same(*both(pair, computed), "circuits")


def test_circuits_entry_points(pair):
    rotary = pair[0].rotation(1) is not None

    def computed(ad):
        out = {
            "composition": circuits.composition_scores(ad, n_samples=10),
            "prompt": circuits.prompt_circuit(ad, PROMPTS[0], 1, 0),
            "token_composition": circuits.token_composition(
                ad, "K", (1, 0), [(0, 1)], rows=[1, 2, 3, 4]
            ),
        }
        if rotary:
            out["offsets"] = circuits.offset_summary(ad, 1, 0, offsets=[0, 1, 2])
        else:
            out["positional"] = _build.positional_qk_circuit(ad, 1, 0).topk(k=3).to_dataframe()
        return out

    assert_same(*both(pair, computed), "circuits entry points")


def test_more_entry_points(pair):
    def computed(ad):
        la = ad.attention(PROMPTS, layers=[1])[1]
        return {
            "decompose_layer": _collect.decompose_layer(la, [0, 1]).pattern,
            "stream": trajectories.stream(ad, PROMPTS * 2, batch_size=2, progress=False),
            "from_head": particles.from_head(ad, 1, 0),
            "generate_growth": contextual_mlp.generate_growth(
                ad, PROMPTS[0], 1, 0, max_new_tokens=3
            ),
        }

    assert_same(*both(pair, computed), "more entry points")


def test_particles(pair):
    assert_same(
        *both(pair, lambda ad: particles.compute(ad, PROMPTS[0], layers=0, heads=[0, 1])),
        "particles.compute",
    )


def test_atlas(pair):
    assert_same(
        *both(pair, lambda ad: atlas.compute(ad, PROMPTS, n_seq=4, seq_len=12)), "atlas.compute"
    )


def test_report_builds_from_a_device_model(pair):
    """Every section's views read device tensors (``.cpu()`` before ``.numpy()``)."""
    _, dev = pair
    page = report.build_report(dev, PROMPTS[0], threads=None)
    assert page.failed_sections == []
    assert "This section failed" not in page.to_html()


def test_scale_run_stats(pair):
    from tl_dynamics import scale

    prompts = PROMPTS * 3
    assert_same(
        *both(pair, lambda ad: scale.run_stats(ad, prompts, batch_size=4, progress=False)),
        "scale.run_stats",
    )
