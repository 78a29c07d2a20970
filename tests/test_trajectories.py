"""Depth-wise trajectories: per-token and particle statistics against naive recomputation from a
full residual cache, exact merging, padding invariance, the block Jacobian against the dense
one, class probes, errors and views, on every tiny architecture of the installed host."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from tl_dynamics import sphere, testing, trajectories as T, viz
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.collect import ExactSum
from tl_dynamics.trajectories import _cloud
from tl_dynamics.trajectories import _jacobian
from tl_dynamics.trajectories import _probe
from tl_dynamics.trajectories import _collect

HAS_HOOKED = testing.has_hooked_transformer()
PROMPTS = [
    "def f(x): return x + 1",
    "import torch",
    "a = b",
    "for i in range(10):",
    "x = torch.zeros(3)",
    "return None",
    "class A: pass",
    "print(x)",
]
# fp32 model activations re-derived in float32 elsewhere: differences are rounding (~1e-6 of the
# magnitudes); 1e-4 relative leaves room for padded-batch kernels reordering sums.
ATOL, RTOL = 1e-4, 1e-4
# A padded batch runs the same tokens through different-shaped kernels: float32 rounding only.
PAD_TOL = 2e-4
# Jacobian: power iteration stops at Ritz residual 1e-5 relative; singular values then agree
# with the dense SVD to ~1e-10 in exact arithmetic, float32 Jacobian products limit it to ~1e-6.
JAC_TOL = 1e-5
JAC_RTOL = 1e-4
PARALLEL = {"gptj", "gptneox", "phi"}  # attention and MLP in parallel: no mid-block state


@functools.lru_cache(maxsize=None)
def adapter(arch: str, compat: bool = False) -> ModelAdapter:
    if arch in testing.HF_ARCHS:
        return ModelAdapter(testing.tiny_bridge(arch, compat))
    return ModelAdapter(testing.tiny_hooked(arch))


# every architecture raw; compat mode (same modules, TL-shaped hooks) on a representative few
MODELS = [(a, False) for a in testing.HF_ARCHS] + [(a, True) for a in ("gpt2", "gemma2", "bert")]
if HAS_HOOKED:
    MODELS += [(v, False) for v in testing.HOOKED_VARIANTS]


# ---------------------------------------------------------------- naive reference
def full_cache(ad: ModelAdapter, batch, flattened: bool = False):
    """Every trajectory point's residual state, kept whole (the naive route)."""
    store: list[torch.Tensor] = []
    roles = []
    for layer in range(ad.n_layers):
        roles.append(("resid_pre", layer))
        if flattened:
            roles.append(("resid_mid", layer))
    roles.append(("resid_post", ad.n_layers - 1))
    with ad.hooks([(r, l, lambda z: store.append(z.detach().float().clone())) for r, l in roles]):
        logits = ad.forward(batch)
    return torch.stack(store, 1), logits  # [batch, point, pos, d]


def components(cos: np.ndarray, eps: float) -> list[int]:
    """Union-find connected components of cos > 1 - eps; label = smallest member."""
    n = len(cos)
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for i in range(n):
        for j in range(i + 1, n):
            if cos[i, j] > 1 - eps:
                a, b = find(i), find(j)
                parent[max(a, b)] = min(a, b)
    return [find(i) for i in range(n)]


