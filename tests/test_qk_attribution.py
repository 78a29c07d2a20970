"""QK attribution (docs/math.md §10): the residual split and the score split are exact on every
matrix architecture the adapter reproduces, both hosts, float32 and bfloat16, or refused by name;
a hand-built model plants the one pair that writes a score."""

from __future__ import annotations

from xml.etree import ElementTree

import numpy as np
import pytest
import torch
from helpers import HAS_HOOKED

from tl_dynamics import qk_attribution, testing, viz, zoo
from tl_dynamics.adapter import ModelAdapter, ResidualSplit
from tl_dynamics.collect import Collector
from tl_dynamics.compat import bridge_class
from tl_dynamics.errors import TLDynamicsError

# Parts vs. the model's own stream, queries and keys (relative to the largest entry): float32
# reorders sums (~1e-7 seen), bfloat16 rounds every activation at ~4e-3 and its scores at ~1e-2.
RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
PROMPTS = ["def f(x): return x + 1", "a b c a b c"]
REFUSED = {  # architecture -> words its refusal names
    "gemma2": "post-attention norm",
    "gemma3": "post-attention norm",
    "olmo2": "post-attention norm",
    "bert": "post-LayerNorm",
    "gemma3-softcap": "post-attention norm",
    "olmo-clip-qkv": "clip_qkv",
}
SPLIT = [a for a in testing.HF_ARCHS if a not in REFUSED]
if HAS_HOOKED:
    SPLIT += [
        "gpt2-like",
        "rotary",
        "gqa-rms",
        "attn-only",
        "no-norm",
        "ln-pre",
        "softcap",
        "alibi",
        "qk-norm",  # frozen per head (tests/test_qk_attribution_qknorm.py)
    ]
    REFUSED |= {
        "olmo2-post-norm": "post-attention norm",
        "norm-before-after": "post-attention norm",
    }
else:
    SPLIT += ["native-rotary-gqa", "native-softcap-bidirectional"]


def gathered(adapter: ModelAdapter, prompt, layer: int):
    """The split of ``layer`` and the ``Residual`` of one pass on ``prompt``."""
    split = ResidualSplit(adapter, layer)
    kept: dict = {}

    class Keep(Collector):
        layers, points, inputs = split.layers, split.points, True

        def on_layer(self, state):
            kept[state.layer] = split.keep(state)

    batch = adapter.tokenize(prompt)
    with torch.no_grad(), adapter.collecting(Keep()):
        adapter.forward(batch)
    return split, split.gather(kept, batch), batch


def model_stream(adapter: ModelAdapter, batch, layer: int) -> torch.Tensor:
    seen = {}
    with adapter.hooks([("resid_pre", layer, lambda t: seen.__setitem__("r", t.float()))]):
        adapter.forward(batch)
    return seen["r"]


def rel(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> float:
    return float((a - b)[valid].abs().max() / b[valid].abs().max())


def with_random_norms(arch: str, dtype=torch.float32):
    """A fresh tiny model whose norm gains and shifts are random (the tiny models' are 1 and 0,
    which would hide a misread gain)."""
    model = testing.tiny_model(arch)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and any(k in name for k in ("ln", "norm", "layernorm")):
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen))
    return model.to(dtype)


@pytest.mark.parametrize("arch", SPLIT)
def test_parts_sum_to_the_stream_queries_and_keys(arch):
    adapter = ModelAdapter(testing.cached_model(arch))
    split, res, batch = gathered(adapter, PROMPTS, 1)
    valid = batch.key_valid
    assert rel(res.vectors().sum(0), model_stream(adapter, batch, 1), valid) < RTOL[torch.float32]
    got = qk_attribution.compute(adapter, PROMPTS, layers=1)
    worst = max(max(e.values()) for e in got.errors.values())
    assert worst < RTOL[torch.float32], got.errors


