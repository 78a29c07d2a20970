"""``attach()`` follows the model however it is run (issue 30): every TransformerLens entry point
(``model(...)``, ``model.forward``, ``run_with_cache`` with ``names_filter`` and
``remove_batch_dim``, ``run_with_hooks``, the ``model.hooks(...)`` context, ``generate`` with and
without the KV cache), under ``torch.no_grad`` and ``torch.inference_mode``, on each host of the
installed TransformerLens (4.x: a bridge booted from transformers and the shipped induction-2l,
booted natively; 3.x: a bridge and the shipped induction-2l as a ``HookedTransformer``), collects
exactly what the same tokens through ``model(...)`` collect, bit for bit, or is refused by name
(a ``TLDynamicsError``) before any number. A pass is what the adapter's own hooks see: a hook
firing outside a pass it saw start is an error, and no analysis turns zero passes into numbers."""

from __future__ import annotations

import functools
import re
from contextlib import ExitStack

import numpy as np
import pandas as pd
import pytest
import torch

from tl_dynamics import contextual_mlp, odds_ratio, testing, trajectories, zoo
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError

ANALYSES = {
    "odds_ratio": lambda model: odds_ratio.attach(model),
    "contextual_mlp": lambda model: contextual_mlp.attach(model),
    "trajectories": lambda model: trajectories.attach(model),
}
# "hf": a tiny GPT-2 booted from transformers (a 4.x or 3.x TransformerBridge); "zoo": the shipped
# induction-2l (booted natively on 4.x; a HookedTransformer on 3.x)
HOSTS = ("hf", "zoo")
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
N_NEW = 3  # tokens generate adds


@functools.lru_cache(maxsize=None)
def model_of(host: str):
    return testing.cached_model("gpt2") if host == "hf" else zoo.load("induction-2l")