def naive(ad: ModelAdapter, batch, eps=sphere.TRAJECTORY_EPS_GRID, flattened=False):
    z, logits = full_cache(ad, batch, flattened)
    out = {"z": z, "logits": logits, "prompts": []}
    n_points = z.shape[1]
    for b in range(z.shape[0]):
        real = batch.key_valid[b].nonzero().flatten().tolist()
        zb = z[b][:, real].double()  # [point, n, d]
        norm = zb.norm(dim=-1)
        r = {"norm": norm}
        steps = zb[1:] - zb[:-1]
        r["step"] = steps.norm(dim=-1)
        # a zero state (Gemma's zero BOS embedding row) has no direction: NaN by convention
        r["rel_step"] = torch.where(norm[:-1] > 0, r["step"] / norm[:-1], math.nan)
        c = (steps[1:] * steps[:-1]).sum(-1) / (steps[1:].norm(dim=-1) * steps[:-1].norm(dim=-1))
        r["turning"] = torch.rad2deg(torch.acos(c.clamp(-1, 1)))
        r["cos_final"] = (zb * zb[-1:]).sum(-1) / (norm * norm[-1:])
        hists, means, clusters, eranks, labels = [], [], [], [], []
        for p in range(n_points):
            u = np.nan_to_num((zb[p] / zb[p].norm(dim=-1, keepdim=True)).numpy())  # zero: isolated
            cos = np.clip(u @ u.T, -1, 1)
            iu = np.triu_indices(len(real), 1)
            hists.append(np.histogram(cos[iu], bins=_cloud.N_BINS, range=(-1, 1))[0])
            means.append(cos[iu].mean() if len(iu[0]) else math.nan)
            lab = [components(cos, e) for e in eps]
            labels.append(lab)
            clusters.append([len(set(x)) for x in lab])
            s = np.linalg.svd(u, compute_uv=False)
            p_ = s / s.sum()
            p_ = p_[p_ > 0]
            eranks.append(float(np.exp(-(p_ * np.log(p_)).sum())))
        r.update(
            hist=np.array(hists),
            mean_cos=np.array(means),
            clusters=np.array(clusters).T,
            erank=np.array(eranks),
        )
        merges = [
            [
                len(set(zip(labels[p][e], labels[p + 1][e]))) - len(set(labels[p + 1][e]))
                for p in range(n_points - 1)
            ]
            for e in range(len(eps))
        ]
        r["merges"] = np.array(merges)
        if not ad.is_encoder:
            nxt = batch.tokens[b, real[1:]]
            lens = ad.logit_lens(z[b][:, real[:-1]])  # [point, n-1, vocab]
            tgt = lens.gather(-1, nxt[None, :, None].expand(n_points, -1, 1))
            r["rank"] = (lens > tgt).sum(-1)
            own = logits[b, real[:-1]].float()
            r["model_rank"] = (own > own.gather(-1, nxt[:, None])).sum(-1)
        out["prompts"].append(r)
    return out


def test_exact_sum_is_associative():
    xs = torch.tensor([1e16, 1.0, -1e16, 0.1, 3.3e-5, 7.0], dtype=torch.float64)
    parts = [ExactSum.of(x[None]) for x in xs]
    left = functools.reduce(lambda a, b: a + b, parts)
    right = parts[0] + (parts[1] + (parts[2] + (parts[3] + (parts[4] + parts[5]))))
    assert left == right
    assert left.value()[0] == math.fsum(xs.tolist())
    assert float(xs.sum()) != math.fsum(xs.tolist())  # the plain float sum is order-dependent


