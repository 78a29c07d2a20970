"""Every analysis on fp16 and bf16 models: upcast, runs, and its identities hold within the
precision of the model's dtype (issue 13, item 5; docs/math.md §7.2).

One tiny model per dtype and architecture (``testing.tiny_model(arch).to(dtype)``) and its
float32 twin (the same half-precision weights, upcast: ``.to(dtype).to(torch.float32)``).
Weight-only read-outs (circuits, the particle system's head dynamics) must equal the twin's
exactly; everything computed from a forward pass is compared with the model's own activations
or with the twin within the dtype's tolerance.
"""

import pytest
import torch

from helpers import HAS_HOOKED
from tl_dynamics import circuits, contextual_mlp, odds_ratio, particles, testing, trajectories
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.contextual_mlp import _frame

# Patterns (absolute) and outputs/norms (relative to the largest): the model rounds its scores,
# softmax and sums to its own dtype (8 bits of mantissa for bf16, 11 for fp16). Measured on the
# tiny gpt2 and llama (rotary): patterns <= 1.5e-3 fp16 and 6.6e-3 bf16; contextual-MLP outputs
# <= 1.0e-3 and 6.0e-3 relative; trajectory norms <= 6.0e-4 and 6.9e-3 relative, final cosines
# <= 5.0e-4 and 5.0e-3: the bounds of the adapter's own half-precision test (about 3x margin).
HALF_TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
# Weight-only analyses read float32 upcasts of the same weights: equal up to float32 rounding.
EXACT = 1e-6
DTYPES = (torch.float16, torch.bfloat16)
# Learned positions; rotary with grouped K/V; and HookedTransformer (TransformerLens 3.x) ones.
ARCHS = ("gpt2", "llama") + (("hooked-gpt2-like", "hooked-rotary") if HAS_HOOKED else ())


def tiny(arch: str):
    return (
        testing.tiny_hooked(arch[len("hooked-") :])
        if arch.startswith("hooked-")
        else testing.tiny_model(arch)
    )


@pytest.fixture(
    scope="module",
    params=[(a, d) for a in ARCHS for d in DTYPES],
    ids=lambda p: f"{p[0]}-{str(p[1]).split('.')[-1]}",
)
def pair(request) -> tuple[ModelAdapter, ModelAdapter, torch.dtype]:
    arch, dtype = request.param
    half = ModelAdapter(tiny(arch).to(dtype))
    twin = ModelAdapter(tiny(arch).to(dtype).to(torch.float32))
    assert half.dtype == dtype and twin.dtype == torch.float32
    return half, twin, dtype


def test_circuits_upcast_and_equal_the_float32_twin(pair):
    half, twin, _ = pair
    assert half.W_Q(0).dtype == torch.float32
    got = circuits.compute(half, testing.PROMPTS[0], n_samples=10)
    want = circuits.compute(twin, testing.PROMPTS[0], n_samples=10)
    torch.testing.assert_close(got.copying.scores, want.copying.scores, atol=EXACT, rtol=0)
    torch.testing.assert_close(
        got.qk_positivity.scores, want.qk_positivity.scores, atol=EXACT, rtol=0
    )
    torch.testing.assert_close(
        got.composition.scores, want.composition.scores, atol=EXACT, rtol=0, equal_nan=True
    )
    for key, prompt in got.prompt.items():
        torch.testing.assert_close(prompt.qk, want.prompt[key].qk, atol=EXACT, rtol=EXACT)