def inputs(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 9 tokens, the second left-padded by 3, and their attention mask."""
    vocab = min(int(model.cfg.d_vocab), 500)
    tokens = torch.randint(1, vocab, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0
    tokens[1, :3] = 0
    return tokens, mask


def a_hook_name(model) -> str:
    return str(ModelAdapter(model).hook_name("resid_pre", 1))


def noop(tensor, hook=None):
    return None


ENTRY_POINTS = {
    "forward": lambda m, t, k: m.forward(t, attention_mask=k),
    "run_with_cache": lambda m, t, k: m.run_with_cache(t, attention_mask=k),
    "run_with_cache_names_filter": lambda m, t, k: m.run_with_cache(
        t, attention_mask=k, names_filter=a_hook_name(m)
    ),
    "run_with_cache_remove_batch_dim": lambda m, t, k: m.run_with_cache(
        t[:1], attention_mask=k[:1], remove_batch_dim=True
    ),
    "run_with_hooks": lambda m, t, k: m.run_with_hooks(
        t, attention_mask=k, fwd_hooks=[(a_hook_name(m), noop)]
    ),
    "hooks_context": lambda m, t, k: _in_hooks(m, t, k),
}


def _in_hooks(model, tokens, mask):
    with model.hooks(fwd_hooks=[(a_hook_name(model), noop)]):
        return model(tokens, attention_mask=mask)


def digest(name: str, collector) -> list:
    """Everything an analysis reports, in a form compared bit for bit."""
    if name == "odds_ratio":
        res = collector.result()
        return [res.stats.n_prompts, dict(res.stats.sums), res.to_dataframe()]
    if name == "contextual_mlp":
        collector.result()  # raises where nothing was collected
        rows = [len(layers[0][0].q) if layers else 0 for layers in collector._passes]
        return [rows] + [
            collector.result(row, p).to_dataframe()
            for p, n_rows in enumerate(rows)
            for row in range(n_rows)
        ]
    res = collector.result()
    return [res.to_dataframe(), res.stats]


def assert_identical(got, want, where: str) -> None:
    if isinstance(want, pd.DataFrame):
        pd.testing.assert_frame_equal(got, want, check_exact=True, obj=where)
    elif isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for key in want:
            assert_identical(got[key], want[key], f"{where}[{key}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {len(got)} parts, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_identical(g, w, f"{where}[{i}]")
    elif isinstance(want, (np.ndarray, torch.Tensor)):
        g, w = np.asarray(got), np.asarray(want)
        assert g.shape == w.shape and np.array_equal(g, w, equal_nan=True), where
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def collect(host: str, name: str, run, mode: str = "no_grad") -> list:
    model = model_of(host)
    with MODES[mode](), ANALYSES[name](model) as collector:
        run(model)
    return digest(name, collector)


@functools.lru_cache(maxsize=None)
def reference(host: str, name: str, rows: int = 2) -> list:
    """What ``model(tokens, attention_mask=mask)`` collects (of the first ``rows`` rows)."""
    model = model_of(host)
    tokens, mask = inputs(model)
    return collect(host, name, lambda m: m(tokens[:rows], attention_mask=mask[:rows]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("name", ANALYSES)
@pytest.mark.parametrize("host", HOSTS)
def test_every_entry_point_collects_what_the_model_call_collects(host, name, entry, mode):
    model = model_of(host)
    tokens, mask = inputs(model)
    got = collect(host, name, lambda m: ENTRY_POINTS[entry](m, tokens, mask), mode)
    rows = 1 if entry.endswith("remove_batch_dim") else 2  # it takes one row
    assert_identical(got, reference(host, name, rows), f"{host}/{name}/{entry}/{mode}")


def generating(model, prompt, cache: bool = True, n: int = N_NEW):
    """Greedy ``generate`` of ``n`` tokens, with the KV cache or without it."""
    return model.generate(
        prompt,
        max_new_tokens=n,
        use_past_kv_cache=cache,
        do_sample=False,
        stop_at_eos=False,
        verbose=False,
    )


@pytest.mark.parametrize("name", ANALYSES)
@pytest.mark.parametrize("host", HOSTS)
def test_generate_without_the_kv_cache_collects_each_step_as_the_model_call_on_it(host, name):
    """Without the KV cache every step runs the whole sequence so far: each is collected as
    ``model(sequence)`` collects it (N_NEW passes), or the host's generate is refused by name
    (TransformerLens 3.x's ``HookedTransformer.generate`` runs its steps from embeddings it
    made itself, so no token ids reach the model)."""
    model = model_of(host)
    prompt = inputs(model)[0][:1, 3:]
    hooked = ModelAdapter(model).info.host == "hooked"
    with torch.no_grad():
        out = generating(model, prompt, cache=False)
    if hooked:
        with pytest.raises(TLDynamicsError, match="generate"):
            collect(host, name, lambda m: generating(m, prompt, cache=False))
        return
    got = collect(host, name, lambda m: generating(m, prompt, cache=False))
    n = prompt.shape[1]
    want = collect(host, name, lambda m: [m(out[:, : n + i]) for i in range(N_NEW)])
    assert_identical(got, want, f"{host}/{name}/generate")


@pytest.mark.parametrize("name", ANALYSES)
@pytest.mark.parametrize("host", ["hf"])  # its cached steps are wrong; zoo's are collected
def test_generate_with_the_kv_cache_is_refused_by_name_before_any_number(host, name):
    """Where the host's cached generation is wrong (tests/test_generate_cache.py collects it
    where it is right)."""
    model = model_of(host)
    prompt = inputs(model)[0][:1, 3:]
    with pytest.raises(TLDynamicsError, match="KV cache"):
        with ANALYSES[name](model) as collector:
            generating(model, prompt, cache=True)
    with pytest.raises(TLDynamicsError, match=r"no forward pass has run inside attach\(\)"):
        digest(name, collector)


@pytest.mark.parametrize("name", ANALYSES)
def test_no_forward_pass_is_never_a_number(name):
    """Zero passes: ``result()`` raises the same error in every analysis."""
    model = model_of("hf")
    with ANALYSES[name](model) as collector:
        pass
    with pytest.raises(
        TLDynamicsError,
        match=rf"^{name}\.attach\(\): no forward pass has run inside attach\(\); run the model",
    ):
        collector.result()


def test_a_hook_firing_outside_a_pass_is_an_error_never_dropped():
    """A layer run on its own (no forward pass of the model started) reaches a tl_dynamics hook
    outside any pass the adapter saw start: refused by name, not silently dropped."""
    model = model_of("hf")
    adapter = ModelAdapter(model)
    with torch.no_grad(), odds_ratio.attach(model) as collector:
        x = torch.zeros(1, 3, adapter.d_model)
        with pytest.raises(TLDynamicsError, match="outside a forward pass"):
            model.blocks[1](x)
    with pytest.raises(TLDynamicsError, match="no forward pass has run"):
        collector.result()


@pytest.mark.parametrize("host", HOSTS)
def test_a_pass_that_stops_before_its_end_is_refused_by_name(host):
    """``stop_at_layer`` through ``model(...)`` (refused when the call returns) or through
    ``run_with_cache`` (on a bridge it returns without a word: refused at the next pass, or when
    the block ends); a refused pass is not collected, and the passes after it are."""
    model = model_of(host)
    tokens, mask = inputs(model)
    with torch.no_grad(), odds_ratio.attach(model) as collector:
        with pytest.raises(TLDynamicsError, match="stopped before its end"):
            model(tokens, attention_mask=mask, stop_at_layer=1)
        try:  # a HookedTransformer's run_with_cache calls the model itself: refused at once
            model.run_with_cache(tokens, attention_mask=mask, stop_at_layer=1)
        except TLDynamicsError as refusal:
            assert "stopped before its end" in str(refusal)
        else:  # a bridge's calls self.forward: refused by the next pass
            with pytest.raises(TLDynamicsError, match="stopped before its end"):
                model(tokens, attention_mask=mask)
        model(tokens, attention_mask=mask)
    assert_identical(digest("odds_ratio", collector), reference(host, "odds_ratio"), host)
    with pytest.raises(TLDynamicsError, match="stopped before its end"):
        with odds_ratio.attach(model):
            model.run_with_cache(tokens, attention_mask=mask, stop_at_layer=1)


@pytest.mark.parametrize("name", ANALYSES)
@pytest.mark.parametrize("host", HOSTS)
def test_a_pass_resumed_from_a_residual_stream_is_refused_never_collected(host, name):
    """``forward(residual, start_at_layer=k)``: a 4.x bridge runs the whole body from the residual
    (blocks before ``k`` on it as if it were embeddings, their outputs discarded), so the layers
    collected would be numbers for unknown tokens; a HookedTransformer skips the blocks before
    ``k``, so the pass's first hook fires outside a pass; TransformerLens 3.x's bridge refuses
    ``start_at_layer`` itself. Nothing is collected, and the next whole pass is."""
    model = model_of(host)
    tokens, mask = inputs(model)
    _, cache = model.run_with_cache(tokens[:1])
    residual = cache[a_hook_name(model)]  # the residual entering block 1
    with torch.no_grad(), ANALYSES[name](model) as collector:
        with pytest.raises((TLDynamicsError, NotImplementedError)) as refused:
            model.forward(residual, start_at_layer=1)
        if refused.type is TLDynamicsError:
            assert re.search("start_at_layer", str(refused.value)), str(refused.value)
        else:  # the host's own refusal (3.x bridge): never a number either
            assert "start_at_layer is not supported" in str(refused.value)
        with pytest.raises(TLDynamicsError, match="no forward pass has run"):
            collector.result()
        model(tokens, attention_mask=mask)
    assert_identical(digest(name, collector), reference(host, name), host)
    assert all(len(p.fwd_hooks) == 0 for p in model.hook_dict.values()), "hooks left attached"


def test_hooks_are_gone_after_every_entry_point():
    model = model_of("hf")
    tokens, mask = inputs(model)
    with ExitStack() as stack:
        for make in ANALYSES.values():
            stack.enter_context(make(model))
        for run in ENTRY_POINTS.values():
            run(model, tokens, mask)
    assert all(len(p.fwd_hooks) == 0 for p in model.hook_dict.values())
    assert len(model._forward_pre_hooks) == 0 and len(model._forward_hooks) == 0
    body = getattr(model, "original_model", None)
    if body is not None:
        assert len(body._forward_pre_hooks) == 0 and len(body._forward_hooks) == 0