@pytest.mark.parametrize("arch,compat", MODELS)
def test_statistics_match_naive_recomputation(arch, compat):
    ad = adapter(arch, compat)
    bidirectional_hooked = ad.info.host == "hooked" and ad.is_encoder
    prompts = PROMPTS[:1] if bidirectional_hooked else PROMPTS[:2]
    batch = ad.tokenize(prompts)
    traj = T.compute(ad, batch, lens="full")
    ref = naive(ad, batch)
    for b, r in enumerate(ref["prompts"]):
        real = batch.key_valid[b]
        for name in ("norm", "step", "rel_step", "turning", "cos_final"):
            mine = getattr(traj, name)[b][:, real].double()
            torch.testing.assert_close(
                mine, r[name], atol=ATOL, rtol=RTOL, msg=name, equal_nan=True
            )
        assert np.array_equal(traj.cos_hist[b].numpy(), r["hist"])
        np.testing.assert_allclose(traj.mean_cos[b].numpy(), r["mean_cos"], atol=ATOL)
        np.testing.assert_allclose(traj.erank[b].numpy(), r["erank"], rtol=RTOL)
        assert np.array_equal(traj.clusters[b].numpy(), r["clusters"])
        assert np.array_equal(traj.merges[b].numpy(), r["merges"])
        if ad.is_encoder:
            assert traj.rank is None and "not applicable" in traj.lens_note
            continue
        n = int(real.sum())
        assert torch.equal(traj.rank[b][:, real][:, : n - 1], r["rank"])
        # the lens at the last point is the model's own prediction (its own logits)
        assert torch.equal(traj.rank[b, -1][real][: n - 1], r["model_rank"])
        top1 = (r["rank"] == 0).flip(0).long().cumprod(0).flip(0).bool()
        expect = torch.where(top1.any(0), top1.long().argmax(0), traj.n_points)
        assert torch.equal(traj.settling[b][real][: n - 1], expect)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_does_not_change_per_token_results(arch, side):
    ad = adapter(arch)
    prompts = PROMPTS[:3]
    padded = T.compute(ad, prompts, padding_side=side, lens="full")
    for b, prompt in enumerate(prompts):
        single = T.compute(ad, prompt, lens="full")
        real = padded.key_valid[b]
        for name in (
            "norm",
            "step",
            "rel_step",
            "turning",
            "cos_final",
            "cos_embed",
            "dist_unembed",
        ):
            mine = getattr(padded, name)
            if mine is None:
                continue
            torch.testing.assert_close(
                mine[b][:, real],
                getattr(single, name)[0],
                atol=PAD_TOL,
                rtol=PAD_TOL,
                msg=f"{name} row {b}",
                equal_nan=True,
            )
        for name in ("rank", "settling"):
            if getattr(padded, name) is not None:
                assert torch.equal(getattr(padded, name)[b][..., real], getattr(single, name)[0])
        for name in ("cos_hist", "clusters", "merges"):
            assert torch.equal(getattr(padded, name)[b], getattr(single, name)[0]), name
        torch.testing.assert_close(padded.erank[b], single.erank[0], atol=PAD_TOL, rtol=PAD_TOL)