@pytest.mark.parametrize(
    "arch,dtype",
    [("gpt2", torch.float32), ("phi", torch.float32), ("opt", torch.float32)]
    + [("llama", torch.float32), ("gpt2", torch.bfloat16), ("llama", torch.bfloat16)],
)
def test_split_is_exact_with_random_norm_gains_in_float32_and_bfloat16(arch, dtype):
    adapter = ModelAdapter(with_random_norms(arch, dtype))
    split, res, batch = gathered(adapter, PROMPTS, 1)
    assert split.norm.gain is not None and float((split.norm.gain - 1).abs().max()) > 0.1
    assert res.errors["input norm"] < RTOL[dtype]
    assert rel(res.vectors().sum(0), model_stream(adapter, batch, 1), batch.key_valid) < RTOL[dtype]
    got = qk_attribution.compute(adapter, PROMPTS, layers=1)
    assert max(max(e.values()) for e in got.errors.values()) < RTOL[dtype], got.errors


@pytest.mark.parametrize("arch", ["gpt2", "phi", "opt"])
def test_embedding_and_mlp_parts_are_the_models_own(arch):
    """The token embedding is ``W_E[token]`` (OPT's positions start at 2); each MLP part is the
    model's own MLP output (sequential GPT-2 and OPT, parallel Phi)."""
    adapter = ModelAdapter(testing.cached_model(arch))
    split, res, batch = gathered(adapter, PROMPTS, 1)
    valid = batch.key_valid
    assert rel(res.coefficients[0], adapter.W_E[batch.tokens], valid) < 1e-5
    _, cache = adapter.model.run_with_cache(
        batch.tokens, attention_mask=batch.key_valid.long(), names_filter=["blocks.0.hook_mlp_out"]
    )
    mlp = res.coefficients[split.names.index("L0 MLP output")]
    assert rel(mlp, cache["blocks.0.hook_mlp_out"].float(), valid) < 1e-5


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_what_cannot_be_split_exactly_is_refused_by_name(arch):
    adapter = ModelAdapter(testing.cached_model(arch))
    with pytest.raises(TLDynamicsError, match=REFUSED[arch]):
        qk_attribution.compute(adapter, "a b c", layers=1)


def test_pair_matrix_and_odds_parts_sum_to_the_score():
    model = testing.cached_model("gpt2")
    p = qk_attribution.pair(model, "a b c a b", 1, 2, dest=4, src=2)
    assert abs(p.matrix.sum() + p.position - p.raw) < 1e-5 * max(1.0, abs(p.raw))
    parts = sum(v.sum() for v in p.parts.values())
    assert abs(parts - p.matrix.sum()) < 1e-5 * max(1.0, abs(p.raw))
    assert p.query_labels[0] == "token embedding of ' a'" and "L0H3 output" in p.key_labels
    frame = p.to_dataframe()
    assert len(frame) == p.matrix.size and abs(frame.score_part.sum() - p.matrix.sum()) < 1e-5


def test_softcapped_scores_are_attributed_before_the_cap():
    model = testing.cached_model("softcap" if HAS_HOOKED else "native-softcap-bidirectional")
    p = qk_attribution.pair(model, "a b c a b", 1, 0, dest=3, src=1)
    assert p.softcap is not None and abs(p.score - p.softcap * np.tanh(p.raw / p.softcap)) < 1e-5
    assert abs(p.matrix.sum() + p.position - p.raw) < 1e-5 * max(1.0, abs(p.raw))
    res = qk_attribution.compute(model, "a b c a b", layers=1, heads=0)
    assert res.precap and "before the cap" in res.show().fragment("n")


@pytest.mark.parametrize("arch", ["bloom"] + (["alibi"] if HAS_HOOKED else []))
def test_alibi_position_term_completes_the_score(arch):
    p = qk_attribution.pair(testing.cached_model(arch), "a b c a b", 1, 1, dest=4, src=1)
    assert p.position != 0.0
    assert abs(p.matrix.sum() + p.position - p.raw) < 1e-5 * max(1.0, abs(p.raw))


