"""A TransformerLens checkpoint folder keeps every field of its config, or refuses it by name
(issue 47 item 7; ``tl_dynamics/_tl_checkpoint.py``).

The cases (tests/data/tl_config_cases.*, built by scripts/tl_config_cases.py with TransformerLens
3.x) are small ``HookedTransformer`` models, every parameter random, each setting fields that
change the forward pass: attention direction, rotary width, base and pair layout,
``d_vocab_out``, the attention scale, both soft-caps, local windows, parallel blocks, grouped
keys, gated MLPs, norms. Their logits come from TransformerLens's own model built from the same
config. Each loads through ``load_model(folder)`` and gives the same logits to 1e-5, or is
refused with the field's name. On TransformerLens 3.x the truth is also rebuilt live.

Before (TransformerLens 4.x): the loader kept ``TransformerBridgeConfig``'s dataclass fields
only; "bidirectional" loaded causal (logits off by 2.8), the soft-caps, the attention scale,
windows, parallel blocks and ``scale_attn_by_inverse_layer_idx`` were dropped without a word
(0.6 to 2.8 off), ``d_vocab_out`` failed with a raw size mismatch and every rotary checkpoint
with a raw converter error.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tl_dynamics import compat, load_model
from tl_dynamics._tl_checkpoint import NATIVE
from tl_dynamics.errors import TLDynamicsError

DATA = Path(__file__).parent / "data" / "tl_config_cases"
CONFIGS: dict[str, dict] = json.loads(DATA.with_suffix(".json").read_text())
HOOKED = compat.has_hooked_transformer()
TOL = 1e-5
# TransformerLens 4.x's native model does not implement these: refused by the field's name
REFUSED_ON_4 = {
    "unscaled": "use_attn_scale",
    "window": "window_size",
    "parallel": "parallel_attn_mlp",
    "layer_idx_scale": "scale_attn_by_inverse_layer_idx",
    "post_embedding_ln": "post_embedding_ln",
    "shortformer": "positional_embedding_type",
    "qk_norm": "use_qk_norm",
}


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return load_file(str(DATA.with_suffix(".safetensors")))


def _state(tensors: dict, case: str) -> dict[str, torch.Tensor]:
    prefix = case + "/"
    return {
        k[len(prefix) :]: v
        for k, v in tensors.items()
        if k.startswith(prefix) and k != prefix + "logits"
    }


def _folder(tmp_path: Path, config: dict, state: dict) -> Path:
    folder = tmp_path / "checkpoint"
    folder.mkdir(exist_ok=True)
    (folder / "tl_config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"))
    return folder


def _changed(case: str) -> dict:
    """The fields this case sets apart from the base case."""
    base = CONFIGS["base"]
    return {k: v for k, v in CONFIGS[case].items() if base.get(k) != v and k != "model_name"}


def test_the_cases_cover_every_forward_field_the_issue_names():
    changed = set().union(*(_changed(c) for c in CONFIGS))
    need = {
        "attention_dir", "positional_embedding_type", "rotary_dim", "rotary_base",
        "rotary_adjacent_pairs", "d_vocab_out", "attn_scale", "use_attn_scale",
        "attn_scores_soft_cap", "output_logits_soft_cap", "window_size", "use_local_attn",
        "attn_types", "parallel_attn_mlp", "n_key_value_heads", "gated_mlp", "final_rms",
        "normalization_type", "act_fn", "scale_attn_by_inverse_layer_idx", "post_embedding_ln",
        "use_qk_norm", "attn_only",
    }  # fmt: skip
    assert need <= changed, need - changed
    assert set(REFUSED_ON_4) <= set(CONFIGS)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_every_field_is_kept_or_refused_by_name(tmp_path, tensors, case):
    folder = _folder(tmp_path, CONFIGS[case], _state(tensors, case))
    if not HOOKED and case in REFUSED_ON_4:
        with pytest.raises(TLDynamicsError, match=REFUSED_ON_4[case]):
            load_model(folder, device="cpu")
        return
    model = load_model(folder, device="cpu")
    with torch.no_grad():
        logits = model(tensors["tokens"])
    want = tensors[f"{case}/logits"]
    assert logits.shape == want.shape
    err = (logits - want).abs().max().item()
    assert err <= TOL, (case, err)
    for name, value in _changed(case).items():  # the fields are the model's own
        if HOOKED or name in NATIVE:
            assert getattr(model.cfg, name) == value, (case, name, getattr(model.cfg, name))


@pytest.mark.skipif(not HOOKED, reason="HookedTransformer exists on TransformerLens 3.x only")
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_the_stored_truth_is_transformer_lens_own_model(tensors, case):
    """The logits stored for TransformerLens 4.x are what ``HookedTransformer`` gives now."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    config = {k: v for k, v in CONFIGS[case].items() if k != "dtype"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = HookedTransformer(HookedTransformerConfig(**config), move_to_device=False)
    model.load_state_dict(_state(tensors, case), strict=False)
    with torch.no_grad():
        logits = model.eval()(tensors["tokens"])
    assert torch.equal(logits, tensors[f"{case}/logits"]), case


@pytest.mark.parametrize(
    "change, field",
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"n_devices": 2}, "n_devices"),
        ({"rmsnorm_uses_offset": True}, "rmsnorm_uses_offset"),
    ],
)
def test_fields_no_host_can_honour_are_refused_by_name(tmp_path, tensors, change, field):
    folder = _folder(tmp_path, {**CONFIGS["base"], **change}, _state(tensors, "base"))
    with pytest.raises(TLDynamicsError, match=field):
        load_model(folder, device="cpu")


def test_weights_whose_rotary_tables_contradict_the_config_are_refused(tmp_path, tensors):
    """The stored tables were made with base 500,000; a config saying 10,000 does not describe
    them (a ``HookedTransformer`` would run with the stored tables and report the other base)."""
    config = {**CONFIGS["rotary_partial_base"], "rotary_base": 10000}
    folder = _folder(tmp_path, config, _state(tensors, "rotary_partial_base"))
    with pytest.raises(TLDynamicsError, match="rotary_base=10000"):
        load_model(folder, device="cpu")


@pytest.mark.skipif(HOOKED, reason="the native model of TransformerLens 4.x only")
def test_a_gated_mlp_with_biases_is_refused_on_the_native_model(tmp_path, tensors):
    state = _state(tensors, "llama_like")
    state["blocks.0.mlp.b_in"] = torch.ones_like(state["blocks.0.mlp.b_in"])
    with pytest.raises(TLDynamicsError, match="gated_mlp"):
        load_model(_folder(tmp_path, CONFIGS["llama_like"], state), device="cpu")