def test_stream_matches_naive_sums_and_merges_exactly():
    ad = adapter("gpt2")
    full = T.stream(ad, PROMPTS, batch_size=4, progress=False)
    half = T.stream(ad, PROMPTS[:4], batch_size=4, progress=False).merge(
        T.stream(ad, PROMPTS[4:], batch_size=4, progress=False)
    )
    assert half == full
    assert (
        _collect.merge(
            [
                T.stream(ad, PROMPTS[:4], batch_size=4, progress=False),
                T.stream(ad, PROMPTS[4:], batch_size=4, progress=False),
            ]
        )
        == full
    )
    assert full.n_prompts == len(PROMPTS)
    # against the naive recomputation, prompt by prompt
    refs = [naive(ad, ad.tokenize(p))["prompts"][0] for p in PROMPTS]
    n_tok = sum(r["norm"].shape[1] for r in refs)
    assert full.n_tokens == n_tok
    for name in ("norm", "step", "rel_step", "turning", "cos_final"):
        expect = sum(r[name].sum(1) for r in refs) / n_tok
        np.testing.assert_allclose(full.mean(name), expect.numpy(), rtol=RTOL, atol=ATOL)
    assert np.array_equal(full.cos_histogram(density=False), sum(r["hist"] for r in refs))
    for e_i, eps in enumerate(full.eps):
        expect = sum(r["clusters"][e_i] for r in refs) / len(refs)
        np.testing.assert_allclose(full.cluster_counts(eps), expect)
        assert full.cluster_counts(eps).shape == (ad.n_layers + 1,)
        np.testing.assert_allclose(
            full.mean_merges(eps), sum(r["merges"][e_i] for r in refs) / len(refs)
        )
    np.testing.assert_allclose(
        full.effective_rank(), sum(r["erank"] for r in refs) / len(refs), rtol=RTOL
    )
    n_lens = sum(r["rank"].shape[1] for r in refs)
    np.testing.assert_allclose(
        full.mean_rank(), sum(r["rank"].sum(1) for r in refs).numpy() / n_lens
    )
    # dataset standardiser = per-dimension moments of every real token's state
    states = torch.cat([naive(ad, ad.tokenize(p))["z"][0] for p in PROMPTS], dim=1)  # [P, N, d]
    std = full.standardizer()
    torch.testing.assert_close(std.mean, states.mean(1), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(std.std, states.std(1, unbiased=False), atol=1e-3, rtol=1e-3)


def test_merge_refuses_different_settings():
    ad = adapter("gpt2")
    a = T.stream(ad, PROMPTS[:2], progress=False)
    b = T.stream(ad, PROMPTS[:2], eps=(0.3,), progress=False)
    with pytest.raises(
        TLDynamicsError,
        match=r"cannot merge statistics computed differently: "
        r"they differ in \['eps'\]",
    ):
        a.merge(b)
    with pytest.raises(TLDynamicsError, match="eps=0.7 was not computed; valid: \\[0.3\\]"):
        b.cluster_counts(0.7)


def test_attach_during_user_forward_and_hooks_removed():
    ad = adapter("gpt2")
    batch = ad.tokenize(PROMPTS[:4])
    with T.attach(
        ad.model, lens=True
    ) as acc:  # the pass's own Batch (its padding) reaches the collector
        ad.forward(batch)
    assert acc.stats() == T.stream(ad, [batch], progress=False) == acc.result().stats
    n = acc.stats().n_prompts
    ad.forward(batch)  # outside the block: nothing more is recorded
    assert acc.stats().n_prompts == n
    with pytest.raises(RuntimeError, match="boom"):
        with T.attach(ad) as acc2:
            raise RuntimeError("boom")
    ad.forward(batch)
    with pytest.raises(TLDynamicsError, match="no forward pass has run inside attach"):
        acc2.result()
    with T.attach(
        ad, lens=True
    ) as acc3:  # the user's own call: its token ids are the pass's tokens
        ad.model(batch.tokens[:1])
    own = acc3.result()
    assert own.stats.has_lens and torch.equal(own.tokens, batch.tokens[:1].cpu())
    assert own.stats == T.stream(ad, [ad.tokenize(batch.tokens[:1])], progress=False)


def test_attach_result_is_computes_trajectory_for_every_pass():
    """Two passes of different lengths inside ``attach`` give what ``compute`` gives on each,
    stacked (the shorter padded), and the statistics of both."""
    ad = adapter("gpt2")
    first, second = ad.tokenize(PROMPTS[:2]), ad.tokenize(PROMPTS[2:5])
    with T.attach(
        ad, lens=True
    ) as acc:  # each pass brings its own Batch: nothing to set between them
        ad.forward(first)
        ad.forward(second)
    both = acc.result()
    assert isinstance(both, T.Trajectory) and both.tokens.shape[0] == 5
    assert both.stats == T.stream(ad, [first, second], progress=False)
    for rows, batch in ((slice(0, 2), first), (slice(2, 5), second)):
        alone = T.compute(ad, batch, lens="full")
        n = batch.tokens.shape[1]
        for name in ("norm", "step", "cos_final", "rank", "settling", "tokens", "key_valid"):
            torch.testing.assert_close(
                getattr(both, name)[rows][..., :n],
                getattr(alone, name),
                rtol=0,
                atol=0,
                equal_nan=True,
                msg=name,
            )
        for name in ("cos_hist", "clusters", "merges", "erank", "mean_cos"):  # per prompt
            torch.testing.assert_close(
                getattr(both, name)[rows],
                getattr(alone, name),
                rtol=0,
                atol=0,
                equal_nan=True,
                msg=name,
            )
        assert both.str_tokens[rows][0][:n] == alone.str_tokens[0]
    assert not both.key_valid[:2, first.tokens.shape[1] :].any()  # padding of the shorter pass
    assert len(both.to_dataframe()) == int(both.key_valid.sum()) * both.n_points


def test_flattened_trajectory_and_parallel_blocks():
    ad = adapter("gpt2")
    traj = T.compute(ad, PROMPTS[0], flattened=True)
    assert traj.labels == ("resid_pre0", "resid_mid0", "resid_pre1", "resid_mid1", "resid_post1")
    ref = naive(ad, ad.tokenize(PROMPTS[0]), flattened=True)["prompts"][0]
    torch.testing.assert_close(traj.step[0].double(), ref["step"], atol=ATOL, rtol=RTOL)
    for arch in sorted(PARALLEL):
        with pytest.raises(
            TLDynamicsError,
            match=r"flattened trajectory is not available for "
            r".*run attention and MLP in parallel",
        ):
            T.compute(adapter(arch), PROMPTS[0], flattened=True)


def test_layers_select_the_trajectory_points():
    """``layers`` keeps the inputs of the chosen blocks (and the final output): every per-point
    number is the full run's at those points, steps and events join the kept points."""
    ad = adapter("gpt2")
    full = T.compute(ad, PROMPTS[:2], lens="full")
    one = T.compute(ad, PROMPTS[:2], layers=1, lens="full")
    assert one.labels == ("resid_pre1", "resid_post1") == one.stats.labels

    def same(a, b):  # bit for bit, NaN at padding included
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    for name in ("norm", "cos_final", "rank", "cos_unembed", "erank", "mean_cos", "cos_hist"):
        same(getattr(one, name), getattr(full, name)[:, 1:])
    same(one.clusters, full.clusters[..., 1:])
    same(one.merges[..., 0], full.merges[..., 1])
    same(one.step[:, 0], full.step[:, 1])
    assert T.compute(ad, PROMPTS[0], layers=[1, 0]).labels == full.labels  # depth order
    with pytest.raises(TLDynamicsError, match="layer 5 is out of range"):
        T.compute(ad, "x", layers=5)
    with pytest.raises(
        TLDynamicsError, match="selects nothing|layers must name at least one layer"
    ):
        T.compute(ad, "x", layers=[])
    with pytest.raises(
        TLDynamicsError,
        match=r"cannot merge statistics computed differently: "
        r"they differ in \['labels'\]",
    ):
        full.stats.merge(T.stream(ad, PROMPTS[:2], layers=1, progress=False))


def test_encoder_has_no_next_token_statistics():
    ad = adapter("bert")
    stats = T.stream(ad, PROMPTS[:2], progress=False)
    assert not stats.has_lens
    with pytest.raises(
        TLDynamicsError,
        match="mean_rank needs the next-token statistics.*not applicable: .* is an encoder",
    ):
        stats.mean_rank()


@pytest.mark.parametrize("arch", ["gpt2"] + (["gpt2-like"] if HAS_HOOKED else []))
def test_jacobian_power_iteration_matches_dense(arch):
    ad = adapter(arch)
    prompt = PROMPTS[0]
    spec = _jacobian.block_jacobian(ad, prompt, layer=1, position=3, k=2, tol=JAC_TOL)
    dense = _jacobian.dense_block_jacobian(ad, prompt, layer=1, position=3).double()
    assert spec.converged and spec.iterations < T._jacobian.DEFAULT_MAX_ITER
    torch.testing.assert_close(
        spec.singular_values.double(), torch.linalg.svdvals(dense)[:2], rtol=JAC_RTOL, atol=0
    )
    radius = float(torch.linalg.eigvals(dense).abs().max())
    assert abs(spec.spectral_radius - radius) <= JAC_RTOL * radius
    assert spec.to_dataframe()["singular_value"].tolist() == spec.singular_values.tolist()
    # the injected input really is the block's input: central differences of the real model
    batch = ad.tokenize(prompt)
    v = torch.randn(ad.d_model, generator=torch.Generator().manual_seed(0))
    v = v / v.norm()
    h = 1e-2  # float32: smaller steps lose digits to rounding, larger ones to curvature
    outs = []
    for sign in (1, -1):

        def bump(act, sign=sign):
            act[0, 3] += sign * h * v

        store = []
        with ad.hooks(
            [
                ("resid_pre", 1, bump),
                ("resid_post", 1, lambda a, store=store: store.append(a[0, 3].clone())),
            ]
        ):
            ad.forward(batch)
        outs.append(store[0])
    fd = (outs[0] - outs[1]) / (2 * h)
    exact = (dense @ v.double()).float()
    assert float((fd - exact).norm() / exact.norm()) < 2e-3


def test_class_probe_separates_classes():
    ad = adapter("gpt2")
    prompts = [f"x{i} = {i}" for i in range(8)] + [f"def f{i}(): pass" for i in range(8)]
    labels = ["assign"] * 8 + ["def"] * 8
    probe = _probe.class_probe(ad, prompts, labels, test_fraction=0.25)
    assert probe.accuracy.shape == (ad.n_layers + 1,)
    assert sum(probe.test) == 4
    assert float(probe.accuracy.max()) == 1.0  # the prompts differ in their first tokens
    assert probe.class_vectors.shape == (ad.n_layers + 1, 2, ad.d_model)
    assert float(probe.attraction.median()) < 1.0
    df = probe.to_dataframe()
    assert list(df.index) == list(probe.labels)
    with pytest.raises(TLDynamicsError, match="needs at least 2 classes"):
        _probe.class_probe(ad, prompts[:3], ["a"] * 3)
    with pytest.raises(TLDynamicsError, match="need at least 2 per class"):
        _probe.class_probe(ad, prompts[:3], ["a", "a", "b"])
    with pytest.raises(TLDynamicsError, match="3 prompts and 2 labels"):
        _probe.class_probe(ad, prompts[:3], ["a", "b"])


def test_clear_errors():
    ad = adapter("gpt2")
    with pytest.raises(
        TLDynamicsError,
        match=r"eps must be a non-empty sequence of cluster "
        r"thresholds in \(0, 2\]",
    ):
        T.compute(ad, "x", eps=(0.0,))
    with pytest.raises(
        TLDynamicsError,
        match=r"standardize must be None, 'prompt' or TrajectoryStats\.standardizer\(\)'s result",
    ):
        T.compute(ad, "x", standardize="rogue")
    with pytest.raises(TLDynamicsError, match="batch_size must be a positive integer, got 0"):
        T.stream(ad, PROMPTS, batch_size=0)
    with pytest.raises(TLDynamicsError, match="stream takes an iterable of prompts"):
        T.stream(ad, "one prompt")
    with pytest.raises(
        TLDynamicsError,
        match=r"position 40 is out of range: prompt 0 has \d+ "
        r"real tokens",
    ):
        _jacobian.block_jacobian(ad, "x = 1", layer=0, position=40)
    with pytest.raises(TLDynamicsError, match="layer 5 is out of range"):
        _jacobian.block_jacobian(ad, "x = 1", layer=5)
    with pytest.raises(TLDynamicsError, match=r"k must be an integer in 1..64"):
        _jacobian.block_jacobian(ad, "x = 1", layer=0, k=0)
    with pytest.raises(TLDynamicsError, match="unknown statistic 'speed'"):
        T.stream(ad, PROMPTS[:1], progress=False).mean("speed")
    with pytest.raises(TLDynamicsError, match="prompt is empty"):
        T.compute(ad, "")


def test_standardize_options():
    ad = adapter("gpt2")
    stats = T.stream(ad, PROMPTS, batch_size=4, progress=False)
    again = T.stream(ad, PROMPTS, batch_size=4, standardize=stats.standardizer(), progress=False)
    per_prompt = T.compute(ad, PROMPTS[:2], standardize="prompt", skip_first=True)
    assert again.meta["standardize"] == "dataset"
    assert again.n_tokens == stats.n_tokens
    # dataset-standardised states are centred: mean pairwise cosine near 0 at every point
    assert np.all(np.abs(again.mean_pairwise_cos()) < np.abs(stats.mean_pairwise_cos()) + 0.05)
    n = int(per_prompt.particle_mask[0].sum())
    assert n == int(per_prompt.key_valid[0].sum()) - 1
    assert int(per_prompt.cos_hist[0, 0].sum()) == n * (n - 1) // 2


def test_views_and_report_section():
    ad = adapter("gpt2")
    batch = ad.tokenize(PROMPTS[:3])
    traj = T.compute(ad, batch, lens="full")
    df = traj.to_dataframe()
    assert len(df) == int(batch.key_valid.sum()) * traj.n_points
    assert {"lens_rank", "settling", "step", "turning_deg", "cos_unembed"} <= set(df.columns)
    stats = T.stream(ad, PROMPTS[:3], progress=False)
    sdf = stats.to_dataframe()
    assert list(sdf.index) == list(stats.labels) and "clusters_eps0.1" in sdf.columns
    assert "ColoredTokens" in traj.show(0)._repr_html_()
    shown = stats.show()._repr_html_()
    assert shown.count("tld-figure tld-svg") == 3 and shown.count("<polyline") >= len(stats.labels)
    page = viz.Page("t")
    T.report_section(page, ad, batch)
    assert page.sections[-1].title == "Depth-wise trajectories"
    assert page.to_html().count("tld-figure tld-svg") == 3
    # the section is compute's result, shown: per-token views, then the batch's statistics
    assert traj.stats == T.stream(ad, [batch], progress=False)
    [shown] = page.sections[-1].items
    html = shown._repr_html_()
    assert isinstance(shown, viz.Group) and "ColoredTokens" in html and "per-point means" in html


def test_trained_lm_rank_improves_with_depth():
    zoo = pytest.importorskip("tl_dynamics.zoo")
    try:
        model = ModelAdapter(zoo.load("code-2l"))
    except TLDynamicsError as exc:
        pytest.skip(f"shipped model code-2l is missing or unusable on this host: {exc}")
    lines = [
        line.strip()[:48]
        for line in open(T.__file__.replace("__init__.py", "_points.py"))
        if len(line.strip()) > 20
    ][:48]
    stats = T.stream(model, lines, batch_size=16, progress=False)
    rank, log_rank = stats.mean_rank(), stats.mean("log_rank")
    # on average over tokens, the true next token ranks higher after the blocks than at the
    # embedding (the model's own prediction is the last point)
    assert log_rank[-1] < log_rank[0] and rank[-1] < rank[0], (rank, log_rank)
    assert stats.top1_rate()[-1] > stats.top1_rate()[0]


def test_induction_model_lens_rank_improves_on_repeats():
    zoo = pytest.importorskip("tl_dynamics.zoo")
    try:
        ad = ModelAdapter(zoo.load("induction-2l"))
    except TLDynamicsError as exc:
        pytest.skip(f"shipped model induction-2l cannot be used on this host: {exc}")
    seq = torch.randint(1, 64, (16, 20), generator=torch.Generator().manual_seed(0))
    traj = T.compute(ad, ad.tokenize(torch.cat([seq, seq], 1)), lens="full")
    second = traj.rank[:, :, 20:39].double().mean((0, 2))  # next token predictable by induction
    first = traj.rank[:, :, :19].double().mean((0, 2))  # random: nothing to predict
    assert second[-1] < 0.5 * second[0], second
    assert first[-1] > 0.5 * first[0], first


@pytest.mark.parametrize("n,d", [(300, 200), (200, 300)])
def test_cloud_blocks_equal_the_whole_matrix(n, d):
    """The effective rank's Gram taken block by block below the diagonal and the cosine
    histogram binned by row blocks (issue 15) against the SVD and a float64 floor of every
    pair, with padding."""
    from tl_dynamics.trajectories import _cloud

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, n, d, generator=gen) * torch.linspace(0.05, 2.0, d) + 1.0
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n // 3 :] = False
    u = sphere.unit(z) * mask[..., None]
    erank = _cloud.effective_rank(u, mask)
    cos, pairs = sphere.cosines(u), sphere.pair_mask(mask)
    hist = _cloud.cos_histogram(cos, pairs)
    ud = u.double()
    whole = ud @ ud.transpose(1, 2) if n <= d else ud.transpose(1, 2) @ ud
    for b in range(2):
        sigma = torch.linalg.eigvalsh(whole[b]).clamp_min(0.0).sqrt()  # the unblocked Gram
        p = sigma / sigma.sum()
        unblocked = torch.exp(-(p * torch.log(p.clamp_min(1e-300))).sum())
        np.testing.assert_allclose(float(erank[b]), float(unblocked), rtol=1e-12)
        s = np.linalg.svd(u[b][mask[b]].double().numpy(), compute_uv=False)
        p = s / s.sum()
        np.testing.assert_allclose(float(erank[b]), np.exp(-(p * np.log(p)).sum()), rtol=1e-6)
        bins = ((cos[b][pairs[b]].double() + 1.0) * (_cloud.N_BINS / 2.0)).floor().long()
        assert torch.equal(
            hist[b], torch.bincount(bins.clamp(0, _cloud.N_BINS - 1), minlength=_cloud.N_BINS)
        )


