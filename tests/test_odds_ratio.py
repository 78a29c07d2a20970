"""The odds-ratio decomposition: exact identities against the model's own activations on every
architecture, streamed statistics against a direct per-row computation, planted heads, the
Markov-chain and barycentric views, views, report section and errors."""

import itertools
import math

import numpy as np
import pytest
import torch

from tl_dynamics import odds_ratio as orr
from tl_dynamics import testing, viz
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.odds_ratio import _fast, _labels, _stats
from tl_dynamics.errors import TLDynamicsError
from helpers import adapter_for, HAS_HOOKED
from tl_dynamics.odds_ratio import _collect
from tl_dynamics.odds_ratio import _markov
from tl_dynamics.odds_ratio import _simplex

# The split subtracts squared norms: in fp32 its parts sum back to c<q,k> within ~1e-7 times
# the size of the terms (c/2)(|q|^2 + |k|^2). Tolerances are 1e-5 relative to that magnitude
# (at least 1), so they read as the 1e-5 on the tiny models and scale on real ones.
REL_TOL = 1e-5
# Softmax outputs are compared absolutely (they are in [0, 1]).
PATTERN_TOL = 1e-5
# Streaming statistics vs a direct float64 computation from the per-prompt tensors.
STATS_TOL = 1e-4
KKT_TOL = 1e-6

if HAS_HOOKED:
    MODELS = [(variant, False) for variant in testing.HOOKED_VARIANTS]
else:
    MODELS = [(arch, compat) for arch in testing.HF_ARCHS for compat in (False, True)]
MODEL_IDS = [f"{a}-{'compat' if c else 'raw'}" for a, c in MODELS]
PADDING = [("single", "right"), ("batch", "right"), ("batch", "left")]
# A few models with each special feature: ALiBi bias, soft-cap + window, bidirectional, plain.
FEATURED = (
    ["alibi", "softcap", "local", "bidirectional", "gpt2-like"]
    if HAS_HOOKED
    else ["bloom", "gemma2", "bert", "gpt2", "llama"]
)


def masked_max(diff, keep) -> float:
    """Largest |diff| where ``keep`` (broadcast) is True."""
    return float(diff.abs().masked_fill(~keep.expand_as(diff), 0.0).max())


def prompt_for(kind: str):
    return testing.PROMPTS[0] if kind == "single" else list(testing.PROMPTS)


def skip_padded_encoder(adapter, kind):
    if kind == "batch" and adapter.info.host == "hooked" and adapter.is_encoder:
        pytest.skip(
            "a bidirectional HookedTransformer does not mask padding keys, so the adapter "
            "refuses padded batches there"
        )


# ------------------------------------------------------------------ exactness matrix
@pytest.mark.parametrize("kind,side", PADDING)
@pytest.mark.parametrize("arch,compat", MODELS, ids=MODEL_IDS)
def test_parts_sum_to_the_models_own_scores_and_pattern(arch, compat, kind, side):
    adapter = adapter_for(arch, compat)
    skip_padded_encoder(adapter, kind)
    layers = adapter.attention(prompt_for(kind), reference=True, padding_side=side)
    for la in layers.values():
        dec = _collect.decompose_layer(la, range(adapter.n_heads))
        parts = dec.parts
        total = parts.total()
        keep = la.allowed[:, None] & la.query_valid[:, None, :, None]
        magnitude = max(
            1.0, float((parts.query_term[..., :, None] + parts.key_prior[..., None, :]).max())
        )
        assert masked_max(total - la.raw_scores(), keep) <= REL_TOL * magnitude
        pattern = la.masked_softmax(la.capped(total))
        rows = la.query_valid[:, None, :, None].expand_as(pattern)
        assert masked_max(pattern - la.reference["pattern"], rows) <= PATTERN_TOL
        assert masked_max(dec.pattern - la.reference["pattern"], rows) <= PATTERN_TOL
        if la.spec.scores_hook == "logits":
            own = la.reference["scores"]
            assert masked_max(la.capped(total) - own, keep) <= REL_TOL * magnitude
        assert dec.precap == (la.spec.softcap is not None)
        for cf in (dec.prior_pattern, dec.likelihood_pattern):
            sums = cf.sum(-1)[la.query_valid[:, None].expand_as(cf[..., 0])]
            assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)
            assert float(cf.masked_fill(la.allowed[:, None], 0.0).abs().max()) == 0.0


