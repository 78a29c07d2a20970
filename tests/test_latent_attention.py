"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, Youtu) in every analysis
(docs/math.md §1.7): the adapter's factors against the model's hooks and the Hugging Face twin's
own modules, the gain-folded W_Q/W_K/W_V as the exact linearisation of those factors, the score
split into a per-head non-rotary part and a rotary part whose key every head shares, the
circuits read through the factors, the contextual MLP's decoupled keys, and particles seeded from
a latent head."""

import re

import pytest
import torch

from test_architectures import boot_tiny
from tl_dynamics import circuits, contextual_mlp, particles, testing
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError

EXACT_TOL = 1e-5  # fp32 sums reordered (as in test_architectures)
ROUTE_TOL = 2e-4  # two fp32 routes to one number (small factors vs dense products)
LATENT = [
    "DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "YoutuForCausalLM",
]
# DeepSeek-V3 variants: half-layout rotary pairs, a plain q_proj (no query latent), a YaRN rope
# whose cos/sin carry a magnitude (mscale 1.139), and random biases on the down-projections.
YARN = dict(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=16,
    rope_theta=1e4,
    mscale=1.0,
    mscale_all_dim=0.0,
    beta_fast=32,
    beta_slow=1,
)
VARIANTS = {
    "rope-half": dict(rope_interleave=False),
    "no-q-latent": dict(q_lora_rank=None),
    "yarn": dict(rope_parameters=YARN),
    "biases": dict(attention_bias=True),
}
CASES = [(name, None) for name in LATENT] + [("DeepseekV3ForCausalLM", v) for v in VARIANTS]


def _model(name, variant=None):
    """A tiny latent-attention model whose latent norm gains (Hugging Face: ones) are random, so
    a gain left out or applied twice shows; with ``"biases"`` random biases too."""
    model = boot_tiny(name, **VARIANTS.get(variant, {}))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for path, module in model.original_model.named_modules():
            if path.endswith(("q_a_layernorm", "kv_a_layernorm")):
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=gen))
            if (
                variant == "biases"
                and isinstance(module, torch.nn.Linear)
                and module.bias is not None
            ):
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen))
    return model


def _twin_factors(twin, layer, order):
    """Queries, keys, values and the latent RMS scales straight from the Hugging Face twin's own
    modules (rotary coordinates put in ``order``), as functions of the attention input."""
    attn = twin.model.layers[layer].self_attn
    n, d_nope, d_rope = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    cols = list(range(d_nope)) + [d_nope + i for i in order]

    def rms(u, norm):
        return torch.sqrt(u.pow(2).mean(-1) + norm.variance_epsilon)

    def q(x):
        y = (
            attn.q_proj(x)
            if attn.q_lora_rank is None
            else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        )
        return y.reshape(*x.shape[:-1], n, -1)[..., cols]

    def rho_q(x):
        if attn.q_lora_rank is None:
            return torch.ones(x.shape[:-1])
        return rms(attn.q_a_proj(x), attn.q_a_layernorm)

    def kv(x):
        latent, rope = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, d_rope], -1)
        up = attn.kv_b_proj(attn.kv_a_layernorm(latent)).reshape(*x.shape[:-1], n, -1)
        rope = rope[..., order][..., None, :].expand(*up.shape[:-1], d_rope)
        return torch.cat((up[..., :d_nope], rope), -1), up[..., d_nope:]

    def rho_kv(x):
        return rms(attn.kv_a_proj_with_mqa(x)[..., : attn.kv_lora_rank], attn.kv_a_layernorm)

    return q, kv, rho_q, rho_kv


def _valid_max(diff, rows):
    return float((diff.abs().flatten(2).amax(-1) * rows).max())


@pytest.mark.parametrize("name,variant", CASES, ids=[v or n for n, v in CASES])
def test_latent_factors_are_the_models_queries_keys_and_values(name, variant):
    """The factors reproduce the scored (rotated) q and k and the values on a left-padded batch,
    equal the twin's own modules, and the gain-folded W_Q/W_K/W_V are their linearisation:
    x W_Q + b_Q = rho_q(x) q(x), x W_K^nope + b = rho_kv(x) k^nope(x), x W_K^rope + b = k^rope(x),
    x W_V + b_V = rho_kv(x) v(x), with the RMS scales rho computed here from the twin."""
    model = _model(name, variant)
    adapter, twin = ModelAdapter(model), testing.hf_twin(model)
    for layer, la in adapter.attention(
        testing.PROMPTS, reference=True, inputs=True, padding_side="left"
    ).items():
        factors, rotation = adapter.latent(layer), adapter.rotation(layer)
        x, rows = la.reference["x"], la.query_valid
        positions = adapter.positions(la.allowed.any(1))
        d = factors.d_nope
        assert rotation.start == d and rotation.rotary_dim == factors.d_rope == la.q.shape[-1] - d
        scored_q = rotation.rotate(adapter.unrotated_queries(layer, x), positions)
        assert _valid_max(scored_q - la.q, rows) <= EXACT_TOL
        assert _valid_max(rotation.rotate(factors.keys(x), positions) - la.k, rows) <= EXACT_TOL
        assert _valid_max(factors.values(x) - la.v, rows) <= EXACT_TOL
        q, kv, rho_q, rho_kv = _twin_factors(twin, layer, factors.rope_order)
        with torch.no_grad():
            keys, values = kv(x)
            assert _valid_max(factors.queries(x) - q(x), rows) <= EXACT_TOL
            assert _valid_max(factors.keys(x) - keys, rows) <= EXACT_TOL
            lin_q = torch.einsum("bpm,hmd->bphd", x, adapter.W_Q(layer)) + adapter.b_Q(layer)
            lin_k = torch.einsum("bpm,hmd->bphd", x, adapter.W_K(layer)) + adapter.b_K(layer)
            lin_v = torch.einsum("bpm,hmd->bphd", x, adapter.W_V(layer)) + adapter.b_V(layer)
            sq, skv = rho_q(x)[..., None, None], rho_kv(x)[..., None, None]
            assert _valid_max(lin_q - sq * q(x), rows) <= EXACT_TOL
            assert _valid_max(lin_k[..., :d] - skv * keys[..., :d], rows) <= EXACT_TOL
            assert _valid_max(lin_k[..., d:] - keys[..., d:], rows) <= EXACT_TOL
            assert _valid_max(lin_v - skv * values, rows) <= EXACT_TOL
        W_K = adapter.W_K(layer)
        assert torch.equal(W_K[..., d:], W_K[:1, :, d:].expand_as(W_K[..., d:]))  # shared
        assert adapter.W_Q(layer).shape == (adapter.n_heads, adapter.d_model, la.q.shape[-1])


@pytest.mark.parametrize("name", LATENT)
def test_latent_scores_split_into_a_per_head_part_and_a_shared_rotary_part(name):
    """``score_parts``: the non-rotary part per head plus the rotary part, whose key is the same
    vector for every head, sum to the model's scores; their softmax is the Hugging Face twin's
    eager pattern."""
    model = _model(name)
    adapter, twin = ModelAdapter(model), testing.hf_twin(model)
    batch = adapter.tokenize(testing.PROMPTS, padding_side="right")
    captured = adapter.attention(batch, reference=True)
    with torch.no_grad():
        hf = twin(batch.tokens, attention_mask=batch.key_valid.long(), output_attentions=True)
    for layer, la in captured.items():
        nope, rope = adapter.latent(layer).score_parts(la)
        keep = la.allowed[:, None] & la.query_valid[:, None, :, None]
        assert float(((nope + rope - la.reference["scores"]).abs() * keep).max()) <= EXACT_TOL
        d = adapter.latent(layer).d_nope
        by_hand = torch.einsum("bihd,bjd->bhij", la.q[..., d:], la.k[:, :, 0, d:]) * la.scale
        assert torch.allclose(rope, by_hand, atol=EXACT_TOL)  # one rotary key for every head
        pattern = la.masked_softmax(nope + rope)
        rows = la.query_valid[:, None, :, None]
        assert float(((pattern - hf.attentions[layer]).abs() * rows).max()) <= EXACT_TOL
        assert not torch.allclose(nope[:, 0], nope[:, 1])  # the non-rotary part is per head


def _qk_parts_error(adapter):
    """Largest relative error between the model's score at query i + delta, key i and the
    circuit's two parts rescaled by the latent RMS scales: nope / (rho_q rho_kv) + rope / rho_q."""
    worst = 0.0
    for layer, la in adapter.attention(testing.PROMPTS[1], reference=True, inputs=True).items():
        factors, x = adapter.latent(layer), la.reference["x"][0]
        own = la.reference["scores"][0]
        scale = own.masked_fill(~la.allowed[0], 0).abs().amax((1, 2))
        rho_q, rho_kv = factors.query_rms(x), factors.key_rms(x)
        for delta in (0, 1, 3):
            i = torch.arange(x.shape[0] - delta)
            for head in range(adapter.n_heads):
                pair = (x[i + delta], x[i])
                nope = circuits.qk_circuit(adapter, layer, head, delta, pair, part="non-rotary")
                rope = circuits.qk_circuit(adapter, layer, head, delta, pair, part="rotary")
                whole = circuits.qk_circuit(adapter, layer, head, delta, pair).dense()
                assert torch.allclose(nope.dense() + rope.dense(), whole, atol=1e-5)
                mine = (nope.dense().diagonal() / rho_kv[i] + rope.dense().diagonal()) / rho_q[
                    i + delta
                ]
                err = (mine - own[head, i + delta, i]).abs().max() / scale[head]
                worst = max(worst, float(err))
    return worst