def test_marginals_add_up_and_attach_matches_compute():
    model = testing.cached_model("gpt2")
    res = qk_attribution.compute(model, PROMPTS, layers=1, heads=[0, 3])
    r = res.rows[(1, 0)]
    # both sides sum to the attention-weighted score (less the position term) on counted rows
    rows = r["rows"]
    assert np.allclose(r["query_w"].sum(-1)[rows], r["key_w"].sum(-1)[rows], atol=1e-5)
    shares = res.shares(1, 0, "key")
    ok = np.isfinite(shares).all(-1)
    assert ok.any() and np.allclose(shares[ok].sum(-1), 1.0)
    # the odds-ratio parts at the chosen key add to the pair lifts' total there
    lift = r["prior"].sum(-1) + r["like_q"].sum(-1) + r["like_k"].sum(-1)
    assert np.isfinite(lift[rows]).all()
    with qk_attribution.attach(model, layers=1, heads=[0, 3]) as qk:
        model(PROMPTS[0])
        model(PROMPTS[1])
    streamed = qk.result()
    for key in res.rows:
        for name in ("key_w", "query_u", "top_v"):
            a, b = res.rows[key][name], streamed.rows[key][name]
            n0, n1 = res.key_valid[0].sum(), res.key_valid[1].sum()
            assert np.allclose(a[0, :n0], b[0, :n0], atol=1e-5)
            assert np.allclose(a[1, :n1], b[1, :n1], atol=1e-5)
    frame = res.to_dataframe()
    assert set(frame.side) == {"query", "key"} and len(frame) == 2 * 2 * len(res.key_names(1))


def test_bad_arguments_are_refused_before_work():
    model = testing.cached_model("gpt2")
    with pytest.raises(TLDynamicsError, match="top_k must be a positive int"):
        qk_attribution.compute(model, "a b", top_k=0)
    with pytest.raises(TLDynamicsError, match="may not attend"):
        qk_attribution.pair(model, "a b c", 1, 0, dest=1, src=2)
    with pytest.raises(TLDynamicsError, match="dest 9; valid: 0..3"):
        qk_attribution.pair(model, "a b c", 1, 0, dest=9, src=0)
    res = qk_attribution.compute(model, "a b c", layers=1, heads=0)
    with pytest.raises(TLDynamicsError, match="side 'value'; valid"):
        res.shares(1, 0, "value")  # type: ignore[arg-type]
    with pytest.raises(TLDynamicsError, match="L1H2 was not computed"):
        res.leaders(1, 2)


def planted_model():
    """GPT-2 whose L1H0 reads its query only along ``u`` and its key only along ``v``; the token
    embedding alone writes ``u``, and L0H1 alone writes ``v`` (other heads leak 2% of it)."""
    import transformers

    folder = testing.hf_folder("gpt2")
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder)
    d, dh = hf.config.n_embd, hf.config.n_embd // hf.config.n_head
    gen = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.cat([torch.ones(d, 1), torch.randn(d, 2, generator=gen)], 1))
    u, v = basis[:, 1], basis[:, 2]  # unit, orthogonal, zero mean (orthogonal to ones)
    keep = torch.eye(d) - torch.outer(u, u) - torch.outer(v, v)
    with torch.no_grad():
        tr = hf.transformer
        tr.wte.weight.copy_(
            tr.wte.weight @ keep + 3 * torch.randn(tr.wte.weight.shape[0], 1, generator=gen) * u
        )
        tr.wpe.weight.copy_(tr.wpe.weight @ keep)
        h0 = tr.h[0]
        proj = h0.attn.c_proj.weight @ keep  # [heads * d_head, d_model]
        proj += 0.02 * torch.randn(d, 1, generator=gen) * v  # every head leaks a little along v
        proj[dh : 2 * dh] += 3 * torch.randn(dh, 1, generator=gen) * v  # L0H1 writes v
        h0.attn.c_proj.weight.copy_(proj)
        h0.attn.c_proj.bias.copy_(h0.attn.c_proj.bias @ keep)
        h0.mlp.c_proj.weight.copy_(h0.mlp.c_proj.weight @ keep)
        h0.mlp.c_proj.bias.copy_(h0.mlp.c_proj.bias @ keep)
        qkv = tr.h[1].attn.c_attn
        e = torch.zeros(dh)
        e[0] = 4.0
        qkv.weight[:, 0:dh] = torch.outer(u, e)
        qkv.weight[:, d : d + dh] = torch.outer(v, e)
        qkv.bias[0:dh] = 0.0
        qkv.bias[d : d + dh] = 0.0
    hf.save_pretrained(folder)
    return bridge_class().boot_transformers(str(folder), device="cpu").eval()