def test_odds_ratio_parts_reproduce_the_half_models_own_pattern(pair):
    half, _, dtype = pair
    result = odds_ratio.compute(half, list(testing.PROMPTS), keep_tensors=True)
    captured = half.attention(list(testing.PROMPTS), reference=True)
    for layer, la in captured.items():
        dec = result[layer]
        assert dec.pattern.dtype == torch.float32
        own = la.reference["pattern"].float()
        keep = la.allowed[:, None].expand_as(own)
        assert float((dec.pattern - own)[keep].abs().max()) <= HALF_TOL[dtype]
        # the split is exact on the upcast q, k: prior + likelihood + query term = c <q, k>
        parts = dec.parts
        total = parts.query_term[..., None] + parts.key_prior[..., None, :] + parts.loglik
        raw = la.raw_scores()
        scale = max(1.0, float(raw.abs().max()))
        assert float((total - raw).abs().max()) <= 1e-5 * scale
    shares = result.stats.shares()
    total = shares["attr_prior"] + shares["attr_loglik"] + shares.get("attr_bias", 0.0)
    assert abs(total - 1).max() < 1e-9
    frame = result.to_dataframe()
    assert frame[["attr_prior", "attr_loglik", "sink_mass"]].notna().all().all()


def test_contextual_mlp_runs_on_half_models_within_the_dtypes_precision(pair):
    half, _, dtype = pair
    result = contextual_mlp.compute(half, testing.PROMPTS[0])
    assert len(result) == half.n_layers * half.n_heads
    for mlp in result:
        exact = mlp.exactness()
        scale = max(1.0, float(mlp.reference_output.abs().max()))
        assert float(exact.output_error.max()) <= HALF_TOL[dtype] * scale, (mlp.layer, mlp.head)
        assert float(exact.pattern_error.max()) <= HALF_TOL[dtype], (mlp.layer, mlp.head)


def test_frame_check_tolerance_follows_the_dtype_and_still_catches_a_wrong_frame(pair):
    """The frame check allows a few rounding steps of the model's dtype, no more: a query off by
    10% (far beyond bf16's rounding) is still refused."""
    half, _, dtype = pair
    assert _frame.frame_tolerance(torch.float32) == _frame.FRAME_RTOL
    assert _frame.frame_tolerance(dtype) == _frame.FRAME_EPS_STEPS * torch.finfo(dtype).eps
    assert _frame.frame_tolerance(dtype) < 0.1
    batch = half.tokenize(testing.PROMPTS[0])
    la = half.attention(batch, layers=[0], inputs=True)[0]
    _frame.build_frames(half, la, batch.key_valid)  # passes as captured
    from dataclasses import replace

    from tl_dynamics.errors import TLDynamicsError

    wrong = replace(la, q=la.q * 1.1)
    with pytest.raises(TLDynamicsError, match="could not reproduce the scored"):
        _frame.build_frames(half, wrong, batch.key_valid)


def test_trajectories_of_a_half_model_match_its_float32_twin(pair):
    half, twin, dtype = pair
    got = trajectories.compute(half, testing.PROMPTS[0])
    want = trajectories.compute(twin, testing.PROMPTS[0])
    assert got.norm.dtype == torch.float32
    ok = torch.isfinite(want.norm)
    assert torch.equal(ok, torch.isfinite(got.norm))
    rel = ((got.norm - want.norm) / want.norm.abs().amax())[ok]
    assert float(rel.abs().max()) <= HALF_TOL[dtype]
    cos_ok = torch.isfinite(want.cos_final)
    assert float((got.cos_final - want.cos_final)[cos_ok].abs().max()) <= HALF_TOL[dtype]
    assert float((got.mean_cos - want.mean_cos).abs().max()) <= HALF_TOL[dtype]


def test_particles_seeded_from_a_half_model(pair):
    """The head dynamics are weights (equal to the twin's); the run is finite."""
    half, twin, _ = pair
    got = particles.compute(half, testing.PROMPTS[0], layers=0, heads=[0, 1])
    want = particles.compute(twin, testing.PROMPTS[0], layers=0, heads=[0, 1])
    for a, b in zip(got.head_dynamics, want.head_dynamics):
        for name in ("Q", "K", "V"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=EXACT, rtol=EXACT)
        assert a.beta == pytest.approx(b.beta, rel=EXACT)
    assert torch.isfinite(got.run.mean_cosine).all()
    assert got.model_clusters.shape == want.model_clusters.shape
