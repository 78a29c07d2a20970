"""The per-pass statistics as one compiled plan (issue 33; ``tl_dynamics/collect/_fused.py``).

The odds-ratio statistics of a group of layers are a pure function of the collected tensors
(``odds_ratio._fused.group_sums``). Compiled with ``torch.compile`` (inductor, full graph,
static shapes) they equal the eager function on the CPU, and the compiled plan launches fewer
kernels than the eager plan's ops (counted, recorded in benchmarks/README.md). On a CUDA device
(skipped without one) the collectors add no host synchronisation to an attached forward
(``torch.cuda.set_sync_debug_mode``) beyond the trajectories' one documented read (the cluster
fixed point), and the compiled collector equals the eager one.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tl_dynamics import compat, contextual_mlp, odds_ratio, testing, trajectories
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.collect._count import count_ops
from tl_dynamics.collect._fused import ENV, Fused, compile_mode, compiled_as
from tl_dynamics.collect._policy import planned_as
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.odds_ratio import _fused, _stats
from tl_dynamics.odds_ratio._headstats import SINK_SUM_KEYS
from tl_dynamics.odds_ratio._fast import MaskFacts

DEVICE = os.environ.get("TL_DYNAMICS_TEST_DEVICE", "cuda")
CUDA = DEVICE.startswith("cuda") and torch.cuda.is_available()
# one prompt shorter than the other: padding masks the keys and queries of row 1
PROMPTS = ["def add(a, b):\n    return a + b\n", "x = 1"]


def _group_inputs(ad: ModelAdapter):
    layers = ad.attention(ad.tokenize(PROMPTS))
    las = [layers[layer] for layer in sorted(layers)]
    q = torch.cat([la.q for la in las], 2)
    k = torch.cat([la.k for la in las], 2)
    first = las[0]
    spec = first.spec
    masks = MaskFacts.of(first.allowed, first.query_valid, spec.causal, spec.window)
    return (q, k, masks, first.scale)


def test_the_policy_compiles_where_it_pays(monkeypatch):
    fused = Fused(lambda x: x * 2)
    key = ("shape",)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(ENV, raising=False)
    assert compile_mode() == "auto"
    fused.seen[key] = 1  # a shape seen once: eager (a corpus of many lengths compiles nothing)
    assert not fused.wants(cuda, key)
    fused.seen[key] = 2  # its second pass compiles it, on a GPU only
    assert fused.wants(cuda, key) and not fused.wants(cpu, key)
    assert Fused(lambda x: x, cpu=True).wants(cpu, key) is False  # still not a first sight
    with compiled_as(True):
        assert fused.wants(cpu, ("new",))
    with compiled_as(False):
        assert not fused.wants(cuda, key)
    monkeypatch.setenv(ENV, "never")
    assert not fused.wants(cuda, key)
    monkeypatch.setenv(ENV, "always")
    assert fused.wants(cpu, ("new",))
    monkeypatch.setenv(ENV, "auto")
    fused.compiled.update([("a",), ("b",)])  # two shapes compiled: a third recurring stays eager
    fused.seen[("c",)] = 5
    assert not fused.wants(cuda, ("c",)) and fused.wants(cuda, ("a",))
    monkeypatch.setenv(ENV, "always")  # up to eight
    assert fused.wants(cpu, ("c",))
    fused.compiled.update(("s", i) for i in range(6))
    assert not fused.wants(cpu, ("new",)) and fused.wants(cpu, ("s", 3))
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(TLDynamicsError, match=r"TL_DYNAMICS_COMPILE='sometimes': valid values"):
        compile_mode()


def test_on_the_cpu_auto_runs_eager_and_gives_the_collectors_numbers(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    fused = Fused(_fused.group_sums)
    args = _group_inputs(ModelAdapter(testing.tiny_model("gpt2")))
    for _ in range(3):  # shapes recur, but the CPU is not compiled for (measured slower)
        part, _sinks, _per = fused(torch.device("cpu"), *args, 4, 2, True)
    assert fused.compiled_shapes == 0 and fused._compiled is None
    n_keys = len(_stats.SUM_KEYS) + len(SINK_SUM_KEYS)  # the sums, then the summed sink facts
    assert part.shape == (2, n_keys, 4) and part.dtype == torch.float64


@pytest.mark.slow
@pytest.mark.skipif(
    compat.has_hooked_transformer(),
    reason="the compiled statistics involve no TransformerLens code: compiled once (a minute "
    "or more of inductor on a loaded CPU), in the newest-TransformerLens environment",
)
def test_compiled_statistics_equal_eager_on_the_cpu_with_fewer_kernels():
    """Inductor on the CPU (C++ kernels): the same numbers as eager, and fewer launches."""
    from torch._inductor import metrics

    ad = ModelAdapter(testing.tiny_model("gpt2"))
    args = _group_inputs(ad)
    with count_ops(launch_bound=True) as eager_count:
        want_part, want_sinks, want_per = _fused.group_sums(*args, 4, 2, True)
    fused = Fused(_fused.group_sums)
    metrics.reset()
    with compiled_as(True):
        got_part, got_sinks, got_per = fused(torch.device("cpu"), *args, 4, 2, True)
    assert fused.failed is None and fused.compiled_shapes == 1
    torch.testing.assert_close(got_part, want_part, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_per, want_per, rtol=1e-5, atol=1e-6)
    assert got_sinks.keys() == want_sinks.keys()
    for name in want_sinks:
        torch.testing.assert_close(got_sinks[name], want_sinks[name], rtol=1e-5, atol=1e-6)
    kernels = metrics.generated_kernel_count
    # recorded in benchmarks/README.md ("Fused statistics"): eager ops against compiled kernels
    print(f"\ngroup_sums, 2 layers x 4 heads: {eager_count.ops} eager ops, {kernels} kernels")
    assert 0 < kernels < eager_count.ops / 2

    # the collector with the GPU's plan, compiled from its first pass, equals it eager
    batch = ad.tokenize(PROMPTS)
    results = {}
    for compiled in (False, True):
        with planned_as(True), compiled_as(compiled):
            with odds_ratio.attach(ad) as collector:
                ad.forward(batch)
                ad.forward(batch)
        results[compiled] = collector.result().to_dataframe().select_dtypes("number")
    # the collector's own call compiled (a failure would fall back to eager, equal by itself)
    assert _fused.GROUP_SUMS.failed is None and _fused.GROUP_SUMS.compiled_shapes >= 1
    diff = (results[True] - results[False]).abs().max().max()
    assert diff <= 1e-5, diff


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_attached_forward_adds_no_host_sync_on_cuda(arch):
    with compiled_as(True):  # the steady state of a GPU: the statistics compiled
        _no_added_syncs(arch)


def _no_added_syncs(arch: str) -> None:
    ad = ModelAdapter(testing.tiny_model(arch).to(DEVICE))
    host = ad.tokenize(PROMPTS)  # on the device already: a copy from pageable memory syncs
    batch = Batch(host.tokens.to(DEVICE), host.key_valid.to(DEVICE), host.padding_side)
    ad.forward(batch)  # warm-up (lazy initialisation may sync once)

    def syncs(make=None) -> int:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                if make is None:
                    ad.forward(batch)
                else:
                    with make():
                        ad.forward(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in seen)

    plain = syncs()
    with odds_ratio.attach(ad), contextual_mlp.attach(ad):
        ad.forward(batch)  # warm: the first pass compiles the odds-ratio statistics
    if plain == 0:  # the forward itself syncs nowhere: no collector may (an error if one does)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with odds_ratio.attach(ad), contextual_mlp.attach(ad):
                ad.forward(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert syncs(lambda: odds_ratio.attach(ad)) == plain
    assert syncs(lambda: contextual_mlp.attach(ad)) == plain
    # the cluster fixed point's one read per forward (docs/developing.md)
    assert syncs(lambda: trajectories.attach(ad, lens=False)) <= plain + 1


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_compiled_collector_equals_eager_on_cuda():
    ad = ModelAdapter(testing.tiny_model("llama").to(DEVICE))
    batch = ad.tokenize(PROMPTS)
    results = {}
    for compiled in (False, True):
        with compiled_as(compiled):
            with odds_ratio.attach(ad) as collector:
                ad.forward(batch)
                ad.forward(batch)
        results[compiled] = collector.result().to_dataframe().select_dtypes("number")
    assert _fused.GROUP_SUMS.failed is None
    diff = (results[True] - results[False]).abs().max().max()
    assert diff <= 1e-5, diff
