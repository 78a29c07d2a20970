"""One collector pass (issue 21): every attached analysis shares one hook set and one
``LayerState`` per layer, computes in a few launches per pass whatever the number of heads and
tokens, and reads the device a handful of times per forward. Counted, never timed: ops and syncs
with ``count_ops`` on a 12-layer GPT-2 shape (narrow, so it runs in seconds; the counts do not
depend on the width), on the GPU's plan (``launch_bound=True``: the launches a GPU would make; on
the CPU itself the same code works in cache-sized pieces, with the same numbers). The analyses
run with their defaults, the trajectories' logit lens read where the view reads it (issue 48:
at most the forward's own ops per layer, about 78 here)."""

from __future__ import annotations

import functools
import tempfile
from contextlib import ExitStack

import numpy as np
import pytest
import torch

from tl_dynamics import contextual_mlp, odds_ratio, testing, trajectories
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.collect import Collector, to_host, torch_threads
from tl_dynamics.collect._count import count_ops
from tl_dynamics.errors import TLDynamicsError

N_LAYERS = 12


@functools.lru_cache(maxsize=None)
def gpt2_shape(n_head: int) -> ModelAdapter:
    """A GPT-2-small-shaped stack (12 layers) with ``n_head`` heads, d_model 64, random weights."""
    import transformers

    testing.tiny_model("gpt2")  # quiet transformers' loading messages the same way
    folder = tempfile.mkdtemp(prefix=f"tld_collect_h{n_head}_")
    torch.manual_seed(0)
    tok = testing.tokenizer()
    config = transformers.GPT2Config(
        n_layer=N_LAYERS,
        n_head=n_head,
        n_embd=64,
        n_positions=256,
        vocab_size=len(tok),
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return ModelAdapter(testing.bridge_class().boot_transformers(folder).eval())


def attached(adapter: ModelAdapter, tokens: torch.Tensor, which: tuple[str, ...]):
    makers = {
        "odds_ratio": lambda: odds_ratio.attach(adapter),
        "contextual_mlp": lambda: contextual_mlp.attach(adapter),
        "trajectories": lambda: trajectories.attach(adapter),  # the lens as the view reads it
    }

    def run():
        with ExitStack() as stack:
            collectors = [stack.enter_context(makers[w]()) for w in which]
            adapter.model(tokens)
        return [c.result() for c in collectors]

    return run


def per_layer(adapter: ModelAdapter, tokens: torch.Tensor, which: tuple[str, ...]):
    """(the forward's own ops per layer, the ops the analyses add per layer with their
    ``result()``, host syncs of the whole run)."""
    with torch.no_grad():
        attached(adapter, tokens, which)()  # warm: rotations read, caches filled
        with count_ops(launch_bound=True) as plain:
            adapter.model(tokens)
        with count_ops(launch_bound=True) as both:
            attached(adapter, tokens, which)()
    return plain.ops / N_LAYERS, (both.ops - plain.ops) / N_LAYERS, both.syncs


ALL = ("odds_ratio", "contextual_mlp", "trajectories")
SHAPES = [(4, 1, 32), (4, 1, 128), (8, 1, 32), (8, 1, 128), (4, 4, 32)]  # heads, batch, tokens


def test_all_three_add_at_most_the_forwards_own_ops_per_layer_and_stay_flat():
    added = {}
    for n_head, batch, n_pos in SHAPES:
        adapter = gpt2_shape(n_head)
        tokens = torch.randint(1, 500, (batch, n_pos), generator=torch.Generator().manual_seed(0))
        forward, extra, syncs = per_layer(adapter, tokens, ALL)
        assert extra <= forward, (
            f"{n_head} heads, {batch} x {n_pos}: the analyses add {extra:.1f} "
            f"ops per layer, the forward itself runs {forward:.1f}"
        )
        assert syncs <= 10, f"{n_head} heads, {batch} x {n_pos}: {syncs} host syncs per forward"
        added[(n_head, batch, n_pos)] = extra
    # flat: twice the heads or four times the tokens change the launches by under 10%
    assert max(added.values()) <= 1.10 * min(added.values()), added


def test_collecting_reads_the_device_once_per_pass_until_a_result_is_asked_for():
    adapter = gpt2_shape(4)
    tokens = torch.randint(1, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), odds_ratio.attach(adapter) as odds, contextual_mlp.attach(adapter) as mlp:
        adapter.model(tokens)  # warm
        with count_ops(launch_bound=True) as c:
            adapter.model(tokens)
            adapter.model(tokens)
    # one read per pass, at its start: whether rows of a batch without a mask look padded
    # (adapter/_texts.py; a masked pass reads its mask's side once instead, adapter/_pass.py)
    assert c.syncs == 2, c.by_sync
    with count_ops(launch_bound=True) as c:  # one read for every pass's sums
        odds.result()
    assert c.syncs == 1, c.by_sync
    assert mlp.n_passes == 3


def test_every_collector_reads_one_shared_layer_state():
    """Two collectors attached separately see the very same ``LayerAttention`` per layer (its
    scores computed once) and the same mask tensor in every layer of a pass."""
    adapter = ModelAdapter(testing.tiny_model("gpt2"))

    class Keep(Collector):
        def __init__(self):
            self.layers, self.seen, self.starts, self.ends = (0, 1), [], 0, 0

        def start_pass(self, batch):
            self.starts += 1

        def on_layer(self, state):
            self.seen.append(state.attention)

        def end_pass(self):
            self.ends += 1

    a, b = Keep(), Keep()
    with adapter.collecting(a), adapter.collecting(b):
        adapter.forward(adapter.tokenize(["a b c", "d e"]))
    assert [x is y for x, y in zip(a.seen, b.seen)] == [True, True]
    assert a.seen[0].allowed is a.seen[1].allowed  # masks built once per pass
    assert a.seen[0].scores() is a.seen[0].scores()  # memoised: computed once, read by all
    assert (a.starts, a.ends) == (1, 1)
    assert all(len(p.fwd_hooks) == 0 for p in adapter.model.hook_dict.values())
    assert len(adapter.model._forward_pre_hooks) == 0 and len(adapter.model._forward_hooks) == 0


def test_the_pass_brings_its_own_padding_mask():
    """A user's own call with ``attention_mask`` gives collectors the same numbers as the
    adapter's padded batch: the mask reaches them one way, from the pass itself."""
    adapter = ModelAdapter(testing.tiny_model("gpt2"))
    batch = adapter.tokenize(list(testing.PROMPTS), padding_side="left")
    with odds_ratio.attach(adapter) as mine:
        adapter.model(batch.tokens, attention_mask=batch.key_valid.long())
    direct = odds_ratio.compute(adapter, batch, keep_tensors=False)
    for key in direct.stats.sums:
        np.testing.assert_allclose(
            mine.result().stats.sums[key], direct.stats.sums[key], rtol=1e-6, atol=1e-9
        )
    with trajectories.attach(adapter) as traj:
        adapter.model(batch.tokens, attention_mask=batch.key_valid.long())
    assert traj.result().stats == trajectories.compute(adapter, batch).stats
    assert torch.equal(traj.result().key_valid, batch.key_valid.cpu())


def test_a_collector_attached_twice_runs_once_and_bad_requests_fail_before_hooking():
    adapter = ModelAdapter(testing.tiny_model("gpt2"))
    with odds_ratio.attach(adapter, keep_tensors=True) as collector:
        collector.forward("x = 1")  # attaches the same collector again inside: one pass
    assert collector.result().stats.n_prompts == 1 and len(collector.result().decompositions) == 1

    class Wrong(Collector):
        points = (("resid_nowhere", 0),)

        def on_layer(self, state):
            pass

    with pytest.raises(TLDynamicsError, match="unknown residual point 'resid_nowhere'"):
        with adapter.collecting(Wrong()):
            pass
    assert all(len(p.fwd_hooks) == 0 for p in adapter.model.hook_dict.values())


def test_attaching_reads_the_models_hook_table_a_few_times_not_per_hook(monkeypatch):
    """A bridge builds its ``hook_dict`` anew (aliases included) at every read: the hub
    resolves all of a registration's hook names from one read. Reading it per hook name cost
    0.15 s of CPU per attach of all three analyses on GPT-2 small (480 reads)."""
    adapter = gpt2_shape(4)
    bridge = type(adapter.model)
    reads = [0]
    table = bridge.hook_dict

    def counted(model):
        reads[0] += 1
        return table.fget(model)

    monkeypatch.setattr(bridge, "hook_dict", property(counted))
    tokens = torch.randint(1, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    attached(adapter, tokens, ALL)()  # warm: rotations read, weights cached
    reads[0] = 0
    attached(adapter, tokens, ALL)()
    # per attach: the check, the registration and the hooking; per detach: the last two
    assert 0 < reads[0] <= 3 * len(ALL) + 2 * len(ALL), reads[0]


def test_threads_and_host_reads():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(TLDynamicsError, match="threads must be a positive integer"):
        with torch_threads(0):
            pass
    values = {
        "a": torch.arange(6.0).reshape(2, 3),
        "b": torch.tensor([1, 2]),
        "c": torch.ones(2, dtype=torch.bool),
    }
    with count_ops() as c:
        out = to_host(values)
    assert c.syncs == 3  # one read per dtype, not per tensor
    assert all(torch.equal(out[k], values[k]) for k in values)


def test_the_cpu_and_gpu_plans_give_the_same_numbers(monkeypatch):
    """Cache-sized chunks and point groups (the CPU's plan) and budget-sized ones (a GPU's) are
    the same computation: every statistic agrees."""
    from tl_dynamics.collect._policy import planned_as
    from tl_dynamics.odds_ratio import _fast

    # the CPU's odds-ratio chunks at this size: groups of 3 heads (the last one shorter), 16
    # query rows each
    monkeypatch.setattr(_fast, "CPU_CHUNK_ELEMENTS", 3 * 2 * 128 * 16)
    monkeypatch.setattr(_fast, "CPU_CHUNK_ROWS", 16)
    adapter = gpt2_shape(4)
    tokens = torch.randint(1, 500, (2, 128), generator=torch.Generator().manual_seed(3))
    runs = {}
    for plan in (False, True):
        with planned_as(launch_bound=plan), torch.no_grad():
            runs[plan] = (
                odds_ratio.compute(adapter, tokens, keep_tensors=False).stats,
                trajectories.compute(adapter, tokens),
            )
    (odds_cpu, traj_cpu), (odds_gpu, traj_gpu) = runs[False], runs[True]
    for key in odds_cpu.sums:
        np.testing.assert_allclose(odds_cpu.sums[key], odds_gpu.sums[key], rtol=1e-4, atol=1e-5)
    for name in ("clusters", "merges", "splits", "cos_hist"):  # integer statistics: equal
        assert torch.equal(getattr(traj_cpu, name), getattr(traj_gpu, name)), name
    torch.testing.assert_close(traj_cpu.erank, traj_gpu.erank, rtol=1e-6, atol=1e-6)
    # the lens's rows go in 64-row blocks and vocabulary chunks on the CPU, in one block and
    # one product on a GPU: the same ranks and top tokens, logits to rounding
    for name in ("rank", "lens_top", "lens_cells"):
        assert torch.equal(getattr(traj_cpu, name), getattr(traj_gpu, name)), name
    torch.testing.assert_close(traj_cpu.lens_top_logit, traj_gpu.lens_top_logit, equal_nan=True)


def test_nothing_keeps_a_model_alive_after_collecting():
    """The per-model hub holds its adapter only while collectors are attached: a model the user
    drops is freed (the hubs are a weak mapping keyed by the model)."""
    import gc
    import weakref

    model = testing.tiny_model("gpt2")
    adapter = ModelAdapter(model)
    with odds_ratio.attach(adapter) as collector:
        adapter.forward(adapter.tokenize("a b c"))
    assert collector.result().stats.n_prompts == 1
    gone = weakref.ref(model)
    del model, adapter, collector
    gc.collect()
    assert gone() is None
