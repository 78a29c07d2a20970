"""SAELens (TransformerLens 3.x): SAEs spliced into a ``HookedSAETransformer``.

Inside attention (``hook_z``, ``hook_q``/``hook_k``, ``hook_pattern``, the attention output)
the adapter refuses the model by the hook's name: the head would write (or attend by) the SAE's
reconstruction, which the weights do not reproduce. In the residual stream and the MLPs every
analysis reads the spliced forward: the trajectories equal a ``run_with_cache`` of the spliced
model, the captured attention equals the spliced model's own, and the atlas's losses are the
spliced model's (its interventions grow the batch at the spliced point itself). Skipped where sae-lens is not
installed (the TransformerLens 4 environment: SAELens needs HookedTransformer).
"""

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens")

from tl_dynamics import atlas, circuits, testing, trajectories  # noqa: E402
from tl_dynamics.adapter import ModelAdapter  # noqa: E402
from tl_dynamics.errors import TLDynamicsError  # noqa: E402
from tl_dynamics.atlas import _probes  # noqa: E402

PROMPT = "def f(x): return x + 1"
# float32 forward passes of a tiny model, compared entry by entry
TOL = 1e-5


@pytest.fixture()
def model():
    """A tiny HookedSAETransformer with the weights of ``testing.tiny_hooked()``."""
    base = testing.tiny_hooked()
    spliced = sae_lens.HookedSAETransformer(base.cfg, tokenizer=base.tokenizer)
    spliced.load_state_dict(base.state_dict())
    return spliced.eval()


