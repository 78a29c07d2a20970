"""QK attribution on QK-norm layers (docs/math.md §10.2): a q/k norm before rotary is frozen per
position and head at the pass's own scale, so the per-component queries and keys still sum to the
scored ones, and the scores they make reproduce the model's own and its Hugging Face twin's."""

from __future__ import annotations

import pytest
import torch
from helpers import HAS_HOOKED
from test_architectures import boot_tiny

from tl_dynamics import qk_attribution, testing
from tl_dynamics.adapter import ModelAdapter, ResidualSplit
from tl_dynamics.compat import tl_major_version

RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
PROMPTS = ["def f(x): return x + 1", "a b c a b c"]
# the q/k norm of each: per head RMS (Qwen3, Qwen3-MoE, HookedTransformer use_qk_norm), per head
# LayerNorm with a gain per head (StableLM, Cohere), RMS over all heads together (OLMoE)
QK_NORM = ["stablelm-qk-layernorm", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"]
if HAS_HOOKED:
    QK_NORM.append("qk-norm")
if tl_major_version() >= 4:  # the 3.9 bridge's Cohere rotary is refused by the adapter itself
    QK_NORM.append("CohereForCausalLM")


def qk_norm_model(name: str, dtype: torch.dtype = torch.float32):
    """A fresh tiny model whose every norm gain (input and q/k norms) and shift is random, so a
    misread gain, head order or centring shows (the tiny models' are 1 and 0)."""
    if name.endswith("ForCausalLM"):
        model = boot_tiny(name, **({"use_qk_norm": True} if name.startswith("Cohere") else {}))
    else:
        model = testing.tiny_model(name)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            per_head = p.ndim == 2 and ("q_norm" in pname or "k_norm" in pname)  # Cohere
            if per_head or (p.ndim == 1 and any(k in pname for k in ("ln", "norm"))):
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen))
    return model.to(dtype)


def part_scores(adapter: ModelAdapter, batch) -> tuple[torch.Tensor, ResidualSplit]:
    """Every head's scores of layer 1 ``[batch, head, pos, pos]`` from the summed parts."""
    split = ResidualSplit(adapter, 1)
    res = split.run(batch)
    heads = list(range(adapter.n_heads))
    q, k = split.queries(res, heads).sum(0), split.keys(res, heads).sum(0)
    la = adapter.attention(batch, layers=1)[1]
    bias = la.bias()
    raw = la.scale * torch.einsum("bihd,bjhd->bhij", q, k)
    return raw if bias is None else raw + bias, split


@pytest.mark.parametrize("name", QK_NORM)
def test_qk_norm_parts_reproduce_the_models_scores(name):
    model = qk_norm_model(name)
    adapter = ModelAdapter(model)
    batch = adapter.tokenize(PROMPTS)
    raw, split = part_scores(adapter, batch)
    assert split.query_norm is not None and split.key_norm is not None
    gains = split.query_norm.weight + split.query_norm.offset
    assert float((gains - 1).abs().max()) > 0.1  # the random gains reached the read norm
    la = adapter.attention(batch, layers=1)[1]
    allowed = (la.allowed & la.query_valid[..., None])[:, None].expand_as(raw)  # real rows
    ref = la.raw_scores()
    assert float((raw - ref)[allowed].abs().max() / ref[allowed].abs().max()) < RTOL[torch.float32]
    got = qk_attribution.compute(adapter, PROMPTS, layers=1)
    worst = max(max(e.values()) for e in got.errors.values())
    assert worst < RTOL[torch.float32], got.errors
    if adapter.info.host != "bridge":
        return
    # against the Hugging Face model itself: the parts' scores give its attention weights
    mask = batch.key_valid.long()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        hf = testing.hf_twin(model)(
            batch.tokens, attention_mask=mask, position_ids=positions, output_attentions=True
        )
    pattern = raw.masked_fill(~la.allowed[:, None], float("-inf")).softmax(-1)
    rows = la.query_valid[:, None, :, None].expand_as(pattern)
    assert float((pattern - hf.attentions[1].float())[rows].abs().max()) < 1e-5


@pytest.mark.parametrize("name", ["Qwen3ForCausalLM", "stablelm-qk-layernorm"])
def test_qk_norm_split_holds_in_bfloat16(name):
    adapter = ModelAdapter(qk_norm_model(name, torch.bfloat16))
    got = qk_attribution.compute(adapter, PROMPTS, layers=1, heads=[0, 3])
    assert max(max(e.values()) for e in got.errors.values()) < RTOL[torch.bfloat16], got.errors
    p = qk_attribution.pair(adapter, "a b c a b", 1, 3, dest=4, src=2)
    assert abs(p.matrix.sum() + p.position - p.raw) < RTOL[torch.bfloat16] * max(1.0, abs(p.raw))


def test_a_wrong_frozen_key_norm_is_caught_by_the_sum_check():
    """The key norm's gain matters: with it misread (every gain 1), the key parts no longer sum
    to the scored keys and the pass is refused, never returned."""
    import dataclasses

    adapter = ModelAdapter(qk_norm_model("Qwen3ForCausalLM"))
    split = ResidualSplit(adapter, 1)
    norm = split.key_norm
    assert norm is not None
    split.key_norm = dataclasses.replace(norm, weight=torch.ones_like(norm.weight))
    res = split.run(PROMPTS)
    la = adapter.attention(PROMPTS, layers=1)[1]
    k = split.keys(res, [0])[..., 0, :].sum(0)
    err = float((k - la.k[:, :, 0])[res.valid].abs().max() / la.k[:, :, 0][res.valid].abs().max())
    assert err > 1e-2