@pytest.mark.parametrize(
    "name,variant",
    [
        ("DeepseekV3ForCausalLM", None),
        ("DeepseekV2ForCausalLM", None),
        ("DeepseekV3ForCausalLM", "yarn"),
        ("DeepseekV3ForCausalLM", "biases"),
    ],
)
def test_latent_qk_circuit_parts_with_the_latent_scales_are_the_models_scores(name, variant):
    adapter = ModelAdapter(_model(name, variant))
    assert _qk_parts_error(adapter) <= EXACT_TOL
    notes = " ".join(circuits.qk_circuit(adapter, 1, 0).notes)
    assert "Multi-head latent attention" in notes and "rho_q(x)" in notes
    assert circuits.qk_circuit(adapter, 1, 0, part="rotary").name == "QK (rotary part) L1H0"


def test_latent_part_is_refused_where_it_does_not_apply():
    adapter = ModelAdapter(testing.tiny_model("llama"))
    message = (
        "part='rotary' is not valid: layer 0 of LlamaForCausalLM has no multi-head latent "
        "attention; part applies only there (valid here: None)"
    )
    with pytest.raises(TLDynamicsError, match=re.escape(message)):
        circuits.qk_circuit(adapter, 0, 0, part="rotary")
    latent = ModelAdapter(boot_tiny("DeepseekV3ForCausalLM"))
    with pytest.raises(
        TLDynamicsError,
        match=re.escape("part='rope' is not valid: valid: None, 'non-rotary', 'rotary'"),
    ):
        circuits.qk_circuit(latent, 0, 0, part="rope")
    assert ModelAdapter(testing.tiny_model("llama")).latent(0) is None


