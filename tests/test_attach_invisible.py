"""Attach is invisible (issue 40): with any analysis attached, under every entry point and on each
host of the installed TransformerLens, what the researcher's own code sees is what it sees
without attach, bit for bit: the logits, the cache ``run_with_cache`` returns (keys, shapes,
values), the calls each of their hooks receives (hook point, shape, value, in order), and the
effect of their patching hooks (on the final norm and on a block's attention). The logit lens
reads the final norm's arithmetic from the adapter, never the model's hooked ``ln_final``."""

from __future__ import annotations

import functools
from contextlib import ExitStack

import pytest
import torch

from tl_dynamics import testing
from tl_dynamics.adapter import ModelAdapter
from test_attach_entry_points import ANALYSES, HOSTS, assert_identical, digest, inputs, model_of

USER_HOOKS = ("none", "recording", "patch_ln_final", "patch_attention")


def _run_with_cache(model, tokens, mask, hooks):
    with model.hooks(fwd_hooks=hooks):
        return model.run_with_cache(tokens, attention_mask=mask)


def _persistent(model, tokens, mask, hooks):
    """Hooks added with ``add_hook`` (kept until removed), then ``model(...)``; exactly those
    hooks are removed afterwards."""
    added = add_persistent(model, hooks)
    try:
        return model(tokens, attention_mask=mask)
    finally:
        remove(added)


def add_persistent(model, hooks) -> list:
    added = []
    for name, fn in hooks:
        for point_name, point in model.hook_dict.items():
            if name(point_name) if callable(name) else name == point_name:
                before = list(point.fwd_hooks)
                point.add_hook(fn, dir="fwd")
                added += [(point, h) for h in point.fwd_hooks if all(h is not b for b in before)]
    return added


def remove(added: list) -> None:
    for point, handle in added:
        handle.hook.remove()
        point.fwd_hooks = [h for h in point.fwd_hooks if h is not handle]


def _context(model, tokens, mask, hooks):
    with model.hooks(fwd_hooks=hooks):
        return model(tokens, attention_mask=mask)


ENTRY_POINTS = {
    "call": _persistent,
    "forward": lambda m, t, k, h: _context_forward(m, t, k, h),
    "run_with_cache": _run_with_cache,
    "run_with_hooks": lambda m, t, k, h: m.run_with_hooks(t, attention_mask=k, fwd_hooks=h),
    "hooks_context": _context,
}


def _context_forward(model, tokens, mask, hooks):
    with model.hooks(fwd_hooks=hooks):
        return model.forward(tokens, attention_mask=mask)


@functools.lru_cache(maxsize=None)
def clean_cache(host: str) -> dict:
    """The cache of another prompt of the same shape: what a patching hook splices in."""
    model = model_of(host)
    tokens, mask = inputs(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens.flip(-1), attention_mask=mask)
    return {name: t.clone() for name, t in cache.items()}


def targets(host: str) -> dict[str, str]:
    ad = ModelAdapter(model_of(host))
    return {
        "patch_ln_final": "ln_final.hook_normalized",
        "patch_attention": str(ad.hook_name("pattern", 0)),
    }


def user_hooks(host: str, kind: str, record: list) -> list:
    """The researcher's hooks of one kind (``record`` collects what a recording hook sees)."""
    if kind == "none":
        return []
    if kind == "recording":

        def rec(x, hook):
            record.append((hook.name, tuple(x.shape), x.detach().clone()))

        return [(lambda name: True, rec)]
    clean = clean_cache(host)
    return [(targets(host)[kind], lambda x, hook: clean[hook.name])]


def run(host: str, entry: str, kind: str, analysis: str | None):
    """``(outputs, record, collector)`` of one entry point, with ``analysis`` attached or not."""
    model = model_of(host)
    tokens, mask = inputs(model)
    record: list = []
    hooks = user_hooks(host, kind, record)
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        collector = None if analysis is None else stack.enter_context(ANALYSES[analysis](model))
        out = ENTRY_POINTS[entry](model, tokens, mask, hooks)
    return out, record, collector