def test_softcapped_models_say_the_split_is_pre_cap():
    arch = "softcap" if HAS_HOOKED else "gemma2"
    res = orr.compute(adapter_for(arch), testing.PROMPTS[0])
    assert res[0].precap and res.stats.softcap[0] == testing.SOFTCAP
    assert "pre-cap" in repr(res.show().components[0].caption)


def test_hand_computed_three_token_example():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]).reshape(1, 3, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]]).reshape(1, 3, 1, 2)
    parts = orr.split_scores(q, k, scale=0.5)
    assert parts.query_term[0, 0].tolist() == [0.25, 0.25, 0.5]
    assert parts.key_prior[0, 0].tolist() == [0.25, 1.0, 0.0]
    assert parts.loglik[0, 0].tolist() == [
        [0.0, -1.25, -0.25],
        [-0.5, -0.25, -0.25],
        [-0.25, -0.5, -0.5],
    ]
    assert parts.total()[0, 0].tolist() == [[0.5, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 1.0, 0.0]]
    assert parts.sigma2 == 2.0
    allowed = torch.ones(1, 3, 3, dtype=torch.bool)
    prior, lik = orr.counterfactual_patterns(parts, allowed)
    expected = torch.softmax(torch.tensor([0.25, 1.0, 0.0]), 0)
    assert torch.allclose(prior[0, 0, 2], expected)
    assert torch.allclose(lik[0, 0, 0], torch.softmax(torch.tensor([0.0, -1.25, -0.25]), 0))


# ------------------------------------------------------------------ statistics
def direct_stats(dec):
    """Independent float64 computation of the per-head statistics from the per-prompt parts:
    masked row means and centred products of the four parts themselves, log-softmaxes of the
    counterfactual logits."""
    p = dec.parts
    keys = dec.allowed[:, None].expand_as(p.loglik)
    rows = (dec.query_valid & (dec.allowed.sum(-1) >= 2))[:, None].expand_as(p.loglik[..., 0])
    prior = p.key_prior[..., None, :].double().expand_as(p.loglik)
    loglik = p.loglik.double()
    bias = p.bias.double() if p.bias is not None else torch.zeros_like(loglik)
    r = p.query_term[..., None].double() + prior + loglik + bias
    n = keys.double().sum(-1, keepdim=True).clamp(min=1)

    def c(x):
        x = x.masked_fill(~keys, 0.0)
        return (x - x.sum(-1, keepdim=True) / n).masked_fill(~keys, 0.0)

    def total(x):
        return x.masked_fill(~rows, 0.0).sum(dim=(0, 2)).numpy()

    def dot(x, y):
        return total((c(x) * c(y)).sum(-1))

    s = r if dec.softcap is None else dec.softcap * torch.tanh(r / dec.softcap)
    real = torch.log_softmax(s.masked_fill(~keys, -math.inf), -1)

    def kl(logits):
        other = torch.log_softmax(logits.masked_fill(~keys, -math.inf), -1)
        return total(torch.where(keys, real.exp() * (real - other), 0.0).sum(-1))

    return {
        "rows": total(torch.ones_like(r[..., 0])),
        "var_r": dot(r, r),
        "cov_r_prior": dot(r, prior),
        "cov_r_loglik": dot(r, loglik),
        "cov_prior_loglik": 2 * dot(prior, loglik),
        "var_prior": dot(prior, prior),
        "kl_prior": kl(prior + bias),
        "kl_loglik": kl(loglik + bias),
    }


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", FEATURED)
def test_streamed_statistics_equal_a_direct_per_row_computation(arch, side):
    adapter = adapter_for(arch)
    prompt = (
        testing.PROMPTS[0]
        if adapter.info.host == "hooked" and adapter.is_encoder
        else list(testing.PROMPTS)
    )
    res = orr.compute(adapter, prompt, padding_side=side)
    stats, shares, means = res.stats, res.stats.shares(), res.stats.means()
    for a, layer in enumerate(stats.layers):
        want = direct_stats(res[layer])
        rows = want["rows"]
        assert stats.sums["rows"][a].tolist() == rows.tolist()
        for key, mine in (
            ("cov_r_prior", shares["attr_prior"]),
            ("cov_r_loglik", shares["attr_loglik"]),
            ("cov_prior_loglik", shares["cov_prior_loglik"]),
            ("var_prior", shares["var_prior"]),
        ):
            np.testing.assert_allclose(
                mine[a], want[key] / want["var_r"], atol=STATS_TOL, rtol=STATS_TOL
            )
        for key in ("kl_prior", "kl_loglik"):
            np.testing.assert_allclose(
                means[key][a], want[key] / rows, atol=STATS_TOL, rtol=STATS_TOL
            )
    # the two variance decompositions each add up to one
    total = shares["attr_prior"] + shares["attr_loglik"] + shares["attr_bias"]
    np.testing.assert_allclose(total, 1.0, atol=1e-9)
    total = (
        shares["var_prior"]
        + shares["var_loglik"]
        + shares["var_bias"]
        + shares["cov_prior_loglik"]
        + shares["cov_bias"]
    )
    np.testing.assert_allclose(total, 1.0, atol=1e-6)
    assert (shares["cov_prior_loglik"] < 0).mean() > 0.5  # the anti-correlation math.md warns of