def test_cpu_bins_equal_the_float64_floor_near_every_edge():
    """``_cloud.bins`` (the CPU's arithmetic binning with a correction) against the float64
    floor on every float32 within 65,536 steps of each bin edge (at -1, 0 and 1 too) and on
    random cosines (it was checked once on every float32 in [-1, 1]); the float32 floor alone
    is one bin high on some of them."""
    from tl_dynamics.trajectories import _cloud

    edges = [-1.0 + 2.0 * k / _cloud.N_BINS for k in range(_cloud.N_BINS + 1)]
    bits = torch.tensor(edges, dtype=torch.float32).view(torch.int32).long()
    near = (bits[:, None] + torch.arange(-65536, 65537)).flatten()
    near = torch.cat([near, near | (1 << 31)])  # the same magnitudes, negative (and 0, -0)
    c = near.to(torch.int32).view(torch.float32)
    c = torch.cat([c[(c >= -1.0) & (c <= 1.0)], torch.rand(100_000) * 2 - 1])
    floor = ((c.double() + 1.0) * (_cloud.N_BINS / 2.0)).floor().long().clamp(0, _cloud.N_BINS - 1)
    assert torch.equal(_cloud.bins(c).long(), floor)
    assert torch.equal(_cloud.bins(c).long(), torch.bucketize(c, _cloud._THRESHOLDS, right=True))
    plain = ((c + 1.0) * (_cloud.N_BINS / 2.0)).floor().long().clamp(0, _cloud.N_BINS - 1)
    assert (plain >= floor).all() and (plain > floor).any()  # never low, sometimes high


def test_pair_cosine_sum_from_the_gram():
    """``rank_and_pair_sum``'s pair sum, ``(|sum u|^2 - trace Gram) / 2``, equals the float64
    sum of every pair's cosine ``i < j`` over the tokens kept, on both sides of the Gram."""
    from tl_dynamics.trajectories import _cloud

    gen = torch.Generator().manual_seed(1)
    for n, d in ((40, 30), (30, 40), (300, 200)):
        mask = torch.rand(2, n, generator=gen) > 0.3
        u = sphere.unit(torch.randn(2, n, d, generator=gen) + 0.5) * mask[..., None]
        ud = u.double()
        erank, pair_sum = _cloud.rank_and_pair_sum(ud)
        cos = ud @ ud.transpose(1, 2)
        want = (cos * sphere.pair_mask(mask)).sum((1, 2))
        torch.testing.assert_close(pair_sum, want, rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(erank, _cloud.effective_rank(u, mask), rtol=0, atol=0)