def flatten(out) -> list:
    """Logits, and every cache entry as (name, shape, value), of an entry point's output."""
    if isinstance(out, tuple):  # run_with_cache: (logits, cache)
        logits, cache = out
        return [logits] + [(name, tuple(t.shape), t) for name, t in cache.items()]
    return [out]


@functools.lru_cache(maxsize=None)
def unattached(host: str, entry: str, kind: str) -> tuple[list, list]:
    out, record, _ = run(host, entry, kind, None)
    return flatten(out), record


@pytest.mark.parametrize("kind", USER_HOOKS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("analysis", ANALYSES)
@pytest.mark.parametrize("host", HOSTS)
def test_the_user_sees_what_they_see_without_attach(host, analysis, entry, kind):
    out, record, collector = run(host, entry, kind, analysis)
    want_out, want_record = unattached(host, entry, kind)
    where = f"{host}/{analysis}/{entry}/{kind}"
    got = flatten(out)
    assert [g[0] for g in got[1:]] == [w[0] for w in want_out[1:]], f"{where}: cache keys"
    assert_identical(got, want_out, f"{where}: logits and cache")
    assert [(n, s) for n, s, _ in record] == [(n, s) for n, s, _ in want_record], (
        f"{where}: the recording hook's calls (hook point, shape)"
    )
    assert_identical([v for *_, v in record], [v for *_, v in want_record], f"{where}: values")
    collector.result()  # something was collected
    assert all(len(p.fwd_hooks) == 0 for p in model_of(host).hook_dict.values())


@pytest.mark.parametrize("host", HOSTS)
def test_a_patch_on_the_final_norm_leaves_the_lens_alone(host):
    """The lens reads the residual states through the adapter's own final-norm arithmetic, so a
    user's patch of ``ln_final`` (which comes after every trajectory point) changes nothing of
    the trajectories, and a zeroing patch no rank."""
    model = model_of(host)
    tokens, mask = inputs(model)
    plain = digest("trajectories", run(host, "run_with_hooks", "none", "trajectories")[2])
    clean = clean_cache(host)
    for patch in (lambda x, hook: torch.zeros_like(x), lambda x, hook: clean[hook.name]):
        with torch.no_grad(), ANALYSES["trajectories"](model) as collector:
            model.run_with_hooks(
                tokens, attention_mask=mask, fwd_hooks=[("ln_final.hook_normalized", patch)]
            )
        assert_identical(digest("trajectories", collector), plain, f"{host}: patched ln_final")


def test_the_lens_is_the_model_head_on_the_last_state():
    """``logit_lens`` of the last ``resid_post`` is the model's logits (the adapter's final-norm
    arithmetic reproduces the host's module: LayerNorm, RMSNorm, Gemma's ``1 + w``), and
    reading it fires no hook of the model."""
    fired: list = []
    for arch in ("gpt2", "llama", "gemma2", "olmo"):
        model = testing.cached_model(arch)
        ad = ModelAdapter(model)
        tokens = inputs(model)[0]
        with torch.no_grad():
            logits, cache = model.run_with_cache(tokens)
        with model.hooks(fwd_hooks=[(lambda name: True, lambda x, hook: fired.append(hook.name))]):
            lens = ad.logit_lens(cache[str(ad.hook_name("resid_post", ad.n_layers - 1))])
        assert fired == [], arch
        err = float((lens - logits).abs().max() / logits.abs().max())
        assert err < 1e-6, (arch, err)


def test_the_self_check_pass_fires_no_user_hook():
    """A fresh model's first ``attach`` runs the adapter's self-check probe pass: a hook the user
    added with ``add_hook`` before it sees nothing of it."""
    model = testing.tiny_model("llama")  # fresh: its adapter has not checked itself yet
    calls: list = []
    added = add_persistent(model, [(lambda name: True, lambda x, hook: calls.append(hook.name))])
    tokens = inputs(model)[0][:1]  # one row: no padding
    try:
        with torch.no_grad(), ANALYSES["trajectories"](model):
            model(tokens)
        attached = list(calls)
        calls.clear()
        with torch.no_grad():
            model(tokens)
    finally:
        remove(added)
    assert attached == calls