@pytest.mark.parametrize("side", ["left", "right"])
def test_fast_streaming_path_equals_the_direct_path(side):
    """The chunked path (matrix-product moments, banded keys, likelihood partition from the
    real pattern) against the direct full-tensor path, on real q/k with padding."""
    for arch in (
        ("gpt2-like", "bidirectional", "local") if HAS_HOOKED else ("gpt2", "bert", "mistral")
    ):
        adapter = adapter_for(arch)
        prompt = (
            testing.PROMPTS[0]
            if adapter.info.host == "hooked" and adapter.is_encoder
            else list(testing.PROMPTS)
        )
        for la in adapter.attention(prompt, padding_side=side).values():
            args = (la.q, la.k, la.scale, None, la.allowed, la.query_valid)
            assert _fast.row_facts(la.q, la.k, la.scale, la.allowed, la.query_valid) is not None
            fast, fast_sinks = _stats.layer_sums(*args, fast=True)
            direct, direct_sinks = _stats.layer_sums(*args, fast=False)
            for key in fast:
                torch.testing.assert_close(fast[key], direct[key], rtol=1e-4, atol=1e-5)
            for key in fast_sinks:
                torch.testing.assert_close(
                    fast_sinks[key].double(), direct_sinks[key].double(), rtol=1e-4, atol=1e-4
                )


@pytest.mark.parametrize("side", ["left", "right"])
def test_causal_row_sums_are_prefix_sums_and_mask_facts_are_shared(side):
    """A causal mask with padding is recognised (its row sums are float64 prefix sums, equal
    to the [pos, pos] product); a bidirectional one is not. One layer's mask facts serve the
    next layer only where its masks are equal."""
    causal = adapter_for("gpt2-like" if HAS_HOOKED else "gpt2")
    las = causal.attention(list(testing.PROMPTS), padding_side=side)
    first = las[min(las)]
    masks = _fast.MaskFacts.of(
        first.allowed, first.query_valid, first.spec.causal, first.spec.window
    )
    assert masks.prefix is not None and bool((~masks.key_valid).any())  # padded and causal
    values = first.k.permute(0, 2, 1, 3)
    for v in (values, values.pow(2).sum(-1).double()):
        torch.testing.assert_close(
            _fast._row_sums(masks.allowed_f, v, masks.prefix),
            _fast._row_sums(masks.allowed_f, v, None),
            rtol=1e-5,
            atol=1e-5,
        )
    for la in las.values():  # the adapter builds one mask per pass and kind: every layer's
        assert masks.matches(la.allowed, la.query_valid)
    shifted = first.allowed.roll(1, dims=0)
    assert not masks.matches(shifted, first.query_valid)
    encoder = adapter_for("bidirectional" if HAS_HOOKED else "bert")
    la = next(iter(encoder.attention(testing.PROMPTS[0]).values()))
    assert (
        _fast.MaskFacts.of(la.allowed, la.query_valid, la.spec.causal, la.spec.window).prefix
        is None
    )


def test_fast_path_is_exact_when_key_priors_span_far():
    """The likelihood-only log-partition is a masked log-sum-exp of its own, so a key whose
    prior is 144 nats above the rest (where exp(-prior) underflows) changes nothing."""
    q, k = planted("loud")
    k[0, 3] *= 4.0  # prior 0.25 * 576 = 144 nats above the rest
    allowed = torch.ones(1, 12, 12, dtype=torch.bool).tril()
    valid = torch.ones(1, 12, dtype=torch.bool)
    fast = _fast.row_facts(q, k, 0.5, allowed, valid, _fast.MaskFacts.of(allowed, valid, True))
    direct = _stats._direct_row_facts(q, k, 0.5, None, allowed, valid, None)
    for key in ("kl_prior", "kl_loglik", "neg_entropy", "var_r"):  # rows with >= 2 keys
        torch.testing.assert_close(
            fast[key][..., 1:].double(), direct[key][..., 1:].double(), rtol=1e-4, atol=1e-4
        )
    torch.testing.assert_close(fast["column"], direct["column"], rtol=1e-4, atol=1e-4)


