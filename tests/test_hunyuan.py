"""HunYuan dense on both TransformerLens versions (docs/math.md §1.6, adapter/_postrope.py).

Hugging Face rotates q and k, then RMS-normalises each head with a per-dimension gain ``w``.
TransformerLens 4.x does the same (its ``hook_q_normed`` fires after rotary; the adapter reads
it). TransformerLens 3.x normalises before rotary and fires ``hook_rot_q`` on ``R N(q)``: the
adapter reproduces that host exactly. The two orders agree when ``w`` is equal within each
rotated pair ``(k, k + d/2)`` (a random tiny model's unit gains: the matrix row is exact against
Hugging Face on both versions); with gains that split pairs, as a trained checkpoint has, 3.x's
patterns differ from Hugging Face's and the adapter says so when it is made
(``HostDiffersWarning``).
"""

import warnings

import pytest
import torch

from test_architectures import EXACT_TOL, boot_tiny
from tl_dynamics import compat, testing
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import HostDiffersWarning

NAME = "HunYuanDenseV1ForCausalLM"
DIFFERS = (
    f"{NAME} normalises q and k after rotary (Hugging Face), but TransformerLens 3.x normalises "
    "them before rotary"
)


def _split_gains(model):
    """Give every q/k norm gains that differ within rotated pairs (as trained weights do)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:
            orig = block.attn.original_component
            for norm in (orig.query_layernorm, orig.key_layernorm):
                norm.weight.copy_(1 + 0.5 * torch.randn_like(norm.weight))
    return model


def _made(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapter = ModelAdapter(model)
    return adapter, [str(w.message) for w in caught if w.category is HostDiffersWarning]


def test_unit_gains_agree_with_hugging_face_and_say_nothing():
    adapter, said = _made(boot_tiny(NAME))
    assert said == []
    errors = testing.hf_truth_errors(adapter, testing.hf_twin(adapter.model), testing.PROMPTS)
    assert max(errors.values()) <= EXACT_TOL, errors


def test_split_gains_host_exact_and_hugging_face_only_on_transformer_lens_4():
    model = _split_gains(boot_tiny(NAME))
    adapter, said = _made(model)
    for side in ("left", "right"):
        host = testing.reconstruction_errors(adapter, testing.PROMPTS, side)
        assert max(host["pattern"], host["scores"], host["z"], host["out"]) <= EXACT_TOL, host
    hf = testing.hf_truth_errors(adapter, testing.hf_twin(model), testing.PROMPTS, "left")
    if compat.tl_major_version() >= 4:
        assert said == [] and max(hf.values()) <= EXACT_TOL, hf
        return
    assert hf["pattern"] > 1e-2, hf  # TransformerLens 3.x itself scores another model
    assert len(said) == 1 and said[0].startswith(DIFFERS), said
    # what 3.x scores: the rotation of N(x W_Q), the norm read from the module (its own gains)
    la = adapter.attention(testing.PROMPTS, reference=True, inputs=True, padding_side="left")[1]
    assert [spec.postrope for spec in adapter.specs] == [False, False]
    norm = adapter.query_norm(1)
    assert norm is not None and torch.equal(
        norm.weight, model.blocks[1].attn.original_component.query_layernorm.weight.float()
    )
    positions = adapter.positions(la.allowed.any(1))
    scored = adapter.rotation(1).rotate(adapter.unrotated_queries(1, la.reference["x"]), positions)
    assert (scored - la.q)[la.query_valid].abs().max() <= EXACT_TOL


@pytest.mark.skipif(compat.tl_major_version() >= 4, reason="the 3.x bridge's order")
def test_transformer_lens_3_normalises_before_rotary():
    """The host fact the adapter relies on: 3.x's hook_q_normed is N(hook_q), before rotary."""
    model = _split_gains(boot_tiny(NAME))
    seen = {}
    names = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_q_normed"]
    hooks = [(n, lambda t, hook, n=n: seen.__setitem__(n, t.detach())) for n in names]
    with torch.no_grad():
        model.run_with_hooks(model.to_tokens(testing.PROMPTS[0]), fwd_hooks=hooks)
    norm = model.blocks[0].attn.original_component.query_layernorm
    with torch.no_grad():
        expected = norm(seen[names[0]].transpose(1, 2))
    assert (expected - seen[names[1]]).abs().max() <= EXACT_TOL
