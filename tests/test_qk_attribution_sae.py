"""QK attribution over SAELens features (docs/math.md §10.7): with an SAE on the stream a layer
reads, either side of every score splits into the SAE's active features, its decoder bias and its
error term, still exactly; a feature planted to carry the key direction gets the score, and an
SAE without it leaves the score to its error term. SAELens needs TransformerLens 3.x."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_qk_attribution import planted_model

sae_lens = pytest.importorskip("sae_lens")

from tl_dynamics import qk_attribution, testing  # noqa: E402
from tl_dynamics.adapter import ModelAdapter, ResidualSplit  # noqa: E402
from tl_dynamics.errors import TLDynamicsError  # noqa: E402

PROMPTS = ["def f(x): return x + 1", "a b c a b c"]
PLANTED_PROMPT = "the cat sat on the mat and the dog"


def sae_on(hook: str, d_in: int = testing.D_MODEL, seed: int = 0, avoid=None):
    """A random StandardSAE (4 x d_in features) at ``hook``; with ``avoid`` (a unit vector), no
    decoder row writes along it, and features 0 and 1 read and write ``+avoid`` and ``-avoid``
    (so together they carry the stream's whole component along it)."""
    from sae_lens.saes.sae import SAEMetadata

    meta = SAEMetadata(hook_name=hook)
    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=d_in, d_sae=4 * d_in, metadata=meta))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
        if avoid is not None:
            sae.b_dec.zero_()
            sae.W_dec.sub_(torch.outer(sae.W_dec @ avoid, avoid))
            sae.W_enc[:, :2] = torch.stack([avoid, -avoid], 1)
            sae.b_enc[:2] = 0.0
            sae.W_dec[:2] = torch.stack([avoid, -avoid])
    return sae


@pytest.fixture(scope="module")
def gpt2():
    return testing.cached_model("gpt2")


def test_features_sum_to_the_components_and_the_scores(gpt2):
    adapter = ModelAdapter(gpt2)
    sae = sae_on("blocks.1.hook_resid_pre")
    split = ResidualSplit(adapter, 1, sae=sae)
    res = split.run(PROMPTS)
    feats = split.features(res)
    assert sum(k == "feature" for k in feats.kinds) > 10  # a real split, not only the error
    total = res.vectors().sum(0)
    err = (feats.vectors().sum(0) - total)[res.valid].abs().max() / total[res.valid].abs().max()
    assert float(err) < 1e-5
    got = qk_attribution.compute(adapter, PROMPTS, layers=1, sae=sae, sae_side="key")
    assert max(max(e.values()) for e in got.errors.values()) < 1e-4, got.errors
    assert got.key_names(1)[-3:] == ("SAE decoder bias", "SAE error", "key bias")
    assert got.query_names(1)[0] == "token embedding" and 1 in got.features
    shares = got.shares(1, 0, "key")
    ok = np.isfinite(shares).all(-1)
    assert ok.any() and np.allclose(shares[ok].sum(-1), 1.0)
    # one pair: the feature x component matrix adds up to the same score as the components'
    plain = qk_attribution.pair(adapter, "a b c a b", 1, 2, dest=4, src=2)
    split_pair = qk_attribution.pair(adapter, "a b c a b", 1, 2, dest=4, src=2, sae=sae)
    assert abs(split_pair.matrix.sum() - plain.matrix.sum()) < 1e-4 * max(1.0, abs(plain.raw))
    assert split_pair.raw == plain.raw
    assert any(label.startswith("SAE feature ") for label in split_pair.query_labels)
    assert split_pair.key_labels[-3:] == ("SAE decoder bias", "SAE error", "key bias")


def planted_direction(model) -> torch.Tensor:
    """The unit direction L1H0 of the planted model reads its key along."""
    W_K = ModelAdapter(model).W_K(1)[0, :, 0]
    return W_K / W_K.norm()


def test_a_feature_carrying_the_key_direction_gets_the_score():
    model = planted_model()
    v = planted_direction(model)
    carries = sae_on("blocks.1.hook_resid_pre", avoid=v)
    blind = sae_on("blocks.1.hook_resid_pre", avoid=v, seed=1)
    with torch.no_grad():  # the control: no feature writes along v
        blind.W_dec[:2] = 0.0
    p = qk_attribution.pair(model, PLANTED_PROMPT, 1, 0, dest=7, src=3, sae=carries, sae_side="key")
    a = p.query_labels.index(f"token embedding of '{p.dest_token}'")
    cols = [
        p.key_labels.index(f"SAE feature {f}") for f in (0, 1) if f"SAE feature {f}" in p.key_labels
    ]
    assert cols and p.matrix[a, cols].sum() / p.matrix.sum() >= 0.95  # the one active at src
    res = qk_attribution.compute(
        model, PLANTED_PROMPT, layers=1, heads=0, sae=carries, sae_side="key"
    )
    kn = res.key_names(1)
    shares = res.shares(1, 0, "key")
    counted = res.rows[(1, 0)]["rows"] & np.isfinite(shares).all(-1)
    assert counted.sum() >= 5
    carried = [kn.index(f"SAE feature {f}") for f in (0, 1) if f"SAE feature {f}" in kn]
    planted = shares[..., carried].sum(-1)
    assert (planted[counted] >= 0.95).all()
    control = qk_attribution.compute(
        model, PLANTED_PROMPT, layers=1, heads=0, sae=blind, sae_side="key"
    )
    error = control.shares(1, 0, "key")[..., control.key_names(1).index("SAE error")]
    assert (error[counted] >= 0.95).all()


def test_what_is_not_exact_is_refused_by_name(gpt2):
    with pytest.raises(
        TLDynamicsError, match="features can split layer 0's queries and keys, not layer 1's"
    ):
        qk_attribution.compute(gpt2, "a b", layers=1, sae=sae_on("blocks.0.hook_resid_pre"))
    with pytest.raises(TLDynamicsError, match="reads 'blocks.1.hook_resid_mid'"):
        qk_attribution.pair(gpt2, "a b", 1, 0, 1, 0, sae=sae_on("blocks.1.hook_resid_mid"))
    with pytest.raises(TLDynamicsError, match="sae_side 'value'; valid"):
        qk_attribution.pair(
            gpt2, "a b", 1, 0, 1, 0, sae=sae_on("blocks.1.hook_resid_pre"), sae_side="value"
        )
    with pytest.raises(TLDynamicsError, match="sae must be a SAELens SAE"):
        qk_attribution.compute(gpt2, "a b", layers=1, sae=object())


def test_a_spliced_sae_is_exact_with_its_error_term_and_refused_without():
    base = testing.tiny_hooked()
    model = sae_lens.HookedSAETransformer(base.cfg, tokenizer=base.tokenizer)
    model.load_state_dict(base.state_dict())
    model.eval()
    sae = sae_on("blocks.1.hook_resid_pre")
    model.add_sae(sae, use_error_term=True)  # the stream flows on unchanged
    got = qk_attribution.compute(model, PROMPTS, layers=1, sae=sae)
    assert max(max(e.values()) for e in got.errors.values()) < 1e-4, got.errors
    model.reset_saes()
    model.add_sae(sae_on("blocks.0.hook_resid_post"), use_error_term=False)
    with pytest.raises(
        TLDynamicsError, match="spliced at 'blocks.0.hook_resid_post' without use_error_term"
    ):
        qk_attribution.compute(model, PROMPTS, layers=1)