def test_cpu_likelihood_partition_falls_back_where_the_product_underflows():
    """On the CPU the likelihood-only log-partition comes from the pattern by one product,
    ``lse - P_min + log sum_j p_ij exp(-(P_j - P_min))``. Here the rows from 3 on put all their
    weight on key 3, whose prior is 223 nats above the rest: every term of that sum underflows
    in float32, so the chunk must take the masked log-sum-exp (the product alone gives -inf),
    and equal the direct path."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 12, 1, 8, generator=gen)
    k = torch.randn(1, 12, 1, 8, generator=gen)
    k[0, 3, 0] = 30.0 * torch.eye(8)[0]  # prior 0.25 * 900 = 225
    q[0, 3:, 0] = 20.0 * torch.eye(8)[0]  # r = 300 on key 3, about +-10 elsewhere
    allowed = torch.ones(1, 12, 12, dtype=torch.bool).tril()
    valid = torch.ones(1, 12, dtype=torch.bool)
    fast = _fast.row_facts(q, k, 0.5, allowed, valid, _fast.MaskFacts.of(allowed, valid, True))
    direct = _stats._direct_row_facts(q, k, 0.5, None, allowed, valid, None)
    assert torch.isfinite(fast["kl_loglik"]).all()
    for key in ("kl_prior", "kl_loglik", "neg_entropy"):
        torch.testing.assert_close(
            fast[key][..., 1:].double(), direct[key][..., 1:].double(), rtol=1e-4, atol=1e-4
        )


def test_attach_streams_over_the_users_own_forward_passes():
    adapter = adapter_for("gpt2-like" if HAS_HOOKED else "gpt2")
    model = adapter.model
    tokens = [adapter.tokenize(p).tokens for p in testing.PROMPTS]
    threads = torch.get_num_threads()
    with orr.attach(model, layers=[1], heads=[0, 2]) as collector:
        for t in tokens:
            model(t)
    res = collector.result()
    assert res.stats.n_prompts == 2 and res.decompositions == ()
    singles = [orr.compute(adapter, t, layers=[1], heads=[0, 2]).stats for t in tokens]
    for key in res.stats.sums:
        np.testing.assert_allclose(
            res.stats.sums[key], singles[0].sums[key] + singles[1].sums[key], rtol=1e-6, atol=1e-9
        )
    assert torch.get_num_threads() == threads  # the statistics' own thread setting is undone
    model(tokens[0])  # hooks are gone after the block: nothing more is collected
    assert collector.result().stats.n_prompts == 2
    assert list(res.to_dataframe().index) == ["L1H0", "L1H2"]


def test_attach_forward_uses_the_padding_mask_and_keeps_tensors_on_request():
    adapter = adapter_for("gpt2-like" if HAS_HOOKED else "gpt2")
    with orr.attach(adapter, keep_tensors=True) as collector:
        collector.forward(list(testing.PROMPTS), padding_side="left")
    res = collector.result()
    direct = orr.compute(adapter, list(testing.PROMPTS), padding_side="left")
    np.testing.assert_allclose(res.stats.sums["var_r"], direct.stats.sums["var_r"], rtol=1e-6)
    assert res.stats.n_prompts == 2 and len(res.decompositions) == 1
    table = res.sink_table()
    assert len(table) == 2 * adapter.n_layers * adapter.n_heads
    assert set(table["wins_by"]) <= {"prior", "likelihood"}


# ------------------------------------------------------------------ planted heads
def planted(kind: str, n: int = 12, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    if kind == "loud":  # one key far louder than the rest, queries leaning towards it
        q = 0.3 * torch.randn(n, d, generator=g) + 1.0 * u
        k = 0.3 * torch.randn(n, d, generator=g)
        k[3] = 6.0 * u
    else:  # keys on a sphere (equal priors), each query near one key
        k = 3.0 * torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
        q = k[torch.randperm(n, generator=g)] + 0.05 * torch.randn(n, d, generator=g)
    return q.reshape(1, n, 1, d), k.reshape(1, n, 1, d)


@pytest.mark.parametrize(
    "kind,expected", [("loud", "prior-driven"), ("close", "likelihood-driven")]
)
def test_planted_heads_get_the_right_label_and_sink_mechanism(kind, expected):
    q, k = planted(kind)
    n = q.shape[1]
    allowed = torch.ones(1, n, n, dtype=torch.bool)
    sums, sinks = _stats.layer_sums(q, k, 0.5, None, allowed, torch.ones(1, n, dtype=torch.bool))
    attr_prior = float(sums["cov_r_prior"] / sums["var_r"])
    attr_loglik = 1.0 - attr_prior
    kept = [float(sums[k] / sums["rows"]) for k in ("top_real", "top_prior", "top_loglik")]
    assert _labels.point_label(attr_prior, attr_loglik, *kept) == expected
    if kind == "loud":
        assert int(sinks["sink_position"]) == 3 and int(sinks["sink_prior_rank"]) == 0
        assert float(sinks["sink_prior_adv"]) > float(sinks["sink_loglik_adv"])
        kl_prior, kl_loglik = sums["kl_prior"], sums["kl_loglik"]
        assert kl_prior < kl_loglik
    else:
        assert float(sums["kl_loglik"]) < float(sums["kl_prior"])
    assert _labels.point_label(0.5, 0.5, 1.0, 1.0, 1.0) == "mixed"


def test_permuting_the_tokens_of_a_bidirectional_head_permutes_the_result():
    adapter = adapter_for("bidirectional" if HAS_HOOKED else "bert")
    la = adapter.attention(testing.PROMPTS[0], layers=[1])[1]
    perm = torch.randperm(la.q.shape[1], generator=torch.Generator().manual_seed(1))
    base = orr.split_scores(la.q, la.k, la.scale)
    moved = orr.split_scores(la.q[:, perm], la.k[:, perm], la.scale)
    assert torch.allclose(moved.key_prior, base.key_prior[..., perm])
    assert torch.allclose(moved.loglik, base.loglik[..., perm, :][..., perm], atol=1e-6)
    allowed = la.allowed[:, perm][:, :, perm]
    valid = la.query_valid[:, perm]
    s1, _ = _stats.layer_sums(la.q, la.k, la.scale, None, la.allowed, la.query_valid)
    s2, _ = _stats.layer_sums(la.q[:, perm], la.k[:, perm], la.scale, None, allowed, valid)
    for key in s1:
        torch.testing.assert_close(s1[key], s2[key], rtol=1e-4, atol=1e-6)
    pattern = la.pattern([0])[0, 0]
    pi = _markov.stationary(pattern)
    torch.testing.assert_close(_markov.stationary(pattern[perm][:, perm]), pi[perm])


# ------------------------------------------------------------------ Markov chain
def test_markov_chain_statistics_satisfy_their_definitions():
    enc = adapter_for("bidirectional" if HAS_HOOKED else "bert")
    chain = orr.markov(enc, testing.PROMPTS[0], 1, 2)
    S = enc.attention(testing.PROMPTS[0], layers=[1])[1].pattern([2])[0, 0].double()
    assert not chain.causal
    torch.testing.assert_close(chain.stationary @ S, chain.stationary)
    assert abs(float(chain.stationary.sum()) - 1) < 1e-9 and (chain.stationary > 0).all()
    dec = orr.markov(adapter_for("gpt2-like" if HAS_HOOKED else "gpt2"), testing.PROMPTS[1], 0, 1)
    assert dec.causal and dec.stationary[0] == 1.0
    S = (
        adapter_for("gpt2-like" if HAS_HOOKED else "gpt2")
        .attention(testing.PROMPTS[1], layers=[0])[0]
        .pattern([1])[0, 0]
        .double()
    )
    t = dec.absorption_steps
    torch.testing.assert_close(t[1:], 1 + S[1:, 1:] @ t[1:])  # t = 1 + T t on transient states
    torch.testing.assert_close(
        torch.sort(dec.eigenvalues.real).values, torch.sort(torch.diagonal(S)).values
    )
    alpha, n = _markov.DAMPING, S.shape[0]
    walk = alpha * S + (1 - alpha) / n
    torch.testing.assert_close(dec.damped_stationary @ walk, dec.damped_stationary)
    assert 1.0 <= dec.effective_rank <= n
    assert (dec.row_entropy >= 0).all() and dec.row_entropy[0] == 0
    assert list(dec.to_dataframe().columns)[-1] == "absorption_steps"


def test_composition_through_depth():
    adapter = adapter_for("gpt2-like" if HAS_HOOKED else "gpt2")
    layers = adapter.attention(testing.PROMPTS[0])
    S0, S1 = (layers[l].pattern()[0].mean(0) for l in (0, 1))
    torch.testing.assert_close(orr.composed(adapter, testing.PROMPTS[0]).float(), S1 @ S0)
    eye = torch.eye(S0.shape[0])
    rollout = ((S1 + eye) / 2) @ ((S0 + eye) / 2)
    torch.testing.assert_close(
        orr.composed(adapter, testing.PROMPTS[0], residual=0.5).float(), rollout
    )
    one = orr.composed(adapter, testing.PROMPTS[0], layers=[1], heads={1: 3})
    torch.testing.assert_close(one.float(), layers[1].pattern([3])[0, 0])


# ------------------------------------------------------------------ simplex least squares
def brute_force(M: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Enumerate every support; solve the equality-constrained problem on it; keep the best
    feasible one (an independent solution for n <= 6)."""
    best = (math.inf, None)
    n = M.shape[1]
    for size in range(1, n + 1):
        for support in itertools.combinations(range(n), size):
            P = M[:, support].T - y[None]
            system = np.zeros((size + 1, size + 1))
            system[:size, :size] = P @ P.T
            system[:size, size] = system[size, :size] = 1.0
            rhs = np.zeros(size + 1)
            rhs[size] = 1.0
            a = np.linalg.lstsq(system, rhs, rcond=None)[0][:size]
            if (a >= -1e-12).all() and abs(a.sum() - 1) < 1e-9:
                point = a @ P
                if point @ point < best[0]:
                    best = (float(point @ point), point)
    return best