def _dense_heads(twin, layer):
    """``W_Q, W_K, W_V`` per head (gains folded, rotary columns in the twin's own order) and
    ``W_O``, from the twin's weights alone."""
    attn = twin.model.layers[layer].self_attn
    n, d_nope, d_rope = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    r_kv = attn.kv_lora_rank
    A_q = attn.q_a_proj.weight.T * attn.q_a_layernorm.weight
    W_Q = torch.einsum(
        "mr,hrd->hmd", A_q, attn.q_b_proj.weight.T.reshape(-1, n, d_nope + d_rope).transpose(0, 1)
    )
    A = attn.kv_a_proj_with_mqa.weight.T
    up = attn.kv_b_proj.weight.T.reshape(r_kv, n, -1).transpose(0, 1)
    latent = A[:, :r_kv] * attn.kv_a_layernorm.weight
    W_K = torch.cat((latent @ up[..., :d_nope], A[None, :, r_kv:].expand(n, -1, -1)), -1)
    W_V = latent @ up[..., d_nope:]
    W_O = attn.o_proj.weight.T.reshape(n, -1, attn.o_proj.weight.shape[0])
    return W_Q.detach(), W_K.detach(), W_V.detach(), W_O.detach()


def _positivity(matrix):
    lam = torch.linalg.eigvals(matrix.double())
    return float(lam.real.sum() / lam.abs().sum())


def test_latent_copying_positivity_and_composition_equal_dense_products_of_the_twin():
    """Copying and QK positivity scores and the Q/K/V-composition scores of a DeepSeek-V3 equal
    the same quantities formed densely from the Hugging Face twin's weights (vocabulary-sized
    circuits for the spectra, d_model x d_model W_QK and W_OV for composition)."""
    model = _model("DeepseekV3ForCausalLM")
    adapter, twin = ModelAdapter(model), testing.hf_twin(model)
    E, U = adapter.W_E.double(), adapter.W_U.double()
    copying = circuits.copying_scores(adapter, biases=False, chance=False)
    positivity = circuits.qk_positivity_scores(adapter, biases=False, chance=False)
    heads = {layer: _dense_heads(twin, layer) for layer in (0, 1)}
    for layer, (W_Q, W_K, W_V, W_O) in heads.items():
        for h in range(adapter.n_heads):
            ov = E @ (W_V[h] @ W_O[h]).double() @ U
            qk = E @ (W_Q[h] @ W_K[h].T).double() @ E.T  # offset 0: the rotation is the identity
            assert abs(_positivity(ov) - copying.score(layer, h)) <= ROUTE_TOL
            assert abs(_positivity(qk) - positivity.score(layer, h)) <= ROUTE_TOL
    comp = circuits.composition_scores(adapter, n_samples=10)
    W_Q, W_K, W_V, W_O = (w.double() for w in heads[1])
    for h1 in range(adapter.n_heads):
        left = (heads[0][2][h1] @ heads[0][3][h1]).double()  # earlier head's W_OV
        for h2 in range(adapter.n_heads):
            for kind, m in (
                ("Q", W_Q[h2] @ W_K[h2].T),
                ("K", W_K[h2] @ W_Q[h2].T),
                ("V", W_V[h2] @ W_O[h2]),
            ):
                want = (left @ m).norm() / (left.norm() * m.norm())
                assert abs(float(want) - float(comp.of(kind)[0, h1, 1, h2])) <= ROUTE_TOL
    assert any("value width" in note for note in comp.notes)  # the baseline's width is stated