def test_the_one_planted_pair_carries_the_score():
    model = planted_model()
    res = qk_attribution.compute(model, "the cat sat on the mat and the dog", layers=1, heads=0)
    kn, qn = res.key_names(1), res.query_names(1)
    r = res.rows[(1, 0)]
    counted = r["rows"] & np.isfinite(res.shares(1, 0, "key")).all(-1)
    assert counted.sum() >= 5
    top = [(qn[a], kn[b]) for a, b in zip(r["top_a"][..., 0][counted], r["top_b"][..., 0][counted])]
    assert set(top) == {("token embedding", "L0H1 output")}
    assert (res.shares(1, 0, "key")[..., kn.index("L0H1 output")][counted] >= 0.95).all()
    assert (res.shares(1, 0, "query")[..., qn.index("token embedding")][counted] >= 0.95).all()
    p = qk_attribution.pair(model, "the cat sat on the mat and the dog", 1, 0, dest=7, src=3)
    a = p.query_labels.index(f"token embedding of '{p.dest_token}'")
    b = p.key_labels.index("L0H1 output")
    assert p.matrix[a, b] / p.matrix.sum() >= 0.95


def test_views_name_components_in_words_and_export(tmp_path):
    model = testing.cached_model("gpt2")
    adapter = ModelAdapter(model)
    toks = adapter.str_tokens(adapter.tokenize("x <b> a"))
    dest = max(i for i, t in enumerate(toks) if "<" in t)  # not the BOS <|endoftext|>
    p = qk_attribution.pair(model, "x <b> a", 1, 0, dest=dest, src=1)
    view = p.show()
    label = f"token embedding of '{toks[dest]}'"
    assert view.name == "Heatmap" and label in view.props["rowLabels"]
    view.save(tmp_path / "pair.svg")
    svg = (tmp_path / "pair.svg").read_text()
    ElementTree.fromstring(svg.encode())  # well-formed: the token text is escaped, not markup
    group = qk_attribution.compute(model, "x <b> a", layers=1, heads=0).show()
    assert isinstance(group, viz.Group)
    strips = next(c for c in group.components if isinstance(c, viz.Group))
    strips.save(tmp_path / "rows.svg")  # the share strips (the table has no .svg)
    group.save(tmp_path / "rows.html")


def test_heads_asked_out_of_order_get_their_own_keys():
    """Heads asked in any order are split in that order: each head's parts sum to its own keys
    (the grouped projection once returned them sorted, so a later head got an earlier one's)."""
    ad = ModelAdapter(zoo.load("induction-2l"))
    batch = ad.tokenize(["KQZ7XMBW2RKQZ7XMBW2R", "ABCDEFGHABCDEFGH"])
    mixed = qk_attribution.compute(ad, batch, layers=1, heads=[1, 0, 3, 2], pairs=False)
    for head in (0, 1, 2, 3):
        alone = qk_attribution.compute(ad, batch, layers=1, heads=head, pairs=False)
        for field in ("key_w", "query_w"):
            np.testing.assert_allclose(
                mixed.rows[(1, head)][field], alone.rows[(1, head)][field], rtol=1e-5, atol=1e-6
            )