def test_simplex_solver_matches_brute_force_and_satisfies_kkt():
    rng = np.random.default_rng(0)
    for case in range(150):
        n, d = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        M = rng.normal(size=(d, n))
        if case % 3 == 0 and n > 2:
            M[:, 2] = (M[:, 0] + M[:, 1]) / 2  # affinely dependent vertices
        y = rng.normal(size=d) * rng.choice([0.1, 1.0, 3.0])
        sol = _simplex.simplex_lstsq(torch.tensor(M), torch.tensor(y))
        objective, point = brute_force(M, y)
        assert sol.kkt <= KKT_TOL
        assert abs(sol.objective - objective) <= 1e-9 * max(1.0, objective)
        np.testing.assert_allclose(sol.residual, point, atol=1e-8)
        assert (sol.coords >= 0).all() and abs(sol.coords.sum() - 1) < 1e-12


def test_kkt_residual_flags_a_non_optimal_point():
    P = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert _simplex.kkt_residual(P, np.array([0.5, 0.5])) < 1e-12
    assert _simplex.kkt_residual(P, np.array([1.0, 0.0])) > 0.5


def test_barycentric_view_on_a_model():
    adapter = adapter_for("gpt2-like" if HAS_HOOKED else "gpt2")
    view = orr.barycentric(adapter, testing.PROMPTS[0], 1, 0)
    assert float(view.kkt.max()) <= KKT_TOL
    la = adapter.attention(testing.PROMPTS[0], layers=[1])[1]
    O = la.source_outputs([0])[0, :, 0].double()
    for r in range(len(view.rows)):
        diff = view.S[r] - view.A[r]
        gram = O @ O.T
        assert abs(float(diff @ gram @ diff) - float(view.gap[r])) <= 1e-6 * max(
            1.0, float(view.gap[r])
        )
        assert float(view.fit_error[r]) <= float(view.head_error[r]) + 1e-9  # A is optimal
    assert len(view.rows) == len(view.tokens) - 1  # the last token has no next token
    vec = orr.barycentric(adapter, testing.PROMPTS[0], 1, 0, target=torch.zeros(adapter.d_model))
    assert len(vec.rows) == len(vec.tokens)
    assert isinstance(view.show(), viz.Group) and "gap" in view.to_dataframe().columns