def test_latent_contextual_mlp_is_exact_and_reads_the_decoupled_keys(tmp_path):
    """On a left-padded batch the MLP reproduces every head's output and pattern; its inputs are
    the model's queries (x W_Q + b_Q) / rho_q(x), and b_i = c k_i' with k_i' the decoupled key
    seen from the query: the non-rotary key of head h, and R_T^T R_i of the rotary key that the
    twin's kv_a_proj gives once per position, for every head."""
    model = _model("DeepseekV3ForCausalLM")
    adapter, twin = ModelAdapter(model), testing.hf_twin(model)
    rows = contextual_mlp.compute_rows(adapter, testing.PROMPTS, padding_side="left")
    for result in rows:
        for mlp in result:
            check = mlp.exactness()
            assert check.max_output_error <= EXACT_TOL
            assert float(check.pattern_error.max()) <= EXACT_TOL
    mlp = rows[1][1, 2]
    factors, rotation = adapter.latent(1), adapter.rotation(1)
    assert mlp.input_space == "query" and mlp.query_norm.scope == "latent"
    d, T = factors.d_nope, mlp.positions[-1]
    neurons = mlp.neurons(T)
    positions = adapter.positions(adapter.tokenize(testing.PROMPTS, padding_side="left"))[1]
    x = mlp.x[neurons.sources]
    attn = twin.model.layers[1].self_attn
    with torch.no_grad():
        latent, rope = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, factors.d_rope], -1)
        nope = attn.kv_b_proj(attn.kv_a_layernorm(latent)).reshape(len(x), adapter.n_heads, -1)
    rope = rope[:, list(factors.rope_order)]
    seen = rotation.rotate(
        torch.cat((torch.zeros(len(x), d), rope), -1), positions[neurons.sources]
    )
    seen = rotation.rotate(seen, positions[T].expand(len(x)), transpose=True)[:, d:]
    want = mlp.scale * torch.cat((nope[:, 2, :d], seen), -1)
    assert torch.allclose(neurons.b, want, atol=EXACT_TOL)
    with torch.no_grad():
        q = mlp.queries(mlp.x[T][None].double()).float()[0]
    assert torch.allclose(q, factors.queries(mlp.x[T])[2], atol=EXACT_TOL)
    back = contextual_mlp.ContextualMLP.load(mlp.save(tmp_path / "latent.safetensors"))
    assert back.query_norm.scope == "latent" and back.frame.rotation.start == d
    assert torch.equal(back.pattern(), mlp.pattern())  # the latent query map survives a file


def test_particles_seeded_from_a_latent_head_run():
    """``from_head`` on a latent head: Q^T K = W_Q W_K^T and V^T = W_V W_O as the twin's factors
    give them (gains folded in; the per-token latent scales are named among what is dropped),
    and the flow runs to finite states."""
    model = _model("DeepseekV3ForCausalLM")
    adapter, twin = ModelAdapter(model), testing.hf_twin(model)
    order = list(adapter.latent(1).rope_order)
    W_Q, W_K, W_V, W_O = _dense_heads(twin, 1)
    d = adapter.latent(1).d_nope
    cols = list(range(d)) + [d + i for i in order]
    hd = particles.from_head(adapter, 1, 3)
    assert torch.allclose(hd.qk.float(), W_Q[3][:, cols] @ W_K[3][:, cols].T, atol=1e-5)
    assert torch.allclose(hd.qk.float(), W_Q[3] @ W_K[3].T, atol=1e-5)  # order-free
    assert torch.allclose(hd.ov.float(), W_V[3] @ W_O[3], atol=1e-5)
    assert "latent RMS norms' per-token scales" in hd.source.dropped
    x0 = torch.nn.functional.normalize(
        torch.randn(
            1, 6, adapter.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
        ),
        dim=-1,
    )
    run = particles.simulate(x0, **hd.kwargs(), t_max=2.0)
    assert torch.isfinite(run.states).all()