def sae_at(hook: str, d_in: int, seed: int = 0):
    """A random StandardSAE (4 x d_in features) reading and writing at ``hook``."""
    from sae_lens.saes.sae import SAEMetadata

    cfg = sae_lens.StandardSAEConfig(
        d_in=d_in, d_sae=4 * d_in, metadata=SAEMetadata(hook_name=hook)
    )
    sae = sae_lens.StandardSAE(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    if hook.endswith("hook_z"):
        sae.turn_on_forward_pass_hook_z_reshaping()
    return sae


ATTENTION = {
    "blocks.0.attn.hook_z": ("z", "the head would write the SAE's reconstruction, which W_V W_O"),
    "blocks.1.attn.hook_q": ("d_head", "attend and write by activations the SAE reconstructs"),
    "blocks.1.attn.hook_k": ("d_head", "attend and write by activations the SAE reconstructs"),
    "blocks.0.attn.hook_pattern": ("pos", "attend and write by activations the SAE reconstructs"),
    "blocks.1.hook_attn_out": ("d_model", "the head would write the SAE's reconstruction"),
    "ln_final.hook_normalized": ("d_model", "the logit lens recomputes the final normalisation"),
}


def _width(model, kind: str, n_pos: int) -> int:
    cfg = model.cfg
    return {
        "z": cfg.n_heads * cfg.d_head,
        "d_head": cfg.d_head,
        "pos": n_pos,
        "d_model": cfg.d_model,
    }[kind]


@pytest.mark.parametrize("hook", list(ATTENTION))
def test_an_sae_inside_attention_is_refused_by_name(model, hook):
    kind, why = ATTENTION[hook]
    n_pos = model.to_tokens(PROMPT).shape[1]
    model.add_sae(sae_at(hook, _width(model, kind, n_pos)))
    spliced = model.run_with_cache(PROMPT)[1]
    assert f"{hook}.hook_sae_output" in spliced  # the SAE is really in the forward pass
    message = f"SAE (_SAEWrapper) spliced at '{hook}': "
    for call in (
        lambda: ModelAdapter(model),
        lambda: circuits.copying_scores(model),
        lambda: trajectories.compute(model, PROMPT),
        lambda: atlas.compute(model),
    ):
        with pytest.raises(TLDynamicsError) as info:
            call()
        assert message in str(info.value) and why in str(info.value)
        assert "model.reset_saes()" in str(info.value)


def test_an_sae_spliced_after_the_adapter_was_made_is_refused(model):
    adapter = ModelAdapter(model)
    adapter.attention(PROMPT)  # fine before
    model.add_sae(sae_at("blocks.0.attn.hook_z", model.cfg.n_heads * model.cfg.d_head))
    with pytest.raises(TLDynamicsError, match=r"spliced at 'blocks\.0\.attn\.hook_z'"):
        adapter.attention(PROMPT)
    model.reset_saes()
    assert len(adapter.attention(PROMPT)) == model.cfg.n_layers


@pytest.mark.parametrize(
    "hooks",
    [
        ["blocks.1.hook_resid_pre"],
        ["blocks.0.hook_mlp_out"],
        ["blocks.0.hook_resid_mid", "blocks.1.hook_resid_pre"],
    ],
)
def test_saes_in_the_stream_are_read_as_spliced(model, hooks):
    """Trajectories and captured attention equal the spliced forward (run_with_cache), and
    differ from the model without the SAEs (so the SAEs matter)."""
    d = model.cfg.d_model
    _, clean = model.run_with_cache(PROMPT)
    for i, hook in enumerate(hooks):
        model.add_sae(sae_at(hook, d, seed=i))
    logits, cache = model.run_with_cache(PROMPT)

    def stream(name: str):
        return cache[f"{name}.hook_sae_output"] if name in hooks else cache[name]

    traj = trajectories.compute(model, PROMPT, flattened=True, lens="full")
    names = [
        f"blocks.{layer}.hook_{kind}"
        for layer in range(model.cfg.n_layers)
        for kind in ("resid_pre", "resid_mid")
    ] + [f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    assert traj.n_points == len(names)
    want = torch.stack([stream(name)[0].norm(dim=-1) for name in names])  # [point, pos]
    torch.testing.assert_close(traj.norm[0], want, rtol=TOL, atol=TOL)
    unspliced = torch.stack([clean[name][0].norm(dim=-1) for name in names])
    assert (traj.norm[0] - unspliced).abs().max() > 0.1
    # the logit lens at the last point is the spliced model's own prediction
    top = logits[0, :-1].argmax(-1)
    assert bool((traj.rank[0, -1, :-1][top == model.to_tokens(PROMPT)[0, 1:]] == 0).all())
    # attention captured from the spliced stream equals the spliced model's pattern and z
    errors = testing.reconstruction_errors(ModelAdapter(model), PROMPT)
    assert errors["pattern"] <= TOL and errors["z"] <= TOL


def test_atlas_losses_are_the_spliced_models(model):
    """The atlas grows the batch inside ``resid_pre`` of each layer (the spliced point itself
    here): its clean loss is the spliced model's own next-token loss on the same positions."""
    model.add_sae(sae_at("blocks.1.hook_resid_pre", model.cfg.d_model))
    res = atlas.compute(model, n_seq=2, seq_len=6)
    probes = _probes.build_probes(ModelAdapter(model), n_seq=2, seq_len=6)
    with torch.no_grad():
        per_token = model(probes.repeat.tokens, return_type="loss", loss_per_token=True)
    predicted = [p - 1 for p in probes.second_copy]  # loss_per_token[i] predicts token i + 1
    assert res.clean_loss == pytest.approx(float(per_token[:, predicted].mean()), abs=1e-4)
    assert "earlier layers run once" in " ".join(res.notes)
    # the interventions of layer 1 with resid_pre repeated at the spliced point equal them with
    # the input repeated (test_atlas's identity, here through the SAE)
    from tl_dynamics.atlas import _causal

    adapter = ModelAdapter(model)
    captures = adapter.attention(probes.natural)
    runner = _causal.CausalRunner(adapter, probes.natural, captures, {"all": None})
    repl = runner._replacements(captures[1], [0, 2])
    variants = [(0, 0, "mean"), (2, 1, "prior"), (0, 0, "likelihood")]
    shared = runner._forward(1, variants, repl, expand=True)
    repeated = runner._forward(1, variants, repl, expand=False)
    assert (shared - repeated).abs().max() <= 1e-4
    model.reset_saes()
    with torch.no_grad():
        clean = model(probes.repeat.tokens, return_type="loss", loss_per_token=True)
    assert abs(float(clean[:, predicted].mean()) - res.clean_loss) > 0.01  # the SAE matters