# ------------------------------------------------------------------ views, report, errors
def test_views_show_the_three_patterns_and_parts_with_head_names():
    adapter = adapter_for("gpt2-like" if HAS_HOOKED else "gpt2")
    res = orr.compute(adapter, ["x = <b> & 1", "y"], layers=[1], heads=[0, 3])
    group = res[1].show(heads=3)
    patterns, parts = group.components[0], group.components[1]  # rows of heat maps
    names = [m.props["title"] for m in patterns.components]
    assert names == ["L1H3 real", "L1H3 prior-only", "L1H3 likelihood-only"]
    assert patterns.row and parts.row and all(m.name == "Heatmap" for m in parts.components)
    captions = " ".join(c.caption for c in group.components)
    for part in ("query term", "key prior", "log-likelihood"):
        assert part in captions
    tokens = group.components[-1]
    assert tokens.name == "ColoredTokensMulti" and "&lt;" in "".join(tokens.props["tokens"])
    page = viz.Page("odds ratio")
    page.add_section("t", [res.show()])
    assert "L1H3" in page.to_html()
    df = res.to_dataframe()
    assert {"attr_prior", "kl_prior", "label", "sink_mass", "sigma2"} <= set(df.columns)
    assert set(res[1].to_dataframe()["head_name"]) == {"L1H0", "L1H3"}


def test_report_section_shows_the_most_prior_and_likelihood_driven_heads():
    adapter = adapter_for("gpt2-like" if HAS_HOOKED else "gpt2")
    page = viz.Page("report")
    batch = adapter.tokenize(list(testing.PROMPTS))
    orr.report_section(page, adapter, batch)
    assert len(page.sections) == 1 and "odds ratio" in page.sections[0].title.lower()
    df = orr.compute(adapter, batch).to_dataframe()
    lines = [
        c.html
        for c in page.sections[0].items
        if isinstance(c, viz.Component) and c.name is None and c.html.startswith("<p>")
    ]
    assert len(lines) == 2
    for key, line in zip(("attr_prior", "attr_loglik"), lines):
        what = "prior" if key == "attr_prior" else "likelihood"
        carriers = df[df["label"] == f"{what}-driven"]
        if len(carriers):  # named only when it carries the label: the largest share among them
            top = carriers[key].idxmax()
            assert line.startswith(f"<p>{top}: the head most driven")
        else:
            top = df[key].idxmax()
            assert "most driven" not in line
            assert line.startswith("<p>No head is") or "undecided" in line
        assert f"{df.loc[top, key]:.3f}" in line and top in line


def test_layers_and_heads_follow_the_one_convention_and_are_keywords():
    adapter = adapter_for("gpt2-like" if HAS_HOOKED else "gpt2")
    res = orr.compute(adapter, "x = 1", layers=[0, 1], heads=2)
    assert list(res.to_dataframe().index) == ["L0H2", "L1H2"] and res[1].heads == (2,)
    with pytest.raises(TypeError):
        orr.compute(adapter, "x = 1", [0])
    with pytest.raises(TypeError):
        orr.attach(adapter, [0])


def test_bad_inputs_give_clear_errors():
    adapter = adapter_for("gpt2-like" if HAS_HOOKED else "gpt2")
    with pytest.raises(
        TLDynamicsError, match=r"layer 9 is out of range: this model has 2 layers \(valid: 0..1\)"
    ):
        orr.compute(adapter, "x", layers=[9])
    with pytest.raises(TLDynamicsError, match=r"head 4 is out of range.*valid: 0..3"):
        orr.compute(adapter, "x", heads=[4])
    with pytest.raises(TLDynamicsError, match="prompt is empty"):
        orr.compute(adapter, "")
    with pytest.raises(
        TLDynamicsError, match=r"head 2 was not decomposed in layer 0; decomposed heads: \[0\]"
    ):
        orr.compute(adapter, "x = 1", layers=0, heads=[0])[0].show(heads=2)
    with pytest.raises(
        TLDynamicsError, match=r"layer 1 was not decomposed; decomposed layers: \[0\]"
    ):
        orr.compute(adapter, "x = 1", layers=0)[1]
    with pytest.raises(
        TLDynamicsError, match="no per-prompt tensors were kept: pass keep_tensors=True"
    ):
        orr.compute(adapter, "x = 1", keep_tensors=False)[0]
    with pytest.raises(
        TLDynamicsError, match=r"unknown target 'logits'; valid: 'unembed', 'embed'"
    ):
        orr.barycentric(adapter, "x = 1", 0, 0, target="logits")
    with pytest.raises(
        TLDynamicsError, match=r"simplex_lstsq needs M \[d, n\] with n >= 1 and y \[d\]"
    ):
        _simplex.simplex_lstsq(torch.zeros(3, 2), torch.zeros(4))
    with pytest.raises(TLDynamicsError, match="must be row-stochastic"):
        _markov.stationary(torch.ones(3, 3))
    with pytest.raises(TLDynamicsError, match=r"absorption_steps needs a causal"):
        _markov.absorption_steps(torch.full((2, 2), 0.5))
    with pytest.raises(TLDynamicsError, match=r"damping alpha must be in \[0, 1\), got 1.5"):
        _markov.damped_stationary(torch.eye(2), alpha=1.5)
    with pytest.raises(TLDynamicsError, match="score scale c must be positive"):
        orr.split_scores(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), scale=0.0)


# ------------------------------------------------------------------ the real encoder
@pytest.fixture(scope="module")
def minilm():
    from tl_dynamics import zoo

    try:
        return ModelAdapter(zoo.load("minilm"))
    except TLDynamicsError as exc:  # the optional package is missing
        pytest.skip(f"real encoder unavailable: {exc}")


MINILM_PROMPTS = [
    "The cat sat on the mat because it was warm.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
]


MORE_SENTENCES = [
    "She poured the coffee into a mug and added some milk.",
    "The quick brown fox jumps over the lazy dog.",
    "Rain is expected tomorrow, so take an umbrella with you.",
    "He read the letter twice before he put it back in the drawer.",
    "The museum opens at nine and closes at five on weekdays.",
    "Our train was late because of snow on the tracks.",
]


def test_real_encoder_split_is_exact_relative_to_score_size(minilm):
    for la in minilm.attention(MINILM_PROMPTS, reference=True).values():
        dec = _collect.decompose_layer(la, range(minilm.n_heads))
        magnitude = float(
            (dec.parts.query_term[..., :, None] + dec.parts.key_prior[..., None, :]).max()
        )
        keep = la.allowed[:, None] & la.query_valid[:, None, :, None]
        assert masked_max(dec.parts.total() - la.raw_scores(), keep) <= REL_TOL * magnitude
        rows = la.query_valid[:, None, :, None].expand_as(dec.pattern)
        pattern = la.masked_softmax(dec.parts.total())
        assert masked_max(pattern - la.reference["pattern"], rows) <= PATTERN_TOL


def test_real_encoder_cls_sinks_win_by_likelihood_in_middle_layers(minilm):
    res = orr.compute(minilm, MINILM_PROMPTS, layers=[1, 2, 3, 4])
    sinks = res.sink_table()
    cls = sinks[(sinks["token"] == "[CLS]") & (sinks["mass"] > 0.4)]
    assert len(cls) >= 20  # most middle-layer heads put > 40% of their attention on [CLS]
    assert (cls["wins_by"] == "likelihood").mean() > 0.9
    assert cls["prior_rank"].median() >= 3  # [CLS]'s key is not among the loudest
    # a label is a verdict over prompts: eight sentences (the two above and six more)
    labels = orr.compute(minilm, MINILM_PROMPTS + MORE_SENTENCES, layers=[1, 2, 3, 4])
    counts = labels.to_dataframe()["label"].value_counts()  # 48 heads; measured: 22
    assert counts.get("likelihood-driven", 0) >= 16, counts
    assert counts.get("prior-driven", 0) == 0, counts


def test_one_heads_decomposition_equals_its_slice_of_the_layer():
    """``show_extremes`` forms only the shown head's split (a twelfth of the layer's cost at 12
    heads): it equals that head's slice of the whole layer's decomposition."""
    res = orr.compute(testing.tiny_model("gpt2"), ["a b c a b", "x y"], keep_tensors=True)
    lazy = res.decompositions[0]
    for layer in lazy:
        whole = res[layer]
        for head in whole.heads:
            one = lazy.heads_of(layer, [head])
            i = whole.head_index(head)
            assert one.heads == (head,)
            for name in ("query_term", "key_prior", "loglik"):
                assert torch.equal(getattr(one.parts, name)[:, 0], getattr(whole.parts, name)[:, i])
            assert torch.equal(one.prior_pattern[:, 0], whole.prior_pattern[:, i])
            assert torch.equal(one.likelihood_pattern[:, 0], whole.likelihood_pattern[:, i])
    assert "prior" in res.show_extremes()._repr_html_()
